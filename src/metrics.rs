//! Metric families, registered once at start-up, and the per-upstream handles requests record into.
//!
//! Owns the names and labels of everything `/metrics` shows. Handles are resolved when an upstream is built (or
//! on the first use of a label combination, then cached), so a request never hashes a label set. Gauges that
//! describe the pool's state are set from a snapshot at scrape time rather than moved on every change.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::StatusCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::error::Outcome;
use crate::pool::PoolSnapshot;

type Labels = Vec<(&'static str, String)>;

/// Status classes as labels; index 0 is for requests that got no status at all.
const STATUS_CLASSES: [&str; 6] = ["none", "1xx", "2xx", "3xx", "4xx", "5xx"];

fn status_class(status: Option<StatusCode>) -> usize {
    status.map_or(0, |s| usize::from(s.as_u16() / 100).clamp(1, 5))
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~52 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

/// Every family floodgate exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    inflight: Family<Labels, Gauge>,
    queue_depth: Family<Labels, Gauge>,
    queue_wait: Family<Labels, Histogram, fn() -> Histogram>,
    connections: Family<Labels, Gauge>,
    opened: Family<Labels, Counter>,
    peak: Family<Labels, Gauge>,
    response: Family<Labels, Histogram, fn() -> Histogram>,
    retries: Family<Labels, Counter>,
    pub client_connections: Gauge,
    client_side: Arc<OutcomeCounters>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<Labels, Counter>::default();
        let inflight = Family::<Labels, Gauge>::default();
        let queue_depth = Family::<Labels, Gauge>::default();
        let queue_wait = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram as _);
        let connections = Family::<Labels, Gauge>::default();
        let opened = Family::<Labels, Counter>::default();
        let peak = Family::<Labels, Gauge>::default();
        let response = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram as _);
        let retries = Family::<Labels, Counter>::default();
        let client_connections = Gauge::default();
        registry.register(
            "floodgate_requests",
            "Requests by how they ended (outcome) and the status class answered",
            requests.clone(),
        );
        registry.register(
            "floodgate_inflight",
            "Requests holding an upstream slot",
            inflight.clone(),
        );
        registry.register(
            "floodgate_queue_depth",
            "Requests waiting for an upstream slot",
            queue_depth.clone(),
        );
        registry.register(
            "floodgate_queue_wait_seconds",
            "Time admitted requests waited in the queue",
            queue_wait.clone(),
        );
        registry.register(
            "floodgate_upstream_connections",
            "Upstream connections by state (active counts dialling, busy and closing)",
            connections.clone(),
        );
        registry.register(
            "floodgate_upstream_connections_opened",
            "Upstream connections dialled successfully",
            opened.clone(),
        );
        registry.register(
            "floodgate_upstream_connections_peak",
            "Most upstream connections that existed at once",
            peak.clone(),
        );
        registry.register(
            "floodgate_upstream_response_seconds",
            "Time from dispatch to the upstream's response head",
            response.clone(),
        );
        registry.register(
            "floodgate_upstream_retries",
            "Requests sent again after their connection failed: unsent (a stale idle connection, nothing reached \
             the upstream) or replayed (an idempotent request that may have reached it)",
            retries.clone(),
        );
        registry.register(
            "floodgate_client_connections",
            "Open client connections",
            client_connections.clone(),
        );
        let client_side = Arc::new(OutcomeCounters::new(requests.clone(), None));
        Metrics {
            registry,
            requests,
            inflight,
            queue_depth,
            queue_wait,
            connections,
            opened,
            peak,
            response,
            retries,
            client_connections,
            client_side,
        }
    }

    /// Handles for one upstream, resolved once.
    pub fn upstream(&self, name: &str) -> UpstreamMetrics {
        let labels = || vec![("upstream", name.to_string())];
        let state = |state: &str| vec![("upstream", name.to_string()), ("state", state.to_string())];
        let reason = |reason: &str| vec![("upstream", name.to_string()), ("reason", reason.to_string())];
        UpstreamMetrics {
            requests: Arc::new(OutcomeCounters::new(self.requests.clone(), Some(name.to_string()))),
            inflight: self.inflight.get_or_create_owned(&labels()),
            queue_depth: self.queue_depth.get_or_create_owned(&labels()),
            queue_wait: self.queue_wait.get_or_create_owned(&labels()),
            active: self.connections.get_or_create_owned(&state("active")),
            idle: self.connections.get_or_create_owned(&state("idle")),
            opened: self.opened.get_or_create_owned(&labels()),
            peak: self.peak.get_or_create_owned(&labels()),
            response: self.response.get_or_create_owned(&labels()),
            retried_unsent: self.retries.get_or_create_owned(&reason("unsent")),
            replayed: self.retries.get_or_create_owned(&reason("replayed")),
        }
    }

    /// Counts a request rejected before it reached an upstream (no `upstream` label).
    pub fn client_side(&self, outcome: Outcome, status: Option<StatusCode>) {
        self.client_side.record(outcome, status);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// `floodgate_requests_total` counters for one upstream (or for client-side rejections), cached per
/// outcome and status class on first use so that only combinations that happened are exported.
pub struct OutcomeCounters {
    family: Family<Labels, Counter>,
    upstream: Option<String>,
    cells: Vec<OnceLock<Counter>>,
}

impl OutcomeCounters {
    fn new(family: Family<Labels, Counter>, upstream: Option<String>) -> Self {
        let cells = (0..Outcome::ALL.len() * STATUS_CLASSES.len())
            .map(|_| OnceLock::new())
            .collect();
        OutcomeCounters {
            family,
            upstream,
            cells,
        }
    }

    pub fn record(&self, outcome: Outcome, status: Option<StatusCode>) {
        let class = status_class(status);
        let Some(cell) = self.cells.get(outcome.index() * STATUS_CLASSES.len() + class) else {
            return;
        };
        cell.get_or_init(|| {
            let mut labels: Labels = Vec::with_capacity(3);
            if let Some(upstream) = &self.upstream {
                labels.push(("upstream", upstream.clone()));
            }
            labels.push(("outcome", outcome.as_str().to_string()));
            labels.push((
                "status",
                STATUS_CLASSES.get(class).copied().unwrap_or("none").to_string(),
            ));
            self.family.get_or_create_owned(&labels)
        })
        .inc();
    }
}

/// One upstream's metric handles.
#[derive(Clone)]
pub struct UpstreamMetrics {
    pub requests: Arc<OutcomeCounters>,
    inflight: Gauge,
    queue_depth: Gauge,
    queue_wait: Histogram,
    active: Gauge,
    idle: Gauge,
    pub opened: Counter,
    peak: Gauge,
    response: Histogram,
    pub retried_unsent: Counter,
    pub replayed: Counter,
}

impl UpstreamMetrics {
    pub fn queue_waited(&self, waited: Duration) {
        self.queue_wait.observe(waited.as_secs_f64());
    }

    pub fn responded(&self, took: Duration) {
        self.response.observe(took.as_secs_f64());
    }

    /// Sets the state gauges from a snapshot (at scrape time).
    pub fn refresh(&self, snapshot: &PoolSnapshot) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.inflight.set(gauge(snapshot.in_use));
        self.queue_depth.set(gauge(snapshot.queue_depth));
        self.active.set(gauge(
            snapshot.connections_open.saturating_sub(snapshot.connections_idle),
        ));
        self.idle.set(gauge(snapshot.connections_idle));
        self.peak.set(gauge(snapshot.connections_peak));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_appear_with_upstream_outcome_and_status_labels() {
        let metrics = Metrics::new();
        let api = metrics.upstream("api");
        api.requests.record(Outcome::Ok, Some(StatusCode::OK));
        api.requests.record(Outcome::Ok, Some(StatusCode::OK));
        metrics.client_side(Outcome::NoRoute, Some(StatusCode::NOT_FOUND));
        let text = metrics.encode();
        assert!(
            text.contains(r#"floodgate_requests_total{upstream="api",outcome="ok",status="2xx"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"floodgate_requests_total{outcome="no_route",status="4xx"} 1"#),
            "{text}"
        );
    }
}
