//! What both bodies share: a timer that fails a body making no progress, and the error it fails with.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Fails a body that has made no progress for `timeout`; the timer is only armed while the body waits.
pub(crate) struct IdleTimer {
    pub(crate) timeout: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    progressed: bool,
}

impl IdleTimer {
    pub(crate) fn new(timeout: Duration) -> Self {
        IdleTimer {
            timeout,
            sleep: None,
            progressed: true,
        }
    }

    pub(crate) fn progressed(&mut self) {
        self.progressed = true;
    }

    /// Called when the inner body is pending: true once it has been pending for the whole timeout.
    pub(crate) fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = Instant::now() + self.timeout;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if self.progressed {
            sleep.as_mut().reset(deadline);
            self.progressed = false;
        }
        sleep.as_mut().poll(cx).is_ready()
    }
}

/// A body, the client's or the upstream's, sent nothing for its idle timeout.
#[derive(Debug, thiserror::Error)]
#[error("{0} sent nothing for {1:?}")]
pub struct BodyStalled(pub(crate) &'static str, pub(crate) Duration);
