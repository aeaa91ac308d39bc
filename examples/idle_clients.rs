//! Idle clients for the end-to-end benchmark (`benches/e2e/run.sh`, scenario `idle`).
//!
//! Opens `--connections` HTTP/1.1 connections to `--addr`, with at most `--parallel` of them being set up at once
//! (a burst of thousands of SYNs would overflow the listen backlog and measure SYN retries instead), sends one
//! `GET` on each, reads the whole response, and then keeps every connection open and idle. When each one has been
//! answered or has failed, it prints one JSON line with `"ready":true`: the counts, the status codes, and the
//! latency of connect + request + response in microseconds. Then it waits for SIGTERM or SIGINT and prints a last
//! line with `"final":true` and how many of the connections the server closed in the meantime.
//!
//! ```sh
//! cargo run --release --example idle_clients -- --addr 127.0.0.1:8080 --connections 8000
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::{header, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, Semaphore};
use tokio::time::timeout;

#[derive(Parser, Debug)]
#[command(about = "Connections that make one request each and then stay open, idle (benches/e2e, scenario idle)")]
struct Args {
    /// The server to connect to.
    #[arg(long)]
    addr: SocketAddr,
    /// Connections to open.
    #[arg(long, default_value_t = 8000)]
    connections: usize,
    /// Connections being set up (connect, request, response) at once.
    #[arg(long, default_value_t = 64)]
    parallel: usize,
    /// Request target of the one request on each connection.
    #[arg(long, default_value = "/")]
    path: Uri,
    /// Limit for the connect, and again for the request and its response, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Pads the one request's head with an `x-pad` header of this many bytes (a client that once sent a large head).
    #[arg(long, default_value_t = 0)]
    pad_bytes: usize,
    /// HTTP/2 with prior knowledge (h2c) instead of HTTP/1.1: one stream on each connection, then idle.
    #[arg(long)]
    h2: bool,
}

enum Outcome {
    Answered { status: u16, latency: Duration },
    ConnectFailed(String),
    RequestFailed(String),
    TimedOut,
}

/// What keeps a connection open: hyper closes one whose sender is gone.
enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<Empty<Bytes>>),
    Http2(hyper::client::conn::http2::SendRequest<Empty<Bytes>>),
}

impl Sender {
    async fn send(&mut self, request: Request<Empty<Bytes>>) -> hyper::Result<hyper::Response<hyper::body::Incoming>> {
        match self {
            Sender::Http1(sender) => sender.send_request(request).await,
            Sender::Http2(sender) => sender.send_request(request).await,
        }
    }
}

/// Connects and makes the one request; on success hands back what keeps the connection open.
async fn open_one(
    addr: SocketAddr,
    path: Uri,
    pad: Option<hyper::header::HeaderValue>,
    limit: Duration,
    h2: bool,
) -> Result<(Outcome, Sender, tokio::task::JoinHandle<()>), Outcome> {
    let started = Instant::now();
    let stream = match timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(Outcome::ConnectFailed(e.to_string())),
        Err(_) => return Err(Outcome::ConnectFailed("connect timed out".into())),
    };
    let _ = stream.set_nodelay(true);
    let mut request = Request::get(path);
    if !h2 {
        request = request.header(header::HOST, addr.to_string());
    } else {
        request = request.uri(
            format!("http://{addr}/")
                .parse::<Uri>()
                .map_err(|e| Outcome::RequestFailed(e.to_string()))?,
        );
    }
    if let Some(pad) = pad {
        request = request.header("x-pad", pad);
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|e| Outcome::RequestFailed(e.to_string()))?;
    // An HTTP/1 handshake does no I/O; it only ties the sender to the connection task. The connection task ends
    // when the server closes the connection: that is how a close is seen later.
    let (mut sender, conn) = if h2 {
        let (sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|e| Outcome::RequestFailed(e.to_string()))?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        (Sender::Http2(sender), conn)
    } else {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Outcome::RequestFailed(e.to_string()))?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        (Sender::Http1(sender), conn)
    };
    let exchange = async {
        let response = sender.send(request).await?;
        let status = response.status().as_u16();
        response.into_body().collect().await?;
        Ok::<_, hyper::Error>(status)
    };
    match timeout(limit, exchange).await {
        Ok(Ok(status)) => {
            let latency = started.elapsed();
            Ok((Outcome::Answered { status, latency }, sender, conn))
        }
        Ok(Err(e)) => {
            conn.abort();
            Err(Outcome::RequestFailed(e.to_string()))
        }
        Err(_) => {
            conn.abort();
            Err(Outcome::TimedOut)
        }
    }
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

async fn run(args: Args) -> anyhow::Result<()> {
    let limit = Duration::from_millis(args.timeout_ms);
    let gate = Arc::new(Semaphore::new(args.parallel.max(1)));
    let closed_by_peer = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let started = Instant::now();

    let spawner = {
        let gate = gate.clone();
        let closed_by_peer = closed_by_peer.clone();
        let path = args.path.clone();
        let pad = (args.pad_bytes > 0)
            .then(|| hyper::header::HeaderValue::from_str(&"a".repeat(args.pad_bytes)))
            .transpose()?;
        tokio::spawn(async move {
            for _ in 0..args.connections {
                let Ok(permit) = gate.clone().acquire_owned().await else {
                    return;
                };
                let tx = tx.clone();
                let closed_by_peer = closed_by_peer.clone();
                let path = path.clone();
                let pad = pad.clone();
                tokio::spawn(async move {
                    let result = open_one(args.addr, path, pad, limit, args.h2).await;
                    drop(permit);
                    match result {
                        Ok((outcome, sender, conn)) => {
                            let _ = tx.send(outcome);
                            drop(tx);
                            // Holding the sender keeps hyper from closing the idle connection itself.
                            let _sender = sender;
                            let _ = conn.await;
                            closed_by_peer.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(outcome) => {
                            let _ = tx.send(outcome);
                        }
                    }
                });
            }
        })
    };

    let mut codes: BTreeMap<String, u64> = BTreeMap::new();
    let mut latencies = Vec::with_capacity(args.connections);
    let (mut err_connect, mut err_read, mut err_timeout) = (0u64, 0u64, 0u64);
    let mut first_error: Option<String> = None;
    while let Some(outcome) = rx.recv().await {
        match outcome {
            Outcome::Answered { status, latency } => {
                *codes.entry(status.to_string()).or_default() += 1;
                latencies.push(latency.as_micros() as u64);
            }
            Outcome::ConnectFailed(e) => {
                err_connect += 1;
                first_error.get_or_insert(format!("connect: {e}"));
            }
            Outcome::RequestFailed(e) => {
                err_read += 1;
                first_error.get_or_insert(format!("request: {e}"));
            }
            Outcome::TimedOut => err_timeout += 1,
        }
    }
    // Every task has sent its outcome and dropped its channel end: the set-up is over.
    let _ = spawner.await;
    let setup = started.elapsed();
    if let Some(e) = &first_error {
        eprintln!("idle_clients: first error: {e}");
    }
    latencies.sort_unstable();
    // Handled from here on only: a TERM during the set-up keeps its default action and ends the program at once.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let completed = latencies.len() as u64;
    println!(
        "{}",
        serde_json::json!({
            "ready": true,
            "connections": args.connections,
            "connected": completed + err_read + err_timeout,
            "completed": completed,
            "failed": err_connect + err_read + err_timeout,
            "codes": codes,
            "err_connect": err_connect,
            "err_read": err_read,
            "err_write": 0,
            "err_timeout": err_timeout,
            "closed_by_peer": closed_by_peer.load(Ordering::SeqCst),
            "duration_us": setup.as_micros() as u64,
            "p50_us": percentile(&latencies, 50.0),
            "p99_us": percentile(&latencies, 99.0),
            "p999_us": percentile(&latencies, 99.9),
            "max_us": latencies.last().copied().unwrap_or(0),
        })
    );

    let ready_at = Instant::now();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let closed = closed_by_peer.load(Ordering::SeqCst);
    println!(
        "{}",
        serde_json::json!({
            "final": true,
            "closed_by_peer": closed,
            "open": completed.saturating_sub(closed),
            "idle_ms": ready_at.elapsed().as_millis() as u64,
        })
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // One thread is plenty for idle sockets and keeps the load generator's own CPU use small and steady.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(run(args))
}
