//! What the listeners, the admin listener and a reload share: the proxy, the configuration in force, readiness,
//! the client listener's TLS and connection budget, and where a reload reads the configuration. Plain shared data:
//! `server` makes it, `reload` changes it, `admin` reads it; it never acts itself.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::sync::Semaphore;

use crate::config::{Config, ConfigErrors};
use crate::proxy::Proxy;

/// Reads the configuration again, from the same layers as at start-up.
pub type ConfigSource = Arc<dyn Fn() -> Result<Config, ConfigErrors> + Send + Sync>;

/// What the listeners, the admin listener and a reload share.
pub struct State {
    pub proxy: Arc<Proxy>,
    pub ready: AtomicBool,
    /// The configuration in force; new client connections read their settings from it.
    pub config: ArcSwap<Config>,
    /// Present when `tls_cert` and `tls_key` are set: every client connection is then TLS.
    pub(crate) tls: ArcSwapOption<rustls::ServerConfig>,
    /// Bounds open client connections at `max_client_connections`.
    pub(crate) client_room: Arc<Semaphore>,
    /// Set once, by [`Floodgate::reload_from`], whether or not a [`Reloader`] was taken before.
    pub(crate) source: std::sync::OnceLock<ConfigSource>,
    pub(crate) reloading: tokio::sync::Mutex<()>,
}
