//! What comes back to the pool, and where it goes: the one way back in ([`UpstreamPool::came_back`]) for ending
//! leases, turned-down grants, health checks' connections and freed slots; the oldest waiter first, else idle or
//! given up under the same lock. It never dials and never decides admission at arrival.

use std::sync::Arc;
use std::sync::MutexGuard;

use tokio::time::Instant;

use super::idle::IdleConn;
use super::slots::ClosingMark;
use super::{Conn, Grant, PoolState, Slot, UpstreamPool};
use crate::admission::{Now, Waiter};

impl UpstreamPool {
    /// The one way back into the pool: whatever an exchange or a health check is done with.
    /// A connection that may carry another request and a freed slot go to the oldest waiter first; what nobody
    /// may have is kept idle or given up, under the same lock, so a waiter arriving meanwhile is not passed over
    /// and a cap lowered meanwhile is not missed.
    pub(super) fn came_back(self: &Arc<Self>, back: Back) {
        // An exchange the upstream answered is progress; one given up on (it may be stuck there) is not.
        if matches!(back, Back::Reusable(_) | Back::Released(Some((_, false)))) {
            self.exchange_finished();
        }
        match back {
            Back::Reusable(conn) | Back::TurnedDown(Grant::Idle(conn)) => self.hand_on(Grant::Idle(conn), true),
            // The slot goes back as a freed one, after its grant has left the count.
            Back::TurnedDown(Grant::Dial(slot)) => {
                let mut state = self.lock();
                state.leased = state.leased.saturating_sub(1);
                drop(state);
                drop(slot);
            }
            Back::Checked(conn) => self.hand_on(Grant::Idle(conn), false),
            Back::Released(mut closing) => {
                let mut state = self.lock();
                if let Some((conn, abandoned)) = &mut closing {
                    if *abandoned {
                        conn.close_when_upstream_done();
                    }
                    state.start_closing(conn);
                }
                state.leased = state.leased.saturating_sub(1);
                self.admit_admissible(state);
                // The connection's handle goes after the lock: its task closes it and gives its slot back.
                drop(closing);
            }
            // An unhealthy answer on a stream says nothing against its session, busy with other streams: the
            // stream comes back once the upstream has read whatever ended it (a check cut short is reset).
            Back::CheckFailed(conn) if conn.session().is_some() && !conn.is_closed() => {
                let pool = self.clone();
                self.spawn(async move {
                    if let Some(session) = conn.session() {
                        session.acknowledged().await;
                    }
                    pool.hand_on(Grant::Idle(conn), false);
                });
            }
            Back::CheckFailed(conn) => {
                let mut state = self.lock();
                state.start_closing(&conn);
                drop(state);
                drop(conn);
            }
            Back::Slot {
                endpoint,
                closing,
                tunnel,
            } => {
                if tunnel {
                    self.tunnel_count.take_back(closing.as_ref());
                }
                let mut state = self.lock();
                if tunnel {
                    state.tunnels_open = state.tunnels_open.saturating_sub(1);
                } else {
                    state.slots.take_back(endpoint, closing.as_ref());
                }
                if state.is_empty() {
                    self.emptied.notify_waiters();
                }
                if tunnel {
                    return;
                }
                // Issued again at once to a waiter the rules let have it (none while above a lowered cap). The
                // slot is issued before a waiter is taken from the queue: another generation of the pool may have
                // taken the room since it was freed, and a waiter taken out with nothing to grant would be lost.
                if let Some(issued) = state.slots.issue() {
                    match state.next_taker(false) {
                        Some(waiter) => {
                            let slot = Slot::issued(self.clone(), issued);
                            state.leased += 1;
                            drop(state);
                            if let Err(grant) = waiter.grant(Grant::Dial(slot)) {
                                self.hand_on(grant, true);
                            }
                            return;
                        }
                        None => state.slots.unissue(issued),
                    }
                }
                // Nobody here could take it: older generations of this upstream's pool (a reload replaced them, and
                // their waiters came first), then the newest, may have waiters the room now lets in.
                let others = state.slots.lineage().others(state.slots.generation());
                drop(state);
                for pool in others {
                    pool.admit_admissible(pool.lock());
                }
            }
        }
    }

    /// Offers `grant` to the oldest waiter the rules let have it, then the next, until one takes it (a waiter that
    /// already left gives it back). With nobody to take it, or when handing it on would keep more connections than
    /// the cap in force, an idle connection is kept idle (closed above the cap or in a retired pool) and a slot is
    /// dropped, after the lock, which gives it back. `counted`: the grant is an ending lease's, already among the
    /// leases; handed on, the waiter takes its place, kept, it leaves the count. An uncounted grant handed on joins
    /// the count.
    pub(super) fn hand_on(self: &Arc<Self>, mut grant: Grant, mut counted: bool) {
        let limits = self.limits();
        loop {
            let waiter = {
                let mut state = self.lock();
                let over_cap = match &grant {
                    // An HTTP/2 stream is not handed on while its session has more at work than it now allows.
                    // Nor a connection to a drained endpoint: it closes as it comes back.
                    Grant::Idle(conn) => {
                        state.slots.live_over_cap()
                            || conn.over_stream_limit(&limits)
                            || state.slots.sheds_at(conn.endpoint)
                    }
                    // The slot's connection is gone: handing it on would make one more.
                    Grant::Dial(_) => state.slots.over_cap(),
                };
                match (!over_cap).then(|| state.next_taker(counted)).flatten() {
                    Some(waiter) => {
                        if !counted {
                            state.leased += 1;
                            counted = true;
                        }
                        waiter
                    }
                    None => {
                        if counted {
                            state.leased = state.leased.saturating_sub(1);
                        }
                        let leftover = state.keep(grant);
                        drop(state);
                        drop(leftover);
                        return;
                    }
                }
            };
            match waiter.grant(grant) {
                Ok(()) => return,
                Err(back) => grant = back,
            }
        }
    }

    /// Issues a slot if the cap in force allows; only under the lock.
    pub(super) fn issue_slot(self: &Arc<Self>, state: &mut PoolState) -> Option<Slot> {
        let issued = state.slots.issue()?;
        Some(Slot::issued(self.clone(), issued))
    }

    /// Grants, one at a time, whatever the rules allow to waiters now: each retry a free slot, then each other
    /// waiter, while under the adaptive limit, an idle connection or a free slot. Only waiters the adaptive limit
    /// held back, or that a raised cap or limit makes room for, can be served here; without either nothing is.
    pub(super) fn admit_admissible<'a>(self: &'a Arc<Self>, mut state: MutexGuard<'a, PoolState>) {
        loop {
            let Some((waiter, grant)) = self.next_admissible(&mut state) else {
                return;
            };
            drop(state);
            if let Err(grant) = waiter.grant(grant) {
                self.came_back(Back::TurnedDown(grant));
            }
            state = self.lock();
        }
    }

    pub(super) fn next_admissible(self: &Arc<Self>, state: &mut PoolState) -> Option<(Waiter<Grant>, Grant)> {
        // A slot is issued before its waiter leaves the queue, so that a waiter is never taken out with nothing to
        // grant (another generation of the pool may take the room first).
        if state.queue.has_retries() && state.slots.has_room() {
            if let Some(issued) = state.slots.issue() {
                match state.queue.next_retry(Now::default()) {
                    Some(retry) => {
                        state.leased += 1;
                        return Some((retry, Grant::Dial(Slot::issued(self.clone(), issued))));
                    }
                    None => state.slots.unissue(issued),
                }
            }
        }
        // A retry made to wait for a fresh connection must not be handed a long-idle one: idle connections go to
        // the other waiters only.
        if !state.queue.has_waiting() || !state.under_limit(false) || state.slots.live_over_cap() {
            return None;
        }
        // An idle connection, else a slot's count; the slot itself is made only once a waiter takes it.
        let ready = match self.take_idle(state) {
            Some(conn) => Ok(conn),
            None => Err(state.slots.issue()?),
        };
        let Some(waiter) = state.queue.next_waiting(Now::default()) else {
            // Every one of them was shed on the way (deadline, CoDel): the connection goes back as it was, the
            // slot is not issued after all.
            match ready {
                Ok(conn) => state.idle.push_back(IdleConn::new(conn, Instant::now())),
                Err(issued) => state.slots.unissue(issued),
            }
            return None;
        };
        let grant = match ready {
            Ok(conn) => Grant::Idle(conn),
            Err(issued) => Grant::Dial(Slot::issued(self.clone(), issued)),
        };
        state.leased += 1;
        Some((waiter, grant))
    }
}

impl PoolState {
    /// Whether one more lease is within the adaptive limit; `counted`: the lease to be granted is an ending one's,
    /// already counted.
    pub(super) fn under_limit(&self, counted: bool) -> bool {
        self.leased.saturating_sub(usize::from(counted)) < self.limit
    }

    /// The oldest waiter a grant coming back may go to: any, within the adaptive limit; past it, only a retry.
    pub(super) fn next_taker(&mut self, counted: bool) -> Option<Waiter<Grant>> {
        if self.under_limit(counted) {
            self.queue.next(Now::default())
        } else {
            self.queue.next_retry(Now::default())
        }
    }

    /// What came back and nobody may have: a connection goes idle (or is closed above the cap and in a retired
    /// pool); what is handed back is to be dropped after the lock, which closes it or gives its slot back.
    pub(super) fn keep(&mut self, grant: Grant) -> Option<Grant> {
        match grant {
            Grant::Idle(conn) if self.retired || self.slots.live_over_cap() || self.slots.sheds_at(conn.endpoint) => {
                self.start_closing(&conn);
                Some(Grant::Idle(conn))
            }
            Grant::Idle(conn) => {
                self.idle.push_back(IdleConn::new(conn, Instant::now()));
                None
            }
            slot => Some(slot),
        }
    }
}

/// What comes back to the pool, through [`UpstreamPool::came_back`].
pub(super) enum Back {
    /// An ending lease's connection, which may carry another request.
    Reusable(Conn),
    /// An ending lease with no connection to hand on: the one it held, if any, is closed now, or once the upstream
    /// has closed its side when the exchange was abandoned mid-way (`true`). The lease leaves the count, which may
    /// let a waiter the adaptive limit held back in.
    Released(Option<(Conn, bool)>),
    /// A grant that reached a waiter which had just given up: it goes back where it came from, and leaves the
    /// lease count as it goes.
    TurnedDown(Grant),
    /// A health check's connection that answered well.
    Checked(Conn),
    /// A health check's connection that did not: closed now.
    CheckFailed(Conn),
    /// A slot: its connection's socket is closed, or it never had one. `endpoint`: the one it dialled;
    /// `closing`: its connection's mark.
    Slot {
        endpoint: Option<usize>,
        closing: Option<ClosingMark>,
        /// A tunnel's: counted under `max_tunnels`, and nobody waits for one.
        tunnel: bool,
    },
}
