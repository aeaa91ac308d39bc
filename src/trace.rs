//! Traces: each request's span of floodgate's own, exported over OTLP when `otlp_endpoint` is set ([`otlp`]).
//! A build without the `otlp` feature has the same types with no values ([`off`]): its configuration refuses an
//! `otlp_endpoint`, so nothing ever starts one, and a request pays nothing for them.

#[cfg(not(feature = "otlp"))]
mod off;
#[cfg(feature = "otlp")]
mod otlp;

#[cfg(not(feature = "otlp"))]
pub(crate) use off::{Marks, RequestSpan, Tracing};
#[cfg(feature = "otlp")]
pub(crate) use otlp::{Marks, RequestSpan, Tracing};

/// Whether this build can export traces (the `otlp` feature).
pub(crate) const EXPORTER_BUILT: bool = cfg!(feature = "otlp");
