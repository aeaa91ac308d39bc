//! The access log: one line per request, written where the request's outcome is counted.
//!
//! An [`Entry`] exists only while the access log is on, so with it off a request pays for one `None` and no
//! clock read, allocation or lock. Lines are `tracing` events with the target [`TARGET`], which `main` sends to
//! their own non-blocking writer: fields named as OpenTelemetry's semantic conventions name them (written as JSON
//! or `key=value` by `main`), or one Combined Log Format line as the event's message.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::{header, Method, StatusCode, Version};

use crate::error::Outcome;

/// The header that carries a request's ID (set by `edge`), read here for the access log's request ID.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The target of access-log events; the ordinary log leaves it out.
pub const TARGET: &str = "floodgate::access";

/// How a line is made: named fields, or a Combined Log Format line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Fields,
    Combined,
}

/// What is known about a request when it arrives, kept until its answer is done with.
#[derive(Debug)]
pub struct Entry {
    style: Style,
    client: SocketAddr,
    /// `X-Request-Id` as it went upstream (see `edge`); `-` without one.
    request_id: String,
    method: Method,
    path: String,
    query: Option<String>,
    /// The host the client asked for (the target's authority, else `Host`), and its port when it names one.
    host: Option<String>,
    port: Option<u16>,
    /// `https` for a client that reached floodgate over TLS.
    scheme: &'static str,
    user_agent: Option<String>,
    referer: Option<String>,
    version: Version,
    arrived: Instant,
    upstream: Option<String>,
    /// The route's label (`host/prefix`, as the traces' `http.route`).
    route: Option<std::sync::Arc<str>>,
    /// The request's exported span, with `otlp_endpoint`: its trace and span IDs, to join the line to the trace.
    trace: Option<(String, String)>,
    /// The request body's bytes handed upstream, counted as they go (one that had a body to read).
    request_body: Option<prometheus_client::metrics::counter::Counter>,
    admitted: Option<Instant>,
}

impl Entry {
    /// `None` when the access log is off: the request's path carries nothing for it.
    pub fn start<B>(
        style: Option<Style>,
        client: SocketAddr,
        tls: bool,
        request: &http::Request<B>,
    ) -> Option<Box<Entry>> {
        let style = style?;
        let headers = request.headers();
        let text = |value: Option<&http::HeaderValue>| {
            value.map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
        };
        let uri = request.uri();
        let authority = match uri.authority() {
            Some(authority) => Some(authority.as_str().to_string()),
            None => text(headers.get(header::HOST)),
        };
        let (host, port) = match authority.as_deref().map(host_and_port) {
            Some((host, port)) => (Some(host.to_string()), port),
            None => (None, None),
        };
        Some(Box::new(Entry {
            style,
            client,
            request_id: text(headers.get(X_REQUEST_ID)).unwrap_or_else(|| "-".to_string()),
            method: request.method().clone(),
            path: uri.path().to_string(),
            query: uri.query().map(str::to_string),
            host,
            port,
            scheme: if tls { "https" } else { "http" },
            user_agent: text(headers.get(header::USER_AGENT)),
            referer: text(headers.get(header::REFERER)),
            version: request.version(),
            arrived: Instant::now(),
            upstream: None,
            route: None,
            trace: None,
            request_body: None,
            admitted: None,
        }))
    }

    pub fn routed(&mut self, upstream: &str, route: &std::sync::Arc<str>) {
        self.upstream = Some(upstream.to_string());
        self.route = Some(route.clone());
    }

    /// A counter for the request body's bytes, read when the line is written.
    pub fn request_body_counter(&mut self) -> prometheus_client::metrics::counter::Counter {
        self.request_body.get_or_insert_with(Default::default).clone()
    }

    /// The IDs of the request's exported trace and span, as W3C Trace Context writes them (hex).
    pub fn traced(&mut self, trace_id: String, span_id: String) {
        self.trace = Some((trace_id, span_id));
    }

    /// The request left the queue at `at`.
    pub fn admitted_at(&mut self, at: Instant) {
        self.admitted = Some(at);
    }

    /// Writes the line. `bytes` is the response body handed on to the client.
    pub fn write(&self, outcome: Outcome, status: Option<StatusCode>, bytes: u64) {
        self.line(outcome.as_str(), status.map_or(0, |s| s.as_u16()), bytes, None);
    }

    /// Writes a tunnel's line when it ends (its `101` was counted when sent): the bytes each way, and which side
    /// closed it (`closed_by`). Its upstream duration is how long it held its socket.
    pub fn write_tunnel(&self, to_client: u64, to_upstream: u64, closed_by: &str) {
        self.line("tunnel", 101, to_client, Some((to_upstream, closed_by)));
    }

    fn line(&self, outcome: &str, status: u16, bytes: u64, tunnel: Option<(u64, &str)>) {
        let now = Instant::now();
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let queue_us = self.admitted.map_or(0, |at| micros(at.duration_since(self.arrived)));
        let upstream_us = self.admitted.map_or(0, |at| micros(now.duration_since(at)));
        if self.style == Style::Combined {
            tracing::info!(target: TARGET, "{}", self.combined(status, bytes));
            return;
        }
        tracing::info!(
            target: TARGET,
            {
            "client.address" = %self.client.ip(),
            "client.port" = self.client.port(),
            "http.request.header.x-request-id" = %self.request_id,
            "http.request.method" = %self.method,
            "url.path" = %self.path,
            "url.query" = self.query.as_deref(),
            "server.address" = self.host.as_deref(),
            "server.port" = self.port,
            "url.scheme" = self.scheme,
            "http.route" = self.route.as_deref(),
            "user_agent.original" = self.user_agent.as_deref(),
            "network.protocol.version" = protocol_version(self.version),
            "http.response.status_code" = status,
            "http.request.body.size" = self.request_body.as_ref().map_or(0, |counted| counted.get()),
            "http.response.body.size" = bytes,
            "floodgate.upstream" = self.upstream.as_deref().unwrap_or("-"),
            "floodgate.outcome" = outcome,
            "floodgate.queue.duration_us" = queue_us,
            "floodgate.upstream.duration_us" = upstream_us,
            "floodgate.request.duration_us" = micros(now.duration_since(self.arrived)),
            "trace_id" = self.trace.as_ref().map(|(trace_id, _)| trace_id.as_str()),
            "span_id" = self.trace.as_ref().map(|(_, span_id)| span_id.as_str()),
            "floodgate.tunnel.bytes_to_upstream" = tunnel.map(|(to_upstream, _)| to_upstream),
            "floodgate.tunnel.closed_by" = tunnel.map(|(_, closed_by)| closed_by),
            },
            "{} {} {status}",
            self.method,
            self.path,
        );
    }

    /// The line in the Combined Log Format: `host ident user [time] "request line" status bytes "referer"
    /// "user agent"`, with `-` for what is not known (a status of 0: none was sent).
    fn combined(&self, status: u16, bytes: u64) -> String {
        let quoted =
            |value: Option<&str>| value.map_or_else(|| "-".to_string(), |value| value.escape_default().to_string());
        let target = match &self.query {
            Some(query) => format!("{}?{query}", self.path),
            None => self.path.clone(),
        };
        let bytes = if bytes == 0 { "-".to_string() } else { bytes.to_string() };
        format!(
            "{} - - [{}] \"{} {} HTTP/{}\" {status} {bytes} \"{}\" \"{}\"",
            self.client.ip(),
            clf_time(std::time::SystemTime::now()),
            self.method,
            target.escape_default(),
            protocol_version(self.version),
            quoted(self.referer.as_deref()),
            quoted(self.user_agent.as_deref()),
        )
    }
}

/// `authority` (`host[:port]`, an IPv6 literal in brackets) as OpenTelemetry's `server.address` (the host, without
/// brackets) and `server.port` (when it names one).
fn host_and_port(authority: &str) -> (&str, Option<u16>) {
    let (name, port) = crate::h1::split_port(authority.as_bytes());
    let name = authority.get(..name.len()).unwrap_or(authority);
    let host = name
        .strip_prefix('[')
        .and_then(|literal| literal.strip_suffix(']'))
        .unwrap_or(name);
    (host, port.and_then(|port| std::str::from_utf8(port).ok()?.parse().ok()))
}

/// HTTP's version as OpenTelemetry's `network.protocol.version` writes it.
fn protocol_version(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

/// `10/Oct/2000:13:55:36 +0000`: the Combined Log Format's time, in UTC.
fn clf_time(at: std::time::SystemTime) -> String {
    let format = time::macros::format_description!("[day]/[month repr:short]/[year]:[hour]:[minute]:[second] +0000");
    time::OffsetDateTime::from(at)
        .format(format)
        .unwrap_or_else(|_| "01/Jan/1970:00:00:00 +0000".to_string())
}

#[cfg(test)]
mod tests {
    use super::host_and_port;

    #[test]
    fn server_address_is_the_host_alone_and_server_port_the_port_it_names() {
        assert_eq!(host_and_port("app.example"), ("app.example", None));
        assert_eq!(host_and_port("app.example:8443"), ("app.example", Some(8443)));
        assert_eq!(host_and_port("app.example:"), ("app.example", None));
        assert_eq!(host_and_port("[2001:db8::1]:443"), ("2001:db8::1", Some(443)));
        assert_eq!(host_and_port("[2001:db8::1]"), ("2001:db8::1", None));
    }
}
