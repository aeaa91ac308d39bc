//! Properties of the pool and its admission queue: random interleavings of arrivals, releases, cancellations,
//! timeouts, idle expiry, connection failures and changes of the cap and queue bound while all that goes on, each
//! step checked against a model of what the pool must do.
//!
//! loom cannot check code built on `tokio::sync`, so proptest chooses the interleavings and each is replayed
//! deterministically on tokio's paused clock, where time moves only when the case moves it. Two levels:
//! * [slots](slot_level): no sockets; the case polls every admission future itself, so a waiter can be dropped at
//!   any point, including after a grant has reached it and before it looked;
//! * [connections](connection_level): loopback TCP to an upstream that answers each request with the number of
//!   the connection it came on and counts connections from its own side. Sockets make progress without the clock,
//!   so after each step the case yields until pool, requests and upstream match the model.
//!
//! Failures are persisted by proptest under `proptest-regressions/` and replayed first on the next run.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tokio::sync::oneshot;

use crate::admission::Shed;
use crate::config::{Origin, Scheme, UpstreamConfig};
use crate::metrics::Metrics;
use crate::pool::{Lease, PoolSnapshot, Refused, UpstreamPool};

/// The models' queue order: a retry joins at the front, behind the retries already there; anything else at the back.
fn enqueue(queue: &mut VecDeque<usize>, retries: &mut BTreeSet<usize>, id: usize, retry: bool) {
    if retry {
        let behind = queue.iter().take_while(|queued| retries.contains(queued)).count();
        retries.insert(id);
        queue.insert(behind, id);
    } else {
        queue.push_back(id);
    }
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime")
}

fn new_pool(port: u16, limits: UpstreamConfig) -> Arc<UpstreamPool> {
    let origin = Origin {
        scheme: Scheme::Http,
        host: "127.0.0.1".into(),
        port,
    };
    UpstreamPool::new(
        "properties",
        origin,
        limits,
        None,
        Metrics::new().upstream("properties"),
    )
}

/// The largest cap a case sets; small, so that caps cross the number of live connections often.
const MAX_CAP: usize = 4;

/// Only the queue bound changes; the cap in force stays (a reload that changed just `max_queue`).
fn set_max_queue(pool: &Arc<UpstreamPool>, max_queue: usize) {
    let mut limits = UpstreamConfig::clone(&pool.limits());
    limits.max_queue = max_queue;
    pool.set_limits(limits);
}

/// Which of the current candidates (waiters, leases, connections) an operation applies to, modulo their number.
/// Plain so that a failing case can be written down as a regression test; shrinks towards the first candidate.
#[derive(Debug, Clone, Copy)]
struct Which(usize);

impl Which {
    fn of(self, candidates: usize) -> usize {
        self.0 % candidates
    }
}

fn which() -> impl Strategy<Value = Which> {
    (0..16usize).prop_map(Which)
}

/// Polls `future` once; `Some` if it finished.
async fn poll_once<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *future).poll(cx) {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        })
    })
    .await
}

/// The part of a snapshot a model predicts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolView {
    open: usize,
    idle: usize,
    in_use: usize,
    queue_depth: usize,
    opened_total: u64,
    connections_peak: usize,
    queue_peak: usize,
    requests_total: u64,
}

impl From<PoolSnapshot> for PoolView {
    fn from(s: PoolSnapshot) -> Self {
        PoolView {
            open: s.connections_open,
            idle: s.connections_idle,
            in_use: s.in_use,
            queue_depth: s.queue_depth,
            opened_total: s.connections_opened_total,
            connections_peak: s.connections_peak,
            queue_peak: s.queue_peak,
            requests_total: s.requests_total,
        }
    }
}

/// The cap the pool keeps is the one in force, except that a lowered cap lets connections that already existed
/// finish: a count may stay above the cap in force only until it first comes down to it.
#[derive(Debug, Clone, Copy)]
struct Ceiling {
    cap: usize,
    /// The highest cap in force since the count was last at or below the cap in force.
    bound: usize,
    /// The highest cap ever in force; no peak may pass it.
    highest: usize,
}

impl Ceiling {
    fn new(cap: usize) -> Self {
        Ceiling {
            cap,
            bound: cap,
            highest: cap,
        }
    }

    fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
        self.bound = self.bound.max(cap);
        self.highest = self.highest.max(cap);
    }

    fn observe(&mut self, count: usize) -> Result<(), TestCaseError> {
        prop_assert!(
            count <= self.bound,
            "{} connections, above every cap in force since the count was last within the cap ({})",
            count,
            self.bound
        );
        if count <= self.cap {
            self.bound = self.cap;
        }
        Ok(())
    }
}

mod slot_level {
    //! Slots without connections: no lease here ever dials, so every grant is a slot, and the case is the only
    //! executor of the admission futures.

    use super::*;

    #[derive(Debug, Clone)]
    pub(super) enum Op {
        /// `fresh` is a retry that must not reuse an idle connection (`admit_fresh`); it has no client to lose.
        Arrive {
            priority: bool,
            fresh: bool,
            patience_ms: u64,
        },
        /// The executor gets round to one waiter.
        Poll(Which),
        PollAll,
        /// A request's response ended: its slot goes to the oldest waiter, or back to the pool.
        Release(Which),
        /// A waiter's future is dropped wherever it is, even with a grant waiting for it.
        Cancel(Which),
        /// The client went away; the waiter notices at its next poll.
        ClientGone(Which),
        Advance {
            ms: u64,
        },
        /// A reload or the admin API changes the cap while slots are held and waiters queue.
        SetCap(usize),
        SetMaxQueue(usize),
        /// The adaptive limit moves (`None`: turned off) while leases are held and waiters queue.
        SetLimit(Option<usize>),
    }

    pub(super) fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (prop::bool::weighted(0.2), prop::bool::weighted(0.15), 1..200u64)
                .prop_map(|(priority, fresh, patience_ms)| Op::Arrive { priority, fresh, patience_ms }),
            2 => which().prop_map(Op::Poll),
            2 => Just(Op::PollAll),
            3 => which().prop_map(Op::Release),
            1 => which().prop_map(Op::Cancel),
            1 => which().prop_map(Op::ClientGone),
            2 => (1..150u64).prop_map(|ms| Op::Advance { ms }),
            2 => (1..=MAX_CAP).prop_map(Op::SetCap),
            1 => (0..4usize).prop_map(Op::SetMaxQueue),
            2 => prop::option::weighted(0.85, 1..=MAX_CAP).prop_map(Op::SetLimit),
        ]
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Outcome {
        Served,
        Shed(Shed),
        ClientGone,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Waiter {
        Queued {
            deadline: u64,
            gone: bool,
        },
        /// Handed a slot it has not yet looked at.
        Granted,
    }

    /// What the pool must do, written as plainly as possible.
    struct Model {
        max_connections: usize,
        max_queue: usize,
        /// The adaptive limit in force; `usize::MAX` when off.
        limit: usize,
        /// Leases held plus grants waiting for their waiter: what the limit bounds.
        leased: usize,
        now: u64,
        open: usize,
        queue: VecDeque<usize>,
        /// The queued ids that joined as retries: they are served before the others, in the order they came.
        retries: BTreeSet<usize>,
        waiters: BTreeMap<usize, Waiter>,
        leases: BTreeSet<usize>,
        requests_total: u64,
        queue_peak: usize,
        connections_peak: usize,
    }

    impl Model {
        fn issue(&mut self, id: usize) -> Option<Outcome> {
            self.open += 1;
            self.leased += 1;
            self.connections_peak = self.connections_peak.max(self.open);
            self.leases.insert(id);
            Some(Outcome::Served)
        }

        fn retry_queued(&self) -> bool {
            self.queue.iter().any(|queued| self.retries.contains(queued))
        }

        /// Hands a waiter a grant: `issued` a new slot, else one being handed on.
        fn grant(&mut self, id: usize, issued: bool) {
            if issued {
                self.open += 1;
                self.connections_peak = self.connections_peak.max(self.open);
            }
            self.leased += 1;
            self.queue.retain(|&queued| queued != id);
            self.waiters.insert(id, Waiter::Granted);
        }

        /// Whatever the rules allow now: each retry a free slot, then, under the limit, each other waiter one.
        fn admit_admissible(&mut self) {
            while self.open < self.max_connections {
                let next = match self.queue.front() {
                    Some(&first) if self.retries.contains(&first) => first,
                    _ if self.leased < self.limit => {
                        let Some(&first) = self.queue.iter().find(|q| !self.retries.contains(q)) else {
                            break;
                        };
                        first
                    }
                    _ => break,
                };
                self.grant(next, true);
            }
        }

        fn join(&mut self, id: usize, front: bool, deadline: u64) -> Option<Outcome> {
            super::enqueue(&mut self.queue, &mut self.retries, id, front);
            self.queue_peak = self.queue_peak.max(self.queue.len());
            self.waiters.insert(id, Waiter::Queued { deadline, gone: false });
            None
        }

        /// The outcome of the first poll, if it finishes.
        fn arrive(&mut self, id: usize, priority: bool, fresh: bool, patience_ms: u64) -> Option<Outcome> {
            let deadline = self.now + patience_ms;
            if fresh {
                if self.open < self.max_connections {
                    return self.issue(id);
                }
                return self.join(id, true, deadline);
            }
            if !priority {
                self.requests_total += 1;
            }
            // A retry is held back by the cap and by retries ahead of it; a new request also by anyone waiting and
            // by the adaptive limit.
            let free = if priority {
                !self.retry_queued()
            } else {
                self.queue.is_empty() && self.leased < self.limit
            };
            if self.open < self.max_connections && free {
                return self.issue(id);
            }
            if !priority && self.queue.len() >= self.max_queue {
                return Some(Outcome::Shed(Shed::QueueFull));
            }
            self.join(id, priority, deadline)
        }

        fn leave_queue(&mut self, id: usize) {
            self.queue.retain(|&queued| queued != id);
            self.waiters.remove(&id);
        }

        /// A grant already handed over wins over a deadline or a departed client.
        fn poll(&mut self, id: usize) -> Option<Outcome> {
            match self.waiters.get(&id).copied()? {
                Waiter::Granted => {
                    self.waiters.remove(&id);
                    self.leases.insert(id);
                    Some(Outcome::Served)
                }
                Waiter::Queued { deadline, .. } if self.now >= deadline => {
                    self.leave_queue(id);
                    Some(Outcome::Shed(Shed::QueueTimeout))
                }
                Waiter::Queued { gone: true, .. } => {
                    self.leave_queue(id);
                    Some(Outcome::ClientGone)
                }
                Waiter::Queued { .. } => None,
            }
        }

        /// `open` still counts the freed slot: above the cap, handing it on would keep one slot too many. At or
        /// above the adaptive limit only a retry may have it.
        fn slot_freed(&mut self) {
            if self.open <= self.max_connections {
                let next = match self.queue.front() {
                    Some(&first) if self.retries.contains(&first) || self.leased < self.limit => Some(first),
                    _ => None,
                };
                if let Some(next) = next {
                    self.grant(next, false);
                    return;
                }
            }
            self.open -= 1;
        }

        /// A raised cap's new slots go to the oldest waiters at once; a lowered one takes effect as slots free.
        fn set_cap(&mut self, cap: usize) {
            let raised = cap > self.max_connections;
            self.max_connections = cap;
            if raised {
                self.admit_admissible();
            }
        }

        /// A raised limit lets the waiters it held back in at once; a lowered one takes effect as leases end.
        fn set_limit(&mut self, limit: usize) {
            let raised = limit > self.limit;
            self.limit = limit;
            if raised {
                self.admit_admissible();
            }
        }

        fn cancel(&mut self, id: usize) {
            match self.waiters.get(&id).copied() {
                Some(Waiter::Granted) => {
                    self.waiters.remove(&id);
                    self.leased -= 1;
                    self.slot_freed();
                }
                Some(Waiter::Queued { .. }) => self.leave_queue(id),
                None => {}
            }
        }

        fn client_gone(&mut self, id: usize) {
            if let Some(Waiter::Queued { gone, .. }) = self.waiters.get_mut(&id) {
                *gone = true;
            }
        }

        /// The lease leaves the count first (which may let a waiter the limit held back in), then its slot frees.
        fn release(&mut self, id: usize) {
            self.leases.remove(&id);
            self.leased -= 1;
            self.admit_admissible();
            self.slot_freed();
        }

        fn view(&self) -> PoolView {
            PoolView {
                open: self.open,
                idle: 0,
                in_use: self.leased,
                queue_depth: self.queue.len(),
                opened_total: 0,
                connections_peak: self.connections_peak,
                queue_peak: self.queue_peak,
                requests_total: self.requests_total,
            }
        }

        fn latest_deadline(&self) -> u64 {
            let deadlines = self.waiters.values().filter_map(|w| match w {
                Waiter::Queued { deadline, .. } => Some(*deadline),
                Waiter::Granted => None,
            });
            deadlines.max().unwrap_or(self.now)
        }
    }

    type Admission = Pin<Box<dyn Future<Output = Result<Lease, Refused>>>>;

    struct Pending {
        id: usize,
        admission: Admission,
        gone: Option<oneshot::Sender<()>>,
    }

    /// The pool, and the futures and leases the case holds: the case is their only executor.
    struct Driver {
        pool: Arc<UpstreamPool>,
        model: Model,
        pending: Vec<Pending>,
        leases: Vec<(usize, Lease)>,
        arrivals: usize,
        ceiling: Ceiling,
    }

    fn outcome(result: &Result<Lease, Refused>) -> Outcome {
        match result {
            Ok(_) => Outcome::Served,
            Err(Refused::Shed(shed)) => Outcome::Shed(*shed),
            Err(Refused::ClientGone) => Outcome::ClientGone,
        }
    }

    impl Driver {
        /// Polls one pending admission and checks its outcome (or that it has none yet) against the model's.
        async fn poll(&mut self, index: usize) -> Result<(), TestCaseError> {
            let id = self.pending[index].id;
            let result = poll_once(&mut self.pending[index].admission).await;
            let expected = self.model.poll(id);
            self.finish(index, result, expected)
        }

        fn finish(
            &mut self,
            index: usize,
            result: Option<Result<Lease, Refused>>,
            expected: Option<Outcome>,
        ) -> Result<(), TestCaseError> {
            let id = self.pending[index].id;
            prop_assert_eq!(result.as_ref().map(outcome), expected, "request {}", id);
            if let Some(result) = result {
                self.pending.remove(index);
                if let Ok(lease) = result {
                    self.leases.push((id, lease));
                }
            }
            Ok(())
        }

        async fn poll_all(&mut self) -> Result<(), TestCaseError> {
            // In arrival order; each poll may complete and remove its future.
            let ids: Vec<usize> = self.pending.iter().map(|p| p.id).collect();
            for id in ids {
                if let Some(index) = self.pending.iter().position(|p| p.id == id) {
                    self.poll(index).await?;
                }
            }
            Ok(())
        }

        async fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
            match *op {
                Op::Arrive {
                    priority,
                    fresh,
                    patience_ms,
                } => {
                    let id = self.arrivals;
                    self.arrivals += 1;
                    let deadline = tokio::time::Instant::now() + Duration::from_millis(patience_ms);
                    let pool = self.pool.clone();
                    let (admission, gone): (Admission, _) = if fresh {
                        (Box::pin(async move { pool.admit_fresh(deadline).await }), None)
                    } else {
                        let (gone_tx, gone_rx) = oneshot::channel::<()>();
                        let client_gone = async move {
                            if gone_rx.await.is_err() {
                                std::future::pending::<()>().await;
                            }
                        };
                        let admission = async move { pool.admit(priority, deadline, client_gone).await };
                        (Box::pin(admission), Some(gone_tx))
                    };
                    self.pending.push(Pending { id, admission, gone });
                    let index = self.pending.len() - 1;
                    let result = poll_once(&mut self.pending[index].admission).await;
                    let expected = self.model.arrive(id, priority, fresh, patience_ms);
                    self.finish(index, result, expected)?;
                }
                Op::Poll(which) if !self.pending.is_empty() => self.poll(which.of(self.pending.len())).await?,
                Op::PollAll => self.poll_all().await?,
                Op::Release(which) if !self.leases.is_empty() => self.release(which.of(self.leases.len())),
                Op::Cancel(which) if !self.pending.is_empty() => {
                    let cancelled = self.pending.remove(which.of(self.pending.len()));
                    drop(cancelled.admission);
                    self.model.cancel(cancelled.id);
                }
                Op::ClientGone(which) if !self.pending.is_empty() => {
                    let index = which.of(self.pending.len());
                    let pending = &mut self.pending[index];
                    if let Some(gone) = pending.gone.take() {
                        let _ = gone.send(());
                        self.model.client_gone(pending.id);
                    }
                }
                Op::Advance { ms } => {
                    tokio::time::advance(Duration::from_millis(ms)).await;
                    self.model.now += ms;
                }
                Op::SetCap(cap) => {
                    self.pool.set_max_connections(cap);
                    self.model.set_cap(cap);
                    self.ceiling.set_cap(cap);
                }
                Op::SetMaxQueue(max_queue) => {
                    set_max_queue(&self.pool, max_queue);
                    self.model.max_queue = max_queue;
                }
                Op::SetLimit(limit) => {
                    let limit = limit.unwrap_or(usize::MAX);
                    self.pool.set_adaptive_limit(limit);
                    self.model.set_limit(limit);
                }
                Op::Poll(_) | Op::Release(_) | Op::Cancel(_) | Op::ClientGone(_) => {}
            }
            Ok(())
        }

        fn release(&mut self, index: usize) {
            let (id, lease) = self.leases.remove(index);
            drop(lease);
            self.model.release(id);
        }

        /// `open_before`: the pool's count before the step, which may have issued slots only up to the cap.
        fn check(&mut self, open_before: usize) -> Result<(), TestCaseError> {
            let snapshot = self.pool.snapshot();
            prop_assert_eq!(snapshot.limit, self.model.limit.min(self.model.max_connections));
            let seen = PoolView::from(snapshot);
            prop_assert_eq!(&seen, &self.model.view());
            let leased = self.pool.leased();
            prop_assert_eq!(leased, self.model.leased, "leases counted against the limit");
            // Nobody waits whom the rules would serve: a retry only for the cap, any other request also for the
            // adaptive limit.
            let open = seen.open;
            let cap_full = open >= self.model.max_connections;
            prop_assert!(
                cap_full || !self.model.retry_queued(),
                "a retry waits with {} of {} slots issued",
                open,
                self.model.max_connections
            );
            prop_assert!(
                seen.queue_depth == 0 || cap_full || leased >= self.model.limit,
                "{} waiting with {} of {} slots issued and {} leases under a limit of {}",
                seen.queue_depth,
                open,
                self.model.max_connections,
                leased,
                self.model.limit
            );
            let cap = self.model.max_connections;
            prop_assert!(
                seen.open <= open_before.max(cap),
                "{} slots after a step that began with {}: one was issued at or above the cap ({})",
                seen.open,
                open_before,
                cap
            );
            self.ceiling.observe(seen.open)?;
            prop_assert!(seen.connections_peak <= self.ceiling.highest);
            let granted = self.model.waiters.values().filter(|w| **w == Waiter::Granted).count();
            // Every slot is accounted for exactly once: held by one lease or waiting for one waiter.
            prop_assert_eq!(seen.open, self.leases.len() + granted, "slots vs holders");
            Ok(())
        }

        fn open(&self) -> usize {
            self.pool.snapshot().connections_open
        }

        /// Releases everything and lets time pass: every waiter must end, and the pool must come to rest.
        async fn drain(&mut self) -> Result<(), TestCaseError> {
            for _ in 0..1000 {
                let open_before = self.open();
                self.poll_all().await?;
                self.check(open_before)?;
                let open_before = self.open();
                if !self.leases.is_empty() {
                    self.release(0);
                } else if !self.pending.is_empty() {
                    let ms = self.model.latest_deadline() - self.model.now + 1;
                    self.apply(&Op::Advance { ms }).await?;
                } else {
                    break;
                }
                self.check(open_before)?;
            }
            prop_assert!(self.pending.is_empty(), "waiters never ended");
            let rest = PoolView::from(self.pool.snapshot());
            prop_assert_eq!((rest.open, rest.in_use, rest.queue_depth), (0, 0, 0));
            Ok(())
        }
    }

    pub(super) async fn run(max_connections: usize, max_queue: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let limits = UpstreamConfig {
            url: "127.0.0.1:9".into(),
            max_connections,
            max_queue,
            ..UpstreamConfig::default()
        };
        let mut driver = Driver {
            pool: new_pool(9, limits),
            model: Model {
                max_connections,
                max_queue,
                limit: usize::MAX,
                leased: 0,
                now: 0,
                open: 0,
                queue: VecDeque::new(),
                retries: BTreeSet::new(),
                waiters: BTreeMap::new(),
                leases: BTreeSet::new(),
                requests_total: 0,
                queue_peak: 0,
                connections_peak: 0,
            },
            pending: Vec::new(),
            leases: Vec::new(),
            arrivals: 0,
            ceiling: Ceiling::new(max_connections),
        };
        for (step, op) in ops.iter().enumerate() {
            let open_before = driver.open();
            driver
                .apply(op)
                .await
                .and_then(|()| driver.check(open_before))
                .map_err(|e| TestCaseError::fail(format!("step {step} ({op:?}): {e}")))?;
        }
        driver.drain().await
    }
}

mod connection_level {
    //! Whole connections over loopback TCP, to an upstream that answers every request with the number of the
    //! connection it arrived on (so a request knows which connection it holds) and counts connections itself.

    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Mutex, MutexGuard};

    use http_body_util::BodyExt;
    use tokio::net::{TcpListener, TcpStream};
    use tokio::task::JoinHandle;

    use super::*;
    use crate::forward::RequestBody;

    /// Steps happen on multiples of `GRID_MS`; queue deadlines fall 1 ms after one, close timeouts 2 ms (5 ms for a
    /// close that began at an idle expiry), idle expiry 3 ms. Timers of different kinds thus never share an
    /// instant, and which of them fires first is never up to the scheduler.
    const GRID_MS: u64 = 10;
    const CLOSE_TIMEOUT_MS: u64 = 502;
    const IDLE_TIMEOUT_MS: u64 = 1003;
    /// The longest the pool's expiry task sleeps (see `expire_idle`); the model must know when it looks.
    const EXPIRY_TICK_MS: u64 = 1000;

    #[derive(Debug, Clone)]
    pub(super) enum Op {
        Arrive {
            priority: bool,
            fresh: bool,
            patience_steps: u64,
        },
        /// A request's response ended; without `reuse` its connection is closed rather than kept.
        Finish {
            which: Which,
            reuse: bool,
        },
        /// A request's task is dropped, waiting or holding a connection.
        Abort(Which),
        ClientGone(Which),
        /// The upstream closes a connection it has open (idle or busy at the pool).
        Kill(Which),
        /// The upstream closes its side of a connection the pool is closing, letting the pool free the slot.
        AckClose(Which),
        /// From now on the upstream resets new connections at their first request.
        Failing(bool),
        Advance {
            steps: u64,
        },
        /// A reload or the admin API changes the cap with connections busy, idle and closing.
        SetCap(usize),
        SetMaxQueue(usize),
        /// A reload removed the upstream: what was admitted is still served, nothing is kept.
        Retire,
    }

    pub(super) fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (prop::bool::weighted(0.15), prop::bool::weighted(0.25), 1..40u64)
                .prop_map(|(priority, fresh, patience_steps)| Op::Arrive { priority, fresh, patience_steps }),
            4 => (which(), prop::bool::weighted(0.7)).prop_map(|(which, reuse)| Op::Finish { which, reuse }),
            2 => which().prop_map(Op::Abort),
            2 => which().prop_map(Op::ClientGone),
            1 => which().prop_map(Op::Kill),
            3 => which().prop_map(Op::AckClose),
            1 => prop::bool::weighted(0.4).prop_map(Op::Failing),
            3 => prop_oneof![3 => 1..30u64, 1 => 30..150u64].prop_map(|steps| Op::Advance { steps }),
            3 => (1..=MAX_CAP).prop_map(Op::SetCap),
            1 => (0..4usize).prop_map(Op::SetMaxQueue),
            // Rare, so that most cases run a good while before it: after it, nothing is kept idle.
            1 => Just(Op::Retire),
        ]
    }

    // ---- The upstream ----

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum UpSide {
        Open,
        /// The pool closed its side; the upstream keeps its own open until told (or reset).
        FinReceived,
        Closed,
    }

    struct UpConn {
        side: UpSide,
        socket: Option<Arc<TcpStream>>,
        kill: Option<oneshot::Sender<()>>,
    }

    /// Every connection the upstream accepted, numbered in order.
    #[derive(Default)]
    struct Upstream {
        conns: Mutex<Vec<UpConn>>,
        failing: AtomicBool,
        /// Most connections alive at once, counted at every accept.
        peak: AtomicUsize,
        /// The same since the harness last took it: every accept must be within the cap in force then.
        recent_peak: AtomicUsize,
    }

    impl Upstream {
        fn lock(&self) -> MutexGuard<'_, Vec<UpConn>> {
            self.conns.lock().unwrap()
        }

        /// A connection whose close timed out is reset by the pool; having read the FIN already, the upstream
        /// learns of the reset only from the socket's pending error.
        fn notice_resets(conns: &mut [UpConn]) {
            for conn in conns.iter_mut().filter(|c| c.side == UpSide::FinReceived) {
                if conn
                    .socket
                    .as_ref()
                    .is_some_and(|s| matches!(s.take_error(), Ok(Some(_))))
                {
                    conn.side = UpSide::Closed;
                    conn.socket = None;
                }
            }
        }

        fn sides(&self) -> Vec<UpSide> {
            let mut conns = self.lock();
            Self::notice_resets(&mut conns);
            conns.iter().map(|c| c.side).collect()
        }

        fn accepted(&self, socket: Arc<TcpStream>, kill: oneshot::Sender<()>) -> usize {
            let mut conns = self.lock();
            Self::notice_resets(&mut conns);
            conns.push(UpConn {
                side: UpSide::Open,
                socket: Some(socket),
                kill: Some(kill),
            });
            let alive = conns.iter().filter(|c| c.side != UpSide::Closed).count();
            self.peak.fetch_max(alive, Ordering::Relaxed);
            self.recent_peak.fetch_max(alive, Ordering::Relaxed);
            conns.len() - 1
        }

        fn set(&self, id: usize, side: UpSide) {
            let mut conns = self.lock();
            let conn = &mut conns[id];
            conn.side = side;
            conn.kill = None;
            if side == UpSide::Closed {
                conn.socket = None;
            }
        }

        fn kill(&self, id: usize) {
            if let Some(kill) = self.lock()[id].kill.take() {
                let _ = kill.send(());
            }
        }
    }

    async fn accept(listener: TcpListener, upstream: Arc<Upstream>) {
        while let Ok((socket, _)) = listener.accept().await {
            let socket = Arc::new(socket);
            let (kill_tx, kill_rx) = oneshot::channel();
            let id = upstream.accepted(socket.clone(), kill_tx);
            let doomed = upstream.failing.load(Ordering::Relaxed);
            tokio::spawn(serve(upstream.clone(), id, socket, kill_rx, doomed));
        }
    }

    /// Answers each request head with the connection's number. On the pool's FIN it leaves the socket to the
    /// registry, still open, so that the pool's close completes only when the case says so.
    async fn serve(
        upstream: Arc<Upstream>,
        id: usize,
        socket: Arc<TcpStream>,
        mut kill: oneshot::Receiver<()>,
        doomed: bool,
    ) {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            tokio::select! {
                _ = &mut kill => break,
                readable = socket.readable() => if readable.is_err() { break },
            }
            match socket.try_read(&mut buf) {
                Ok(0) => return upstream.set(id, UpSide::FinReceived),
                Ok(n) => {
                    head.extend_from_slice(&buf[..n]);
                    while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        head.drain(..end + 4);
                        if doomed {
                            let _ = socket2::SockRef::from(&*socket).set_linger(Some(Duration::ZERO));
                            return upstream.set(id, UpSide::Closed);
                        }
                        let body = id.to_string();
                        let response = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                        if write_all(&socket, response.as_bytes()).await.is_err() {
                            return upstream.set(id, UpSide::Closed);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
        upstream.set(id, UpSide::Closed);
    }

    async fn write_all(socket: &TcpStream, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            socket.writable().await?;
            match socket.try_write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    // ---- The requests ----

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum End {
        Finished,
        Failed,
        Shed(Shed),
        ClientGone,
        Dropped,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Seen {
        Waiting,
        /// Holds the connection the upstream numbers so.
        Holding(usize),
        Done(End),
    }

    #[derive(Default)]
    struct Requests {
        seen: Mutex<Vec<Seen>>,
        /// Which request holds each connection, by the upstream's numbering.
        holders: Mutex<BTreeMap<usize, usize>>,
        violations: Mutex<Vec<String>>,
    }

    impl Requests {
        fn violation(&self, what: String) {
            self.violations.lock().unwrap().push(what);
        }
    }

    /// A request's entry in [`Requests`]; a request dropped before it ended says so.
    struct Record {
        requests: Arc<Requests>,
        id: usize,
        ended: bool,
    }

    impl Record {
        fn set(&self, seen: Seen) {
            let before = std::mem::replace(&mut self.requests.seen.lock().unwrap()[self.id], seen);
            if let Seen::Done(end) = before {
                self.requests
                    .violation(format!("request {} ended twice: {end:?}, then {seen:?}", self.id));
            }
        }

        fn end(mut self, end: End) {
            self.ended = true;
            self.set(Seen::Done(end));
        }
    }

    impl Drop for Record {
        fn drop(&mut self) {
            if !self.ended {
                self.set(Seen::Done(End::Dropped));
            }
        }
    }

    /// A request's claim on a connection, checked against every other live request's.
    struct Hold {
        requests: Arc<Requests>,
        conn: usize,
    }

    impl Hold {
        fn new(requests: &Arc<Requests>, id: usize, conn: usize) -> Hold {
            if let Some(other) = requests.holders.lock().unwrap().insert(conn, id) {
                requests.violation(format!("requests {other} and {id} both hold connection {conn}"));
            }
            Hold {
                requests: requests.clone(),
                conn,
            }
        }
    }

    impl Drop for Hold {
        fn drop(&mut self) {
            self.requests.holders.lock().unwrap().remove(&self.conn);
        }
    }

    enum Admit {
        Plain {
            priority: bool,
            gone: oneshot::Receiver<()>,
        },
        Fresh,
    }

    async fn request(
        pool: Arc<UpstreamPool>,
        requests: Arc<Requests>,
        id: usize,
        admit: Admit,
        deadline: tokio::time::Instant,
        finish: oneshot::Receiver<bool>,
    ) {
        let record = Record {
            requests: requests.clone(),
            id,
            ended: false,
        };
        let admitted = match admit {
            Admit::Fresh => pool.admit_fresh(deadline).await,
            Admit::Plain { priority, gone } => {
                let client_gone = async move {
                    if gone.await.is_err() {
                        std::future::pending::<()>().await;
                    }
                };
                pool.admit(priority, deadline, client_gone).await
            }
        };
        let mut lease = match admitted {
            Ok(lease) => lease,
            Err(Refused::Shed(shed)) => return record.end(End::Shed(shed)),
            Err(Refused::ClientGone) => return record.end(End::ClientGone),
        };
        let Ok(conn) = exchange(&mut lease).await else {
            // As the proxy does after a failed exchange: the connection is not trusted again.
            lease.forbid_reuse();
            drop(lease);
            return record.end(End::Failed);
        };
        let hold = Hold::new(&requests, id, conn);
        record.set(Seen::Holding(conn));
        if !finish.await.unwrap_or(true) {
            lease.forbid_reuse();
        }
        drop(hold);
        drop(lease);
        record.end(End::Finished);
    }

    /// One request on the lease's connection (dialled first if need be); the number of the connection it used.
    async fn exchange(lease: &mut Lease) -> Result<usize, ()> {
        let conn = lease.connection().await.map_err(drop)?;
        let (response, _) = crate::pool::client::send(
            conn.wire().expect("an HTTP/1 test connection"),
            Box::new(http::Request::new(RequestBody::empty())),
        )
        .await
        .map_err(drop)?;
        let body = response.into_body().collect().await.map_err(drop)?.to_bytes();
        std::str::from_utf8(&body).ok().and_then(|n| n.parse().ok()).ok_or(())
    }

    // ---- The model ----

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Held {
        /// Dialled a connection whose number the model learns when the request reports it.
        Fresh,
        Conn(usize),
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Req {
        Queued { deadline: u64, fresh: bool },
        Holding(Held),
        Done(End),
    }

    #[derive(Debug, Clone, Copy)]
    struct ConnState {
        /// The pool's slot is held exactly while this is not `Closed`.
        up: UpSide,
        served: u64,
        closing_since: Option<u64>,
    }

    struct Model {
        max_connections: usize,
        max_queue: usize,
        max_requests: u64,
        now: u64,
        failing: bool,
        retired: bool,
        open: usize,
        queue: VecDeque<usize>,
        /// The queued ids that joined as retries: they are served before the others, in the order they came.
        retries: BTreeSet<usize>,
        /// Oldest first, with the time each went idle; may hold connections the upstream has since closed.
        idle: VecDeque<(usize, u64)>,
        /// Connections the pool is closing, not yet closed: it counts every close it starts.
        closing: BTreeSet<usize>,
        conns: BTreeMap<usize, ConnState>,
        requests: Vec<Req>,
        expiry_at: u64,
        requests_total: u64,
        queue_peak: usize,
        connections_peak: usize,
        opened_total: u64,
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Observed {
        pool: PoolView,
        requests: Vec<Seen>,
        upstream: Vec<UpSide>,
    }

    impl Model {
        fn alive(&self, conn: usize) -> bool {
            self.conns.get(&conn).is_some_and(|c| c.up == UpSide::Open)
        }

        fn conn(&mut self, conn: usize) -> &mut ConnState {
            self.conns.get_mut(&conn).expect("a connection the model knows")
        }

        /// Dials with a slot it holds; false if the exchange failed, which gives the slot back.
        fn dial(&mut self, r: usize) -> bool {
            self.opened_total += 1;
            if self.failing {
                self.requests[r] = Req::Done(End::Failed);
                return false;
            }
            self.requests[r] = Req::Holding(Held::Fresh);
            true
        }

        fn issue(&mut self, r: usize) {
            self.open += 1;
            self.connections_peak = self.connections_peak.max(self.open);
            if !self.dial(r) {
                self.slot_freed();
            }
        }

        /// `open` still counts the freed slot: above the cap, handing it on would keep one connection too many.
        fn slot_freed(&mut self) {
            if self.open <= self.max_connections {
                while let Some(next) = self.queue.pop_front() {
                    if self.dial(next) {
                        return;
                    }
                }
            }
            self.open -= 1;
        }

        /// Connections that may carry a request: open at the upstream and not being closed by the pool, or being
        /// dialled.
        fn live(&self) -> usize {
            let open = self.conns.values().filter(|c| c.up == UpSide::Open).count();
            let dialled = self
                .requests
                .iter()
                .filter(|r| **r == Req::Holding(Held::Fresh))
                .count();
            open + dialled
        }

        fn live_over_cap(&self) -> bool {
            self.live() > self.max_connections
        }

        /// A connection that finished an exchange is handed on, kept idle, or closed when more live connections
        /// exist than the cap allows, or when the pool is retired and nobody waits.
        fn put_idle(&mut self, conn: usize) {
            if !self.live_over_cap() {
                if let Some(next) = self.queue.pop_front() {
                    self.requests[next] = Req::Holding(Held::Conn(conn));
                    return;
                }
            }
            if self.retired || self.live_over_cap() {
                self.start_closing(conn);
            } else {
                self.idle.push_back((conn, self.now));
            }
        }

        /// Surplus idle connections close at once, oldest first; a raised cap's new slots go to the oldest
        /// waiters at once, each of which dials.
        fn reconfigure(&mut self, cap: usize, max_queue: usize) {
            let raised = cap > self.max_connections;
            self.max_connections = cap;
            self.max_queue = max_queue;
            while self.live_over_cap() {
                let Some((conn, _)) = self.idle.pop_front() else { break };
                if self.alive(conn) {
                    self.start_closing(conn);
                }
            }
            let mut granted = Vec::new();
            while raised && self.open < self.max_connections {
                let Some(next) = self.queue.pop_front() else { break };
                self.open += 1;
                self.connections_peak = self.connections_peak.max(self.open);
                granted.push(next);
            }
            for r in granted {
                if !self.dial(r) {
                    self.slot_freed();
                }
            }
        }

        fn retire(&mut self) {
            self.retired = true;
            for (conn, _) in std::mem::take(&mut self.idle) {
                if self.alive(conn) {
                    self.start_closing(conn);
                }
            }
        }

        fn join(&mut self, r: usize, front: bool) {
            super::enqueue(&mut self.queue, &mut self.retries, r, front);
            self.queue_peak = self.queue_peak.max(self.queue.len());
        }

        fn leave_queue(&mut self, r: usize, end: End) {
            self.queue.retain(|&queued| queued != r);
            self.requests[r] = Req::Done(end);
        }

        fn start_closing(&mut self, conn: usize) {
            self.closing.insert(conn);
            let now = self.now;
            let state = self.conn(conn);
            state.up = UpSide::FinReceived;
            state.closing_since = Some(now);
        }

        /// The pool's side of a closing connection completed: the slot is free.
        fn closed(&mut self, conn: usize) {
            let state = self.conn(conn);
            state.up = UpSide::Closed;
            state.closing_since = None;
            self.closing.remove(&conn);
            self.slot_freed();
        }

        fn arrive(&mut self, r: usize, priority: bool, fresh: bool, patience: u64) {
            self.requests.push(Req::Queued {
                deadline: self.now + patience,
                fresh,
            });
            if fresh {
                if self.open < self.max_connections {
                    return self.issue(r);
                }
                // The oldest idle connection still open is closed to make room; one the upstream already closed
                // has left the pool's idle list (its watch saw it go) and is no candidate.
                let mut evicted = None;
                while self.closing.is_empty() {
                    let Some((conn, _)) = self.idle.pop_front() else { break };
                    if self.alive(conn) {
                        evicted = Some(conn);
                        break;
                    }
                }
                self.join(r, true);
                if let Some(conn) = evicted {
                    self.start_closing(conn);
                }
                return;
            }
            if !priority {
                self.requests_total += 1;
            }
            while let Some((conn, _)) = self.idle.pop_back() {
                if self.alive(conn) {
                    self.requests[r] = Req::Holding(Held::Conn(conn));
                    return;
                }
            }
            if self.open < self.max_connections && self.queue.is_empty() {
                return self.issue(r);
            }
            if !priority && self.queue.len() >= self.max_queue {
                self.requests[r] = Req::Done(End::Shed(Shed::QueueFull));
                return;
            }
            self.join(r, priority);
        }

        fn lease_ends(&mut self, r: usize, reuse: bool, end: End) {
            let Req::Holding(Held::Conn(conn)) = self.requests[r] else {
                unreachable!("request {r} holds no known connection")
            };
            self.requests[r] = Req::Done(end);
            let max_requests = self.max_requests;
            let state = self.conn(conn);
            state.served += 1;
            let worn_out = max_requests > 0 && state.served >= max_requests;
            if state.up != UpSide::Open {
                return;
            }
            if reuse && !worn_out {
                self.put_idle(conn);
            } else {
                self.start_closing(conn);
            }
        }

        fn abort(&mut self, r: usize) {
            match self.requests[r] {
                Req::Queued { .. } => self.leave_queue(r, End::Dropped),
                Req::Holding(_) => self.lease_ends(r, true, End::Dropped),
                Req::Done(_) => {}
            }
        }

        fn kill(&mut self, conn: usize) {
            self.conn(conn).up = UpSide::Closed;
            self.slot_freed();
        }

        fn expire(&mut self, t: u64) {
            for (conn, since) in std::mem::take(&mut self.idle) {
                if !self.alive(conn) {
                    continue;
                }
                if since + IDLE_TIMEOUT_MS > t {
                    self.idle.push_back((conn, since));
                } else {
                    self.start_closing(conn);
                }
            }
            let fallback = t + IDLE_TIMEOUT_MS.min(EXPIRY_TICK_MS);
            self.expiry_at = self
                .idle
                .front()
                .map_or(fallback, |&(_, since)| (since + IDLE_TIMEOUT_MS).min(fallback));
        }

        fn close_deadline(state: &ConnState) -> Option<u64> {
            state
                .closing_since
                .filter(|_| state.up == UpSide::FinReceived)
                .map(|since| since + CLOSE_TIMEOUT_MS)
        }

        fn next_timer(&self) -> u64 {
            let deadlines = self.requests.iter().filter_map(|r| match r {
                Req::Queued { deadline, .. } => Some(*deadline),
                _ => None,
            });
            let closes = self.conns.values().filter_map(Self::close_deadline);
            deadlines.chain(closes).fold(self.expiry_at, u64::min)
        }

        /// Every timer due at `t`, which must all be of one kind.
        fn fire(&mut self, t: u64) -> Result<(), String> {
            self.now = t;
            let timed_out: Vec<usize> = (0..self.requests.len())
                .filter(|&r| matches!(self.requests[r], Req::Queued { deadline, .. } if deadline == t))
                .collect();
            let close_timeouts: Vec<usize> = self
                .conns
                .iter()
                .filter(|(_, state)| Self::close_deadline(state) == Some(t))
                .map(|(&conn, _)| conn)
                .collect();
            let expiry = self.expiry_at == t;
            if usize::from(!timed_out.is_empty()) + usize::from(!close_timeouts.is_empty()) + usize::from(expiry) > 1 {
                return Err(format!("harness: timers of different kinds due together at {t} ms"));
            }
            for r in timed_out {
                self.leave_queue(r, End::Shed(Shed::QueueTimeout));
            }
            for conn in close_timeouts {
                self.closed(conn);
            }
            if expiry {
                self.expire(t);
            }
            Ok(())
        }

        fn view(&self) -> PoolView {
            PoolView {
                open: self.open,
                idle: self.idle.iter().filter(|&&(conn, _)| self.alive(conn)).count(),
                in_use: self.requests.iter().filter(|r| matches!(r, Req::Holding(_))).count(),
                queue_depth: self.queue.len(),
                opened_total: self.opened_total,
                connections_peak: self.connections_peak,
                queue_peak: self.queue_peak,
                requests_total: self.requests_total,
            }
        }

        /// Where the observation differs from the model; otherwise which fresh connection each dialler got.
        fn compare(&self, seen: &Observed) -> Result<Vec<(usize, usize)>, String> {
            let mut diffs = Vec::new();
            if seen.pool != self.view() {
                diffs.push(format!("pool {:?}, model {:?}", seen.pool, self.view()));
            }
            if seen.requests.len() != self.requests.len() {
                diffs.push(format!(
                    "{} requests seen, {} made",
                    seen.requests.len(),
                    self.requests.len()
                ));
            }
            let mut fresh: Vec<(usize, usize)> = Vec::new();
            for (r, (want, got)) in self.requests.iter().zip(&seen.requests).enumerate() {
                let matches = match (want, got) {
                    (Req::Queued { .. }, Seen::Waiting) => true,
                    (Req::Holding(Held::Conn(conn)), Seen::Holding(got)) => conn == got,
                    (Req::Holding(Held::Fresh), Seen::Holding(got)) => {
                        let new = !self.conns.contains_key(got) && fresh.iter().all(|&(_, other)| other != *got);
                        fresh.push((r, *got));
                        new
                    }
                    (Req::Done(want), Seen::Done(got)) => want == got,
                    _ => false,
                };
                if !matches {
                    diffs.push(format!("request {r}: {got:?}, model {want:?}"));
                }
            }
            for (conn, side) in seen.upstream.iter().enumerate() {
                let want = match self.conns.get(&conn) {
                    Some(state) => state.up,
                    None if fresh.iter().any(|&(_, new)| new == conn) => UpSide::Open,
                    // Reset at its first request while the upstream was failing.
                    None => UpSide::Closed,
                };
                if *side != want {
                    diffs.push(format!("upstream connection {conn}: {side:?}, model {want:?}"));
                }
            }
            if seen.upstream.len() as u64 != self.opened_total {
                diffs.push(format!(
                    "{} accepted, {} dialled",
                    seen.upstream.len(),
                    self.opened_total
                ));
            }
            if diffs.is_empty() {
                Ok(fresh)
            } else {
                Err(diffs.join("\n"))
            }
        }

        fn bind(&mut self, fresh: &[(usize, usize)]) {
            for &(r, conn) in fresh {
                self.requests[r] = Req::Holding(Held::Conn(conn));
                let state = ConnState {
                    up: UpSide::Open,
                    served: 0,
                    closing_since: None,
                };
                self.conns.insert(conn, state);
            }
        }

        fn pick<T: Copy>(which: Which, choices: impl Iterator<Item = T>) -> Option<T> {
            let choices: Vec<T> = choices.collect();
            (!choices.is_empty()).then(|| choices[which.of(choices.len())])
        }

        fn requests_where(&self, which: Which, test: impl Fn(&Req) -> bool) -> Option<usize> {
            Self::pick(which, (0..self.requests.len()).filter(|&r| test(&self.requests[r])))
        }

        fn conns_where(&self, which: Which, up: UpSide) -> Option<usize> {
            Self::pick(
                which,
                self.conns.iter().filter(|(_, s)| s.up == up).map(|(&conn, _)| conn),
            )
        }
    }

    struct Client {
        task: JoinHandle<()>,
        gone: Option<oneshot::Sender<()>>,
        finish: Option<oneshot::Sender<bool>>,
    }

    struct Driver {
        pool: Arc<UpstreamPool>,
        upstream: Arc<Upstream>,
        requests: Arc<Requests>,
        clients: Vec<Client>,
        model: Model,
        ceiling: Ceiling,
    }

    impl Driver {
        fn observe(&self) -> Observed {
            Observed {
                pool: PoolView::from(self.pool.snapshot()),
                requests: self.requests.seen.lock().unwrap().clone(),
                upstream: self.upstream.sides(),
            }
        }

        /// Sockets make progress without the clock: yields until pool, requests and upstream match the model, then
        /// a while longer to make sure nothing else was on its way.
        async fn settle(&mut self) -> Result<(), TestCaseError> {
            let started = std::time::Instant::now();
            let mut last: Option<Observed> = None;
            let mut unchanged = 0;
            loop {
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
                let seen = self.observe();
                match self.model.compare(&seen) {
                    Ok(fresh) => {
                        for _ in 0..64 {
                            tokio::task::yield_now().await;
                        }
                        let again = self.observe();
                        prop_assert_eq!(&again, &seen, "moved on after matching the model");
                        self.model.bind(&fresh);
                        return self.invariants(&seen);
                    }
                    Err(diff) => {
                        if last.as_ref() == Some(&seen) {
                            unchanged += 1;
                        } else {
                            unchanged = 0;
                            last = Some(seen);
                        }
                        // Loopback traffic lands within a few turns of the scheduler; a state that stays put
                        // for hundreds of turns and a fifth of a second is where the pool stopped.
                        let elapsed = started.elapsed();
                        if (unchanged > 500 && elapsed > Duration::from_millis(200))
                            || elapsed > Duration::from_secs(10)
                        {
                            return Err(TestCaseError::fail(format!("differs from the model:\n{diff}")));
                        }
                    }
                }
            }
        }

        /// What holds whatever the model says: the cap, one holder per connection, every connection counted,
        /// nobody waiting for a slot that is free.
        fn invariants(&mut self, seen: &Observed) -> Result<(), TestCaseError> {
            let violations = self.requests.violations.lock().unwrap().clone();
            prop_assert!(violations.is_empty(), "{:?}", violations);
            let cap = self.model.max_connections;
            // A step's dials all happen after any cap change it made, so each accept is within the cap now.
            let dialled_at = self.upstream.recent_peak.swap(0, Ordering::Relaxed);
            prop_assert!(
                dialled_at <= cap,
                "the upstream accepted a connection with {} alive under a cap of {}",
                dialled_at,
                cap
            );
            let highest = self.ceiling.highest;
            let peak = self.upstream.peak.load(Ordering::Relaxed);
            prop_assert!(peak <= highest, "the upstream saw {} connections at once", peak);
            prop_assert!(seen.pool.connections_peak <= highest);
            let alive = seen.upstream.iter().filter(|side| **side != UpSide::Closed).count();
            prop_assert!(
                alive <= seen.pool.open,
                "{} connections exist, the pool counts {}",
                alive,
                seen.pool.open
            );
            self.ceiling.observe(seen.pool.open)?;
            prop_assert!(
                seen.pool.queue_depth == 0 || seen.pool.open >= cap,
                "{} waiting with {} of {} connections open",
                seen.pool.queue_depth,
                seen.pool.open,
                cap
            );
            let drained = self.model.retired && seen.pool.open == 0 && seen.pool.queue_depth == 0;
            prop_assert_eq!(self.pool.drained(), drained, "drained");
            Ok(())
        }

        async fn advance_to(&mut self, t: u64) {
            let by = t - self.model.now;
            if by > 0 {
                tokio::time::advance(Duration::from_millis(by)).await;
            }
            self.model.now = t;
        }

        async fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
            let model = &self.model;
            match *op {
                Op::Arrive {
                    priority,
                    fresh,
                    patience_steps,
                } => {
                    let r = self.clients.len();
                    let patience = patience_steps * GRID_MS + 1;
                    let deadline = tokio::time::Instant::now() + Duration::from_millis(patience);
                    let (gone_tx, gone_rx) = oneshot::channel();
                    let (finish_tx, finish_rx) = oneshot::channel();
                    let admit = if fresh {
                        Admit::Fresh
                    } else {
                        Admit::Plain {
                            priority,
                            gone: gone_rx,
                        }
                    };
                    self.requests.seen.lock().unwrap().push(Seen::Waiting);
                    let task = tokio::spawn(request(
                        self.pool.clone(),
                        self.requests.clone(),
                        r,
                        admit,
                        deadline,
                        finish_rx,
                    ));
                    self.clients.push(Client {
                        task,
                        gone: (!fresh).then_some(gone_tx),
                        finish: Some(finish_tx),
                    });
                    self.model.arrive(r, priority, fresh, patience);
                }
                Op::Finish { which, reuse } => {
                    if let Some(r) = model.requests_where(which, |r| matches!(r, Req::Holding(_))) {
                        if let Some(finish) = self.clients[r].finish.take() {
                            let _ = finish.send(reuse);
                        }
                        self.model.lease_ends(r, reuse, End::Finished);
                    }
                }
                Op::Abort(which) => {
                    if let Some(r) = model.requests_where(which, |r| !matches!(r, Req::Done(_))) {
                        self.clients[r].task.abort();
                        self.model.abort(r);
                    }
                }
                Op::ClientGone(which) => {
                    if let Some(r) = model.requests_where(which, |r| matches!(r, Req::Queued { fresh: false, .. })) {
                        if let Some(gone) = self.clients[r].gone.take() {
                            let _ = gone.send(());
                        }
                        self.model.leave_queue(r, End::ClientGone);
                    }
                }
                Op::Kill(which) => {
                    if let Some(conn) = model.conns_where(which, UpSide::Open) {
                        self.upstream.kill(conn);
                        self.model.kill(conn);
                    }
                }
                Op::AckClose(which) => {
                    if let Some(conn) = model.conns_where(which, UpSide::FinReceived) {
                        self.upstream.set(conn, UpSide::Closed);
                        self.model.closed(conn);
                    }
                }
                Op::Failing(failing) => {
                    self.upstream.failing.store(failing, Ordering::Relaxed);
                    self.model.failing = failing;
                }
                Op::SetCap(cap) => {
                    self.pool.set_max_connections(cap);
                    self.model.reconfigure(cap, self.model.max_queue);
                    self.ceiling.set_cap(cap);
                }
                Op::SetMaxQueue(max_queue) => {
                    set_max_queue(&self.pool, max_queue);
                    self.model.reconfigure(self.model.max_connections, max_queue);
                }
                Op::Retire => {
                    self.pool.retire();
                    self.model.retire();
                }
                Op::Advance { steps } => {
                    // One timer instant at a time, each settled before the next, as the model fires them.
                    let target = self.model.now + steps * GRID_MS;
                    loop {
                        let next = self.model.next_timer();
                        if next > target {
                            break;
                        }
                        self.advance_to(next).await;
                        self.model.fire(next).map_err(TestCaseError::fail)?;
                        self.settle().await?;
                    }
                    self.advance_to(target).await;
                }
            }
            self.settle().await
        }

        /// Ends every request and lets time pass until the pool is at rest: nobody may be left waiting.
        async fn drain(&mut self) -> Result<(), TestCaseError> {
            for _ in 0..500 {
                let model = &self.model;
                let holding = (0..model.requests.len()).find(|&r| matches!(model.requests[r], Req::Holding(_)));
                let closing = model
                    .conns
                    .iter()
                    .find(|(_, s)| s.up == UpSide::FinReceived)
                    .map(|(&c, _)| c);
                if let Some(r) = holding {
                    if let Some(finish) = self.clients[r].finish.take() {
                        let _ = finish.send(true);
                    }
                    self.model.lease_ends(r, true, End::Finished);
                    self.settle().await?;
                } else if let Some(conn) = closing {
                    self.upstream.set(conn, UpSide::Closed);
                    self.model.closed(conn);
                    self.settle().await?;
                } else if model.open > 0 || model.requests.iter().any(|r| matches!(r, Req::Queued { .. })) {
                    // Nothing is held or closing: whatever is left is idle, within the cap, and none of it in a
                    // retired pool.
                    let seen = self.observe().pool;
                    prop_assert_eq!(seen.open, seen.idle, "open but neither idle, held nor closing");
                    prop_assert!(seen.idle <= model.max_connections, "{} idle", seen.idle);
                    prop_assert!(!model.retired || seen.idle == 0, "{} idle in a retired pool", seen.idle);
                    let steps = (IDLE_TIMEOUT_MS + EXPIRY_TICK_MS) / GRID_MS;
                    self.apply(&Op::Advance { steps }).await?;
                } else {
                    break;
                }
            }
            let rest = self.observe();
            prop_assert!(
                rest.requests.iter().all(|r| matches!(r, Seen::Done(_))),
                "{:?}",
                rest.requests
            );
            prop_assert_eq!((rest.pool.open, rest.pool.in_use, rest.pool.queue_depth), (0, 0, 0));
            prop_assert!(rest.upstream.iter().all(|side| *side == UpSide::Closed));
            prop_assert_eq!(self.pool.drained(), self.model.retired);
            Ok(())
        }
    }

    pub(super) async fn run(
        max_connections: usize,
        max_queue: usize,
        max_requests: u64,
        ops: Vec<Op>,
    ) -> Result<(), TestCaseError> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a loopback listener");
        let port = listener.local_addr().expect("its address").port();
        let upstream = Arc::new(Upstream::default());
        tokio::spawn(accept(listener, upstream.clone()));
        let limits = UpstreamConfig {
            url: format!("127.0.0.1:{port}"),
            max_connections,
            max_queue,
            idle_timeout: Duration::from_millis(IDLE_TIMEOUT_MS),
            close_timeout: Duration::from_millis(CLOSE_TIMEOUT_MS),
            max_requests_per_connection: max_requests,
            ..UpstreamConfig::default()
        };
        let mut driver = Driver {
            pool: new_pool(port, limits),
            upstream,
            requests: Arc::new(Requests::default()),
            clients: Vec::new(),
            model: Model {
                max_connections,
                max_queue,
                max_requests,
                now: 0,
                failing: false,
                retired: false,
                open: 0,
                queue: VecDeque::new(),
                retries: BTreeSet::new(),
                idle: VecDeque::new(),
                closing: BTreeSet::new(),
                conns: BTreeMap::new(),
                requests: Vec::new(),
                expiry_at: IDLE_TIMEOUT_MS.min(EXPIRY_TICK_MS),
                requests_total: 0,
                queue_peak: 0,
                connections_peak: 0,
                opened_total: 0,
            },
            ceiling: Ceiling::new(max_connections),
        };
        driver.settle().await?;
        for (step, op) in ops.iter().enumerate() {
            driver
                .apply(op)
                .await
                .map_err(|e| TestCaseError::fail(format!("step {step} ({op:?}) at {} ms: {e}", driver.model.now)))?;
        }
        driver
            .drain()
            .await
            .map_err(|e| TestCaseError::fail(format!("draining: {e}")))
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn slots_stay_within_a_changing_cap_and_every_waiter_is_served_in_order_or_shed_once(
        max_connections in 1..4usize,
        max_queue in 0..4usize,
        ops in prop::collection::vec(slot_level::op(), 1..60),
    ) {
        paused_runtime().block_on(slot_level::run(max_connections, max_queue, ops))?;
    }
}

proptest! {
    // Each case runs real sockets; fewer cases keep the whole suite to a few seconds.
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn connections_stay_within_a_changing_cap_are_held_once_and_every_request_ends_once(
        max_connections in 1..4usize,
        max_queue in 0..4usize,
        max_requests in prop_oneof![Just(0u64), 1..4u64],
        ops in prop::collection::vec(connection_level::op(), 1..60),
    ) {
        paused_runtime().block_on(connection_level::run(max_connections, max_queue, max_requests, ops))?;
    }
}

/// Found by the slot-level property: a retry waiting through `admit_fresh` was in the queue but not in its peak.
#[test]
fn a_retry_waiting_for_a_fresh_connection_counts_towards_the_queue_peak() {
    paused_runtime().block_on(async {
        let limits = UpstreamConfig {
            url: "127.0.0.1:9".into(),
            max_connections: 1,
            max_queue: 1,
            ..UpstreamConfig::default()
        };
        let pool = new_pool(9, limits);
        let far = tokio::time::Instant::now() + Duration::from_secs(60);
        let _held = pool.admit(false, far, std::future::pending()).await.unwrap();
        let mut retry = Box::pin(pool.admit_fresh(far));
        assert!(poll_once(&mut retry).await.is_none());
        let snapshot = pool.snapshot();
        assert_eq!((snapshot.queue_depth, snapshot.queue_peak), (1, 1));
    });
}

/// Found by the connection-level property: idle expiry read the wall clock while the pool's other timers read
/// tokio's, so on a paused clock an idle connection outlived `idle_timeout` indefinitely.
#[test]
fn an_idle_connection_expires_once_the_runtime_clock_passes_idle_timeout() {
    use connection_level::Op;
    let ops = vec![
        Op::Arrive {
            priority: false,
            fresh: false,
            patience_steps: 1,
        },
        Op::Finish {
            which: Which(0),
            reuse: true,
        },
        // Past idle_timeout and the expiry task's next look; the harness checks the upstream saw the close.
        Op::Advance { steps: 250 },
    ];
    paused_runtime().block_on(connection_level::run(1, 0, 0, ops)).unwrap();
}

/// Found by the connection-level property: lowering the cap counted idle entries, not live connections, so an
/// entry whose connection the upstream had already closed stood in for a live surplus one, and the pool kept two
/// idle connections under a cap of one.
#[test]
fn a_lowered_cap_closes_live_surplus_idle_connections_past_ones_the_upstream_already_closed() {
    use connection_level::Op;
    let arrive = Op::Arrive {
        priority: false,
        fresh: false,
        patience_steps: 1,
    };
    let finish = Op::Finish {
        which: Which(0),
        reuse: true,
    };
    let ops = vec![
        arrive.clone(),
        arrive.clone(),
        arrive,
        finish.clone(),
        finish.clone(),
        finish,
        // The oldest idle connection, first in line to be closed by a lowered cap.
        Op::Kill(Which(0)),
        Op::SetCap(1),
    ];
    paused_runtime().block_on(connection_level::run(3, 0, 0, ops)).unwrap();
}

/// Found by the connection-level property: an idle connection closed to make room for a fresh retry was not counted
/// as closing, so under a lowered cap it passed for a live one, and the connection that then finished its exchange
/// was closed instead of going to the waiting retry.
#[test]
fn a_connection_closed_for_a_fresh_retry_counts_as_closing_under_a_lowered_cap() {
    use connection_level::Op;
    let arrive = |fresh| Op::Arrive {
        priority: false,
        fresh,
        patience_steps: 1,
    };
    let finish = Op::Finish {
        which: Which(0),
        reuse: true,
    };
    let ops = vec![
        arrive(false),
        arrive(true),
        Op::SetCap(2),
        // The first connection goes idle; the next fresh retry closes it to make room and waits.
        finish.clone(),
        arrive(true),
        Op::SetCap(1),
        // One live connection under a cap of one: it goes to the retry.
        finish,
    ];
    paused_runtime().block_on(connection_level::run(1, 0, 0, ops)).unwrap();
}
