//! The stall guard (`stall_timeout`): every slot busy and no exchange finished for that long, the upstream is taken
//! for stalled (a deadlocked server holds its slots forever, and the queue would otherwise make every client wait
//! its whole `queue_timeout` for nothing). Admission then sheds at once and the queue is drained with the same
//! answer, until an exchange finishes. It never touches a connection or the cap; it reads the pool's counts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Weak;
use std::time::Duration;

use tokio::time::Instant;

use super::{PoolState, UpstreamPool};
use crate::admission::Shed;

/// When an exchange last finished, and whether the pool is in a stall now.
pub(super) struct Progress {
    started: Instant,
    /// Microseconds from `started` to the last exchange's end.
    last_finished_us: AtomicU64,
    stalled: AtomicBool,
}

impl Progress {
    pub(super) fn new() -> Progress {
        Progress {
            started: Instant::now(),
            last_finished_us: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
        }
    }

    fn last_finished(&self) -> Instant {
        self.started + Duration::from_micros(self.last_finished_us.load(Ordering::Acquire))
    }

    pub(super) fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }
}

impl UpstreamPool {
    /// An exchange was answered (its lease came back), or a busy spell began: the clock starts again, and a stall
    /// is over.
    pub(super) fn exchange_finished(&self) {
        let since = self
            .progress
            .started
            .elapsed()
            .as_micros()
            .try_into()
            .unwrap_or(u64::MAX);
        self.progress.last_finished_us.fetch_max(since, Ordering::AcqRel);
        if self.progress.stalled.swap(false, Ordering::AcqRel) {
            tracing::info!(upstream = %self.name, "upstream moving again: an exchange finished; admitting");
        }
    }

    /// Whether the upstream counts as stalled at `now`, its slots all taken (the caller knows: admission found
    /// none, or requests wait): the guard is on and no exchange has been answered within `stall_timeout` (since
    /// the last answer, or the start of the busy spell). Given-up exchanges holding slots count as stuck. Said once
    /// per stall, and counted. Only under the lock, with `state`.
    pub(super) fn stalled_at(&self, state: &PoolState, now: Instant) -> bool {
        let limit = self.limits().stall_timeout;
        if limit.is_zero() || now.saturating_duration_since(self.progress.last_finished()) < limit {
            return false;
        }
        if !self.progress.stalled.swap(true, Ordering::AcqRel) {
            self.metrics.stalls.inc();
            tracing::warn!(
                upstream = %self.name,
                in_flight = state.leased,
                stall_timeout = ?limit,
                "upstream stalled: every slot busy and no exchange finished within stall_timeout; shedding until one does"
            );
        }
        true
    }
}

/// Drains the queue of a stalled pool (`Shed::Stalled`) at the moment the stall begins, and again while it lasts;
/// ends with the pool.
pub(super) async fn watch_stalls(pool: Weak<UpstreamPool>) {
    loop {
        let next = {
            let Some(pool) = pool.upgrade() else { return };
            let now = Instant::now();
            let limit = pool.limits().stall_timeout;
            if limit.is_zero() {
                now + Duration::from_secs(1)
            } else {
                let due = pool.progress.last_finished() + limit;
                if now < due {
                    due
                } else {
                    let mut state = pool.lock();
                    if !state.queue.is_empty() && pool.stalled_at(&state, now) {
                        state.queue.shed_all(Shed::Stalled);
                    }
                    drop(state);
                    // Stalled, or only just moving: looked at again soon, new arrivals being shed by admission.
                    now + (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
                }
            }
        };
        tokio::time::sleep_until(next).await;
    }
}
