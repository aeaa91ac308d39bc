//! The slot: the right for one upstream connection to exist.
//!
//! There are exactly `max_connections` slots per upstream (and `max_tunnels` tunnel slots beside them). A slot is
//! taken before a connection is dialled and moves into the connection's wire until the socket is fully closed;
//! dropping it is the only way to give it back, and giving it back hands it straight to the first waiter if there
//! is one. Nothing else in the crate counts connections, so no code path has to remember to release. A
//! connection's slot that was used to dial also names the endpoint it dialled (chosen under the pool's lock, within
//! that endpoint's own cap), so the same drop gives back the endpoint's count too; a tunnel's is counted only
//! against `max_tunnels`.

use std::sync::Arc;

use super::slots::{ClosingMark, Issued};
use super::{Back, UpstreamPool};

/// The right to own one upstream connection. Dropping it frees the right (or passes it to a waiter).
#[must_use = "dropping a slot frees it at once"]
pub struct Slot {
    pool: Arc<UpstreamPool>,
    /// The endpoint whose count this slot raised when it was used to dial; `None` until then.
    pub(super) endpoint: Option<usize>,
    /// Its connection's mark among those closing, once it has one.
    closing: Option<ClosingMark>,
    /// A tunnel's socket, counted under `max_tunnels` rather than `max_connections`.
    pub(super) tunnel: bool,
}

impl Slot {
    /// Only the pool makes slots, from a count [`super::slots::Slots`] has just raised.
    pub(super) fn issued(pool: Arc<UpstreamPool>, _count: Issued) -> Slot {
        Slot {
            pool,
            endpoint: None,
            closing: None,
            tunnel: false,
        }
    }

    /// A slot issued by the tunnels' count.
    pub(super) fn for_tunnel(mut self) -> Slot {
        self.tunnel = true;
        self
    }

    /// A slot issued at `endpoint`, already counted there.
    pub(super) fn dialling(mut self, endpoint: usize) -> Slot {
        self.endpoint = Some(endpoint);
        self
    }

    pub(super) fn pool(&self) -> &Arc<UpstreamPool> {
        &self.pool
    }

    /// The slot now stands for a connection whose closing is counted by `mark`: the slot's return ends that.
    pub(super) fn connected(&mut self, mark: ClosingMark) {
        self.closing = Some(mark);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.came_back(Back::Slot {
            endpoint: self.endpoint,
            closing: self.closing.take(),
            tunnel: self.tunnel,
        });
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slot")
    }
}
