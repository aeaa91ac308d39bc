//! The request body on its way upstream, and what both directions' bodies share: the timer that fails a body
//! making no progress, and how far an upload has gone. Below both `forward` (which relays bodies) and `pool` (whose
//! connections carry them); it never holds a lease or a connection.

mod client;
mod progress;
mod request;
mod stall;

pub(crate) use client::{discard_received, Reading};
pub(crate) use client::{ClientBody, ClientBodyError, Http1Body};
pub(crate) use progress::UploadProgress;
pub use request::{CutOff, RequestBody, UpstreamRequest};
pub use stall::BodyStalled;
pub(crate) use stall::IdleTimer;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
