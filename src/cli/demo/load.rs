//! The demo's load driver: `--clients` keep-alive clients released together, each sending `--requests` requests,
//! with their latencies and outcomes.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http::header::{CONNECTION, HOST, USER_AGENT};
use http::{Request, StatusCode};
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::Barrier;

use super::{PhaseReport, UpstreamStats};

#[derive(Debug, Default)]
pub(super) struct LoadResult {
    pub(super) ok: usize,
    pub(super) shed: usize,
    pub(super) errors: usize,
    pub(super) latencies: Vec<Duration>,
    pub(super) first_error: Option<String>,
    pub(super) wall_time: Duration,
}

impl LoadResult {
    pub(super) fn error(&mut self, message: impl Into<String>) {
        self.errors = self.errors.saturating_add(1);
        if self.first_error.is_none() {
            self.first_error = Some(message.into());
        }
    }

    pub(super) fn merge(&mut self, other: LoadResult) {
        self.ok = self.ok.saturating_add(other.ok);
        self.shed = self.shed.saturating_add(other.shed);
        self.errors = self.errors.saturating_add(other.errors);
        self.latencies.extend(other.latencies);
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    pub(super) fn into_report(mut self, upstream: UpstreamStats) -> PhaseReport {
        self.latencies.sort_unstable();
        PhaseReport {
            peak_upstream_connections: upstream.peak_connections,
            upstream_connections_accepted: upstream.connections_accepted,
            peak_upstream_threads: upstream.peak_threads,
            upstream_requests_served: upstream.requests_served,
            ok: self.ok,
            shed: self.shed,
            errors: self.errors,
            latency_p50: percentile(&self.latencies, 50),
            latency_p99: percentile(&self.latencies, 99),
            wall_time: self.wall_time,
            first_error: self.first_error,
        }
    }
}

/// Nearest-rank percentile of an ascending slice; `None` when it is empty.
pub(super) fn percentile(sorted: &[Duration], percent: usize) -> Option<Duration> {
    let rank = percent.min(100).saturating_mul(sorted.len()).div_ceil(100).max(1);
    sorted.get(rank.saturating_sub(1)).copied()
}

/// Lines the clients up so the burst starts at one instant, after the server
/// has really taken every connection.
pub(super) struct StartGate {
    pub(super) connected: AtomicUsize,
    pub(super) arrived: Barrier,
    pub(super) go: Barrier,
}

/// Bursts `clients` keep-alive clients at `addr`. `settle` runs once every
/// client is connected (it gets how many succeeded) and before the burst.
pub(super) async fn drive_load<S, F>(
    addr: SocketAddr,
    clients: usize,
    requests: usize,
    budget: Duration,
    settle: S,
) -> LoadResult
where
    S: FnOnce(usize) -> F,
    F: Future<Output = ()>,
{
    // The driver waits at both barriers too, so the clock starts exactly when
    // the burst does.
    let gate = Arc::new(StartGate {
        connected: AtomicUsize::new(0),
        arrived: Barrier::new(clients.saturating_add(1)),
        go: Barrier::new(clients.saturating_add(1)),
    });
    let connecting = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(run_client(addr, requests, Arc::clone(&gate), budget)))
        .collect();

    gate.arrived.wait().await;
    settle(gate.connected.load(Ordering::SeqCst)).await;
    gate.go.wait().await;
    let started = Instant::now();
    tracing::debug!(%addr, clients, took = ?connecting.elapsed(), "clients connected; burst starts");

    let mut total = LoadResult::default();
    for task in tasks {
        match task.await {
            Ok(result) => total.merge(result),
            Err(e) => {
                for _ in 0..requests {
                    total.error(format!("client task failed: {e}"));
                }
            }
        }
    }
    total.wall_time = started.elapsed();
    total
}

pub(super) async fn run_client(
    addr: SocketAddr,
    requests: usize,
    gate: Arc<StartGate>,
    budget: Duration,
) -> LoadResult {
    let mut result = LoadResult::default();
    // Connect before the gate so the burst is of requests, not handshakes;
    // a failed connect is retried (and counted) per request below.
    let mut sender = connect(addr, budget).await.ok();
    if sender.is_some() {
        gate.connected.fetch_add(1, Ordering::SeqCst);
    }
    gate.arrived.wait().await;
    gate.go.wait().await;

    let host = addr.to_string();
    for _ in 0..requests {
        let started = Instant::now();
        let outcome = tokio::time::timeout(budget, async {
            // The server may have closed an idle keep-alive connection; that
            // is legitimate, so reconnect rather than count an error.
            let reusable = match sender.take() {
                Some(mut s) => s.ready().await.is_ok().then_some(s),
                None => None,
            };
            let mut current = match reusable {
                Some(s) => s,
                None => connect(addr, budget).await?,
            };
            let (status, keep) = send_one(&mut current, &host).await?;
            if keep {
                sender = Some(current);
            }
            anyhow::Ok(status)
        })
        .await;

        match outcome {
            Ok(Ok(status)) if status.is_success() => {
                result.ok = result.ok.saturating_add(1);
                result.latencies.push(started.elapsed());
            }
            Ok(Ok(StatusCode::SERVICE_UNAVAILABLE)) => {
                result.shed = result.shed.saturating_add(1);
            }
            Ok(Ok(status)) => result.error(format!("unexpected status {status}")),
            Ok(Err(e)) => result.error(format!("{e:#}")),
            Err(_) => result.error(format!("no response within {budget:?}")),
        }
    }
    result
}

pub(super) async fn connect(addr: SocketAddr, budget: Duration) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
    let stream = tokio::time::timeout(budget, tokio::net::TcpStream::connect(addr))
        .await
        .with_context(|| format!("connect to {addr} timed out"))?
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP/1.1 handshake")?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "demo client connection ended");
        }
    });
    Ok(sender)
}

/// Sends one GET and reads the whole body; returns the status and whether
/// the connection may be reused.
pub(super) async fn send_one(sender: &mut SendRequest<Empty<Bytes>>, host: &str) -> anyhow::Result<(StatusCode, bool)> {
    let request = Request::get("/demo")
        .header(HOST, host)
        .header(USER_AGENT, "floodgate-demo")
        .body(Empty::<Bytes>::new())?;
    let response = sender.send_request(request).await.context("request")?;
    let status = response.status();
    let close = response
        .headers()
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("close"));
    response.into_body().collect().await.context("reading response body")?;
    Ok((status, !close))
}
