//! What an HTTP/2 client connection is doing, for its timeouts: serving requests, idle, or in the middle of a
//! header block.
//!
//! Owns two client-side deadlines of hyper's HTTP/2 server: `header_read_timeout` from a header block's first frame
//! to its last (see `h2_frames`), and `client_idle_timeout` while no request is in flight. floodgate's own HTTP/1
//! server keeps its connections' deadlines itself (`server::h1_conn`). It never closes anything itself: it tells
//! the connection's task which deadline passed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

const NO_HEAD: u64 = u64::MAX;

/// A deadline that passed on a client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expired {
    /// Idle between requests for `client_idle_timeout`: close politely.
    Idle,
    /// A header block opened `header_read_timeout` ago and is still open: cut it off.
    HeaderRead,
}

/// Shared by the connection's task, its frame watch and its requests.
pub(crate) struct ClientActivity {
    started: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds since `started`.
    idle_since: AtomicU64,
    /// An HTTP/2 header block left open, since when: it bounds the connection whatever else is in flight.
    block_since: AtomicU64,
    changed: Notify,
}

impl ClientActivity {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ClientActivity {
            started: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            block_since: AtomicU64::new(NO_HEAD),
            changed: Notify::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn at(&self, ms: u64, plus: Duration) -> Instant {
        self.started + Duration::from_millis(ms) + plus
    }

    /// A request was dispatched; the returned guard ends it when the answer is done with.
    pub(crate) fn request_started(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// An HTTP/2 header block opened (a HEADERS frame without END_HEADERS).
    pub(crate) fn header_block_started(&self) {
        if self.block_since.load(Ordering::Acquire) == NO_HEAD {
            self.block_since.store(self.now_ms(), Ordering::Release);
            self.changed.notify_one();
        }
    }

    /// The open HTTP/2 header block ended (a CONTINUATION with END_HEADERS).
    pub(crate) fn header_block_ended(&self) {
        self.block_since.store(NO_HEAD, Ordering::Release);
        self.changed.notify_one();
    }

    /// Resolves when a deadline passes.
    pub(crate) async fn expired(&self, header_read_timeout: Duration, idle_timeout: Duration) -> Expired {
        loop {
            let block = self.block_since.load(Ordering::Acquire);
            let idle = self.in_flight.load(Ordering::Acquire) == 0;
            let block_deadline = (block != NO_HEAD).then(|| self.at(block, header_read_timeout));
            let own_deadline = idle.then(|| {
                (
                    self.at(self.idle_since.load(Ordering::Acquire), idle_timeout),
                    Expired::Idle,
                )
            });
            let next = match (block_deadline, own_deadline) {
                (Some(block), Some((own, _))) if block <= own => Some((block, Expired::HeaderRead)),
                (Some(block), None) => Some((block, Expired::HeaderRead)),
                (_, own) => own,
            };
            let Some((deadline, expiry)) = next else {
                self.changed.notified().await;
                continue;
            };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    let unchanged = self.block_since.load(Ordering::Acquire) == block
                        && (self.in_flight.load(Ordering::Acquire) == 0) == idle;
                    if unchanged {
                        return expiry;
                    }
                }
                _ = self.changed.notified() => {}
            }
        }
    }

    /// Resolves once no request has been in flight for `quiet`: how long a connection closing politely waits for
    /// a peer that does not answer its goodbye.
    pub(crate) async fn quiet_for(&self, quiet: Duration) {
        let from = self.now_ms();
        loop {
            if self.in_flight.load(Ordering::Acquire) > 0 {
                self.changed.notified().await;
                continue;
            }
            let since = self.idle_since.load(Ordering::Acquire).max(from);
            tokio::select! {
                _ = tokio::time::sleep_until(self.at(since, quiet)) => {
                    if self.in_flight.load(Ordering::Acquire) == 0
                        && self.idle_since.load(Ordering::Acquire).max(from) == since
                    {
                        return;
                    }
                }
                _ = self.changed.notified() => {}
            }
        }
    }
}

/// One dispatched request on a client connection; dropping it ends the request.
pub(crate) struct InFlight(Arc<ClientActivity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle_since.store(self.0.now_ms(), Ordering::Release);
            self.0.changed.notify_one();
        }
    }
}
