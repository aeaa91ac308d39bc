//! The slot: the right for one upstream connection to exist.
//!
//! There are exactly `max_connections` slots per upstream. A slot is taken before a connection is dialled and
//! belongs to that connection's own task until the socket is fully closed; dropping it is the only way to give it
//! back, and giving it back hands it straight to the first waiter if there is one. Nothing else in the crate
//! counts connections, so no code path has to remember to release. A slot that was used to dial also names the
//! endpoint it dialled (chosen under the pool's lock, within that endpoint's own cap), so the same drop gives back
//! the endpoint's count too.

use std::sync::Arc;

use super::UpstreamPool;

/// The right to own one upstream connection. Dropping it frees the right (or passes it to a waiter).
#[must_use = "dropping a slot frees it at once"]
pub struct Slot {
    pool: Option<Arc<UpstreamPool>>,
    /// The endpoint whose count this slot raised when it was used to dial; `None` until then.
    pub(super) endpoint: Option<usize>,
}

impl Slot {
    /// Only the pool makes slots, with its count already raised (or a freed slot being handed on).
    pub(super) fn issued(pool: Arc<UpstreamPool>) -> Slot {
        Slot {
            pool: Some(pool),
            endpoint: None,
        }
    }

    /// Turns the slot back into a bare count, for the pool's bookkeeping while it hands the right on.
    pub(super) fn into_count(mut self) -> Option<Arc<UpstreamPool>> {
        self.pool.take()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            UpstreamPool::slot_freed(&pool, self.endpoint);
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slot")
    }
}
