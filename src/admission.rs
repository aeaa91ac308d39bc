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
}
