//! The idle list: connections kept for reuse, most recent last; taken newest first, expired oldest first, and
//! closed (counted as closing until their slots are back) when they outlive their welcome.

use std::sync::Weak;
use std::time::Duration;

use tokio::time::Instant;

use super::{Conn, PoolState, UpstreamPool};

pub(super) struct IdleConn {
    pub(super) conn: Conn,
    pub(super) since: Instant,
}

impl IdleConn {
    /// `conn` entering the idle list, idle since `since`: its watch starts looking for the upstream closing it.
    pub(super) fn new(mut conn: Conn, since: Instant) -> IdleConn {
        conn.set_idle();
        IdleConn { conn, since }
    }

    /// The connection leaving the idle list to carry a request (its watch gives way at the exchange's first read).
    pub(super) fn into_conn(self) -> Conn {
        let mut conn = self.conn;
        conn.set_busy();
        conn
    }
}

impl UpstreamPool {
    /// The most recent idle connection that is still usable; the unusable ones met on the way are closed. With
    /// several endpoints, the most recent one to the endpoint with the fewest requests in flight (not ejected
    /// first), all idle connections looked at. An HTTP/2 stream whose session has its limit's worth at work stays
    /// idle, passed over.
    pub(super) fn take_idle(&self, state: &mut PoolState) -> Option<Conn> {
        let limits = self.limits();
        if state.endpoints.len() > 1 {
            for idle in std::mem::take(&mut state.idle) {
                if idle.conn.is_usable_idle(&limits) && !state.slots.sheds_at(idle.conn.endpoint) {
                    state.idle.push_back(idle);
                } else {
                    state.start_closing(&idle.conn);
                }
            }
            let busy = state.busy();
            let rank = |endpoint: usize| {
                (
                    state.slots.is_ejected(endpoint),
                    busy.get(endpoint).copied().unwrap_or(usize::MAX),
                )
            };
            let best = state
                .idle
                .iter()
                .enumerate()
                .rev()
                .filter(|(_, idle)| !idle.conn.lacks_room(&limits))
                .min_by_key(|(_, idle)| rank(idle.conn.endpoint))
                .map(|(at, _)| at)?;
            return state.idle.remove(best).map(IdleConn::into_conn);
        }
        let mut passed_over = Vec::new();
        // With several worker threads, a usable connection another thread opened is passed over for one this thread
        // opened (whose exchange then runs here, without waking the other thread); the newest such is the fallback.
        let mut elsewhere_at = None;
        let mut taken = None;
        while let Some(idle) = state.idle.pop_back() {
            if !idle.conn.is_usable_idle(&limits) || state.slots.sheds_at(idle.conn.endpoint) {
                // Dropped (with the idle entry), the connection goes to the pool's closing task, which frees its
                // slot.
                state.start_closing(&idle.conn);
            } else if idle.conn.lacks_room(&limits) {
                passed_over.push(idle);
            } else if idle.conn.home_elsewhere().is_some() {
                elsewhere_at.get_or_insert(passed_over.len());
                passed_over.push(idle);
            } else {
                taken = Some(idle.into_conn());
                break;
            }
        }
        let taken = taken.or_else(|| elsewhere_at.map(|at| passed_over.remove(at).into_conn()));
        // Back where they were, in their order.
        while let Some(idle) = passed_over.pop() {
            state.idle.push_back(idle);
        }
        taken
    }

    /// Closes every idle connection (shutdown): their tasks free the slots once the upstream has closed too.
    /// Closes the idle connections the upstream closed (or spoke on), found by their watches.
    pub(super) fn close_spent_idle(&self) {
        let spent = {
            let mut state = self.lock();
            let mut spent = Vec::new();
            for idle in std::mem::take(&mut state.idle) {
                if idle.conn.is_closed() {
                    state.start_closing(&idle.conn);
                    spent.push(idle);
                } else {
                    state.idle.push_back(idle);
                }
            }
            spent
        };
        drop(spent);
    }

    pub fn close_idle(&self) {
        let idle = {
            let mut state = self.lock();
            let idle = std::mem::take(&mut state.idle);
            for idle in &idle {
                state.start_closing(&idle.conn);
            }
            idle
        };
        drop(idle);
    }
}

impl PoolState {
    /// Idle connections past a lowered cap, oldest first, counted as closing; to be dropped after the lock. Counted
    /// one by one: an idle entry whose connection is already gone (the upstream closed it) holds no slot, is not
    /// counted, and must not stand in for a live surplus one.
    pub(super) fn evict_surplus_idle(&mut self) -> Vec<IdleConn> {
        let mut evicted = Vec::new();
        while self.slots.live_over_cap() {
            let Some(idle) = self.idle.pop_front() else { break };
            self.start_closing(&idle.conn);
            evicted.push(idle);
        }
        evicted
    }
}

/// Closes idle connections past `idle_timeout`, past their lifetime, or closed by the upstream meanwhile. Wakes
/// when the oldest idle connection is due, and at least once a second for the other two cases.
pub(super) async fn expire_idle(pool: Weak<UpstreamPool>) {
    loop {
        let next_due = {
            let Some(pool) = pool.upgrade() else { return };
            let now = Instant::now();
            let limits = pool.limits();
            let idle_timeout = limits.idle_timeout;
            let mut state = pool.lock();
            // `min_idle`: the idle timeout closes none below the floor (the oldest go first).
            let mut may_expire = state.idle_connections().len().saturating_sub(limits.min_idle);
            // Dropping a connection under the lock is cheap and never calls back into the pool: the pool's
            // closing task closes the socket and frees the slot.
            for idle in std::mem::take(&mut state.idle) {
                let fresh = idle
                    .conn
                    .idle_since(idle.since)
                    .is_none_or(|since| since + idle_timeout > now);
                let usable = idle.conn.is_usable_idle(&limits);
                if usable && !fresh && may_expire > 0 {
                    may_expire -= 1;
                    state.start_closing(&idle.conn);
                } else if usable {
                    state.idle.push_back(idle);
                } else {
                    state.start_closing(&idle.conn);
                }
            }
            drop(state);
            // Idle connections closed (by their idleness, the upstream, their age) are made again up to the floor.
            pool.prewarm();
            let state = pool.lock();
            let fallback = now + idle_timeout.min(Duration::from_secs(1));
            // An oldest one already due was kept by `min_idle`'s floor: nothing to wake for before the fallback.
            state.idle.front().map_or(fallback, |oldest| {
                let due = oldest.since + idle_timeout;
                if due <= now {
                    fallback
                } else {
                    due.min(fallback)
                }
            })
        };
        tokio::time::sleep_until(next_due).await;
    }
}
