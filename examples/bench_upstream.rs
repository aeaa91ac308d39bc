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
//!
//! The service time is kept by a timer thread of its own rather than tokio's timer, which rounds every sleep up to
//! the next millisecond tick: a "2 ms" service would really be 2-3 ms, and N / service time would not be the
//! bound it claims. `service_p50_us`/`service_p99_us` report what the handlers really took.
//!
//! Two options shape the upstream for the overload-control scenarios (`benches/e2e/scenarios/README.md`):
//! `--knee K` makes it a server that does K requests' work at a time: a request that starts with n requests in
//! flight (itself included) takes the service time x max(1, n / K), so past K in flight latency rises in
//! proportion and throughput stays at K / service time (what an adaptive concurrency limit should settle near);
//! `--body-bytes B` answers every request with a body of B bytes instead of `ok\n` (for slow readers); a request
//! whose query has `bytes=N` gets the first min(N, B) of them instead (the slow-readers scenario's fast clients ask
//! for a small body from the same upstream).
//!
//! The hand-off gap: on each connection, the time from one handler returning its response to the next handler
//! starting on the same connection — the idle time a proxy in front leaves on a connection it holds, which at a
//! fixed service time is what separates its throughput from N / service time. Reported as `gap_p50_us` and
//! `gap_p99_us` over the window (null before the first reuse).
//!
//! The busy share: `inflight_time_us[k]` is how long, in the window of `window_us`, exactly k requests were in
//! flight (the last entry takes any number above it); the share of the window at k >= N is how much of the time a
//! proxy capped at N kept the upstream working at its cap.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

type Sleeper = (Instant, u64, oneshot::Sender<()>);

/// Wakes sleepers at their deadline to within the OS's timed-wait precision (tens of µs), from one thread.
#[derive(Clone)]
struct PreciseTimer {
    requests: mpsc::Sender<Sleeper>,
    next_id: Arc<AtomicU64>,
}

impl PreciseTimer {
    fn start() -> std::io::Result<Self> {
        let (requests, incoming) = mpsc::channel::<Sleeper>();
        std::thread::Builder::new()
            .name("service-timer".into())
            .spawn(move || {
                // Ordered by deadline, then by arrival (the id), so equal deadlines never compare the senders.
                let mut due: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
                let mut wakers = HashMap::new();
                loop {
                    let received = match due.peek() {
                        None => incoming.recv().map_err(|_| RecvTimeoutError::Disconnected),
                        Some(Reverse((at, _))) => incoming.recv_timeout(at.saturating_duration_since(Instant::now())),
                    };
                    match received {
                        Ok((at, id, waker)) => {
                            due.push(Reverse((at, id)));
                            wakers.insert(id, waker);
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    let now = Instant::now();
                    while let Some(&Reverse((at, id))) = due.peek() {
                        if at > now {
                            break;
                        }
                        due.pop();
                        if let Some(waker) = wakers.remove(&id) {
                            let _ = waker.send(());
                        }
                    }
                }
            })?;
        Ok(Self {
            requests,
            next_id: Arc::new(AtomicU64::new(0)),
        })
    }

    async fn sleep(&self, duration: Duration) {
        let (waker, woken) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if self.requests.send((Instant::now() + duration, id, waker)).is_ok() {
            let _ = woken.await;
        }
    }
}

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
    /// Requests served at full speed at once; past it each request's service time grows with the requests in
    /// flight (service time x in flight / knee). 0: no knee, every request takes the service time.
    #[arg(long, default_value_t = 0)]
    knee: u64,
    /// Response body size in bytes (0: the default body, "ok" and a newline). A request with `bytes=N` in its
    /// query gets the first min(N, B) bytes.
    #[arg(long, default_value_t = 0)]
    body_bytes: usize,
}

/// What every request is answered with, and how its service time is worked out.
#[derive(Clone)]
struct Service {
    delay: Duration,
    knee: u64,
    body: Bytes,
    timer: PreciseTimer,
}

impl Service {
    /// The service time of a request that starts with `inflight` requests in flight, itself included.
    fn time(&self, inflight: u64) -> Duration {
        if self.knee == 0 || inflight <= self.knee {
            return self.delay;
        }
        // u32 is plenty: in flight is bounded by the connections a proxy opens.
        let factor = u32::try_from(inflight).unwrap_or(u32::MAX);
        self.delay * factor / u32::try_from(self.knee).unwrap_or(u32::MAX)
    }
}

/// A gauge that remembers its highest value since the last reset.
#[derive(Default)]
struct PeakGauge {
    now: AtomicU64,
    peak: AtomicU64,
}

impl PeakGauge {
    /// Counts one more; returns the count with it.
    fn up(&self) -> u64 {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        now
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

/// How long the upstream spent at each number of requests in flight since the last reset: what share of a window
/// it worked at its cap (a proxy that leaves it idle between exchanges shows here, whatever its peak).
struct LevelClock {
    inner: Mutex<Levels>,
}

struct Levels {
    level: usize,
    since: Instant,
    window_start: Instant,
    /// Microseconds at each level; the last entry also takes every level above it.
    time_us: Vec<u64>,
}

/// Levels counted apart; any above share the last.
const LEVELS: usize = 1025;

impl LevelClock {
    fn new() -> Self {
        let now = Instant::now();
        LevelClock {
            inner: Mutex::new(Levels {
                level: 0,
                since: now,
                window_start: now,
                time_us: Vec::new(),
            }),
        }
    }

    fn change(&self, up: bool) {
        let mut levels = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        levels.close_span(Instant::now());
        levels.level = if up {
            levels.level + 1
        } else {
            levels.level.saturating_sub(1)
        };
    }

    /// `[window_us, [µs at 0 in flight, at 1, ...]]` up to now; a reset also starts a new window.
    fn read(&self, reset: bool) -> (u64, Vec<u64>) {
        let mut levels = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        levels.close_span(now);
        let window = u64::try_from(now.duration_since(levels.window_start).as_micros()).unwrap_or(u64::MAX);
        let time_us = if reset {
            levels.window_start = now;
            std::mem::take(&mut levels.time_us)
        } else {
            levels.time_us.clone()
        };
        (window, time_us)
    }
}

impl Levels {
    fn close_span(&mut self, now: Instant) {
        let spent = u64::try_from(now.duration_since(self.since).as_micros()).unwrap_or(u64::MAX);
        let at = self.level.min(LEVELS - 1);
        if self.time_us.len() <= at {
            self.time_us.resize(at + 1, 0);
        }
        if let Some(slot) = self.time_us.get_mut(at) {
            *slot += spent;
        }
        self.since = now;
    }
}

struct Counters {
    conns: PeakGauge,
    inflight: PeakGauge,
    levels: LevelClock,
    accepted: AtomicU64,
    served: AtomicU64,
    /// Hand-off gaps in microseconds; one lock per request is nothing next to a proxy's hand-off.
    gaps: Mutex<Histogram<u64>>,
    /// Handler times in microseconds: the service time as it really was.
    service: Mutex<Histogram<u64>>,
}

fn histogram() -> Histogram<u64> {
    // Auto-resizing, 3 significant figures: a gap of a few µs and one of seconds are both kept.
    Histogram::new(3).unwrap_or_else(|_| unreachable!("3 significant figures is valid"))
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            conns: PeakGauge::default(),
            inflight: PeakGauge::default(),
            levels: LevelClock::new(),
            accepted: AtomicU64::default(),
            served: AtomicU64::default(),
            gaps: Mutex::new(histogram()),
            service: Mutex::new(histogram()),
        }
    }
}

impl Counters {
    fn snapshot(&self) -> serde_json::Value {
        self.snapshot_and(false)
    }

    fn snapshot_and(&self, reset_levels: bool) -> serde_json::Value {
        let (window_us, inflight_time_us) = self.levels.read(reset_levels);
        let gaps = self.gaps.lock().unwrap_or_else(PoisonError::into_inner);
        let gap = |q: f64| (!gaps.is_empty()).then(|| gaps.value_at_quantile(q));
        let service = self.service.lock().unwrap_or_else(PoisonError::into_inner);
        let service_at = |q: f64| (!service.is_empty()).then(|| service.value_at_quantile(q));
        serde_json::json!({
            "service_p50_us": service_at(0.5),
            "service_p99_us": service_at(0.99),
            "gap_p50_us": gap(0.5),
            "gap_p99_us": gap(0.99),
            "gaps": gaps.len(),
            "conns": self.conns.now.load(Ordering::SeqCst),
            "peak_conns": self.conns.peak.load(Ordering::SeqCst),
            "inflight": self.inflight.now.load(Ordering::SeqCst),
            "peak_inflight": self.inflight.peak.load(Ordering::SeqCst),
            "accepted": self.accepted.load(Ordering::SeqCst),
            "served": self.served.load(Ordering::SeqCst),
            "window_us": window_us,
            "inflight_time_us": inflight_time_us,
        })
    }

    fn reset(&self) -> serde_json::Value {
        let before = self.snapshot_and(true);
        self.conns.reset();
        self.inflight.reset();
        self.accepted.store(0, Ordering::SeqCst);
        self.served.store(0, Ordering::SeqCst);
        self.gaps.lock().unwrap_or_else(PoisonError::into_inner).reset();
        self.service.lock().unwrap_or_else(PoisonError::into_inner).reset();
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
        self.0.levels.change(false);
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}

async fn serve(
    counters: Arc<Counters>,
    service: &Service,
    last_answer: &Mutex<Option<Instant>>,
    body_len: Option<usize>,
) -> Response<Full<Bytes>> {
    let inflight = counters.inflight.up();
    counters.levels.change(true);
    let delay = service.time(inflight);
    let _inflight = InflightGuard(&counters);
    let start = Instant::now();
    if let Some(answered) = *last_answer.lock().unwrap_or_else(PoisonError::into_inner) {
        let gap = u64::try_from(start.duration_since(answered).as_micros()).unwrap_or(u64::MAX);
        let _ = counters.gaps.lock().unwrap_or_else(PoisonError::into_inner).record(gap);
    }
    if !delay.is_zero() {
        service.timer.sleep(delay).await;
    }
    counters.served.fetch_add(1, Ordering::SeqCst);
    let answered = Instant::now();
    let took = u64::try_from(answered.duration_since(start).as_micros()).unwrap_or(u64::MAX);
    let _ = counters
        .service
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .record(took);
    *last_answer.lock().unwrap_or_else(PoisonError::into_inner) = Some(answered);
    match body_len {
        Some(n) if n < service.body.len() => text(StatusCode::OK, service.body.slice(..n)),
        _ => text(StatusCode::OK, service.body.clone()),
    }
}

/// `bytes=N` from a request's query, if there is one.
fn body_len(req: &Request<hyper::body::Incoming>) -> Option<usize> {
    req.uri()
        .query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix("bytes="))
        .and_then(|n| n.parse().ok())
}

fn control(counters: &Counters, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/stats") => text(StatusCode::OK, format!("{}\n", counters.snapshot())),
        (&Method::GET | &Method::POST, "/reset") => text(StatusCode::OK, format!("{}\n", counters.reset())),
        _ => text(StatusCode::NOT_FOUND, "GET /stats or POST /reset\n"),
    }
}

async fn serve_data_connection(stream: TcpStream, counters: Arc<Counters>, service: Service) {
    let _conn = ConnGuard(counters.clone());
    // HTTP/1.1 serves one request at a time per connection, so this is never contended.
    let last_answer = Arc::new(Mutex::new(None));
    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
        let counters = counters.clone();
        let last_answer = last_answer.clone();
        let service = service.clone();
        let len = body_len(&req);
        async move { Ok::<_, Infallible>(serve(counters, &service, &last_answer, len).await) }
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

/// `service`: the data listener's; None for the control listener.
async fn accept_loop(listener: TcpListener, counters: Arc<Counters>, service: Option<Service>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                match &service {
                    Some(service) => {
                        // Counted here, before the task is spawned, so no accepted connection is ever missed.
                        counters.conns.up();
                        counters.accepted.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(serve_data_connection(stream, counters.clone(), service.clone()));
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
        "bench_upstream ready listen={} control={} delay_ms={} knee={} body_bytes={}",
        data.local_addr()?,
        ctl.local_addr()?,
        args.delay_ms,
        args.knee,
        args.body_bytes
    );
    let counters = Arc::new(Counters::default());
    let service = Service {
        delay: Duration::from_millis(args.delay_ms),
        knee: args.knee,
        body: if args.body_bytes == 0 {
            Bytes::from_static(b"ok\n")
        } else {
            Bytes::from(vec![b'x'; args.body_bytes])
        },
        timer: PreciseTimer::start()?,
    };
    tokio::spawn(accept_loop(data, counters.clone(), Some(service)));
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
