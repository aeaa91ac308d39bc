//! Lanes: one sub-queue per client key, served by deficit round robin, so a client that sends many requests
//! waits behind its own, not in front of everyone else's.
//!
//! Owns the per-key order and the turns: each key with requests waiting takes `weight` consecutive grants per
//! round (every request costs one), then goes to the back. A key's lane exists only while it has requests, so
//! millions of distinct keys cost nothing once they are gone. It never decides shedding or deadlines; without
//! fairness every request is in the one shared lane, which is plain FIFO.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

struct Lane<T> {
    items: VecDeque<T>,
    weight: u32,
    /// Grants left in this key's current turn.
    credit: u32,
}

pub struct Lanes<T> {
    lanes: HashMap<Arc<str>, Lane<T>>,
    /// Keys with requests waiting, in turn order; the front one is served next.
    turns: VecDeque<Arc<str>>,
    len: usize,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes {
            lanes: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> Lanes<T> {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many requests `key` has waiting.
    pub fn len_of(&self, key: &str) -> usize {
        self.lanes.get(key).map_or(0, |lane| lane.items.len())
    }

    /// Adds `item` at the back of `key`'s lane; a key that had nothing waiting joins the end of the turns.
    pub fn push(&mut self, key: &Arc<str>, weight: u32, item: T) {
        let lane = self.lanes.entry(key.clone()).or_insert_with(|| Lane {
            items: VecDeque::new(),
            weight,
            credit: 0,
        });
        if lane.items.is_empty() {
            self.turns.push_back(key.clone());
        }
        lane.weight = weight.max(1);
        lane.items.push_back(item);
        self.len += 1;
    }

    /// The next request by the turns: from the key whose turn it is, its oldest (or, `newest`, its latest).
    pub fn pop(&mut self, newest: bool) -> Option<T> {
        let key = self.turns.front()?.clone();
        let lane = self.lanes.get_mut(&key)?;
        if lane.credit == 0 {
            lane.credit = lane.weight;
        }
        let item = if newest {
            lane.items.pop_back()
        } else {
            lane.items.pop_front()
        };
        lane.credit = lane.credit.saturating_sub(1);
        if lane.items.is_empty() {
            self.lanes.remove(&key);
            self.turns.pop_front();
        } else if lane.credit == 0 {
            self.turns.rotate_left(1);
        }
        if item.is_some() {
            self.len -= 1;
        }
        item
    }

    /// Removes the first request `matches` picks, wherever it waits; false if there is none.
    pub fn remove(&mut self, mut matches: impl FnMut(&T) -> bool) -> bool {
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
                self.lanes.remove(&key);
                self.turns.retain(|turn| *turn != key);
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
            lanes.push(&key("greedy"), 1, format!("g{i}"));
        }
        lanes.push(&key("polite"), 1, "p0".to_string());
        assert_eq!(lanes.len_of("greedy"), 4);
        assert_eq!(drain(&mut lanes), ["g0", "p0", "g1", "g2", "g3"]);
        assert!(lanes.is_empty());
        assert_eq!(lanes.len_of("greedy"), 0);
    }

    #[test]
    fn weights_give_a_key_that_many_grants_per_round() {
        let mut lanes = Lanes::default();
        for i in 0..6 {
            lanes.push(&key("heavy"), 3, format!("h{i}"));
            lanes.push(&key("light"), 1, format!("l{i}"));
        }
        let order = drain(&mut lanes);
        assert_eq!(&order[..8], ["h0", "h1", "h2", "l0", "h3", "h4", "h5", "l1"]);
        assert_eq!(order.len(), 12);
    }

    #[test]
    fn removing_a_keys_last_request_ends_its_turn() {
        let mut lanes = Lanes::default();
        lanes.push(&key("a"), 1, "a0".to_string());
        lanes.push(&key("b"), 1, "b0".to_string());
        lanes.push(&key("b"), 1, "b1".to_string());
        assert!(lanes.remove(|item| item == "a0"));
        assert!(!lanes.remove(|item| item == "a0"));
        assert_eq!(lanes.len(), 2);
        assert_eq!(lanes.pop(true).as_deref(), Some("b1"), "newest first when asked");
        assert_eq!(drain(&mut lanes), ["b0"]);
    }
}
