//! `floodgate demo`: a self-contained, ~10 second proof of the mission.
//!
//! This module owns everything the demo needs and nothing else: an embedded
//! thread-per-connection HTTP/1.1 upstream (one OS thread per accepted
//! connection, the way a stock JVM server behaves), a tokio load driver that
//! bursts `--clients` keep-alive clients at it, and the report comparing the
//! run straight at the upstream with the run through an in-process
//! [`Floodgate`]. Every number in the report is measured (counters in the
//! upstream, clocks in the clients); none is derived from the configuration.

mod load;
#[cfg(test)]
mod tests;
mod upstream;

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::sync::oneshot;

use floodgate::config::{Config, Env, Overrides};
use floodgate::server::Floodgate;

use load::drive_load;
use upstream::{Upstream, UpstreamStats};

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
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
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
