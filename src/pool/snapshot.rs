//! What `/status` and the gauges see of a pool: one consistent reading under its lock.

use std::sync::atomic::Ordering;

use super::{AdaptiveSnapshot, UpstreamPool};

/// One endpoint in a [`PoolSnapshot`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointSnapshot {
    pub address: String,
    /// Its own cap; `None` for an upstream given by one `url` (the upstream's cap is its bound).
    pub max_connections: Option<usize>,
    pub connections_open: usize,
    /// Its connections that are not idle: dialling, busy or closing.
    pub in_flight: usize,
    pub ejected: bool,
    pub failed_dials: u32,
}

/// A snapshot for `/status` and the gauges.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PoolSnapshot {
    pub address: String,
    pub max_connections: usize,
    pub max_queue: usize,
    /// The bound on requests in flight in force: the adaptive limit, or `max_connections` without one.
    pub limit: usize,
    /// The adaptive limit's estimate and inputs, when it is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<AdaptiveSnapshot>,
    pub in_use: usize,
    pub connections_open: usize,
    pub connections_idle: usize,
    pub connections_peak: usize,
    pub connections_opened_total: u64,
    pub queue_depth: usize,
    pub queue_peak: usize,
    pub requests_total: u64,
    /// Removed or replaced by a reload, finishing what it had admitted.
    pub draining: bool,
    pub endpoints: Vec<EndpointSnapshot>,
}

impl UpstreamPool {
    pub fn snapshot(&self) -> PoolSnapshot {
        let adaptive = self.adaptive.snapshot();
        let (open, peak, idle, queue_depth, max_connections, limit, in_use, draining, endpoints) = {
            let state = self.lock();
            let idle = state.idle.iter().filter(|i| !i.conn.is_closed()).count();
            let busy = state.busy();
            let endpoints = self
                .endpoints
                .iter()
                .zip(state.slots.per_endpoint())
                .zip(&state.endpoints)
                .zip(busy)
                .enumerate()
                .map(
                    |(at, ((((origin, _), (cap, open)), health), in_flight))| EndpointSnapshot {
                        address: origin.authority(),
                        max_connections: cap,
                        connections_open: open,
                        in_flight,
                        ejected: state.slots.is_ejected(at),
                        failed_dials: health.failures,
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
            )
        };
        PoolSnapshot {
            address: self.origin.authority(),
            max_connections,
            max_queue: self.limits().max_queue,
            limit,
            adaptive,
            in_use,
            connections_open: open,
            connections_idle: idle,
            connections_peak: peak,
            connections_opened_total: self.metrics.opened.get(),
            queue_depth,
            queue_peak: self.queue_peak.load(Ordering::Relaxed),
            requests_total: self.requests_total.load(Ordering::Relaxed),
            draining,
            endpoints,
        }
    }
}
