//! Metric families, registered once at start-up, and the per-upstream handles requests record into.
//!
//! Owns the names and labels of everything `/metrics` shows. Handles are resolved when an upstream is built (or
//! on the first use of a label combination, then cached), so a request never hashes a label set. Gauges that
//! describe the pool's state are set from a snapshot at scrape time rather than moved on every change.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use http::StatusCode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::error::Outcome;

mod process;
#[cfg(test)]
mod tests;
mod upstream;

use upstream::{BucketCounts, ByClass, EndpointFamilies, ReplicaCountFamily, RouteFamilies};
pub use upstream::{OutcomeCounters, RouteMetrics, UpstreamMetrics, WaitHistogram};

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Status classes as labels; index 0 is for requests that got no status at all.
const STATUS_CLASSES: [&str; 6] = ["none", "1xx", "2xx", "3xx", "4xx", "5xx"];

fn status_class(status: Option<StatusCode>) -> usize {
    status.map_or(0, |s| usize::from(s.as_u16() / 100).clamp(1, 5))
}

/// Upper bounds of the latency histograms' buckets: 100 µs .. ~52 s.
fn latency_bounds() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.0, 20)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_bounds())
}

/// Every family floodgate exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    inflight: Family<Labels, Gauge>,
    queue_depth: Family<Labels, Gauge>,
    queue_wait: Family<Labels, Histogram, fn() -> Histogram>,
    queue_wait_by_class: Family<Labels, Histogram, fn() -> Histogram>,
    connections: Family<Labels, Gauge>,
    opened: Family<Labels, Counter>,
    peak: Family<Labels, Gauge>,
    response: Family<Labels, Histogram, fn() -> Histogram>,
    retries: Family<Labels, Counter>,
    bodies_cut: Family<Labels, Counter>,
    stalls: Family<Labels, Counter>,
    prewarmed: Family<Labels, Counter>,
    long_holds: Family<Labels, Counter>,
    held_while_down: Family<Labels, Counter>,
    retries_over_budget: Family<Labels, Counter>,
    max_connections: Family<Labels, Gauge>,
    limit: Family<Labels, Gauge>,
    adaptive_rtt: Family<Labels, FloatGauge>,
    adaptive_gradient: Family<Labels, FloatGauge>,
    reloads: Family<Labels, Counter>,
    /// Whether the last configuration load (start-up's, or a reload's) was put in force, and when one last was,
    /// as Prometheus's own `prometheus_config_last_reload_*`.
    last_reload_successful: Gauge,
    last_reload_success: FloatGauge,
    /// Per endpoint (`upstream`, `endpoint` labels), set at scrape time.
    endpoint_connections: Family<Labels, Gauge>,
    endpoint_ejected: Family<Labels, Gauge>,
    endpoint_ejections: Family<Labels, Counter>,
    endpoint_max_connections: Family<Labels, Gauge>,
    endpoint_slow_starts: Family<Labels, Counter>,
    /// Tunnels (WebSockets and other upgrades): open now and their bound (set at scrape time), opened, refused by
    /// reason, and the bytes relayed each way.
    tunnels: Family<Labels, Gauge>,
    max_tunnels: Family<Labels, Gauge>,
    tunnels_opened: Family<Labels, Counter>,
    tunnels_refused: Family<Labels, Counter>,
    tunnel_bytes: Family<Labels, Counter>,
    /// Reads of a replica count refused, by upstream and reason (see `pool::replicas`).
    replica_counts_refused: Family<Labels, Counter>,
    /// Resolutions of discovered endpoints not taken, by upstream and reason (see `pool::discovery`).
    discovery_failures: Family<Labels, Counter>,
    /// Per upstream and route, as the client sees it: its request's time and bytes both ways.
    request_duration: Family<Labels, Histogram, fn() -> Histogram>,
    request_bytes: Family<Labels, Counter>,
    response_bytes: Family<Labels, Counter>,
    /// Kept per upstream name, as the families keep their metrics, so asking twice gives the same counts.
    queue_wait_buckets: Mutex<BTreeMap<String, Arc<BucketCounts>>>,
    /// The upstream response-time histogram's counts again, for `/status` (as `queue_wait_buckets`).
    response_buckets: Mutex<BTreeMap<String, Arc<BucketCounts>>>,
    /// When these metrics were made (floodgate's start), and the last reload's attempt, for `/status`.
    started: std::time::Instant,
    last_reload: Mutex<Option<LastReload>>,
    pub client_connections: Gauge,
    /// Request and response body bytes held in memory now (moved by `buffer::BufferBudget`).
    pub buffered_bytes: Gauge,
    /// Bodies that fitted their upstream's buffer limit but streamed because `max_buffered_bytes` was reached.
    pub buffer_fallbacks: Counter,
    /// PING frames with the ACK flag an HTTP/2 client sent beyond the one floodgate asks for (see
    /// `server::h2_frames`).
    pub http2_unsolicited_ping_acks: Counter,
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
        let queue_wait_by_class =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram as _);
        let connections = Family::<Labels, Gauge>::default();
        let opened = Family::<Labels, Counter>::default();
        let peak = Family::<Labels, Gauge>::default();
        let response = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram as _);
        let retries = Family::<Labels, Counter>::default();
        let bodies_cut = Family::<Labels, Counter>::default();
        let stalls = Family::<Labels, Counter>::default();
        let prewarmed = Family::<Labels, Counter>::default();
        let long_holds = Family::<Labels, Counter>::default();
        let held_while_down = Family::<Labels, Counter>::default();
        let retries_over_budget = Family::<Labels, Counter>::default();
        let max_connections = Family::<Labels, Gauge>::default();
        let limit = Family::<Labels, Gauge>::default();
        let adaptive_rtt = Family::<Labels, FloatGauge>::default();
        let adaptive_gradient = Family::<Labels, FloatGauge>::default();
        let reloads = Family::<Labels, Counter>::default();
        let endpoint_connections = Family::<Labels, Gauge>::default();
        let endpoint_ejected = Family::<Labels, Gauge>::default();
        let endpoint_ejections = Family::<Labels, Counter>::default();
        let endpoint_max_connections = Family::<Labels, Gauge>::default();
        let endpoint_slow_starts = Family::<Labels, Counter>::default();
        let tunnels = Family::<Labels, Gauge>::default();
        let max_tunnels = Family::<Labels, Gauge>::default();
        let tunnels_opened = Family::<Labels, Counter>::default();
        let tunnels_refused = Family::<Labels, Counter>::default();
        let tunnel_bytes = Family::<Labels, Counter>::default();
        let replica_counts_refused = Family::<Labels, Counter>::default();
        let discovery_failures = Family::<Labels, Counter>::default();
        let request_duration =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram as _);
        let request_bytes = Family::<Labels, Counter>::default();
        let response_bytes = Family::<Labels, Counter>::default();
        let client_connections = Gauge::default();
        let buffered_bytes = Gauge::default();
        let buffer_fallbacks = Counter::default();
        let http2_unsolicited_ping_acks = Counter::default();
        registry.register(
            "floodgate_requests",
            "Requests by how they ended (outcome) and the status class answered",
            requests.clone(),
        );
        registry.register(
            "floodgate_requests_in_flight",
            "Requests holding an upstream slot",
            inflight.clone(),
        );
        registry.register(
            "floodgate_queue_depth",
            "Requests waiting for an upstream slot",
            queue_depth.clone(),
        );
        registry.register_with_unit(
            "floodgate_queue_wait",
            "Time admitted requests waited in the queue",
            Unit::Seconds,
            queue_wait.clone(),
        );
        registry.register_with_unit(
            "floodgate_queue_wait_by_class",
            "Time admitted requests waited in the queue, by priority class (a series appears once its class is used)",
            Unit::Seconds,
            queue_wait_by_class.clone(),
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
        registry.register_with_unit(
            "floodgate_upstream_response",
            "Time from dispatch to the upstream's response head",
            Unit::Seconds,
            response.clone(),
        );
        registry.register(
            "floodgate_upstream_retries",
            "Requests sent again after their connection failed: unsent (a stale idle connection, nothing reached \
             the upstream) or replayed (an idempotent request that may have reached it)",
            retries.clone(),
        );
        registry.register(
            "floodgate_upstream_request_bodies_cut",
            "Request bodies the upstream answered before it had them whole, whose rest could then not be sent \
             (the client stopped sending, or the upstream reading): they went without their end, never framed as \
             complete, and the connection was closed",
            bodies_cut.clone(),
        );
        registry.register(
            "floodgate_upstream_stalls",
            "Stalls the stall guard saw begin (stall_timeout): every slot busy and no exchange finished for that long; \
             requests are shed with reason upstream_stalled until one does",
            stalls.clone(),
        );
        registry.register(
            "floodgate_upstream_prewarmed_connections",
            "Upstream connections dialled ahead of need to keep min_idle idle ones ready",
            prewarmed.clone(),
        );
        registry.register(
            "floodgate_upstream_long_holds",
            "Exchanges that held their upstream slot longer than hold_warn_after (each also logged once, with its \
             request ID)",
            long_holds.clone(),
        );
        registry.register(
            "floodgate_upstream_held_while_down",
            "Requests held while no endpoint of their upstream could be dialled (hold_while_down), each counted once",
            held_while_down.clone(),
        );
        registry.register(
            "floodgate_upstream_retries_over_budget",
            "Clients' retries (a request with one of retry_budget's headers) shed because first attempts had not earned \
             them",
            retries_over_budget.clone(),
        );
        registry.register(
            "floodgate_upstream_max_connections",
            "The cap in force on upstream connections (changed by a reload or the admin API)",
            max_connections.clone(),
        );
        registry.register(
            "floodgate_adaptive_limit",
            "The bound on requests in flight at the upstream in force: the adaptive limit, or the cap without one",
            limit.clone(),
        );
        registry.register_with_unit(
            "floodgate_adaptive_rtt",
            "The adaptive limit's inputs: the last window's mean response time (kind=short) and the baseline it is \
             compared with (kind=baseline); 0 while the limit is off or has seen no window",
            Unit::Seconds,
            adaptive_rtt.clone(),
        );
        registry.register(
            "floodgate_adaptive_gradient",
            "The adaptive limit's last gradient: tolerance x baseline / short, from 0.5 to 1 (1: no slowdown seen)",
            adaptive_gradient.clone(),
        );
        registry.register(
            "floodgate_endpoint_connections",
            "Connections to each endpoint of an upstream: dialling, busy, idle or closing (at most its own cap)",
            endpoint_connections.clone(),
        );
        registry.register(
            "floodgate_endpoint_ejected",
            "1 while an endpoint is ejected after failed dials, else 0",
            endpoint_ejected.clone(),
        );
        registry.register(
            "floodgate_endpoint_ejections",
            "Times an endpoint was ejected after failed dials",
            endpoint_ejections.clone(),
        );
        registry.register(
            "floodgate_endpoint_max_connections",
            "The connections an endpoint may have now: its own cap (the upstream's for a url), or its ramp's under \
             slow_start",
            endpoint_max_connections.clone(),
        );
        registry.register(
            "floodgate_endpoint_slow_starts",
            "Times an endpoint began a slow start (slow_start: new to the pool, or back from an ejection)",
            endpoint_slow_starts.clone(),
        );
        registry.register(
            "floodgate_reloads",
            "Configuration reloads by result: applied, or refused (the running configuration stayed)",
            reloads.clone(),
        );
        registry.register_with_unit(
            "floodgate_request_duration",
            "Time from a request's arrival to the end of its answer to the client, by upstream and route",
            Unit::Seconds,
            request_duration.clone(),
        );
        registry.register_with_unit(
            "floodgate_request",
            "Request body bytes received from clients and sent upstream, by upstream and route",
            Unit::Bytes,
            request_bytes.clone(),
        );
        registry.register_with_unit(
            "floodgate_response",
            "Response body bytes sent to clients, by upstream and route",
            Unit::Bytes,
            response_bytes.clone(),
        );
        registry.register(
            "floodgate_tunnels",
            "Tunnels (WebSockets and other upgrades) open to the upstream, each on a socket of its own",
            tunnels.clone(),
        );
        registry.register(
            "floodgate_max_tunnels",
            "The bound on tunnels open to the upstream at once (max_tunnels)",
            max_tunnels.clone(),
        );
        registry.register(
            "floodgate_tunnels_opened",
            "Tunnels the upstream accepted (switched: a 101)",
            tunnels_opened.clone(),
        );
        registry.register(
            "floodgate_tunnels_refused",
            "Upgrade requests refused, by reason: limit (max_tunnels reached), off (max_tunnels = 0), or upstream (it did not switch)",
            tunnels_refused.clone(),
        );
        registry.register_with_unit(
            "floodgate_tunnel",
            "Bytes relayed through tunnels, by direction: to_upstream or to_client",
            Unit::Bytes,
            tunnel_bytes.clone(),
        );
        registry.register(
            "floodgate_replica_counts_refused",
            "Reads of an upstream's replica count that were not taken, by reason: unreadable, not_a_file, too_long, \
             not_a_count or out_of_range; the count in force stays",
            replica_counts_refused.clone(),
        );
        registry.register(
            "floodgate_upstream_discovery_failures",
            "Resolutions of an upstream's discovered endpoints (endpoints = { dns = ... }) that were not taken, by \
             reason: failed (the name did not resolve) or empty (no address); the endpoints in force stay",
            discovery_failures.clone(),
        );
        registry.register(
            "floodgate_http2_unsolicited_ping_acks",
            "PING acknowledgements HTTP/2 clients sent for PINGs floodgate never sent; a connection that keeps \
             sending them is closed",
            http2_unsolicited_ping_acks.clone(),
        );
        registry.register(
            "floodgate_client_connections",
            "Open client connections",
            client_connections.clone(),
        );
        registry.register_with_unit(
            "floodgate_buffered",
            "Request and response body bytes held in memory (bounded by max_buffered_bytes)",
            Unit::Bytes,
            buffered_bytes.clone(),
        );
        registry.register(
            "floodgate_buffer_fallbacks",
            "Bodies small enough to buffer that streamed instead because max_buffered_bytes was reached",
            buffer_fallbacks.clone(),
        );
        for result in ["applied", "refused"] {
            // Present at 0 from the start: an alert on `increase()` sees the first reload too.
            let _ = reloads.get_or_create(&vec![("result", result.to_string())]);
        }
        // The configuration start-up loaded is the first one put in force.
        let (last_reload_successful, last_reload_success) = (Gauge::default(), FloatGauge::default());
        last_reload_successful.set(1);
        last_reload_success.set(unix_time());
        registry.register(
            "floodgate_config_last_reload_successful",
            "1 if the last configuration load (start-up or reload) was put in force, 0 if it was refused",
            last_reload_successful.clone(),
        );
        registry.register_with_unit(
            "floodgate_config_last_reload_success_timestamp",
            "When a configuration was last put in force (start-up or reload), in seconds since the Unix epoch",
            Unit::Seconds,
            last_reload_success.clone(),
        );
        let build = prometheus_client::metrics::info::Info::new(vec![
            ("version", env!("CARGO_PKG_VERSION")),
            ("commit", env!("FLOODGATE_COMMIT")),
        ]);
        registry.register(
            "floodgate_build",
            "The version and commit floodgate was built from",
            build,
        );
        registry.register_collector(Box::new(process::ProcessCollector::new()));
        let client_side = Arc::new(OutcomeCounters::new(requests.clone(), None));
        client_side.prime(Outcome::ALL.into_iter().filter(|outcome| outcome.of_client_side()));
        Metrics {
            registry,
            requests,
            inflight,
            queue_depth,
            queue_wait,
            queue_wait_by_class,
            connections,
            opened,
            peak,
            response,
            retries,
            bodies_cut,
            stalls,
            prewarmed,
            long_holds,
            held_while_down,
            retries_over_budget,
            max_connections,
            limit,
            adaptive_rtt,
            adaptive_gradient,
            reloads,
            last_reload_successful,
            last_reload_success,
            endpoint_connections,
            endpoint_ejected,
            endpoint_ejections,
            endpoint_max_connections,
            endpoint_slow_starts,
            tunnels,
            max_tunnels,
            tunnels_opened,
            tunnels_refused,
            tunnel_bytes,
            replica_counts_refused,
            discovery_failures,
            request_duration,
            request_bytes,
            response_bytes,
            queue_wait_buckets: Mutex::default(),
            response_buckets: Mutex::default(),
            started: std::time::Instant::now(),
            last_reload: Mutex::default(),
            client_connections,
            buffered_bytes,
            buffer_fallbacks,
            http2_unsolicited_ping_acks,
            client_side,
        }
    }

    /// Handles for one upstream, resolved once.
    pub fn upstream(&self, name: &str) -> UpstreamMetrics {
        let labels = || vec![("upstream", name.to_string())];
        let state = |state: &str| vec![("upstream", name.to_string()), ("state", state.to_string())];
        let reason = |reason: &str| vec![("upstream", name.to_string()), ("reason", reason.to_string())];
        let kind = |kind: &str| vec![("upstream", name.to_string()), ("kind", kind.to_string())];
        let direction = |to: &str| vec![("upstream", name.to_string()), ("direction", to.to_string())];
        UpstreamMetrics {
            requests: {
                let requests = OutcomeCounters::new(self.requests.clone(), Some(name.to_string()));
                requests.prime(Outcome::ALL.into_iter().filter(|outcome| outcome.of_upstreams()));
                Arc::new(requests)
            },
            inflight: self.inflight.get_or_create_owned(&labels()),
            queue_depth: self.queue_depth.get_or_create_owned(&labels()),
            queue_wait: self.queue_wait.get_or_create_owned(&labels()),
            by_class: Arc::new(ByClass {
                upstream: name.to_string(),
                family: self.queue_wait_by_class.clone(),
                resolved: Default::default(),
            }),
            queue_wait_buckets: buckets_of(&self.queue_wait_buckets, name),
            active: self.connections.get_or_create_owned(&state("active")),
            idle: self.connections.get_or_create_owned(&state("idle")),
            opened: self.opened.get_or_create_owned(&labels()),
            peak: self.peak.get_or_create_owned(&labels()),
            max_connections: self.max_connections.get_or_create_owned(&labels()),
            limit: self.limit.get_or_create_owned(&labels()),
            rtt_short: self.adaptive_rtt.get_or_create_owned(&kind("short")),
            rtt_baseline: self.adaptive_rtt.get_or_create_owned(&kind("baseline")),
            gradient: self.adaptive_gradient.get_or_create_owned(&labels()),
            response: self.response.get_or_create_owned(&labels()),
            response_buckets: buckets_of(&self.response_buckets, name),
            retried_unsent: self.retries.get_or_create_owned(&reason("unsent")),
            replayed: self.retries.get_or_create_owned(&reason("replayed")),
            request_body_cut: self.bodies_cut.get_or_create_owned(&labels()),
            stalls: self.stalls.get_or_create_owned(&labels()),
            prewarmed: self.prewarmed.get_or_create_owned(&labels()),
            long_holds: self.long_holds.get_or_create_owned(&labels()),
            held_while_down: self.held_while_down.get_or_create_owned(&labels()),
            retries_over_budget: self.retries_over_budget.get_or_create_owned(&labels()),
            tunnels: self.tunnels.get_or_create_owned(&labels()),
            max_tunnels: self.max_tunnels.get_or_create_owned(&labels()),
            tunnels_opened: self.tunnels_opened.get_or_create_owned(&labels()),
            tunnels_refused_limit: self.tunnels_refused.get_or_create_owned(&reason("limit")),
            tunnels_refused_off: self.tunnels_refused.get_or_create_owned(&reason("off")),
            tunnels_refused_upstream: self.tunnels_refused.get_or_create_owned(&reason("upstream")),
            tunnel_bytes_to_upstream: self.tunnel_bytes.get_or_create_owned(&direction("to_upstream")),
            tunnel_bytes_to_client: self.tunnel_bytes.get_or_create_owned(&direction("to_client")),
            discovery: Arc::new(ReplicaCountFamily {
                upstream: name.to_string(),
                refused: self.discovery_failures.clone(),
            }),
            replica_counts: Arc::new(ReplicaCountFamily {
                upstream: name.to_string(),
                refused: self.replica_counts_refused.clone(),
            }),
            routes: Arc::new(RouteFamilies {
                upstream: name.to_string(),
                duration: self.request_duration.clone(),
                request_bytes: self.request_bytes.clone(),
                response_bytes: self.response_bytes.clone(),
            }),
            endpoints: Arc::new(EndpointFamilies {
                upstream: name.to_string(),
                connections: self.endpoint_connections.clone(),
                ejected: self.endpoint_ejected.clone(),
                ejections: self.endpoint_ejections.clone(),
                max_connections: self.endpoint_max_connections.clone(),
                slow_starts: self.endpoint_slow_starts.clone(),
            }),
        }
    }

    /// Counts one reload, applied or refused.
    pub fn reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.reloads.get_or_create(&vec![("result", result.to_string())]).inc();
        self.last_reload_successful.set(i64::from(applied));
        let at = unix_time();
        if applied {
            self.last_reload_success.set(at);
        }
        *self.last_reload.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(LastReload { at, applied });
    }

    /// How long floodgate has run, the last reload tried (none yet: the start-up configuration is in force) and
    /// when the configuration in force was put in force, in seconds since the Unix epoch.
    pub fn lifetime(&self) -> Lifetime {
        Lifetime {
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            config_in_force_since: self.last_reload_success.get(),
            last_reload: *self.last_reload.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
        }
    }

    /// Counts a request rejected before it reached an upstream (under `upstream="-"`).
    pub fn client_side(&self, outcome: Outcome, status: Option<StatusCode>) {
        self.client_side.record(outcome, status);
    }

    /// The counters of [`Metrics::client_side`], for answers that also write an access-log line.
    pub fn client_side_counters(&self) -> &OutcomeCounters {
        &self.client_side
    }

    /// Every family in OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Every family in the Prometheus text format (0.0.4), for scrapers that do not ask for OpenMetrics.
    pub fn encode_prometheus_text(&self) -> String {
        prometheus_text(&self.encode())
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4 reads it: a counter's `HELP` and `TYPE` name its samples
/// (with `_total`), an info family is a gauge of its `_info` samples, and `UNIT` lines and `# EOF` go.
fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if line.starts_with("# HELP ") {
            // Written with its TYPE, which may rename the family.
            help = Some(line);
            continue;
        }
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let (name, kind) = declared.split_once(' ').unwrap_or((declared, "unknown"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                other => (name.to_string(), other),
            };
            if let Some(text) = help.take().and_then(|help| help.splitn(4, ' ').nth(3)) {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Now, in seconds since the Unix epoch (0 for a clock set before it), as the `*_timestamp_seconds` gauges say it.
/// `name`'s bucket counts in `by_upstream`, made the first time: one set per upstream, kept across reloads as its
/// exported histogram is.
fn buckets_of(by_upstream: &Mutex<BTreeMap<String, Arc<BucketCounts>>>, name: &str) -> Arc<BucketCounts> {
    by_upstream
        .lock()
        // Only ever inserted into; a panic elsewhere cannot leave it half-changed.
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .entry(name.to_string())
        .or_insert_with(|| Arc::new(BucketCounts::new()))
        .clone()
}

/// A reload's attempt: when (seconds since the Unix epoch), and whether its configuration was put in force.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LastReload {
    pub at: f64,
    pub applied: bool,
}

/// What `/status` shows of floodgate's own life ([`Metrics::lifetime`]).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Lifetime {
    pub uptime_seconds: f64,
    pub config_in_force_since: f64,
    pub last_reload: Option<LastReload>,
}

fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}
