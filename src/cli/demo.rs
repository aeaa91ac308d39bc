//! `floodgate demo`: a self-contained, ~10 second proof of the mission.
//!
//! This module owns everything the demo needs and nothing else: an embedded
//! thread-per-connection HTTP/1.1 upstream (one OS thread per accepted
//! connection, the way a stock JVM server behaves), a tokio load driver that
//! bursts `--clients` keep-alive clients at it, and the report comparing the
//! run straight at the upstream with the run through an in-process
//! [`Floodgate`]. Every number in the report is measured (counters in the
//! upstream, clocks in the clients); none is derived from the configuration.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use http::header::{CONNECTION, HOST, USER_AGENT};
use http::{Request, StatusCode};
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::{oneshot, Barrier};

use floodgate::config::{Config, Env, Overrides};
use floodgate::server::Floodgate;

/// Burst clients at an embedded thread-per-connection server, first directly
/// and then through floodgate, and print what each run cost the server. The
/// proxy's flags (--max-connections, --max-queue, --queue-timeout, ...) set up
/// the demo's floodgate; it listens on loopback in front of the embedded
/// upstream whatever --listen, --admin and --upstream say.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Concurrent clients, each on its own keep-alive connection.
    #[arg(long, default_value_t = 200, value_parser = parse_positive)]
    pub clients: usize,

    /// Sequential requests sent by each client.
    #[arg(long, default_value_t = 5, value_parser = parse_positive)]
    pub requests: usize,

    /// Time the embedded upstream spends on each request (e.g. "20ms").
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub service_time: Duration,
}

/// The demo's own defaults for what the proxy's flags leave unset: a cap to see, a queue long and patient enough
/// that the burst is served rather than shed.
const DEFAULT_CAP: usize = 8;
const DEFAULT_QUEUE: usize = 1024;
const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(10);

fn parse_positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// What one run (direct or via floodgate) measured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PhaseReport {
    /// Most connections the upstream held open at once.
    pub peak_upstream_connections: usize,
    /// Connections the upstream accepted over the whole run.
    pub upstream_connections_accepted: usize,
    /// Most handler threads alive in the upstream at once.
    pub peak_upstream_threads: usize,
    /// Requests the upstream actually answered.
    pub upstream_requests_served: usize,
    /// Requests answered with a 2xx.
    pub ok: usize,
    /// Requests answered with 503 (shed by floodgate).
    pub shed: usize,
    /// Requests that failed any other way (connect, I/O, unexpected status).
    pub errors: usize,
    /// Median latency of successful requests.
    pub latency_p50: Option<Duration>,
    /// 99th percentile latency of successful requests.
    pub latency_p99: Option<Duration>,
    /// From the moment all clients were released until the last one finished.
    pub wall_time: Duration,
    /// The first error seen, so a failing run explains itself.
    pub first_error: Option<String>,
}

/// Both runs side by side; `Display` renders the README table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoReport {
    pub clients: usize,
    pub requests_per_client: usize,
    pub service_time: Duration,
    pub max_connections: usize,
    pub direct: PhaseReport,
    pub via_floodgate: PhaseReport,
}

impl DemoReport {
    /// True when the run demonstrates the mission: no errors on either side,
    /// every request through floodgate answered, and floodgate kept the
    /// upstream within its cap.
    #[must_use]
    pub fn proves_mission(&self) -> bool {
        let expected = self.clients.saturating_mul(self.requests_per_client);
        self.direct.errors == 0
            && self.via_floodgate.errors == 0
            && self.via_floodgate.ok.saturating_add(self.via_floodgate.shed) == expected
            && self.via_floodgate.ok > 0
            && self.via_floodgate.peak_upstream_connections <= self.max_connections
            && self.via_floodgate.peak_upstream_threads <= self.max_connections
    }
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const LABEL: usize = 27;
        const DIRECT: usize = 10;
        let proxied_title = format!("via floodgate (cap {})", self.max_connections);
        let proxied = proxied_title.len().saturating_add(4);

        writeln!(
            f,
            "floodgate demo: {} clients x {} requests, {} service time, thread-per-connection upstream",
            self.clients,
            self.requests_per_client,
            format_duration_short(self.service_time),
        )?;
        writeln!(f, "{:<LABEL$}{:>DIRECT$}{:>proxied$}", "", "direct", proxied_title)?;

        let (d, p) = (&self.direct, &self.via_floodgate);
        let rows: [(&str, String, String); 9] = [
            (
                "peak upstream connections",
                d.peak_upstream_connections.to_string(),
                p.peak_upstream_connections.to_string(),
            ),
            (
                "upstream connections opened",
                d.upstream_connections_accepted.to_string(),
                p.upstream_connections_accepted.to_string(),
            ),
            (
                "peak upstream threads",
                d.peak_upstream_threads.to_string(),
                p.peak_upstream_threads.to_string(),
            ),
            ("requests ok", d.ok.to_string(), p.ok.to_string()),
            ("shed (503)", d.shed.to_string(), p.shed.to_string()),
            ("errors", d.errors.to_string(), p.errors.to_string()),
            (
                "latency p50",
                format_latency(d.latency_p50),
                format_latency(p.latency_p50),
            ),
            (
                "latency p99",
                format_latency(d.latency_p99),
                format_latency(p.latency_p99),
            ),
            ("wall time", format_wall(d.wall_time), format_wall(p.wall_time)),
        ];
        for (label, direct, via) in &rows {
            writeln!(f, "{label:<LABEL$}{direct:>DIRECT$}{via:>proxied$}")?;
        }

        for (name, phase) in [("direct", d), ("via floodgate", p)] {
            if let Some(err) = &phase.first_error {
                writeln!(f, "first error ({name}): {err}")?;
            }
        }

        if p.peak_upstream_connections > 0 && p.ok > 0 {
            write!(
                f,
                "floodgate served {} clients over {} upstream connection(s); directly, they cost the upstream {} threads",
                self.clients, p.peak_upstream_connections, d.peak_upstream_threads,
            )?;
        } else {
            write!(f, "floodgate run did not complete; see the errors above")?;
        }
        Ok(())
    }
}

fn format_latency(latency: Option<Duration>) -> String {
    match latency {
        None => "-".to_owned(),
        Some(d) => {
            let ms = d.as_secs_f64() * 1000.0;
            if ms < 10.0 {
                format!("{ms:.1} ms")
            } else {
                format!("{ms:.0} ms")
            }
        }
    }
}

fn format_wall(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

fn format_duration_short(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

/// Runs the demo: the same burst straight at a thread-per-connection upstream,
/// then through floodgate capped at `max_connections`.
///
/// # Errors
///
/// Fails when the embedded upstream or floodgate cannot start or stop.
/// Failed requests are not errors: they are counted in the report.
pub async fn run(args: DemoArgs, mut flags: Overrides) -> anyhow::Result<DemoReport> {
    let limits = &mut flags.upstream;
    let max_connections = *limits.max_connections.get_or_insert(DEFAULT_CAP);
    limits.max_queue.get_or_insert(DEFAULT_QUEUE);
    let queue_timeout = *limits.queue_timeout.get_or_insert(DEFAULT_QUEUE_TIMEOUT);
    let budget = request_budget(queue_timeout, args.service_time);
    let direct = run_direct(&args, budget).await.context("direct run")?;
    let via_floodgate = run_via_floodgate(&args, flags, budget)
        .await
        .context("run via floodgate")?;
    Ok(DemoReport {
        clients: args.clients,
        requests_per_client: args.requests,
        service_time: args.service_time,
        max_connections,
        direct,
        via_floodgate,
    })
}

/// A budget for one request that no healthy run reaches, so a wedged
/// connection turns into a counted error instead of a hung demo.
fn request_budget(queue_timeout: Duration, service_time: Duration) -> Duration {
    queue_timeout
        .saturating_add(service_time.saturating_mul(4))
        .saturating_add(Duration::from_secs(10))
}

async fn run_direct(args: &DemoArgs, budget: Duration) -> anyhow::Result<PhaseReport> {
    // A fresh upstream per run keeps the peaks of one run out of the other.
    let upstream = Upstream::start(args.service_time).context("starting the embedded upstream")?;
    // `connect` returns once the kernel completed the handshake, which can be
    // long before the accept thread has spawned the connection's thread;
    // wait for it so the burst meets all the threads the clients cost.
    let shared = Arc::clone(&upstream.shared);
    let settle = |connected: usize| async move {
        let deadline = Instant::now() + Duration::from_secs(5);
        while shared.threads.live.load(Ordering::SeqCst) < connected && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let load = drive_load(upstream.addr(), args.clients, args.requests, budget, settle).await;
    tracing::debug!(wall = ?load.wall_time, "direct load done");
    let stats = stop_upstream(upstream).await?;
    tracing::debug!("direct upstream stopped");
    Ok(load.into_report(stats))
}

async fn run_via_floodgate(args: &DemoArgs, mut flags: Overrides, budget: Duration) -> anyhow::Result<PhaseReport> {
    let upstream = Upstream::start(args.service_time).context("starting the embedded upstream")?;

    flags.upstream.upstream = Some(upstream.addr().to_string());
    flags.global.listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    flags.global.admin = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let config = Config::load(None, &Env::none(), &flags).context("the floodgate configuration")?;

    let floodgate = Floodgate::bind(config).await.context("binding floodgate")?;
    let listen = floodgate.listen_addr();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(floodgate.run(async move {
        // A dropped sender also means stop: the demo is over either way.
        let _ = stop_rx.await;
    }));

    let load = drive_load(listen, args.clients, args.requests, budget, |_| async {}).await;

    tracing::debug!(wall = ?load.wall_time, "load via floodgate done");
    let _ = stop_tx.send(());
    match tokio::time::timeout(Duration::from_secs(30), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(e).context("floodgate stopped with an error"),
        Ok(Err(e)) => return Err(e).context("floodgate task failed"),
        Err(_) => bail!("floodgate did not shut down within 30s"),
    }
    tracing::debug!("floodgate stopped");

    let stats = stop_upstream(upstream).await?;
    Ok(load.into_report(stats))
}

async fn stop_upstream(upstream: Upstream) -> anyhow::Result<UpstreamStats> {
    // Joining OS threads blocks; keep it off the async workers.
    tokio::task::spawn_blocking(move || upstream.shutdown(Duration::from_secs(5)))
        .await
        .context("stopping the embedded upstream")
}

// ---------------------------------------------------------------------------
// Load driver
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct LoadResult {
    ok: usize,
    shed: usize,
    errors: usize,
    latencies: Vec<Duration>,
    first_error: Option<String>,
    wall_time: Duration,
}

impl LoadResult {
    fn error(&mut self, message: impl Into<String>) {
        self.errors = self.errors.saturating_add(1);
        if self.first_error.is_none() {
            self.first_error = Some(message.into());
        }
    }

    fn merge(&mut self, other: LoadResult) {
        self.ok = self.ok.saturating_add(other.ok);
        self.shed = self.shed.saturating_add(other.shed);
        self.errors = self.errors.saturating_add(other.errors);
        self.latencies.extend(other.latencies);
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn into_report(mut self, upstream: UpstreamStats) -> PhaseReport {
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
fn percentile(sorted: &[Duration], percent: usize) -> Option<Duration> {
    let rank = percent.min(100).saturating_mul(sorted.len()).div_ceil(100).max(1);
    sorted.get(rank.saturating_sub(1)).copied()
}

/// Lines the clients up so the burst starts at one instant, after the server
/// has really taken every connection.
struct StartGate {
    connected: AtomicUsize,
    arrived: Barrier,
    go: Barrier,
}

/// Bursts `clients` keep-alive clients at `addr`. `settle` runs once every
/// client is connected (it gets how many succeeded) and before the burst.
async fn drive_load<S, F>(addr: SocketAddr, clients: usize, requests: usize, budget: Duration, settle: S) -> LoadResult
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

async fn run_client(addr: SocketAddr, requests: usize, gate: Arc<StartGate>, budget: Duration) -> LoadResult {
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

async fn connect(addr: SocketAddr, budget: Duration) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
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
async fn send_one(sender: &mut SendRequest<Empty<Bytes>>, host: &str) -> anyhow::Result<(StatusCode, bool)> {
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

// ---------------------------------------------------------------------------
// Embedded thread-per-connection upstream
// ---------------------------------------------------------------------------

/// What the upstream measured over its lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct UpstreamStats {
    peak_connections: usize,
    peak_threads: usize,
    connections_accepted: usize,
    requests_served: usize,
    live_threads: usize,
}

/// A live count with its high-water mark.
#[derive(Debug, Default)]
struct Gauge {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn inc(&self) {
        let now = self.live.fetch_add(1, Ordering::SeqCst).saturating_add(1);
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn dec(&self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct Shared {
    stopping: AtomicBool,
    connections: Gauge,
    threads: Gauge,
    accepted: AtomicUsize,
    served: AtomicUsize,
    next_id: AtomicU64,
    /// Clones of open sockets, so shutdown can unblock handler threads that
    /// sit in `read` on a peer that never hangs up.
    open: Mutex<HashMap<u64, TcpStream>>,
}

impl Shared {
    fn stats(&self) -> UpstreamStats {
        UpstreamStats {
            peak_connections: self.connections.peak.load(Ordering::SeqCst),
            peak_threads: self.threads.peak.load(Ordering::SeqCst),
            connections_accepted: self.accepted.load(Ordering::SeqCst),
            requests_served: self.served.load(Ordering::SeqCst),
            live_threads: self.threads.live.load(Ordering::SeqCst),
        }
    }

    fn open_sockets(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        // A poisoned map only means a handler died mid-update; the sockets
        // in it are still the ones to close.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Undoes a handler's bookkeeping however the handler thread ends.
struct HandlerGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for HandlerGuard {
    fn drop(&mut self) {
        self.shared.open_sockets().remove(&self.id);
        self.shared.connections.dec();
        self.shared.threads.dec();
    }
}

/// A blocking HTTP/1.1 server spending one OS thread per connection, like a
/// JVM thread-per-connection server: the cost floodgate exists to bound.
struct Upstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Upstream {
    fn start(service_time: Duration) -> io::Result<Self> {
        let listener = bind_listener()?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let accept_shared = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("demo-upstream-accept".to_owned())
            .spawn(move || accept_loop(&listener, &accept_shared, service_time))?;
        Ok(Self {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    #[cfg(test)]
    fn stats(&self) -> UpstreamStats {
        self.shared.stats()
    }

    /// Stops accepting, closes every open connection and waits up to `grace`
    /// for the handler threads to exit.
    fn shutdown(mut self, grace: Duration) -> UpstreamStats {
        self.stop();
        let deadline = Instant::now() + grace;
        while self.shared.threads.live.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        self.shared.stats()
    }

    fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // `accept` has no timeout; a throwaway connection wakes it up to
        // notice the flag.
        match TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)) {
            Ok(_) => {
                if accept.join().is_err() {
                    tracing::warn!("demo upstream accept thread panicked");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not wake the demo upstream accept thread; leaving it behind");
            }
        }
        for socket in self.shared.open_sockets().values() {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop();
    }
}

fn bind_listener() -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    // std's backlog of 128 would drop SYNs when hundreds of clients connect
    // at once, and the 1s SYN retry would then pollute the direct numbers.
    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    socket.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>, service_time: Duration) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Typically EMFILE under a very large --clients; back off
                // instead of spinning, the pending connection stays queued.
                tracing::debug!(error = %e, "demo upstream accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.connections.inc();
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        match stream.try_clone() {
            Ok(clone) => {
                shared.open_sockets().insert(id, clone);
            }
            Err(e) => {
                tracing::debug!(error = %e, "demo upstream could not track a connection");
            }
        }
        let handler_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name(format!("demo-upstream-conn-{id}"))
            .spawn(move || {
                handler_shared.threads.inc();
                let guard = HandlerGuard {
                    shared: handler_shared,
                    id,
                };
                if let Err(e) = serve_connection(stream, service_time, &guard.shared.served) {
                    tracing::debug!(error = %e, "demo upstream connection ended with an error");
                }
            });
        if let Err(e) = spawned {
            // The closure (and the socket) is gone; undo what it would have.
            tracing::warn!(error = %e, "demo upstream could not spawn a connection thread");
            shared.open_sockets().remove(&id);
            shared.connections.dec();
        }
    }
}

const MAX_HEAD_BYTES: u64 = 64 * 1024;
const BODY: &[u8] = b"hello from a thread-per-connection upstream\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RequestHead {
    is_head: bool,
    content_length: u64,
    keep_alive: bool,
}

#[derive(Debug)]
enum HeadError {
    Io(io::Error),
    Malformed(&'static str),
    TooLarge,
    Unsupported(&'static str),
}

impl From<io::Error> for HeadError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn serve_connection(stream: TcpStream, service_time: Duration, served: &AtomicUsize) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream);
    loop {
        let head = match read_request_head(&mut reader) {
            Ok(Some(head)) => head,
            Ok(None) => return Ok(()),
            Err(HeadError::Io(e)) => return Err(e),
            Err(HeadError::Malformed(why)) => {
                return write_response(reader.get_mut(), "400 Bad Request", why.as_bytes(), false, false);
            }
            Err(HeadError::TooLarge) => {
                return write_response(
                    reader.get_mut(),
                    "431 Request Header Fields Too Large",
                    b"request head too large\n",
                    false,
                    false,
                );
            }
            Err(HeadError::Unsupported(why)) => {
                return write_response(reader.get_mut(), "501 Not Implemented", why.as_bytes(), false, false);
            }
        };

        let discarded = io::copy(&mut reader.by_ref().take(head.content_length), &mut io::sink())?;
        if discarded != head.content_length {
            return Ok(());
        }

        // The work a real handler would do, holding its thread the whole time.
        thread::sleep(service_time);
        served.fetch_add(1, Ordering::SeqCst);

        write_response(reader.get_mut(), "200 OK", BODY, head.keep_alive, head.is_head)?;
        if !head.keep_alive {
            return Ok(());
        }
    }
}

fn write_response(
    stream: &mut TcpStream,
    status: &str,
    body: &[u8],
    keep_alive: bool,
    head_only: bool,
) -> io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n{}\r\n",
        body.len(),
        if keep_alive { "" } else { "connection: close\r\n" },
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    // One write per response, so Nagle never holds half of it back.
    stream.write_all(&out)?;
    stream.flush()
}

/// Reads one request head. `Ok(None)` is a clean close between requests.
fn read_request_head<R: BufRead>(reader: &mut R) -> Result<Option<RequestHead>, HeadError> {
    let mut budget = MAX_HEAD_BYTES;
    let mut line = Vec::new();

    // RFC 9112 §2.2: ignore empty lines before the request line.
    let request_line = loop {
        line.clear();
        if read_line(reader, &mut line, &mut budget)? == 0 {
            return Ok(None);
        }
        let trimmed = trim_line_end(&line);
        if !trimmed.is_empty() {
            break std::str::from_utf8(trimmed)
                .map_err(|_| HeadError::Malformed("request line is not UTF-8\n"))?
                .to_owned();
        }
    };

    let mut parts = request_line.split(' ');
    let (Some(method), Some(_target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed("malformed request line\n"));
    };
    let mut keep_alive = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        _ => return Err(HeadError::Malformed("unsupported HTTP version\n")),
    };
    if method.is_empty() {
        return Err(HeadError::Malformed("malformed request line\n"));
    }

    let mut content_length: Option<u64> = None;
    loop {
        line.clear();
        if read_line(reader, &mut line, &mut budget)? == 0 {
            return Err(HeadError::Malformed("connection closed inside the request head\n"));
        }
        let trimmed = trim_line_end(&line);
        if trimmed.is_empty() {
            break;
        }
        let text = std::str::from_utf8(trimmed).map_err(|_| HeadError::Malformed("header is not UTF-8\n"))?;
        if text.starts_with([' ', '\t']) {
            return Err(HeadError::Malformed("obsolete header folding\n"));
        }
        let Some((name, value)) = text.split_once(':') else {
            return Err(HeadError::Malformed("header without a colon\n"));
        };
        if name.is_empty() || name.ends_with([' ', '\t']) {
            return Err(HeadError::Malformed("malformed header name\n"));
        }
        let value = value.trim_matches([' ', '\t']);
        if name.eq_ignore_ascii_case("content-length") {
            let parsed = value
                .parse::<u64>()
                .map_err(|_| HeadError::Malformed("invalid content-length\n"))?;
            if content_length.is_some_and(|seen| seen != parsed) {
                return Err(HeadError::Malformed("conflicting content-length\n"));
            }
            content_length = Some(parsed);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Only bodiless GETs are expected; refusing beats misframing.
            return Err(HeadError::Unsupported("transfer-encoding is not supported\n"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }

    Ok(Some(RequestHead {
        is_head: method == "HEAD",
        content_length: content_length.unwrap_or(0),
        keep_alive,
    }))
}

/// Reads through the next `\n`, charging the head budget.
fn read_line<R: BufRead>(reader: &mut R, line: &mut Vec<u8>, budget: &mut u64) -> Result<usize, HeadError> {
    let n = reader.by_ref().take(*budget).read_until(b'\n', line)?;
    *budget = budget.saturating_sub(u64::try_from(n).unwrap_or(u64::MAX));
    if n > 0 && !line.ends_with(b"\n") {
        return Err(if *budget == 0 {
            HeadError::TooLarge
        } else {
            HeadError::Malformed("connection closed inside the request head\n")
        });
    }
    Ok(n)
}

fn trim_line_end(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile(&sorted, 50), Some(ms(50)));
        assert_eq!(percentile(&sorted, 99), Some(ms(99)));
        assert_eq!(percentile(&sorted, 100), Some(ms(100)));
        assert_eq!(percentile(&sorted, 0), Some(ms(1)));

        let few = [ms(10), ms(20), ms(30)];
        assert_eq!(percentile(&few, 50), Some(ms(20)));
        assert_eq!(percentile(&few, 99), Some(ms(30)));
        assert_eq!(percentile(&[ms(7)], 99), Some(ms(7)));
        assert_eq!(percentile(&[], 50), None);
    }

    fn get(mut stream: &TcpStream) -> anyhow::Result<String> {
        stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut head = String::new();
        let mut content_length = 0usize;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                content_length = v.trim().parse()?;
            }
            head.push_str(&line);
            if line == "\r\n" || line.is_empty() {
                break;
            }
        }
        let mut body = vec![0; content_length];
        reader.read_exact(&mut body)?;
        Ok(format!("{head}{}", String::from_utf8(body)?))
    }

    #[test]
    fn upstream_spends_one_thread_per_connection() -> anyhow::Result<()> {
        let upstream = Upstream::start(ms(1))?;
        let a = TcpStream::connect(upstream.addr())?;
        let b = TcpStream::connect(upstream.addr())?;
        // Two requests on one keep-alive connection must not cost a thread more.
        for stream in [&a, &b, &a] {
            let response = get(stream)?;
            assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
            assert!(response.ends_with("upstream\n"), "{response}");
        }
        let stats = upstream.stats();
        assert_eq!(stats.peak_threads, 2);
        assert_eq!(stats.peak_connections, 2);
        assert_eq!(stats.connections_accepted, 2);
        assert_eq!(stats.requests_served, 3);

        // Keep `a` open: shutdown must still end its thread.
        drop(b);
        let stats = upstream.shutdown(Duration::from_secs(5));
        assert_eq!(stats.live_threads, 0);
        drop(a);
        Ok(())
    }

    #[test]
    fn head_parser_frames_requests() {
        let mut input: &[u8] = b"\r\nPOST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc";
        let head = read_request_head(&mut input);
        assert!(matches!(
            head,
            Ok(Some(RequestHead {
                is_head: false,
                content_length: 3,
                keep_alive: false
            }))
        ));
        assert_eq!(input, b"abc");

        let mut empty: &[u8] = b"";
        assert!(matches!(read_request_head(&mut empty), Ok(None)));

        let mut chunked: &[u8] = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(
            read_request_head(&mut chunked),
            Err(HeadError::Unsupported(_))
        ));

        let huge = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(70_000));
        assert!(matches!(
            read_request_head(&mut huge.as_bytes()),
            Err(HeadError::TooLarge)
        ));
    }
}
