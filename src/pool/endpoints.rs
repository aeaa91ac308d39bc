//! Endpoints: which one a slot dials, what a failed dial or a health check says about it, and its ejection and
//! return (which change the cap in force through [`super::slots::Slots`]). It never counts connections itself.

use std::sync::{Arc, Weak};

use tokio::time::Instant;

use super::{Grant, PoolState, Slot, UpstreamPool};

/// What the pool knows of one endpoint's health (its counts are in [`Slots`]); only under the pool's lock.
#[derive(Default)]
pub(super) struct EndpointState {
    /// Dials that failed in a row.
    pub(super) failures: u32,
    /// Ejections without a successful dial between them: the next one lasts `eject_backoff` x 2^this.
    pub(super) ejections: u32,
    /// Back from an ejection: the next failed dial ejects it again at once.
    pub(super) probation: bool,
    /// Counts ejections, so that the timer of one that a health check already ended does not end a later one.
    pub(super) generation: u64,
    /// A health check of it is under way.
    pub(super) checking: bool,
    /// What the admin API set: ready, draining or in maintenance.
    pub(super) admin: EndpointAdmin,
    /// Under slow start: its ramp.
    pub(super) ramp: Option<super::slow_start::Ramp>,
}

/// An endpoint's state as the admin API sets it (HAProxy's `set server state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointAdmin {
    /// In service.
    #[default]
    Ready,
    /// No new exchange and no new connection (health checks included); the exchanges it has finish, and its
    /// connections close as they come back.
    Drain,
    /// As `Drain`, shown apart: the operator's "down for maintenance".
    Maint,
}

impl EndpointAdmin {
    pub fn parse(text: &str) -> Option<EndpointAdmin> {
        match text.trim() {
            "ready" => Some(EndpointAdmin::Ready),
            "drain" => Some(EndpointAdmin::Drain),
            "maint" => Some(EndpointAdmin::Maint),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EndpointAdmin::Ready => "ready",
            EndpointAdmin::Drain => "drain",
            EndpointAdmin::Maint => "maint",
        }
    }
}

impl UpstreamPool {
    /// Puts the endpoint at `address` (`host:port`) in `admin`; its state before, or `None` for no such endpoint.
    /// Draining (or maintenance) takes it out of the cap in force and closes its idle connections now; the
    /// exchanges on it finish, and their connections close as they come back. Ready puts it back.
    pub fn set_endpoint_state(self: &Arc<Self>, address: &str, admin: EndpointAdmin) -> Option<EndpointAdmin> {
        let mut state = self.lock();
        let at = self.place_of(&state, address)?;
        let health = state.endpoints.get_mut(at)?;
        let was = health.admin;
        health.admin = admin;
        let raised = state.slots.set_drained(at, admin != EndpointAdmin::Ready);
        let closed = if admin == EndpointAdmin::Ready {
            Vec::new()
        } else {
            state.close_idle_at(at)
        };
        self.apply_cap(state, raised);
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(closed);
        tracing::info!(upstream = %self.name, endpoint = %address, from = was.as_str(), to = admin.as_str(),
            "endpoint state changed through the admin API");
        Some(was)
    }
}

impl UpstreamPool {
    /// Chooses the endpoint `slot` dials, under the lock, and counts a connection there (a tunnel's socket is
    /// counted against `max_tunnels` only, and may go to an endpoint without room): one with room under its own cap; among those, not ejected, then the fewest failed dials in a row, the fewest requests in flight,
    /// the fewest connections. An ejected endpoint only when no other has room. `None`: none has room, which
    /// cannot happen while the slot is counted (the pool's count never exceeds the sum of the endpoints' caps, and
    /// this slot is in the one but not yet in the other), and is a failed dial rather than a panic all the same.
    pub(super) fn choose_endpoint(&self, slot: &mut Slot) -> Option<usize> {
        if slot.endpoint.is_some() {
            return slot.endpoint;
        }
        let mut state = self.lock();
        let busy = state.busy();
        // A tunnel's socket is not among an endpoint's connections (its own cap bounds those): any endpoint may
        // take it, the healthiest and least busy first.
        let mut candidates: Vec<(usize, (bool, u32, usize, usize))> = state
            .slots
            .per_endpoint()
            .zip(&state.endpoints)
            .enumerate()
            .filter(|(at, _)| {
                if slot.tunnel {
                    !state.slots.is_drained(*at)
                } else {
                    state.slots.endpoint_has_room(*at)
                }
            })
            .map(|(at, ((_, open), health))| {
                let in_flight = busy.get(at).copied().unwrap_or(usize::MAX);
                (at, (state.slots.is_ejected(at), health.failures, in_flight, open))
            })
            .collect();
        candidates.sort_by_key(|(_, preference)| *preference);
        if slot.tunnel {
            return candidates.first().map(|(at, _)| *at);
        }
        // The best that still has room when counted: an older generation of the pool may take an endpoint's last
        // room between the look and the count.
        let chosen = candidates
            .into_iter()
            .map(|(at, _)| at)
            .find(|at| state.slots.count_at(*at))?;
        slot.endpoint = Some(chosen);
        Some(chosen)
    }

    /// The outcome of a dial to `endpoint`. A success ends its run of failures (and of ejections); a failure that
    /// makes `eject_after` in a row (or the first after an ejection) ejects it, if the upstream has other
    /// endpoints, for `eject_backoff` doubled per ejection in a row, at most `eject_backoff_max`.
    pub(super) fn dialled(self: &Arc<Self>, endpoint: usize, succeeded: bool) {
        let limits = self.limits();
        let mut guard = self.lock();
        let state = &mut *guard;
        let several = state.endpoints.len() > 1;
        let Some(health) = state.endpoints.get_mut(endpoint) else {
            return;
        };
        if succeeded {
            health.failures = 0;
            health.ejections = 0;
            health.probation = false;
            return;
        }
        health.failures = health.failures.saturating_add(1);
        let due = limits.eject_after > 0 && (health.failures >= limits.eject_after || health.probation);
        if !several || state.slots.is_ejected(endpoint) || !due {
            return;
        }
        health.probation = false;
        health.generation = health.generation.wrapping_add(1);
        let generation = health.generation;
        let backoff = limits
            .eject_backoff
            .saturating_mul(1u32 << health.ejections.min(16))
            .min(limits.eject_backoff_max);
        health.ejections = health.ejections.saturating_add(1);
        let address = self
            .endpoints
            .load()
            .get(endpoint)
            .map(|(origin, _)| origin.authority())
            .unwrap_or_default();
        tracing::warn!(upstream = %self.name, endpoint = %address, ?backoff, "endpoint ejected after failed dials");
        self.metrics.endpoint_ejected(&address);
        // The end is fixed now, not when the task first runs.
        self.spawn(end_ejection(
            Arc::downgrade(self),
            endpoint,
            generation,
            Instant::now() + backoff,
        ));
        let raised = state.slots.set_ejected(endpoint, true);
        self.apply_cap(guard, raised);
    }

    /// What a health check of `endpoint` may use, with nobody waiting and no check of it under way: the most
    /// recent usable idle connection to it, else a free slot if the endpoint has room under its own cap (issued
    /// and counted at the endpoint like a dial's). `None`: the check is skipped this round.
    pub(super) fn check_grant(self: &Arc<Self>, endpoint: usize) -> Option<Grant> {
        let mut state = self.lock();
        let checking = state
            .endpoints
            .get(endpoint)
            .is_none_or(|health| health.checking || health.admin == EndpointAdmin::Maint);
        if state.retired || !state.queue.is_empty() || checking {
            return None;
        }
        let limits = self.limits();
        let idle = state.idle.iter().rposition(|idle| {
            idle.conn.endpoint == endpoint && idle.conn.is_usable(&limits) && !idle.conn.lacks_room(&limits)
        });
        if let Some(idle) = idle.and_then(|at| state.idle.remove(at)) {
            if let Some(health) = state.endpoints.get_mut(endpoint) {
                health.checking = true;
            }
            return Some(Grant::Idle(idle.into_conn()));
        }
        let issued = state.slots.issue_at(endpoint)?;
        if let Some(health) = state.endpoints.get_mut(endpoint) {
            health.checking = true;
        }
        Some(Grant::Dial(Slot::issued(self.clone(), issued).dialling(endpoint)))
    }

    /// The outcome of a health check of `endpoint`: `None` says nothing (a reused connection failed: it may just
    /// have been closed while idle); a failure counts as a failed dial; a success ends the run of failures, and an
    /// ejection at once (the endpoint has just answered).
    pub(super) fn health_checked(self: &Arc<Self>, endpoint: usize, healthy: Option<bool>) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(health) = state.endpoints.get_mut(endpoint) else {
            return;
        };
        health.checking = false;
        let Some(healthy) = healthy else { return };
        if !healthy {
            drop(guard);
            self.dialled(endpoint, false);
            return;
        }
        health.failures = 0;
        health.ejections = 0;
        health.probation = false;
        if state.slots.is_ejected(endpoint) {
            health.generation = health.generation.wrapping_add(1);
            self.start_ramp(state, endpoint);
            let raised = state.slots.set_ejected(endpoint, false);
            self.apply_cap(guard, raised);
        }
    }
}

impl UpstreamPool {
    /// The place of the endpoint at `address` (`host:port`) among the upstream's endpoints now (not gone ones).
    pub(super) fn place_of(&self, state: &PoolState, address: &str) -> Option<usize> {
        self.endpoints
            .load()
            .iter()
            .enumerate()
            .position(|(at, (origin, _))| !state.slots.is_gone(at) && origin.authority() == address)
    }
}

impl PoolState {
    /// Starts closing `endpoint`'s idle connections and takes them out of the idle list: the caller drops them
    /// after the lock, and each connection's task then closes it and frees its slot.
    pub(super) fn close_idle_at(&mut self, endpoint: usize) -> Vec<super::IdleConn> {
        let mut closed = Vec::new();
        for idle in std::mem::take(&mut self.idle) {
            if idle.conn.endpoint == endpoint {
                self.start_closing(&idle.conn);
                closed.push(idle);
            } else {
                self.idle.push_back(idle);
            }
        }
        closed
    }

    /// Per endpoint, its connections that are not idle: the requests in flight there (and dials, closes).
    pub(super) fn busy(&self) -> Vec<usize> {
        let mut busy: Vec<usize> = self.slots.per_endpoint().map(|(_, open)| open).collect();
        for (endpoint, _) in self.idle_connections() {
            if let Some(count) = busy.get_mut(endpoint) {
                *count = count.saturating_sub(1);
            }
        }
        busy
    }

    /// The connections nothing is at work on, with their endpoints: each HTTP/1 connection in the idle list, and
    /// each HTTP/2 session with no stream at work (its permits are listed one by one, and it is counted once).
    pub(super) fn idle_connections(&self) -> Vec<(usize, &super::Conn)> {
        let mut found: Vec<(usize, &super::Conn)> = Vec::new();
        for idle in &self.idle {
            let conn = &idle.conn;
            let counted = match conn.session() {
                None => true,
                Some(session) => session.streams_out() == 0 && !found.iter().any(|(_, other)| other.same_session(conn)),
            };
            if counted {
                found.push((conn.endpoint, conn));
            }
        }
        found
    }
}

/// Ends an ejection after its backoff: the endpoint may be chosen again (on probation: one more failed dial
/// ejects it again at once, for twice as long), and the cap rises with it.
pub(super) async fn end_ejection(pool: Weak<UpstreamPool>, endpoint: usize, generation: u64, at: Instant) {
    tokio::time::sleep_until(at).await;
    let Some(pool) = pool.upgrade() else { return };
    let mut guard = pool.lock();
    let state = &mut *guard;
    let Some(health) = state.endpoints.get_mut(endpoint) else {
        return;
    };
    if !state.slots.is_ejected(endpoint) || health.generation != generation {
        // A health check ended this ejection already.
        return;
    }
    health.failures = 0;
    health.probation = true;
    // Back from an ejection: it ramps up again under slow start.
    pool.start_ramp(state, endpoint);
    let raised = state.slots.set_ejected(endpoint, false);
    pool.apply_cap(guard, raised);
}
