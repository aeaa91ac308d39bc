//! The admin listener: the stats page at `/`, `/metrics`, `/status`, `/healthz`, `/readyz`, the configuration in
//! force at `/config`, and the write endpoints, `POST /reload`, `PUT /upstreams/{name}/max_connections` and
//! `PUT /upstreams/{name}/endpoints/{host:port}/state`.
//!
//! Owns the views of the proxy's state and who may see or change what: `/config` and the write endpoints answer
//! only when the admin listener is on a loopback address or the request carries the configured bearer token, since
//! the listener is often opened to Prometheus on a pod address. It is never behind admission: an overloaded upstream cannot make
//! its own metrics unreachable. The stats page is one static file that polls `/status`; rates and recent
//! quantiles are worked out in the browser from the difference between two polls, so the proxy keeps no
//! per-viewer state.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::WaitHistogram;
use crate::pool::{PoolSnapshot, UpstreamPool};
use crate::reload::ReloadError;
use crate::state::State;

/// Self-contained (inline CSS and JS): the admin listener may be reachable where nothing else is.
const STATS_PAGE: &str = include_str!("admin/stats.html");

/// The page loads nothing but itself and `/status`; the policy makes that a rule the browser enforces.
const STATS_PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                                 connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

#[derive(serde::Serialize)]
struct Status {
    ready: bool,
    version: &'static str,
    /// Uptime, the configuration's age and the last reload's result.
    #[serde(flatten)]
    lifetime: crate::metrics::Lifetime,
    /// The allocator's settings as the running process has them.
    allocator: crate::allocator::Settings,
    client_connections: i64,
    upstreams: BTreeMap<String, UpstreamStatus>,
    /// Pools a reload removed or replaced that are still finishing requests, by their upstream's name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    draining: Vec<DrainingStatus>,
}

#[derive(serde::Serialize)]
struct DrainingStatus {
    name: String,
    #[serde(flatten)]
    status: UpstreamStatus,
}

#[derive(serde::Serialize)]
struct UpstreamStatus {
    #[serde(flatten)]
    pool: PoolSnapshot,
    /// Requests that ended, by the outcome names of `/metrics`; an outcome appears once it has happened.
    outcomes: BTreeMap<&'static str, u64>,
    queue_wait_seconds: WaitHistogram,
    /// From a request's dispatch to its answer's head, as `floodgate_upstream_response_seconds`.
    upstream_response_seconds: WaitHistogram,
    /// The most a request waits in the queue: a reader's percentile of the waits is never past it.
    queue_timeout_seconds: f64,
}

impl UpstreamStatus {
    fn of(pool: &UpstreamPool) -> Self {
        UpstreamStatus {
            pool: pool.snapshot(),
            outcomes: pool
                .metrics
                .requests
                .totals()
                .map(|(outcome, total)| (outcome.as_str(), total))
                .collect(),
            queue_wait_seconds: pool.metrics.queue_wait(),
            upstream_response_seconds: pool.metrics.response_times(),
            queue_timeout_seconds: pool.limits().queue_timeout.as_secs_f64(),
        }
    }
}

/// Scrapers and probes need few connections; a cap keeps a flood of them from using up file descriptors the
/// proxy needs.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// A probe or a scrape sends its request as soon as it has connected: a connection that has not sent a whole
/// request head this long after connecting, or after its last answer, is closed.
const ADMIN_HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// The admin connections open, oldest first, so that a full house makes room for a new connection by closing the
/// oldest one that is not being answered: connections that merely sit there cannot keep probes out.
#[derive(Default)]
struct AdminConnections {
    open: std::sync::Mutex<std::collections::VecDeque<AdminConnection>>,
    next_id: std::sync::atomic::AtomicU64,
}

struct AdminConnection {
    id: u64,
    /// A request is being answered on it.
    busy: Arc<std::sync::atomic::AtomicBool>,
    close: Arc<tokio::sync::Notify>,
}

impl AdminConnections {
    /// Room for one more, by closing the oldest idle connection if need be; `None` when every one is busy.
    fn admit(&self) -> Option<AdminConnection> {
        let mut open = self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if open.len() >= MAX_ADMIN_CONNECTIONS {
            let oldest_idle = open.iter().position(|conn| !conn.busy.load(Ordering::Acquire))?;
            if let Some(evicted) = open.remove(oldest_idle) {
                evicted.close.notify_one();
            }
        }
        let conn = AdminConnection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            busy: Arc::default(),
            close: Arc::default(),
        };
        open.push_back(AdminConnection {
            id: conn.id,
            busy: conn.busy.clone(),
            close: conn.close.clone(),
        });
        Some(conn)
    }

    fn closed(&self, id: u64) {
        let mut open = self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        open.retain(|conn| conn.id != id);
    }
}

pub(crate) async fn serve(listener: TcpListener, state: Arc<State>, stop: CancellationToken) {
    let connections = Arc::new(AdminConnections::default());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.cancelled() => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let Some(conn) = connections.admit() else {
            continue;
        };
        let state = state.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let busy = conn.busy.clone();
            let service = service_fn(move |request| {
                let state = state.clone();
                let busy = busy.clone();
                async move {
                    busy.store(true, Ordering::Release);
                    let answer = answer(&state, request).await;
                    busy.store(false, Ordering::Release);
                    Ok::<_, Infallible>(answer)
                }
            });
            let serving = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(ADMIN_HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = serving => {}
                () = conn.close.notified() => {}
            }
            connections.closed(conn.id);
        });
    }
}

/// A write request's body is a number or nothing.
const MAX_WRITE_BODY: usize = 64;

async fn answer(state: &State, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_string();
    let path = path.as_str();
    if let Some(write) = Write::of(request.method(), path) {
        if let Err(refused) = trusted(state, request.headers(), "writes") {
            return refused;
        }
        return match write {
            Write::Reload => reload(state).await,
            Write::MaxConnections(name) => set_max_connections(state, name, request).await,
            Write::EndpointState(name, address) => set_endpoint_state(state, name, address, request).await,
        };
    }
    if is_write_path(path) {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST /reload; PUT /upstreams/NAME/max_connections; PUT /upstreams/NAME/endpoints/HOST:PORT/state\n",
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET, apart from the write endpoints\n",
        );
    }
    match path {
        "/" => stats_page(),
        // The configuration in force (the last reload's), secrets redacted: as trusted as a write, since it names
        // every upstream, file and peer.
        "/config" => match trusted(state, request.headers(), "/config") {
            Err(refused) => refused,
            Ok(()) => match shown_config(&state.config.load()) {
                Some(body) => {
                    let mut response = owned_text(StatusCode::OK, body);
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/toml"));
                    response
                }
                None => text(StatusCode::INTERNAL_SERVER_ERROR, "configuration unavailable\n"),
            },
        },
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if state.ready.load(Ordering::SeqCst) => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n"),
        "/metrics" => {
            refresh_gauges(state);
            // OpenMetrics to a scraper that asks for it (Prometheus does), the classic text format to any other.
            let openmetrics = prefers_openmetrics(request.headers());
            let metrics = &state.proxy.metrics;
            let (body, content_type) = if openmetrics {
                (
                    metrics.encode(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            } else {
                (
                    metrics.encode_prometheus_text(),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            response
        }
        "/status" => {
            let status = Status {
                ready: state.ready.load(Ordering::SeqCst),
                version: env!("CARGO_PKG_VERSION"),
                lifetime: state.proxy.metrics.lifetime(),
                allocator: crate::allocator::settings(),
                client_connections: state.proxy.metrics.client_connections.get(),
                upstreams: state
                    .proxy
                    .router()
                    .pools()
                    .iter()
                    .map(|(name, pool)| (name.clone(), UpstreamStatus::of(pool)))
                    .collect(),
                draining: state
                    .proxy
                    .draining()
                    .iter()
                    .map(|pool| DrainingStatus {
                        name: pool.name.to_string(),
                        status: UpstreamStatus::of(pool),
                    })
                    .collect(),
            };
            match serde_json::to_vec_pretty(&status) {
                Ok(body) => {
                    let mut response = Response::new(Full::new(Bytes::from(body)));
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                    response
                }
                Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "status unavailable\n"),
            }
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "try /, /metrics, /status, /config, /healthz or /readyz\n",
        ),
    }
}

/// What `/config` shows: the configuration as `floodgate check` prints it (every `Secret` redacted), and without
/// what plain configuration may hold that is a credential all the same: the header values routes set (an
/// upstream's `Authorization`), `fair_weights`' keys (clients' API keys, with `fair_key = "header:X-Api-Key"`;
/// numbered instead) and an `otlp_endpoint`'s user information.
fn shown_config(config: &crate::config::Config) -> Option<String> {
    let mut table = toml::Table::try_from(config).ok()?;
    redact_credentials(&mut table);
    toml::to_string(&table).ok()
}

fn redact_credentials(table: &mut toml::Table) {
    let redacted = || toml::Value::String(crate::config::REDACTED.to_string());
    for (key, value) in table.iter_mut() {
        match (key.as_str(), value) {
            ("set_request_headers" | "set_response_headers", toml::Value::Table(headers)) => {
                headers.iter_mut().for_each(|(_, value)| *value = redacted());
            }
            ("fair_weights", toml::Value::Table(weights)) => {
                let numbered = std::mem::take(weights)
                    .into_iter()
                    .enumerate()
                    .map(|(n, (_, weight))| (format!("{} {}", crate::config::REDACTED, n + 1), weight));
                weights.extend(numbered);
            }
            ("otlp_endpoint", toml::Value::String(url)) => {
                if let Some((scheme, rest)) = url.split_once("://") {
                    let authority_end = rest.find('/').unwrap_or(rest.len());
                    if let Some(at) = rest.get(..authority_end).and_then(|authority| authority.rfind('@')) {
                        let host = rest.get(at + 1..).unwrap_or_default();
                        *url = format!("{scheme}://{}@{host}", crate::config::REDACTED);
                    }
                }
            }
            (_, toml::Value::Table(inner)) => redact_credentials(inner),
            (_, toml::Value::Array(items)) => items.iter_mut().for_each(|item| {
                if let toml::Value::Table(inner) = item {
                    redact_credentials(inner);
                }
            }),
            _ => {}
        }
    }
}

/// The endpoints that change something.
enum Write<'a> {
    Reload,
    MaxConnections(&'a str),
    /// An upstream's name and one of its endpoints' address.
    EndpointState(&'a str, &'a str),
}

impl<'a> Write<'a> {
    fn of(method: &Method, path: &'a str) -> Option<Write<'a>> {
        match (method, path) {
            (&Method::POST, "/reload") => Some(Write::Reload),
            (&Method::PUT, path) => upstream_of(path)
                .map(Write::MaxConnections)
                .or_else(|| endpoint_of(path).map(|(name, address)| Write::EndpointState(name, address))),
            _ => None,
        }
    }
}

fn upstream_of(path: &str) -> Option<&str> {
    path.strip_prefix("/upstreams/")?
        .strip_suffix("/max_connections")
        .filter(|name| !name.is_empty() && !name.contains('/'))
}

/// `/upstreams/NAME/endpoints/HOST:PORT/state`: the upstream's name and the endpoint's address.
fn endpoint_of(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/upstreams/")?.strip_suffix("/state")?;
    let (name, address) = rest.split_once("/endpoints/")?;
    (!name.is_empty() && !name.contains('/') && !address.is_empty() && !address.contains('/'))
        .then_some((name, address))
}

fn is_write_path(path: &str) -> bool {
    path == "/reload" || upstream_of(path).is_some() || endpoint_of(path).is_some()
}

/// Loopback listeners are trusted; elsewhere only `Authorization: Bearer <admin_token>` is. `what` names what is
/// refused without one.
#[allow(clippy::result_large_err)]
fn trusted(state: &State, headers: &http::HeaderMap, what: &str) -> Result<(), Response<Full<Bytes>>> {
    let config = state.config.load();
    if config.admin.ip().is_loopback() {
        return Ok(());
    }
    let Some(token) = &config.admin_token else {
        return Err(owned_text(
            StatusCode::FORBIDDEN,
            format!("{what} refused: the admin listener is not on loopback and no admin_token is set\n"),
        ));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        // The scheme is case-insensitive (RFC 9110 §11.1).
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let valid = presented.is_some_and(|presented| {
        use subtle::ConstantTimeEq;
        bool::from(presented.as_bytes().ct_eq(token.expose().as_bytes()))
    });
    if valid {
        return Ok(());
    }
    let mut refused = text(
        StatusCode::UNAUTHORIZED,
        "a valid Authorization: Bearer token is required\n",
    );
    refused
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Err(refused)
}

async fn reload(state: &State) -> Response<Full<Bytes>> {
    match crate::reload::reload(state).await {
        Ok(reloaded) => {
            let mut body = String::from("reloaded\n");
            for change in &reloaded.changed {
                body.push_str(&format!("changed {change}\n"));
            }
            for key in &reloaded.needs_restart {
                body.push_str(&format!("needs restart {key} (the running value stays)\n"));
            }
            owned_text(StatusCode::OK, body)
        }
        Err(ReloadError::Invalid(errors)) => {
            let mut body = String::from("refused; the running configuration stays\n");
            for problem in errors.problems() {
                body.push_str(&format!("{problem}\n"));
            }
            owned_text(StatusCode::UNPROCESSABLE_ENTITY, body)
        }
        Err(err @ ReloadError::NoSource) => owned_text(StatusCode::CONFLICT, format!("{err}\n")),
    }
}

/// HAProxy's `set maxconn server`: the new cap holds until the next reload puts the configured one back.
async fn set_max_connections(state: &State, name: &str, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let Some(pool) = state.proxy.router().pools().get(name).cloned() else {
        return owned_text(StatusCode::NOT_FOUND, format!("no upstream named `{name}`\n"));
    };
    let body = match Limited::new(request.into_body(), MAX_WRITE_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return text(StatusCode::BAD_REQUEST, "the body must be a number of connections\n"),
    };
    let parsed = std::str::from_utf8(&body)
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok())
        .filter(|&cap| (1..=crate::config::LARGEST_RUNTIME_COUNT).contains(&cap));
    let Some(cap) = parsed else {
        return text(
            StatusCode::BAD_REQUEST,
            "the body must be a whole number of connections, at least 1 (and at most 2^63 - 1)\n",
        );
    };
    let was = pool.snapshot().max_connections;
    pool.set_max_connections(cap);
    tracing::info!(upstream = %name, from = was, to = cap, "max_connections changed through the admin API");
    owned_text(
        StatusCode::OK,
        format!("upstreams.{name}.max_connections: {was} -> {cap} (until the next reload)\n"),
    )
}

/// HAProxy's `set server state`: `drain`, `maint` or `ready` for one endpoint, until a reload that replaces the
/// pool (one that keeps the endpoint list keeps it).
async fn set_endpoint_state(
    state: &State,
    name: &str,
    address: &str,
    request: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let Some(pool) = state.proxy.router().pools().get(name).cloned() else {
        return owned_text(StatusCode::NOT_FOUND, format!("no upstream named `{name}`\n"));
    };
    let body = match Limited::new(request.into_body(), MAX_WRITE_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return text(StatusCode::BAD_REQUEST, "the body must be ready, drain or maint\n"),
    };
    let Some(wanted) = std::str::from_utf8(&body)
        .ok()
        .and_then(crate::pool::EndpointAdmin::parse)
    else {
        return text(StatusCode::BAD_REQUEST, "the body must be ready, drain or maint\n");
    };
    match pool.set_endpoint_state(address, wanted) {
        Some(was) => owned_text(
            StatusCode::OK,
            format!(
                "upstreams.{name} endpoint {address}: {} -> {}\n",
                was.as_str(),
                wanted.as_str()
            ),
        ),
        None => owned_text(
            StatusCode::NOT_FOUND,
            format!("upstream `{name}` has no endpoint `{address}` (host:port, as in /status)\n"),
        ),
    }
}

fn stats_page() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(STATS_PAGE.as_bytes())));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(STATS_PAGE_POLICY),
    );
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // A new binary may bring a new page; the browser should not keep an old one.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn refresh_gauges(state: &State) {
    let router = state.proxy.router();
    // A draining pool shares its series with a new pool of the same name; the new one is what they show, so it
    // is refreshed last.
    for pool in state.proxy.draining() {
        if !router.pools().contains_key(pool.name.as_ref()) {
            pool.metrics.refresh(&pool.snapshot());
        }
    }
    for pool in router.pools().values() {
        pool.metrics.refresh(&pool.snapshot());
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    with_text(status, Bytes::from_static(body.as_bytes()))
}

fn owned_text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    with_text(status, Bytes::from(body))
}

fn with_text(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Whether an `Accept` field asks for OpenMetrics: named with a weight above 0 and no lower than `text/plain`'s
/// (`q=0` refuses it, RFC 9110 §12.4.2; a wildcard counts for neither).
fn prefers_openmetrics(headers: &http::HeaderMap) -> bool {
    let (mut openmetrics, mut plain) = (0.0_f32, 0.0_f32);
    for value in headers.get_all(header::ACCEPT) {
        let Ok(value) = value.to_str() else { continue };
        for range in value.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let weight = parts
                .map(str::trim)
                .find_map(|param| param.strip_prefix("q=").or_else(|| param.strip_prefix("Q=")))
                .map_or(Some(1.0), |q| q.trim().parse::<f32>().ok())
                .filter(|q| q.is_finite())
                .unwrap_or(0.0)
                .clamp(0.0, 1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(weight),
                "text/plain" => plain = plain.max(weight),
                _ => {}
            }
        }
    }
    openmetrics > 0.0 && openmetrics >= plain
}

#[cfg(test)]
mod tests {
    use super::redact_credentials;

    #[test]
    fn header_values_fair_keys_and_url_user_information_are_redacted_wherever_they_are() {
        let mut table: toml::Table = toml::from_str(
            r#"
otlp_endpoint = "https://user:pass@collector:4318/v1/traces"
[upstreams.a]
fair_weights = { "key-1" = 3, "key-2" = 5 }
[[routes]]
set_request_headers = { authorization = "Bearer x" }
set_response_headers = { "x-served-by" = "node-7" }
"#,
        )
        .unwrap();
        redact_credentials(&mut table);
        let text = toml::to_string(&table).unwrap();
        for gone in ["user:pass", "key-1", "key-2", "Bearer x", "node-7"] {
            assert!(!text.contains(gone), "{gone} in {text}");
        }
        assert!(text.contains("https://<redacted>@collector:4318/v1/traces"), "{text}");
        assert!(text.contains("authorization = \"<redacted>\""), "{text}");
    }
}
