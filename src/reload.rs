//! Live reload: a new configuration put in force while requests keep flowing.
//!
//! Owns what a new configuration changes and in which order: everything is read and checked first, and a
//! configuration with any problem changes nothing. Then pools whose upstream kept its address (every endpoint's
//! address and own cap) and protocol take the new limits in place (the pool itself enforces a changed cap), new upstreams get
//! pools, the new routes go in force in one swap, and pools whose upstream was removed or moved are retired to
//! drain. Listener settings apply to connections accepted from then on; the keys that need new sockets or a new
//! process are reported, not applied. It never binds a socket and never counts connections.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::config::{Config, ConfigError, ConfigErrors, UpstreamConfig};
use crate::metrics::Metrics;
use crate::pool::UpstreamPool;
use crate::route::Router;
pub use crate::state::ConfigSource;
use crate::state::State;
use crate::tls::UpstreamTls;
use crate::upstream_lane::{Spawner, UpstreamLane};

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("nothing to reload from: floodgate was started without a configuration source")]
    NoSource,
    #[error("configuration refused, the running one stays: {0}")]
    Invalid(ConfigErrors),
}

/// What a reload did.
#[derive(Debug, Default)]
pub struct Reloaded {
    /// Keys whose new values are in force, as `key: old -> new`.
    pub changed: Vec<String>,
    /// Keys that changed in the configuration but keep their running value until a restart.
    pub needs_restart: Vec<String>,
}

type Reconfigured = (
    Arc<UpstreamPool>,
    UpstreamConfig,
    Option<UpstreamTls>,
    Option<Vec<(crate::config::Origin, usize)>>,
);

/// The pools and routes a configuration asks for, worked out against the ones running, not yet in force.
pub struct Plan {
    router: Router,
    /// Pools kept, with their new limits, TLS client and (when it changed) endpoint list.
    reconfigure: Vec<Reconfigured>,
    retire: Vec<Arc<UpstreamPool>>,
}

impl Plan {
    /// Reuses each running pool whose upstream has the same name and endpoints (addresses and own caps); builds
    /// the others. `clients` are
    /// [`upstream_clients`]' for this configuration.
    /// `draining`: pools earlier reloads retired that still have connections; one of an upstream's name that is
    /// back after a reload removed it is the new pool's predecessor, so that its connections count against the
    /// new cap too.
    pub fn new(
        config: &Config,
        metrics: &Metrics,
        running: Option<&Router>,
        draining: &[Arc<UpstreamPool>],
        mut clients: UpstreamClients,
        lane: &Arc<UpstreamLane>,
    ) -> Result<Plan, ConfigError> {
        let mut pools = BTreeMap::new();
        let mut reconfigure = Vec::new();
        for (name, upstream) in &config.upstreams {
            let endpoints = upstream.endpoint_list(name)?;
            let tls = clients.remove(name).flatten();
            // A changed list of `endpoints` (an address, an endpoint's own cap, one added or removed) is changed in
            // place: kept endpoints keep their connections, new ones join, gone ones drain (`membership`). The same
            // endpoints in another order are no change at all. A new `url`, a list for a url or the reverse, a
            // changed scheme or protocol (an HTTP/1 connection cannot carry an HTTP/2 stream, nor the reverse) is
            // a new pool: the old one drains, its sockets counted against the new one's cap until they close.
            let kept = running
                .and_then(|router| router.pools().get(name))
                .filter(|pool| pool.limits().protocol == upstream.protocol)
                .and_then(|pool| {
                    // Discovered endpoints: the discovery puts its set in force (see `pool::discovery`).
                    if let Some(dns) = upstream.endpoints.dns() {
                        let kept = !pool.limits().endpoints.is_empty() && dns.scheme() == Some(pool.origin.scheme);
                        return kept.then_some((pool, None));
                    }
                    let live = pool.live_endpoints();
                    if crate::pool::same_set(&live, &endpoints) {
                        return Some((pool, None));
                    }
                    let lists = !pool.limits().endpoints.is_empty() && !upstream.endpoints.is_empty();
                    let scheme = endpoints.iter().all(|(origin, _)| origin.scheme == pool.origin.scheme);
                    (lists && scheme).then(|| (pool, Some(endpoints.clone())))
                });
            let pool = match kept {
                Some((pool, changed)) => {
                    reconfigure.push((pool.clone(), upstream.clone(), tls, changed));
                    pool.clone()
                }
                // Its connections and timers run in the upstream lane.
                // A pool of the same name it replaces hands on its tunnels' count: they run on until they end,
                // and the upstream's bound holds over both.
                None => UpstreamPool::with_endpoints_on(
                    name,
                    endpoints,
                    upstream.clone(),
                    tls,
                    metrics.upstream(name),
                    Spawner::Lane(lane.clone()),
                    running
                        .and_then(|router| router.pools().get(name))
                        .or_else(|| draining.iter().rev().find(|old| &*old.name == name.as_str()))
                        .map(|old| &**old),
                ),
            };
            pools.insert(name.clone(), pool);
        }
        let mut routes = Vec::new();
        for (index, route) in config.routes.iter().enumerate() {
            let pool = pools.get(&route.upstream).cloned().ok_or_else(|| {
                ConfigError::new(
                    format!("routes[{index}].upstream"),
                    format!("unknown upstream `{}`", route.upstream),
                )
            })?;
            routes.push((route.clone(), pool));
        }
        let retire = running
            .map(|router| {
                router
                    .pools()
                    .values()
                    .filter(|old| !pools.values().any(|new| Arc::ptr_eq(old, new)))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Ok(Plan {
            router: Router::new(routes, pools),
            reconfigure,
            retire,
        })
    }

    /// The router for a proxy that is only starting: nothing runs yet to change. Reads the upstreams' TLS files.
    pub fn starting(config: &Config, metrics: &Metrics, lane: &Arc<UpstreamLane>) -> Result<Router, ConfigError> {
        Ok(Plan::new(config, metrics, None, &[], upstream_clients(config)?, lane)?.into_router())
    }

    /// The router for a proxy that is only starting: nothing runs yet to change.
    pub fn into_router(self) -> Router {
        self.router
    }
}

/// Each `https://` upstream's TLS client, by upstream name (`None` for `http://`).
pub type UpstreamClients = BTreeMap<String, Option<UpstreamTls>>;

/// Reads what each upstream's TLS client needs (the CA bundle or the system's roots, the client certificate):
/// blocking file reads, done once per start-up or reload, never per dial.
pub fn upstream_clients(config: &Config) -> Result<UpstreamClients, ConfigError> {
    let mut clients = BTreeMap::new();
    for (name, upstream) in &config.upstreams {
        let endpoints = upstream.endpoint_list(name)?;
        // Discovered endpoints share the name's scheme and the name verified.
        let discovered = upstream.endpoints.dns().map(crate::config::DnsEndpoints::origin);
        let Some(origin) = discovered.as_ref().or(endpoints.first().map(|(origin, _)| origin)) else {
            return Err(ConfigError::new(format!("upstreams.{name}.url"), "no endpoint"));
        };
        // Every endpoint shares the scheme and the name verified (see `endpoint_list`): one client serves all.
        let tls = crate::tls::upstream_client(name, upstream, origin).map_err(|problems| {
            problems
                .into_iter()
                .next()
                .unwrap_or_else(|| ConfigError::new(format!("upstreams.{name}"), "TLS settings refused"))
        })?;
        clients.insert(name.clone(), tls);
    }
    Ok(clients)
}

/// A reloaded configuration with every file it names already read, ready to be put in force.
struct Loaded {
    config: Config,
    needs_restart: Vec<String>,
    listener_tls: Option<Arc<rustls::ServerConfig>>,
    clients: UpstreamClients,
}

/// The blocking part of a reload: the layers, then every certificate and key they name.
fn load(source: &ConfigSource, running: &Config) -> Result<Loaded, ConfigErrors> {
    let mut config = source()?;
    let mut needs_restart = Vec::new();
    keep_restart_only(running, &mut config, &mut needs_restart);
    // Certificates are read again even when their paths did not change: renewing them is the usual reason.
    let listener_tls = crate::tls::server_config(&config)?;
    let clients = upstream_clients(&config)?;
    Ok(Loaded {
        config,
        needs_restart,
        listener_tls,
        clients,
    })
}

/// Reads the configuration again and puts it in force, or changes nothing and says why. One at a time.
pub async fn reload(state: &State) -> Result<Reloaded, ReloadError> {
    let _one_at_a_time = state.reloading.lock().await;
    let source = state.source.get().cloned().ok_or(ReloadError::NoSource)?;
    // Reading files is blocking work; the current-thread runtime must not stall on it.
    let running = state.config.load_full();
    let loaded = tokio::task::spawn_blocking(move || load(&source, &running))
        .await
        .map_err(|err| {
            ReloadError::Invalid(ConfigError::new("configuration", format!("reading failed: {err}")).into())
        });
    let result = match loaded {
        Ok(Ok(loaded)) => apply(state, loaded),
        Ok(Err(errors)) => Err(ReloadError::Invalid(errors)),
        Err(err) => Err(err),
    };
    match &result {
        Ok(reloaded) => {
            state.proxy.metrics.reloaded(true);
            tracing::info!(changed = ?reloaded.changed, "configuration reloaded");
            for key in &reloaded.needs_restart {
                tracing::warn!(key = %key, "changed in the configuration; takes effect at the next restart");
            }
        }
        Err(err) => {
            state.proxy.metrics.reloaded(false);
            match err {
                ReloadError::Invalid(errors) => {
                    for problem in errors.problems() {
                        tracing::error!(problem = %problem, "reload refused; the running configuration stays");
                    }
                }
                other => tracing::error!(error = %other, "reload refused"),
            }
        }
    }
    result
}

fn apply(state: &State, loaded: Loaded) -> Result<Reloaded, ReloadError> {
    let Loaded {
        config,
        needs_restart,
        listener_tls: tls,
        clients,
    } = loaded;
    let running = state.config.load_full();
    let mut reloaded = Reloaded {
        needs_restart,
        ..Reloaded::default()
    };
    let plan = Plan::new(
        &config,
        &state.proxy.metrics,
        Some(&state.proxy.router()),
        &state.proxy.draining(),
        clients,
        state.proxy.lane(),
    )
    .map_err(|problem| ReloadError::Invalid(problem.into()))?;

    // Nothing can fail from here on.
    reloaded.changed = changed_keys(&running, &config);
    if tls.is_some() && !reloaded.changed.iter().any(|c| c.starts_with("tls")) {
        reloaded.changed.push("tls certificates: read again".to_string());
    }
    for (pool, limits, tls, endpoints) in plan.reconfigure {
        pool.reconfigure(limits, tls);
        if let Some(endpoints) = endpoints {
            pool.set_endpoints(&endpoints);
        }
    }
    // Pools with `replicas` count them (a new pool starts from its predecessor's count meanwhile), and pools
    // whose endpoints are discovered resolve them now.
    for pool in plan.router.pools().values() {
        let counting = pool.clone();
        pool.spawn(async move {
            counting.count_replicas().await;
            counting.discover_endpoints().await;
        });
    }
    state
        .proxy
        .replace_router(plan.router, config.trusted_proxies.clone(), plan.retire);
    state.tls.store(tls);
    resize_client_room(state, running.max_client_connections, config.max_client_connections);
    state.proxy.buffers().set_limit(config.max_buffered_bytes);
    state.config.store(Arc::new(config));
    Ok(reloaded)
}

/// Copies the values a reload cannot apply from `running` into `new`, naming each that differed: they need new
/// sockets, a new runtime or a new logger.
fn keep_restart_only(running: &Config, new: &mut Config, needs_restart: &mut Vec<String>) {
    // Each key once: compared, named if it differs, and given its running value back.
    macro_rules! keep {
        ($($key:ident),*) => {$(
            if running.$key != new.$key {
                needs_restart.push(stringify!($key).to_string());
                new.$key = running.$key.clone();
            }
        )*};
    }
    keep!(
        listen,
        admin,
        threads,
        log_format,
        log_level,
        access_log,
        access_log_format,
        access_log_fields,
        access_log_request_headers,
        access_log_response_headers,
        access_log_header_bytes,
        access_log_unredacted,
        proxy_protocol,
        config_watch_interval,
        otlp_endpoint,
        otlp_service_name
    );
    // A listener is TLS or plain for its life; its certificates can change, its kind cannot.
    let tls_on = |config: &Config| config.tls_cert.is_some() || !config.tls_certificates.is_empty();
    if tls_on(running) != tls_on(new) {
        needs_restart.push("tls_cert (turning TLS on or off)".to_string());
        new.tls_cert = running.tls_cert.clone();
        new.tls_key = running.tls_key.clone();
        new.tls_certificates = running.tls_certificates.clone();
    }
}

/// `key: old -> new` for every leaf that differs, secrets shown only as changed.
fn changed_keys(running: &Config, new: &Config) -> Vec<String> {
    let mut changed = Vec::new();
    match (toml::Value::try_from(running), toml::Value::try_from(new)) {
        (Ok(old), Ok(new_value)) => diff("", Some(&old), Some(&new_value), &mut changed),
        _ => changed.push("(the configuration could not be compared)".to_string()),
    }
    if running.admin_token != new.admin_token {
        changed.push("admin_token: changed".to_string());
    }
    changed
}

fn diff(path: &str, old: Option<&toml::Value>, new: Option<&toml::Value>, out: &mut Vec<String>) {
    match (old, new) {
        (Some(toml::Value::Table(old)), Some(toml::Value::Table(new))) => {
            let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
            for key in keys {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                diff(&child, old.get(key), new.get(key), out);
            }
        }
        (Some(old), Some(new)) if old == new => {}
        (Some(toml::Value::Table(_)), None) => out.push(format!("{path}: removed")),
        (None, Some(toml::Value::Table(_))) => out.push(format!("{path}: added")),
        (old, new) => out.push(format!("{path}: {} -> {}", show(old), show(new))),
    }
}

fn show(value: Option<&toml::Value>) -> String {
    value.map_or_else(|| "(unset)".to_string(), ToString::to_string)
}

/// A raised `max_client_connections` lets waiting clients in at once; a lowered one takes permits as connections
/// close, so no new client is accepted until fewer than the new limit are open.
fn resize_client_room(state: &State, from: usize, to: usize) {
    if to > from {
        state.client_room.add_permits(to - from);
    } else if from > to {
        let room = state.client_room.clone();
        let Ok(surplus) = u32::try_from(from - to) else {
            return;
        };
        tokio::spawn(async move {
            if let Ok(permits) = room.acquire_many_owned(surplus).await {
                permits.forget();
            }
        });
    }
}
