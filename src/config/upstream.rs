//! One upstream's settings: where it is (its endpoints, their origins), its cap, queue, timeouts and the rest.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{integer, ConfigError};

/// Whether, and how, an upstream's concurrency limit adapts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdaptiveLimit {
    /// Only `max_connections` bounds the requests in flight.
    #[default]
    Off,
    /// The gradient estimate (see `pool::adaptive`): the limit follows the response times observed.
    Gradient,
}

/// What floodgate speaks to an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1: one request at a time on each connection.
    #[default]
    Http1,
    /// HTTP/2 (cleartext with prior knowledge for `http://`, ALPN `h2` for `https://`): up to
    /// `max_streams_per_connection` requests at once on each connection.
    Http2,
}

/// One instance of an upstream's service (an `endpoints` entry): where it is dialled and its own cap.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `http://host:port`, `https://host:port` or a bare `host:port`, as an upstream's `url`.
    pub url: String,
    /// Never more than this many connections to this endpoint.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_connections: usize,
}

/// An upstream's endpoints when it has no `url`: a list, or the addresses a DNS name resolves to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Endpoints {
    List(Vec<EndpointConfig>),
    Dns(DnsEndpoints),
}

impl Default for Endpoints {
    fn default() -> Self {
        Endpoints::List(Vec::new())
    }
}

impl Endpoints {
    /// Neither listed nor discovered (the upstream is given by `url`).
    pub fn is_empty(&self) -> bool {
        matches!(self, Endpoints::List(list) if list.is_empty())
    }

    /// The listed endpoints (none when they are discovered).
    pub fn listed(&self) -> &[EndpointConfig] {
        match self {
            Endpoints::List(list) => list,
            Endpoints::Dns(_) => &[],
        }
    }

    pub fn dns(&self) -> Option<&DnsEndpoints> {
        match self {
            Endpoints::Dns(dns) => Some(dns),
            Endpoints::List(_) => None,
        }
    }
}

/// Endpoints discovered from DNS: every A and AAAA record of `dns` an endpoint at `port`, each with its own cap
/// `max_connections`, resolved again every `interval` and changed in place; a resolution that fails (or finds no
/// address) keeps the last set. `nameserver`: ask that server (`ip:port`, UDP) rather than the system's resolver.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DnsEndpoints {
    pub dns: String,
    pub port: u16,
    /// Each endpoint's own cap.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_connections: usize,
    /// `http` or `https`.
    #[serde(default = "DnsEndpoints::default_scheme")]
    pub scheme: String,
    #[serde(default = "DnsEndpoints::default_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nameserver: Option<std::net::SocketAddr>,
}

impl DnsEndpoints {
    /// The shortest `interval`: a resolution each time, and a typo such as `1ns` would ask without a pause.
    pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

    fn default_scheme() -> String {
        "http".into()
    }

    fn default_interval() -> Duration {
        Duration::from_secs(5)
    }

    /// The scheme every discovered endpoint is dialled with.
    pub fn scheme(&self) -> Option<Scheme> {
        match self.scheme.as_str() {
            "http" => Some(Scheme::Http),
            "https" => Some(Scheme::Https),
            _ => None,
        }
    }

    /// The upstream's origin as a whole: the name and port (the default Host, and the name TLS verifies).
    pub fn origin(&self) -> Origin {
        Origin {
            scheme: self.scheme().unwrap_or(Scheme::Http),
            host: self.dns.clone(),
            port: self.port,
        }
    }
}

/// One named upstream origin and the limits of its pool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// `http://host:port`, `https://host:port` (TLS to the upstream) or a bare `host:port` (plain HTTP).
    pub url: String,
    /// Several instances of the service instead of `url` (the file only): each with its own cap. The upstream's
    /// cap in force is then the lower of `max_connections` and their sum.
    /// Or, as a table, endpoints discovered from DNS (see [`DnsEndpoints`]).
    #[serde(skip_serializing_if = "Endpoints::is_empty")]
    pub endpoints: Endpoints,
    /// With several endpoints: this many consecutive failed dials eject an endpoint for a while; 0: never.
    #[serde(deserialize_with = "integer::deserialize")]
    pub eject_after: u32,
    /// How long a first ejection lasts; each repeated one (no successful dial in between) lasts twice as long.
    #[serde(with = "humantime_serde")]
    pub eject_backoff: Duration,
    /// The longest an ejection lasts.
    #[serde(with = "humantime_serde")]
    pub eject_backoff_max: Duration,
    /// With several endpoints: a path each endpoint is sent `GET` at every `health_check_interval`, on a
    /// connection of its own that takes a slot like any other; empty: no active checks.
    pub health_check_path: String,
    /// How often each endpoint is checked, and how long one check may take.
    #[serde(with = "humantime_serde")]
    pub health_check_interval: Duration,
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_connections: usize,
    /// `http1` or `http2`.
    pub protocol: UpstreamProtocol,
    /// HTTP/2 only: most requests at once on one connection, and never more than the upstream's own
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` at that moment. So at most `max_connections` times this are at work.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_streams_per_connection: usize,
    /// HTTP/2 only: a PING this often on each connection, which is closed when one goes unanswered until the
    /// next; zero: none (gRPC servers take PINGs on an idle connection as abuse by default).
    #[serde(with = "humantime_serde")]
    pub ping_interval: Duration,
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_queue: usize,
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// The order waiting requests are served in: `fifo`, `adaptive-lifo` or `codel`.
    pub queue_discipline: Discipline,
    /// CoDel's acceptable queue wait.
    #[serde(with = "humantime_serde")]
    pub codel_target: Duration,
    /// CoDel's window, and how long a queue must stand before adaptive LIFO turns to newest first.
    #[serde(with = "humantime_serde")]
    pub codel_interval: Duration,
    /// A request header carrying the client's timeout in milliseconds (`X-Request-Timeout: 250`); a request that
    /// cannot start within it is shed. Empty: no such header is read. Parsed once, with the configuration.
    #[serde(with = "header_name_text")]
    pub deadline_header: Option<http::HeaderName>,
    /// Whether gRPC's `grpc-timeout` header (`250m`, `2S`…) is read as a deadline too.
    pub grpc_timeout: bool,
    /// When no endpoint can be dialled (refused, failed, timed out), requests wait for one to answer again, within
    /// their queue_timeout and deadline, instead of a 502: nothing of them was sent.
    pub hold_while_down: bool,
    /// Every slot busy and no exchange finished for this long: the upstream is taken for stalled, new requests
    /// are shed at once (`upstream_stalled`) and the queue with them, until an exchange finishes. Zero: off.
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// The status of an answer shed for capacity (queue full, queue timeout, CoDel overload). A request shed for
    /// its own deadline gets 504.
    #[serde(deserialize_with = "integer::deserialize")]
    pub shed_status: u16,
    /// What makes two requests the same client for fair sharing: `client_ip`, `header:NAME` or `route`; empty:
    /// no fairness, one shared FIFO lane. Parsed once, with the configuration: see [`FairKey`].
    #[serde(with = "fair_key_text")]
    pub fair_key: Option<FairKey>,
    /// Grants per round for particular keys (default 1 each).
    #[serde(deserialize_with = "integer::map")]
    pub fair_weights: BTreeMap<String, u32>,
    /// Most requests one key may have waiting (beyond: `quota_status`); 0: no per-key bound.
    #[serde(deserialize_with = "integer::deserialize")]
    pub fair_max_queue: usize,
    /// The status of an answer shed for a key's quota.
    #[serde(deserialize_with = "integer::deserialize")]
    pub quota_status: u16,
    /// A request header whose value (0-9) is the request's priority class, higher served first; empty: none,
    /// every request has its route's class. Parsed once, with the configuration.
    #[serde(with = "header_name_text")]
    pub priority_header: Option<http::HeaderName>,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub close_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub body_idle_timeout: Duration,
    /// 0 means unlimited.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_requests_per_connection: u64,
    /// An exchange holding its slot longer than this logs one warning with its request ID and is counted
    /// (HikariCP's `leakDetectionThreshold`); zero: off.
    #[serde(with = "humantime_serde")]
    pub hold_warn_after: Duration,
    /// Idle connections kept ready (dialled at start, after a reload and after idle ones close), within the cap;
    /// `idle_timeout` closes none below it. 0: none.
    #[serde(deserialize_with = "integer::deserialize")]
    pub min_idle: usize,
    /// 0 means unlimited.
    #[serde(with = "humantime_serde")]
    pub max_connection_lifetime: Duration,
    /// How much of a response the proxy still reads after its client went away, to keep the connection.
    #[serde(deserialize_with = "integer::deserialize")]
    pub abort_drain_bytes: u64,
    #[serde(with = "humantime_serde")]
    pub abort_drain_timeout: Duration,
    /// `off`, or `gradient`: a limit on the requests in flight at the upstream that moves between
    /// `min_connections` and `max_connections` with the response times observed (see [`crate::pool`]).
    pub adaptive_limit: AdaptiveLimit,
    /// The lowest the adaptive limit goes.
    #[serde(deserialize_with = "integer::deserialize")]
    pub min_connections: usize,
    /// How often the adaptive limit is worked out again, from the responses since.
    #[serde(with = "humantime_serde")]
    pub adaptive_window: Duration,
    /// How much slower than the baseline a window may be before the limit is cut (1.5: half as slow again).
    pub adaptive_tolerance: f64,
    /// How far each window moves the limit towards its new target (0 to 1).
    pub adaptive_smoothing: f64,
    /// How often the limit dips to measure the baseline response time again.
    #[serde(with = "humantime_serde")]
    pub adaptive_probe_interval: Duration,
    /// `https://` only: a PEM bundle of the CAs the upstream's certificate must chain to; without it, the
    /// system's roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// `https://` only: a PEM certificate chain presented to an upstream that asks for one; with
    /// `tls_client_key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_cert: Option<PathBuf>,
    /// `https://` only: the PEM private key of the first certificate in `tls_client_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_key: Option<PathBuf>,
    /// `https://` only: the name sent as SNI and verified in the upstream's certificate, instead of the URL's
    /// host (a DNS name, or an IP address: then no SNI is sent and the certificate must name the address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
    /// A request body of at most this many bytes is read in full before the request is admitted, so a slow
    /// uploader never holds a slot; 0 turns it off.
    #[serde(deserialize_with = "integer::deserialize")]
    pub buffer_request_bytes: u64,
    /// A response body of at most this many bytes (by its Content-Length) is read in full at upstream speed and
    /// the connection given back before the client is sent it; 0 turns it off.
    #[serde(deserialize_with = "integer::deserialize")]
    pub buffer_response_bytes: u64,
    /// Most tunnels (WebSockets and other HTTP/1.1 upgrades) open to the upstream at once, each on a socket of its
    /// own beside the `max_connections` ones; 0 (the default) refuses every upgrade with `501`.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_tunnels: usize,
    /// A tunnel with no byte either way for this long is closed.
    #[serde(with = "humantime_serde")]
    pub tunnel_idle_timeout: Duration,
    /// A bound on the clients' own retries (see [`RetryBudget`]); unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<RetryBudget>,
    /// Each endpoint starts at a small cap in force and earns its full one by its response times (see
    /// [`SlowStart`]); unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_start: Option<SlowStart>,
    /// Declares `max_connections` (and `max_tunnels`) as the upstream's total across floodgate's replicas, each
    /// taking its share from a live count of them (see [`ReplicaSource`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaSource>,
}

/// Clients' own retries (a request carrying one of `headers`) admitted only while their budget allows: each first
/// attempt earns `ratio` of a retry, and `min_per_second` more come each second (a bucket that holds ten seconds'
/// worth); a retry beyond it is shed at once (`retry_budget`), before it can join the queue.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBudget {
    /// Each first attempt earns this many retries (0.2: one retry per five requests).
    #[serde(default = "RetryBudget::default_ratio")]
    pub ratio: f64,
    /// Retries allowed each second whatever the first attempts (so a quiet upstream's few retries pass).
    #[serde(
        default = "RetryBudget::default_min_per_second",
        deserialize_with = "integer::deserialize"
    )]
    pub min_per_second: u32,
    /// Request headers that mark a request as a retry when present (lower case).
    #[serde(default = "RetryBudget::default_headers")]
    pub headers: Vec<String>,
}

impl RetryBudget {
    fn default_ratio() -> f64 {
        0.2
    }

    fn default_min_per_second() -> u32 {
        10
    }

    fn default_headers() -> Vec<String> {
        vec!["grpc-previous-rpc-attempts".into(), "x-retry-attempt".into()]
    }
}

/// Slow start that measures: an endpoint new to the pool (every one when floodgate starts) or back from ejection
/// starts with `initial` connections in force, and the cap in force doubles after each `window` whose mean response
/// time (at least `min_samples` of them) stays within `tolerance` of the lowest window mean its ramp has seen; it
/// holds past that, and halves (to no less than `initial`) past twice that. It ends at the endpoint's own cap, or
/// after `max_duration` whatever the times say.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlowStart {
    #[serde(default = "SlowStart::default_initial", deserialize_with = "integer::deserialize")]
    pub initial: usize,
    #[serde(default = "SlowStart::default_window", with = "humantime_serde")]
    pub window: Duration,
    #[serde(default = "SlowStart::default_tolerance")]
    pub tolerance: f64,
    #[serde(
        default = "SlowStart::default_min_samples",
        deserialize_with = "integer::deserialize"
    )]
    pub min_samples: u32,
    #[serde(default = "SlowStart::default_max_duration", with = "humantime_serde")]
    pub max_duration: Duration,
}

impl SlowStart {
    fn default_initial() -> usize {
        1
    }

    fn default_window() -> Duration {
        Duration::from_secs(1)
    }

    fn default_tolerance() -> f64 {
        1.5
    }

    fn default_min_samples() -> u32 {
        5
    }

    fn default_max_duration() -> Duration {
        Duration::from_secs(60)
    }
}

/// Where a replica counts floodgate's replicas: the addresses a DNS name resolves to (a headless Service of
/// floodgate's pods), or a file holding the count (or one address per replica, a line each).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// How often the count is read again.
    #[serde(default = "ReplicaSource::default_interval", with = "humantime_serde")]
    pub interval: Duration,
}

impl ReplicaSource {
    /// The shortest `interval`: a count is read from a file or asked of DNS each time, and a shorter one would only
    /// spend a thread's time on reads (a typo such as `1ns` would read without a pause).
    pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

    fn default_interval() -> Duration {
        Duration::from_secs(5)
    }

    /// Whether a file of this type can hold a count: a regular file, or a named pipe something writes the count
    /// into. A directory has no count, and a device (`/dev/zero`) or a socket is read without end or forever.
    pub fn can_hold_count(file_type: std::fs::FileType) -> bool {
        use std::os::unix::fs::FileTypeExt;
        file_type.is_file() || file_type.is_fifo()
    }

    /// What is wrong with `file` as a count's source, as far as can be told before it is read: it exists and is no
    /// file a count can be read from. A file that does not exist (yet) is no problem here: it is read as it comes.
    pub(super) fn file_problem(file: &std::path::Path) -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        let file_type = std::fs::metadata(file).ok()?.file_type();
        let what = match file_type {
            _ if Self::can_hold_count(file_type) => return None,
            _ if file_type.is_dir() => "a directory",
            _ if file_type.is_char_device() || file_type.is_block_device() => "a device",
            _ if file_type.is_socket() => "a socket",
            _ => "not a regular file",
        };
        Some(format!(
            "{} is {what}: the count is read from a regular file (or a named pipe)",
            file.display()
        ))
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: String::new(),
            endpoints: Endpoints::default(),
            eject_after: 3,
            eject_backoff: Duration::from_secs(1),
            eject_backoff_max: Duration::from_secs(30),
            health_check_path: String::new(),
            health_check_interval: Duration::from_secs(5),
            max_connections: 8,
            protocol: UpstreamProtocol::Http1,
            // One: the requests at work stay `max_connections`, as for HTTP/1, unless more are asked for.
            max_streams_per_connection: 1,
            ping_interval: Duration::ZERO,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(5),
            queue_discipline: Discipline::Fifo,
            codel_target: Duration::from_millis(5),
            codel_interval: Duration::from_millis(100),
            deadline_header: Some(http::HeaderName::from_static("x-request-timeout")),
            grpc_timeout: true,
            stall_timeout: Duration::ZERO,
            hold_while_down: false,
            shed_status: 503,
            fair_key: None,
            fair_weights: BTreeMap::new(),
            fair_max_queue: 0,
            quota_status: 429,
            priority_header: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(1),
            body_idle_timeout: Duration::from_secs(30),
            max_requests_per_connection: 0,
            min_idle: 0,
            hold_warn_after: Duration::ZERO,
            max_connection_lifetime: Duration::ZERO,
            abort_drain_bytes: 1024 * 1024,
            abort_drain_timeout: Duration::from_secs(5),
            adaptive_limit: AdaptiveLimit::Off,
            min_connections: 1,
            adaptive_window: Duration::from_millis(100),
            adaptive_tolerance: 1.5,
            adaptive_smoothing: 0.2,
            adaptive_probe_interval: Duration::from_secs(30),
            max_tunnels: 0,
            tunnel_idle_timeout: Duration::from_secs(300),
            replicas: None,
            retry_budget: None,
            slow_start: None,
            tls_ca: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_server_name: None,
            buffer_request_bytes: 64 * 1024,
            buffer_response_bytes: 64 * 1024,
        }
    }
}

impl UpstreamConfig {
    /// The endpoints the pool of upstream `name` dials, each with its own cap: every `endpoints` entry, or the one
    /// `url` with no cap of its own (`usize::MAX`: the upstream's `max_connections` alone bounds it). The first
    /// problem found is named by its key; validation reports them all (see `UpstreamConfig::endpoint_problems`).
    pub fn endpoint_list(&self, name: &str) -> Result<Vec<(Origin, usize)>, ConfigError> {
        self.endpoint_problems(name).map_err(|problems| {
            problems
                .into_iter()
                .next()
                .unwrap_or_else(|| ConfigError::new(format!("upstreams.{name}"), "no usable endpoint"))
        })
    }

    /// [`UpstreamConfig::endpoint_list`] with every problem, never an empty list of them.
    pub(crate) fn endpoint_problems(&self, name: &str) -> Result<Vec<(Origin, usize)>, Vec<ConfigError>> {
        let key = |field: &str| format!("upstreams.{name}.{field}");
        match (self.url.is_empty(), self.endpoints.is_empty()) {
            (false, false) => {
                return Err(vec![ConfigError::new(
                    key("endpoints"),
                    "give either url or endpoints, not both",
                )])
            }
            (true, true) => {
                return Err(vec![ConfigError::new(
                    key("url"),
                    "missing (e.g. \"http://127.0.0.1:9000\", or endpoints = [{ url = ..., max_connections = ... }])",
                )])
            }
            (false, true) => {
                let origin = Origin::parse(&self.url).map_err(|message| vec![ConfigError::new(key("url"), message)])?;
                return Ok(vec![(origin, usize::MAX)]);
            }
            (true, false) => {}
        }
        if let Some(dns) = self.endpoints.dns() {
            let mut problems = Vec::new();
            if dns.dns.trim().is_empty() || dns.dns.contains(['/', ':', ' ']) {
                problems.push(ConfigError::new(key("endpoints.dns"), "must be a DNS name"));
            }
            if dns.port == 0 {
                problems.push(ConfigError::new(key("endpoints.port"), "must be from 1 to 65535"));
            }
            if dns.max_connections == 0 {
                problems.push(ConfigError::new(key("endpoints.max_connections"), "must be at least 1"));
            }
            match dns.scheme() {
                None => problems.push(ConfigError::new(
                    key("endpoints.scheme"),
                    "must be \"http\" or \"https\"",
                )),
                Some(Scheme::Https) if self.tls_server_name.is_none() => problems.push(ConfigError::new(
                    key("endpoints.scheme"),
                    "https:// endpoints found by DNS need tls_server_name (the one name verified)",
                )),
                Some(_) => {}
            }
            if dns.interval < DnsEndpoints::MIN_INTERVAL {
                problems.push(ConfigError::new(
                    key("endpoints.interval"),
                    format!("must be at least {}ms", DnsEndpoints::MIN_INTERVAL.as_millis()),
                ));
            }
            // Discovered, not listed: the pool starts with none and takes the first resolution's.
            return if problems.is_empty() {
                Ok(Vec::new())
            } else {
                Err(problems)
            };
        }
        let mut problems = Vec::new();
        let listed = self.endpoints.listed();
        let mut list: Vec<(Origin, usize)> = Vec::with_capacity(listed.len());
        for (index, endpoint) in listed.iter().enumerate() {
            let at = |field: &str| key(&format!("endpoints[{index}].{field}"));
            if endpoint.max_connections == 0 {
                problems.push(ConfigError::new(at("max_connections"), "must be at least 1"));
            }
            let origin = match Origin::parse(&endpoint.url) {
                Ok(origin) => origin,
                Err(message) => {
                    problems.push(ConfigError::new(at("url"), message));
                    continue;
                }
            };
            if list.iter().any(|(seen, _)| *seen == origin) {
                problems.push(ConfigError::new(at("url"), "the same endpoint is listed twice"));
                continue;
            }
            if let Some((first, _)) = list.first() {
                // One TLS client serves every endpoint: one scheme, and one name to verify.
                if first.scheme != origin.scheme {
                    problems.push(ConfigError::new(at("url"), "every endpoint must use the same scheme"));
                } else if origin.scheme == Scheme::Https && first.host != origin.host && self.tls_server_name.is_none()
                {
                    problems.push(ConfigError::new(
                        at("url"),
                        "https:// endpoints with different hosts need tls_server_name (the one name verified)",
                    ));
                }
            }
            list.push((origin, endpoint.max_connections));
        }
        if problems.is_empty() {
            Ok(list)
        } else {
            Err(problems)
        }
    }

    /// Every duration key with its value and whether 0 is allowed (it means "none" there); validation and the
    /// config fuzz target both walk this one list.
    pub fn durations(&self) -> [(&'static str, Duration, bool); 19] {
        [
            ("health_check_interval", self.health_check_interval, false),
            ("eject_backoff", self.eject_backoff, false),
            ("eject_backoff_max", self.eject_backoff_max, false),
            ("queue_timeout", self.queue_timeout, true),
            ("codel_target", self.codel_target, false),
            ("codel_interval", self.codel_interval, false),
            ("connect_timeout", self.connect_timeout, false),
            ("request_timeout", self.request_timeout, false),
            ("idle_timeout", self.idle_timeout, false),
            ("close_timeout", self.close_timeout, false),
            ("body_idle_timeout", self.body_idle_timeout, false),
            ("max_connection_lifetime", self.max_connection_lifetime, true),
            ("ping_interval", self.ping_interval, true),
            ("stall_timeout", self.stall_timeout, true),
            ("hold_warn_after", self.hold_warn_after, true),
            ("abort_drain_timeout", self.abort_drain_timeout, false),
            ("adaptive_window", self.adaptive_window, false),
            ("adaptive_probe_interval", self.adaptive_probe_interval, false),
            ("tunnel_idle_timeout", self.tunnel_idle_timeout, false),
        ]
    }
}

/// The highest priority class.
pub const MAX_PRIORITY: u8 = 9;

/// What makes requests the same client, for fair sharing of one upstream's slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FairKey {
    /// The client's address: the peer's, or behind a trusted proxy the last `X-Forwarded-For` entry that is not
    /// itself a trusted proxy.
    ClientIp,
    /// A request header's value, such as an API key; requests without it share one lane.
    Header(http::HeaderName),
    /// The route the request took.
    Route,
}

impl FairKey {
    pub(super) fn parse(text: &str) -> Result<Option<FairKey>, String> {
        match text {
            "" => Ok(None),
            "client_ip" => Ok(Some(FairKey::ClientIp)),
            "route" => Ok(Some(FairKey::Route)),
            other => match other.strip_prefix("header:") {
                Some(name) => http::HeaderName::from_bytes(name.trim().as_bytes())
                    .map(|name| Some(FairKey::Header(name)))
                    .map_err(|_| format!("`{name}` is not a header name")),
                None => Err("must be \"\", client_ip, route or header:NAME".to_string()),
            },
        }
    }

    pub(super) fn text(&self) -> String {
        match self {
            FairKey::ClientIp => "client_ip".to_string(),
            FairKey::Route => "route".to_string(),
            FairKey::Header(name) => format!("header:{name}"),
        }
    }
}

/// `fair_key` as the file writes it (`""`, `client_ip`, `route`, `header:NAME`), parsed when the configuration is
/// read rather than at every request.
pub(super) mod fair_key_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::FairKey;

    pub(crate) fn serialize<S: Serializer>(key: &Option<FairKey>, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&key.as_ref().map(FairKey::text).unwrap_or_default())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<FairKey>, D::Error> {
        let text = String::deserialize(deserializer)?;
        FairKey::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A header name key as the file writes it (`""` for none), checked when the configuration is read rather than at
/// every request, which then looks it up by the name made here.
pub(super) mod header_name_text {
    use http::HeaderName;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(name: &Option<HeaderName>, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(name.as_ref().map_or("", HeaderName::as_str))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<HeaderName>, D::Error> {
        let text = String::deserialize(deserializer)?;
        if text.is_empty() {
            return Ok(None);
        }
        HeaderName::from_bytes(text.as_bytes())
            .map(Some)
            .map_err(|_| serde::de::Error::custom("not a header name (or \"\" for none)"))
    }
}

/// How the pool talks to an upstream: plain HTTP/1.1, or HTTP/1.1 inside TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    pub(super) fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

/// An upstream origin as dialled: scheme, host (name or IP literal, brackets removed) and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub scheme: Scheme,
    pub host: String,
    pub port: u16,
}

impl Origin {
    /// Parses `http://host:port`, `https://host:port`, either without a port (80, 443) or `host:port` (plain
    /// HTTP); IPv6 literals in brackets.
    pub fn parse(text: &str) -> Result<Origin, String> {
        let (scheme, rest) = match text.split_once("://") {
            Some(("http", rest)) => (Scheme::Http, rest),
            Some(("https", rest)) => (Scheme::Https, rest),
            Some((scheme, _)) => return Err(format!("scheme `{scheme}` is not supported (use http:// or https://)")),
            None => (Scheme::Http, text),
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') || authority.contains('@') {
            return Err(format!("`{text}` is not an origin like http://host:port"));
        }
        let uri_authority: http::uri::Authority = authority
            .parse()
            .map_err(|_| format!("`{text}` is not an origin like http://host:port"))?;
        let host = uri_authority.host().trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("`{text}` has no host"));
        }
        // A name, an IPv4 address or a bracketed IPv6 one; the URI grammar lets more through (`a[1::]`).
        let valid_host = if uri_authority.host().starts_with('[') {
            host.parse::<std::net::Ipv6Addr>().is_ok()
        } else {
            host.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        };
        if !valid_host {
            return Err(format!("`{text}` has an invalid host"));
        }
        let port = match uri_authority.port_u16() {
            Some(port) => port,
            None if rest.contains(':') && !authority.ends_with(']') => {
                return Err(format!("`{text}` has an invalid port"))
            }
            None => scheme.default_port(),
        };
        if port == 0 {
            return Err(format!("`{text}` has port 0"));
        }
        Ok(Origin {
            scheme,
            host: host.to_string(),
            port,
        })
    }

    /// `scheme://host:port`, which parses back to this origin.
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme.as_str(), self.authority())
    }

    /// The `host:port` form used for Host headers and logs.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The order waiting requests are served in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Discipline {
    /// Oldest first.
    #[default]
    Fifo,
    /// Oldest first until the queue has been non-empty for `codel_interval`, then newest first: under sustained
    /// overload the fresh requests, whose clients still wait, are the ones served in time.
    AdaptiveLifo,
    /// Oldest first; once every request served over `codel_interval` waited longer than `codel_target`, those
    /// that waited over twice the target are shed instead of served.
    Codel,
}
