//! The bounded pool of one upstream: its slots, its idle connections and the queue that waits for either.
//!
//! Owns the one invariant: at most `max_connections` TCP connections to the upstream exist at any instant,
//! counting ones being dialled, busy, idle and still closing. The count is the number of live [`Slot`]s; a slot is
//! issued only under the pool's lock while fewer than `max_connections` exist, and freed only when the connection's
//! socket is closed. A request is admitted by being granted either an idle connection or a slot to dial with;
//! idle connections and freed slots go to the oldest waiter first, so the queue is FIFO. This module never builds
//! requests or answers: that is `forward`'s job.
//!
//! An upstream may have several endpoints (instances of one service), each with its own cap. A slot stays the
//! upstream-wide right; the endpoint is chosen under the lock when the slot is used to dial (one with room under
//! its own cap, not ejected, fewest failed dials in a row, fewest requests in flight, fewest connections), and the
//! slot carries it until it is freed, which lowers that endpoint's count in the same step as the pool's. The cap
//! in force is the lower of the configured one and the sum of the caps of the endpoints not ejected (of all of
//! them when every one is), so no slot is issued that no endpoint could take: each endpoint's count stays within
//! its cap, and the pool's within the upstream's. Consecutive failed dials eject an endpoint for a backoff that
//! doubles with each repeated ejection; ejections begin and end like a lowered and a raised cap.
//!
//! The cap can change while the pool runs (a reload, the admin API). Raising it issues the new slots to waiters at
//! once; lowering it closes surplus idle connections at once, closes busy ones as they finish instead of reusing
//! them, and issues no slot while more connections exist than the new cap. A retired pool (its upstream removed
//! or replaced) serves what it already admitted and closes each connection as it comes free.
//!
//! With an adaptive limit (`adaptive`) a second bound sits beside the cap, on leases rather than connections: no
//! new request is granted a lease (an idle connection or a slot) while as many leases as the limit are out, so a
//! request above it waits in the queue like any other. Lowering it closes nothing: a connection whose lease ends
//! above the limit goes idle instead of to a waiter. Raising it serves waiters at once. Retries of admitted
//! requests are bound by the cap only: their own lease has just ended, so they add nothing to what was in flight.

mod adaptive;
mod connection;
#[cfg(test)]
mod endpoint_properties;
mod health;
mod lease;
#[cfg(test)]
mod properties;
mod slot;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption, Guard};
use http::HeaderValue;
use tokio::time::Instant;

pub use adaptive::{AdaptiveLimit, AdaptiveSnapshot};
pub use connection::{Conn, UpstreamSender};
pub use lease::{Lease, UploadProgress};
pub use slot::Slot;

use crate::admission::{Now, Patience, Place, Shed, Ticket, WaitQueue, Waiter};
use crate::config::{Origin, UpstreamConfig};
use crate::error::ShedAdvice;
use crate::metrics::UpstreamMetrics;
use crate::tls::UpstreamTls;
use crate::upstream_lane::Spawner;

const CLOSING_NOT_COUNTED: u8 = 0;
const CLOSING_COUNTED: u8 = 1;
const CLOSING_DONE: u8 = 2;

/// What an admitted request is handed: a connection ready for reuse, or the right to dial a new one.
pub enum Grant {
    Idle(Conn),
    Dial(Slot),
}

/// Why a request left the queue without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Shed(Shed),
    ClientGone,
}

struct IdleConn {
    conn: Conn,
    since: Instant,
}

struct PoolState {
    /// Live slots: connections dialling, busy, idle or closing.
    open: usize,
    /// Connections on their way out that still hold their slot: each will free it soon. Every close the pool
    /// starts is counted (see [`count_closing`]): `open - closing` is what a changed cap is held against.
    closing: usize,
    /// The cap in force: the configured one, or less while endpoints are ejected (see [`PoolState::effective_cap`]).
    max_connections: usize,
    /// The configured cap; a reload or the admin API changes it.
    configured: usize,
    /// Per endpoint, in the order of [`UpstreamPool::endpoints`].
    endpoints: Vec<EndpointState>,
    /// The upstream was removed or replaced: no connection is kept once it comes free.
    retired: bool,
    /// Leases granted and not yet ended, grants on their way to a waiter included: what the adaptive limit bounds.
    leased: usize,
    /// The adaptive limit in force; `usize::MAX` without one.
    limit: usize,
    /// Most recently used at the back; the front is the first to expire.
    idle: VecDeque<IdleConn>,
    queue: WaitQueue<Grant>,
}

/// What the pool knows of one endpoint; only under the pool's lock.
struct EndpointState {
    /// Its own cap; `usize::MAX` for the one endpoint of an upstream given by `url` (the upstream's cap bounds it).
    cap: usize,
    /// Connections to it, from the moment a slot chose it to dial until their sockets are closed.
    open: usize,
    /// Dials that failed in a row.
    failures: u32,
    /// Ejections without a successful dial between them: the next one lasts `eject_backoff` x 2^this.
    ejections: u32,
    ejected: bool,
    /// Back from an ejection: the next failed dial ejects it again at once.
    probation: bool,
    /// Counts ejections, so that the timer of one that a health check already ended does not end a later one.
    generation: u64,
    /// A health check of it is under way.
    checking: bool,
}

/// One endpoint in a [`PoolSnapshot`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointSnapshot {
    pub address: String,
    /// Its own cap; `None` for an upstream given by one `url` (the upstream's cap is its bound).
    pub max_connections: Option<usize>,
    pub connections_open: usize,
    /// Its connections that are not idle: dialling, busy or closing.
    pub in_flight: usize,
    pub ejected: bool,
    pub failed_dials: u32,
}

/// A snapshot for `/status` and the gauges.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PoolSnapshot {
    pub address: String,
    pub max_connections: usize,
    pub max_queue: usize,
    /// The bound on requests in flight in force: the adaptive limit, or `max_connections` without one.
    pub limit: usize,
    /// The adaptive limit's estimate and inputs, when it is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<AdaptiveSnapshot>,
    pub in_use: usize,
    pub connections_open: usize,
    pub connections_idle: usize,
    pub connections_peak: usize,
    pub connections_opened_total: u64,
    pub queue_depth: usize,
    pub queue_peak: usize,
    pub requests_total: u64,
    /// Removed or replaced by a reload, finishing what it had admitted.
    pub draining: bool,
    pub endpoints: Vec<EndpointSnapshot>,
}

/// One upstream's pool, admission queue and counters.
pub struct UpstreamPool {
    pub name: Arc<str>,
    /// The first endpoint's origin: the scheme every endpoint shares, and the default Host header.
    pub origin: Origin,
    /// Every endpoint with its own cap, as configured; a changed list makes a new pool.
    endpoints: Vec<(Origin, usize)>,
    /// Host header for requests that arrived without one (HTTP/1.0).
    pub authority: HeaderValue,
    /// Everything but the cap is read from here at the moment it applies; the cap lives under the lock.
    limits: ArcSwap<UpstreamConfig>,
    pub metrics: UpstreamMetrics,
    /// The TLS client of an `https://` upstream: every dial runs its handshake before the connection is used.
    /// Replaced by a reload, which reads the certificates again; connections made before keep their session.
    tls: ArcSwapOption<UpstreamTls>,
    state: Mutex<PoolState>,
    in_use: AtomicUsize,
    connections_peak: AtomicUsize,
    queue_peak: AtomicUsize,
    requests_total: AtomicU64,
    /// Moving average of how long an admitted request holds its slot, in microseconds (0: none seen yet).
    hold_us: AtomicU64,
    adaptive: adaptive::Adaptive,
    /// Where the pool's tasks run (its connections, their closing, its timers): the upstream lane when floodgate
    /// builds it, else the runtime it was built in.
    spawner: Spawner,
}

impl UpstreamPool {
    /// `tls` is [`crate::tls::upstream_client`]'s, built for this origin (`None` for `http://`).
    pub fn new(
        name: &str,
        origin: Origin,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        Self::with_endpoints(name, vec![(origin, usize::MAX)], limits, tls, metrics)
    }

    /// A pool over several endpoints, each with its own cap (see [`UpstreamConfig::endpoint_list`]); they share
    /// `tls` and the first one's origin is the pool's. An empty list is one endpoint nobody can dial.
    pub fn with_endpoints(
        name: &str,
        endpoints: Vec<(Origin, usize)>,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        Self::with_endpoints_on(name, endpoints, limits, tls, metrics, Spawner::current())
    }

    /// [`Self::with_endpoints`], its tasks run by `spawner` (floodgate's upstream lane).
    pub fn with_endpoints_on(
        name: &str,
        endpoints: Vec<(Origin, usize)>,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
        spawner: Spawner,
    ) -> Arc<Self> {
        let origin = endpoints.first().map_or_else(
            || Origin {
                scheme: crate::config::Scheme::Http,
                host: "0.0.0.0".into(),
                port: 9,
            },
            |(origin, _)| origin.clone(),
        );
        let endpoint_states: Vec<EndpointState> = endpoints
            .iter()
            .map(|(_, cap)| EndpointState {
                cap: *cap,
                open: 0,
                failures: 0,
                ejections: 0,
                ejected: false,
                probation: false,
                generation: 0,
                checking: false,
            })
            .collect();
        let authority =
            HeaderValue::from_str(&origin.authority()).unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let adaptive = adaptive::Adaptive::new(adaptive::Params::of(&limits));
        let pool = Arc::new(UpstreamPool {
            name: Arc::from(name),
            authority,
            state: Mutex::new(PoolState {
                open: 0,
                closing: 0,
                max_connections: 0,
                configured: limits.max_connections,
                endpoints: endpoint_states,
                retired: false,
                leased: 0,
                limit: adaptive.in_force(),
                idle: VecDeque::new(),
                queue: WaitQueue::new(limits.queue_policy()),
            }),
            origin,
            endpoints,
            limits: ArcSwap::from_pointee(limits),
            metrics,
            tls: ArcSwapOption::new(tls.map(Arc::new)),
            in_use: AtomicUsize::new(0),
            connections_peak: AtomicUsize::new(0),
            queue_peak: AtomicUsize::new(0),
            requests_total: AtomicU64::new(0),
            hold_us: AtomicU64::new(0),
            adaptive,
            spawner,
        });
        {
            let mut state = pool.lock();
            state.max_connections = state.effective_cap();
        }
        pool.spawn(expire_idle(Arc::downgrade(&pool)));
        if pool.endpoints.len() > 1 {
            pool.spawn(health::run(Arc::downgrade(&pool)));
        }
        pool
    }

    /// Runs `task` where the pool's connections run, whichever task the caller is on.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.spawner.spawn(task);
    }

    /// The endpoints with their own caps, as configured.
    pub fn endpoints(&self) -> &[(Origin, usize)] {
        &self.endpoints
    }

    /// The limits in force (timeouts, queue bounds, connection lifetime); cheap enough for every request.
    pub fn limits(&self) -> Guard<Arc<UpstreamConfig>> {
        self.limits.load()
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the counts half-updated (each update is one statement),
        // so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

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
            drop(state);
            return Ok(Admitted::Now(Lease::new(self.clone(), grant)));
        }
        let now = Instant::now();
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
            if state.open < state.max_connections {
                let slot = self.issue_slot(&mut state);
                state.leased += 1;
                drop(state);
                return Ok(Lease::new(self.clone(), Grant::Dial(slot)));
            }
            // A connection on its way out will free a slot soon; only without one is an idle one evicted.
            let evicted = if state.closing == 0 {
                state.idle.pop_front()
            } else {
                None
            };
            if let Some(idle) = &evicted {
                count_closing(&mut state, &idle.conn);
            }
            let ticket = state.queue.join(true, Instant::now(), None).map_err(Refused::Shed)?;
            self.queue_peak.fetch_max(state.queue.len(), Ordering::Relaxed);
            (ticket, evicted)
        };
        // Dropped outside the lock; its task frees the slot once the upstream has closed too.
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
    fn take_now(self: &Arc<Self>, state: &mut PoolState, priority: bool) -> Option<Grant> {
        if !priority && !state.under_limit(false) {
            return None;
        }
        let grant = self.take_idle(state).or_else(|| {
            let ahead = if priority {
                state.queue.has_retries()
            } else {
                !state.queue.is_empty()
            };
            (state.open < state.max_connections && !ahead).then(|| Grant::Dial(self.issue_slot(state)))
        })?;
        state.leased += 1;
        Some(grant)
    }

    /// The most recent idle connection that is still usable; the unusable ones met on the way are closed. With
    /// several endpoints, the most recent one to the endpoint with the fewest requests in flight (not ejected
    /// first), all idle connections looked at.
    fn take_idle(&self, state: &mut PoolState) -> Option<Grant> {
        let limits = self.limits();
        if state.endpoints.len() > 1 {
            for idle in std::mem::take(&mut state.idle) {
                if idle.conn.is_usable(&limits) {
                    state.idle.push_back(idle);
                } else {
                    count_closing(state, &idle.conn);
                }
            }
            let busy = state.busy();
            let rank = |endpoint: usize| {
                let ejected = state.endpoints.get(endpoint).is_some_and(|e| e.ejected);
                (ejected, busy.get(endpoint).copied().unwrap_or(usize::MAX))
            };
            let best = state
                .idle
                .iter()
                .enumerate()
                .rev()
                .min_by_key(|(_, idle)| rank(idle.conn.endpoint))
                .map(|(at, _)| at)?;
            return state.idle.remove(best).map(|idle| Grant::Idle(idle.conn));
        }
        while let Some(idle) = state.idle.pop_back() {
            if idle.conn.is_usable(&limits) {
                return Some(Grant::Idle(idle.conn));
            }
            // Dropping the sender lets the connection's task close it and free its slot.
            count_closing(state, &idle.conn);
        }
        None
    }

    /// A lease ended with a connection that may be reused: the oldest waiter gets it (and the lease's place under
    /// the adaptive limit), else it goes idle. At or above the adaptive limit only a retry may have it. Above a
    /// lowered cap, or in a retired pool with nobody waiting, it is closed instead.
    pub(crate) fn put_idle(self: &Arc<Self>, conn: Conn) {
        self.return_idle(conn, true);
    }

    /// [`Self::put_idle`]; `counted`: the connection comes from a lease (false: from a health check).
    fn return_idle(self: &Arc<Self>, conn: Conn, counted: bool) {
        self.hand_on(Grant::Idle(conn), counted, |state, grant| match grant {
            Grant::Idle(conn) if state.retired || state.live_over_cap() => {
                count_closing(state, &conn);
                Some(Grant::Idle(conn))
            }
            Grant::Idle(conn) => {
                state.idle.push_back(IdleConn {
                    conn,
                    since: Instant::now(),
                });
                None
            }
            other => Some(other),
        });
    }

    /// A slot was dropped: hand the right on to the oldest waiter, or lower the count. The endpoint it dialled,
    /// if any, loses the connection in the same step.
    fn slot_freed(pool: &Arc<Self>, endpoint: Option<usize>) {
        Self::hand_on_slot(pool, |state| state.endpoint_closed(endpoint));
    }

    /// A connection's socket is closed: its slot is freed and the connection stops counting as closing in one
    /// step under the lock. Done in two, someone in between would count it as live (no longer closing, slot still
    /// held) or miss it (slot freed, still closing) and keep or close the wrong connection under a lowered cap.
    pub(super) fn connection_closed(slot: Slot, closing: &AtomicU8) {
        let endpoint = slot.endpoint;
        let Some(pool) = slot.into_count() else { return };
        Self::hand_on_slot(&pool, |state| {
            if closing.swap(CLOSING_DONE, Ordering::AcqRel) == CLOSING_COUNTED {
                state.closing = state.closing.saturating_sub(1);
            }
            state.endpoint_closed(endpoint);
        });
    }

    /// Hands a freed right on, or lowers the count; `first` runs under the lock before anything else.
    fn hand_on_slot(pool: &Arc<Self>, first: impl FnOnce(&mut PoolState)) {
        pool.hand_on_after(Grant::Dial(Slot::issued(pool.clone())), false, first, |state, grant| {
            if let Grant::Dial(slot) = grant {
                state.open = state.open.saturating_sub(1);
                slot.into_count();
                return None;
            }
            Some(grant)
        });
    }

    /// Offers `grant` to the oldest waiter, then the next, until one takes it (a waiter that already left gives
    /// it back). With nobody waiting, or when handing it on would keep more connections than the cap in force,
    /// `keep` deals with it under the same lock, so a waiter arriving meanwhile cannot be passed over and a cap
    /// lowered meanwhile cannot be missed; anything `keep` hands back is dropped after the lock is released.
    /// `counted`: the grant is an ending lease's, already among the leases the adaptive limit counts; handed on,
    /// the waiter takes its place, kept, it leaves the count. An uncounted grant handed on joins the count.
    fn hand_on(self: &Arc<Self>, grant: Grant, counted: bool, keep: impl Fn(&mut PoolState, Grant) -> Option<Grant>) {
        self.hand_on_after(grant, counted, |_| {}, keep);
    }

    /// [`Self::hand_on`], with `first` run under the lock before the grant is looked at.
    fn hand_on_after(
        self: &Arc<Self>,
        mut grant: Grant,
        mut counted: bool,
        first: impl FnOnce(&mut PoolState),
        keep: impl Fn(&mut PoolState, Grant) -> Option<Grant>,
    ) {
        let mut first = Some(first);
        loop {
            let waiter = {
                let mut state = self.lock();
                if let Some(first) = first.take() {
                    first(&mut state);
                }
                let over_cap = match &grant {
                    Grant::Idle(_) => state.live_over_cap(),
                    // The freed right's connection is gone: handing it on would make one more.
                    Grant::Dial(_) => state.open > state.max_connections,
                };
                let next = if over_cap {
                    None
                } else if state.under_limit(counted) {
                    state.queue.next(Now::default())
                } else {
                    state.queue.next_retry(Now::default())
                };
                match next {
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
                        let leftover = keep(&mut state, grant);
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

    /// Raises the count and issues the slot that stands for it; only under the lock, with room under the cap.
    fn issue_slot(self: &Arc<Self>, state: &mut PoolState) -> Slot {
        state.open += 1;
        self.connections_peak.fetch_max(state.open, Ordering::Relaxed);
        Slot::issued(self.clone())
    }

    /// Chooses the endpoint `slot` dials, under the lock, and counts the connection there: one with room under its
    /// own cap; among those, not ejected, then the fewest failed dials in a row, the fewest requests in flight,
    /// the fewest connections. An ejected endpoint only when no other has room. `None`: none has room, which
    /// cannot happen while the slot is counted (the pool's count never exceeds the sum of the endpoints' caps, and
    /// this slot is in the one but not yet in the other), and is a failed dial rather than a panic all the same.
    pub(super) fn choose_endpoint(&self, slot: &mut Slot) -> Option<usize> {
        if slot.endpoint.is_some() {
            return slot.endpoint;
        }
        let mut state = self.lock();
        let busy = state.busy();
        let chosen = state
            .endpoints
            .iter()
            .enumerate()
            .filter(|(_, endpoint)| endpoint.open < endpoint.cap)
            .min_by_key(|(at, endpoint)| {
                let in_flight = busy.get(*at).copied().unwrap_or(usize::MAX);
                (endpoint.ejected, endpoint.failures, in_flight, endpoint.open)
            })
            .map(|(at, _)| at)?;
        let endpoint = state.endpoints.get_mut(chosen)?;
        endpoint.open += 1;
        slot.endpoint = Some(chosen);
        Some(chosen)
    }

    /// The outcome of a dial to `endpoint`. A success ends its run of failures (and of ejections); a failure that
    /// makes `eject_after` in a row (or the first after an ejection) ejects it, if the upstream has other
    /// endpoints, for `eject_backoff` doubled per ejection in a row, at most `eject_backoff_max`.
    pub(super) fn dialled(self: &Arc<Self>, endpoint: usize, succeeded: bool) {
        let limits = self.limits();
        let mut state = self.lock();
        let several = state.endpoints.len() > 1;
        let Some(health) = state.endpoints.get_mut(endpoint) else {
            return;
        };
        if succeeded {
            health.failures = 0;
            health.ejections = 0;
            health.probation = false;
            return;
        }
        health.failures = health.failures.saturating_add(1);
        let due = limits.eject_after > 0 && (health.failures >= limits.eject_after || health.probation);
        if !several || health.ejected || !due {
            return;
        }
        health.ejected = true;
        health.probation = false;
        health.generation = health.generation.wrapping_add(1);
        let generation = health.generation;
        let backoff = limits
            .eject_backoff
            .saturating_mul(1u32 << health.ejections.min(16))
            .min(limits.eject_backoff_max);
        health.ejections = health.ejections.saturating_add(1);
        let address = self
            .endpoints
            .get(endpoint)
            .map(|(origin, _)| origin.authority())
            .unwrap_or_default();
        tracing::warn!(upstream = %self.name, endpoint = %address, ?backoff, "endpoint ejected after failed dials");
        self.metrics.endpoint_ejected(&address);
        // The end is fixed now, not when the task first runs.
        self.spawn(end_ejection(
            Arc::downgrade(self),
            endpoint,
            generation,
            Instant::now() + backoff,
        ));
        self.apply_cap(state);
    }

    /// What a health check of `endpoint` may use, with nobody waiting and no check of it under way: the most
    /// recent usable idle connection to it, else a free slot if the endpoint has room under its own cap (issued
    /// and counted at the endpoint like a dial's). `None`: the check is skipped this round.
    pub(super) fn check_grant(self: &Arc<Self>, endpoint: usize) -> Option<Grant> {
        let mut state = self.lock();
        let checking = state.endpoints.get(endpoint).is_none_or(|health| health.checking);
        if state.retired || !state.queue.is_empty() || checking {
            return None;
        }
        let limits = self.limits();
        let idle = state
            .idle
            .iter()
            .rposition(|idle| idle.conn.endpoint == endpoint && idle.conn.is_usable(&limits));
        if let Some(idle) = idle.and_then(|at| state.idle.remove(at)) {
            if let Some(health) = state.endpoints.get_mut(endpoint) {
                health.checking = true;
            }
            return Some(Grant::Idle(idle.conn));
        }
        if state.open >= state.max_connections {
            return None;
        }
        let health = state.endpoints.get_mut(endpoint)?;
        if health.open >= health.cap {
            return None;
        }
        health.open += 1;
        health.checking = true;
        let mut slot = self.issue_slot(&mut state);
        slot.endpoint = Some(endpoint);
        Some(Grant::Dial(slot))
    }

    /// A health check is done with a connection that may be reused: to the oldest waiter, else idle.
    pub(super) fn return_checked(self: &Arc<Self>, conn: Conn) {
        self.return_idle(conn, false);
    }

    /// The outcome of a health check of `endpoint`: `None` says nothing (a reused connection failed: it may just
    /// have been closed while idle); a failure counts as a failed dial; a success ends the run of failures, and an
    /// ejection at once (the endpoint has just answered).
    pub(super) fn health_checked(self: &Arc<Self>, endpoint: usize, healthy: Option<bool>) {
        let mut state = self.lock();
        let Some(health) = state.endpoints.get_mut(endpoint) else {
            return;
        };
        health.checking = false;
        let Some(healthy) = healthy else { return };
        if !healthy {
            drop(state);
            self.dialled(endpoint, false);
            return;
        }
        health.failures = 0;
        health.ejections = 0;
        health.probation = false;
        if health.ejected {
            health.ejected = false;
            health.generation = health.generation.wrapping_add(1);
            self.apply_cap(state);
        }
    }

    /// Closes a connection made for a health check: counted as closing until its task frees the slot.
    pub(super) fn close_checked(&self, conn: Conn) {
        let mut state = self.lock();
        count_closing(&mut state, &conn);
        drop(state);
        conn.close_now();
    }

    /// Whether the pool was retired by a reload.
    pub(super) fn is_retired(&self) -> bool {
        self.lock().retired
    }

    /// Puts the cap the configured one and the endpoints' health allow in force, as a changed cap is: raised, its
    /// new slots go to the oldest waiters at once; lowered, surplus idle connections close now (oldest first) and
    /// busy ones as they come free.
    fn apply_cap<'a>(self: &'a Arc<Self>, mut state: MutexGuard<'a, PoolState>) {
        let cap = state.effective_cap();
        let raised = cap > state.max_connections;
        state.max_connections = cap;
        let mut evicted = Vec::new();
        while state.live_over_cap() {
            let Some(idle) = state.idle.pop_front() else { break };
            count_closing(&mut state, &idle.conn);
            evicted.push(idle);
        }
        if raised {
            self.admit_admissible(state);
        } else {
            drop(state);
        }
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(evicted);
    }

    /// A grant that reached a waiter which had just given up goes back where it came from; it leaves the lease
    /// count as it goes.
    fn give_back(self: &Arc<Self>, grant: Grant) {
        match grant {
            Grant::Idle(conn) => self.put_idle(conn),
            Grant::Dial(slot) => {
                let mut state = self.lock();
                state.leased = state.leased.saturating_sub(1);
                drop(state);
                drop(slot);
            }
        }
    }

    /// A lease ended without a connection to hand on: `closing`, if any, was given up on by the exchange (its
    /// task is told to close it now, or once the upstream has closed its side when the exchange was abandoned
    /// mid-way, and it counts as closing until that task has freed its slot; the
    /// connection's state moves under the pool's lock on both sides, so a task that finished first is never
    /// counted). The lease leaves the count, which may let a waiter the adaptive limit held back in.
    pub(crate) fn lease_released(self: &Arc<Self>, closing: Option<(&Conn, bool)>) {
        let mut state = self.lock();
        if let Some((conn, abandoned)) = closing {
            if abandoned {
                conn.close_when_upstream_done();
            } else {
                conn.close_now();
            }
            count_closing(&mut state, conn);
        }
        state.leased = state.leased.saturating_sub(1);
        self.admit_admissible(state);
    }

    /// Grants, one at a time, whatever the rules allow to waiters now: each retry a free slot, then each other
    /// waiter, while under the adaptive limit, an idle connection or a free slot. Only waiters the adaptive limit
    /// held back, or that a raised cap or limit makes room for, can be served here; without either nothing is.
    fn admit_admissible<'a>(self: &'a Arc<Self>, mut state: MutexGuard<'a, PoolState>) {
        loop {
            let Some((waiter, grant)) = self.next_admissible(&mut state) else {
                return;
            };
            drop(state);
            if let Err(grant) = waiter.grant(grant) {
                self.give_back(grant);
            }
            state = self.lock();
        }
    }

    fn next_admissible(self: &Arc<Self>, state: &mut PoolState) -> Option<(Waiter<Grant>, Grant)> {
        if state.queue.has_retries() && state.open < state.max_connections {
            if let Some(retry) = state.queue.next_retry(Now::default()) {
                state.leased += 1;
                return Some((retry, Grant::Dial(self.issue_slot(state))));
            }
        }
        // A retry made to wait for a fresh connection must not be handed a long-idle one: idle connections go to
        // the other waiters only.
        if !state.queue.has_waiting() || !state.under_limit(false) || state.live_over_cap() {
            return None;
        }
        let idle = self.take_idle(state);
        if idle.is_none() && state.open >= state.max_connections {
            return None;
        }
        let Some(waiter) = state.queue.next_waiting(Now::default()) else {
            // Every one of them was shed on the way (deadline, CoDel): the connection goes back as it was.
            if let Some(Grant::Idle(conn)) = idle {
                state.idle.push_back(IdleConn {
                    conn,
                    since: Instant::now(),
                });
            }
            return None;
        };
        state.leased += 1;
        let grant = idle.unwrap_or_else(|| Grant::Dial(self.issue_slot(state)));
        Some((waiter, grant))
    }

    /// Puts a new adaptive limit in force; raised, it serves the waiters it makes room for at once. Lowered, it
    /// closes nothing: leases end as they do, and their connections go idle until the count is below it.
    fn set_adaptive_limit(self: &Arc<Self>, limit: usize) {
        let mut state = self.lock();
        let raised = limit > state.limit;
        state.limit = limit;
        if raised {
            self.admit_admissible(state);
        }
    }

    /// Leases counted against the adaptive limit (grants on their way to a waiter included).
    #[cfg(test)]
    fn leased(&self) -> usize {
        self.lock().leased
    }

    /// Requests holding a lease now.
    pub fn in_flight(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// A response head arrived `took` after its request was dispatched with `in_flight` requests in flight: the
    /// response-time histogram's, the drain pace's and the adaptive limit's input. Lock-free unless it closes the
    /// limit's window.
    pub fn responded(self: &Arc<Self>, in_flight: usize, took: Duration) {
        self.metrics.responded(took);
        self.paced(took);
        self.adaptive
            .observe(in_flight, took, |limit| self.set_adaptive_limit(limit));
    }

    pub(crate) fn lease_started(&self) {
        self.in_use.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn lease_ended(&self) {
        self.in_use.fetch_sub(1, Ordering::Relaxed);
    }

    /// The pace at which the queue drains, from the upstream's response times: for the small and buffered
    /// responses that dominate, the time to the response head is most of the time a request holds its slot, and
    /// it is measured anyway (no clock read of its own on the request path). An average over roughly the last
    /// eight; a lost update between two racing responses only makes the estimate a little older.
    fn paced(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let old = self.hold_us.load(Ordering::Relaxed);
        let new = if old == 0 { sample } else { old - old / 8 + sample / 8 };
        self.hold_us.store(new.max(1), Ordering::Relaxed);
    }

    /// What a shed answer tells its client: the configured status, and when to come back: the time the queue
    /// ahead of it, plus itself, takes to drain at the recent pace (`cap` requests at a time, each holding its slot
    /// for the recent average), in whole seconds from 1 to 60.
    pub fn shed_advice(&self) -> ShedAdvice {
        let (queued, cap) = {
            let state = self.lock();
            (state.queue.len(), state.max_connections.min(state.limit).max(1))
        };
        let hold = Duration::from_micros(self.hold_us.load(Ordering::Relaxed));
        let drain = hold.mul_f64((queued + 1) as f64 / cap as f64);
        let retry_after_secs = drain.as_secs_f64().ceil().clamp(1.0, 60.0) as u64;
        let limits = self.limits();
        let status = http::StatusCode::from_u16(limits.shed_status).unwrap_or(http::StatusCode::SERVICE_UNAVAILABLE);
        let quota_status =
            http::StatusCode::from_u16(limits.quota_status).unwrap_or(http::StatusCode::TOO_MANY_REQUESTS);
        ShedAdvice {
            status,
            quota_status,
            retry_after_secs,
        }
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        let adaptive = self.adaptive.snapshot();
        let (open, idle, queue_depth, max_connections, limit, draining, endpoints) = {
            let state = self.lock();
            let idle = state.idle.iter().filter(|i| !i.conn.is_closed()).count();
            let busy = state.busy();
            let endpoints = self
                .endpoints
                .iter()
                .zip(&state.endpoints)
                .zip(busy)
                .map(|(((origin, _), endpoint), in_flight)| EndpointSnapshot {
                    address: origin.authority(),
                    max_connections: (endpoint.cap != usize::MAX).then_some(endpoint.cap),
                    connections_open: endpoint.open,
                    in_flight,
                    ejected: endpoint.ejected,
                    failed_dials: endpoint.failures,
                })
                .collect();
            (
                state.open,
                idle,
                state.queue.len(),
                state.max_connections,
                state.limit.min(state.max_connections),
                state.retired,
                endpoints,
            )
        };
        PoolSnapshot {
            address: self.origin.authority(),
            max_connections,
            max_queue: self.limits().max_queue,
            limit,
            adaptive,
            in_use: self.in_use.load(Ordering::Relaxed),
            connections_open: open,
            connections_idle: idle,
            connections_peak: self.connections_peak.load(Ordering::Relaxed),
            connections_opened_total: self.metrics.opened.get(),
            queue_depth,
            queue_peak: self.queue_peak.load(Ordering::Relaxed),
            requests_total: self.requests_total.load(Ordering::Relaxed),
            draining,
            endpoints,
        }
    }

    /// A reload: new limits (see [`Self::set_limits`]) and the TLS client built from the reloaded files. When the
    /// TLS settings changed, idle connections made under the old ones are closed; busy ones finish.
    pub fn reconfigure(self: &Arc<Self>, limits: UpstreamConfig, tls: Option<UpstreamTls>) {
        let old = self.limits();
        let tls_changed = (
            &old.tls_ca,
            &old.tls_client_cert,
            &old.tls_client_key,
            &old.tls_server_name,
        ) != (
            &limits.tls_ca,
            &limits.tls_client_cert,
            &limits.tls_client_key,
            &limits.tls_server_name,
        );
        self.tls.store(tls.map(Arc::new));
        self.set_limits(limits);
        if tls_changed {
            self.close_idle();
        }
    }

    /// Puts new limits in force. A raised cap issues its new slots to waiters now; a lowered one closes surplus
    /// idle connections now (oldest first) and the surplus busy ones as they finish (see `hand_on`).
    /// Requests already queued keep their place under a lowered `max_queue`; `queue_timeout` applies to
    /// arrivals from now on.
    pub fn set_limits(self: &Arc<Self>, limits: UpstreamConfig) {
        self.change_limits(|_| limits);
    }

    /// Changes only the cap (the admin API's `PUT /upstreams/{name}/max_connections`).
    pub fn set_max_connections(self: &Arc<Self>, max_connections: usize) {
        self.change_limits(|current| UpstreamConfig {
            max_connections,
            ..current.clone()
        });
    }

    /// Reads, changes and stores the limits under the pool's lock, so a reload and an admin call that race
    /// cannot leave the cap in force and the stored limits disagreeing. The adaptive limit then takes its
    /// settings from the limits stored by then (turned on, it starts from `min_connections`; turned off, nothing
    /// but the cap bounds the leases, and waiters it held back are served at once).
    fn change_limits(self: &Arc<Self>, change: impl FnOnce(&UpstreamConfig) -> UpstreamConfig) {
        let (raised, surplus_idle) = {
            let mut state = self.lock();
            let limits = change(&self.limits());
            state.configured = limits.max_connections;
            let cap = state.effective_cap();
            let raised = cap > state.max_connections;
            state.max_connections = cap;
            state.queue.set_policy(limits.queue_policy());
            self.limits.store(Arc::new(limits));
            // Counted one by one: an idle entry whose connection is already gone (the upstream closed it) holds no
            // slot, is not counted, and must not stand in for a live surplus one.
            let mut evicted = Vec::new();
            while state.live_over_cap() {
                let Some(idle) = state.idle.pop_front() else { break };
                count_closing(&mut state, &idle.conn);
                evicted.push(idle);
            }
            (raised, evicted)
        };
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(surplus_idle);
        // The estimate's lock before the pool's, as when a window closes.
        let params = adaptive::Params::of(&self.limits());
        self.adaptive
            .reconfigure(params, |limit| self.set_adaptive_limit(limit));
        if raised {
            // A raised cap's slots go to the oldest waiters, as freed ones do.
            self.admit_admissible(self.lock());
        }
    }

    /// The upstream was removed or replaced by a reload: requests already admitted or queued are served, idle
    /// connections close now, and every other connection closes as it comes free. The pool goes away with the
    /// last connection's task.
    pub fn retire(&self) {
        let idle = {
            let mut state = self.lock();
            state.retired = true;
            let idle = std::mem::take(&mut state.idle);
            for idle in &idle {
                count_closing(&mut state, &idle.conn);
            }
            idle
        };
        drop(idle);
    }

    /// Whether the pool is retired and has nothing left: no connection, no waiter.
    pub fn drained(&self) -> bool {
        let state = self.lock();
        state.retired && state.open == 0 && state.queue.is_empty()
    }

    /// Closes every idle connection (shutdown): their tasks free the slots once the upstream has closed too.
    pub fn close_idle(&self) {
        let idle = {
            let mut state = self.lock();
            let idle = std::mem::take(&mut state.idle);
            for idle in &idle {
                count_closing(&mut state, &idle.conn);
            }
            idle
        };
        drop(idle);
    }
}

impl PoolState {
    /// Whether one more lease is within the adaptive limit; `counted`: the lease to be granted is an ending one's,
    /// already counted.
    fn under_limit(&self, counted: bool) -> bool {
        self.leased.saturating_sub(usize::from(counted)) < self.limit
    }

    /// More live connections, not counting those already on their way out, than the cap in force.
    fn live_over_cap(&self) -> bool {
        self.open.saturating_sub(self.closing) > self.max_connections
    }

    /// The cap that may be in force: the configured one, and no more than the endpoints not ejected can take
    /// between them (all endpoints' caps when every one is ejected: trying them beats shedding everything).
    fn effective_cap(&self) -> usize {
        let room = |ejected_too: bool| {
            self.endpoints
                .iter()
                .filter(|endpoint| ejected_too || !endpoint.ejected)
                .fold(0usize, |sum, endpoint| sum.saturating_add(endpoint.cap))
        };
        let healthy = room(false);
        let room = if healthy == 0 { room(true) } else { healthy };
        self.configured.min(room)
    }

    /// Per endpoint, its connections that are not idle: the requests in flight there (and dials, closes).
    fn busy(&self) -> Vec<usize> {
        let mut busy: Vec<usize> = self.endpoints.iter().map(|endpoint| endpoint.open).collect();
        for idle in &self.idle {
            if let Some(count) = busy.get_mut(idle.conn.endpoint) {
                *count = count.saturating_sub(1);
            }
        }
        busy
    }

    /// A slot that dialled `endpoint` is freed: its socket is closed (or was never connected).
    fn endpoint_closed(&mut self, endpoint: Option<usize>) {
        if let Some(endpoint) = endpoint.and_then(|at| self.endpoints.get_mut(at)) {
            endpoint.open = endpoint.open.saturating_sub(1);
        }
    }
}

/// Counts `conn` as closing until its task frees its slot (see [`UpstreamPool::connection_closed`]); only under the
/// pool's lock, and only once per connection. A connection whose task has already freed its slot is not counted,
/// so this is safe to call for any connection the pool drops. Uncounted, a connection on its way out would pass
/// for a live one, and a lowered cap would close connections it should keep.
fn count_closing(state: &mut PoolState, conn: &Conn) {
    let counted = conn.closing.compare_exchange(
        CLOSING_NOT_COUNTED,
        CLOSING_COUNTED,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
    if counted.is_ok() {
        state.closing += 1;
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

impl Queued {
    pub fn pool(&self) -> &Arc<UpstreamPool> {
        &self.pool
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
                self.pool.give_back(grant);
            }
        }
    }
}

/// Ends an ejection after its backoff: the endpoint may be chosen again (on probation: one more failed dial
/// ejects it again at once, for twice as long), and the cap rises with it.
async fn end_ejection(pool: Weak<UpstreamPool>, endpoint: usize, generation: u64, at: Instant) {
    tokio::time::sleep_until(at).await;
    let Some(pool) = pool.upgrade() else { return };
    let mut state = pool.lock();
    if let Some(health) = state.endpoints.get_mut(endpoint) {
        if !health.ejected || health.generation != generation {
            // A health check ended this ejection already.
            return;
        }
        health.ejected = false;
        health.failures = 0;
        health.probation = true;
    }
    pool.apply_cap(state);
}

/// Closes idle connections past `idle_timeout`, past their lifetime, or closed by the upstream meanwhile. Wakes
/// when the oldest idle connection is due, and at least once a second for the other two cases.
async fn expire_idle(pool: Weak<UpstreamPool>) {
    loop {
        let next_due = {
            let Some(pool) = pool.upgrade() else { return };
            let now = Instant::now();
            let limits = pool.limits();
            let idle_timeout = limits.idle_timeout;
            let mut state = pool.lock();
            // Dropping a sender under the lock is cheap and never calls back into the pool: the connection's
            // own task closes the socket and frees the slot.
            for idle in std::mem::take(&mut state.idle) {
                if idle.since + idle_timeout > now && idle.conn.is_usable(&limits) {
                    state.idle.push_back(idle);
                } else {
                    count_closing(&mut state, &idle.conn);
                }
            }
            let fallback = now + idle_timeout.min(Duration::from_secs(1));
            state
                .idle
                .front()
                .map_or(fallback, |oldest| (oldest.since + idle_timeout).min(fallback))
        };
        tokio::time::sleep_until(next_due).await;
    }
}

#[cfg(test)]
mod tests {
    //! The slot and queue rules without a network: no lease here ever dials, so every grant is a slot.

    use std::future::pending;

    use tokio::sync::oneshot;
    use tokio::time::{advance, Instant as TokioInstant};

    use super::*;
    use crate::config::Scheme;
    use crate::metrics::Metrics;

    fn pool(max_connections: usize, max_queue: usize) -> Arc<UpstreamPool> {
        let limits = UpstreamConfig {
            url: "127.0.0.1:9".into(),
            max_connections,
            max_queue,
            queue_timeout: Duration::from_secs(5),
            ..UpstreamConfig::default()
        };
        let origin = Origin {
            scheme: Scheme::Http,
            host: "127.0.0.1".into(),
            port: 9,
        };
        UpstreamPool::new("test", origin, limits, None, Metrics::new().upstream("test"))
    }

    fn far() -> TokioInstant {
        TokioInstant::now() + Duration::from_secs(3600)
    }

    /// Lets spawned waiters run until they are parked in the queue.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn slots_past_the_cap_wait_and_are_handed_over_oldest_first() {
        let pool = pool(2, 10);
        let first = pool.admit(false, far(), pending()).await.unwrap();
        let second = pool.admit(false, far(), pending()).await.unwrap();
        let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        for waiter in 0..3 {
            let (pool, order_tx) = (pool.clone(), order_tx.clone());
            tokio::spawn(async move {
                let lease = pool.admit(false, far(), pending()).await;
                let _ = order_tx.send((waiter, lease));
            });
            settle().await;
        }
        assert_eq!(pool.snapshot().queue_depth, 3);
        assert_eq!(pool.snapshot().connections_open, 2);

        drop(first);
        let (who, lease) = order.recv().await.unwrap();
        assert_eq!(who, 0);
        assert_eq!(
            pool.snapshot().connections_open,
            2,
            "a freed slot is handed on, not freed"
        );
        drop(lease);
        let (who, third) = order.recv().await.unwrap();
        assert_eq!(who, 1);
        drop(second);
        let (who, fourth) = order.recv().await.unwrap();
        assert_eq!(who, 2);
        drop((third, fourth));
        let snapshot = pool.snapshot();
        assert_eq!(
            (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
            (0, 0, 0)
        );
        assert_eq!(snapshot.connections_peak, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_sheds_at_once_and_a_long_wait_sheds_at_the_deadline() {
        let pool = pool(1, 1);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let deadline = TokioInstant::now() + Duration::from_millis(250);
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.admit(false, deadline, pending()).await.map(|_| ()) })
        };
        settle().await;
        let full = pool.admit(false, far(), pending()).await.map(|_| ());
        assert_eq!(full, Err(Refused::Shed(Shed::QueueFull)));
        advance(Duration::from_millis(300)).await;
        assert_eq!(waiter.await.unwrap(), Err(Refused::Shed(Shed::QueueTimeout)));
        assert_eq!(pool.snapshot().queue_depth, 0);
        drop(held);
        assert_eq!(pool.snapshot().connections_open, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_client_leaves_is_gone_from_the_queue_at_once() {
        let pool = pool(1, 10);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let (gone_tx, gone_rx) = oneshot::channel::<()>();
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let gone = async {
                    let _ = gone_rx.await;
                };
                pool.admit(false, far(), gone).await.map(|_| ())
            })
        };
        settle().await;
        assert_eq!(pool.snapshot().queue_depth, 1);
        drop(gone_tx);
        assert_eq!(waiter.await.unwrap(), Err(Refused::ClientGone));
        assert_eq!(pool.snapshot().queue_depth, 0);
        drop(held);
        assert_eq!(
            pool.snapshot().connections_open,
            0,
            "the slot was not handed to the departed waiter"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_waiter_gives_back_a_grant_that_raced_with_its_departure() {
        let pool = pool(1, 10);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let mut waiting = Box::pin(pool.admit(false, far(), pending()));
        assert!(futures_poll_once(waiting.as_mut()).await.is_none());
        // The slot is handed to the waiter's channel, but the waiter is dropped before it looks.
        drop(held);
        drop(waiting);
        assert_eq!(pool.snapshot().connections_open, 0);
        assert_eq!(pool.snapshot().in_use, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_goes_before_earlier_waiters() {
        let pool = pool(1, 10);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        for (who, priority) in [("plain", false), ("retry", true)] {
            let (pool, order_tx) = (pool.clone(), order_tx.clone());
            tokio::spawn(async move {
                let lease = pool.admit(priority, far(), pending()).await;
                let _ = order_tx.send((who, lease));
            });
            settle().await;
        }
        drop(held);
        assert_eq!(order.recv().await.map(|(who, _)| who), Some("retry"));
        assert_eq!(order.recv().await.map(|(who, _)| who), Some("plain"));
    }

    #[tokio::test(start_paused = true)]
    async fn random_interleavings_never_exceed_the_cap_or_lose_a_waiter() {
        // A small deterministic generator, so a failure replays the same interleaving.
        let mut seed: u64 = 0x5eed_f100_d6a7;
        let mut next = move |bound: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % bound
        };
        let pool = pool(3, 1000);
        // Counted independently of the pool's own bookkeeping.
        let held = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let mut tasks = Vec::new();
        for _ in 0..200 {
            let hold = Duration::from_millis(next(20));
            let patience = Duration::from_millis(next(200));
            let leave_after = Duration::from_millis(next(400));
            let start_after = Duration::from_millis(next(300));
            let (pool, held) = (pool.clone(), held.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(start_after).await;
                let gone = tokio::time::sleep(leave_after);
                let deadline = TokioInstant::now() + patience;
                match pool.admit(false, deadline, gone).await {
                    Ok(lease) => {
                        let now = held.0.fetch_add(1, Ordering::SeqCst) + 1;
                        held.1.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(hold).await;
                        held.0.fetch_sub(1, Ordering::SeqCst);
                        drop(lease);
                        "served"
                    }
                    Err(Refused::Shed(_)) => "shed",
                    Err(Refused::ClientGone) => "gone",
                }
            }));
        }
        let mut outcomes = std::collections::BTreeMap::new();
        for task in tasks {
            *outcomes.entry(task.await.unwrap()).or_insert(0) += 1;
        }
        let snapshot = pool.snapshot();
        let peak_held = held.1.load(Ordering::SeqCst);
        assert!(peak_held <= 3, "{peak_held} leases at once; outcomes {outcomes:?}");
        assert!(
            snapshot.connections_peak <= 3,
            "peak {} with outcomes {outcomes:?}",
            snapshot.connections_peak
        );
        assert_eq!(
            (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
            (0, 0, 0)
        );
        assert_eq!(outcomes.values().sum::<i32>(), 200);
        assert!(outcomes.get("served").copied().unwrap_or(0) > 0, "{outcomes:?}");
    }

    /// Queues `waiters` requests in order, each reporting its number and outcome on the returned channel.
    async fn queue_waiters(
        pool: &Arc<UpstreamPool>,
        waiters: usize,
    ) -> tokio::sync::mpsc::UnboundedReceiver<(usize, Result<Lease, Refused>)> {
        let (order_tx, order) = tokio::sync::mpsc::unbounded_channel();
        for waiter in 0..waiters {
            let (pool, order_tx) = (pool.clone(), order_tx.clone());
            tokio::spawn(async move {
                let lease = pool.admit(false, far(), pending()).await;
                let _ = order_tx.send((waiter, lease));
            });
            settle().await;
        }
        order
    }

    #[tokio::test(start_paused = true)]
    async fn a_raised_cap_hands_its_new_slots_to_the_oldest_waiters_at_once() {
        let pool = pool(1, 10);
        let _held = pool.admit(false, far(), pending()).await.unwrap();
        let mut order = queue_waiters(&pool, 3).await;
        assert_eq!(pool.snapshot().queue_depth, 3);

        pool.set_max_connections(3);
        // Before any waiter has run: the slots were handed over by the change itself.
        let snapshot = pool.snapshot();
        assert_eq!((snapshot.connections_open, snapshot.queue_depth), (3, 1));
        settle().await;
        let (first, _first_lease) = order.try_recv().unwrap();
        let (second, _second_lease) = order.try_recv().unwrap();
        assert_eq!((first, second), (0, 1));
        assert!(order.try_recv().is_err(), "the youngest waiter got a slot past the cap");
        assert_eq!(pool.snapshot().max_connections, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn below_a_lowered_cap_freed_slots_go_to_nobody_until_the_count_is_within_it() {
        let pool = pool(3, 10);
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(pool.admit(false, far(), pending()).await.unwrap());
        }
        let mut order = queue_waiters(&pool, 2).await;

        pool.set_max_connections(1);
        for open in [2, 1] {
            drop(held.remove(0));
            settle().await;
            assert!(order.try_recv().is_err(), "a slot was handed on above the cap");
            let snapshot = pool.snapshot();
            assert_eq!((snapshot.connections_open, snapshot.queue_depth), (open, 2));
        }
        // One slot left, and it is within the cap: from here on it goes to the waiters in turn.
        drop(held.remove(0));
        let (who, lease) = order.recv().await.unwrap();
        assert_eq!(who, 0);
        assert_eq!(pool.snapshot().connections_open, 1);
        drop(lease);
        let (who, lease) = order.recv().await.unwrap();
        assert_eq!(who, 1);
        drop(lease);
        let snapshot = pool.snapshot();
        assert_eq!((snapshot.connections_open, snapshot.queue_depth), (0, 0));
        assert_eq!(snapshot.connections_peak, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lowered_max_queue_keeps_the_queued_waiters_and_sheds_new_arrivals() {
        let pool = pool(1, 3);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let mut order = queue_waiters(&pool, 3).await;

        let mut limits = UpstreamConfig::clone(&pool.limits());
        limits.max_queue = 1;
        pool.set_limits(limits);
        assert_eq!(pool.snapshot().queue_depth, 3);
        assert_eq!(pool.snapshot().max_queue, 1);
        let late = pool.admit(false, far(), pending()).await.map(|_| ());
        assert_eq!(late, Err(Refused::Shed(Shed::QueueFull)));

        drop(held);
        for expected in 0..3 {
            let (who, lease) = order.recv().await.unwrap();
            assert_eq!(who, expected);
            assert!(lease.is_ok(), "queued waiter {who} was refused");
        }
        assert_eq!(pool.snapshot().queue_depth, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retired_pool_serves_what_it_queued_and_is_drained_once_all_is_released() {
        let pool = pool(1, 10);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let mut order = queue_waiters(&pool, 1).await;

        pool.retire();
        assert!(pool.snapshot().draining);
        assert!(!pool.drained(), "drained with a slot held and a waiter queued");
        drop(held);
        let (_, lease) = order.recv().await.unwrap();
        let lease = lease.unwrap();
        assert!(!pool.drained(), "drained while a lease is held");
        drop(lease);
        assert!(pool.drained());
        assert_eq!(pool.snapshot().connections_open, 0);
    }

    /// Polls a future once; `Some` if it finished.
    async fn futures_poll_once<F: Future + Unpin>(future: F) -> Option<F::Output> {
        let mut future = future;
        std::future::poll_fn(|cx| match std::pin::Pin::new(&mut future).poll(cx) {
            std::task::Poll::Ready(out) => std::task::Poll::Ready(Some(out)),
            std::task::Poll::Pending => std::task::Poll::Ready(None),
        })
        .await
    }
}
