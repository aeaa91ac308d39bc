//! Validation: every problem with a loaded configuration, each naming its key, so that one edit fixes them all.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use super::{AccessLogTarget, Config, ConfigError, ReplicaSource, RouteConfig, MAX_PRIORITY};

impl Config {
    /// Every problem with the values, in key order within each part; empty when the configuration is usable.
    pub(super) fn validate(&self) -> Vec<ConfigError> {
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
        if let Err(err) = super::log_filter(&self.log_level) {
            problems.push("log_level", err);
        }
        for name in &self.access_log_fields {
            if !super::access_log::FIELDS.contains(&name.as_str()) {
                problems.push(
                    "access_log_fields",
                    format!(
                        "`{name}` is no access-log field (one of: {})",
                        super::access_log::FIELDS.join(", ")
                    ),
                );
            }
        }
        for (key, names) in [
            ("access_log_request_headers", &self.access_log_request_headers),
            ("access_log_response_headers", &self.access_log_response_headers),
        ] {
            for name in names {
                if http::HeaderName::from_bytes(name.trim().as_bytes()).is_err() {
                    problems.push(key, format!("`{name}` is not a header field name"));
                }
            }
            if names.len() > MAX_CAPTURED_HEADERS {
                problems.push(key, format!("at most {MAX_CAPTURED_HEADERS} header fields"));
            }
        }
        for name in &self.access_log_unredacted {
            if !super::access_log::SECRET_HEADERS
                .iter()
                .any(|secret| secret.eq_ignore_ascii_case(name))
            {
                problems.push(
                    "access_log_unredacted",
                    format!(
                        "`{name}` is never redacted (only {} are)",
                        super::access_log::SECRET_HEADERS.join(", ")
                    ),
                );
            }
        }
        if !(1..=8192).contains(&self.access_log_header_bytes) {
            problems.push("access_log_header_bytes", "must be from 1 to 8192");
        }
        if self.access_log.trim().is_empty() {
            problems.push("access_log", "must be off, stdout, stderr or a file path");
        } else if let AccessLogTarget::File(path) = self.access_log_target() {
            if let Err(err) = try_access_log(&path) {
                problems.push("access_log", format!("cannot open {} to append: {err}", path.display()));
            }
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
        if !self.otlp_endpoint.is_empty() && !crate::trace::EXPORTER_BUILT {
            problems.push(
                "otlp_endpoint",
                "this floodgate was built without the `otlp` feature (cargo build --features otlp) and cannot \
                 export traces",
            );
        } else if !self.otlp_endpoint.is_empty() {
            match self.otlp_endpoint.parse::<http::Uri>() {
                Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => {}
                Ok(uri) if uri.scheme_str() == Some("https") => {
                    problems.push("otlp_endpoint", "https is not supported: send to a collector over http")
                }
                _ => problems.push(
                    "otlp_endpoint",
                    "must be an http:// URL such as http://collector:4318/v1/traces",
                ),
            }
        }
        if self.otlp_service_name.trim().is_empty() {
            problems.push("otlp_service_name", "must not be empty");
        }
        for (key, value, zero_allowed) in [
            ("first_byte_timeout", self.first_byte_timeout, false),
            ("header_read_timeout", self.header_read_timeout, false),
            ("client_idle_timeout", self.client_idle_timeout, false),
            ("shutdown_timeout", self.shutdown_timeout, true),
            ("drain_time", self.drain_time, true),
            ("config_watch_interval", self.config_watch_interval, true),
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
                    let plain = endpoints
                        .first()
                        .is_some_and(|(origin, _)| origin.scheme == super::Scheme::Http);
                    for (field, set) in [
                        ("tls_ca", upstream.tls_ca.is_some()),
                        ("tls_client_cert", upstream.tls_client_cert.is_some()),
                        ("tls_client_key", upstream.tls_client_key.is_some()),
                        ("tls_server_name", upstream.tls_server_name.is_some()),
                    ] {
                        if plain && set {
                            problems.push(
                                key(field),
                                "only for https:// upstreams, and url is http:// (plain HTTP)",
                            );
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
            // HTTP/2 stream ids are 31 bits, and a client opens odd ones only.
            if upstream.max_streams_per_connection > (1 << 30) {
                problems.push(key("max_streams_per_connection"), "must be at most 1073741824");
            } else {
                problems.count(
                    &key("max_streams_per_connection"),
                    upstream.max_streams_per_connection as u128,
                    false,
                );
            }
            problems.count(&key("max_tunnels"), upstream.max_tunnels as u128, true);
            problems.count(&key("min_idle"), upstream.min_idle as u128, true);
            if upstream.max_tunnels > 0 && upstream.protocol == super::UpstreamProtocol::Http2 {
                problems.push(
                    key("max_tunnels"),
                    "tunnels (WebSocket upgrades) need protocol = \"http1\"; this upstream speaks http2",
                );
            }
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
            if let Some(budget) = &upstream.retry_budget {
                if !budget.ratio.is_finite() || !(0.0..=100.0).contains(&budget.ratio) {
                    problems.push(key("retry_budget.ratio"), "must be a number from 0 to 100");
                }
                if budget.headers.is_empty() {
                    problems.push(key("retry_budget.headers"), "must name at least one header");
                }
                for name in &budget.headers {
                    if http::HeaderName::from_bytes(name.as_bytes())
                        .map(|parsed| parsed.as_str() != name)
                        .unwrap_or(true)
                    {
                        problems.push(
                            key("retry_budget.headers"),
                            format!("`{name}` is not a header name in lower case"),
                        );
                    }
                }
            }
            if let Some(ramp) = &upstream.slow_start {
                problems.count(&key("slow_start.initial"), ramp.initial as u128, false);
                problems.count(&key("slow_start.min_samples"), u128::from(ramp.min_samples), false);
                if !ramp.tolerance.is_finite() || !(1.0..=100.0).contains(&ramp.tolerance) {
                    problems.push(key("slow_start.tolerance"), "must be a number from 1 to 100");
                }
                problems.duration(&key("slow_start.window"), ramp.window, false);
                if ramp.max_duration < ramp.window {
                    problems.push(key("slow_start.max_duration"), "must be at least slow_start.window");
                }
            }
            if let Some(replicas) = &upstream.replicas {
                match (&replicas.dns, &replicas.file) {
                    (Some(_), None) | (None, Some(_)) => {}
                    _ => problems.push(key("replicas"), "needs one of dns and file"),
                }
                if replicas.dns.as_deref().is_some_and(|name| name.trim().is_empty()) {
                    problems.push(key("replicas.dns"), "must be a DNS name");
                }
                if let Some(problem) = replicas.file.as_deref().and_then(ReplicaSource::file_problem) {
                    problems.push(key("replicas.file"), problem);
                }
                if replicas.interval < ReplicaSource::MIN_INTERVAL {
                    problems.push(
                        key("replicas.interval"),
                        format!("must be at least {}ms", ReplicaSource::MIN_INTERVAL.as_millis()),
                    );
                } else {
                    problems.duration(&key("replicas.interval"), replicas.interval, false);
                }
            }
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
            if route.strip_prefix && route.path_prefix.as_deref().is_none_or(|prefix| prefix == "/") {
                problems.push(format!("routes[{index}].strip_prefix"), "needs a path_prefix to strip");
            }
            for (field, value) in [
                ("request_timeout", route.request_timeout),
                ("body_idle_timeout", route.body_idle_timeout),
            ] {
                if let Some(value) = value {
                    problems.duration(&format!("routes[{index}].{field}"), value, false);
                }
            }
            for (field, set) in [
                ("set_request_headers", &route.set_request_headers),
                ("set_response_headers", &route.set_response_headers),
            ] {
                if let Err(problem) = RouteConfig::fields_to_set(set) {
                    problems.push(format!("routes[{index}].{field}"), problem);
                }
            }
            for (field, names) in [
                ("remove_request_headers", &route.remove_request_headers),
                ("remove_response_headers", &route.remove_response_headers),
            ] {
                if let Err(problem) = RouteConfig::fields_to_remove(names) {
                    problems.push(format!("routes[{index}].{field}"), problem);
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
pub(super) fn listeners_clash(listen: SocketAddr, admin: SocketAddr) -> Option<String> {
    let overlap = listen.ip() == admin.ip() || listen.ip().is_unspecified() || admin.ip().is_unspecified();
    (listen.port() != 0 && listen.port() == admin.port() && overlap)
        .then(|| format!("{admin} is also where listen ({listen}) binds; give the admin listener another port"))
}

/// Opens the access log as start-up will (to append, creating it), so that `floodgate check` refuses a path start-up
/// could not open; a file that did not exist is removed again, for `check` to leave nothing behind.
pub(super) fn try_access_log(path: &Path) -> std::io::Result<()> {
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
pub(super) const LONGEST_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The largest integer TOML can state, so that `floodgate check` can always print what it accepted.
pub(super) const LARGEST_COUNT: u128 = i64::MAX as u128;

/// `LARGEST_COUNT` for a count set at runtime (the admin API's cap), which `check` must be able to print too.
pub const LARGEST_RUNTIME_COUNT: usize = i64::MAX as usize;

#[derive(Default)]
pub(super) struct Problems(Vec<ConfigError>);

impl Problems {
    pub(super) fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError::new(key, message));
    }

    pub(super) fn count(&mut self, key: &str, value: u128, zero_allowed: bool) {
        if value == 0 && !zero_allowed {
            self.push(key, "must be greater than zero");
        } else if value > LARGEST_COUNT {
            self.push(key, format!("must be at most {LARGEST_COUNT}"));
        }
    }

    pub(super) fn duration(&mut self, key: &str, value: Duration, zero_allowed: bool) {
        if value.is_zero() && !zero_allowed {
            self.push(key, "must be greater than zero");
        } else if value > LONGEST_DURATION {
            self.push(key, "must be at most a year (365d)");
        }
    }
}

/// Whether a problem validation found at `key` may be the work of a default standing in for the value refused at
/// `refused`: the keys are of one family (see [`family`]), or a whole upstream (or all) went, which routes name.
pub(super) fn hides(refused: &str, key: &str) -> bool {
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
pub(super) fn family(key: &str) -> String {
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

/// The most header fields each of `access_log_request_headers` and `access_log_response_headers` may name: a
/// line's size stays bounded (with `access_log_header_bytes`).
const MAX_CAPTURED_HEADERS: usize = 32;
