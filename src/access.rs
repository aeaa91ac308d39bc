//! The access log: one line per request, written where the request's outcome is counted.
//!
//! An [`Entry`] exists only while the access log is on, so with it off a request pays for one `None` and no
//! clock read, allocation or lock. Lines are `tracing` events with the target [`TARGET`], which `main` sends to
//! their own non-blocking writer as they are: each line is made here, the fields named as OpenTelemetry's semantic
//! conventions name them, as JSON or `key=value` (the configured ones, and the header fields it captures), or a
//! Combined Log Format line.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::{header, Method, StatusCode, Version};

use crate::error::Outcome;

/// The header that carries a request's ID (set by `edge`), read here for the access log's request ID.
pub use crate::h1::X_REQUEST_ID;

/// The target of access-log events; the ordinary log leaves it out.
pub const TARGET: &str = "floodgate::access";

/// How a line is made: named fields as one JSON object or as `key=value` pairs after a readable head, or a
/// Combined Log Format line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Json,
    Human,
    Combined,
}

pub use crate::config::access_log::{FIELDS, SECRET_HEADERS};

/// What the access log writes, fixed at start-up from the configuration.
#[derive(Debug)]
pub struct Settings {
    pub style: Style,
    /// Which of [`FIELDS`] a line has, by index; all when `access_log_fields` is empty.
    chosen: [bool; FIELDS.len()],
    request_headers: Vec<Captured>,
    response_headers: Vec<Captured>,
    /// The most bytes of a captured value written.
    header_bytes: usize,
}

/// A header field the access log captures, under the OpenTelemetry name `http.{request,response}.header.NAME`.
#[derive(Debug)]
struct Captured {
    name: http::HeaderName,
    key: String,
    redacted: bool,
}

impl Settings {
    /// `None` when the access log is off. Names were checked when the configuration was (`config::validate`): one
    /// that does not parse is left out rather than refused here.
    pub fn of(config: &crate::config::Config) -> Option<std::sync::Arc<Settings>> {
        let style = match config.access_log_format()? {
            crate::config::AccessLogFormat::Combined => Style::Combined,
            crate::config::AccessLogFormat::Json => Style::Json,
            _ => Style::Human,
        };
        let every = config.access_log_fields.is_empty();
        let chosen = FIELDS.map(|field| every || config.access_log_fields.iter().any(|name| name == field));
        let captured = |names: &[String], side: &str| -> Vec<Captured> {
            names
                .iter()
                .filter_map(|name| {
                    let name = http::HeaderName::from_bytes(name.trim().as_bytes()).ok()?;
                    let redacted = SECRET_HEADERS.contains(&name.as_str())
                        && !config
                            .access_log_unredacted
                            .iter()
                            .any(|shown| shown.eq_ignore_ascii_case(name.as_str()));
                    Some(Captured {
                        key: format!("http.{side}.header.{name}"),
                        name,
                        redacted,
                    })
                })
                .collect()
        };
        Some(std::sync::Arc::new(Settings {
            style,
            chosen,
            request_headers: captured(&config.access_log_request_headers, "request"),
            response_headers: captured(&config.access_log_response_headers, "response"),
            header_bytes: config.access_log_header_bytes,
        }))
    }

    /// The captured values of `headers` for `fields`, cut to `header_bytes` (at a character boundary) and redacted.
    fn capture(&self, fields: &[Captured], headers: &http::HeaderMap) -> Vec<Option<String>> {
        fields
            .iter()
            .map(|field| {
                let value = headers.get(&field.name)?;
                if field.redacted {
                    return Some("<redacted>".to_string());
                }
                let text = String::from_utf8_lossy(value.as_bytes());
                if text.len() <= self.header_bytes {
                    return Some(text.into_owned());
                }
                let mut end = self.header_bytes;
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                Some(format!("{}…", text.get(..end).unwrap_or_default()))
            })
            .collect()
    }
}

/// A field's value in a line. A `human` line writes text quoted (Rust's escapes) but for a few fields always
/// written bare, as tracing's own line did for values it displayed.
enum Value<'a> {
    Text(&'a str),
    Bare(&'a str),
    Number(u64),
}

/// What is known about a request when it arrives, kept until its answer is done with.
#[derive(Debug)]
pub struct Entry {
    settings: std::sync::Arc<Settings>,
    /// The captured request and response header values, in the order `settings` names them.
    request_headers: Vec<Option<String>>,
    response_headers: Vec<Option<String>>,
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
        settings: Option<&std::sync::Arc<Settings>>,
        client: SocketAddr,
        tls: bool,
        request: &http::Request<B>,
    ) -> Option<Box<Entry>> {
        let settings = settings?.clone();
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
            request_headers: settings.capture(&settings.request_headers, headers),
            response_headers: Vec::new(),
            settings,
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

    /// The answer's head, as the client gets it: its captured fields are taken now.
    pub fn answered_with(&mut self, headers: &http::HeaderMap) {
        if !self.settings.response_headers.is_empty() {
            self.response_headers = self.settings.capture(&self.settings.response_headers, headers);
        }
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
        let style = self.settings.style;
        if style == Style::Combined {
            tracing::info!(target: TARGET, "{}", self.combined(status, bytes));
            return;
        }
        fn text(value: Option<&str>) -> Option<Value<'_>> {
            value.map(Value::Text)
        }
        let client_ip = self.client.ip().to_string();
        let method = self.method.as_str();
        let values: [Option<Value<'_>>; FIELDS.len()] = [
            Some(Value::Bare(&client_ip)),
            Some(Value::Number(u64::from(self.client.port()))),
            Some(Value::Bare(&self.request_id)),
            Some(Value::Bare(method)),
            Some(Value::Bare(&self.path)),
            text(self.query.as_deref()),
            text(self.host.as_deref()),
            self.port.map(|port| Value::Number(u64::from(port))),
            Some(Value::Text(self.scheme)),
            text(self.route.as_deref()),
            text(self.user_agent.as_deref()),
            Some(Value::Text(protocol_version(self.version))),
            Some(Value::Number(u64::from(status))),
            Some(Value::Number(
                self.request_body.as_ref().map_or(0, |counted| counted.get()),
            )),
            Some(Value::Number(bytes)),
            Some(Value::Text(self.upstream.as_deref().unwrap_or("-"))),
            Some(Value::Text(outcome)),
            Some(Value::Number(queue_us)),
            Some(Value::Number(upstream_us)),
            Some(Value::Number(micros(now.duration_since(self.arrived)))),
            text(self.trace.as_ref().map(|(trace_id, _)| trace_id.as_str())),
            text(self.trace.as_ref().map(|(_, span_id)| span_id.as_str())),
            tunnel.map(|(to_upstream, _)| Value::Number(to_upstream)),
            tunnel.map(|(_, closed_by)| Value::Text(closed_by)),
        ];
        let settings = &self.settings;
        let chosen = FIELDS
            .iter()
            .zip(values)
            .zip(settings.chosen)
            .filter_map(|((key, value), chosen)| Some((*key, value.filter(|_| chosen)?)));
        fn captured<'a>(fields: &'a [Captured], values: &'a [Option<String>]) -> Vec<(&'a str, Value<'a>)> {
            fields
                .iter()
                .zip(values.iter())
                .filter_map(|(field, value)| Some((field.key.as_str(), Value::Text(value.as_deref()?))))
                .collect()
        }
        let fields = chosen
            .chain(captured(&settings.request_headers, &self.request_headers))
            .chain(captured(&settings.response_headers, &self.response_headers));
        let message = format!("{} {} {status}", self.method, self.path);
        let line = render(style, &message, fields);
        tracing::info!(target: TARGET, "{line}");
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

/// A `json` line (an object with `timestamp`, `level`, `message`, the fields, `target`, as tracing's JSON log
/// writes an event) or a `human` one (`timestamp  INFO target: message key=value ...`, as tracing's line was).
fn render<'a>(style: Style, message: &str, fields: impl Iterator<Item = (&'a str, Value<'a>)>) -> String {
    use std::fmt::Write;
    // RFC 3339 in UTC to the microsecond, as the ordinary log's lines.
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z");
    let timestamp = time::OffsetDateTime::now_utc().format(format).unwrap_or_default();
    let json = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_string());
    let mut line = String::with_capacity(512);
    if style == Style::Json {
        let _ = write!(
            line,
            "{{\"timestamp\":{},\"level\":\"INFO\",\"message\":{}",
            json(&timestamp),
            json(message)
        );
        for (key, value) in fields {
            let _ = match value {
                Value::Text(text) | Value::Bare(text) => write!(line, ",{}:{}", json(key), json(text)),
                Value::Number(number) => write!(line, ",{}:{number}", json(key)),
            };
        }
        let _ = write!(line, ",\"target\":{}}}", json(TARGET));
    } else {
        let _ = write!(line, "{timestamp}  INFO {TARGET}: {message}");
        for (key, value) in fields {
            let _ = match value {
                Value::Number(number) => write!(line, " {key}={number}"),
                Value::Text(text) => write!(line, " {key}={text:?}"),
                Value::Bare(text) => write!(line, " {key}={text}"),
            };
        }
    }
    line
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
