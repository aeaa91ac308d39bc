//! The limits in force: a changed cap, queue bound or adaptive limit put into effect, retirement by a reload, and
//! the pace figures shed answers and the adaptive limit read.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use super::{adaptive, PoolState, UpstreamPool};
use crate::config::UpstreamConfig;
use crate::error::ShedAdvice;
use crate::tls::UpstreamTls;

impl UpstreamPool {
    /// Whether the pool was retired by a reload.
    pub(super) fn is_retired(&self) -> bool {
        self.lock().retired
    }

    /// Puts a changed cap in force (`raised`: it rose): raised, its new slots go to the oldest waiters at once;
    /// lowered, surplus idle connections close now (oldest first) and busy ones as they come free.
    pub(super) fn apply_cap<'a>(self: &'a Arc<Self>, mut state: MutexGuard<'a, PoolState>, raised: bool) {
        let evicted = state.evict_surplus_idle();
        if raised {
            self.admit_admissible(state);
        } else {
            drop(state);
        }
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(evicted);
    }

    /// Puts a new adaptive limit in force; raised, it serves the waiters it makes room for at once. Lowered, it
    /// closes nothing: leases end as they do, and their connections go idle until the count is below it.
    pub(super) fn set_adaptive_limit(self: &Arc<Self>, limit: usize) {
        let mut state = self.lock();
        let raised = limit > state.limit;
        state.limit = limit;
        if raised {
            self.admit_admissible(state);
        }
    }

    /// Leases counted against the adaptive limit (grants on their way to a waiter included).
    #[cfg(test)]
    pub(super) fn leased(&self) -> usize {
        self.lock().leased
    }

    /// Requests in flight (leases held, grants on their way to a waiter) as the adaptive limit reads them at a
    /// dispatch; 0 while it is off, read then without taking the pool's lock on the request's path.
    pub fn in_flight_for_limit(&self) -> usize {
        if self.adaptive.is_on() {
            self.lock().leased
        } else {
            0
        }
    }

    /// A response head arrived `took` after its request was dispatched with `in_flight` requests in flight: the
    /// response-time histogram's, the drain pace's, the adaptive limit's and `endpoint`'s slow start's input.
    /// Lock-free unless it closes the limit's window or an endpoint ramps.
    pub fn responded(self: &Arc<Self>, in_flight: usize, took: Duration, endpoint: Option<usize>) {
        self.metrics.responded(took);
        self.paced(took);
        if let Some(endpoint) = endpoint {
            self.ramp_answered(endpoint, took);
        }
        self.adaptive
            .observe(in_flight, took, |limit| self.set_adaptive_limit(limit));
    }

    /// The pace at which the queue drains, from the upstream's response times: for the small and buffered
    /// responses that dominate, the time to the response head is most of the time a request holds its slot, and
    /// it is measured anyway (no clock read of its own on the request path). An average over roughly the last
    /// eight; a lost update between two racing responses only makes the estimate a little older.
    pub(super) fn paced(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let old = self.hold_us.load(Ordering::Relaxed);
        let new = if old == 0 { sample } else { old - old / 8 + sample / 8 };
        self.hold_us.store(new.max(1), Ordering::Relaxed);
    }

    /// What a shed answer tells its client: the configured status, and when to come back: the time the queue
    /// ahead of it, plus itself, takes to drain at the recent pace (`cap` requests at a time, each holding its slot
    /// for the recent average), in whole seconds from 1 to 60.
    pub fn shed_advice(&self) -> ShedAdvice {
        let (queued, cap) = {
            let state = self.lock();
            (state.queue.len(), state.slots.cap().min(state.limit).max(1))
        };
        let hold = Duration::from_micros(self.hold_us.load(Ordering::Relaxed));
        let drain = hold.mul_f64((queued + 1) as f64 / cap as f64);
        let retry_after_secs = drain.as_secs_f64().ceil().clamp(1.0, 60.0) as u64;
        let retry_after_ms = (drain.as_millis() as u64).clamp(1, 60_000);
        let limits = self.limits();
        let status = http::StatusCode::from_u16(limits.shed_status).unwrap_or(http::StatusCode::SERVICE_UNAVAILABLE);
        let quota_status =
            http::StatusCode::from_u16(limits.quota_status).unwrap_or(http::StatusCode::TOO_MANY_REQUESTS);
        ShedAdvice {
            status,
            quota_status,
            retry_after_secs,
            retry_after_ms,
        }
    }

    /// A reload: new limits (see [`Self::set_limits`]) and the TLS client built from the reloaded files. When the
    /// TLS settings changed, idle connections made under the old ones are closed; busy ones finish.
    pub fn reconfigure(self: &Arc<Self>, limits: UpstreamConfig, tls: Option<UpstreamTls>) {
        let old = self.limits();
        let tls_changed = (
            &old.tls_ca,
            &old.tls_client_cert,
            &old.tls_client_key,
            &old.tls_server_name,
        ) != (
            &limits.tls_ca,
            &limits.tls_client_cert,
            &limits.tls_client_key,
            &limits.tls_server_name,
        );
        self.tls.store(tls.map(Arc::new));
        self.set_limits(limits);
        if tls_changed {
            self.close_idle();
        }
    }

    /// Puts new limits in force. A raised cap issues its new slots to waiters now; a lowered one closes surplus
    /// idle connections now (oldest first) and the surplus busy ones as they finish (see `hand_on`).
    /// Requests already queued keep their place under a lowered `max_queue`; `queue_timeout` applies to
    /// arrivals from now on.
    pub fn set_limits(self: &Arc<Self>, limits: UpstreamConfig) {
        self.change_limits(|_| limits);
    }

    /// Changes only the cap (the admin API's `PUT /upstreams/{name}/max_connections`).
    pub fn set_max_connections(self: &Arc<Self>, max_connections: usize) {
        self.change_limits(|current| UpstreamConfig {
            max_connections,
            ..current.clone()
        });
    }

    /// Reads, changes and stores the limits under the pool's lock, so a reload and an admin call that race
    /// cannot leave the cap in force and the stored limits disagreeing. The adaptive limit then takes its
    /// settings from the limits stored by then (turned on, it starts from `min_connections`; turned off, nothing
    /// but the cap bounds the leases, and waiters it held back are served at once).
    pub(super) fn change_limits(self: &Arc<Self>, change: impl FnOnce(&UpstreamConfig) -> UpstreamConfig) {
        let (raised, surplus_idle) = {
            let mut state = self.lock();
            let limits = change(&self.limits());
            // With `replicas`, the caps are the upstream's totals and this replica takes its share.
            let replicas = self.replicas();
            let raised = state
                .slots
                .set_configured(super::replicas::share(limits.max_connections, replicas));
            // A lowered bound closes no tunnel: it refuses new ones until fewer are open.
            self.tunnel_count
                .set_bound(super::replicas::share(limits.max_tunnels, replicas));
            state.queue.set_policy(crate::admission::QueuePolicy::of(&limits));
            self.limits.store(Arc::new(limits));
            (raised, state.evict_surplus_idle())
        };
        // Dropped outside the lock: each connection's task closes it and frees its slot.
        drop(surplus_idle);
        // The estimate's lock before the pool's, as when a window closes.
        let params = adaptive::Params::of(&self.limits());
        self.adaptive
            .reconfigure(params, |limit| self.set_adaptive_limit(limit));
        if raised {
            // A raised cap's slots go to the oldest waiters, as freed ones do.
            self.admit_admissible(self.lock());
        }
        // Slow start turned off ends every ramp.
        self.end_ramps();
        // A reload may have set or raised `min_idle`, or raised the cap it is held within.
        self.prewarm();
    }

    /// The upstream was removed or replaced by a reload: requests already admitted or queued are served, idle
    /// connections close now, and every other connection closes as it comes free. The pool goes away with the
    /// last connection's task.
    pub fn retire(&self) {
        let idle = {
            let mut state = self.lock();
            state.retired = true;
            let idle = std::mem::take(&mut state.idle);
            for idle in &idle {
                state.start_closing(&idle.conn);
            }
            idle
        };
        drop(idle);
    }

    /// Resolves once the pool is retired and its last connection (tunnels' included) has closed: the upstream is
    /// done with every exchange sent to it, the ones whose clients were answered or left before it finished
    /// included.
    pub async fn connections_closed(&self) {
        loop {
            let emptied = self.emptied.notified();
            tokio::pin!(emptied);
            emptied.as_mut().enable();
            {
                let state = self.lock();
                if state.is_empty() {
                    return;
                }
            }
            emptied.await;
        }
    }

    /// Whether the pool is retired and has nothing left: no connection, no waiter.
    pub fn drained(&self) -> bool {
        let state = self.lock();
        state.is_empty() && state.queue.is_empty()
    }
}
