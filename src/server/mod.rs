//! The listeners: binding, the accept loop, and graceful shutdown.
//!
//! Owns start-up (pools and routes built from the config, both listeners bound) and the lifecycle: accepting
//! never waits on an upstream, `max_client_connections` bounds what is accepted, each new connection takes the
//! listener settings in force when it was accepted (a reload changes them for later ones), and on shutdown
//! `/readyz` turns 503, accepting goes on for `drain_time` and then stops, and in-flight and queued requests get
//! `shutdown_timeout` to finish.

mod connection;
mod h1_conn;
mod h2_frames;
mod proxy_header;
mod workers;

use workers::Job;
pub use workers::{serving_runtime, Workers};

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::reload::{self, Plan, ReloadError, Reloaded};
use crate::state::ConfigSource;
pub use crate::state::State;
use crate::upstream_lane::UpstreamLane;

/// Why floodgate could not start. Each message leaves its cause to the error's source, which a chain printer
/// (`anyhow`'s `{:#}`) adds after it: saying it in both printed it twice.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration")]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot start the upstream lane's thread")]
    Lane(#[source] std::io::Error),
    #[error("cannot start exporting traces to otlp_endpoint: {0}")]
    Tracing(String),
}

/// A bound, not yet running floodgate.
pub struct Floodgate {
    listener: TcpListener,
    admin: TcpListener,
    state: Arc<State>,
    workers: Workers,
}

/// A handle that reloads a running floodgate.
#[derive(Clone)]
pub struct Reloader(Arc<State>);

impl Reloader {
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        reload::reload(&self.0).await
    }
}

impl Floodgate {
    /// Builds the pools and routes and binds both listeners. Must run inside a tokio runtime. Without a
    /// [`Floodgate::reload_from`] source, a reload has nothing to read and is refused.
    pub async fn bind(config: Config) -> Result<Floodgate, StartError> {
        let metrics = Arc::new(Metrics::new());
        let lane = UpstreamLane::new();
        // On a multi-thread runtime (a library user's), the lane gets its own thread (see upstream_lane); on a
        // current-thread one (floodgate's threads, `Workers`), `run` drives it ahead of the client connections.
        if tokio::runtime::Handle::current().runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            lane.start_thread().map_err(StartError::Lane)?;
        }
        let router = Plan::starting(&config, &metrics, &lane)?;
        // With `replicas`, a pool's share comes from the first count, read before anything is served: a replica
        // never starts with the whole total (see pool::replicas).
        // Discovered endpoints too: the first resolution is waited for as long, so the first requests find them.
        for pool in router.pools().values() {
            let _ = tokio::time::timeout(REPLICA_COUNT_AT_START, pool.count_replicas()).await;
            let _ = tokio::time::timeout(REPLICA_COUNT_AT_START, pool.discover_endpoints()).await;
        }
        let access_log = crate::access::Settings::of(&config);
        let tracing = match config.otlp_endpoint.as_str() {
            "" => None,
            endpoint => {
                Some(crate::trace::Tracing::start(endpoint, &config.otlp_service_name).map_err(StartError::Tracing)?)
            }
        };
        let proxy = Proxy::new(router, metrics, config.trusted_proxies.clone(), lane)
            .with_access_log(access_log)
            .with_tracing(tracing);
        proxy.buffers().set_limit(config.max_buffered_bytes);
        // Validation read these files already; reading them again here keeps a file changed in between from
        // slipping through, and this is the copy the listener serves.
        let tls = crate::tls::server_config(&config)?;
        let listener = bind(config.listen).await?;
        let admin = bind(config.admin).await?;
        Ok(Floodgate {
            listener,
            admin,
            state: Arc::new(State {
                proxy: Arc::new(proxy),
                ready: AtomicBool::new(true),
                client_room: Arc::new(Semaphore::new(config.max_client_connections)),
                config: ArcSwap::from_pointee(config),
                tls: ArcSwapOption::new(tls),
                source: std::sync::OnceLock::new(),
                reloading: tokio::sync::Mutex::new(()),
            }),
            workers: Workers::none(),
        })
    }

    /// Serves clients on `workers` beside the thread [`Floodgate::run`] is awaited on, each with an upstream lane
    /// of its own. For the lanes to run ahead of the client connections, `run` must be awaited in a current-thread
    /// runtime's `block_on`, as `main` does.
    pub fn with_workers(mut self, workers: Workers) -> Floodgate {
        self.workers = workers;
        self
    }

    /// Where a reload reads the configuration from: the same layers as the one given to [`Floodgate::bind`].
    pub fn reload_from(self, source: ConfigSource) -> Floodgate {
        // Only the first source counts: the layers a process was started with do not change.
        let _ = self.state.source.set(source);
        self
    }

    pub fn reloader(&self) -> Reloader {
        Reloader(self.state.clone())
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .unwrap_or_else(|_| self.state.config.load().listen)
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .unwrap_or_else(|_| self.state.config.load().admin)
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.state.config.load_full()
    }

    /// Serves until `shutdown` resolves, then drains for at most `shutdown_timeout`.
    ///
    /// On a current-thread runtime the upstream lane ([`crate::upstream_lane`]) runs inside this future: await it
    /// directly in the runtime's `block_on` (as `main` does, with a small `event_interval`), not in a spawned task,
    /// for the lane to run ahead of the client connections.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), StartError> {
        let lane = self.state.proxy.lane().run();
        tokio::select! {
            biased;
            () = lane => Ok(()),
            served = self.serve(shutdown) => served,
        }
    }

    async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), StartError> {
        let Floodgate {
            listener,
            admin,
            state,
            mut workers,
        } = self;
        let stop = CancellationToken::new();
        let admin_task = tokio::spawn(admin::serve(admin, state.clone(), stop.clone()));
        let connections = TaskTracker::new();
        let draining = CancellationToken::new();
        {
            let state = state.clone();
            let draining = draining.clone();
            tokio::spawn(async move {
                shutdown.await;
                // /readyz must say so before anything else changes.
                state.ready.store(false, Ordering::SeqCst);
                // Load balancers that see /readyz fail move new clients away meanwhile; nothing else changes yet.
                let drain_time = state.config.load().drain_time;
                if !drain_time.is_zero() {
                    tracing::info!(drain_time = ?drain_time, "stopping: /readyz fails, still accepting for drain_time");
                    tokio::time::sleep(drain_time).await;
                }
                draining.cancel();
            });
        }
        accept_loop(&listener, &state, &connections, &draining, &mut workers).await;
        drop(listener);
        tracing::info!(
            in_flight = connections.len(),
            "shutting down: no longer accepting, draining"
        );
        connections.close();
        let tunnels = state.proxy.tunnel_tasks();
        tunnels.close();
        let shutdown_timeout = state.config.load().shutdown_timeout;
        let deadline = tokio::time::Instant::now() + shutdown_timeout;
        // Tunnels run until they end or shutdown_timeout passes, like any client connection.
        let both = || async { tokio::join!(connections.wait(), tunnels.wait()) };
        let drained = tokio::time::timeout_at(deadline, both()).await.is_ok();
        if !drained {
            tracing::warn!(
                remaining = connections.len() + tunnels.len(),
                timeout = ?shutdown_timeout,
                "shutdown_timeout passed with connections still open"
            );
            // Tunnels end now, each writing its line and handing its socket to be closed; a moment for that.
            state.proxy.stop_tunnels();
            let _ = tokio::time::timeout(TUNNELS_STOPPING, both()).await;
        }
        upstreams_done(&state.proxy.all_pools(), deadline).await;
        drop(workers);
        stop.cancel();
        let _ = admin_task.await;
        Ok(())
    }
}

/// How long start-up waits for an upstream's first replica count (a DNS answer, say) before it goes on with the last
/// one it has (none: a share of the whole).
const REPLICA_COUNT_AT_START: Duration = Duration::from_secs(5);

/// How long tunnels ended at `shutdown_timeout` are given to write their lines and hand their sockets over.
const TUNNELS_STOPPING: Duration = Duration::from_millis(500);

/// Idle upstream connections close now; connections the upstream is still working on for requests already
/// answered (a timed-out exchange, an abandoned body being drained) are waited for until `deadline`, so the
/// upstream is not cut off mid-response by the exit.
async fn upstreams_done(pools: &[Arc<crate::pool::UpstreamPool>], deadline: tokio::time::Instant) {
    for pool in pools {
        pool.retire();
    }
    let busy: usize = pools
        .iter()
        .map(|pool| {
            let snapshot = pool.snapshot();
            snapshot.connections_open + snapshot.tunnels_open
        })
        .sum();
    if busy == 0 {
        return;
    }
    tracing::info!(
        connections = busy,
        "waiting for the upstreams to finish work already sent to them"
    );
    let closed = futures_util::future::join_all(pools.iter().map(|pool| pool.connections_closed()));
    if tokio::time::timeout_at(deadline, closed).await.is_err() {
        tracing::warn!("shutdown_timeout passed with upstream connections still at work; they are closed");
    }
}

/// Binds with a deep accept backlog: bursts of new clients wait in the kernel rather than being refused (tokio's
/// `TcpListener::bind` asks for 128; the kernel caps the request at `net.core.somaxconn`).
async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    let listen = || -> std::io::Result<TcpListener> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(4096)
    };
    listen().map_err(|source| StartError::Bind { addr, source })
}

async fn accept_loop(
    listener: &TcpListener,
    state: &Arc<State>,
    connections: &TaskTracker,
    draining: &CancellationToken,
    workers: &mut Workers,
) {
    let limit = &state.client_room;
    let metrics = state.proxy.metrics.clone();
    // Accepts failed in a row: the first is logged as a warning, the rest at debug level until one succeeds.
    let mut failed_accepts: u64 = 0;
    loop {
        // Wait for room first: past max_client_connections, new clients wait in the kernel's backlog.
        let permit = tokio::select! {
            biased;
            _ = draining.cancelled() => return,
            permit = limit.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            biased;
            _ = draining.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if failed_accepts > 0 {
                    tracing::info!(failed_accepts, "accepting again");
                    failed_accepts = 0;
                }
                let proxy = state.proxy.clone();
                let config = state.config.load_full();
                let draining = draining.clone();
                let open = OpenClient::new(metrics.client_connections.clone(), permit);
                let tls = state.tls.load_full().map(TlsAcceptor::from);
                let tracker = connections.clone();
                let serve = move |stream| {
                    let task = connection::serve(stream, peer, tls, proxy, config, draining, open, tracker.clone());
                    tracker.spawn(task);
                };
                let Some(worker) = workers.next_turn() else {
                    serve(stream);
                    continue;
                };
                // The socket moves to the worker's own I/O driver; a worker that has stopped leaves it here.
                let stream = match stream.into_std() {
                    Ok(stream) => stream,
                    Err(err) => {
                        tracing::debug!(error = %err, "cannot hand an accepted connection to a worker");
                        continue;
                    }
                };
                let job: Job = Box::new(move || match tokio::net::TcpStream::from_std(stream) {
                    Ok(stream) => serve(stream),
                    Err(err) => tracing::debug!(error = %err, "a worker cannot take an accepted connection"),
                });
                if let Err(tokio::sync::mpsc::error::SendError(job)) = worker.send(job) {
                    job();
                }
            }
            Err(err) => {
                // Typically out of file descriptors: back off instead of spinning on the same error, and say so
                // once per episode rather than at every retry.
                if failed_accepts == 0 {
                    tracing::warn!(error = %err, "accept failed; backing off, retrying every 100ms");
                } else {
                    tracing::debug!(error = %err, "accept failed again");
                }
                failed_accepts += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One open client connection, for as long as it lives, however its task (or tasks) end: counted in
/// `floodgate_client_connections`, and holding its place among `max_client_connections`.
pub(super) struct OpenClient {
    gauge: prometheus_client::metrics::gauge::Gauge,
    _room: tokio::sync::OwnedSemaphorePermit,
}

impl OpenClient {
    fn new(gauge: prometheus_client::metrics::gauge::Gauge, room: tokio::sync::OwnedSemaphorePermit) -> Self {
        gauge.inc();
        OpenClient { gauge, _room: room }
    }
}

impl Drop for OpenClient {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}
