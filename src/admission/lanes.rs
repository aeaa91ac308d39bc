//! Lanes: one sub-queue per client key, served by deficit round robin, so a client that sends many requests
//! waits behind its own, not in front of everyone else's.
//!
//! Owns the per-key order and the turns: each key with requests waiting takes `weight` consecutive grants per
//! round (every request costs one), then goes to the back. Requests without a key share one lane, kept apart from
//! the keyed ones so that an upstream without fairness pays for no hashing. A keyed lane outlives its last request
//! only while there are few lanes ([`KEPT_EMPTY`]): millions of distinct keys cost nothing once they are gone, and
//! a few regular ones are not rebuilt every time their queue forms. It never decides shedding or deadlines.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Up to this many keyed lanes stay in the map when they empty: building a lane again (a map entry and its
/// buffer) is most of the cost of a queue that forms and drains all the time.
pub(super) const KEPT_EMPTY: usize = 16;

struct Lane<T> {
    items: VecDeque<T>,
    weight: u32,
    /// Grants left in this key's current turn.
    credit: u32,
}

impl<T> Lane<T> {
    fn new(weight: u32) -> Self {
        Lane {
            items: VecDeque::new(),
            weight,
            credit: 0,
        }
    }

    /// Takes one request for this lane's turn; true when the turn is over (its credit spent or the lane empty).
    fn take(&mut self, newest: bool) -> (Option<T>, bool) {
        if self.credit == 0 {
            self.credit = self.weight.max(1);
        }
        let item = if newest {
            self.items.pop_back()
        } else {
            self.items.pop_front()
        };
        self.credit = self.credit.saturating_sub(1);
        if self.items.is_empty() {
            self.credit = 0;
        }
        (item, self.credit == 0)
    }
}

/// Whose turn it is: the shared lane's or a key's.
#[derive(Clone, PartialEq, Eq)]
enum Turn {
    Shared,
    Key(Arc<str>),
}

pub(super) struct Lanes<T> {
    shared: Lane<T>,
    lanes: HashMap<Arc<str>, Lane<T>>,
    /// Lanes with requests waiting, in turn order; the front one is served next.
    turns: VecDeque<Turn>,
    len: usize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes {
            shared: Lane::new(1),
            lanes: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> Lanes<T> {
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many requests `key` has waiting (`None`: the shared lane).
    pub(super) fn len_of(&self, key: Option<&str>) -> usize {
        match key {
            None => self.shared.items.len(),
            Some(key) => self.lanes.get(key).map_or(0, |lane| lane.items.len()),
        }
    }

    /// Adds `item` at the back of `key`'s lane (`None`: the shared one); a lane that had nothing waiting joins the
    /// end of the turns.
    pub(super) fn push(&mut self, key: Option<&Arc<str>>, weight: u32, item: T) {
        let (lane, turn) = match key {
            None => (&mut self.shared, Turn::Shared),
            Some(key) => (
                self.lanes.entry(key.clone()).or_insert_with(|| Lane::new(weight)),
                Turn::Key(key.clone()),
            ),
        };
        if lane.items.is_empty() {
            self.turns.push_back(turn);
        }
        lane.weight = weight.max(1);
        lane.items.push_back(item);
        self.len += 1;
    }

    /// The next request by the turns: from the lane whose turn it is, its oldest (or, `newest`, its latest).
    pub(super) fn pop(&mut self, newest: bool) -> Option<T> {
        let (item, turn_over, emptied_key) = match self.turns.front()? {
            Turn::Shared => {
                let (item, over) = self.shared.take(newest);
                (item, over, None)
            }
            Turn::Key(key) => {
                let lane = self.lanes.get_mut(key)?;
                let (item, over) = lane.take(newest);
                let emptied = lane.items.is_empty().then(|| key.clone());
                (item, over, emptied)
            }
        };
        if turn_over {
            let ended = self.turns.pop_front();
            let still_waiting = match &ended {
                Some(Turn::Shared) => !self.shared.items.is_empty(),
                Some(Turn::Key(key)) => self.lanes.get(key).is_some_and(|lane| !lane.items.is_empty()),
                None => false,
            };
            if let (true, Some(turn)) = (still_waiting, ended) {
                self.turns.push_back(turn);
            }
        }
        if let Some(key) = emptied_key {
            if self.lanes.len() > KEPT_EMPTY {
                self.lanes.remove(&key);
            }
        }
        if item.is_some() {
            self.len -= 1;
        }
        item
    }

    /// Removes the first request `matches` picks, wherever it waits; false if there is none.
    pub(super) fn remove(&mut self, mut matches: impl FnMut(&T) -> bool) -> bool {
        if let Some(index) = self.shared.items.iter().position(&mut matches) {
            self.shared.items.remove(index);
            self.len -= 1;
            if self.shared.items.is_empty() {
                self.shared.credit = 0;
                self.turns.retain(|turn| *turn != Turn::Shared);
            }
            return true;
        }
        let found = self.lanes.iter_mut().find_map(|(key, lane)| {
            lane.items
                .iter()
                .position(&mut matches)
                .map(|index| (key.clone(), index))
        });
        let Some((key, index)) = found else {
            return false;
        };
        if let Some(lane) = self.lanes.get_mut(&key) {
            lane.items.remove(index);
            self.len -= 1;
            if lane.items.is_empty() {
                lane.credit = 0;
                let turn = Turn::Key(key.clone());
                self.turns.retain(|queued| *queued != turn);
                if self.lanes.len() > KEPT_EMPTY {
                    self.lanes.remove(&key);
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    fn drain(lanes: &mut Lanes<String>) -> Vec<String> {
        std::iter::from_fn(|| lanes.pop(false)).collect()
    }

    #[test]
    fn a_greedy_key_waits_behind_its_own_requests_not_in_front_of_others() {
        let mut lanes = Lanes::default();
        for i in 0..4 {
            lanes.push(Some(&key("greedy")), 1, format!("g{i}"));
        }
        lanes.push(Some(&key("polite")), 1, "p0".to_string());
        assert_eq!(lanes.len_of(Some("greedy")), 4);
        assert_eq!(drain(&mut lanes), ["g0", "p0", "g1", "g2", "g3"]);
        assert!(lanes.is_empty());
        assert_eq!(lanes.len_of(Some("greedy")), 0);
    }

    #[test]
    fn weights_give_a_key_that_many_grants_per_round() {
        let mut lanes = Lanes::default();
        for i in 0..6 {
            lanes.push(Some(&key("heavy")), 3, format!("h{i}"));
            lanes.push(Some(&key("light")), 1, format!("l{i}"));
        }
        let order = drain(&mut lanes);
        assert_eq!(&order[..8], ["h0", "h1", "h2", "l0", "h3", "h4", "h5", "l1"]);
        assert_eq!(order.len(), 12);
    }

    #[test]
    fn many_keys_that_come_and_go_leave_at_most_a_few_empty_lanes_behind() {
        let mut lanes = Lanes::default();
        for i in 0..10_000 {
            lanes.push(Some(&key(&format!("client-{i}"))), 1, i);
            assert_eq!(lanes.pop(false), Some(i));
        }
        assert!(lanes.is_empty());
        assert!(lanes.lanes.len() <= KEPT_EMPTY + 1, "{} lanes kept", lanes.lanes.len());
        // A kept lane starts a fresh turn when it is used again.
        lanes.push(Some(&key("client-9999")), 2, 1);
        lanes.push(Some(&key("other")), 1, 2);
        lanes.push(Some(&key("client-9999")), 2, 3);
        assert_eq!(drain_numbers(&mut lanes), [1, 3, 2]);
    }

    fn drain_numbers(lanes: &mut Lanes<i32>) -> Vec<i32> {
        std::iter::from_fn(|| lanes.pop(false)).collect()
    }

    #[test]
    fn removing_a_keys_last_request_ends_its_turn() {
        let mut lanes = Lanes::default();
        lanes.push(Some(&key("a")), 1, "a0".to_string());
        lanes.push(Some(&key("b")), 1, "b0".to_string());
        lanes.push(Some(&key("b")), 1, "b1".to_string());
        assert!(lanes.remove(|item| item == "a0"));
        assert!(!lanes.remove(|item| item == "a0"));
        assert_eq!(lanes.len(), 2);
        assert_eq!(lanes.pop(true).as_deref(), Some("b1"), "newest first when asked");
        assert_eq!(drain(&mut lanes), ["b0"]);
    }
}
