//! Admission: the bounded queue of requests waiting for an upstream connection, and the shedding decisions.
//!
//! Owns the waiter list and its discipline (FIFO, with retries allowed to the front) and the two shed reasons. It
//! never touches a connection: what a waiter is handed (an idle connection or the right to dial one) is the pool's
//! business, so the discipline can change without touching the pool.

use std::collections::VecDeque;

use tokio::sync::oneshot;

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Shed {
    #[error("queue full")]
    QueueFull,
    #[error("queue timeout")]
    QueueTimeout,
}

/// A request waiting for a grant `G`; it leaves the queue by being granted or by removing itself.
pub struct Waiter<G> {
    id: u64,
    grant: oneshot::Sender<G>,
}

impl<G> Waiter<G> {
    /// Hands the grant over; gives it back if the waiter is already gone.
    pub fn grant(self, grant: G) -> Result<(), G> {
        self.grant.send(grant)
    }
}

/// The waiting queue of one upstream. Not synchronised: the pool holds it under its own lock.
pub struct WaitQueue<G> {
    waiters: VecDeque<Waiter<G>>,
    next_id: u64,
    max_queue: usize,
}

/// A place in the queue, as seen by the waiting request.
pub struct Ticket<G> {
    pub id: u64,
    pub granted: oneshot::Receiver<G>,
}

impl<G> WaitQueue<G> {
    pub fn new(max_queue: usize) -> Self {
        WaitQueue {
            waiters: VecDeque::new(),
            next_id: 0,
            max_queue,
        }
    }

    /// A new bound applies to arrivals; waiters already queued keep their place.
    pub fn set_max_queue(&mut self, max_queue: usize) {
        self.max_queue = max_queue;
    }

    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Joins the back of the queue, or sheds when it is full. A retry of a request that was already admitted
    /// (`priority`) goes to the front and is never shed for a full queue: it has waited its turn once.
    pub fn join(&mut self, priority: bool) -> Result<Ticket<G>, Shed> {
        if !priority && self.waiters.len() >= self.max_queue {
            return Err(Shed::QueueFull);
        }
        let (tx, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let waiter = Waiter { id, grant: tx };
        if priority {
            self.waiters.push_front(waiter);
        } else {
            self.waiters.push_back(waiter);
        }
        Ok(Ticket { id, granted: rx })
    }

    /// The next waiter to serve.
    pub fn pop_oldest(&mut self) -> Option<Waiter<G>> {
        self.waiters.pop_front()
    }

    /// Removes a waiter that gave up (timeout, client gone); false if it was already taken by [`Self::pop_oldest`].
    pub fn leave(&mut self, id: u64) -> bool {
        match self.waiters.iter().position(|w| w.id == id) {
            Some(index) => {
                self.waiters.remove(index);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queue_sheds_but_a_retry_still_gets_the_front() {
        let mut q: WaitQueue<u32> = WaitQueue::new(1);
        let first = q.join(false).unwrap();
        assert_eq!(q.join(false).err(), Some(Shed::QueueFull));
        let retry = q.join(true).unwrap();
        assert_eq!(q.pop_oldest().map(|w| w.id), Some(retry.id));
        assert_eq!(q.pop_oldest().map(|w| w.id), Some(first.id));
        assert!(q.pop_oldest().is_none());
    }

    #[test]
    fn a_waiter_that_leaves_is_gone_at_once_and_order_is_kept() {
        let mut q: WaitQueue<u32> = WaitQueue::new(10);
        let a = q.join(false).unwrap();
        let b = q.join(false).unwrap();
        let c = q.join(false).unwrap();
        assert!(q.leave(b.id));
        assert!(!q.leave(b.id));
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop_oldest().map(|w| w.id), Some(a.id));
        assert_eq!(q.pop_oldest().map(|w| w.id), Some(c.id));
    }

    #[test]
    fn a_grant_to_a_departed_waiter_comes_back() {
        let mut q: WaitQueue<u32> = WaitQueue::new(10);
        let ticket = q.join(false).unwrap();
        drop(ticket);
        let waiter = q.pop_oldest().unwrap();
        assert_eq!(waiter.grant(7), Err(7));
    }

    #[test]
    fn zero_max_queue_sheds_every_waiter() {
        let mut q: WaitQueue<u32> = WaitQueue::new(0);
        assert_eq!(q.join(false).err(), Some(Shed::QueueFull));
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
            fn every_waiter_ends_once_in_fifo_order_and_only_retries_pass_a_full_queue(
                max_queue in 0..4usize,
                ops in prop::collection::vec(op(), 1..80),
            ) {
                let mut queue: WaitQueue<u64> = WaitQueue::new(max_queue);
                // The ids in the queue, front first; the tickets the test still holds; how each waiter ended.
                let mut model: VecDeque<u64> = VecDeque::new();
                let mut tickets: BTreeMap<u64, Option<Ticket<u64>>> = BTreeMap::new();
                let mut ends: BTreeMap<u64, End> = BTreeMap::new();
                let mut retries: BTreeSet<u64> = BTreeSet::new();
                for op in ops {
                    match op {
                        Op::Join { priority } => match queue.join(priority) {
                            Ok(ticket) => {
                                prop_assert!(priority || model.len() < max_queue, "joined a full queue");
                                prop_assert!(!tickets.contains_key(&ticket.id), "id {} reused", ticket.id);
                                if priority {
                                    retries.insert(ticket.id);
                                    model.push_front(ticket.id);
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
                            let waiter = queue.pop_oldest();
                            prop_assert_eq!(waiter.as_ref().map(|w| w.id), model.pop_front());
                            if let Some(waiter) = waiter {
                                let id = waiter.id;
                                match (waiter.grant(id), tickets.get_mut(&id).and_then(Option::take)) {
                                    (Ok(()), Some(mut ticket)) => {
                                        prop_assert_eq!(ticket.granted.try_recv().ok(), Some(id));
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
                while let Some(waiter) = queue.pop_oldest() {
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
