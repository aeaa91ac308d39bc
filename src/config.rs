//! Configuration: a TOML file and command-line flags turned into one validated, typed [`Config`].
//!
//! Owns the defaults (stated again in `config/floodgate.toml`), the parsing of humane durations and the
//! validation that stops start-up with one line naming the offending key. It never reads the network and never
//! starts anything; what it returns is trusted by every other module.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;

/// A configuration problem, always naming the key it is about.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// The whole validated configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// Tokio worker threads; `None` lets the runtime use one per CPU.
    pub threads: Option<usize>,
    pub max_client_connections: usize,
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub client_idle_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_concurrent_streams: u32,
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    pub trusted_proxies: Vec<IpNet>,
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub routes: Vec<RouteConfig>,
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
            upstreams: BTreeMap::new(),
            routes: Vec::new(),
        }
    }
}

/// One named upstream origin and the limits of its pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// `http://host:port` or a bare `host:port`.
    pub url: String,
    pub max_connections: usize,
    pub max_queue: usize,
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
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
    pub max_requests_per_connection: u64,
    /// 0 means unlimited.
    #[serde(with = "humantime_serde")]
    pub max_connection_lifetime: Duration,
    /// How much of a response the proxy still reads after its client went away, to keep the connection.
    pub abort_drain_bytes: u64,
    #[serde(with = "humantime_serde")]
    pub abort_drain_timeout: Duration,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: String::new(),
            max_connections: 8,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(1),
            body_idle_timeout: Duration::from_secs(30),
            max_requests_per_connection: 0,
            max_connection_lifetime: Duration::ZERO,
            abort_drain_bytes: 1024 * 1024,
            abort_drain_timeout: Duration::from_secs(5),
        }
    }
}

impl UpstreamConfig {
    /// Every duration key with its value and whether 0 is allowed (it means "none" there); validation and the
    /// config fuzz target both walk this one list.
    pub fn durations(&self) -> [(&'static str, Duration, bool); 8] {
        [
            ("queue_timeout", self.queue_timeout, true),
            ("connect_timeout", self.connect_timeout, false),
            ("request_timeout", self.request_timeout, false),
            ("idle_timeout", self.idle_timeout, false),
            ("close_timeout", self.close_timeout, false),
            ("body_idle_timeout", self.body_idle_timeout, false),
            ("max_connection_lifetime", self.max_connection_lifetime, true),
            ("abort_drain_timeout", self.abort_drain_timeout, false),
        ]
    }
}

/// Picks an upstream by Host and/or path prefix; neither means catch-all.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub host: Option<String>,
    pub path_prefix: Option<String>,
    pub upstream: String,
}

/// An upstream origin as dialled: host (name or IP literal, brackets removed) and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub host: String,
    pub port: u16,
}

impl Origin {
    /// Parses `http://host:port`, `http://host` (port 80) or `host:port`; IPv6 literals in brackets.
    pub fn parse(text: &str) -> Result<Origin, String> {
        let rest = match text.split_once("://") {
            Some(("http", rest)) => rest,
            Some((scheme, _)) => return Err(format!("scheme `{scheme}` is not supported (use http://)")),
            None => text,
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
            None => 80,
        };
        if port == 0 {
            return Err(format!("`{text}` has port 0"));
        }
        Ok(Origin {
            host: host.to_string(),
            port,
        })
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

/// Values given on the command line; each one overrides the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    pub upstream: Option<String>,
    pub max_connections: Option<usize>,
    pub max_queue: Option<usize>,
    pub queue_timeout: Option<Duration>,
    pub connect_timeout: Option<Duration>,
    pub request_timeout: Option<Duration>,
    pub idle_timeout: Option<Duration>,
    pub body_idle_timeout: Option<Duration>,
    pub client_idle_timeout: Option<Duration>,
    pub header_read_timeout: Option<Duration>,
    pub first_byte_timeout: Option<Duration>,
    pub shutdown_timeout: Option<Duration>,
    pub threads: Option<usize>,
}

/// The name the quick `--upstream` case gives its one upstream.
pub const DEFAULT_UPSTREAM: &str = "default";

impl Config {
    /// The quick case: everything goes to one upstream with the given cap.
    pub fn single_upstream(upstream: &str, max_connections: usize) -> Result<Config, ConfigError> {
        let overrides = Overrides {
            upstream: Some(upstream.to_string()),
            max_connections: Some(max_connections),
            ..Overrides::default()
        };
        Config::load(None, &overrides)
    }

    /// Reads the file (if any), applies the flags and validates the result.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let config = match file {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        config.finish(overrides)
    }

    /// [`Config::load`] from the text of a file rather than its path; `origin` names the text in errors.
    pub(crate) fn load_toml(text: &str, origin: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let source = config::File::from_str(text, config::FileFormat::Toml);
        Config::from_source(source, origin)?.finish(overrides)
    }

    fn finish(mut self, overrides: &Overrides) -> Result<Config, ConfigError> {
        self.apply(overrides);
        self.validate()?;
        Ok(self)
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

    fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let source = config::File::from(path).format(config::FileFormat::Toml).required(true);
        Config::from_source(source, &path.display().to_string())
    }

    fn from_source<S>(source: S, origin: &str) -> Result<Config, ConfigError>
    where
        S: config::Source + Send + Sync + 'static,
    {
        let raw = config::Config::builder()
            .add_source(source)
            .build()
            .map_err(|err| ConfigError::new(origin, one_line(&err.to_string())))?;
        raw.try_deserialize::<Config>().map_err(from_config_error)
    }

    fn apply(&mut self, o: &Overrides) {
        if let Some(listen) = o.listen {
            self.listen = listen;
        }
        if let Some(admin) = o.admin {
            self.admin = admin;
        }
        if o.threads.is_some() {
            self.threads = o.threads;
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
        if let Some(url) = &o.upstream {
            // The flag names the one upstream everything goes to, as in the quick case.
            let upstream = self.upstreams.entry(DEFAULT_UPSTREAM.to_string()).or_default();
            upstream.url = url.clone();
            self.routes.retain(|route| route.upstream == DEFAULT_UPSTREAM);
            if self.routes.is_empty() {
                self.routes.push(RouteConfig {
                    host: None,
                    path_prefix: None,
                    upstream: DEFAULT_UPSTREAM.to_string(),
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

    fn validate(&self) -> Result<(), ConfigError> {
        if self.upstreams.is_empty() {
            return Err(ConfigError::new(
                "upstreams",
                "no upstream configured (give --upstream http://host:port or an [upstreams.NAME] table)",
            ));
        }
        positive("max_client_connections", self.max_client_connections as u128)?;
        positive("max_header_bytes", self.max_header_bytes as u128)?;
        positive("max_concurrent_streams", u128::from(self.max_concurrent_streams))?;
        if let Some(threads) = self.threads {
            positive("threads", threads as u128)?;
        }
        if self.max_client_connections > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(ConfigError::new(
                "max_client_connections",
                format!("must be at most {}", tokio::sync::Semaphore::MAX_PERMITS),
            ));
        }
        for (key, value, zero_allowed) in [
            ("first_byte_timeout", self.first_byte_timeout, false),
            ("header_read_timeout", self.header_read_timeout, false),
            ("client_idle_timeout", self.client_idle_timeout, false),
            ("shutdown_timeout", self.shutdown_timeout, true),
        ] {
            duration_in_range(key, value, zero_allowed)?;
        }
        for (name, upstream) in &self.upstreams {
            let valid_name = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !valid_name {
                return Err(ConfigError::new(
                    format!("upstreams.{name}"),
                    "upstream names may only use a-z, 0-9 and _",
                ));
            }
            let key = |field: &str| format!("upstreams.{name}.{field}");
            if upstream.url.is_empty() {
                return Err(ConfigError::new(key("url"), "missing (e.g. \"http://127.0.0.1:9000\")"));
            }
            Origin::parse(&upstream.url).map_err(|message| ConfigError::new(key("url"), message))?;
            positive(&key("max_connections"), upstream.max_connections as u128)?;
            for (field, value, zero_allowed) in upstream.durations() {
                duration_in_range(&key(field), value, zero_allowed)?;
            }
        }
        for (index, route) in self.routes.iter().enumerate() {
            if !self.upstreams.contains_key(&route.upstream) {
                return Err(ConfigError::new(
                    format!("routes[{index}].upstream"),
                    format!("unknown upstream `{}`", route.upstream),
                ));
            }
            if let Some(prefix) = &route.path_prefix {
                if !prefix.starts_with('/') {
                    return Err(ConfigError::new(
                        format!("routes[{index}].path_prefix"),
                        "must start with /",
                    ));
                }
            }
        }
        if self.routes.is_empty() {
            return Err(ConfigError::new(
                "routes",
                "no route configured (add a [[routes]] entry with upstream = \"NAME\")",
            ));
        }
        Ok(())
    }
}

/// Deadlines are computed as `now + duration`; a year bounds them far from overflow and from any sane setting.
const LONGEST_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn duration_in_range(key: &str, value: Duration, zero_allowed: bool) -> Result<(), ConfigError> {
    if !zero_allowed {
        positive(key, value.as_nanos())?;
    }
    if value > LONGEST_DURATION {
        return Err(ConfigError::new(key, "must be at most a year (365d)"));
    }
    Ok(())
}

fn positive(key: &str, value: u128) -> Result<(), ConfigError> {
    if value == 0 {
        Err(ConfigError::new(key, "must be greater than zero"))
    } else {
        Ok(())
    }
}

/// The `config` crate reports a key path for most errors but names an unknown field only in its message; either
/// way the result is one line whose key is the offending one.
fn from_config_error(err: config::ConfigError) -> ConfigError {
    let (key, text) = match &err {
        config::ConfigError::Type { key: Some(key), .. } | config::ConfigError::At { key: Some(key), .. } => {
            let text = err.to_string();
            let message = text.split(" for key `").next().unwrap_or(&text).to_string();
            (key.clone(), message)
        }
        _ => (String::new(), err.to_string()),
    };
    let (key, text) = match text
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
    {
        Some((field, _)) if key.is_empty() => (field.to_string(), text.clone()),
        Some((field, _)) => (format!("{key}.{field}"), text.clone()),
        None if key.is_empty() => ("config".to_string(), text),
        None => (key, text),
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
        assert_eq!((o.host.as_str(), o.port), ("127.0.0.1", 9000));
        let o = Origin::parse("localhost:81").unwrap();
        assert_eq!((o.host.as_str(), o.port), ("localhost", 81));
        let o = Origin::parse("http://[::1]:9000/").unwrap();
        assert_eq!((o.host.as_str(), o.port), ("::1", 9000));
        assert_eq!(o.authority(), "[::1]:9000");
        assert_eq!(Origin::parse("http://example.com").unwrap().port, 80);
        assert!(Origin::parse("https://example.com").is_err());
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

    #[test]
    fn the_reference_file_is_valid_and_states_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/floodgate.toml");
        let config = Config::load(Some(&path), &Overrides::default()).unwrap();
        let defaults = Config::default();
        assert_eq!(config.listen, defaults.listen);
        assert_eq!(config.client_idle_timeout, defaults.client_idle_timeout);
        let app = &config.upstreams["app"];
        let upstream_defaults = UpstreamConfig::default();
        assert_eq!(app.max_queue, upstream_defaults.max_queue);
        assert_eq!(app.queue_timeout, upstream_defaults.queue_timeout);
        assert_eq!(app.idle_timeout, upstream_defaults.idle_timeout);
        assert_eq!(app.abort_drain_bytes, upstream_defaults.abort_drain_bytes);
    }

    #[test]
    fn zero_connections_is_rejected_with_its_key() {
        let err = Config::single_upstream("127.0.0.1:9000", 0).unwrap_err();
        assert_eq!(err.key, "upstreams.default.max_connections");
    }
}
