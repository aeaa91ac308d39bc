//! Admission: the bounded queue of requests waiting for an upstream connection, its discipline, and the
//! shedding decisions.
//!
//! Owns the waiter lists and the order they are served in: retries of admitted requests first, then priority
//! classes highest first, within a class the clients' lanes in deficit round robin (one shared lane without
//! fairness), and within a lane the upstream's discipline (FIFO; adaptive LIFO, newest first once a queue has
//! stood for a CoDel interval; CoDel, FIFO that sheds long waiters once every request for an interval has waited
//! past the target), skipping requests whose client deadline has passed. It decides every shed reason but the queue timeout's moment, which the
//! waiting request's own timer keeps. It never touches a connection: what a waiter is handed (an idle connection
//! or the right to dial one) is the pool's business, so the discipline can change without touching the pool.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

mod deadline;
mod lanes;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::time::Instant;

pub use deadline::client_timeout;

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
        }
    }
}

/// The order waiting requests are served in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Discipline {
    /// Oldest first.
    #[default]
    Fifo,
    /// Oldest first until the queue has been non-empty for `codel_interval`, then newest first: under sustained
    /// overload the fresh requests, whose clients still wait, are the ones served in time.
    AdaptiveLifo,
    /// Oldest first; once every request served over `codel_interval` waited longer than `codel_target`, those
    /// that waited over twice the target are shed instead of served.
    Codel,
}

/// The queue's bounds, discipline and fairness, from the upstream's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuePolicy {
    pub max_queue: usize,
    pub discipline: Discipline,
    pub target: Duration,
    pub interval: Duration,
    /// Most requests one client key may have waiting; 0: only `max_queue` bounds them.
    pub per_key_max: usize,
    /// Grants per round for the keys named; every other key gets 1.
    pub weights: Arc<BTreeMap<String, u32>>,
}

impl QueuePolicy {
    /// FIFO with `max_queue` places, no fairness.
    pub fn fifo(max_queue: usize) -> Self {
        QueuePolicy {
            max_queue,
            discipline: Discipline::Fifo,
            target: Duration::from_millis(5),
            interval: Duration::from_millis(100),
            per_key_max: 0,
            weights: Arc::default(),
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
pub struct Now(Option<Instant>);

impl Now {
    pub fn get(&mut self) -> Instant {
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
pub struct Waiter<G> {
    id: u64,
    answer: oneshot::Sender<Result<G, Shed>>,
    since: Instant,
    deadline: Option<Instant>,
}

impl<G> Waiter<G> {
    /// Hands the grant over; gives it back if the waiter is already gone.
    pub fn grant(self, grant: G) -> Result<(), G> {
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
pub struct WaitQueue<G> {
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
pub struct Ticket<G> {
    pub id: u64,
    pub answer: oneshot::Receiver<Result<G, Shed>>,
}

impl<G> WaitQueue<G> {
    pub fn new(policy: QueuePolicy) -> Self {
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
    pub fn set_policy(&mut self, policy: QueuePolicy) {
        if policy.discipline != self.policy.discipline {
            self.above_target_since = None;
        }
        self.policy = policy;
    }

    pub fn len(&self) -> usize {
        self.retries.len() + self.waiting
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Joins the queue at `now`, or sheds when it is full. A retry of a request that was already admitted
    /// (`priority`) is served before the others and is never shed for a full queue: it has waited its turn once.
    pub fn join(&mut self, priority: bool, now: Instant, deadline: Option<Instant>) -> Result<Ticket<G>, Shed> {
        self.join_at(priority, now, deadline, &Place::default())
    }

    /// [`Self::join`] in a priority class and a client's lane; a key at `per_key_max` is shed for its quota.
    pub fn join_at(
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
        let waiter = Waiter {
            id,
            answer: tx,
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
        Ok(Ticket { id, answer: rx })
    }

    /// Whether a retry of an admitted request is waiting.
    pub fn has_retries(&self) -> bool {
        !self.retries.is_empty()
    }

    /// Whether a request that is not a retry is waiting.
    pub fn has_waiting(&self) -> bool {
        self.waiting > 0
    }

    /// The next waiter to serve at `now`. On the way, waiters whose deadline has passed are shed, and so are
    /// those CoDel gives up on.
    pub fn next(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
        self.next_from(now.into(), Among::Any)
    }

    /// [`Self::next`] among the retries only: what a grant the adaptive limit holds back from new requests may
    /// still go to.
    pub fn next_retry(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
        self.next_from(now.into(), Among::Retries)
    }

    /// [`Self::next`] among the requests that are not retries only.
    pub fn next_waiting(&mut self, now: impl Into<Now>) -> Option<Waiter<G>> {
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

    /// Removes a waiter that gave up (timeout, client gone); false if it was already taken by [`Self::next`].
    pub fn leave(&mut self, id: u64) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queue_sheds_but_a_retry_still_gets_the_front() {
        let mut q: WaitQueue<u32> = WaitQueue::new(QueuePolicy::fifo(1));
        let first = q.join(false, Instant::now(), None).unwrap();
        assert_eq!(q.join(false, Instant::now(), None).err(), Some(Shed::QueueFull));
        let retry = q.join(true, Instant::now(), None).unwrap();
        assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(retry.id));
        assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(first.id));
        assert!(q.next(Instant::now()).is_none());
    }

    #[test]
    fn a_waiter_that_leaves_is_gone_at_once_and_order_is_kept() {
        let mut q: WaitQueue<u32> = WaitQueue::new(QueuePolicy::fifo(10));
        let a = q.join(false, Instant::now(), None).unwrap();
        let b = q.join(false, Instant::now(), None).unwrap();
        let c = q.join(false, Instant::now(), None).unwrap();
        assert!(q.leave(b.id));
        assert!(!q.leave(b.id));
        assert_eq!(q.len(), 2);
        assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(a.id));
        assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(c.id));
    }

    #[test]
    fn a_grant_to_a_departed_waiter_comes_back() {
        let mut q: WaitQueue<u32> = WaitQueue::new(QueuePolicy::fifo(10));
        let ticket = q.join(false, Instant::now(), None).unwrap();
        drop(ticket);
        let waiter = q.next(Instant::now()).unwrap();
        assert_eq!(waiter.grant(7), Err(7));
    }

    fn policy(discipline: Discipline) -> QueuePolicy {
        QueuePolicy {
            discipline,
            ..QueuePolicy::fifo(100)
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// What a ticket was answered: a grant's value, a shed reason, or nothing yet.
    fn answered(ticket: &mut Ticket<u32>) -> Option<Result<u32, Shed>> {
        ticket.answer.try_recv().ok()
    }

    #[test]
    fn adaptive_lifo_serves_oldest_first_until_the_queue_has_stood_for_an_interval_then_newest_first() {
        let mut q: WaitQueue<u32> = WaitQueue::new(policy(Discipline::AdaptiveLifo));
        let t0 = Instant::now();
        let ids: Vec<u64> = (0..4).map(|i| q.join(false, t0 + ms(i), None).unwrap().id).collect();
        // A young queue: FIFO.
        assert_eq!(q.next(t0 + ms(10)).map(|w| w.id), Some(ids[0]));
        // Non-empty since t0, now past the 100 ms interval: newest first.
        assert_eq!(q.next(t0 + ms(150)).map(|w| w.id), Some(ids[3]));
        assert_eq!(q.next(t0 + ms(151)).map(|w| w.id), Some(ids[2]));
        // A retry still goes first.
        let retry = q.join(true, t0 + ms(152), None).unwrap();
        assert_eq!(q.next(t0 + ms(153)).map(|w| w.id), Some(retry.id));
        assert_eq!(q.next(t0 + ms(154)).map(|w| w.id), Some(ids[1]));
        // Once it has emptied, a new queue is young again.
        let a = q.join(false, t0 + ms(200), None).unwrap();
        let _b = q.join(false, t0 + ms(201), None).unwrap();
        assert_eq!(q.next(t0 + ms(210)).map(|w| w.id), Some(a.id));
    }

    #[test]
    fn codel_sheds_waiters_over_twice_the_target_only_once_every_wait_has_stood_above_it_for_an_interval() {
        let mut q: WaitQueue<u32> = WaitQueue::new(policy(Discipline::Codel));
        let t0 = Instant::now();
        let mut tickets: Vec<Ticket<u32>> = (0..6).map(|_| q.join(false, t0, None).unwrap()).collect();
        // 20 ms waits are over the 5 ms target, but not yet for an interval: served.
        assert_eq!(q.next(t0 + ms(20)).map(|w| w.id), Some(tickets[0].id));
        assert_eq!(q.next(t0 + ms(60)).map(|w| w.id), Some(tickets[1].id));
        // 100 ms after the first wait above target, a 125 ms wait is over twice the target: shed, and so is the
        // next; the queue then runs dry.
        assert!(q.next(t0 + ms(125)).is_none());
        for ticket in &mut tickets[2..] {
            assert_eq!(answered(ticket), Some(Err(Shed::Overload)));
        }
        // A short wait ends the episode: the next long one is served again.
        let quick = q.join(false, t0 + ms(200), None).unwrap();
        assert_eq!(q.next(t0 + ms(201)).map(|w| w.id), Some(quick.id));
        let slow = q.join(false, t0 + ms(210), None).unwrap();
        assert_eq!(q.next(t0 + ms(260)).map(|w| w.id), Some(slow.id));
    }

    #[test]
    fn an_empty_queue_ends_a_codel_episode_so_a_later_queue_is_not_shed_without_an_interval_above_target() {
        let mut q: WaitQueue<u32> = WaitQueue::new(policy(Discipline::Codel));
        let t0 = Instant::now();
        let first = q.join(false, t0, None).unwrap();
        assert_eq!(q.next(t0 + ms(20)).map(|w| w.id), Some(first.id), "an episode begins");
        assert!(q.next(t0 + ms(21)).is_none(), "and the queue runs dry");
        // An hour of requests served at once, then a small queue: its first long wait starts a new episode.
        let later = t0 + Duration::from_secs(3600);
        let mut waiter = q.join(false, later, None).unwrap();
        assert_eq!(q.next(later + ms(11)).map(|w| w.id), Some(waiter.id));
        assert_eq!(answered(&mut waiter), None, "served, not shed");
    }

    #[test]
    fn fifo_never_sheds_for_waiting_long() {
        let mut q: WaitQueue<u32> = WaitQueue::new(policy(Discipline::Fifo));
        let t0 = Instant::now();
        let ids: Vec<u64> = (0..3).map(|_| q.join(false, t0, None).unwrap().id).collect();
        for (i, id) in ids.into_iter().enumerate() {
            assert_eq!(q.next(t0 + Duration::from_secs(10 + i as u64)).map(|w| w.id), Some(id));
        }
    }

    #[test]
    fn a_waiter_whose_deadline_passed_is_shed_instead_of_served() {
        let mut q: WaitQueue<u32> = WaitQueue::new(policy(Discipline::Fifo));
        let t0 = Instant::now();
        let mut late = q.join(false, t0, Some(t0 + ms(50))).unwrap();
        let patient = q.join(false, t0, Some(t0 + ms(500))).unwrap();
        assert_eq!(q.next(t0 + ms(100)).map(|w| w.id), Some(patient.id));
        assert_eq!(answered(&mut late), Some(Err(Shed::Deadline)));
        assert!(q.is_empty());
    }

    #[test]
    fn patience_ends_at_the_earlier_of_the_queue_timeout_and_the_client_deadline() {
        let t0 = Instant::now();
        let queue_only = Patience::queue(t0 + ms(100));
        assert_eq!(queue_only.gives_up(), (t0 + ms(100), Shed::QueueTimeout));
        let sooner = Patience {
            client_deadline: Some(t0 + ms(40)),
            ..queue_only
        };
        assert_eq!(sooner.gives_up(), (t0 + ms(40), Shed::Deadline));
        let later = Patience {
            client_deadline: Some(t0 + ms(400)),
            ..queue_only
        };
        assert_eq!(later.gives_up(), (t0 + ms(100), Shed::QueueTimeout));
    }

    #[test]
    fn client_timeouts_are_read_from_the_configured_header_and_grpc_timeout_and_the_shorter_wins() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = http::HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, http::HeaderValue::from_static(value));
            }
            map
        };
        let read = |pairs: &[(&'static str, &'static str)]| client_timeout(&headers(pairs), "x-request-timeout", true);
        assert_eq!(read(&[("x-request-timeout", "250")]), Some(ms(250)));
        assert_eq!(read(&[("grpc-timeout", "2S")]), Some(Duration::from_secs(2)));
        assert_eq!(read(&[("grpc-timeout", "1500u")]), Some(Duration::from_micros(1500)));
        assert_eq!(read(&[("grpc-timeout", "1H")]), Some(Duration::from_secs(3600)));
        assert_eq!(
            read(&[("x-request-timeout", "900"), ("grpc-timeout", "300m")]),
            Some(ms(300))
        );
        for unreadable in ["", "-5", "1.5", "10s", "99999999999999"] {
            assert_eq!(read(&[("x-request-timeout", unreadable)]), None, "{unreadable:?}");
        }
        for unreadable in ["S", "5", "123456789S", "5x", "5 S"] {
            assert_eq!(read(&[("grpc-timeout", unreadable)]), None, "{unreadable:?}");
        }
        // Turned off: neither is read.
        let off = headers(&[("x-request-timeout", "10"), ("grpc-timeout", "1m")]);
        assert_eq!(client_timeout(&off, "", false), None);
        assert_eq!(client_timeout(&off, "x-deadline-ms", true), Some(ms(1)));
    }

    #[test]
    fn zero_max_queue_sheds_every_waiter() {
        let mut q: WaitQueue<u32> = WaitQueue::new(QueuePolicy::fifo(0));
        assert_eq!(q.join(false, Instant::now(), None).err(), Some(Shed::QueueFull));
    }

    mod properties {
        //! The queue against a `VecDeque` of ids, over random joins, grants, departures and abandoned tickets.

        use std::collections::{BTreeMap, BTreeSet, VecDeque};

        use proptest::prelude::*;
        use proptest::sample::Index;

        use super::super::*;

        #[derive(Debug, Clone)]
        enum Op {
            Join {
                priority: bool,
            },
            /// The pool serves the oldest waiter with a grant that names it.
            Serve,
            /// A waiter gives up and removes itself.
            Leave(Index),
            /// A waiter's receiver goes without leaving the queue: whatever it is granted must come back.
            Abandon(Index),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => prop::bool::weighted(0.2).prop_map(|priority| Op::Join { priority }),
                3 => Just(Op::Serve),
                1 => any::<Index>().prop_map(Op::Leave),
                1 => any::<Index>().prop_map(Op::Abandon),
            ]
        }

        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum End {
            Served,
            Returned,
            Left,
        }

        fn end_once(ends: &mut BTreeMap<u64, End>, id: u64, end: End) -> Result<(), TestCaseError> {
            let earlier = ends.insert(id, end);
            prop_assert!(earlier.is_none(), "waiter {id} ended twice: {earlier:?} then {end:?}");
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn every_waiter_ends_once_in_fifo_order_behind_retries_and_only_retries_pass_a_full_queue(
                max_queue in 0..4usize,
                ops in prop::collection::vec(op(), 1..80),
            ) {
                let mut queue: WaitQueue<u64> = WaitQueue::new(QueuePolicy::fifo(max_queue));
                // The ids in the queue, front first; the tickets the test still holds; how each waiter ended.
                let mut model: VecDeque<u64> = VecDeque::new();
                let mut tickets: BTreeMap<u64, Option<Ticket<u64>>> = BTreeMap::new();
                let mut ends: BTreeMap<u64, End> = BTreeMap::new();
                let mut retries: BTreeSet<u64> = BTreeSet::new();
                for op in ops {
                    match op {
                        Op::Join { priority } => match queue.join(priority, Instant::now(), None) {
                            Ok(ticket) => {
                                prop_assert!(priority || model.len() < max_queue, "joined a full queue");
                                prop_assert!(!tickets.contains_key(&ticket.id), "id {} reused", ticket.id);
                                if priority {
                                    // Behind earlier retries, ahead of everyone else.
                                    let behind = model.iter().take_while(|id| retries.contains(id)).count();
                                    retries.insert(ticket.id);
                                    model.insert(behind, ticket.id);
                                } else {
                                    model.push_back(ticket.id);
                                }
                                tickets.insert(ticket.id, Some(ticket));
                            }
                            Err(shed) => {
                                prop_assert_eq!(shed, Shed::QueueFull);
                                prop_assert!(!priority && model.len() >= max_queue, "shed with room");
                            }
                        },
                        Op::Serve => {
                            let waiter = queue.next(Instant::now());
                            prop_assert_eq!(waiter.as_ref().map(|w| w.id), model.pop_front());
                            if let Some(waiter) = waiter {
                                let id = waiter.id;
                                match (waiter.grant(id), tickets.get_mut(&id).and_then(Option::take)) {
                                    (Ok(()), Some(mut ticket)) => {
                                        prop_assert_eq!(ticket.answer.try_recv().ok(), Some(Ok(id)));
                                        end_once(&mut ends, id, End::Served)?;
                                    }
                                    (Err(back), None) => {
                                        prop_assert_eq!(back, id, "another waiter's grant came back");
                                        end_once(&mut ends, id, End::Returned)?;
                                    }
                                    (granted, held) => prop_assert!(
                                        false,
                                        "grant {:?} to waiter {} whose ticket is held: {}",
                                        granted, id, held.is_some()
                                    ),
                                }
                            }
                        }
                        Op::Leave(which) => {
                            let held: Vec<u64> = model.iter().copied().filter(|id| tickets[id].is_some()).collect();
                            if !held.is_empty() {
                                let id = held[which.index(held.len())];
                                prop_assert!(queue.leave(id));
                                prop_assert!(!queue.leave(id), "left twice");
                                model.retain(|&queued| queued != id);
                                tickets.insert(id, None);
                                end_once(&mut ends, id, End::Left)?;
                            }
                        }
                        Op::Abandon(which) => {
                            let held: Vec<u64> = model.iter().copied().filter(|id| tickets[id].is_some()).collect();
                            if !held.is_empty() {
                                tickets.insert(held[which.index(held.len())], None);
                            }
                        }
                    }
                    prop_assert_eq!(queue.len(), model.len());
                    prop_assert_eq!(queue.is_empty(), model.is_empty());
                    let retries_queued = model.iter().filter(|id| retries.contains(id)).count();
                    prop_assert!(queue.len() <= max_queue + retries_queued, "depth past max_queue");
                }
                // Whatever is still queued is served in order; nobody is lost or served twice.
                while let Some(waiter) = queue.next(Instant::now()) {
                    prop_assert_eq!(Some(waiter.id), model.pop_front());
                    let id = waiter.id;
                    let end = if waiter.grant(id).is_ok() { End::Served } else { End::Returned };
                    end_once(&mut ends, id, end)?;
                }
                prop_assert!(model.is_empty());
                prop_assert_eq!(ends.len(), tickets.len(), "a waiter never ended");
            }
        }
    }
}
