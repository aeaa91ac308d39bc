//! floodgate: any number of clients in, at most N keep-alive connections out per upstream.
//!
//! A reverse proxy for services whose cost follows the concurrency their clients drive at them (a stock Ktor
//! service spends a thread, and its memory, per concurrent connection). floodgate holds a bounded pool of
//! keep-alive connections to each upstream, admits requests through a bounded queue (`admission`: its
//! discipline, client deadlines, fair lanes, priority classes), sheds what cannot be served in time with a status
//! that says why, and shows what it does on an admin listener. [`reload`] puts a new configuration in force
//! without dropping a request.
//!
//! A request's path, one module per step:
//! ```text
//! client ──► server (HTTP/1.1 + h2c, or TLS + ALPN; client deadlines) ──► proxy (the steps, in order)
//!        ──► route (Host / path prefix → upstream) ──► forward (rewrite the head)
//!        ──► buffer (a small request body read in full, so a slow uploader waits without a slot)
//!        ──► pool::admit (idle connection │ free slot under the cap and the adaptive limit │ wait in the
//!            admission queue │ shed 503/429/504)
//!        ──► pool (dial if needed, TLS for https://; never more than max_connections) ──► forward (relay bodies;
//!            a small response read in full at upstream speed, then sent from memory)
//!        ──► end of the response body from the upstream: connection back to idle (or closed), then the slot
//! metrics/admin observe from the side; they are never behind admission.
//! ```
//! A request's end is observed once, by its [`record`]: finished when its answer's body ends or it is abandoned,
//! it counts the outcome and, when that log is on, has [`access`] write its access-log line.
//! The invariant lives in the pool's `Slots` type, the only code that changes the counts behind the cap; a
//! [`pool::Slot`] stands for one count, an upstream connection exists only while it holds one (it has no task of
//! its own: whoever moves its bytes holds its wire), and a slot is given back only once the socket is closed on
//! both sides.

#![forbid(unsafe_code)]
#![warn(unreachable_pub)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)
)]

/// `Box::pin(future)`, with the box allocated before the future is made, so that it is made in the box: `Box::pin`
/// makes it on the stack and copies it in, and the futures a request's path boxes are kilobytes
/// (docs/data-path.md). A macro, not a function: a function's argument is made before its body allocates.
macro_rules! boxed {
    ($future:expr $(,)?) => {{
        let made_in_place = Box::write(Box::new_uninit(), $future);
        Box::into_pin(made_in_place)
    }};
}

pub mod access;
pub(crate) mod activity;
pub(crate) mod admin;
pub(crate) mod admission;
pub mod allocator;
pub(crate) mod body;
pub(crate) mod buffer;
pub mod config;
pub(crate) mod edge;
pub mod error;
pub mod forward;
#[doc(hidden)]
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub(crate) mod h1;
pub(crate) mod kept_timer;
pub mod metrics;
pub(crate) mod net;
pub mod pool;
pub(crate) mod proxy;
pub(crate) mod record;
pub mod reload;
pub(crate) mod route;
pub mod server;
pub(crate) mod state;
pub(crate) mod status;
pub mod tls;
pub(crate) mod trace;
pub(crate) mod tunnel;
pub mod upstream_lane;
