//! The cap across the pools one upstream has had. A reload that moves an upstream (a new `url`, scheme or protocol;
//! a changed list of endpoints is changed in place, `membership`) builds a new pool and retires the old one, whose connections finish what
//! they carry before they close: until they have, they are still sockets at the upstream. Every generation's
//! [`super::slots::Slots`] counts its sockets here too and issues a slot only if the lineage, all generations
//! together, is under the newest generation's cap in force (and each endpoint address under the newest's own cap
//! for it), so a reload never lets the upstream see more than one cap's worth.
//!
//! It owns only counts. It never touches a connection or a waiter; a pool whose socket closed with nobody of its
//! own to take the room tells the other generations (see [`Lineage::others`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::UpstreamPool;

/// One upstream's sockets over all its pools, and the bound the newest pool puts on them.
pub(crate) struct Lineage {
    /// Sockets of every generation: dialling, busy, idle or closing.
    open: AtomicUsize,
    /// Of those, the ones on their way out.
    closing: AtomicUsize,
    /// The newest generation's cap in force.
    cap: AtomicUsize,
    /// The newest generation's number: only it moves `cap`.
    newest: AtomicU64,
    /// Per endpoint address, the sockets of every generation there and the newest generation's cap for it.
    addresses: Mutex<BTreeMap<String, Address>>,
    /// Every generation's pool still alive, oldest first, for one whose socket closed to tell the others.
    pools: Mutex<Vec<(u64, Weak<UpstreamPool>)>>,
}

#[derive(Default)]
struct Address {
    open: usize,
    /// `None`: not an endpoint of the newest pool (only the total bounds it).
    cap: Option<usize>,
}

impl Lineage {
    /// A first generation: `endpoints` are its addresses and their own caps.
    pub(super) fn new(endpoints: &[(String, usize)]) -> Lineage {
        let lineage = Lineage {
            open: AtomicUsize::new(0),
            closing: AtomicUsize::new(0),
            cap: AtomicUsize::new(0),
            newest: AtomicU64::new(0),
            addresses: Mutex::new(BTreeMap::new()),
            pools: Mutex::new(Vec::new()),
        };
        lineage.succeeded(endpoints);
        lineage
    }

    /// A new generation starts with these endpoints: their caps bound every generation's sockets there from now
    /// on. Its number, which [`Self::set_cap`] asks for.
    pub(super) fn succeeded(&self, endpoints: &[(String, usize)]) -> u64 {
        let mut addresses = self.addresses();
        for address in addresses.values_mut() {
            address.cap = None;
        }
        for (address, cap) in endpoints {
            addresses.entry(address.clone()).or_default().cap = Some(*cap);
        }
        self.newest.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// `generation`'s pool, once it exists.
    pub(super) fn joined(&self, generation: u64, pool: Weak<UpstreamPool>) {
        let mut pools = self.pools();
        pools.retain(|(_, pool)| pool.strong_count() > 0);
        pools.push((generation, pool));
    }

    /// The pools of every generation but `generation`, oldest first: a socket of `generation` has closed, and its
    /// room may let one of their waiters in (an older generation's waited longest).
    pub(super) fn others(&self, generation: u64) -> Vec<Arc<UpstreamPool>> {
        self.pools()
            .iter()
            .filter(|(other, _)| *other != generation)
            .filter_map(|(_, pool)| pool.upgrade())
            .collect()
    }

    fn pools(&self) -> MutexGuard<'_, Vec<(u64, Weak<UpstreamPool>)>> {
        self.pools.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `generation`'s cap in force, which bounds every generation if it is the newest.
    pub(super) fn set_cap(&self, generation: u64, cap: usize) {
        if generation == self.newest.load(Ordering::Acquire) {
            self.cap.store(cap, Ordering::Release);
        }
    }

    /// `generation`'s own cap for `address` (`None`: not one of its endpoints any more), if it is the newest.
    pub(super) fn set_address_cap(&self, generation: u64, address: &str, cap: Option<usize>) {
        if generation != self.newest.load(Ordering::Acquire) {
            return;
        }
        let mut addresses = self.addresses();
        match cap {
            Some(cap) => addresses.entry(address.to_string()).or_default().cap = Some(cap),
            None => {
                if let Some(at) = addresses.get_mut(address) {
                    at.cap = None;
                    if at.open == 0 {
                        addresses.remove(address);
                    }
                }
            }
        }
    }

    pub(super) fn has_room(&self) -> bool {
        self.open.load(Ordering::Acquire) < self.cap.load(Ordering::Acquire)
    }

    /// More sockets than the cap: none may be added, and a slot coming back must not be handed on.
    pub(super) fn over_cap(&self) -> bool {
        self.open.load(Ordering::Acquire) > self.cap.load(Ordering::Acquire)
    }

    /// More sockets not on their way out than the cap: a connection coming free must be closed.
    pub(super) fn live_over_cap(&self) -> bool {
        let live = self
            .open
            .load(Ordering::Acquire)
            .saturating_sub(self.closing.load(Ordering::Acquire));
        live > self.cap.load(Ordering::Acquire)
    }

    /// Counts one more socket if every generation together is under the cap.
    pub(super) fn issue(&self) -> bool {
        let cap = self.cap.load(Ordering::Acquire);
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < cap).then_some(open + 1)
            })
            .is_ok()
    }

    /// Whether `address` has room under the newest generation's cap for it (`own`: the asking generation's).
    pub(super) fn address_has_room(&self, address: &str, own: usize) -> bool {
        self.room_at(address, own) > 0
    }

    /// How many more sockets `address` may have under the newest generation's cap for it (`own`: the asking
    /// generation's).
    pub(super) fn room_at(&self, address: &str, own: usize) -> usize {
        let addresses = self.addresses();
        let at = addresses.get(address);
        let open = at.map_or(0, |at| at.open);
        own.min(at.and_then(|at| at.cap).unwrap_or(usize::MAX))
            .saturating_sub(open)
    }

    /// Counts one more socket at `address` if it has room (see [`Self::address_has_room`]).
    pub(super) fn count_at(&self, address: &str, own: usize) -> bool {
        let mut addresses = self.addresses();
        let at = addresses.entry(address.to_string()).or_default();
        if at.open >= own.min(at.cap.unwrap_or(usize::MAX)) {
            return false;
        }
        at.open += 1;
        true
    }

    /// A socket is closed: `address`, the one it was counted at; `closing`, whether it was counted closing.
    pub(super) fn take_back(&self, address: Option<&str>, closing: bool) {
        if closing {
            let _ = self
                .closing
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        let _ = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if let Some(address) = address {
            let mut addresses = self.addresses();
            if let Some(at) = addresses.get_mut(address) {
                at.open = at.open.saturating_sub(1);
                // An address no generation lists any more goes once its last socket has.
                if at.open == 0 && at.cap.is_none() {
                    addresses.remove(address);
                }
            }
        }
    }

    /// A counted socket started closing.
    pub(super) fn start_closing(&self) {
        self.closing.fetch_add(1, Ordering::AcqRel);
    }

    fn addresses(&self) -> MutexGuard<'_, BTreeMap<String, Address>> {
        // Each move is one statement on the counts: a poisoned lock is still consistent.
        self.addresses.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
