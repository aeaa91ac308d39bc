//! Prewarmed connections (`min_idle`, HikariCP's `minimumIdle`): that many idle connections kept ready per upstream,
//! dialled at start, after a reload and after idle ones close, so the first burst after a quiet spell does not pay
//! the dials (and, at a thread-per-connection upstream, the cold threads). Only within the cap: a prewarm dial takes
//! a free slot like any other, never one a waiter could have, and the idle timeout closes none below the floor.
//! It never serves a request itself: a prewarmed connection joins the pool as a health check's good one does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::handoff::Back;
use super::UpstreamPool;

impl UpstreamPool {
    /// Dials idle connections up to `min_idle`, as far as free slots allow and nobody waits for one.
    pub(super) fn prewarm(self: &Arc<Self>) {
        let floor = self.limits().min_idle;
        if floor == 0 {
            return;
        }
        let mut state = self.lock();
        if state.retired {
            return;
        }
        let mut slots = Vec::new();
        while state.idle_connections().len() + self.prewarming.load(Ordering::Acquire) + slots.len() < floor
            && state.queue.is_empty()
        {
            let Some(slot) = self.issue_slot(&mut state) else { break };
            slots.push(slot);
        }
        drop(state);
        for slot in slots {
            self.prewarming.fetch_add(1, Ordering::AcqRel);
            let pool = self.clone();
            self.spawn(async move {
                let dialled = pool.dial(slot).await;
                pool.prewarming.fetch_sub(1, Ordering::AcqRel);
                match dialled {
                    Ok(conn) => {
                        pool.metrics.prewarmed.inc();
                        pool.came_back(Back::Checked(conn));
                    }
                    Err(err) => tracing::debug!(upstream = %pool.name, error = %err, "a prewarm dial failed"),
                }
            });
        }
    }
}

/// Prewarm dials under way (counted so two calls close together do not both dial the same shortfall).
pub(super) type Prewarming = AtomicUsize;
