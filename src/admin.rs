//! The admin listener: `/metrics`, `/status`, `/healthz`, `/readyz`.
//!
//! Owns the read-only views of the proxy's state. It is never behind admission: an overloaded upstream cannot
//! make its own metrics unreachable. It changes nothing.

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

use crate::pool::PoolSnapshot;
use crate::server::State;

#[derive(serde::Serialize)]
struct Status {
    ready: bool,
    client_connections: i64,
    upstreams: BTreeMap<String, PoolSnapshot>,
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
                    .map(|(name, pool)| (name.clone(), pool.snapshot()))
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
        _ => text(StatusCode::NOT_FOUND, "try /metrics, /status, /healthz or /readyz\n"),
    }
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
