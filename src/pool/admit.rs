//! Admitting a request: a lease at once (an idle connection or a slot to dial with), a place in the queue to wait
//! on wherever the caller chooses, or a shed. It never hands anything back: that is [`super::handoff`]'s.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use super::{Back, Grant, Lease, PoolState, Refused, UpstreamPool};
use crate::admission::{Patience, Place, Shed, TakeGrant, Ticket};

impl UpstreamPool {
    /// Admits a request: an idle connection or a free slot now, else a place in the queue until one is handed
    /// over, `deadline` passes, or `client_gone` resolves. `priority` is for a retry of an admitted request.
    pub async fn admit(
        self: &Arc<Self>,
        priority: bool,
        deadline: tokio::time::Instant,
        client_gone: impl Future<Output = ()>,
    ) -> Result<Lease, Refused> {
        self.admit_with(priority, Patience::queue(deadline), &Place::default(), client_gone)
            .await
    }

    /// [`Self::admit`] for a request that may carry its client's deadline (one that has passed already is shed
    /// at once, and one that passes while the request waits sheds it then) and waits at its `place`: its priority
    /// class and its client's lane.
    pub async fn admit_with(
        self: &Arc<Self>,
        priority: bool,
        patience: Patience,
        place: &Place,
        client_gone: impl Future<Output = ()>,
    ) -> Result<Lease, Refused> {
        match self.try_admit(priority, patience, place)? {
            Admitted::Now(lease) => Ok(lease),
            Admitted::Queued(queued) => queued.wait(patience, client_gone).await,
        }
    }

    /// Admission's decision, taken at once: a lease now, a place in the queue (to wait on wherever the caller
    /// chooses), or a shed.
    pub fn try_admit(self: &Arc<Self>, priority: bool, patience: Patience, place: &Place) -> Result<Admitted, Refused> {
        if !priority {
            self.requests_total.fetch_add(1, Ordering::Relaxed);
        }
        // The clock is read only when there is a deadline to check or a queue to join: not on the fast path.
        if patience
            .client_deadline
            .is_some_and(|deadline| deadline <= Instant::now())
        {
            return Err(Refused::Shed(Shed::Deadline));
        }
        let mut state = self.lock();
        if let Some(grant) = self.take_now(&mut state, priority) {
            let roomy = state.leased.saturating_mul(2) <= state.slots.cap();
            drop(state);
            let mut lease = Lease::new(self.clone(), grant);
            lease.roomy = roomy;
            return Ok(Admitted::Now(lease));
        }
        let now = Instant::now();
        if self.stalled_at(&state, now) {
            return Err(Refused::Shed(Shed::Stalled));
        }
        let ticket = state
            .queue
            .join_at(priority, now, patience.client_deadline, place)
            .map_err(Refused::Shed)?;
        self.queue_peak.fetch_max(state.queue.len(), Ordering::Relaxed);
        drop(state);
        Ok(Admitted::Queued(Queued {
            pool: self.clone(),
            ticket: Some(ticket),
        }))
    }

    /// Admits a retry that must not meet a long-idle connection again (the last one was closed under it): a free
    /// slot if there is one, else the oldest idle connection is closed to make room and the retry waits at the
    /// front of the queue for that slot, or for a connection that has just finished an exchange.
    pub async fn admit_fresh(self: &Arc<Self>, deadline: tokio::time::Instant) -> Result<Lease, Refused> {
        let (ticket, evicted) = {
            let mut state = self.lock();
            if let Some(slot) = self.issue_slot(&mut state) {
                state.leased += 1;
                drop(state);
                return Ok(Lease::new(self.clone(), Grant::Dial(slot)));
            }
            // A connection on its way out will free a slot soon; only without one is an idle one evicted.
            let evicted = if state.slots.any_closing() {
                None
            } else {
                state.idle.pop_front()
            };
            if let Some(idle) = &evicted {
                state.start_closing(&idle.conn);
            }
            let ticket = state.queue.join(true, Instant::now(), None).map_err(Refused::Shed)?;
            self.queue_peak.fetch_max(state.queue.len(), Ordering::Relaxed);
            (ticket, evicted)
        };
        // Dropped outside the lock; the closing task frees the slot once the upstream has closed too.
        drop(evicted);
        let queued = Queued {
            pool: self.clone(),
            ticket: Some(ticket),
        };
        queued.wait(Patience::queue(deadline), std::future::pending()).await
    }

    /// The fast path, under the lock: reuse the most recent idle connection, else issue a slot if one is free and
    /// nobody waits ahead. A new request takes neither while the adaptive limit's worth of leases are out; a retry
    /// (`priority`) is held back by the cap only, and only retries wait ahead of it.
    pub(super) fn take_now(self: &Arc<Self>, state: &mut PoolState, priority: bool) -> Option<Grant> {
        if !priority && !state.under_limit(false) {
            return None;
        }
        let quiet = state.leased == 0;
        let grant = self.take_idle(state).map(Grant::Idle).or_else(|| {
            let ahead = if priority {
                state.queue.has_retries()
            } else {
                !state.queue.is_empty()
            };
            if ahead {
                return None;
            }
            self.issue_slot(state).map(Grant::Dial)
        })?;
        state.leased += 1;
        // A busy spell after a quiet one: the stall guard measures from its start, not from the last answer.
        if quiet {
            self.exchange_finished();
        }
        Some(grant)
    }
}

/// What admitting a request gave at once.
pub enum Admitted {
    Now(Lease),
    Queued(Queued),
}

/// A request's place in its upstream's queue. Dropped while waiting (timeout, client gone, cancelled), it leaves
/// the queue at once, and a grant that raced with its departure goes back to the pool rather than being lost; so
/// the wait can be given up from anywhere.
#[must_use = "dropping a place in the queue leaves the queue"]
pub struct Queued {
    pool: Arc<UpstreamPool>,
    ticket: Option<Ticket<Grant>>,
}

/// The rest of a queued request's path, run with its lease on the thread that grants it ([`Queued::hand_over_to`]).
pub trait LeaseTaker: Send + Sync {
    /// Takes `lease` (and runs the rest of the request's path with it, typically by spawning it), or gives it back
    /// when the request has gone: it is then granted to the next waiter.
    fn take(&self, lease: Lease) -> Result<(), Lease>;
}

/// A [`LeaseTaker`] as the queue sees it: grants become leases of this pool. It lives in the pool's queue, so it
/// holds the pool weakly.
struct TakenHere {
    pool: std::sync::Weak<UpstreamPool>,
    taker: Arc<dyn LeaseTaker>,
}

impl TakeGrant<Grant> for TakenHere {
    fn take(&self, grant: Grant) -> Result<(), Grant> {
        let Some(pool) = self.pool.upgrade() else {
            return Err(grant);
        };
        let lease = Lease::new(pool, grant);
        match self.taker.take(lease) {
            Ok(()) => Ok(()),
            // Not used: nothing to give back but the grant, which goes to the next waiter.
            Err(lease) => lease.into_grant().map_or(Ok(()), Err),
        }
    }
}

impl Queued {
    pub fn pool(&self) -> &Arc<UpstreamPool> {
        &self.pool
    }

    /// From now on a grant for this request is taken by `taker` where it is made, rather than sent to
    /// [`Queued::wait`] (which then ends with [`Shed::QueueTimeout`] and `taker` holding what the request needs).
    /// A grant made before this is still the wait's. Set at most once; a second taker is ignored.
    pub fn hand_over_to(&self, taker: Arc<dyn LeaseTaker>) {
        if let Some(ticket) = &self.ticket {
            let taken_here = TakenHere {
                pool: Arc::downgrade(&self.pool),
                taker,
            };
            let _ = ticket.taker.set(Box::new(taken_here));
        }
    }

    /// Waits until a grant is handed over, `patience` runs out, or `client_gone` resolves.
    pub async fn wait(mut self, patience: Patience, client_gone: impl Future<Output = ()>) -> Result<Lease, Refused> {
        let answered = async {
            match self.ticket.as_mut() {
                // The sender is only dropped with the pool itself.
                Some(ticket) => (&mut ticket.answer).await.unwrap_or(Err(Shed::QueueTimeout)),
                None => Err(Shed::QueueTimeout),
            }
        };
        let (gives_up, reason) = patience.gives_up();
        let result = tokio::select! {
            biased;
            answer = answered => Ok(answer),
            _ = tokio::time::sleep_until(gives_up) => Err(Refused::Shed(reason)),
            _ = client_gone => Err(Refused::ClientGone),
        };
        match result {
            Ok(answer) => {
                self.ticket = None;
                match answer {
                    Ok(grant) => Ok(Lease::new(self.pool.clone(), grant)),
                    Err(shed) => Err(Refused::Shed(shed)),
                }
            }
            Err(refused) => Err(refused),
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(mut ticket) = self.ticket.take() {
            if self.pool.lock().queue.leave(ticket.id) {
                return;
            }
            // Closing first means a grant is either refused back to its sender or already here to take.
            ticket.answer.close();
            if let Ok(Ok(grant)) = ticket.answer.try_recv() {
                self.pool.came_back(Back::TurnedDown(grant));
            }
        }
    }
}
