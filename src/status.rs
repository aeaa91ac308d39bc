//! What `/status`, the stats page and the gauges read of a pool: plain data, made by the pool under its lock and
//! read by `metrics` and `admin`. It never refers to anything else in the crate, so both sides can depend on it.

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
    /// `ready`, `drain` or `maint`, as the admin API set it.
    pub state: &'static str,
    /// The connections it may have now: its own cap (the upstream's for a `url`), or its ramp's under slow start.
    pub max_connections_in_force: usize,
    /// Its ramp, while it is under slow start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_start: Option<RampSnapshot>,
}

/// What `/status` shows of an endpoint's slow start.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RampSnapshot {
    /// The ramp's cap in force.
    pub connections: usize,
    /// How long it has ramped.
    pub seconds: f64,
    /// The last window's mean response time; 0 before the first.
    pub last_window_seconds: f64,
    /// The lowest window mean of the ramp, which the others are judged against; 0 before the first.
    pub baseline_seconds: f64,
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
    /// Idle connections kept ready (`min_idle`; 0: none), and how many were dialled for it so far.
    pub min_idle: usize,
    pub prewarmed_total: u64,
    /// Exchanges that held their slot past `hold_warn_after` (0 while it is off).
    pub long_holds_total: u64,
    /// Requests held while no endpoint could be dialled (`hold_while_down`).
    pub held_while_down_total: u64,
    /// Stalls the stall guard saw (`stall_timeout`).
    pub stalls_total: u64,
    /// The retries the clients may still make (`retry_budget`), while a budget is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_budget_tokens: Option<f64>,
    pub connections_open: usize,
    pub connections_idle: usize,
    pub connections_peak: usize,
    pub connections_opened_total: u64,
    pub queue_depth: usize,
    pub queue_peak: usize,
    pub requests_total: u64,
    /// Tunnels (WebSockets) open now, each on a socket of its own beside `connections_open`, and their bound.
    pub tunnels_open: usize,
    pub max_tunnels: usize,
    /// With `replicas`: floodgate's replicas counted (0: not yet), whose share of the totals `max_connections` and
    /// `max_tunnels` are here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<usize>,
    /// Removed or replaced by a reload, finishing what it had admitted.
    pub draining: bool,
    /// The stall guard holds: every slot busy and no exchange finished within `stall_timeout`.
    pub stalled: bool,
    pub endpoints: Vec<EndpointSnapshot>,
}

/// What `/status` and `/metrics` show of the estimate.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AdaptiveSnapshot {
    /// The limit in force (lower than `estimate` while probing).
    pub limit: usize,
    /// The estimate itself, before rounding down.
    pub estimate: f64,
    /// The last window's mean response time; 0 before the first.
    pub rtt_short_seconds: f64,
    /// The baseline the short-term time is compared with; 0 before the first window.
    pub rtt_baseline_seconds: f64,
    pub gradient: f64,
    pub probing: bool,
}
