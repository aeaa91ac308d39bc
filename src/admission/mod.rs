//! Admission: the bounded queue of requests waiting for an upstream connection, its discipline, and the
//! shedding decisions.
//!
//! Owns the waiter lists and the order they are served in: retries of admitted requests first, then priority
//! classes highest first, within a class the clients' lanes in deficit round robin (one shared lane without
//! fairness), and within a lane the upstream's discipline (FIFO; adaptive LIFO, newest first once a queue has
//! stood for a CoDel interval; CoDel, FIFO that sheds long waiters once every request for an interval has waited
//! past the target), skipping requests whose client deadline has passed. It decides every shed reason but the
//! queue timeout's moment, which the waiting request's own timer keeps. It never touches a connection: what a waiter is handed (an idle connection
//! or the right to dial one) is the pool's business, so the discipline can change without touching the pool.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

mod deadline;
mod lanes;
#[cfg(test)]
mod tests;

use tokio::sync::oneshot;
use tokio::time::Instant;

pub(crate) use crate::config::Discipline;
use crate::config::UpstreamConfig;

pub(crate) use deadline::client_timeout;
pub use deadline::is_grpc;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Shed {
    #[error("queue full")]
    QueueFull,
    #[error("queue timeout")]
    QueueTimeout,
    /// CoDel: the queue has stood above its target for an interval, and this request had waited twice the target.
    #[error("overload")]
    Overload,
    /// The client's own deadline (`X-Request-Timeout`, `grpc-timeout`) passed before the request could start.
    #[error("deadline passed")]
    Deadline,
    /// Its client's key already had `fair_max_queue` requests waiting: that client's quota, not the service's
    /// capacity.
    #[error("client quota")]
    Quota,
    /// `retry_budget`: a client's retry beyond what first attempts have earned.
    #[error("retry budget")]
    RetryBudget,
    /// `stall_timeout`: every slot busy and no exchange finished for that long; the upstream is taken for stuck.
    #[error("upstream stalled")]
    Stalled,
}

impl Shed {
    /// The machine-readable name: the `X-Floodgate-Shed-Reason` header's value and the metrics outcome's suffix.
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::QueueTimeout => "queue_timeout",
            Shed::Overload => "overload",
            Shed::Deadline => "deadline",
            Shed::Quota => "quota",
            Shed::Stalled => "upstream_stalled",
            Shed::RetryBudget => "retry_budget",
        }
    }
}

/// The queue's bounds, discipline and fairness, from the upstream's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueuePolicy {
    pub(crate) max_queue: usize,
    pub(crate) discipline: Discipline,
    pub(crate) target: Duration,
    pub(crate) interval: Duration,
    /// Most requests one client key may have waiting; 0: only `max_queue` bounds them.
    pub(crate) per_key_max: usize,
    /// Grants per round for the keys named; every other key gets 1.
    pub(crate) weights: Arc<BTreeMap<String, u32>>,
}

impl QueuePolicy {
    /// The queue an upstream's configuration asks for.
    pub(crate) fn of(upstream: &UpstreamConfig) -> QueuePolicy {
        QueuePolicy {
            max_queue: upstream.max_queue,
            discipline: upstream.queue_discipline,
            target: upstream.codel_target,
            interval: upstream.codel_interval,
            per_key_max: upstream.fair_max_queue,
            weights: Arc::new(upstream.fair_weights.clone()),
        }
    }
}

/// Where a request waits: its priority class (higher first) and its client's key (`None`: the shared lane).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Place {
    pub class: u8,
    pub key: Option<Arc<str>>,
}

/// How long a request may wait: the queue's own bound and, when the client sent one, its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patience {
    pub queue_timeout_at: Instant,
    pub client_deadline: Option<Instant>,
}

impl Patience {
    /// Only the queue's bound.
    pub fn queue(queue_timeout_at: Instant) -> Self {
        Patience {
            queue_timeout_at,
            client_deadline: None,
        }
    }

    /// When the wait ends without a grant, and what the request is shed for then.
    pub fn gives_up(&self) -> (Instant, Shed) {
        match self.client_deadline {
            Some(deadline) if deadline < self.queue_timeout_at => (deadline, Shed::Deadline),
            _ => (self.queue_timeout_at, Shed::QueueTimeout),
        }
    }
}

/// The time, read from the clock at most once and only when asked for: serving FIFO waiters without deadlines
/// needs none, and on some machines a clock read costs as much as the rest of a hand-off.
#[derive(Debug, Default)]
pub(crate) struct Now(Option<Instant>);

impl Now {
    pub(crate) fn get(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
}

impl From<Instant> for Now {
    fn from(at: Instant) -> Self {
        Now(Some(at))
    }
}

/// A request waiting for a grant `G`; it leaves the queue by being granted, by being shed, or by removing
/// itself.
pub(crate) struct Waiter<G> {
    id: u64,
    answer: oneshot::Sender<Result<G, Shed>>,
    taker: Taker<G>,
    since: Instant,
    deadline: Option<Instant>,
}

/// Takes a grant where it is made: for a waiter whose rest of its path may run on whichever thread makes the grant,
/// so that what one worker thread frees reaches the upstream again without waiting for another thread's turn.
pub(crate) trait TakeGrant<G>: Send + Sync {
    /// Takes `grant`, or gives it back when the waiter has gone.
    fn take(&self, grant: G) -> Result<(), G>;
}

/// A waiter's taker, set (at most once) by whoever holds its ticket; until then grants go through the answer.
pub(crate) type Taker<G> = Arc<OnceLock<Box<dyn TakeGrant<G>>>>;

impl<G> Waiter<G> {
    /// Hands the grant over; gives it back if the waiter is already gone. A waiter with a taker takes it on this
    /// thread, and its own wait then ends with nothing (its answer's sender dropped here).
    pub(crate) fn grant(self, grant: G) -> Result<(), G> {
        if let Some(taker) = self.taker.get() {
            return taker.take(grant);
        }
        match self.answer.send(Ok(grant)) {
            Ok(()) => Ok(()),
            Err(Ok(grant)) => Err(grant),
            // Only the grant was sent.
            Err(Err(_)) => Ok(()),
        }
    }

    fn shed(self, reason: Shed) {
        // A waiter that already left needs no answer.
        let _ = self.answer.send(Err(reason));
    }
}

/// The waiting queue of one upstream. Not synchronised: the pool holds it under its own lock.
pub(crate) struct WaitQueue<G> {
    /// Retries of admitted requests: served before anyone else, never shed by the discipline.
    retries: VecDeque<Waiter<G>>,
    /// By priority class; the highest class with anyone waiting is served first.
    classes: BTreeMap<u8, lanes::Lanes<Waiter<G>>>,
    waiting: usize,
    next_id: u64,
    policy: QueuePolicy,
    /// Since when the queue has been non-empty: adaptive LIFO's test for a standing queue.
    busy_since: Option<Instant>,
    /// CoDel: since when every request served has waited longer than the target.
    above_target_since: Option<Instant>,
}

/// Which waiters [`WaitQueue::next_from`] may pick.
#[derive(Clone, Copy)]
enum Among {
    Any,
    Retries,
    Waiting,
}

/// A place in the queue, as seen by the waiting request.
pub(crate) struct Ticket<G> {
    pub id: u64,
    pub answer: oneshot::Receiver<Result<G, Shed>>,
    /// Set to have grants taken where they are made ([`TakeGrant`]).
    pub taker: Taker<G>,
}

impl<G> WaitQueue<G> {
    pub(crate) fn new(policy: QueuePolicy) -> Self {
        WaitQueue {
            retries: VecDeque::new(),
            classes: BTreeMap::new(),
            waiting: 0,
            next_id: 0,
            policy,
            busy_since: None,
            above_target_since: None,
        }
    }

    /// A new bound or discipline applies from now on; waiters already queued keep their place.
    pub(crate) fn set_policy(&mut self, policy: QueuePolicy) {
        if policy.discipline != self.policy.discipline {
            self.above_target_since = None;
        }
        self.policy = policy;
    }

    pub(crate) fn len(&self) -> usize {
        self.retries.len() + self.waiting
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Joins the queue at `now`, or sheds when it is full. A retry of a request that was already admitted
    /// (`priority`) is served before the others and is never shed for a full queue: it has waited its turn once.
    pub(crate) fn join(&mut self, priority: bool, now: Instant, deadline: Option<Instant>) -> Result<Ticket<G>, Shed> {
        self.join_at(priority, now, deadline, &Place::default())
    }

    /// [`Self::join`] in a priority class and a client's lane; a key at `per_key_max` is shed for its quota.
    pub(crate) fn join_at(
        &mut self,
        priority: bool,
        now: Instant,
        deadline: Option<Instant>,
        place: &Place,
    ) -> Result<Ticket<G>, Shed> {
        if !priority && self.len() >= self.policy.max_queue {
            return Err(Shed::QueueFull);
        }
        let key = place.key.as_ref();
        let per_key_max = self.policy.per_key_max;
        if let (false, Some(key), 1..) = (priority, key, per_key_max) {
            let queued = self
                .classes
                .values()
                .map(|lanes| lanes.len_of(Some(key)))
                .sum::<usize>();
            if queued >= per_key_max {
                return Err(Shed::Quota);
            }
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        if self.is_empty() {
            self.busy_since = Some(now);
            // The queue had emptied: whatever CoDel episode there was has ended, and this queue starts afresh
            // (requests served at once in between never passed through CoDel to end it).
            self.above_target_since = None;
        }
        let taker = Taker::default();
        let waiter = Waiter {
            id,
            answer: tx,
            taker: taker.clone(),
            since: now,
            deadline,
        };
        if priority {
            self.retries.push_back(waiter);
        } else {
            let weight = key
                .and_then(|key| self.policy.weights.get(key.as_ref()))
                .copied()
                .unwrap_or(1);
            self.classes.entry(place.class).or_default().push(key, weight, waiter);
            self.waiting += 1;
        }
        Ok(Ticket { id, answer: rx, taker })
    }

    /// Whether a retry of an admitted request is waiting.
    pub(crate) fn has_retries(&self) -> bool {
        !self.retries.is_empty()
    }

    /// Whether a request that is not a retry is waiting.
    pub(crate) fn has_waiting(&self) -> bool {
        self.waiting > 0
    }

    /// The next waiter to serve at `now`. On the way, waiters whose deadline has passed are shed, and so are
    /// those CoDel gives up on.
    pub(crate) fn next(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
        self.next_from(now.into(), Among::Any)
    }

    /// [`Self::next`] among the retries only: what a grant the adaptive limit holds back from new requests may
    /// still go to.
    pub(crate) fn next_retry(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
        self.next_from(now.into(), Among::Retries)
    }

    /// [`Self::next`] among the requests that are not retries only.
    pub(crate) fn next_waiting(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
        self.next_from(now.into(), Among::Waiting)
    }

    fn next_from(&mut self, mut now: Now, among: Among) -> Option<Waiter<G>> {
        loop {
            let interval = self.policy.interval;
            let newest = self.policy.discipline == Discipline::AdaptiveLifo
                && self
                    .busy_since
                    .is_some_and(|since| now.get().saturating_duration_since(since) >= interval);
            let waiter = match among {
                Among::Any => match self.retries.pop_front() {
                    Some(retry) => Some(retry),
                    None => self.pop_waiting(newest),
                },
                Among::Retries => self.retries.pop_front(),
                Among::Waiting => self.pop_waiting(newest),
            };
            if self.is_empty() {
                self.busy_since = None;
            }
            let waiter = waiter?;
            if waiter.deadline.is_some_and(|deadline| deadline <= now.get()) {
                waiter.shed(Shed::Deadline);
                continue;
            }
            if self.policy.discipline == Discipline::Codel && self.codel_drops(&waiter, now.get()) {
                waiter.shed(Shed::Overload);
                continue;
            }
            return Some(waiter);
        }
    }

    /// From the highest class with anyone waiting, the next by the lanes' turns.
    fn pop_waiting(&mut self, newest: bool) -> Option<Waiter<G>> {
        let lanes = self.classes.values_mut().rev().find(|lanes| !lanes.is_empty())?;
        let waiter = lanes.pop(newest)?;
        self.waiting -= 1;
        Some(waiter)
    }

    /// CoDel's decision for a waiter about to be served.
    fn codel_drops(&mut self, waiter: &Waiter<G>, now: Instant) -> bool {
        let waited = now.saturating_duration_since(waiter.since);
        if waited < self.policy.target {
            self.above_target_since = None;
            return false;
        }
        let since = *self.above_target_since.get_or_insert(now);
        now.saturating_duration_since(since) >= self.policy.interval && waited > self.policy.target * 2
    }

    /// Sheds every waiter, retries too, with `reason`; how many there were.
    pub(crate) fn shed_all(&mut self, reason: Shed) -> usize {
        let mut shed = 0;
        while let Some(waiter) = self.retries.pop_front().or_else(|| self.pop_waiting(false)) {
            waiter.shed(reason);
            shed += 1;
        }
        self.busy_since = None;
        shed
    }

    /// Removes a waiter that gave up (timeout, client gone); false if it was already taken by [`Self::next`].
    pub(crate) fn leave(&mut self, id: u64) -> bool {
        let removed = match self.retries.iter().position(|w| w.id == id) {
            Some(index) => self.retries.remove(index).is_some(),
            None => {
                let left = self.classes.values_mut().any(|lanes| lanes.remove(|w| w.id == id));
                if left {
                    self.waiting -= 1;
                }
                left
            }
        };
        if self.is_empty() {
            self.busy_since = None;
        }
        removed
    }
}
