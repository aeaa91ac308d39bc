//! The bounded pool of one upstream: its slots, its idle connections and the queue that waits for either.
//!
//! Owns the one invariant: at most `max_connections` TCP connections to the upstream exist at any instant,
//! counting ones being dialled, busy, idle and still closing. The count is the number of live [`Slot`]s; a slot is
//! issued only under the pool's lock while fewer than `max_connections` exist, and freed only when the connection's
//! socket is closed. A request is admitted by being granted either an idle connection or a slot to dial with;
//! idle connections and freed slots go to the oldest waiter first, so the queue is FIFO. This module never builds
//! requests or answers: that is `forward`'s job.

mod connection;
mod lease;
mod slot;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use http::HeaderValue;

pub use connection::{Conn, UpstreamSender};
pub use lease::Lease;
pub use slot::Slot;

use crate::admission::{Shed, Ticket, WaitQueue};
use crate::config::{Origin, UpstreamConfig};
use crate::metrics::UpstreamMetrics;

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
    /// Most recently used at the back; the front is the first to expire.
    idle: VecDeque<IdleConn>,
    queue: WaitQueue<Grant>,
}

/// A snapshot for `/status` and the gauges.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PoolSnapshot {
    pub address: String,
    pub max_connections: usize,
    pub max_queue: usize,
    pub in_use: usize,
    pub connections_open: usize,
    pub connections_idle: usize,
    pub connections_peak: usize,
    pub connections_opened_total: u64,
    pub queue_depth: usize,
    pub queue_peak: usize,
    pub requests_total: u64,
}

/// One upstream's pool, admission queue and counters.
pub struct UpstreamPool {
    pub name: Arc<str>,
    pub origin: Origin,
    /// Host header for requests that arrived without one (HTTP/1.0).
    pub authority: HeaderValue,
    pub limits: UpstreamConfig,
    pub metrics: UpstreamMetrics,
    state: Mutex<PoolState>,
    in_use: AtomicUsize,
    connections_peak: AtomicUsize,
    queue_peak: AtomicUsize,
    opened_total: AtomicU64,
    requests_total: AtomicU64,
    next_conn_id: AtomicU64,
}

impl UpstreamPool {
    pub fn new(name: &str, origin: Origin, limits: UpstreamConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        let authority =
            HeaderValue::from_str(&origin.authority()).unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let pool = Arc::new(UpstreamPool {
            name: Arc::from(name),
            authority,
            state: Mutex::new(PoolState {
                open: 0,
                idle: VecDeque::new(),
                queue: WaitQueue::new(limits.max_queue),
            }),
            origin,
            limits,
            metrics,
            in_use: AtomicUsize::new(0),
            connections_peak: AtomicUsize::new(0),
            queue_peak: AtomicUsize::new(0),
            opened_total: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            next_conn_id: AtomicU64::new(0),
        });
        tokio::spawn(expire_idle(Arc::downgrade(&pool)));
        pool
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
        if !priority {
            self.requests_total.fetch_add(1, Ordering::Relaxed);
        }
        let ticket = {
            let mut state = self.lock();
            if let Some(grant) = self.take_now(&mut state) {
                drop(state);
                return Ok(Lease::new(self.clone(), grant));
            }
            let ticket = state.queue.join(priority).map_err(Refused::Shed)?;
            self.queue_peak.fetch_max(state.queue.len(), Ordering::Relaxed);
            ticket
        };
        let mut waiting = Waiting {
            pool: self,
            ticket: Some(ticket),
        };
        let granted = async {
            match waiting.ticket.as_mut() {
                Some(ticket) => (&mut ticket.granted).await.ok(),
                None => None,
            }
        };
        tokio::select! {
            biased;
            grant = granted => match grant {
                Some(grant) => {
                    waiting.ticket = None;
                    Ok(Lease::new(self.clone(), grant))
                }
                // The sender is only dropped with the pool itself.
                None => Err(Refused::Shed(Shed::QueueTimeout)),
            },
            _ = tokio::time::sleep_until(deadline) => Err(Refused::Shed(Shed::QueueTimeout)),
            _ = client_gone => Err(Refused::ClientGone),
        }
    }

    /// The fast path, under the lock: reuse the most recent idle connection, else issue a slot if one is free.
    fn take_now(self: &Arc<Self>, state: &mut PoolState) -> Option<Grant> {
        while let Some(idle) = state.idle.pop_back() {
            if idle.conn.is_usable(&self.limits) {
                return Some(Grant::Idle(idle.conn));
            }
            // Dropping the sender lets the connection's task close it and free its slot.
        }
        if state.open < self.limits.max_connections && state.queue.is_empty() {
            state.open += 1;
            self.connections_peak.fetch_max(state.open, Ordering::Relaxed);
            return Some(Grant::Dial(Slot::issued(self.clone())));
        }
        None
    }

    /// A connection finished an exchange and may be reused: the oldest waiter gets it, else it goes idle.
    pub(crate) fn put_idle(self: &Arc<Self>, mut conn: Conn) {
        loop {
            let waiter = {
                let mut state = self.lock();
                match state.queue.pop_oldest() {
                    Some(waiter) => waiter,
                    None => {
                        state.idle.push_back(IdleConn {
                            conn,
                            since: Instant::now(),
                        });
                        return;
                    }
                }
            };
            match waiter.grant(Grant::Idle(conn)) {
                Ok(()) => return,
                Err(Grant::Idle(back)) => conn = back,
                Err(Grant::Dial(slot)) => return drop(slot),
            }
        }
    }

    /// A slot was dropped: hand the right on to the oldest waiter, or lower the count.
    fn slot_freed(pool: &Arc<Self>) {
        let mut slot = Slot::issued(pool.clone());
        loop {
            let waiter = {
                let mut state = pool.lock();
                match state.queue.pop_oldest() {
                    Some(waiter) => waiter,
                    None => {
                        state.open = state.open.saturating_sub(1);
                        drop(state);
                        slot.into_count();
                        return;
                    }
                }
            };
            match waiter.grant(Grant::Dial(slot)) {
                Ok(()) => return,
                Err(Grant::Dial(back)) => slot = back,
                Err(Grant::Idle(conn)) => return drop(conn),
            }
        }
    }

    /// A grant that reached a waiter which had just given up goes back where it came from.
    fn give_back(self: &Arc<Self>, grant: Grant) {
        match grant {
            Grant::Idle(conn) => self.put_idle(conn),
            Grant::Dial(slot) => drop(slot),
        }
    }

    pub(crate) fn next_conn_id(&self) -> u64 {
        self.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn lease_started(&self) {
        self.in_use.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn lease_ended(&self) {
        self.in_use.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn connection_opened(&self) {
        self.opened_total.fetch_add(1, Ordering::Relaxed);
        self.metrics.opened.inc();
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        let (open, idle, queue_depth) = {
            let state = self.lock();
            let idle = state.idle.iter().filter(|i| !i.conn.is_closed()).count();
            (state.open, idle, state.queue.len())
        };
        PoolSnapshot {
            address: self.origin.authority(),
            max_connections: self.limits.max_connections,
            max_queue: self.limits.max_queue,
            in_use: self.in_use.load(Ordering::Relaxed),
            connections_open: open,
            connections_idle: idle,
            connections_peak: self.connections_peak.load(Ordering::Relaxed),
            connections_opened_total: self.opened_total.load(Ordering::Relaxed),
            queue_depth,
            queue_peak: self.queue_peak.load(Ordering::Relaxed),
            requests_total: self.requests_total.load(Ordering::Relaxed),
        }
    }

    /// Closes every idle connection (shutdown): their tasks free the slots once the upstream has closed too.
    pub fn close_idle(&self) {
        let idle = std::mem::take(&mut self.lock().idle);
        drop(idle);
    }
}

/// A request's place in the queue. If it is dropped while waiting (timeout, client gone, cancelled), it leaves
/// the queue at once, and a grant that raced with its departure is given back rather than lost.
struct Waiting<'a> {
    pool: &'a Arc<UpstreamPool>,
    ticket: Option<Ticket<Grant>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut ticket) = self.ticket.take() {
            if self.pool.lock().queue.leave(ticket.id) {
                return;
            }
            if let Ok(grant) = ticket.granted.try_recv() {
                self.pool.give_back(grant);
            }
        }
    }
}

/// Closes idle connections past `idle_timeout` (or their lifetime). Sleeps until the oldest one is due, so an
/// idle pool costs one timer.
async fn expire_idle(pool: Weak<UpstreamPool>) {
    loop {
        let next_due = {
            let Some(pool) = pool.upgrade() else { return };
            let now = Instant::now();
            let idle_timeout = pool.limits.idle_timeout;
            let mut expired = Vec::new();
            let next_due = {
                let mut state = pool.lock();
                while let Some(front) = state.idle.front() {
                    if front.since + idle_timeout > now {
                        break;
                    }
                    expired.extend(state.idle.pop_front());
                }
                let (keep, gone): (VecDeque<IdleConn>, VecDeque<IdleConn>) = std::mem::take(&mut state.idle)
                    .into_iter()
                    .partition(|i| i.conn.is_usable(&pool.limits));
                state.idle = keep;
                expired.extend(gone);
                state.idle.front().map(|i| i.since + idle_timeout)
            };
            drop(expired);
            let fallback = now + idle_timeout.min(Duration::from_secs(1));
            next_due.map_or(fallback, |due| due.min(fallback))
        };
        tokio::time::sleep_until(next_due.into()).await;
    }
}
