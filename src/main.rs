//! The `floodgate` binary: command line, logging, runtime, signals and exit codes.
//!
//! Exit codes: 0 after a clean run or drain (or a valid `check`), 2 for a configuration problem (one line per
//! problem, each naming its key), 1 for anything else that stops start-up.

#![forbid(unsafe_code)]
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

mod cli;

use cli::signals::{notify_systemd, reload_on_change, reload_on_hangup, shutdown_signal};

use clap::{Args, CommandFactory, Parser, Subcommand};
use floodgate::config::{AccessLogTarget, Config, Env, LogFormat, Overrides, REDACTED};
use floodgate::reload::ConfigSource;
use floodgate::server::{Floodgate, Workers};

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

/// The file and the flags: the layers a command line gives (the environment is read by itself). Global, so they
/// may come before or after a subcommand.
#[derive(Args, Debug, Default)]
struct LayerArgs {
    /// TOML configuration file; the environment and flags override it.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: Overrides,
}

impl LayerArgs {
    /// All layers, with the process's environment; on problems, one line each on stderr.
    fn load(self) -> Result<Config, ExitCode> {
        load(&self.into_source())
    }

    /// Reads all layers each time it is called: at start-up, and again at every reload. The flags are fixed for
    /// the process's life, so a value given as a flag wins over every reloaded file.
    fn into_source(self) -> ConfigSource {
        let overrides = self.overrides;
        let file = self.config;
        Arc::new(move || Config::load_checked(file.as_deref(), &Env::Process, &overrides, &[floodgate::tls::check]))
    }
}

/// Loads through `source`; on problems, one line each on stderr.
fn load(source: &ConfigSource) -> Result<Config, ExitCode> {
    source().map_err(|errors| {
        for problem in errors.problems() {
            eprintln!("floodgate: invalid configuration: {problem}");
        }
        ExitCode::from(2)
    })
}

// Parsed once at start-up: boxing the larger variant would save nothing worth the indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Shows the point in ten seconds: a thread-per-connection upstream hit directly, then through floodgate.
    Demo(cli::demo::DemoArgs),
    /// Validates the configuration (all layers, as the proxy would start with them) and prints it as TOML, secrets
    /// redacted; exits 2 with one line per problem.
    Check {
        /// Print nothing for a valid configuration: only its exit status (0) says so, as a reload's check wants.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Asks the running floodgate that this configuration describes (its `admin` address) whether it is ready:
    /// exit 0 on a 200 from /readyz, 1 otherwise. For container health checks.
    Healthcheck(cli::healthcheck::HealthcheckArgs),
    /// Has the running floodgate that this configuration describes (its `admin` address, with its `admin_token`)
    /// read its configuration again, and prints what changed or why it was refused: exit 0 when it is in force.
    Reload,
    /// Prints a completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Prints the manual page (roff), as `man` reads it: `floodgate man > floodgate.1`.
    Man,
}

/// Gives a flood's memory back within about a second of its end (see Cargo.toml and docs/memory.md).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// jemalloc reads its settings once, before `main`, from a variable: a server started without it starts itself again
/// with floodgate's tuning (`floodgate::allocator`), so that any build or install runs with it, not only one made
/// beside a file that sets it at build time. An operator's own value is left as it is.
#[cfg(feature = "jemalloc")]
fn with_tuned_allocator() {
    use std::os::unix::process::CommandExt;
    let variable = floodgate::allocator::SETTINGS_VARIABLE;
    if std::env::var_os(variable).is_some() {
        return;
    }
    let mut args = std::env::args_os();
    let program = args.next().unwrap_or_default();
    // The running binary itself, even if its file was replaced since (an upgrade while it starts).
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(program)
        .args(args)
        .env(variable, floodgate::allocator::TUNING)
        .exec();
    eprintln!(
        "floodgate: cannot start again with the allocator's tuning ({err}); freed memory goes back in about ten \
         seconds instead of one"
    );
}

#[cfg(not(feature = "jemalloc"))]
fn with_tuned_allocator() {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, None | Some(Command::Demo(_))) {
        with_tuned_allocator();
    }
    match cli.command {
        Some(Command::Demo(args)) => {
            // The demo's output is its table; the proxy's own info lines would only interleave with it.
            init_logging(LogFormat::Human, "warn", None);
            return run_demo(args, cli.layers.overrides);
        }
        Some(Command::Check { quiet }) => return run_check(cli.layers, quiet),
        Some(Command::Healthcheck(args)) => {
            // `--admin` says where to ask; otherwise the configuration does.
            if let Some(admin) = cli.layers.overrides.global.admin {
                return cli::healthcheck::run(&args, admin);
            }
            return match cli.layers.load() {
                Ok(config) => cli::healthcheck::run(&args, config.admin),
                Err(code) => code,
            };
        }
        Some(Command::Reload) => {
            return match cli.layers.load() {
                Ok(config) => cli::reload::run(&config),
                Err(code) => code,
            };
        }
        Some(Command::Completions { shell }) => {
            clap_complete::generate(shell, &mut Cli::command(), "floodgate", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Some(Command::Man) => {
            return match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("floodgate: cannot write the manual page: {err}");
                    ExitCode::from(1)
                }
            };
        }
        None => {}
    }
    // Configuration problems are printed plainly: logging is configured by what is being loaded.
    let file = cli.layers.config.clone();
    let source = cli.layers.into_source();
    let config = match load(&source) {
        Ok(config) => config,
        Err(code) => return code,
    };
    let access_log = match open_access_log(&config) {
        Ok(writer) => writer,
        Err(code) => return code,
    };
    // The guard is held to the end of main: dropping it flushes the access lines still queued.
    let (access_log, _access_guard) =
        match access_log.map(|writer| without_panic(|| tracing_appender::non_blocking(writer))) {
            None => (None, None),
            Some(Ok((writer, guard))) => (Some(writer), Some(guard)),
            Some(Err(err)) => {
                eprintln!("floodgate: cannot start the access log's writer thread: {err}");
                return ExitCode::from(1);
            }
        };
    // Written only while the access log is on (`access` makes each line whole, in its format).
    let access_log = access_log.filter(|_| config.access_log_format().is_some());
    init_logging(config.log_format, &config.log_level, access_log);
    let runtime = match start_runtime(Flavor::Serving) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("floodgate: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    // The other threads that serve clients, each a runtime like this one (`floodgate::server::Workers`); before
    // anything else starts threads, so that a process limit is met here, as the runtime's.
    let workers = match Workers::start(serving_threads(config.threads).saturating_sub(1)) {
        Ok(workers) => workers,
        Err(err) => {
            eprintln!("floodgate: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    // Gives freed memory back on a timer rather than only when the allocator is next called (docs/memory.md);
    // without it floodgate still runs, keeping a flood's memory longer.
    #[cfg(feature = "jemalloc")]
    if let Err(err) = tikv_jemalloc_ctl::background_thread::write(true) {
        tracing::warn!(error = %err, "the allocator's purging thread did not start; freed memory goes back later");
    }
    match runtime.block_on(serve(config, source, file, workers)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("floodgate: {err:#}");
            ExitCode::from(1)
        }
    }
}

fn run_check(args: LayerArgs, quiet: bool) -> ExitCode {
    let file = match &args.config {
        Some(path) => path.display().to_string(),
        None => "no file".to_string(),
    };
    let config = match args.load() {
        Ok(config) => config,
        Err(code) => return code,
    };
    if quiet {
        return ExitCode::SUCCESS;
    }
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

async fn serve(config: Config, source: ConfigSource, file: Option<PathBuf>, workers: Workers) -> anyhow::Result<()> {
    let watch = config.config_watch_interval;
    let floodgate = Floodgate::bind(config).await?.reload_from(source).with_workers(workers);
    // Both signal handlers are in place before the ready line: a signal sent on seeing it is never missed.
    reload_on_hangup(floodgate.reloader());
    if let Some(file) = file.filter(|_| !watch.is_zero()) {
        reload_on_change(floodgate.reloader(), file, watch);
    }
    let shutdown = shutdown_signal();
    let (listen, admin) = (floodgate.listen_addr(), floodgate.admin_addr());
    let config = floodgate.config();
    for (name, upstream) in &config.upstreams {
        tracing::info!(
            upstream = %name,
            url = %upstream.url,
            // A single `url` is one endpoint, as /status lists it.
            endpoints = upstream.endpoint_list(name).map_or(0, |list| list.len()),
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
    // The one line scripts and tests wait for: on stdout, unless the access log writes there, whose format it would
    // break.
    let ready = format!("floodgate ready listen={listen} admin={admin}");
    if config.access_log_target() == AccessLogTarget::Stdout {
        eprintln!("{ready}");
    } else {
        let mut stdout = std::io::stdout();
        let _ = writeln!(stdout, "{ready}");
        let _ = stdout.flush();
    }
    let status = format!("serving listen={listen} admin={admin}");
    notify_systemd(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
    floodgate.run(shutdown).await?;
    tracing::info!("floodgate stopped");
    Ok(())
}

#[derive(Clone, Copy)]
enum Flavor {
    Serving,
    Demo,
}

/// [`build_runtime`], with a thread the OS refuses as an error rather than a panic (see [`without_panic`]).
fn start_runtime(flavor: Flavor) -> Result<tokio::runtime::Runtime, String> {
    without_panic(move || build_runtime(flavor)).and_then(|built| built.map_err(|err| err.to_string()))
}

/// The runtime `main` blocks on. Serving, it is the first of floodgate's threads that serve clients, built as the
/// others are (`floodgate::server::serving_runtime`); the demo's is tokio's multi-thread runtime.
fn build_runtime(flavor: Flavor) -> std::io::Result<tokio::runtime::Runtime> {
    match flavor {
        Flavor::Serving => floodgate::server::serving_runtime(),
        Flavor::Demo => tokio::runtime::Builder::new_multi_thread().enable_all().build(),
    }
}

/// How many threads serve clients: `threads`, else one per CPU the process may run on.
fn serving_threads(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |cpus| cpus.get()))
}

/// Runs `make` on a thread of its own and returns what it made, or the message it panicked with. tokio and
/// tracing-appender panic when the OS refuses them a thread (a process or memory limit), and tokio's unwinding then
/// waits forever for the workers it did start: here that is one line, and the stuck thread ends with the process.
fn without_panic<T: Send + 'static>(make: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let (sender, receiver) = std::sync::mpsc::channel();
    let panicked = sender.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
            (Some(text), _) => text.to_string(),
            (None, Some(text)) => text.clone(),
            (None, None) => "panicked".to_string(),
        };
        let _ = panicked.send(Err(message.split_whitespace().collect::<Vec<_>>().join(" ")));
    }));
    let started = std::thread::Builder::new()
        .name("floodgate-start".to_string())
        .spawn(move || {
            let _ = sender.send(Ok(make()));
        });
    let result = match started {
        Ok(_) => receiver
            .recv()
            .unwrap_or_else(|_| Err("the start-up thread ended without a result".to_string())),
        Err(err) => Err(format!("cannot create a thread: {err}")),
    };
    std::panic::set_hook(previous);
    result
}

fn run_demo(args: cli::demo::DemoArgs, overrides: Overrides) -> ExitCode {
    let runtime = match start_runtime(Flavor::Demo) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("floodgate: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(cli::demo::run(args, overrides)) {
        Ok(report) => {
            println!("{report}");
            if report.proves_mission() {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "floodgate demo: the run did not keep the upstream within the cap with every request answered"
                );
                ExitCode::from(1)
            }
        }
        Err(err) => {
            eprintln!("floodgate demo: {err:#}");
            ExitCode::from(1)
        }
    }
}

/// The access log's destination, opened before anything starts. Validation tried the path already, so that `check`
/// refuses it too; one that stopped opening since still stops start-up (exit 2, one line naming the key).
fn open_access_log(config: &Config) -> Result<Option<Box<dyn Write + Send>>, ExitCode> {
    use floodgate::config::AccessLogTarget;
    match config.access_log_target() {
        AccessLogTarget::Off => Ok(None),
        AccessLogTarget::Stdout => Ok(Some(Box::new(std::io::stdout()))),
        AccessLogTarget::Stderr => Ok(Some(Box::new(std::io::stderr()))),
        AccessLogTarget::File(path) => match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
            Ok(file) => Ok(Some(Box::new(file))),
            Err(err) => {
                eprintln!(
                    "floodgate: invalid configuration: access_log: cannot open {}: {err}",
                    path.display()
                );
                Err(ExitCode::from(2))
            }
        },
    }
}

/// `RUST_LOG`, when set and not empty, replaces the configured level: it is the knob everyone reaches for while
/// debugging, and must not need an edit of the file that a deployment mounts.
///
/// Access lines have a writer of their own behind a bounded queue and a thread (`tracing-appender`'s
/// non-blocking writer, lossy): a destination that cannot keep up loses lines instead of stalling requests. The
/// ordinary log stays synchronous on stderr: it is rare (shedding warnings are rate-limited), and its last lines
/// before an exit must not be lost.
/// Writes an event's message alone, for access lines in the Combined Log Format.
struct MessageOnly;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for MessageOnly
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        struct Message<'a, 'w>(&'a mut tracing_subscriber::fmt::format::Writer<'w>, std::fmt::Result);
        impl tracing::field::Visit for Message<'_, '_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.1 = write!(self.0, "{value:?}");
                }
            }
        }
        let mut message = Message(&mut writer, Ok(()));
        event.record(&mut message);
        message.1?;
        writeln!(writer)
    }
}

fn init_logging(format: LogFormat, level: &str, access: Option<tracing_appender::non_blocking::NonBlocking>) {
    use std::io::IsTerminal;
    use tracing_subscriber::filter::{filter_fn, LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{fmt, Layer, Registry};

    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|value| !value.trim().is_empty())
        .and_then(|value| match floodgate::config::log_filter(&value) {
            Ok(filter) => Some(filter),
            Err(err) => {
                eprintln!("floodgate: RUST_LOG ignored ({err}); using log_level");
                None
            }
        });
    // The configured level was validated with the configuration; the fallback only keeps this total.
    let filter = from_env.unwrap_or_else(|| {
        floodgate::config::log_filter(level).unwrap_or_else(|_| Targets::new().with_default(LevelFilter::INFO))
    });
    // Access lines go to the access log only, whatever RUST_LOG asks of floodgate's other targets.
    let filter = filter.with_target(floodgate::access::TARGET, LevelFilter::OFF);

    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = Vec::new();
    let log = match format {
        LogFormat::Human => fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        // Flattened: a log shipper finds `message` and the fields beside `level`, not under a "fields" object. A
        // line written while a request is handled carries its span (`span.id` is its X-Request-Id, see edge.rs).
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    layers.push(log.with_filter(filter).boxed());

    if let Some(writer) = access {
        // The line is the event's message, and nothing else: `access` makes it whole, in the format chosen (web-log
        // tools read a Combined one as it is).
        let access = fmt::layer().event_format(MessageOnly).with_writer(writer).boxed();
        let only_access = filter_fn(|metadata| metadata.target() == floodgate::access::TARGET);
        layers.push(access.with_filter(only_access).boxed());
    }
    tracing_subscriber::registry().with(layers).init();
}
