//! The listeners: binding, the accept loop, and graceful shutdown.
//!
//! Owns start-up (pools and routes built from the config, both listeners bound) and the lifecycle: accepting
//! never waits on an upstream, `max_client_connections` bounds what is accepted, and on shutdown `/readyz` turns
//! 503, accepting stops, and in-flight and queued requests get `shutdown_timeout` to finish.

pub mod activity;
mod connection;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin;
use crate::config::{Config, Origin};
use crate::metrics::Metrics;
use crate::pool::UpstreamPool;
use crate::proxy::Proxy;
use crate::route::Router;

/// Why floodgate could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
}

/// What the admin listener reads.
pub struct State {
    pub proxy: Arc<Proxy>,
    pub ready: AtomicBool,
}

/// A bound, not yet running floodgate.
pub struct Floodgate {
    config: Arc<Config>,
    listener: TcpListener,
    admin: TcpListener,
    state: Arc<State>,
    /// Present when `tls_cert`/`tls_key` or `[[tls_certificates]]` are set: every client connection is then TLS.
    tls: Option<TlsAcceptor>,
}

impl Floodgate {
    /// Builds the pools and routes and binds both listeners. Must run inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Floodgate, StartError> {
        let metrics = Arc::new(Metrics::new());
        let mut pools = BTreeMap::new();
        for (name, upstream) in &config.upstreams {
            let origin = Origin::parse(&upstream.url).map_err(|message| crate::config::ConfigError {
                key: format!("upstreams.{name}.url"),
                message,
            })?;
            // Read once here (the CA bundle or the system's roots, the client certificate), not at every dial.
            let tls = crate::tls::upstream_client(name, upstream, &origin)
                .map_err(|problems| problems.into_iter().next().unwrap_or_else(|| unknown_tls_problem(name)))?;
            let pool = UpstreamPool::new(name, origin, upstream.clone(), tls, metrics.upstream(name));
            pools.insert(name.clone(), pool);
        }
        let mut routes = Vec::new();
        for (index, route) in config.routes.iter().enumerate() {
            let pool = pools
                .get(&route.upstream)
                .cloned()
                .ok_or_else(|| crate::config::ConfigError {
                    key: format!("routes[{index}].upstream"),
                    message: format!("unknown upstream `{}`", route.upstream),
                })?;
            routes.push((route.host.clone(), route.path_prefix.clone(), pool));
        }
        let access_log = config.access_log_target() != crate::config::AccessLogTarget::Off;
        let proxy =
            Proxy::new(Router::new(routes), pools, metrics, config.trusted_proxies.clone()).with_access_log(access_log);
        // Validation read these files already; reading them again here keeps a file changed in between from
        // slipping through, and this is the copy the listener serves.
        let tls = crate::tls::server_config(&config)?.map(TlsAcceptor::from);
        let listener = bind(config.listen).await?;
        let admin = bind(config.admin).await?;
        Ok(Floodgate {
            config: Arc::new(config),
            listener,
            admin,
            state: Arc::new(State {
                proxy: Arc::new(proxy),
                ready: AtomicBool::new(true),
            }),
            tls,
        })
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.config.listen)
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.config.admin)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Serves until `shutdown` resolves, then drains for at most `shutdown_timeout`.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), StartError> {
        let Floodgate {
            config,
            listener,
            admin,
            state,
            tls,
        } = self;
        let stop = CancellationToken::new();
        let admin_task = tokio::spawn(admin::serve(admin, state.clone(), stop.clone()));
        let connections = TaskTracker::new();
        let limit = Arc::new(Semaphore::new(config.max_client_connections));
        let draining = CancellationToken::new();
        {
            let state = state.clone();
            let draining = draining.clone();
            tokio::spawn(async move {
                shutdown.await;
                // /readyz must say so before anything else changes.
                state.ready.store(false, Ordering::SeqCst);
                draining.cancel();
            });
        }
        accept_loop(
            &listener,
            &state,
            &config,
            tls.as_ref(),
            &limit,
            &connections,
            &draining,
        )
        .await;
        drop(listener);
        tracing::info!(
            in_flight = connections.len(),
            "shutting down: no longer accepting, draining"
        );
        connections.close();
        let drained = tokio::time::timeout(config.shutdown_timeout, connections.wait())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(
                remaining = connections.len(),
                timeout = ?config.shutdown_timeout,
                "shutdown_timeout passed with connections still open"
            );
        }
        for pool in state.proxy.pools.values() {
            pool.close_idle();
        }
        stop.cancel();
        let _ = admin_task.await;
        Ok(())
    }
}

/// `upstream_client` reports at least one problem when it fails; this stands in should it ever not.
fn unknown_tls_problem(name: &str) -> crate::config::ConfigError {
    crate::config::ConfigError {
        key: format!("upstreams.{name}.url"),
        message: "the TLS client could not be built".to_string(),
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
    config: &Arc<Config>,
    tls: Option<&TlsAcceptor>,
    limit: &Arc<Semaphore>,
    connections: &TaskTracker,
    draining: &CancellationToken,
) {
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
                let config = config.clone();
                let draining = draining.clone();
                let metrics = metrics.clone();
                let tls = tls.cloned();
                connections.spawn(async move {
                    let _open = OpenClient::new(&metrics.client_connections);
                    connection::serve(stream, peer, tls, proxy, config, draining).await;
                    drop(permit);
                });
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

/// Counts one open client connection for as long as it lives, however its task ends.
struct OpenClient<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> OpenClient<'a> {
    fn new(gauge: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        OpenClient(gauge)
    }
}

impl Drop for OpenClient<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
