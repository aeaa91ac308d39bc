//! The endpoint set changed in place (a reload's new list of endpoints): an endpoint kept keeps its connections,
//! its health and its ramp (a changed own cap put in force as a changed cap is), a new one joins under slow start,
//! and one that is gone drains: no new exchange or connection, its idle connections closed now and the rest as they
//! come back, each slot held until its socket is closed, and its place reused by a later endpoint only once nothing
//! of it is left. It never counts connections: [`super::slots::Slots`] does.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::endpoints::EndpointState;
use super::UpstreamPool;
use crate::config::Origin;

impl UpstreamPool {
    /// Makes `wanted` (origin and own cap each, the same scheme as the pool's) the upstream's endpoints.
    pub fn set_endpoints(self: &Arc<Self>, wanted: &[(Origin, usize)]) {
        let mut closed = Vec::new();
        let mut joined = Vec::new();
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut list: Vec<(Origin, usize)> = self.endpoints.load().as_ref().clone();
        let mut raised = false;
        for (at, (origin, _)) in list.iter().enumerate() {
            if state.slots.is_gone(at) || wanted.iter().any(|(kept, _)| kept == origin) {
                continue;
            }
            raised |= state.slots.set_gone(at, true);
            raised |= self.put_ramp(state, at, None);
            closed.extend(state.close_idle_at(at));
            tracing::info!(upstream = %self.name, endpoint = %origin.authority(),
                "endpoint gone: it drains, its connections closed as they come back");
        }
        for (origin, cap) in wanted {
            let place = list
                .iter()
                .enumerate()
                .position(|(at, (known, _))| known == origin && !state.slots.is_gone(at));
            match place {
                Some(at) => {
                    if list.get(at).is_some_and(|(_, was)| was != cap) {
                        raised |= state.slots.set_endpoint_cap(at, *cap);
                        if let Some(entry) = list.get_mut(at) {
                            entry.1 = *cap;
                        }
                    }
                }
                None => {
                    let at = state.slots.add_endpoint(&origin.authority(), *cap);
                    let entry = (origin.clone(), *cap);
                    if let Some(place) = list.get_mut(at) {
                        *place = entry;
                        if let Some(health) = state.endpoints.get_mut(at) {
                            *health = EndpointState::default();
                        }
                    } else {
                        list.push(entry);
                        state.endpoints.push(EndpointState::default());
                    }
                    raised = true;
                    joined.push((at, origin.authority()));
                }
            }
        }
        let live = (0..list.len()).filter(|at| !state.slots.is_gone(*at)).count();
        self.endpoints.store(Arc::new(list));
        self.live_endpoints.store(live, Ordering::Relaxed);
        for (at, address) in &joined {
            self.metrics.endpoint_known(address);
            self.start_ramp(state, *at);
            tracing::info!(upstream = %self.name, endpoint = %address, "endpoint joined the upstream");
        }
        self.apply_cap(guard, raised);
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(closed);
        self.check_health_if_several();
        self.prewarm();
    }
}
