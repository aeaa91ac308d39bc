//! The `floodgate` binary: command line, logging, runtime, signals and exit codes.
//!
//! Exit codes: 0 after a clean run or drain (or a valid `check`), 2 for a configuration problem (one line per
//! problem, each naming its key), 1 for anything else that stops start-up.

#![forbid(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use floodgate::config::{Config, Env, Overrides, REDACTED};
use floodgate::server::Floodgate;

/// A reverse proxy that turns any number of clients into a fixed, bounded keep-alive pool per upstream.
///
/// Configuration layers, each overriding the one before: built-in defaults, the --config file, FLOODGATE__*
/// environment variables (FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS=16), these flags.
#[derive(Parser, Debug)]
#[command(name = "floodgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    layers: LayerArgs,
}

/// The file and the flags: the layers a command line gives (the environment is read by itself).
#[derive(Args, Debug, Default)]
struct LayerArgs {
    /// TOML configuration file; the environment and flags override it.
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

impl LayerArgs {
    /// `floodgate check --config F` and `floodgate --config F check` both work: clap parses flags before the
    /// subcommand into `outer`; those after it win.
    fn or(self, outer: LayerArgs) -> LayerArgs {
        LayerArgs {
            config: self.config.or(outer.config),
            listen: self.listen.or(outer.listen),
            admin: self.admin.or(outer.admin),
            upstream: self.upstream.or(outer.upstream),
            max_connections: self.max_connections.or(outer.max_connections),
            max_queue: self.max_queue.or(outer.max_queue),
            queue_timeout: self.queue_timeout.or(outer.queue_timeout),
            connect_timeout: self.connect_timeout.or(outer.connect_timeout),
            request_timeout: self.request_timeout.or(outer.request_timeout),
            idle_timeout: self.idle_timeout.or(outer.idle_timeout),
            body_idle_timeout: self.body_idle_timeout.or(outer.body_idle_timeout),
            client_idle_timeout: self.client_idle_timeout.or(outer.client_idle_timeout),
            header_read_timeout: self.header_read_timeout.or(outer.header_read_timeout),
            first_byte_timeout: self.first_byte_timeout.or(outer.first_byte_timeout),
            shutdown_timeout: self.shutdown_timeout.or(outer.shutdown_timeout),
            threads: self.threads.or(outer.threads),
        }
    }

    /// All layers, with the process's environment; on problems, one line each on stderr.
    fn load(self) -> Result<Config, ExitCode> {
        let overrides = Overrides {
            listen: self.listen,
            admin: self.admin,
            upstream: self.upstream,
            max_connections: self.max_connections,
            max_queue: self.max_queue,
            queue_timeout: self.queue_timeout,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
            idle_timeout: self.idle_timeout,
            body_idle_timeout: self.body_idle_timeout,
            client_idle_timeout: self.client_idle_timeout,
            header_read_timeout: self.header_read_timeout,
            first_byte_timeout: self.first_byte_timeout,
            shutdown_timeout: self.shutdown_timeout,
            threads: self.threads,
        };
        Config::load(self.config.as_deref(), &Env::Process, &overrides).map_err(|errors| {
            for problem in errors.problems() {
                eprintln!("floodgate: invalid configuration: {problem}");
            }
            ExitCode::from(2)
        })
    }
}

// Parsed once at start-up: boxing the larger variant would save nothing worth the indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Shows the point in ten seconds: a thread-per-connection upstream hit directly, then through floodgate.
    Demo(floodgate::demo::DemoArgs),
    /// Validates the configuration (all layers, as the proxy would start with them) and prints it as TOML, secrets
    /// redacted; exits 2 with one line per problem.
    Check(LayerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Demo(args)) => {
            // The demo's output is its table; the proxy's own info lines would only interleave with it.
            init_logging("warn");
            return run_demo(args);
        }
        Some(Command::Check(args)) => return run_check(args.or(cli.layers)),
        None => {}
    }
    init_logging("info");
    let config = match cli.layers.load() {
        Ok(config) => config,
        Err(code) => return code,
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

fn run_check(args: LayerArgs) -> ExitCode {
    let file = match &args.config {
        Some(path) => path.display().to_string(),
        None => "no file".to_string(),
    };
    let config = match args.load() {
        Ok(config) => config,
        Err(code) => return code,
    };
    let text = match config.to_redacted_toml() {
        Ok(text) => text,
        Err(err) => {
            eprintln!("floodgate: cannot print the configuration: {err}");
            return ExitCode::from(1);
        }
    };
    let variables = Env::Process.variables();
    let variables = if variables.is_empty() {
        "none".to_string()
    } else {
        variables.join(", ")
    };
    println!("# floodgate check: valid. Effective configuration, secrets shown as {REDACTED}.");
    println!("# Layers: built-in defaults < {file} < environment ({variables}) < flags.");
    print!("{text}");
    ExitCode::SUCCESS
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
