//! The handles requests record into, resolved before any request uses them: one upstream's (its outcomes,
//! queue waits by class, endpoints' series), one route's, and the replica counts refused. Never registers a family:
//! `Metrics` does, and hands these their parts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::StatusCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::{latency_bounds, status_class, FloatGauge, Labels, STATUS_CLASSES};
use crate::error::Outcome;
use crate::status::PoolSnapshot;

/// `floodgate_requests_total` counters for one upstream (or for client-side rejections), cached per
/// outcome and status class on first use so that only combinations that happened are exported.
pub struct OutcomeCounters {
    pub(super) family: Family<Labels, Counter>,
    pub(super) upstream: Option<String>,
    pub(super) cells: Vec<OnceLock<Counter>>,
}

impl OutcomeCounters {
    pub(super) fn new(family: Family<Labels, Counter>, upstream: Option<String>) -> Self {
        let cells = (0..Outcome::ALL.len() * STATUS_CLASSES.len())
            .map(|_| OnceLock::new())
            .collect();
        OutcomeCounters {
            family,
            upstream,
            cells,
        }
    }

    /// Makes the counter of each of `outcomes`, with its usual status class, present at 0: an alert on
    /// `increase()` then sees the first such request too. Other combinations appear when they happen.
    pub(super) fn prime(&self, outcomes: impl IntoIterator<Item = Outcome>) {
        for outcome in outcomes {
            self.cell(outcome, Some(outcome.status()));
        }
    }

    pub fn record(&self, outcome: Outcome, status: Option<StatusCode>) {
        if let Some(counter) = self.cell(outcome, status) {
            counter.inc();
        }
    }

    pub(super) fn cell(&self, outcome: Outcome, status: Option<StatusCode>) -> Option<&Counter> {
        let class = status_class(status);
        let cell = self.cells.get(outcome.index() * STATUS_CLASSES.len() + class)?;
        Some(cell.get_or_init(|| {
            // Every series has the same labels: a request refused before it was routed is counted under `-`, which
            // no upstream can be named.
            let upstream = self.upstream.clone().unwrap_or_else(|| "-".to_string());
            let labels: Labels = vec![
                ("upstream", upstream),
                ("outcome", outcome.as_str().to_string()),
                ("code", STATUS_CLASSES.get(class).copied().unwrap_or("none").to_string()),
            ];
            self.family.get_or_create_owned(&labels)
        }))
    }

    /// Requests counted so far per outcome, over every status class; outcomes that have not happened are left out.
    pub fn totals(&self) -> impl Iterator<Item = (Outcome, u64)> + '_ {
        Outcome::ALL
            .iter()
            .zip(self.cells.chunks(STATUS_CLASSES.len()))
            .filter_map(|(outcome, classes)| {
                let total: u64 = classes.iter().filter_map(OnceLock::get).map(Counter::get).sum();
                (total > 0).then_some((*outcome, total))
            })
    }
}

/// The queue-wait (or response-time) histogram's bucket counts again, where `/status` can read them: prometheus-client keeps its
/// own private. Same bounds as the histogram, so the two agree.
pub(super) struct BucketCounts {
    pub(super) bounds: Vec<f64>,
    /// One per bound, then one for waits above the last.
    pub(super) counts: Vec<AtomicU64>,
}

impl BucketCounts {
    pub(super) fn new() -> Self {
        let bounds: Vec<f64> = latency_bounds().collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        BucketCounts { bounds, counts }
    }

    pub(super) fn observe(&self, value: f64) {
        // Prometheus buckets are inclusive: a value equal to a bound counts in that bound's bucket.
        let bucket = self.bounds.partition_point(|bound| *bound < value);
        if let Some(count) = self.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn snapshot(&self) -> WaitHistogram {
        let mut total = 0;
        let mut cumulative = Vec::with_capacity(self.bounds.len());
        for count in &self.counts {
            total += count.load(Ordering::Relaxed);
            cumulative.push(total);
        }
        // The last entry is the overflow bucket, which `count` already gives.
        cumulative.truncate(self.bounds.len());
        WaitHistogram {
            count: total,
            le: self.bounds.clone(),
            cumulative,
        }
    }
}

/// A histogram as `/status` shows it, in Prometheus's shape: `cumulative[i]` observations were at most `le[i]`
/// seconds; `count` includes those above the last bound. Cumulative counts never decrease, so a reader can
/// take the difference of two readings to get the distribution between them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WaitHistogram {
    pub count: u64,
    pub le: Vec<f64>,
    pub cumulative: Vec<u64>,
}

/// The per-class queue-wait series of one upstream, each resolved the first time its class is used.
pub(super) struct ByClass {
    pub(super) upstream: String,
    pub(super) family: Family<Labels, Histogram, fn() -> Histogram>,
    pub(super) resolved: [std::sync::OnceLock<Histogram>; crate::config::MAX_PRIORITY as usize + 1],
}

/// One upstream's metric handles.
#[derive(Clone)]
pub struct UpstreamMetrics {
    pub requests: Arc<OutcomeCounters>,
    pub(super) inflight: Gauge,
    pub(super) queue_depth: Gauge,
    pub(super) queue_wait: Histogram,
    pub(super) by_class: Arc<ByClass>,
    pub(super) queue_wait_buckets: Arc<BucketCounts>,
    pub(super) active: Gauge,
    pub(super) idle: Gauge,
    pub opened: Counter,
    pub(super) peak: Gauge,
    pub(super) max_connections: Gauge,
    pub(super) limit: Gauge,
    pub(super) rtt_short: FloatGauge,
    pub(super) rtt_baseline: FloatGauge,
    pub(super) gradient: FloatGauge,
    pub(super) response: Histogram,
    pub(super) response_buckets: Arc<BucketCounts>,
    pub retried_unsent: Counter,
    pub replayed: Counter,
    /// A request body's rest that could not be sent after the upstream answered.
    pub request_body_cut: Counter,
    /// Stalls the stall guard saw begin.
    pub stalls: Counter,
    /// Connections dialled ahead of need (`min_idle`).
    pub prewarmed: Counter,
    /// Exchanges that held their slot past `hold_warn_after`.
    pub long_holds: Counter,
    /// Requests held while no endpoint could be dialled (`hold_while_down`).
    pub held_while_down: Counter,
    /// Clients' retries shed over their budget (`retry_budget`).
    pub retries_over_budget: Counter,
    pub(super) tunnels: Gauge,
    pub(super) max_tunnels: Gauge,
    /// Counted when the upstream switches.
    pub tunnels_opened: Counter,
    pub tunnels_refused_limit: Counter,
    pub tunnels_refused_off: Counter,
    pub tunnels_refused_upstream: Counter,
    pub tunnel_bytes_to_upstream: Counter,
    pub tunnel_bytes_to_client: Counter,
    pub(super) replica_counts: Arc<ReplicaCountFamily>,
    /// Resolutions of discovered endpoints not taken, by reason (the same shape as the replica counts').
    pub(super) discovery: Arc<ReplicaCountFamily>,
    pub(super) routes: Arc<RouteFamilies>,
    pub(super) endpoints: Arc<EndpointFamilies>,
}

/// The per-route families, resolved once per route when the routes are built (never on a request's path).
pub(super) struct RouteFamilies {
    pub(super) upstream: String,
    pub(super) duration: Family<Labels, Histogram, fn() -> Histogram>,
    pub(super) request_bytes: Family<Labels, Counter>,
    pub(super) response_bytes: Family<Labels, Counter>,
}

/// One route's handles: a request's time and bytes as its client sees them.
#[derive(Clone, Debug)]
pub struct RouteMetrics {
    pub duration: Histogram,
    pub request_bytes: Counter,
    pub response_bytes: Counter,
}

/// The replica counts refused of one upstream, each reason's series made when its upstream first counts replicas:
/// an upstream without `replicas` shows none.
pub(super) struct ReplicaCountFamily {
    pub(super) upstream: String,
    pub(super) refused: Family<Labels, Counter>,
}

impl ReplicaCountFamily {
    pub(super) fn counter(&self, reason: &'static str) -> Counter {
        let labels = vec![("upstream", self.upstream.clone()), ("reason", reason.to_string())];
        self.refused.get_or_create_owned(&labels)
    }
}

/// The per-endpoint families, resolved at scrape time or on an ejection (never on a request's path).
pub(super) struct EndpointFamilies {
    pub(super) upstream: String,
    pub(super) connections: Family<Labels, Gauge>,
    pub(super) ejected: Family<Labels, Gauge>,
    pub(super) ejections: Family<Labels, Counter>,
    pub(super) max_connections: Family<Labels, Gauge>,
    pub(super) slow_starts: Family<Labels, Counter>,
}

impl EndpointFamilies {
    pub(super) fn labels(&self, endpoint: &str) -> Labels {
        vec![("upstream", self.upstream.clone()), ("endpoint", endpoint.to_string())]
    }
}

impl UpstreamMetrics {
    /// A request of priority `class` waited `waited` for its slot.
    pub fn queue_waited_in(&self, class: u8, waited: Duration) {
        self.queue_waited(waited);
        if let Some(slot) = self.by_class.resolved.get(usize::from(class)) {
            let histogram = slot.get_or_init(|| {
                let labels = vec![
                    ("upstream", self.by_class.upstream.clone()),
                    ("class", class.to_string()),
                ];
                self.by_class.family.get_or_create_owned(&labels)
            });
            histogram.observe(waited.as_secs_f64());
        }
    }

    pub fn queue_waited(&self, waited: Duration) {
        let seconds = waited.as_secs_f64();
        self.queue_wait.observe(seconds);
        self.queue_wait_buckets.observe(seconds);
    }

    pub fn queue_wait(&self) -> WaitHistogram {
        self.queue_wait_buckets.snapshot()
    }

    pub fn responded(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        self.response.observe(seconds);
        self.response_buckets.observe(seconds);
    }

    /// The upstream's response times so far, as `/status` shows them.
    pub fn response_times(&self) -> WaitHistogram {
        self.response_buckets.snapshot()
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
        self.max_connections.set(gauge(snapshot.max_connections));
        self.limit.set(gauge(snapshot.limit));
        self.tunnels.set(gauge(snapshot.tunnels_open));
        self.max_tunnels.set(gauge(snapshot.max_tunnels));
        let adaptive = snapshot.adaptive.as_ref();
        self.rtt_short.set(adaptive.map_or(0.0, |a| a.rtt_short_seconds));
        self.rtt_baseline.set(adaptive.map_or(0.0, |a| a.rtt_baseline_seconds));
        self.gradient.set(adaptive.map_or(1.0, |a| a.gradient));
        for endpoint in &snapshot.endpoints {
            let labels = self.endpoints.labels(&endpoint.address);
            self.endpoints
                .connections
                .get_or_create(&labels)
                .set(gauge(endpoint.connections_open));
            self.endpoints
                .ejected
                .get_or_create(&labels)
                .set(i64::from(endpoint.ejected));
            self.endpoints
                .max_connections
                .get_or_create(&labels)
                .set(gauge(endpoint.max_connections_in_force));
        }
    }

    /// The handles of the route labelled `route` (see `route::Picked`), made when the routes are built.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let labels = vec![("upstream", self.routes.upstream.clone()), ("route", route.to_string())];
        RouteMetrics {
            duration: self.routes.duration.get_or_create_owned(&labels),
            request_bytes: self.routes.request_bytes.get_or_create_owned(&labels),
            response_bytes: self.routes.response_bytes.get_or_create_owned(&labels),
        }
    }

    /// The upstream counts its replicas: the refused counts of each of `reasons` are present at 0 from now.
    pub fn replica_counts_known(&self, reasons: impl IntoIterator<Item = &'static str>) {
        for reason in reasons {
            let _ = self.replica_counts.counter(reason);
        }
    }

    /// A replica count read for `reason` was not taken (at most once an `interval`, never on a request's path).
    pub fn replica_count_refused(&self, reason: &'static str) {
        self.replica_counts.counter(reason).inc();
    }

    /// The upstream's endpoints are discovered: the failure counts of each of `reasons` are present at 0 from now.
    pub fn discovery_known(&self, reasons: impl IntoIterator<Item = &'static str>) {
        for reason in reasons {
            let _ = self.discovery.counter(reason);
        }
    }

    /// A resolution of the upstream's endpoints failed for `reason` (at most once an `interval`).
    pub fn discovery_refused(&self, reason: &'static str) {
        self.discovery.counter(reason).inc();
    }

    /// The endpoint at `address` is one of the upstream's: its counters are present at 0 from now.
    pub fn endpoint_known(&self, address: &str) {
        let _ = self.endpoints.ejections.get_or_create(&self.endpoints.labels(address));
    }

    /// The endpoint at `address` began a slow start (never on a request's path: at a pool's start, an ejection's end).
    pub fn endpoint_slow_started(&self, address: &str) {
        self.endpoints
            .slow_starts
            .get_or_create(&self.endpoints.labels(address))
            .inc();
    }

    /// The endpoint at `address` was ejected.
    pub fn endpoint_ejected(&self, address: &str) {
        self.endpoints
            .ejections
            .get_or_create(&self.endpoints.labels(address))
            .inc();
    }
}
