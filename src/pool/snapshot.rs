//! What `/status` and the gauges see of a pool: one consistent reading under its lock.

use std::sync::atomic::Ordering;

use super::UpstreamPool;
use crate::status::{EndpointSnapshot, PoolSnapshot};

impl UpstreamPool {
    pub fn snapshot(&self) -> PoolSnapshot {
        let adaptive = self.adaptive.snapshot();
        let (open, peak, idle, queue_depth, max_connections, limit, in_use, draining, endpoints, tunnels) = {
            let state = self.lock();
            let idle = state
                .idle_connections()
                .iter()
                .filter(|(_, conn)| !conn.is_closed())
                .count();
            let busy = state.busy();
            let now = tokio::time::Instant::now();
            let endpoints = self
                .endpoints
                .load()
                .iter()
                .zip(state.slots.per_endpoint())
                .zip(&state.endpoints)
                .zip(busy)
                .enumerate()
                // A gone endpoint is shown until its last connection has closed.
                .filter(|(at, (((_, (_, open)), _), _))| !state.slots.is_gone(*at) || *open > 0)
                .map(
                    |(at, ((((origin, _), (cap, open)), health), in_flight))| EndpointSnapshot {
                        address: origin.authority(),
                        max_connections: cap,
                        connections_open: open,
                        in_flight,
                        ejected: state.slots.is_ejected(at),
                        failed_dials: health.failures,
                        state: if state.slots.is_gone(at) {
                            "gone"
                        } else {
                            health.admin.as_str()
                        },
                        max_connections_in_force: state.slots.endpoint_in_force(at).min(state.slots.cap()),
                        slow_start: health.ramp.as_ref().map(|ramp| ramp.snapshot(now)),
                    },
                )
                .collect();
            let cap = state.slots.cap();
            (
                state.slots.open(),
                state.slots.peak(),
                idle,
                state.queue.len(),
                cap,
                state.limit.min(cap),
                state.leased,
                state.retired,
                endpoints,
                (state.tunnels_open, self.tunnel_count.bound()),
            )
        };
        PoolSnapshot {
            address: self.origin.authority(),
            max_connections,
            max_queue: self.limits().max_queue,
            limit,
            adaptive,
            in_use,
            min_idle: self.limits().min_idle,
            prewarmed_total: self.metrics.prewarmed.get(),
            long_holds_total: self.metrics.long_holds.get(),
            held_while_down_total: self.metrics.held_while_down.get(),
            stalls_total: self.metrics.stalls.get(),
            retry_budget_tokens: self
                .limits()
                .retry_budget
                .as_ref()
                .map(|budget| (self.retry_tokens.balance(budget) * 10.0).floor() / 10.0),
            connections_open: open,
            connections_idle: idle,
            connections_peak: peak,
            connections_opened_total: self.metrics.opened.get(),
            queue_depth,
            queue_peak: self.queue_peak.load(Ordering::Relaxed),
            requests_total: self.requests_total.load(Ordering::Relaxed),
            tunnels_open: tunnels.0,
            max_tunnels: tunnels.1,
            replicas: self.limits().replicas.is_some().then(|| self.replicas()),
            draining,
            stalled: self.progress.is_stalled(),
            endpoints,
        }
    }
}
