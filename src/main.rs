//! The `floodgate` binary: command line, logging, runtime, signals and exit codes.
//!
//! Exit codes: 0 after a clean run or drain, 2 for a configuration problem (one line naming the key),
//! 1 for anything else that stops start-up.

#![forbid(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use floodgate::config::{Config, Overrides};
use floodgate::server::Floodgate;

/// A reverse proxy that turns any number of clients into a fixed, bounded keep-alive pool per upstream.
#[derive(Parser, Debug)]
#[command(name = "floodgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML configuration file; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Client listener address.
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Admin listener address (/metrics, /status, /healthz, /readyz).
    #[arg(long)]
    admin: Option<std::net::SocketAddr>,
    /// The one upstream everything goes to: http://host:port or host:port.
    #[arg(long)]
    upstream: Option<String>,
    /// Most TCP connections to each upstream.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Most requests waiting per upstream; 0 sheds at once when all connections are busy.
    #[arg(long)]
    max_queue: Option<usize>,
    /// Longest a request waits in the queue (e.g. 250ms, 5s).
    #[arg(long, value_parser = humantime::parse_duration)]
    queue_timeout: Option<Duration>,
    /// Longest to wait for an upstream connection to open.
    #[arg(long, value_parser = humantime::parse_duration)]
    connect_timeout: Option<Duration>,
    /// Longest from dispatch to the upstream's response head.
    #[arg(long, value_parser = humantime::parse_duration)]
    request_timeout: Option<Duration>,
    /// Idle upstream connections close after this.
    #[arg(long, value_parser = humantime::parse_duration)]
    idle_timeout: Option<Duration>,
    /// A body (either way) that makes no progress for this long aborts the exchange.
    #[arg(long, value_parser = humantime::parse_duration)]
    body_idle_timeout: Option<Duration>,
    /// Client keep-alive connections idle between requests close after this.
    #[arg(long, value_parser = humantime::parse_duration)]
    client_idle_timeout: Option<Duration>,
    /// Longest from the first byte of a request head to its end.
    #[arg(long, value_parser = humantime::parse_duration)]
    header_read_timeout: Option<Duration>,
    /// A new client connection that sends nothing for this long is closed.
    #[arg(long, value_parser = humantime::parse_duration)]
    first_byte_timeout: Option<Duration>,
    /// Longest to let in-flight and queued requests finish on SIGTERM/SIGINT.
    #[arg(long, value_parser = humantime::parse_duration)]
    shutdown_timeout: Option<Duration>,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Shows the point in ten seconds: a thread-per-connection upstream hit directly, then through floodgate.
    Demo(floodgate::demo::DemoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Demo(args)) = cli.command {
        // The demo's output is its table; the proxy's own info lines would only interleave with it.
        init_logging("warn");
        return run_demo(args);
    }
    init_logging("info");
    let overrides = Overrides {
        listen: cli.listen,
        admin: cli.admin,
        upstream: cli.upstream,
        max_connections: cli.max_connections,
        max_queue: cli.max_queue,
        queue_timeout: cli.queue_timeout,
        connect_timeout: cli.connect_timeout,
        request_timeout: cli.request_timeout,
        idle_timeout: cli.idle_timeout,
        body_idle_timeout: cli.body_idle_timeout,
        client_idle_timeout: cli.client_idle_timeout,
        header_read_timeout: cli.header_read_timeout,
        first_byte_timeout: cli.first_byte_timeout,
        shutdown_timeout: cli.shutdown_timeout,
        threads: cli.threads,
    };
    let config = match Config::load(cli.config.as_deref(), &overrides) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("floodgate: invalid configuration: {err}");
            return ExitCode::from(2);
        }
    };
    let runtime = match build_runtime(config.threads) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("floodgate: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("floodgate: {err:#}");
            ExitCode::from(1)
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let floodgate = Floodgate::bind(config).await?;
    let (listen, admin) = (floodgate.listen_addr(), floodgate.admin_addr());
    let config = floodgate.config();
    for (name, upstream) in &config.upstreams {
        tracing::info!(
            upstream = %name,
            url = %upstream.url,
            max_connections = upstream.max_connections,
            max_queue = upstream.max_queue,
            queue_timeout = ?upstream.queue_timeout,
            connect_timeout = ?upstream.connect_timeout,
            request_timeout = ?upstream.request_timeout,
            idle_timeout = ?upstream.idle_timeout,
            "upstream pool"
        );
    }
    tracing::info!(%listen, %admin, max_client_connections = config.max_client_connections, "floodgate started");
    // The one line scripts and tests wait for.
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "floodgate ready listen={listen} admin={admin}");
    let _ = stdout.flush();
    floodgate.run(shutdown_signal()).await?;
    tracing::info!("floodgate stopped");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutdown signal received");
}

fn build_runtime(threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    // One thread: the current-thread scheduler, which hands a woken task over without the work-stealing
    // machinery (atomics, a parked worker to unpark) that a single worker cannot use anyway.
    let mut builder = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all();
    if let Some(threads) = threads.filter(|&t| t > 1) {
        builder.worker_threads(threads);
    }
    builder.build()
}

fn run_demo(args: floodgate::demo::DemoArgs) -> ExitCode {
    let runtime = match build_runtime(None) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("floodgate: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(floodgate::demo::run(args)) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("floodgate demo: {err:#}");
            ExitCode::from(1)
        }
    }
}

fn init_logging(default_level: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
