//! Routing: which upstream a request goes to.
//!
//! Owns the matching rules: Host compared case-insensitively with any port and a trailing dot ignored
//! (`:authority` for HTTP/2), path prefixes matched on segment boundaries, the most specific route first, and the
//! upstreams those routes lead to. A reload replaces the whole router at once, so a request sees either the old
//! routes and pools or the new ones. It never changes the request: paths are forwarded as they came.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::pool::UpstreamPool;

struct Route {
    host: Option<String>,
    prefix: Option<String>,
    pool: Arc<UpstreamPool>,
    picked: Picked,
}

/// What a request learns from the route it matched, beyond the upstream.
#[derive(Debug, Clone)]
pub struct Picked {
    /// `host/prefix` (`*` for any host): the key of fair sharing by route.
    pub label: Arc<str>,
    /// The priority class of the route's requests.
    pub priority: u8,
    /// Its requests' time and bytes as their clients see them.
    pub metrics: crate::metrics::RouteMetrics,
}

/// The routes, most specific first: host and prefix, then host, then the longest prefix, then catch-alls; and
/// every configured upstream's pool by name, routed to or not.
pub struct Router {
    routes: Vec<Route>,
    pools: BTreeMap<String, Arc<UpstreamPool>>,
}

impl Router {
    /// Each route is its host, its path prefix, its upstream's pool and its priority class.
    pub fn new(
        routes: impl IntoIterator<Item = (Option<String>, Option<String>, Arc<UpstreamPool>, u8)>,
        pools: BTreeMap<String, Arc<UpstreamPool>>,
    ) -> Router {
        let mut routes: Vec<Route> = routes
            .into_iter()
            .map(|(host, prefix, pool, priority)| {
                let host = host.map(|h| without_root_dot(strip_port(&h)).to_ascii_lowercase());
                let prefix = prefix.map(|p| {
                    let trimmed = p.trim_end_matches('/');
                    if trimmed.is_empty() {
                        "/".to_string()
                    } else {
                        trimmed.to_string()
                    }
                });
                let label = format!("{}{}", host.as_deref().unwrap_or("*"), prefix.as_deref().unwrap_or(""));
                let metrics = pool.metrics.route(&label);
                Route {
                    host,
                    prefix,
                    pool,
                    picked: Picked {
                        label: Arc::from(label),
                        priority,
                        metrics,
                    },
                }
            })
            .collect();
        routes.sort_by_key(|r| std::cmp::Reverse((r.host.is_some(), r.prefix.as_ref().map_or(0, String::len))));
        Router { routes, pools }
    }

    /// The configured upstreams' pools, by name.
    pub fn pools(&self) -> &BTreeMap<String, Arc<UpstreamPool>> {
        &self.pools
    }

    pub fn pick(&self, host: Option<&str>, path: &str) -> Option<&Arc<UpstreamPool>> {
        self.pick_route(host, path).map(|(pool, _)| pool)
    }

    /// The upstream and what the matched route says about the request.
    pub fn pick_route(&self, host: Option<&str>, path: &str) -> Option<(&Arc<UpstreamPool>, &Picked)> {
        let host = host.map(|host| without_root_dot(strip_port(host)));
        self.routes
            .iter()
            .find(|route| {
                let host_ok = match (&route.host, host) {
                    (None, _) => true,
                    (Some(want), Some(got)) => want.eq_ignore_ascii_case(got),
                    (Some(_), None) => false,
                };
                host_ok
                    && route
                        .prefix
                        .as_deref()
                        .is_none_or(|prefix| prefix_matches(prefix, path))
            })
            .map(|route| (&route.pool, &route.picked))
    }
}

/// `/api` matches `/api`, `/api/` and `/api/x`, never `/apix`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    if prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/') || rest.starts_with('?'),
        None => false,
    }
}

/// `Example.com:8080` → `Example.com`, `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').and_then(|end| host.get(..=end)).unwrap_or(host);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// `secret.internal.` → `secret.internal`: a fully qualified name's trailing dot is the DNS root's empty label
/// (RFC 1034 §3.1), the same name; without this it would skip its host route.
fn without_root_dot(host: &str) -> &str {
    host.strip_suffix('.').unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_on_segment_boundaries() {
        assert!(prefix_matches("/api", "/api"));
        assert!(prefix_matches("/api", "/api/x"));
        assert!(!prefix_matches("/api", "/apix"));
        assert!(prefix_matches("/", "/anything"));
    }

    #[test]
    fn ports_are_ignored_and_ipv6_literals_kept() {
        assert_eq!(strip_port("Example.COM:8080"), "Example.COM");
        assert_eq!(strip_port("example.com"), "example.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
    }

    #[test]
    fn a_trailing_dot_names_the_same_host() {
        assert_eq!(without_root_dot(strip_port("secret.internal.:8080")), "secret.internal");
        assert_eq!(without_root_dot("secret.internal"), "secret.internal");
    }
}
