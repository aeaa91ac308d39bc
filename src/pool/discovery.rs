//! Endpoints discovered from DNS (`endpoints = { dns, port, max_connections, interval, nameserver }`): every A and
//! AAAA record of the name an endpoint at the port, each with its own cap, resolved once before floodgate serves and
//! again every `interval`, the set put in force in place (`membership`: kept endpoints keep their connections, new
//! ones join under slow start, gone ones drain). A resolution that fails or finds no address keeps the set in force,
//! counted by its reason and logged once per change of what is wrong. It never counts connections.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::UpstreamPool;
use crate::config::{DnsEndpoints, Origin};

/// Why a resolution was not taken; the endpoints in force stay.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Unresolved {
    #[error("the name does not resolve ({0})")]
    Failed(String),
    #[error("the name resolves to no address")]
    Empty,
}

impl Unresolved {
    pub(super) const REASONS: [&'static str; 2] = ["failed", "empty"];

    fn reason(&self) -> &'static str {
        match self {
            Unresolved::Failed(_) => "failed",
            Unresolved::Empty => "empty",
        }
    }
}

/// The distinct addresses `source`'s name resolves to now.
pub(super) async fn resolve(source: &DnsEndpoints) -> Result<BTreeSet<IpAddr>, Unresolved> {
    let found: BTreeSet<IpAddr> = match source.nameserver {
        None => tokio::net::lookup_host((source.dns.as_str(), source.port))
            .await
            .map_err(|err| Unresolved::Failed(err.to_string()))?
            .map(|address| address.ip())
            .collect(),
        Some(server) => {
            use hickory_resolver::config::{NameServerConfig, ResolverConfig};
            let mut name_server = NameServerConfig::udp(server.ip());
            for connection in &mut name_server.connections {
                connection.port = server.port();
            }
            let mut builder = hickory_resolver::Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![name_server]),
                hickory_resolver::net::runtime::TokioRuntimeProvider::default(),
            );
            // Each interval asks again: a cached answer would hide a rollout for its TTL.
            builder.options_mut().cache_size = 0;
            let resolver = builder.build().map_err(|err| Unresolved::Failed(err.to_string()))?;
            resolver
                .lookup_ip(source.dns.as_str())
                .await
                .map_err(|err| Unresolved::Failed(err.to_string()))?
                .iter()
                .collect()
        }
    };
    if found.is_empty() {
        return Err(Unresolved::Empty);
    }
    Ok(found)
}

impl UpstreamPool {
    /// Resolves the endpoints once now (start-up waits for it, so the first requests find them), then keeps
    /// resolving them every `interval` while the pool exists and its endpoints are discovered.
    pub async fn discover_endpoints(self: &Arc<Self>) {
        let Some(source) = self.limits().endpoints.dns().cloned() else {
            return;
        };
        if !self.discovering.swap(true, Ordering::AcqRel) {
            self.metrics.discovery_known(Unresolved::REASONS);
            self.spawn(watch(Arc::downgrade(self)));
        }
        self.resolved(&source, resolve(&source).await);
    }

    /// Puts a resolution in force, or keeps the endpoints in force and says why (in the metrics each time, in the
    /// log once per change of what is wrong).
    fn resolved(self: &Arc<Self>, source: &DnsEndpoints, found: Result<BTreeSet<IpAddr>, Unresolved>) {
        let mut refused = self
            .discovery_refused
            .lock()
            // Only ever replaced whole; a panic elsewhere cannot leave it half-changed.
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match found {
            Ok(addresses) => {
                if refused.take().is_some() {
                    tracing::info!(upstream = %self.name, name = %source.dns, "endpoints resolve again");
                }
                drop(refused);
                let scheme = source.scheme().unwrap_or(self.origin.scheme);
                let wanted: Vec<(Origin, usize)> = addresses
                    .into_iter()
                    .map(|ip| {
                        let origin = Origin {
                            scheme,
                            host: ip.to_string(),
                            port: source.port,
                        };
                        (origin, source.max_connections)
                    })
                    .collect();
                if !super::same_set(&self.live_endpoints(), &wanted) {
                    self.set_endpoints(&wanted);
                }
            }
            Err(why) => {
                self.metrics.discovery_refused(why.reason());
                if refused.as_ref() != Some(&why) {
                    tracing::warn!(upstream = %self.name, name = %source.dns, reason = why.reason(),
                        endpoints = self.endpoint_count(),
                        "cannot resolve the endpoints: {why}; keeping the endpoints in force");
                    *refused = Some(why);
                }
            }
        }
    }
}

async fn watch(pool: Weak<UpstreamPool>) {
    loop {
        let Some(source) = pool.upgrade().and_then(|pool| pool.limits().endpoints.dns().cloned()) else {
            if let Some(pool) = pool.upgrade() {
                // A reload listed the endpoints instead: the list is in force, nothing to resolve.
                pool.discovering.store(false, Ordering::Release);
            }
            return;
        };
        tokio::time::sleep(source.interval).await;
        let found = resolve(&source).await;
        let Some(pool) = pool.upgrade() else { return };
        if pool.is_retired() {
            return;
        }
        // A reload may have changed or ended the discovery while this one was asked.
        if pool.limits().endpoints.dns() == Some(&source) {
            pool.resolved(&source, found);
        }
    }
}
