use super::*;

/// FIFO with `max_queue` places, no fairness.
fn fifo(max_queue: usize) -> QueuePolicy {
    QueuePolicy {
        max_queue,
        discipline: Discipline::Fifo,
        target: Duration::from_millis(5),
        interval: Duration::from_millis(100),
        per_key_max: 0,
        weights: Arc::default(),
    }
}

#[test]
fn full_queue_sheds_but_a_retry_still_gets_the_front() {
    let mut q: WaitQueue<u32> = WaitQueue::new(fifo(1));
    let first = q.join(false, Instant::now(), None).unwrap();
    assert_eq!(q.join(false, Instant::now(), None).err(), Some(Shed::QueueFull));
    let retry = q.join(true, Instant::now(), None).unwrap();
    assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(retry.id));
    assert_eq!(q.next(Instant::now()).map(|w| w.id), Some(first.id));
    assert!(q.next(Instant::now()).is_none());
}

#[test]
fn a_waiter_that_leaves_is_gone_at_once_and_order_is_kept() {
    let mut q: WaitQueue<u32> = WaitQueue::new(fifo(10));
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
    let mut q: WaitQueue<u32> = WaitQueue::new(fifo(10));
    let ticket = q.join(false, Instant::now(), None).unwrap();
    drop(ticket);
    let waiter = q.next(Instant::now()).unwrap();
    assert_eq!(waiter.grant(7), Err(7));
}

fn policy(discipline: Discipline) -> QueuePolicy {
    QueuePolicy {
        discipline,
        ..fifo(100)
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
    let named = |name: &'static str| http::HeaderName::from_static(name);
    let default = named("x-request-timeout");
    let read = |pairs: &[(&'static str, &'static str)]| client_timeout(&headers(pairs), Some(&default), true);
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
    assert_eq!(client_timeout(&off, None, false), None);
    assert_eq!(client_timeout(&off, Some(&named("x-deadline-ms")), true), Some(ms(1)));
}

#[test]
fn zero_max_queue_sheds_every_waiter() {
    let mut q: WaitQueue<u32> = WaitQueue::new(fifo(0));
    assert_eq!(q.join(false, Instant::now(), None).err(), Some(Shed::QueueFull));
}

mod properties {
    //! The queue against a `VecDeque` of ids, over random joins, grants, departures and abandoned tickets.

    use std::collections::{BTreeMap, BTreeSet, VecDeque};

    use super::fifo;
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
            let mut queue: WaitQueue<u64> = WaitQueue::new(fifo(max_queue));
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
