//! Configuration: layers turned into one validated, typed [`Config`]: built-in defaults, a TOML file,
//! `FLOODGATE__` environment variables ([`Env`]), command-line flags ([`Overrides`]), each over the one before.
//!
//! Owns the defaults, the layering, humane durations, validation (one line per problem, each naming its key) and
//! the redaction of [`Secret`]s. It never reads the network; the only other files it touches are those it must
//! check for `floodgate check` to refuse what start-up would (TLS files via [`tls`], the `access_log` file).

pub mod access_log;
mod env;
mod errors;
mod integer;
mod layers;
mod log_level;
mod overrides;
mod read;
mod secret;
#[cfg(test)]
mod tests;
mod upstream;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use serde::{Deserialize, Serialize};

pub use env::{env_var, Env, ENV_PREFIX, ENV_SEPARATOR};
pub use errors::{ConfigError, ConfigErrors};
use layers::Node;
pub use log_level::log_filter;
pub use overrides::{GlobalOverrides, Overrides, UpstreamOverrides};
pub use secret::{Secret, REDACTED};
pub use upstream::{
    AdaptiveLimit, Discipline, DnsEndpoints, EndpointConfig, Endpoints, FairKey, Origin, ReplicaSource, RetryBudget,
    Scheme, SlowStart, UpstreamConfig, UpstreamProtocol, MAX_PRIORITY,
};
use validate::hides;
pub use validate::{is_addressable_name, LARGEST_RUNTIME_COUNT, MAX_THREADS};

/// The whole validated configuration. Serializes as the TOML file that states it (what `floodgate check`
/// prints).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Threads serving clients, each a runtime with an upstream lane of its own; `None`: one per CPU.
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
    /// How long, on SIGTERM/SIGINT, floodgate goes on accepting and serving with `/readyz` failing, so that load
    /// balancers move away before the listener closes; `shutdown_timeout` runs from its end.
    #[serde(with = "humantime_serde")]
    pub drain_time: Duration,
    pub trusted_proxies: Vec<IpNet>,
    /// Where each request's span is exported (an OTLP/HTTP traces URL, `http://collector:4318/v1/traces`); empty:
    /// no traces, and trace headers pass through untouched.
    pub otlp_endpoint: String,
    /// The `service.name` floodgate's spans carry.
    pub otlp_service_name: String,
    /// How often the `--config` file is looked at for changes, which are then reloaded as on SIGHUP (a Kubernetes
    /// ConfigMap's update, say); 0: never.
    #[serde(with = "humantime_serde")]
    pub config_watch_interval: Duration,
    /// Whether a connection may start with a PROXY protocol header (v1 or v2) carrying its client's address, taken
    /// from peers in `trusted_proxies` only.
    pub proxy_protocol: bool,
    pub log_format: LogFormat,
    /// A `tracing` filter (`info`, `warn,floodgate=debug`); `RUST_LOG`, when set, wins over it.
    pub log_level: String,
    /// `off`, `stdout`, `stderr` or a file path (appended to); see [`Config::access_log_target`].
    pub access_log: String,
    /// How access-log lines are written: `auto` (as `log_format`), `json`, `human` or `combined`.
    pub access_log_format: AccessLogFormat,
    /// The fields a `json` or `human` access-log line has, by name (`access::FIELDS`); empty: every one.
    pub access_log_fields: Vec<String>,
    /// Request and response header fields an access-log line captures, as `http.request.header.NAME` and
    /// `http.response.header.NAME` (not in `combined` lines).
    pub access_log_request_headers: Vec<String>,
    pub access_log_response_headers: Vec<String>,
    /// The most bytes of a captured header value written; a longer one is cut and ends with `…`.
    pub access_log_header_bytes: usize,
    /// Captured credentials (`authorization`, `proxy-authorization`, `cookie`, `set-cookie`) written as they are
    /// rather than `<redacted>`.
    pub access_log_unredacted: Vec<String>,
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

/// How access-log lines are written: as `log_format` says (`auto`), one JSON object each with OpenTelemetry's
/// semantic-convention names (`json`), those fields as readable `key=value` pairs (`human`), or the Combined Log
/// Format web log tools read (`combined`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    #[default]
    Auto,
    Json,
    Human,
    Combined,
}

impl Config {
    /// The access log's format, `auto` resolved; `None` when the access log is off.
    pub fn access_log_format(&self) -> Option<AccessLogFormat> {
        if self.access_log_target() == AccessLogTarget::Off {
            return None;
        }
        Some(match (self.access_log_format, self.log_format) {
            (AccessLogFormat::Auto, LogFormat::Json) => AccessLogFormat::Json,
            (AccessLogFormat::Auto, LogFormat::Human) => AccessLogFormat::Human,
            (format, _) => format,
        })
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

/// A step of start-up's that the configuration, which is data, cannot take itself, run on it once it is valid:
/// the problems it finds, each naming its key.
pub type StartupCheck = fn(&Config) -> Vec<ConfigError>;

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
            drain_time: Duration::ZERO,
            trusted_proxies: Vec::new(),
            proxy_protocol: false,
            config_watch_interval: Duration::ZERO,
            otlp_endpoint: String::new(),
            otlp_service_name: "floodgate".to_string(),
            log_format: LogFormat::Human,
            log_level: "info".to_string(),
            access_log: "off".to_string(),
            access_log_format: AccessLogFormat::Auto,
            access_log_fields: Vec::new(),
            access_log_request_headers: Vec::new(),
            access_log_response_headers: Vec::new(),
            access_log_header_bytes: 256,
            access_log_unredacted: Vec::new(),
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

/// Picks an upstream by Host and/or path prefix; neither means catch-all.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
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
    /// This route's `request_timeout`, instead of its upstream's.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "humantime_serde")]
    pub request_timeout: Option<Duration>,
    /// This route's `body_idle_timeout` (both bodies), instead of its upstream's: a stream of server-sent events
    /// whose events come further apart, say.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "humantime_serde")]
    pub body_idle_timeout: Option<Duration>,
    /// Forwards the path without this route's `path_prefix` (`/api/orders` as `/orders`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub strip_prefix: bool,
    /// Request header fields set (replacing any the client sent) on the way upstream.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set_request_headers: BTreeMap<String, String>,
    /// Request header fields removed on the way upstream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_request_headers: Vec<String>,
    /// Response header fields set on the upstream's answers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set_response_headers: BTreeMap<String, String>,
    /// Response header fields removed from the upstream's answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_response_headers: Vec<String>,
}

/// Header fields a route may not set or remove: they frame the message or the connection, which floodgate owns.
const FRAMING_FIELDS: [&str; 9] = [
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl RouteConfig {
    /// `set_*_headers` as fields to set; the problem, naming the field, if one is not a header name and value
    /// floodgate may set.
    pub fn fields_to_set(set: &BTreeMap<String, String>) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, String> {
        set.iter()
            .map(|(name, value)| {
                let name = Self::field_name(name)?;
                let value =
                    http::HeaderValue::from_str(value).map_err(|_| format!("{name}: not a valid header value"))?;
                Ok((name, value))
            })
            .collect()
    }

    /// `remove_*_headers` as field names; the problem, naming the field, if one is not a name floodgate may remove.
    pub fn fields_to_remove(names: &[String]) -> Result<Vec<http::HeaderName>, String> {
        names.iter().map(|name| Self::field_name(name)).collect()
    }

    fn field_name(name: &str) -> Result<http::HeaderName, String> {
        let parsed =
            http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("{name:?}: not a header name"))?;
        if FRAMING_FIELDS.contains(&parsed.as_str()) {
            return Err(format!("{parsed}: floodgate frames the message itself"));
        }
        Ok(parsed)
    }
}

fn is_zero(value: &u8) -> bool {
    *value == 0
}

fn is_false(value: &bool) -> bool {
    !*value
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
        Config::load_checked(file, env, overrides, &[])
    }

    /// [`Config::load`], with `checks` of start-up's own run on the validated configuration (building TLS, which
    /// reads the files it names: `crate::tls::check`); their problems are reported with the rest, each with where
    /// its value came from.
    pub fn load_checked(
        file: Option<&Path>,
        env: &Env,
        overrides: &Overrides,
        checks: &[StartupCheck],
    ) -> Result<Config, ConfigErrors> {
        let tree = match file {
            Some(path) => {
                let name = path.display().to_string();
                match std::fs::read_to_string(path) {
                    Ok(text) => Node::from_file(&text, &name),
                    Err(err) => Err(ConfigError::new("config", format!("cannot read {name}: {err}"))),
                }
            }
            None => Ok(Node::empty()),
        };
        Config::from_layers(tree?, env, overrides, checks)
    }

    /// [`Config::load`] from the text of a file rather than its path, without environment; `origin` names the
    /// text in errors.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn load_toml(text: &str, origin: &str, overrides: &Overrides) -> Result<Config, ConfigErrors> {
        Config::from_layers(Node::from_file(text, origin)?, &Env::none(), overrides, &[])
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

    fn from_layers(
        mut tree: Node,
        env: &Env,
        overrides: &Overrides,
        checks: &[StartupCheck],
    ) -> Result<Config, ConfigErrors> {
        let mut problems = Vec::new();
        tree.overlay_env(env, &mut problems);
        // serde stops at the first refused value: each one is taken out of the tree (its key then reads as its
        // default) and the rest read again, so that one `floodgate check` lists every problem, not one per edit.
        let mut refused: Vec<ConfigError> = Vec::new();
        let config = loop {
            match Config::deserialize(read::NodeReader::root(&tree)) {
                Ok(config) => break Some(config),
                Err(refusal) => {
                    let key = refusal
                        .key
                        .filter(|key| !key.is_empty())
                        .unwrap_or_else(|| "config".to_string());
                    // A refused value is the layer's problem, whether or not a flag replaces it.
                    let problem = describe(&tree, None, ConfigError::new(key.clone(), refusal.message));
                    refused.push(problem);
                    if !tree.refuse(&key) || refused.len() >= MAX_REFUSED {
                        break None;
                    }
                }
            }
        };
        refused.sort_by(|a, b| a.key.cmp(&b.key));
        let Some(mut config) = config else {
            problems.extend(refused);
            return Err(ConfigErrors(problems));
        };
        config.apply(overrides);
        let mut checked = config.validate();
        for check in checks {
            checked.extend(check(&config));
        }
        problems.extend(refused.iter().cloned());
        for problem in checked {
            if refused.iter().any(|value| hides(&value.key, &problem.key)) {
                continue;
            }
            problems.push(describe(&tree, Some(overrides), problem));
        }
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(problems))
        }
    }
}

/// The most refused values reported from one configuration: past it, the rest is likely one mistake repeated.
const MAX_REFUSED: usize = 100;

/// Adds to a problem the value it is about and where that was given: the flag that set the key, when `flags` count
/// (a flag's value replaced whatever the layers gave), or else the layer the tree kept it from (for a key no layer
/// gave, a default's problem, neither). A secret's value is never shown.
fn describe(tree: &Node, flags: Option<&Overrides>, mut problem: ConfigError) -> ConfigError {
    if let Some(flag) = flags.and_then(|flags| flags.flag_for(&problem.key)) {
        problem.origin = Some(format!("from {flag}"));
        return problem;
    }
    let Some((value, origin)) = tree.shown(&problem.key) else {
        return problem;
    };
    if problem.value.is_none() {
        let secret = problem.key == "admin_token";
        problem.value = value.map(|value| if secret { REDACTED.to_string() } else { value });
    }
    if problem.origin.is_none() {
        problem.origin = origin.map(ToString::to_string);
    }
    problem
}
