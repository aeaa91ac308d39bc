//! A timer kept across many waits (a client connection's idle spells, an upstream connection's waits for an
//! answer), moved on only when it fires early: made once, it costs no registration in tokio's timer wheel per wait.
//!
//! It never decides what a deadline means or what happens when one passes; its callers do.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Poll};

use tokio::time::{Instant, Sleep};

/// Completes once `deadline` has passed, whatever `timer` was set for: a later setting is moved to `deadline` at
/// once; an earlier one (a wait since it was set) fires early and is moved on then. Polled by hand: as an `async
/// fn` it cost about 100 instructions a request more (callgrind, the profiling build).
pub(crate) fn until(mut timer: Pin<&mut Sleep>, deadline: Instant) -> impl Future<Output = ()> + '_ {
    if timer.deadline() > deadline {
        timer.as_mut().reset(deadline);
    }
    std::future::poll_fn(move |cx| loop {
        ready!(timer.as_mut().poll(cx));
        if Instant::now() >= deadline {
            return Poll::Ready(());
        }
        timer.as_mut().reset(deadline);
    })
}
