//! A counting HTTP/1.1 upstream for the end-to-end benchmark (`benches/e2e/run.sh`).
//!
//! Answers every request with `200 ok` after a fixed service time (`--delay-ms`), and counts, exactly, what a
//! proxy in front of it does to it: connections open now and at their peak, requests in flight now and at their
//! peak, connections accepted and requests served. The counts are the upstream's own view, the invariant the
//! benchmark reports next to the load generator's numbers.
//!
//! The counts are served on a separate control listener, so reading them never shows up in them:
//! `GET /stats` gives them as one JSON object; `POST /reset` (or `GET /reset`) starts a new window — peaks drop to
//! the current values, the accepted and served totals to zero — and gives the counts as they were before.
//! On SIGTERM or SIGINT the last counts are printed to stdout as one JSON line.
//!
//! ```sh
//! cargo run --release --example bench_upstream -- --delay-ms 2
//! # bench_upstream ready listen=127.0.0.1:41234 control=127.0.0.1:41235
//! ```
//!
//! Exact counting: a connection counts from accept until hyper has finished with it (the client closed, or the
//! socket failed); a request counts from the moment its handler starts until it returns the response, so the
//! service time is inside and the write of the response is not. Each peak is the maximum over every value its
//! counter took (`fetch_add` returns each one exactly once), not a sample.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser, Debug)]
#[command(about = "A counting HTTP/1.1 upstream for benches/e2e/run.sh")]
struct Args {
    /// Address to serve requests on (port 0: any free port; the ready line names it).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address of the control listener (/stats, /reset).
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
    /// Fixed service time of every request, in milliseconds (0: answer at once).
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// A gauge that remembers its highest value since the last reset.
#[derive(Default)]
struct PeakGauge {
    now: AtomicU64,
    peak: AtomicU64,
}

impl PeakGauge {
    fn up(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn down(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    /// Starts a new window: the peak becomes the current value. Returns the old peak.
    fn reset(&self) -> u64 {
        let old = self.peak.swap(self.now.load(Ordering::SeqCst), Ordering::SeqCst);
        // An `up` between the two loads above may have raised `now`; keep the peak at least there.
        self.peak.fetch_max(self.now.load(Ordering::SeqCst), Ordering::SeqCst);
        old
    }
}

#[derive(Default)]
struct Counters {
    conns: PeakGauge,
    inflight: PeakGauge,
    accepted: AtomicU64,
    served: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> serde_json::Value {
        serde_json::json!({
            "conns": self.conns.now.load(Ordering::SeqCst),
            "peak_conns": self.conns.peak.load(Ordering::SeqCst),
            "inflight": self.inflight.now.load(Ordering::SeqCst),
            "peak_inflight": self.inflight.peak.load(Ordering::SeqCst),
            "accepted": self.accepted.load(Ordering::SeqCst),
            "served": self.served.load(Ordering::SeqCst),
        })
    }

    fn reset(&self) -> serde_json::Value {
        let before = self.snapshot();
        self.conns.reset();
        self.inflight.reset();
        self.accepted.store(0, Ordering::SeqCst);
        self.served.store(0, Ordering::SeqCst);
        before
    }
}

/// Counts one open connection for as long as it lives.
struct ConnGuard(Arc<Counters>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.conns.down();
    }
}

/// Counts one request in flight until its handler returns.
struct InflightGuard<'a>(&'a Counters);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.inflight.down();
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}

async fn serve(counters: Arc<Counters>, delay: Duration) -> Response<Full<Bytes>> {
    counters.inflight.up();
    let _inflight = InflightGuard(&counters);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    counters.served.fetch_add(1, Ordering::SeqCst);
    text(StatusCode::OK, "ok\n")
}

fn control(counters: &Counters, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/stats") => text(StatusCode::OK, format!("{}\n", counters.snapshot())),
        (&Method::GET | &Method::POST, "/reset") => text(StatusCode::OK, format!("{}\n", counters.reset())),
        _ => text(StatusCode::NOT_FOUND, "GET /stats or POST /reset\n"),
    }
}

async fn serve_data_connection(stream: TcpStream, counters: Arc<Counters>, delay: Duration) {
    let _conn = ConnGuard(counters.clone());
    let svc = service_fn(move |_req: Request<hyper::body::Incoming>| {
        let counters = counters.clone();
        async move { Ok::<_, Infallible>(serve(counters, delay).await) }
    });
    // Errors here are the client's doing (reset, garbage); the connection is over either way.
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

async fn serve_control_connection(stream: TcpStream, counters: Arc<Counters>) {
    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
        let response = control(&counters, &req);
        async move { Ok::<_, Infallible>(response) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

async fn accept_loop(listener: TcpListener, counters: Arc<Counters>, delay: Option<Duration>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                match delay {
                    Some(delay) => {
                        // Counted here, before the task is spawned, so no accepted connection is ever missed.
                        counters.conns.up();
                        counters.accepted.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(serve_data_connection(stream, counters.clone(), delay));
                    }
                    None => {
                        tokio::spawn(serve_control_connection(stream, counters.clone()));
                    }
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: wait a little rather than spin or die.
                eprintln!("bench_upstream: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let data = TcpListener::bind(args.listen).await?;
    let ctl = TcpListener::bind(args.control).await?;
    println!(
        "bench_upstream ready listen={} control={} delay_ms={}",
        data.local_addr()?,
        ctl.local_addr()?,
        args.delay_ms
    );
    let counters = Arc::new(Counters::default());
    let delay = Duration::from_millis(args.delay_ms);
    tokio::spawn(accept_loop(data, counters.clone(), Some(delay)));
    tokio::spawn(accept_loop(ctl, counters.clone(), None));
    shutdown_signal().await?;
    println!("{}", counters.snapshot());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}
