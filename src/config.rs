//! Configuration: layers turned into one validated, typed [`Config`]. Each layer overrides the one before:
//! built-in defaults, a TOML file, `FLOODGATE__` environment variables ([`Env`]), command-line flags
//! ([`Overrides`]).
//!
//! Owns the defaults (stated again in `config/floodgate.toml`), the environment mapping, the parsing of humane
//! durations, the validation that refuses a configuration with one line per problem, each naming its key, and
//! the redaction of [`Secret`] values wherever a configuration is shown. It never reads the network and never
//! starts anything; the only files it touches besides the configuration are the TLS ones it names (and the
//! system's root certificates, for an `https://` upstream without `tls_ca`), checked through [`crate::tls`], and
//! the `access_log` file, opened to append (and removed again if that created it), so that `floodgate check`
//! refuses what start-up would. What it returns is trusted by every other module.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use crate::admission::{Discipline, QueuePolicy};
pub use crate::pool::AdaptiveLimit;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};

/// A configuration problem, always naming the key it is about.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Every problem found in one configuration, each naming its key; never empty. Displayed on one line (`; `
/// between problems); the binary prints [`ConfigErrors::problems`] one per line.
#[derive(Debug, thiserror::Error)]
#[error("{}", join_problems(.0))]
pub struct ConfigErrors(Vec<ConfigError>);

impl From<ConfigError> for ConfigErrors {
    fn from(problem: ConfigError) -> Self {
        ConfigErrors(vec![problem])
    }
}

impl ConfigErrors {
    pub fn problems(&self) -> &[ConfigError] {
        &self.0
    }
}

fn join_problems(problems: &[ConfigError]) -> String {
    problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// What [`Secret`] values are shown as.
pub const REDACTED: &str = "<redacted>";

/// A configuration value that must never be shown. It serializes (what `floodgate check` prints) and debug-prints
/// (what logs show) as [`REDACTED`], so a key declared with this type, such as a future admin bearer token or
/// TLS private key, is redacted everywhere without each place remembering to.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

/// Variables whose names start with this set configuration keys: the rest of the name is the key's path with
/// [`ENV_SEPARATOR`] between its parts, case-insensitive (`FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS`).
/// Kubernetes injects `FLOODGATE_PORT=tcp://…`, `FLOODGATE_SERVICE_HOST`, `FLOODGATE_PORT_8080_TCP_ADDR`… into
/// every pod of a namespace with a Service named floodgate; a single underscore never matches, so those never
/// reach the configuration.
pub const ENV_PREFIX: &str = "FLOODGATE__";
pub const ENV_SEPARATOR: &str = "__";

/// Lists of tables, which only the file can give.
const FILE_ONLY_LISTS: [&str; 2] = ["routes", "tls_certificates"];

/// The variables the environment layer reads.
#[derive(Debug, Clone)]
pub enum Env {
    /// The process's environment.
    Process,
    /// Exactly these variables instead (tests, the fuzz targets, the demo).
    Vars(BTreeMap<String, String>),
}

impl Env {
    /// No variables at all: the file and the flags alone.
    pub fn none() -> Env {
        Env::Vars(BTreeMap::new())
    }

    /// The names of the variables that set keys, sorted, so that `floodgate check` can say where values came
    /// from.
    pub fn variables(&self) -> Vec<String> {
        let mut names: Vec<String> = match self {
            Env::Process => std::env::vars_os()
                .filter_map(|(name, _)| name.into_string().ok())
                .collect(),
            Env::Vars(vars) => vars.keys().cloned().collect(),
        };
        names.retain(|name| {
            name.get(..ENV_PREFIX.len())
                .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENV_PREFIX))
        });
        names.sort();
        names
    }
}

/// The variable that sets `key` (`upstreams.api.url` → `FLOODGATE__UPSTREAMS__API__URL`).
pub fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', ENV_SEPARATOR).to_ascii_uppercase())
}

/// The environment layer as configuration values keyed like the file's (`upstreams.api.max_connections`).
#[derive(Debug, Clone)]
struct EnvLayer(config::Map<String, config::Value>);

impl config::Source for EnvLayer {
    fn clone_into_box(&self) -> Box<dyn config::Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<config::Map<String, config::Value>, config::ConfigError> {
        Ok(self.0.clone())
    }
}

impl EnvLayer {
    /// Reads the variables once; problems the layer itself finds go to `problems` and their variables are left
    /// out, so the rest of the configuration is still checked.
    fn read(env: &Env, problems: &mut Vec<ConfigError>) -> EnvLayer {
        let prefix = ENV_PREFIX.trim_end_matches(ENV_SEPARATOR);
        let source = config::Environment::with_prefix(prefix)
            .prefix_separator(ENV_SEPARATOR)
            .separator(ENV_SEPARATOR);
        let source = match env {
            Env::Process => source,
            Env::Vars(vars) => source.source(Some(vars.clone().into_iter().collect())),
        };
        let mut values = match config::Source::collect(&source) {
            Ok(values) => values,
            Err(err) => {
                problems.push(ConfigError::new("environment", one_line(&err.to_string())));
                config::Map::new()
            }
        };
        // Routes and the listener's extra certificates are lists of tables, and a variable's name has no way to
        // say which entry it means.
        let mut list_variables = Vec::new();
        values.retain(|key, _| {
            let list = FILE_ONLY_LISTS.iter().find(|list| {
                key == *list
                    || key
                        .strip_prefix(*list)
                        .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            });
            if let Some(list) = list {
                list_variables.push((*list, env_var(key)));
            }
            list.is_none()
        });
        list_variables.sort();
        problems.extend(list_variables.into_iter().map(|(list, variable)| {
            ConfigError::new(
                list,
                format!("cannot be set from the environment ({variable}); give [[{list}]] in the file"),
            )
        }));
        // The one list of plain values: in a variable, comma-separated.
        if let Some(value) = values.get_mut("trusted_proxies") {
            if let Ok(text) = value.clone().into_string() {
                let origin = "the environment".to_string();
                let items: Vec<config::Value> = text
                    .split(',')
                    .map(str::trim)
                    .filter(|item| !item.is_empty())
                    .map(|item| config::Value::new(Some(&origin), item))
                    .collect();
                *value = config::Value::new(Some(&origin), items);
            }
        }
        EnvLayer(values)
    }

    /// Names the variable behind a bad value: the key alone would send an operator looking in the file.
    fn annotate(&self, problem: &mut ConfigError) {
        let key = problem.key.split('[').next().unwrap_or(&problem.key);
        if self.0.contains_key(key) {
            problem.message = format!("{} (from {})", problem.message, env_var(key));
        }
    }
}

/// The whole validated configuration. Serializes as the TOML file that states it (what `floodgate check`
/// prints).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Tokio worker threads; `None` lets the runtime use one per CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "integer::option")]
    pub threads: Option<usize>,
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_client_connections: usize,
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub client_idle_timeout: Duration,
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_header_bytes: usize,
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_concurrent_streams: u32,
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    pub trusted_proxies: Vec<IpNet>,
    pub log_format: LogFormat,
    /// A `tracing` filter (`info`, `warn,floodgate=debug`); `RUST_LOG`, when set, wins over it.
    pub log_level: String,
    /// `off`, `stdout`, `stderr` or a file path (appended to); see [`Config::access_log_target`].
    pub access_log: String,
    /// PEM certificate chain (leaf first) the client listener presents; with `tls_key`, the listener speaks TLS
    /// only, and ALPN (`h2`, `http/1.1`) picks the protocol. Paths are not secrets; the key file is never shown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the first certificate in `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Bearer token that lets a client use the admin listener's write endpoints (`POST /reload`,
    /// `PUT /upstreams/NAME/max_connections`) when that listener is not on a loopback address. Without it, they
    /// are refused there; on loopback they are always allowed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<Secret>,
    /// Certificates the listener picks by the SNI name the client sends (`[[tls_certificates]]`); `tls_cert` and
    /// `tls_key` are the default for any other name or none. With these and no default, a client whose name
    /// matches no entry is refused at the handshake.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tls_certificates: Vec<TlsCertificateConfig>,
    /// Bytes of request and response bodies held in memory at once, over all requests and upstreams (see
    /// `buffer_request_bytes` and `buffer_response_bytes`); a body that does not fit what is left streams.
    #[serde(deserialize_with = "integer::deserialize")]
    pub max_buffered_bytes: u64,
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub routes: Vec<RouteConfig>,
}

/// Where access-log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLogTarget {
    Off,
    Stdout,
    Stderr,
    File(std::path::PathBuf),
}

impl Config {
    /// The `access_log` key read: the three names, or else a file path.
    pub fn access_log_target(&self) -> AccessLogTarget {
        match self.access_log.as_str() {
            "off" => AccessLogTarget::Off,
            "stdout" => AccessLogTarget::Stdout,
            "stderr" => AccessLogTarget::Stderr,
            path => AccessLogTarget::File(path.into()),
        }
    }
}

/// How log lines are written: `human` (one readable line each) or `json` (one JSON object per line).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: SocketAddr::from(([127, 0, 0, 1], 9901)),
            threads: None,
            max_client_connections: 10_000,
            first_byte_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            client_idle_timeout: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            max_concurrent_streams: 512,
            shutdown_timeout: Duration::from_secs(30),
            trusted_proxies: Vec::new(),
            log_format: LogFormat::Human,
            log_level: "info".to_string(),
            access_log: "off".to_string(),
            tls_cert: None,
            tls_key: None,
            admin_token: None,
            tls_certificates: Vec::new(),
            max_buffered_bytes: 32 * 1024 * 1024,
            upstreams: BTreeMap::new(),
            routes: Vec::new(),
        }
    }
}

/// One certificate of the client listener and the SNI names it is presented for.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsCertificateConfig {
    /// Names compared with the client's SNI name, case-insensitively; `*.example.org` matches exactly one label
    /// in place of the `*` (`a.example.org`, not `a.b.example.org` nor `example.org`). An exact name wins over a
    /// wildcard.
    pub names: Vec<String>,
    /// PEM certificate chain, leaf first; it must be valid for every name in `names`.
    pub cert: PathBuf,
    /// PEM private key of the first certificate in `cert`.
    pub key: PathBuf,
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

/// One named upstream origin and the limits of its pool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// `http://host:port`, `https://host:port` (TLS to the upstream) or a bare `host:port` (plain HTTP).
    pub url: String,
    /// Several instances of the service instead of `url` (the file only): each with its own cap. The upstream's
    /// cap in force is then the lower of `max_connections` and their sum.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointConfig>,
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
    /// cannot start within it is shed. Empty: no such header is read.
    pub deadline_header: String,
    /// Whether gRPC's `grpc-timeout` header (`250m`, `2S`…) is read as a deadline too.
    pub grpc_timeout: bool,
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
    /// every request has its route's class.
    pub priority_header: String,
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
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: String::new(),
            endpoints: Vec::new(),
            eject_after: 3,
            eject_backoff: Duration::from_secs(1),
            eject_backoff_max: Duration::from_secs(30),
            health_check_path: String::new(),
            health_check_interval: Duration::from_secs(5),
            max_connections: 8,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(5),
            queue_discipline: Discipline::Fifo,
            codel_target: Duration::from_millis(5),
            codel_interval: Duration::from_millis(100),
            deadline_header: "x-request-timeout".to_string(),
            grpc_timeout: true,
            shed_status: 503,
            fair_key: None,
            fair_weights: BTreeMap::new(),
            fair_max_queue: 0,
            quota_status: 429,
            priority_header: String::new(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(1),
            body_idle_timeout: Duration::from_secs(30),
            max_requests_per_connection: 0,
            max_connection_lifetime: Duration::ZERO,
            abort_drain_bytes: 1024 * 1024,
            abort_drain_timeout: Duration::from_secs(5),
            adaptive_limit: AdaptiveLimit::Off,
            min_connections: 1,
            adaptive_window: Duration::from_millis(100),
            adaptive_tolerance: 1.5,
            adaptive_smoothing: 0.2,
            adaptive_probe_interval: Duration::from_secs(30),
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
    /// problem found is named by its key; validation reports them all (see [`UpstreamConfig::endpoint_problems`]).
    pub fn endpoint_list(&self, name: &str) -> Result<Vec<(Origin, usize)>, ConfigError> {
        self.endpoint_problems(name).map_err(|problems| {
            problems
                .into_iter()
                .next()
                .unwrap_or_else(|| ConfigError::new(format!("upstreams.{name}"), "no usable endpoint"))
        })
    }

    /// [`UpstreamConfig::endpoint_list`] with every problem, never an empty list of them.
    fn endpoint_problems(&self, name: &str) -> Result<Vec<(Origin, usize)>, Vec<ConfigError>> {
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
        let mut problems = Vec::new();
        let mut list: Vec<(Origin, usize)> = Vec::with_capacity(self.endpoints.len());
        for (index, endpoint) in self.endpoints.iter().enumerate() {
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

    /// The admission queue's bound and discipline.
    pub fn queue_policy(&self) -> QueuePolicy {
        QueuePolicy {
            max_queue: self.max_queue,
            discipline: self.queue_discipline,
            target: self.codel_target,
            interval: self.codel_interval,
            per_key_max: self.fair_max_queue,
            weights: std::sync::Arc::new(self.fair_weights.clone()),
        }
    }

    /// Every duration key with its value and whether 0 is allowed (it means "none" there); validation and the
    /// config fuzz target both walk this one list.
    pub fn durations(&self) -> [(&'static str, Duration, bool); 15] {
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
            ("abort_drain_timeout", self.abort_drain_timeout, false),
            ("adaptive_window", self.adaptive_window, false),
            ("adaptive_probe_interval", self.adaptive_probe_interval, false),
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
    fn parse(text: &str) -> Result<Option<FairKey>, String> {
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

    fn text(&self) -> String {
        match self {
            FairKey::ClientIp => "client_ip".to_string(),
            FairKey::Route => "route".to_string(),
            FairKey::Header(name) => format!("header:{name}"),
        }
    }
}

/// `fair_key` as the file writes it (`""`, `client_ip`, `route`, `header:NAME`), parsed when the configuration is
/// read rather than at every request.
mod fair_key_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::FairKey;

    pub fn serialize<S: Serializer>(key: &Option<FairKey>, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&key.as_ref().map(FairKey::text).unwrap_or_default())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<FairKey>, D::Error> {
        let text = String::deserialize(deserializer)?;
        FairKey::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Integer keys. The `config` crate would read `4.5` as 5, `0.5` as 1 and `true` or `"yes"` as 1; these take an
/// integer, or a string that is one (all the environment can give), and refuse the rest naming what they got.
mod integer {
    use std::collections::BTreeMap;
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{self, Deserialize, Deserializer, Unexpected, Visitor};

    /// An integer type a key may have, with its range for the refusal.
    pub trait Whole: TryFrom<i128> {
        const MIN: i128;
        const MAX: i128;
    }

    macro_rules! whole {
        ($($t:ty),*) => {$(
            impl Whole for $t {
                const MIN: i128 = <$t>::MIN as i128;
                const MAX: i128 = <$t>::MAX as i128;
            }
        )*};
    }
    whole!(u8, u16, u32, u64, usize);

    struct Int<T>(T);

    struct IntVisitor<T>(PhantomData<T>);

    impl<T: Whole> IntVisitor<T> {
        fn fit<E: de::Error>(value: i128) -> Result<Int<T>, E> {
            match T::try_from(value) {
                Ok(value) => Ok(Int(value)),
                Err(_) => Err(E::custom(format!(
                    "invalid value: integer `{value}`, expected an integer from {} to {}",
                    T::MIN,
                    T::MAX
                ))),
            }
        }
    }

    impl<T: Whole> Visitor<'_> for IntVisitor<T> {
        type Value = Int<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an integer")
        }

        fn visit_i64<E: de::Error>(self, value: i64) -> Result<Int<T>, E> {
            Self::fit(value.into())
        }

        fn visit_u64<E: de::Error>(self, value: u64) -> Result<Int<T>, E> {
            Self::fit(value.into())
        }

        fn visit_i128<E: de::Error>(self, value: i128) -> Result<Int<T>, E> {
            Self::fit(value)
        }

        fn visit_u128<E: de::Error>(self, value: u128) -> Result<Int<T>, E> {
            match i128::try_from(value) {
                Ok(value) => Self::fit(value),
                Err(_) => Self::fit(i128::MAX),
            }
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Int<T>, E> {
            match text.parse::<i128>() {
                Ok(value) => Self::fit(value),
                Err(_) => Err(E::invalid_type(Unexpected::Str(text), &self)),
            }
        }
    }

    impl<'de, T: Whole> Deserialize<'de> for Int<T> {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer.deserialize_any(IntVisitor(PhantomData))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<T, D::Error> {
        Int::deserialize(deserializer).map(|Int(value)| value)
    }

    pub fn option<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<Option<T>, D::Error> {
        Option::<Int<T>>::deserialize(deserializer).map(|value| value.map(|Int(value)| value))
    }

    pub fn map<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<BTreeMap<String, T>, D::Error> {
        let map = BTreeMap::<String, Int<T>>::deserialize(deserializer)?;
        Ok(map.into_iter().map(|(key, Int(value))| (key, value)).collect())
    }
}

/// Picks an upstream by Host and/or path prefix; neither means catch-all.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    pub upstream: String,
    /// The priority class (0-9, higher served first) of requests on this route, unless the upstream's
    /// `priority_header` gives another.
    #[serde(default, skip_serializing_if = "is_zero", deserialize_with = "integer::deserialize")]
    pub priority: u8,
}

fn is_zero(value: &u8) -> bool {
    *value == 0
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

    fn default_port(self) -> u16 {
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

/// Values given on the command line; each one overrides the file and the environment. The flags are global: they
/// may come before or after a subcommand (`floodgate check --max-connections 4` and `floodgate --max-connections 4
/// check` alike), and `floodgate demo` applies them to its own floodgate.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct Overrides {
    #[command(flatten)]
    #[serde(flatten)]
    pub global: GlobalOverrides,
    /// Limits given as flags apply to every upstream.
    #[command(flatten)]
    #[serde(flatten)]
    pub upstream: UpstreamOverrides,
}

/// The flags for top-level keys; each field is named as its key.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct GlobalOverrides {
    /// Client listener address.
    #[arg(long, global = true)]
    pub listen: Option<SocketAddr>,
    /// Admin listener address (/metrics, /status, /healthz, /readyz).
    #[arg(long, global = true)]
    pub admin: Option<SocketAddr>,
    /// Client keep-alive connections idle between requests close after this.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub client_idle_timeout: Option<Duration>,
    /// Longest from the first byte of a request head to its end.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub header_read_timeout: Option<Duration>,
    /// A new client connection that sends nothing for this long is closed.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub first_byte_timeout: Option<Duration>,
    /// Longest to let in-flight and queued requests finish on SIGTERM/SIGINT.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Option<Duration>,
    /// Runtime worker threads, 1 to 1024 (default: one per CPU).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// Log lines as readable text or as one JSON object each.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
}

/// The flags for every upstream's keys; each field is named as its key (`upstream` sets `url`).
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct UpstreamOverrides {
    /// The one upstream everything goes to: http://host:port, https://host:port or host:port.
    #[arg(long, global = true)]
    #[serde(rename = "url")]
    pub upstream: Option<String>,
    /// Most TCP connections to each upstream.
    #[arg(long, global = true)]
    pub max_connections: Option<usize>,
    /// Most requests waiting per upstream; 0 sheds at once when all connections are busy.
    #[arg(long, global = true)]
    pub max_queue: Option<usize>,
    /// Longest a request waits in the queue (e.g. 250ms, 5s).
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub queue_timeout: Option<Duration>,
    /// Longest to wait for an upstream connection to open.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub connect_timeout: Option<Duration>,
    /// Longest from dispatch to the upstream's response head.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub request_timeout: Option<Duration>,
    /// Idle upstream connections close after this.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// A body (either way) that makes no progress for this long aborts the exchange.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub body_idle_timeout: Option<Duration>,
    /// Request bodies up to this many bytes are read before admission (0: off).
    #[arg(long, global = true)]
    pub buffer_request_bytes: Option<u64>,
    /// Responses up to this many bytes (by Content-Length) are read at upstream speed, freeing the slot (0: off).
    #[arg(long, global = true)]
    pub buffer_response_bytes: Option<u64>,
}

impl Overrides {
    /// Whether a flag set `key`, making a problem with its value the flag's rather than the environment's: read
    /// from the flags' own names, so no list of them is kept here.
    fn sets(&self, key: &str) -> bool {
        let given = |group: serde_json::Result<serde_json::Value>, name: &str| {
            group
                .ok()
                .and_then(|group| group.get(name).map(|value| !value.is_null()))
                .unwrap_or(false)
        };
        match key.strip_prefix("upstreams.").and_then(|rest| rest.split_once('.')) {
            Some((_, field)) => given(serde_json::to_value(&self.upstream), field),
            None => given(serde_json::to_value(&self.global), key),
        }
    }
}

/// The name the quick `--upstream` case gives its one upstream.
pub const DEFAULT_UPSTREAM: &str = "default";

impl Config {
    /// The quick case: everything goes to one upstream with the given cap. Reads no file and no environment.
    pub fn single_upstream(upstream: &str, max_connections: usize) -> Result<Config, ConfigErrors> {
        let overrides = Overrides {
            upstream: UpstreamOverrides {
                upstream: Some(upstream.to_string()),
                max_connections: Some(max_connections),
                ..UpstreamOverrides::default()
            },
            ..Overrides::default()
        };
        Config::load(None, &Env::none(), &overrides)
    }

    /// Built-in defaults < the file (if any) < `env` < the flags, then validation.
    pub fn load(file: Option<&Path>, env: &Env, overrides: &Overrides) -> Result<Config, ConfigErrors> {
        let file = file.map(|path| {
            let source = config::File::from(path).format(config::FileFormat::Toml).required(true);
            (source, path.display().to_string())
        });
        Config::from_layers(file, env, overrides)
    }

    /// [`Config::load`] from the text of a file rather than its path, without environment; `origin` names the
    /// text in errors.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn load_toml(text: &str, origin: &str, overrides: &Overrides) -> Result<Config, ConfigErrors> {
        let source = config::File::from_str(text, config::FileFormat::Toml);
        Config::from_layers(Some((source, origin.to_string())), &Env::none(), overrides)
    }

    /// The configuration as the TOML file that would state it, every [`Secret`] shown as [`REDACTED`]: what
    /// `floodgate check` prints. Loading it again gives the same configuration (secrets aside).
    pub fn to_redacted_toml(&self) -> Result<String, toml::ser::Error> {
        toml::to_string(self)
    }

    /// A client that stops reading gets as long as the most patient upstream's `body_idle_timeout`: the listener
    /// cannot know which upstream a connection's next answer comes from.
    pub fn client_write_stall_limit(&self) -> Duration {
        self.upstreams
            .values()
            .map(|u| u.body_idle_timeout)
            .max()
            .unwrap_or_else(|| UpstreamConfig::default().body_idle_timeout)
    }

    fn from_layers<S>(file: Option<(S, String)>, env: &Env, overrides: &Overrides) -> Result<Config, ConfigErrors>
    where
        S: config::Source + Send + Sync + 'static,
    {
        let mut problems = Vec::new();
        let env_layer = EnvLayer::read(env, &mut problems);
        // The defaults are `Config::default()`, which serde fills in for every key no layer sets.
        let mut builder = config::Config::builder();
        let mut origin = "configuration".to_string();
        if let Some((source, name)) = file {
            builder = builder.add_source(source);
            origin = name;
        }
        let raw = match builder.add_source(env_layer.clone()).build() {
            Ok(raw) => raw,
            // An unreadable or unparsable file: nothing below can be checked.
            Err(err) => {
                problems.push(ConfigError::new(origin, one_line(&err.to_string())));
                return Err(ConfigErrors(problems));
            }
        };
        let (mut config, refused) = match raw.clone().try_deserialize::<Config>() {
            Ok(config) => (config, Vec::new()),
            Err(err) => {
                let table = config::Source::collect(&raw).unwrap_or_default();
                let mut found = value_problems(&table);
                if found.is_empty() {
                    found.push(config_problem(err, ""));
                }
                for problem in &mut found {
                    env_layer.annotate(problem);
                }
                // The rest is still validated, without the refused values, so that one edit fixes everything.
                match without_refused(table, &found).try_deserialize::<Config>() {
                    Ok(config) => (config, found),
                    Err(_) => {
                        problems.extend(found);
                        return Err(ConfigErrors(problems));
                    }
                }
            }
        };
        config.apply(overrides);
        let checked = config.validate();
        problems.extend(refused.iter().cloned());
        for mut problem in checked {
            if refused.iter().any(|value| hides(&value.key, &problem.key)) {
                continue;
            }
            if !overrides.sets(&problem.key) {
                env_layer.annotate(&mut problem);
            }
            problems.push(problem);
        }
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(problems))
        }
    }

    fn apply(&mut self, overrides: &Overrides) {
        let o = &overrides.global;
        if let Some(listen) = o.listen {
            self.listen = listen;
        }
        if let Some(admin) = o.admin {
            self.admin = admin;
        }
        if o.threads.is_some() {
            self.threads = o.threads;
        }
        if let Some(format) = o.log_format {
            self.log_format = format;
        }
        let globals = [
            (o.client_idle_timeout, &mut self.client_idle_timeout),
            (o.header_read_timeout, &mut self.header_read_timeout),
            (o.first_byte_timeout, &mut self.first_byte_timeout),
            (o.shutdown_timeout, &mut self.shutdown_timeout),
        ];
        for (value, slot) in globals {
            if let Some(value) = value {
                *slot = value;
            }
        }
        let o = &overrides.upstream;
        if let Some(url) = &o.upstream {
            // The flag names the one upstream everything goes to, as in the quick case.
            let upstream = self.upstreams.entry(DEFAULT_UPSTREAM.to_string()).or_default();
            upstream.url = url.clone();
            upstream.endpoints.clear();
            self.routes.retain(|route| route.upstream == DEFAULT_UPSTREAM);
            if self.routes.is_empty() {
                self.routes.push(RouteConfig {
                    host: None,
                    path_prefix: None,
                    upstream: DEFAULT_UPSTREAM.to_string(),
                    priority: 0,
                });
            }
            self.upstreams.retain(|name, _| name == DEFAULT_UPSTREAM);
        }
        // Limits given as flags apply to every upstream.
        for upstream in self.upstreams.values_mut() {
            if let Some(n) = o.max_connections {
                upstream.max_connections = n;
            }
            if let Some(n) = o.max_queue {
                upstream.max_queue = n;
            }
            if let Some(n) = o.buffer_request_bytes {
                upstream.buffer_request_bytes = n;
            }
            if let Some(n) = o.buffer_response_bytes {
                upstream.buffer_response_bytes = n;
            }
            let durations = [
                (o.queue_timeout, &mut upstream.queue_timeout),
                (o.connect_timeout, &mut upstream.connect_timeout),
                (o.request_timeout, &mut upstream.request_timeout),
                (o.idle_timeout, &mut upstream.idle_timeout),
                (o.body_idle_timeout, &mut upstream.body_idle_timeout),
            ];
            for (value, slot) in durations {
                if let Some(value) = value {
                    *slot = value;
                }
            }
        }
    }

    /// Every problem with the values, in key order within each part; empty when the configuration is usable.
    fn validate(&self) -> Vec<ConfigError> {
        let mut problems = Problems::default();
        if self.upstreams.is_empty() {
            problems.push(
                "upstreams",
                "no upstream configured (give --upstream http://host:port or an [upstreams.NAME] table)",
            );
        }
        problems.count("max_client_connections", self.max_client_connections as u128, false);
        problems.count("max_header_bytes", self.max_header_bytes as u128, false);
        problems.count("max_concurrent_streams", u128::from(self.max_concurrent_streams), false);
        problems.count("max_buffered_bytes", u128::from(self.max_buffered_bytes), true);
        if let Some(threads) = self.threads {
            if !(1..=MAX_THREADS).contains(&threads) {
                problems.push("threads", format!("must be from 1 to {MAX_THREADS}"));
            }
        }
        if let Some(problem) = listeners_clash(self.listen, self.admin) {
            problems.push("admin", problem);
        }
        // Checked here rather than when logging starts, so that `floodgate check` reports it too.
        if let Err(err) = tracing_subscriber::EnvFilter::builder().parse(&self.log_level) {
            problems.push("log_level", format!("not a log filter ({err})"));
        }
        if self.access_log.trim().is_empty() {
            problems.push("access_log", "must be off, stdout, stderr or a file path");
        } else if let AccessLogTarget::File(path) = self.access_log_target() {
            if let Err(err) = try_access_log(&path) {
                problems.push("access_log", format!("cannot open {} to append: {err}", path.display()));
            }
        }
        // The files are read here so that `floodgate check` refuses what start-up would.
        if let Err(found) = crate::tls::listener_config(self) {
            problems.0.extend(found);
        }
        if let Some(token) = &self.admin_token {
            // It travels in an Authorization header and must be hard to guess.
            let token = token.expose();
            if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
                problems.push(
                    "admin_token",
                    "must be at least 16 printable characters without spaces (the value is not shown)",
                );
            }
        }
        if self.max_client_connections > tokio::sync::Semaphore::MAX_PERMITS {
            problems.push(
                "max_client_connections",
                format!("must be at most {}", tokio::sync::Semaphore::MAX_PERMITS),
            );
        }
        for (key, value, zero_allowed) in [
            ("first_byte_timeout", self.first_byte_timeout, false),
            ("header_read_timeout", self.header_read_timeout, false),
            ("client_idle_timeout", self.client_idle_timeout, false),
            ("shutdown_timeout", self.shutdown_timeout, true),
        ] {
            problems.duration(key, value, zero_allowed);
        }
        for (name, upstream) in &self.upstreams {
            if !is_addressable_name(name) {
                problems.push(
                    format!("upstreams.{name}"),
                    "upstream names use a-z, 0-9 and single _ between them (so that \
                     FLOODGATE__UPSTREAMS__<NAME>__<KEY> can reach every one)",
                );
            }
            let key = |field: &str| format!("upstreams.{name}.{field}");
            match upstream.endpoint_problems(name) {
                Ok(endpoints) => {
                    if let Some((origin, _)) = endpoints.first() {
                        if let Err(found) = crate::tls::upstream_client(name, upstream, origin) {
                            problems.0.extend(found);
                        }
                    }
                }
                Err(found) => problems.0.extend(found),
            }
            if !upstream.health_check_path.is_empty()
                && (!upstream.health_check_path.starts_with('/')
                    || upstream.health_check_path.parse::<http::uri::PathAndQuery>().is_err())
            {
                problems.push(
                    key("health_check_path"),
                    "must be a path starting with / (or \"\" for none)",
                );
            }
            problems.count(&key("max_connections"), upstream.max_connections as u128, false);
            problems.count(&key("max_queue"), upstream.max_queue as u128, true);
            problems.count(
                &key("max_requests_per_connection"),
                u128::from(upstream.max_requests_per_connection),
                true,
            );
            problems.count(&key("abort_drain_bytes"), u128::from(upstream.abort_drain_bytes), true);
            problems.count(
                &key("buffer_request_bytes"),
                u128::from(upstream.buffer_request_bytes),
                true,
            );
            problems.count(
                &key("buffer_response_bytes"),
                u128::from(upstream.buffer_response_bytes),
                true,
            );
            for (field, value, zero_allowed) in upstream.durations() {
                problems.duration(&key(field), value, zero_allowed);
            }
            for (field, status) in [
                ("shed_status", upstream.shed_status),
                ("quota_status", upstream.quota_status),
            ] {
                if !(400..=599).contains(&status) {
                    problems.push(key(field), "must be a 4xx or 5xx status");
                }
            }
            problems.count(&key("min_connections"), upstream.min_connections as u128, false);
            if upstream.max_connections > 0 && upstream.min_connections > upstream.max_connections {
                problems.push(key("min_connections"), "must be at most max_connections");
            }
            if !(1.0..=10.0).contains(&upstream.adaptive_tolerance) {
                problems.push(key("adaptive_tolerance"), "must be from 1.0 to 10.0");
            }
            if !(upstream.adaptive_smoothing > 0.0 && upstream.adaptive_smoothing <= 1.0) {
                problems.push(key("adaptive_smoothing"), "must be above 0 and at most 1");
            }
            for (client, weight) in &upstream.fair_weights {
                if *weight == 0 || *weight > 1000 {
                    problems.push(key(&format!("fair_weights.{client}")), "must be from 1 to 1000");
                }
            }
            if !upstream.priority_header.is_empty()
                && http::HeaderName::from_bytes(upstream.priority_header.as_bytes()).is_err()
            {
                problems.push(key("priority_header"), "not a header name (or \"\" for none)");
            }
            if !upstream.deadline_header.is_empty()
                && http::HeaderName::from_bytes(upstream.deadline_header.as_bytes()).is_err()
            {
                problems.push(key("deadline_header"), "not a header name (or \"\" for none)");
            }
        }
        for (index, route) in self.routes.iter().enumerate() {
            if route.priority > MAX_PRIORITY {
                problems.push(
                    format!("routes[{index}].priority"),
                    format!("must be from 0 to {MAX_PRIORITY}"),
                );
            }
            if !self.upstreams.contains_key(&route.upstream) {
                problems.push(
                    format!("routes[{index}].upstream"),
                    format!("unknown upstream `{}`", route.upstream),
                );
            }
            if let Some(prefix) = &route.path_prefix {
                if !prefix.starts_with('/') {
                    problems.push(format!("routes[{index}].path_prefix"), "must start with /");
                }
            }
        }
        // Without an upstream there is nothing a route could name; that problem is already reported.
        if self.routes.is_empty() && !self.upstreams.is_empty() {
            problems.push(
                "routes",
                "no route configured (add a [[routes]] entry with upstream = \"NAME\")",
            );
        }
        problems.0
    }
}

/// The most runtime worker threads. More than the CPUs only adds switching between them, and the largest machines
/// have a few hundred; the bound keeps a typo (`100000`) from asking the OS for that many threads and stacks.
pub const MAX_THREADS: usize = 1024;

/// Why the admin listener cannot bind beside the client one, if it cannot: the same port on the same address, or
/// on any address when either is a wildcard (`0.0.0.0`, `[::]`, which takes the port on every address).
fn listeners_clash(listen: SocketAddr, admin: SocketAddr) -> Option<String> {
    let overlap = listen.ip() == admin.ip() || listen.ip().is_unspecified() || admin.ip().is_unspecified();
    (listen.port() != 0 && listen.port() == admin.port() && overlap)
        .then(|| format!("{admin} is also where listen ({listen}) binds; give the admin listener another port"))
}

/// Opens the access log as start-up will (to append, creating it), so that `floodgate check` refuses a path start-up
/// could not open; a file that did not exist is removed again, for `check` to leave nothing behind.
fn try_access_log(path: &Path) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.append(true);
    match options.clone().create_new(true).open(path) {
        Ok(_) => std::fs::remove_file(path),
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => options.open(path).map(drop),
        Err(err) => Err(err),
    }
}

/// Upstream names end up in variable names: `FLOODGATE__UPSTREAMS__<NAME>__URL` is lowercased and split at every
/// `__`, so a name with an upper-case letter, a `__` or an `_` at either end could not be reached from there.
pub fn is_addressable_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.starts_with('_')
        && !name.ends_with('_')
        && !name.contains("__")
}

/// Deadlines are computed as `now + duration`; a year bounds them far from overflow and from any sane setting.
const LONGEST_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The largest integer TOML can state, so that `floodgate check` can always print what it accepted.
const LARGEST_COUNT: u128 = i64::MAX as u128;

/// `LARGEST_COUNT` for a count set at runtime (the admin API's cap), which `check` must be able to print too.
pub const LARGEST_RUNTIME_COUNT: usize = i64::MAX as usize;

#[derive(Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError::new(key, message));
    }

    fn count(&mut self, key: &str, value: u128, zero_allowed: bool) {
        if value == 0 && !zero_allowed {
            self.push(key, "must be greater than zero");
        } else if value > LARGEST_COUNT {
            self.push(key, format!("must be at most {LARGEST_COUNT}"));
        }
    }

    fn duration(&mut self, key: &str, value: Duration, zero_allowed: bool) {
        if value.is_zero() && !zero_allowed {
            self.push(key, "must be greater than zero");
        } else if value > LONGEST_DURATION {
            self.push(key, "must be at most a year (365d)");
        }
    }
}

/// serde stops at the first bad value. Deserializing one key at a time, and the entries of a refused list or table
/// one at a time, finds every one, so that a single `floodgate check` lists them all rather than one per edit.
/// Sorted by key: the table's order is a hash's.
fn value_problems(table: &config::Map<String, config::Value>) -> Vec<ConfigError> {
    let mut problems = Vec::new();
    for (key, value) in table {
        match key.as_str() {
            "upstreams" => match value.clone().into_table() {
                Ok(upstreams) => {
                    for (name, upstream) in upstreams {
                        let within = format!("upstreams.{name}");
                        match upstream.into_table() {
                            Ok(fields) => {
                                for (field, value) in fields {
                                    let path = format!("{within}.{field}");
                                    let check =
                                        |value| one_key_problem::<UpstreamConfig>(&within, field.clone(), value);
                                    problems.extend(split_problems(&path, value, &check));
                                }
                            }
                            Err(err) => problems.push(config_problem(err, &within)),
                        }
                    }
                }
                Err(err) => problems.push(config_problem(err, "upstreams")),
            },
            "routes" => problems.extend(entry_problems::<RouteConfig>("routes", value)),
            "tls_certificates" => problems.extend(entry_problems::<TlsCertificateConfig>("tls_certificates", value)),
            _ => {
                let check = |value| one_key_problem::<Config>("", key.clone(), value);
                problems.extend(split_problems(key, value.clone(), &check));
            }
        }
    }
    problems.sort_by(|a, b| a.key.cmp(&b.key));
    problems
}

/// The problems of each entry of the list of tables `list`, named `list[index]`.
fn entry_problems<T: DeserializeOwned>(list: &str, value: &config::Value) -> Vec<ConfigError> {
    match value.clone().into_array() {
        Ok(entries) => {
            let mut problems = Vec::new();
            for (index, entry) in entries.into_iter().enumerate() {
                let at = format!("{list}[{index}]");
                let check =
                    |entry: config::Value| entry.try_deserialize::<T>().err().map(|err| config_problem(err, &at));
                problems.extend(split_problems(&at, entry, &check));
            }
            problems
        }
        Err(err) => vec![config_problem(err, list)],
    }
}

/// The configuration's `table` without the values `refused` names: each top-level key or upstream field, and a
/// whole `routes` or `tls_certificates` list for a refused entry (taking one out would renumber the others).
fn without_refused(mut table: config::Map<String, config::Value>, refused: &[ConfigError]) -> config::Value {
    for problem in refused {
        let mut parts = problem.key.split(['.', '[']);
        let top = parts.next().unwrap_or_default();
        let (name, field) = (parts.next(), parts.next());
        match (top, name) {
            ("upstreams", Some(name)) => {
                if let Some(config::ValueKind::Table(upstreams)) = table.get_mut(top).map(|value| &mut value.kind) {
                    match (field, upstreams.get_mut(name).map(|value| &mut value.kind)) {
                        (Some(field), Some(config::ValueKind::Table(fields))) => {
                            fields.remove(field);
                        }
                        _ => {
                            upstreams.remove(name);
                        }
                    }
                }
            }
            _ => {
                table.remove(top);
            }
        }
    }
    config::Value::from(table)
}

/// Whether a problem validation found at `key` may be the work of a default standing in for the value refused at
/// `refused`: the keys are of one family (see [`family`]), or a whole upstream (or all) went, which routes name.
fn hides(refused: &str, key: &str) -> bool {
    let (refused, key) = (family(refused), family(key));
    match refused.as_str() {
        _ if refused == key => true,
        "upstreams" => key == "routes" || key.starts_with("upstreams"),
        upstream if upstream.starts_with("upstreams.") && !upstream.contains('/') => {
            key == "routes" || key.starts_with(&format!("{upstream}/"))
        }
        _ => false,
    }
}

/// Keys that validation checks together: an upstream's url, endpoints and TLS keys; its max and min connections;
/// the listener's TLS keys; listen and admin; all of routes. Any other key is a family of its own.
fn family(key: &str) -> String {
    let head = |key: &str| key.split(['.', '[']).next().unwrap_or_default().to_string();
    if let Some(rest) = key.strip_prefix("upstreams.") {
        let Some((name, field)) = rest.split_once('.') else {
            return format!("upstreams.{}", head(rest));
        };
        let field = match head(field).as_str() {
            "url" | "endpoints" | "tls_ca" | "tls_client_cert" | "tls_client_key" | "tls_server_name" => {
                "origin".into()
            }
            "max_connections" | "min_connections" => "connections".into(),
            other => other.to_string(),
        };
        return format!("upstreams.{name}/{field}");
    }
    match head(key).as_str() {
        "tls_cert" | "tls_key" | "tls_certificates" => "tls".into(),
        "listen" | "admin" => "listeners".into(),
        other => other.to_string(),
    }
}

/// Tells what is wrong with a value in its place in the configuration, if anything.
type Check<'a> = dyn Fn(config::Value) -> Option<ConfigError> + 'a;

/// The problems of `value`, whose key is `path`: the one `check` finds or, in a list or a table, one for each entry
/// that is refused, named by its own key (`trusted_proxies[2]`, `upstreams.api.fair_weights.gold`).
fn split_problems(path: &str, value: config::Value, check: &Check<'_>) -> Vec<ConfigError> {
    let Some(problem) = check(value.clone()) else {
        return Vec::new();
    };
    let origin = value.origin().map(str::to_string);
    let found = match value.kind {
        config::ValueKind::Array(items) => {
            // Each item alone in a list of one, where its problems are named `path[0]`.
            let first = format!("{path}[0]");
            let mut found = Vec::new();
            for (index, item) in items.into_iter().enumerate() {
                let alone = |item| check(config::Value::new(origin.as_ref(), vec![item]));
                found.extend(split_problems(&first, item, &alone).into_iter().map(|mut problem| {
                    if let Some(rest) = problem.key.strip_prefix(&first) {
                        problem.key = format!("{path}[{index}]{rest}");
                    }
                    problem
                }));
            }
            found
        }
        config::ValueKind::Table(entries) => table_problems(path, entries, origin.as_ref(), problem.clone(), check),
        _ => Vec::new(),
    };
    if found.is_empty() {
        vec![problem]
    } else {
        found
    }
}

/// The refused entries of a table, found by taking out the one each refusal names until the rest passes: not each
/// entry alone, as a struct's other fields may be required. `first` is the table's own refusal.
fn table_problems(
    path: &str,
    entries: config::Map<String, config::Value>,
    origin: Option<&String>,
    first: ConfigError,
    check: &Check<'_>,
) -> Vec<ConfigError> {
    let mut rest = entries;
    let mut refused = Vec::new();
    let mut problem = Some(first);
    while let Some(current) = problem.take() {
        let named = current
            .key
            .strip_prefix(path)
            .and_then(|key| key.strip_prefix('.'))
            .and_then(|key| key.split(['.', '[']).next())
            .and_then(|name| rest.remove_entry(name));
        // A refusal no entry left explains: a required field, taken out here.
        let Some((name, value)) = named else { break };
        refused.push((name, value, current));
        problem = check(config::Value::new(origin, rest.clone()));
    }
    let mut found = Vec::new();
    for (name, value, problem) in refused {
        if matches!(value.kind, config::ValueKind::Array(_) | config::ValueKind::Table(_)) {
            // Among the entries that passed, so that only its own problems show.
            let within = |value| {
                let mut entries = rest.clone();
                entries.insert(name.clone(), value);
                check(config::Value::new(origin, entries))
            };
            found.extend(split_problems(&format!("{path}.{name}"), value, &within));
        } else {
            found.push(problem);
        }
    }
    found
}

/// The problem with `key = value` alone in a `T` (whose other keys take their defaults), named `within.key`.
fn one_key_problem<T: DeserializeOwned>(within: &str, key: String, value: config::Value) -> Option<ConfigError> {
    let table: config::Map<String, config::Value> = [(key, value)].into_iter().collect();
    config::Value::from(table)
        .try_deserialize::<T>()
        .err()
        .map(|err| config_problem(err, within))
}

/// The `config` crate reports a key path for most errors but names an unknown field only in its message; either
/// way the result is one line whose key is the offending one, below `within` (a table's path, or empty).
fn config_problem(err: config::ConfigError, within: &str) -> ConfigError {
    let text = err.to_string();
    let (key, origin) = match &err {
        config::ConfigError::Type { key, origin, .. } | config::ConfigError::At { key, origin, .. } => {
            (key.clone().unwrap_or_default(), origin.clone())
        }
        _ => (String::new(), None),
    };
    // The key and origin go first-class into the problem's key and the variable's note; the text keeps the rest.
    let text = origin
        .and_then(|origin| text.strip_suffix(&format!(" in {origin}")).map(str::to_string))
        .unwrap_or(text);
    let text = text.split(" for key `").next().unwrap_or(&text).to_string();
    let key = match text
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
    {
        Some((field, _)) if key.is_empty() => field.to_string(),
        Some((field, _)) => format!("{key}.{field}"),
        None => key,
    };
    let key = match (within.is_empty(), key.is_empty()) {
        (true, true) => "config".to_string(),
        (true, false) => key,
        (false, true) => within.to_string(),
        (false, false) if key.starts_with('[') => format!("{within}{key}"),
        (false, false) => format!("{within}.{key}"),
    };
    ConfigError::new(key, one_line(&text))
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_accepts_urls_bare_authorities_and_ipv6_literals() {
        let o = Origin::parse("http://127.0.0.1:9000").unwrap();
        assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Http, "127.0.0.1", 9000));
        let o = Origin::parse("localhost:81").unwrap();
        assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Http, "localhost", 81));
        let o = Origin::parse("https://example.com").unwrap();
        assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Https, "example.com", 443));
        assert_eq!(o.url(), "https://example.com:443");
        assert_eq!(Origin::parse(&o.url()).unwrap(), o);
        assert_eq!(Origin::parse("https://[::1]:8443").unwrap().port, 8443);
        let o = Origin::parse("http://[::1]:9000/").unwrap();
        assert_eq!((o.host.as_str(), o.port), ("::1", 9000));
        assert_eq!(o.authority(), "[::1]:9000");
        assert_eq!(Origin::parse("http://example.com").unwrap().port, 80);
        assert!(Origin::parse("ftp://example.com").is_err());
        assert!(Origin::parse("http://example.com/path").is_err());
        assert!(Origin::parse("example.com:notaport").is_err());
        assert!(Origin::parse("http://a[1::]:9000").is_err());
    }

    #[test]
    fn quick_case_has_one_upstream_and_a_catch_all() {
        let config = Config::single_upstream("127.0.0.1:9000", 4).unwrap();
        assert_eq!(config.upstreams[DEFAULT_UPSTREAM].max_connections, 4);
        assert_eq!(config.routes.len(), 1);
        assert!(config.routes[0].host.is_none() && config.routes[0].path_prefix.is_none());
    }

    /// The built-in defaults with one upstream `app` at `url` and a catch-all route to it.
    fn defaults_with_app(url: &str) -> Config {
        let mut config = Config::default();
        let app = UpstreamConfig {
            url: url.to_string(),
            ..UpstreamConfig::default()
        };
        config.upstreams.insert("app".to_string(), app);
        config.routes.push(RouteConfig {
            host: None,
            path_prefix: None,
            upstream: "app".to_string(),
            priority: 0,
        });
        config
    }

    #[test]
    fn the_reference_file_is_valid_and_states_every_key_with_its_default() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/floodgate.toml");
        let config = Config::load(Some(&path), &Env::none(), &Overrides::default()).unwrap();
        let mut expected = defaults_with_app("http://127.0.0.1:9000");
        assert_eq!(config.to_redacted_toml().unwrap(), expected.to_redacted_toml().unwrap());
        // Every key appears, set or commented out; `threads` (no default) shows up only once it has a value.
        expected.threads = Some(2);
        expected.tls_cert = Some("cert.pem".into());
        expected.tls_key = Some("key.pem".into());
        expected.tls_certificates.push(TlsCertificateConfig {
            names: vec!["api.example.com".to_string()],
            cert: "api.pem".into(),
            key: "api-key.pem".into(),
        });
        if let Some(app) = expected.upstreams.get_mut("app") {
            app.tls_ca = Some("ca.pem".into());
            app.tls_client_cert = Some("client.pem".into());
            app.tls_client_key = Some("client-key.pem".into());
            app.tls_server_name = Some("app.internal".to_string());
            app.endpoints.push(EndpointConfig {
                url: "http://127.0.0.1:9001".into(),
                max_connections: 1,
            });
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mentioned = |key: &str| {
            text.lines()
                .any(|line| line.trim_start_matches("# ").starts_with(&format!("{key} = ")))
        };
        let table: toml::Table = toml::from_str(&expected.to_redacted_toml().unwrap()).unwrap();
        let lists = ["upstreams", "routes", "tls_certificates"];
        let mut keys: Vec<String> = table.keys().filter(|k| !lists.contains(&k.as_str())).cloned().collect();
        keys.extend(table["upstreams"]["app"].as_table().unwrap().keys().cloned());
        keys.extend(table["tls_certificates"][0].as_table().unwrap().keys().cloned());
        keys.extend(["host", "path_prefix", "upstream"].map(String::from));
        let missing: Vec<&String> = keys.iter().filter(|key| !mentioned(key)).collect();
        assert!(missing.is_empty(), "config/floodgate.toml does not state {missing:?}");
        assert!(text.lines().any(|line| line == "# [[tls_certificates]]"));
    }

    #[test]
    fn zero_connections_is_rejected_with_its_key() {
        let err = Config::single_upstream("127.0.0.1:9000", 0).unwrap_err();
        assert_eq!(err.problems()[0].key, "upstreams.default.max_connections");
    }

    fn vars(pairs: &[(&str, &str)]) -> Env {
        Env::Vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    const FILE: &str = r#"
listen = "127.0.0.1:1000"
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = 4
[[routes]]
upstream = "api"
"#;

    fn load(env: &Env, overrides: &Overrides) -> Result<Config, ConfigErrors> {
        let source = config::File::from_str(FILE, config::FileFormat::Toml);
        Config::from_layers(Some((source, "test".to_string())), env, overrides)
    }

    fn problem_lines(err: &ConfigErrors) -> Vec<String> {
        err.problems().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn the_environment_overrides_the_file_and_flags_override_the_environment() {
        let env = vars(&[
            ("FLOODGATE__LISTEN", "0.0.0.0:2000"),
            ("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "16"),
            ("FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT", "1m 30s"),
            ("floodgate__upstreams__api__max_queue", "7"),
        ]);
        let config = load(&env, &Overrides::default()).unwrap();
        assert_eq!(config.listen, "0.0.0.0:2000".parse().unwrap());
        let api = &config.upstreams["api"];
        assert_eq!(api.max_connections, 16);
        assert_eq!(
            api.queue_timeout,
            Duration::from_secs(90),
            "durations parse as in the file"
        );
        assert_eq!(api.max_queue, 7, "names are case-insensitive");
        assert_eq!(api.url, "http://127.0.0.1:9000", "the file's other keys stay");

        let mut flags = Overrides::default();
        flags.global.listen = Some("127.0.0.1:3000".parse().unwrap());
        flags.upstream.max_connections = Some(2);
        let config = load(&env, &flags).unwrap();
        assert_eq!(config.listen, "127.0.0.1:3000".parse().unwrap());
        assert_eq!(config.upstreams["api"].max_connections, 2);
    }

    #[test]
    fn the_environment_alone_can_define_an_upstream_and_trusted_proxies() {
        let env = vars(&[
            ("FLOODGATE__UPSTREAMS__WEB_2__URL", "127.0.0.1:9100"),
            ("FLOODGATE__TRUSTED_PROXIES", "10.0.0.0/8, 192.168.1.1/32"),
        ]);
        let config = load(&env, &Overrides::default()).unwrap();
        assert_eq!(config.upstreams["web_2"].url, "127.0.0.1:9100");
        assert_eq!(config.upstreams["web_2"].max_connections, 8, "the rest are defaults");
        let proxies: Vec<String> = config.trusted_proxies.iter().map(ToString::to_string).collect();
        assert_eq!(proxies, ["10.0.0.0/8", "192.168.1.1/32"]);
        let empty = load(&vars(&[("FLOODGATE__TRUSTED_PROXIES", "")]), &Overrides::default()).unwrap();
        assert!(empty.trusted_proxies.is_empty());
    }

    #[test]
    fn kubernetes_service_variables_change_nothing() {
        let kubernetes = vars(&[
            ("FLOODGATE_PORT", "tcp://10.96.0.12:8080"),
            ("FLOODGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
            ("FLOODGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
            ("FLOODGATE_PORT_8080_TCP_PORT", "8080"),
            ("FLOODGATE_PORT_8080_TCP_PROTO", "tcp"),
            ("FLOODGATE_SERVICE_HOST", "10.96.0.12"),
            ("FLOODGATE_SERVICE_PORT", "8080"),
            ("FLOODGATE_SERVICE_PORT_HTTP", "8080"),
            ("FLOODGATE_ADMIN_SERVICE_HOST", "10.96.0.13"),
        ]);
        let with = load(&kubernetes, &Overrides::default()).unwrap();
        let without = load(&Env::none(), &Overrides::default()).unwrap();
        assert_eq!(with.to_redacted_toml().unwrap(), without.to_redacted_toml().unwrap());
        assert!(kubernetes.variables().is_empty());
    }

    #[test]
    fn a_bad_environment_value_names_its_key_and_variable() {
        let env = vars(&[("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "lots")]);
        let err = load(&env, &Overrides::default()).unwrap_err();
        let lines = problem_lines(&err);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("upstreams.api.max_connections: "), "{lines:?}");
        assert!(
            lines[0].contains("(from FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS)"),
            "{lines:?}"
        );
    }

    #[test]
    fn an_invalid_environment_value_names_its_variable_unless_a_flag_replaced_it() {
        let env = vars(&[("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "0")]);
        let err = load(&env, &Overrides::default()).unwrap_err();
        assert_eq!(
            problem_lines(&err),
            ["upstreams.api.max_connections: must be greater than zero \
              (from FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS)"]
        );
        let mut flag = Overrides::default();
        flag.upstream.max_connections = Some(0);
        let err = load(&env, &flag).unwrap_err();
        assert_eq!(
            problem_lines(&err),
            ["upstreams.api.max_connections: must be greater than zero"]
        );
    }

    #[test]
    fn routes_cannot_come_from_the_environment() {
        let env = vars(&[("FLOODGATE__ROUTES__0__UPSTREAM", "api")]);
        let err = load(&env, &Overrides::default()).unwrap_err();
        let lines = problem_lines(&err);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("routes: cannot be set from the environment (FLOODGATE__ROUTES__0__UPSTREAM)"));
    }

    #[test]
    fn listener_certificates_cannot_come_from_the_environment() {
        let env = vars(&[("FLOODGATE__TLS_CERTIFICATES__0__CERT", "/etc/a.pem")]);
        let err = load(&env, &Overrides::default()).unwrap_err();
        assert_eq!(
            problem_lines(&err),
            [
                "tls_certificates: cannot be set from the environment (FLOODGATE__TLS_CERTIFICATES__0__CERT); \
              give [[tls_certificates]] in the file"
            ]
        );
    }

    #[test]
    fn tls_keys_on_a_plain_http_upstream_are_refused_rather_than_ignored() {
        let env = vars(&[
            ("FLOODGATE__UPSTREAMS__API__TLS_CA", "/etc/ca.pem"),
            ("FLOODGATE__UPSTREAMS__API__TLS_SERVER_NAME", "api.internal"),
        ]);
        let err = load(&env, &Overrides::default()).unwrap_err();
        let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["upstreams.api.tls_ca", "upstreams.api.tls_server_name"]);
        assert!(problem_lines(&err)[0].contains("only for https://"), "{err}");
    }

    #[test]
    fn every_bad_value_is_reported_not_only_the_first() {
        let text = r#"
listen = "nowhere"
bogus = 1
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = "many"
queue_timeout = "5 parsecs"
[upstreams.web]
url = "http://127.0.0.1:9001"
idle_timeout = 30
"#;
        let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
        let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "bogus",
                "listen",
                "upstreams.api.max_connections",
                "upstreams.api.queue_timeout",
                "upstreams.web.idle_timeout",
                // Found by validating the rest: the file has no [[routes]].
                "routes"
            ]
        );
        assert!(err.problems().iter().all(|p| !p.to_string().contains('\n')));
    }

    #[test]
    fn a_refused_value_hides_only_what_its_default_could_cause() {
        let text = r#"
first_byte_timeout = "0s"
listen = 5
admin = "127.0.0.1:8080"
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = 2.5
min_connections = 6
connect_timeout = "0s"
[upstreams.web]
endpoints = 3
tls_server_name = "web.internal"
max_queue = 2
min_connections = 0
[[routes]]
upstream = "api"
[[routes]]
upstream = "web"
"#;
        let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
        let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
        // Not min_connections against the default 8, nor url missing nor tls_server_name on http://, nor admin on
        // the default listen's port: those are the defaults standing in for the refused values.
        assert_eq!(
            keys,
            [
                "listen",
                "upstreams.api.max_connections",
                "upstreams.web.endpoints",
                "first_byte_timeout",
                "upstreams.api.connect_timeout",
                "upstreams.web.min_connections"
            ]
        );
    }

    #[test]
    fn every_invalid_setting_is_reported_not_only_the_first() {
        let text = r#"
max_header_bytes = 0
[upstreams.Api]
url = "ftp://example.com"
max_connections = 0
[[routes]]
upstream = "nowhere"
path_prefix = "x"
"#;
        let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
        let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "max_header_bytes",
                "upstreams.Api",
                "upstreams.Api.url",
                "upstreams.Api.max_connections",
                "routes[0].upstream",
                "routes[0].path_prefix"
            ]
        );
    }

    #[test]
    fn upstream_names_must_survive_the_environment_mapping() {
        for good in ["api", "web_2", "a1_b2_c3", "0"] {
            assert!(is_addressable_name(good), "{good}");
        }
        for bad in ["", "Api", "web-2", "a__b", "_a", "a_", "é"] {
            assert!(!is_addressable_name(bad), "{bad}");
        }
    }

    #[test]
    fn the_effective_toml_loads_back_to_itself() {
        let mut config = load(&Env::none(), &Overrides::default()).unwrap();
        config.threads = Some(3);
        config.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
        config.routes.push(RouteConfig {
            host: Some("example.com".to_string()),
            path_prefix: Some("/x".to_string()),
            upstream: "api".to_string(),
            priority: 3,
        });
        let text = config.to_redacted_toml().unwrap();
        let again = Config::load_toml(&text, "effective", &Overrides::default()).unwrap();
        assert_eq!(again.to_redacted_toml().unwrap(), text);
    }

    #[test]
    fn secrets_are_redacted_when_printed_or_logged() {
        #[derive(Debug, Deserialize, Serialize)]
        struct WithSecret {
            token: Secret,
        }
        let parsed: WithSecret = toml::from_str("token = \"hunter2\"").unwrap();
        assert_eq!(parsed.token.expose(), "hunter2");
        let printed = toml::to_string(&parsed).unwrap();
        assert_eq!(printed.trim(), format!("token = \"{REDACTED}\""));
        assert!(!format!("{parsed:?}").contains("hunter2"));
    }
}
