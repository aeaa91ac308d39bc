//! The command-line layer: the flags, derived once with clap and read by `floodgate`, `check` and `demo` alike,
//! and how they apply over the file and the environment.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use super::{Config, LogFormat, RouteConfig, DEFAULT_UPSTREAM};

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
    /// On SIGTERM/SIGINT, go on accepting this long with /readyz failing before the drain (default 0s).
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub drain_time: Option<Duration>,
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
    /// What floodgate speaks to each upstream: http1, or http2 (prior knowledge, or ALPN h2 over TLS).
    #[arg(long = "upstream-protocol", global = true, value_enum)]
    #[serde(rename = "protocol")]
    pub upstream_protocol: Option<super::UpstreamProtocol>,
    /// HTTP/2 upstreams: most requests at once on one connection.
    #[arg(long, global = true)]
    pub max_streams_per_connection: Option<usize>,
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
    /// Most WebSocket (and other upgrade) tunnels open to each upstream, beside max-connections (0: refused).
    #[arg(long, global = true)]
    pub max_tunnels: Option<usize>,
    /// A tunnel with no byte either way for this long is closed.
    #[arg(long, global = true, value_parser = humantime::parse_duration)]
    pub tunnel_idle_timeout: Option<Duration>,
}

impl Overrides {
    /// The flag that set `key`, if one did (`--max-connections` for `upstreams.api.max_connections`): read from
    /// the flags' own names, so no list of them is kept here.
    pub(super) fn flag_for(&self, key: &str) -> Option<String> {
        let given = |group: serde_json::Result<serde_json::Value>, name: &str| {
            group
                .ok()
                .and_then(|group| group.get(name).map(|value| !value.is_null()))
                .unwrap_or(false)
        };
        let (set, name) = match key.strip_prefix("upstreams.").and_then(|rest| rest.split_once('.')) {
            Some((_, "url")) => (given(serde_json::to_value(&self.upstream), "url"), "upstream"),
            Some((_, "protocol")) => (
                given(serde_json::to_value(&self.upstream), "protocol"),
                "upstream_protocol",
            ),
            Some((_, field)) => (given(serde_json::to_value(&self.upstream), field), field),
            None => (given(serde_json::to_value(&self.global), key), key),
        };
        set.then(|| format!("--{}", name.replace('_', "-")))
    }
}

impl Config {
    pub(super) fn apply(&mut self, overrides: &Overrides) {
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
            (o.drain_time, &mut self.drain_time),
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
            upstream.endpoints = crate::config::Endpoints::default();
            self.routes.retain(|route| route.upstream == DEFAULT_UPSTREAM);
            if self.routes.is_empty() {
                self.routes.push(RouteConfig {
                    host: None,
                    path_prefix: None,
                    upstream: DEFAULT_UPSTREAM.to_string(),
                    priority: 0,
                    ..RouteConfig::default()
                });
            }
            self.upstreams.retain(|name, _| name == DEFAULT_UPSTREAM);
        }
        // Limits given as flags apply to every upstream.
        for upstream in self.upstreams.values_mut() {
            if let Some(n) = o.max_connections {
                upstream.max_connections = n;
            }
            if let Some(protocol) = o.upstream_protocol {
                upstream.protocol = protocol;
            }
            if let Some(n) = o.max_streams_per_connection {
                upstream.max_streams_per_connection = n;
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
            if let Some(n) = o.max_tunnels {
                upstream.max_tunnels = n;
            }
            let durations = [
                (o.queue_timeout, &mut upstream.queue_timeout),
                (o.connect_timeout, &mut upstream.connect_timeout),
                (o.request_timeout, &mut upstream.request_timeout),
                (o.idle_timeout, &mut upstream.idle_timeout),
                (o.body_idle_timeout, &mut upstream.body_idle_timeout),
                (o.tunnel_idle_timeout, &mut upstream.tunnel_idle_timeout),
            ];
            for (value, slot) in durations {
                if let Some(value) = value {
                    *slot = value;
                }
            }
        }
    }
}
