//! The cap's accounting: how many connections to the upstream exist, how many of them are on their way out, the
//! cap in force, and each endpoint's share.
//!
//! Only [`Slots`] changes those counts, and only through four moves: issue a slot if the cap allows, take one back,
//! change the cap, and count a connection as closing. Each move checks the invariant it keeps, and keeps the
//! upstream's [`Lineage`] (every pool it has had since reloads replaced them) counting the same sockets, so that
//! older generations still closing leave the newest no room past its cap. It never touches a connection, a waiter
//! or the lock (the pool calls it under its lock).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use super::lineage::Lineage;

/// The counts behind the cap; only under the pool's lock.
pub(super) struct Slots {
    /// Live slots: connections dialling, busy, idle or closing.
    open: usize,
    /// Of those, the ones on their way out: each will be taken back soon. `open - closing` is what a lowered cap is
    /// held against, so that closing connections are not closed twice over.
    closing: usize,
    /// The configured cap; a reload or the admin API changes it.
    configured: usize,
    /// The cap in force: the configured one, or less while endpoints are ejected.
    cap: usize,
    /// The most slots ever live at once.
    peak: usize,
    endpoints: Vec<EndpointSlots>,
    /// This upstream's sockets over all its pools, which every issue must also find room in.
    lineage: Arc<Lineage>,
    /// This pool's generation in the lineage.
    generation: u64,
}

struct EndpointSlots {
    /// Where it is dialled (`host:port`): how the lineage knows it across pools.
    address: String,
    /// Its own cap; `usize::MAX` for the one endpoint of an upstream given by `url` (the upstream's cap bounds it).
    cap: usize,
    /// Connections to it, from the moment a slot chose it to dial until the slot is taken back.
    open: usize,
    /// Of those, the ones on their way out.
    closing: usize,
    ejected: bool,
    /// Under slow start: the connections it may have now, below its own cap (`slow_start`).
    ramp: Option<usize>,
    /// Set to drain or to maintenance through the admin API: it takes no new connection (the others keep their own
    /// caps, and the upstream's total holds over all).
    drained: bool,
    /// No longer one of the upstream's endpoints (a reload or a discovery took it out): as drained, and its place
    /// is taken by a new endpoint once its last connection is back.
    gone: bool,
}

impl EndpointSlots {
    /// A new endpoint's counts: nothing open, in service.
    fn new(address: &str, cap: usize) -> EndpointSlots {
        EndpointSlots {
            address: address.to_string(),
            cap,
            open: 0,
            closing: 0,
            ejected: false,
            ramp: None,
            drained: false,
            gone: false,
        }
    }

    fn in_force(&self) -> usize {
        self.ramp.map_or(self.cap, |ramp| ramp.min(self.cap))
    }
}

/// Proof that [`Slots::issue`] counted one more slot; a [`super::Slot`] is made only from one, or it goes back
/// through [`Slots::unissue`].
#[must_use = "an issued count must become a Slot, or it is never taken back"]
pub(super) struct Issued(());

/// Whether a connection counts among those closing. One per connection, shared by its handle and its task, so
/// that it is counted once however many times a close is asked for, and not at all once its slot is back.
#[derive(Clone, Default)]
pub(super) struct ClosingMark(Arc<AtomicU8>);

const NOT_COUNTED: u8 = 0;
const COUNTED: u8 = 1;
const DONE: u8 = 2;

impl Slots {
    /// A count of its own (a first pool, the tunnels' count, tests): `endpoint_caps` in the order of the pool's
    /// endpoints, which are told apart by their place.
    pub(super) fn new(configured: usize, endpoint_caps: impl IntoIterator<Item = usize>) -> Slots {
        let endpoints: Vec<(String, usize)> = endpoint_caps
            .into_iter()
            .enumerate()
            .map(|(at, cap)| (at.to_string(), cap))
            .collect();
        Slots::for_endpoints(configured, &endpoints, None)
    }

    /// A pool's count over `endpoints` (address and own cap, in the pool's order): a new generation of
    /// `lineage`, the pool a reload replaces, or the first of its own.
    pub(super) fn for_endpoints(
        configured: usize,
        endpoints: &[(String, usize)],
        lineage: Option<Arc<Lineage>>,
    ) -> Slots {
        let (lineage, generation) = match lineage {
            Some(lineage) => {
                let generation = lineage.succeeded(endpoints);
                (lineage, generation)
            }
            None => (Arc::new(Lineage::new(endpoints)), 1),
        };
        let endpoints = endpoints
            .iter()
            .map(|(address, cap)| EndpointSlots::new(address, *cap))
            .collect();
        let mut slots = Slots {
            open: 0,
            closing: 0,
            configured,
            cap: 0,
            peak: 0,
            endpoints,
            lineage,
            generation,
        };
        slots.recompute();
        slots
    }

    pub(super) fn lineage(&self) -> &Arc<Lineage> {
        &self.lineage
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    pub(super) fn open(&self) -> usize {
        self.open
    }

    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    /// The cap in force.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Whether a slot could be issued now: under this pool's cap, the lineage under the newest pool's, and an
    /// endpoint left to dial for it.
    pub(super) fn has_room(&self) -> bool {
        self.open < self.cap && self.lineage.has_room() && self.room_to_place()
    }

    /// Whether one more slot would find an endpoint to count at, beyond the slots issued and not yet counted at one.
    /// Within one pool the cap in force sees to it; across generations it does not: an older pool still closing
    /// may hold an address's room under the newest pool's cap for it, and a slot issued with nowhere to dial was a
    /// `502`.
    fn room_to_place(&self) -> bool {
        let placed: usize = self.endpoints.iter().map(|at| at.open).sum();
        let unplaced = self.open.saturating_sub(placed);
        let mut room = 0usize;
        for at in self.endpoints.iter().filter(|at| !at.drained && !at.gone) {
            let own = at.in_force().saturating_sub(at.open);
            if own > 0 {
                room = room.saturating_add(own.min(self.lineage.room_at(&at.address, at.in_force())));
                if room > unplaced {
                    return true;
                }
            }
        }
        false
    }

    /// Whether a connection is on its way out (and will free its slot soon).
    pub(super) fn any_closing(&self) -> bool {
        self.closing > 0
    }

    /// More slots live than the cap in force (it was lowered): a slot that comes back must not be handed on.
    pub(super) fn over_cap(&self) -> bool {
        self.open > self.cap || self.lineage.over_cap()
    }

    /// More live connections, not counting those already on their way out, than the cap in force: a connection
    /// that comes free must be closed rather than kept.
    pub(super) fn live_over_cap(&self) -> bool {
        self.open.saturating_sub(self.closing) > self.cap || self.lineage.live_over_cap()
    }

    /// Counts one more slot if the cap in force allows it, here and over the lineage.
    pub(super) fn issue(&mut self) -> Option<Issued> {
        if self.open >= self.cap || !self.room_to_place() || !self.lineage.issue() {
            return None;
        }
        self.open += 1;
        self.peak = self.peak.max(self.open);
        self.check();
        Some(Issued(()))
    }

    /// Takes back a count [`Self::issue`] made for a slot nobody took: no socket was ever made for it.
    pub(super) fn unissue(&mut self, issued: Issued) {
        let Issued(()) = issued;
        self.lineage.take_back(None, false);
        self.open = self.open.saturating_sub(1);
        self.check();
    }

    /// [`Self::issue`] for a slot that dials `endpoint` at once, if the endpoint too has room under its own cap.
    pub(super) fn issue_at(&mut self, endpoint: usize) -> Option<Issued> {
        if !self.endpoint_has_room(endpoint) {
            return None;
        }
        let issued = self.issue()?;
        if self.count_at(endpoint) {
            return Some(issued);
        }
        // Another generation took the endpoint's last room since it was looked at: not issued after all.
        self.unissue(issued);
        None
    }

    /// Whether `endpoint` has room under its own cap for one more connection, over the lineage too.
    pub(super) fn endpoint_has_room(&self, endpoint: usize) -> bool {
        self.endpoints.get(endpoint).is_some_and(|endpoint| {
            !endpoint.drained
                && !endpoint.gone
                && endpoint.open < endpoint.in_force()
                && self.lineage.address_has_room(&endpoint.address, endpoint.in_force())
        })
    }

    /// A live slot is about to dial `endpoint`: it counts there until the slot is taken back, if the endpoint has
    /// room (another generation may have taken the last since it was looked at); false if not.
    pub(super) fn count_at(&mut self, endpoint: usize) -> bool {
        let Some(at) = self.endpoints.get_mut(endpoint) else {
            return false;
        };
        if at.open >= at.in_force() || !self.lineage.count_at(&at.address, at.in_force()) {
            return false;
        }
        at.open += 1;
        // A lowered cap of its own may leave it above until connections close, but never by a new one.
        debug_assert!(at.open <= at.in_force(), "an endpoint counted past its own cap");
        self.check();
        true
    }

    /// A slot is back: its connection's socket is closed, or it never had one. `endpoint`: the one it dialled;
    /// `closing`: its connection's mark, which is done with from here on.
    pub(super) fn take_back(&mut self, endpoint: Option<usize>, closing: Option<&ClosingMark>) {
        let was_closing = closing.is_some_and(|mark| mark.0.swap(DONE, Ordering::AcqRel) == COUNTED);
        if was_closing {
            self.closing = self.closing.saturating_sub(1);
        }
        let mut address = None;
        if let Some(at) = endpoint.and_then(|at| self.endpoints.get_mut(at)) {
            at.open = at.open.saturating_sub(1);
            if was_closing {
                at.closing = at.closing.saturating_sub(1);
            }
            address = Some(at.address.as_str());
        }
        self.lineage.take_back(address, was_closing);
        debug_assert!(self.open > 0, "a slot taken back that was never issued");
        self.open = self.open.saturating_sub(1);
        self.check();
    }

    /// Counts a connection the pool has started to close among those closing, once, and not at all if its slot is
    /// already back.
    /// `endpoint`: the one it goes to.
    pub(super) fn start_closing(&mut self, mark: &ClosingMark, endpoint: usize) {
        let counted = mark
            .0
            .compare_exchange(NOT_COUNTED, COUNTED, Ordering::AcqRel, Ordering::Acquire);
        if counted.is_ok() {
            self.closing += 1;
            if let Some(at) = self.endpoints.get_mut(endpoint) {
                at.closing += 1;
            }
            self.lineage.start_closing();
        }
        self.check();
    }

    /// Changes the configured cap; whether the cap in force rose.
    pub(super) fn set_configured(&mut self, configured: usize) -> bool {
        self.configured = configured;
        self.recompute()
    }

    /// Marks `endpoint` ejected or back; whether the cap in force rose.
    pub(super) fn set_ejected(&mut self, endpoint: usize, ejected: bool) -> bool {
        if let Some(at) = self.endpoints.get_mut(endpoint) {
            at.ejected = ejected;
        }
        self.recompute()
    }

    /// Marks `endpoint` drained (no new connection) or back in service; whether the cap in force rose.
    pub(super) fn set_drained(&mut self, endpoint: usize, drained: bool) -> bool {
        if let Some(at) = self.endpoints.get_mut(endpoint) {
            at.drained = drained;
        }
        self.recompute()
    }

    /// Puts `endpoint` under slow start at `ramp` connections, or (`None`) ends its ramp; whether the cap in force
    /// rose.
    pub(super) fn set_ramp(&mut self, endpoint: usize, ramp: Option<usize>) -> bool {
        if let Some(at) = self.endpoints.get_mut(endpoint) {
            at.ramp = ramp;
        }
        self.recompute()
    }

    /// The most connections `endpoint` may ever have in this pool: its own cap, or the upstream's when it has none.
    pub(super) fn endpoint_full(&self, endpoint: usize) -> usize {
        self.endpoints.get(endpoint).map_or(0, |at| at.cap.min(self.configured))
    }

    /// `endpoint`'s cap in force: its own, or its ramp's under slow start.
    pub(super) fn endpoint_in_force(&self, endpoint: usize) -> usize {
        self.endpoints.get(endpoint).map_or(0, EndpointSlots::in_force)
    }

    /// Whether `endpoint` takes no new connection and keeps none that comes back: drained, or gone.
    pub(super) fn is_drained(&self, endpoint: usize) -> bool {
        self.endpoints.get(endpoint).is_some_and(|at| at.drained || at.gone)
    }

    /// Whether a connection to `endpoint` that comes free is to be closed rather than kept or handed on: the
    /// endpoint is drained or gone, or has more connections not on their way out than its cap in force (its own
    /// cap or its ramp was lowered).
    pub(super) fn sheds_at(&self, endpoint: usize) -> bool {
        self.endpoints
            .get(endpoint)
            .is_some_and(|at| at.drained || at.gone || at.open.saturating_sub(at.closing) > at.in_force())
    }

    pub(super) fn is_gone(&self, endpoint: usize) -> bool {
        self.endpoints.get(endpoint).is_some_and(|at| at.gone)
    }

    /// Takes `endpoint` out of the upstream (`gone`) or back in; whether the cap in force rose.
    pub(super) fn set_gone(&mut self, endpoint: usize, gone: bool) -> bool {
        if let Some(at) = self.endpoints.get_mut(endpoint) {
            at.gone = gone;
            let cap = (!gone).then_some(at.cap);
            self.lineage.set_address_cap(self.generation, &at.address, cap);
        }
        self.recompute()
    }

    /// Gives `endpoint` its own cap `cap`; whether the cap in force rose.
    pub(super) fn set_endpoint_cap(&mut self, endpoint: usize, cap: usize) -> bool {
        if let Some(at) = self.endpoints.get_mut(endpoint) {
            at.cap = cap;
            self.lineage.set_address_cap(self.generation, &at.address, Some(cap));
        }
        self.recompute()
    }

    /// A new endpoint at `address` with its own `cap`: in the place of a gone one with nothing left there, or a new
    /// place at the end. Its place; the caller puts the cap in force (it never lowers).
    pub(super) fn add_endpoint(&mut self, address: &str, cap: usize) -> usize {
        let fresh = EndpointSlots::new(address, cap);
        self.lineage.set_address_cap(self.generation, address, Some(cap));
        let at = match self.endpoints.iter().position(|at| at.gone && at.open == 0) {
            Some(at) => {
                if let Some(place) = self.endpoints.get_mut(at) {
                    *place = fresh;
                }
                at
            }
            None => {
                self.endpoints.push(fresh);
                self.endpoints.len() - 1
            }
        };
        self.recompute();
        at
    }

    pub(super) fn is_ejected(&self, endpoint: usize) -> bool {
        self.endpoints.get(endpoint).is_some_and(|at| at.ejected)
    }

    /// Per endpoint: its own cap (`None` when the upstream's cap is its bound) and its connections.
    pub(super) fn per_endpoint(&self) -> impl Iterator<Item = (Option<usize>, usize)> + '_ {
        self.endpoints
            .iter()
            .map(|at| ((at.cap != usize::MAX).then_some(at.cap), at.open))
    }

    fn recompute(&mut self) -> bool {
        let cap = self.cap_allowed();
        let raised = cap > self.cap;
        self.cap = cap;
        self.lineage.set_cap(self.generation, cap);
        self.check();
        raised
    }

    /// The configured cap, and no more than the endpoints in service and not ejected can take between them (all
    /// in service when every one is ejected: trying them beats shedding everything). A drained endpoint (drain,
    /// maint) takes no new connection, so its room is none: counting it let requests be admitted to dial where no
    /// endpoint would take them, each a `502`.
    fn cap_allowed(&self) -> usize {
        let room = |ejected_too: bool| {
            self.endpoints
                .iter()
                .filter(|at| !at.gone && !at.drained && (ejected_too || !at.ejected))
                .fold(0usize, |sum, at| sum.saturating_add(at.in_force()))
        };
        let healthy = room(false);
        self.configured.min(if healthy == 0 { room(true) } else { healthy })
    }

    /// What every move keeps: no cap in force above the configured one, no more
    /// connections at endpoints than slots, no more closing than live. (The pool's count past a lowered cap is allowed: it falls as connections finish.)
    fn check(&self) {
        debug_assert!(self.cap <= self.configured, "a cap in force above the configured one");
        debug_assert!(
            self.closing <= self.open,
            "{} closing of {} open",
            self.closing,
            self.open
        );
        debug_assert!(
            self.endpoints.iter().map(|at| at.open).sum::<usize>() <= self.open,
            "more connections at endpoints than slots"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_slot_is_issued_past_the_cap_and_one_taken_back_makes_room() {
        let mut slots = Slots::new(2, [usize::MAX]);
        let issued: Vec<_> = std::iter::from_fn(|| slots.issue()).take(5).collect();
        assert_eq!(issued.len(), 2);
        assert!(!slots.has_room());
        slots.take_back(None, None);
        assert!(slots.issue().is_some());
        assert_eq!((slots.open(), slots.peak()), (2, 2));
    }

    #[test]
    fn the_cap_in_force_is_what_the_endpoints_not_ejected_can_take() {
        let mut slots = Slots::new(10, [3, 4]);
        assert_eq!(slots.cap(), 7);
        assert!(!slots.set_ejected(1, true));
        assert_eq!(slots.cap(), 3);
        assert!(slots.set_ejected(0, true), "all ejected: all are tried");
        assert_eq!(slots.cap(), 7);
        assert!(!slots.set_configured(5));
        assert_eq!(slots.cap(), 5);
    }

    #[test]
    fn a_connection_counts_as_closing_once_and_not_after_its_slot_is_back() {
        let mut slots = Slots::new(2, [usize::MAX]);
        let _issued = slots.issue();
        let mark = ClosingMark::default();
        slots.start_closing(&mark, 0);
        slots.start_closing(&mark, 0);
        assert!(slots.any_closing());
        slots.take_back(None, Some(&mark));
        assert!(!slots.any_closing());
        slots.start_closing(&mark, 0);
        assert!(!slots.any_closing(), "counted after its slot was back");
    }

    #[test]
    fn a_lowered_cap_is_exceeded_until_enough_slots_are_back() {
        let mut slots = Slots::new(3, [usize::MAX]);
        let _issued: Vec<_> = std::iter::from_fn(|| slots.issue()).collect();
        slots.set_configured(1);
        assert!(slots.over_cap() && slots.live_over_cap());
        let mark = ClosingMark::default();
        slots.start_closing(&mark, 0);
        assert!(slots.over_cap() && slots.live_over_cap());
        slots.take_back(None, Some(&mark));
        assert!(slots.over_cap());
        slots.take_back(None, None);
        assert!(!slots.over_cap() && !slots.has_room());
    }

    #[test]
    fn an_endpoint_takes_no_slot_past_its_own_cap() {
        let mut slots = Slots::new(10, [1, 2]);
        assert!(slots.issue_at(0).is_some());
        assert!(slots.issue_at(0).is_none());
        assert!(slots.issue_at(1).is_some());
        assert!(slots.endpoint_has_room(1));
        slots.take_back(Some(0), None);
        assert!(slots.endpoint_has_room(0));
    }

    #[test]
    fn a_ramp_bounds_its_endpoint_and_the_cap_in_force_until_it_ends() {
        let mut slots = Slots::new(10, [4, 4]);
        assert!(!slots.set_ramp(0, Some(1)));
        assert_eq!(slots.cap(), 5);
        assert!(slots.issue_at(0).is_some());
        assert!(slots.issue_at(0).is_none(), "the ramp's one is taken");
        assert!(slots.set_ramp(0, Some(2)));
        assert!(slots.issue_at(0).is_some());
        assert!(slots.set_ramp(0, None));
        assert_eq!(
            (slots.cap(), slots.endpoint_in_force(0), slots.endpoint_full(0)),
            (8, 4, 4)
        );
        let mut one = Slots::new(3, [usize::MAX]);
        one.set_ramp(0, Some(1));
        assert_eq!(
            (one.cap(), one.endpoint_full(0)),
            (1, 3),
            "a url's endpoint ramps to the upstream's cap"
        );
    }

    #[test]
    fn a_gone_endpoint_takes_nothing_new_and_its_place_is_reused_once_its_last_connection_is_back() {
        let mut slots = Slots::new(10, [2, 2]);
        assert!(slots.issue_at(0).is_some());
        assert!(!slots.set_gone(0, true));
        assert_eq!(slots.cap(), 2);
        assert!(slots.issue_at(0).is_none() && slots.is_drained(0));
        assert_eq!(
            slots.add_endpoint("c", 3),
            2,
            "a place of its own while 0 still has a connection"
        );
        assert_eq!(slots.cap(), 5);
        slots.take_back(Some(0), None);
        assert_eq!(slots.add_endpoint("d", 1), 0, "the gone one's place, now empty");
        assert_eq!(slots.cap(), 6);
        assert!(slots.set_endpoint_cap(2, 4));
        assert_eq!(slots.cap(), 7);
        // A lowered own cap under its connections: none is added there until enough are back.
        let mut two = Slots::new(10, [2]);
        assert!(two.issue_at(0).is_some() && two.issue_at(0).is_some());
        assert!(!two.set_endpoint_cap(0, 1));
        assert!(two.over_cap() && two.issue_at(0).is_none());
        two.take_back(Some(0), None);
        assert!(two.issue_at(0).is_none(), "one open at a cap of one");
        two.take_back(Some(0), None);
        assert!(two.issue_at(0).is_some());
    }

    #[test]
    fn a_new_generation_has_no_room_until_the_old_ones_sockets_are_back() {
        let endpoints = [("a:1".to_string(), usize::MAX)];
        let mut old = Slots::for_endpoints(2, &endpoints, None);
        let issued: Vec<_> = std::iter::from_fn(|| old.issue_at(0)).collect();
        assert_eq!(issued.len(), 2);
        let mut new = Slots::for_endpoints(2, &endpoints, Some(old.lineage().clone()));
        assert!(
            !new.has_room() && new.issue().is_none(),
            "the old generation's sockets fill the cap"
        );
        assert!(old.issue().is_none(), "nor may the old one add any");
        old.take_back(Some(0), None);
        assert!(new.issue_at(0).is_some());
        assert!(new.issue().is_none());
        // The newest generation's cap bounds them all, raised or lowered.
        new.set_configured(3);
        assert!(new.issue().is_some());
        new.set_configured(1);
        assert!(new.over_cap() && old.over_cap());
        old.set_configured(10);
        assert!(old.issue().is_none(), "an old generation's own cap moves nothing");
    }

    #[test]
    fn an_endpoint_keeps_its_own_cap_over_every_generation() {
        let mut old = Slots::for_endpoints(4, &[("a:1".to_string(), 2), ("b:1".to_string(), 2)], None);
        assert!(old.issue_at(0).is_some() && old.issue_at(0).is_some());
        let mut new = Slots::for_endpoints(
            4,
            &[("b:1".to_string(), 2), ("a:1".to_string(), 2)],
            Some(old.lineage().clone()),
        );
        assert!(!new.endpoint_has_room(1), "a:1 is full with the old generation's");
        assert!(new.issue_at(1).is_none());
        assert!(new.issue_at(0).is_some(), "b:1 has room");
    }

    #[test]
    fn no_slot_is_issued_that_could_find_no_endpoint_under_the_newest_generations_caps() {
        let url = [("a:1".to_string(), usize::MAX)];
        let mut old = Slots::for_endpoints(4, &url, None);
        for _ in 0..3 {
            assert!(old.issue_at(0).is_some());
        }
        let mut new = Slots::for_endpoints(
            4,
            &[("a:1".to_string(), 2), ("b:1".to_string(), 2)],
            Some(old.lineage().clone()),
        );
        assert!(
            !old.has_room() && old.issue().is_none(),
            "a:1 holds 3 against the newest's 2: the old generation has nowhere to dial"
        );
        // The newest has b:1, but one slot issued and not yet placed takes its last room in the lineage's total.
        let unplaced = new.issue();
        assert!(unplaced.is_some());
        assert!(new.issue().is_none());
        old.take_back(Some(0), None);
        assert!(!old.has_room(), "a:1 at the newest's cap of 2");
        assert!(new.has_room(), "a:1 or b:1 for one more");
        old.take_back(Some(0), None);
        assert!(old.issue().is_some(), "a:1 has room again");
        if let Some(unplaced) = unplaced {
            new.unissue(unplaced);
        }
    }
}
