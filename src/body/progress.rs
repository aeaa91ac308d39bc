//! How far a request body has gone upstream: written by the body, read by the exchange that holds the lease.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// How far a request body has gone upstream, written by the body as hyper pulls it and read by the exchange: a
/// connection whose upload is unfinished when the response has ended (the upstream answered early) is closed, not
/// pooled, since hyper is still sending the rest on it; and a `request_timeout` that runs out while the upstream
/// waits on the client is the client's.
/// Only the body writes it, one poll at a time, so plain stores of the one state suffice.
#[derive(Clone, Default)]
pub struct UploadProgress(Arc<AtomicU8>);

const SENDING: u8 = 0;
const AWAITING_CLIENT: u8 = 1;
const SENT: u8 = 2;

impl UploadProgress {
    /// After a poll of the body: still sending, waiting on the client for more, or all sent.
    pub fn polled(&self, waiting_on_client: bool, sent: bool) {
        let state = match (sent, waiting_on_client) {
            (true, _) => SENT,
            (false, true) => AWAITING_CLIENT,
            (false, false) => SENDING,
        };
        self.0.store(state, Ordering::Relaxed);
    }

    pub fn awaiting_client(&self) -> bool {
        self.0.load(Ordering::Relaxed) == AWAITING_CLIENT
    }

    /// All of the body has been handed to the upstream connection.
    pub fn is_sent(&self) -> bool {
        self.0.load(Ordering::Relaxed) == SENT
    }
}
