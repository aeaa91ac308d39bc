//! The admin listener: the stats page at `/`, `/metrics`, `/status`, `/healthz`, `/readyz`.
//!
//! Owns the read-only views of the proxy's state. It is never behind admission: an overloaded upstream cannot
//! make its own metrics unreachable. It changes nothing. The stats page is one static file that polls
//! `/status`; rates and recent quantiles are worked out in the browser from the difference between two polls,
//! so the proxy keeps no per-viewer state.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::WaitHistogram;
use crate::pool::{PoolSnapshot, UpstreamPool};
use crate::server::State;

/// Self-contained (inline CSS and JS): the admin listener may be reachable where nothing else is.
const STATS_PAGE: &str = include_str!("admin/stats.html");

/// The page loads nothing but itself and `/status`; the policy makes that a rule the browser enforces.
const STATS_PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                                 connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

#[derive(serde::Serialize)]
struct Status {
    ready: bool,
    client_connections: i64,
    upstreams: BTreeMap<String, UpstreamStatus>,
}

#[derive(serde::Serialize)]
struct UpstreamStatus {
    #[serde(flatten)]
    pool: PoolSnapshot,
    /// Requests that ended, by the outcome names of `/metrics`; an outcome appears once it has happened.
    outcomes: BTreeMap<&'static str, u64>,
    queue_wait_seconds: WaitHistogram,
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
        }
    }
}

/// Scrapers and probes need few connections; a cap keeps a flood of them from using up file descriptors the
/// proxy needs.
const MAX_ADMIN_CONNECTIONS: usize = 64;

pub async fn serve(listener: TcpListener, state: Arc<State>, stop: CancellationToken) {
    let room = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.cancelled() => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        };
        let Ok(permit) = room.clone().try_acquire_owned() else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(answer(&state, &request)) }
            });
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(state: &State, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match request.uri().path() {
        "/" => stats_page(),
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if state.ready.load(Ordering::SeqCst) => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n"),
        "/metrics" => {
            refresh_gauges(state);
            let mut response = Response::new(Full::new(Bytes::from(state.proxy.metrics.encode())));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            response
        }
        "/status" => {
            let status = Status {
                ready: state.ready.load(Ordering::SeqCst),
                client_connections: state.proxy.metrics.client_connections.get(),
                upstreams: state
                    .proxy
                    .pools
                    .iter()
                    .map(|(name, pool)| (name.clone(), UpstreamStatus::of(pool)))
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
        _ => text(StatusCode::NOT_FOUND, "try /, /metrics, /status, /healthz or /readyz\n"),
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
    for pool in state.proxy.pools.values() {
        pool.metrics.refresh(&pool.snapshot());
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
