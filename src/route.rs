//! Routing: which upstream a request goes to.
//!
//! Owns the matching rules: Host compared case-insensitively with any port and a trailing dot ignored (`:authority` for
//! HTTP/2), path prefixes matched on segment boundaries (of a path whose dot segments the proxy has resolved,
//! `forward::resolve_dot_segments`, so the path matched is the one forwarded), the most specific route first, and the
//! upstreams those routes lead to, with what each route sets for its requests ([`RouteSettings`]: timeouts, a prefix to
//! strip, header fields to set or remove, and the names whose underscore aliases are dropped with them). A reload
//! replaces the whole router at once, so a request sees either the old routes and pools or the new ones. It never
//! changes the request: `proxy` applies the settings.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

use crate::config::RouteConfig;
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
    /// What the route sets for its requests.
    pub settings: Arc<RouteSettings>,
}

/// What a route sets for its requests, beside or instead of its upstream's settings; read from a checked
/// configuration.
#[derive(Debug, Default)]
pub struct RouteSettings {
    pub request_timeout: Option<Duration>,
    pub body_idle_timeout: Option<Duration>,
    /// The path prefix to take off the path forwarded upstream.
    pub strip_prefix: Option<String>,
    pub set_request: Vec<(HeaderName, HeaderValue)>,
    pub remove_request: Vec<HeaderName>,
    pub set_response: Vec<(HeaderName, HeaderValue)>,
    pub remove_response: Vec<HeaderName>,
    /// The request fields set or removed with a `-` in their names: a client's name for one of them with `_` for a
    /// `-` is dropped (`forward::drop_underscore_aliases`), as floodgate's own fields' are.
    pub guarded_request: Vec<HeaderName>,
}

impl RouteSettings {
    fn of(route: &RouteConfig, prefix: Option<&str>) -> RouteSettings {
        let mut settings = RouteSettings {
            request_timeout: route.request_timeout,
            body_idle_timeout: route.body_idle_timeout,
            strip_prefix: prefix
                .filter(|prefix| route.strip_prefix && *prefix != "/")
                .map(str::to_string),
            // Checked with the configuration; a field that could not be read would have refused it.
            set_request: RouteConfig::fields_to_set(&route.set_request_headers).unwrap_or_default(),
            remove_request: RouteConfig::fields_to_remove(&route.remove_request_headers).unwrap_or_default(),
            set_response: RouteConfig::fields_to_set(&route.set_response_headers).unwrap_or_default(),
            remove_response: RouteConfig::fields_to_remove(&route.remove_response_headers).unwrap_or_default(),
            guarded_request: Vec::new(),
        };
        settings.guarded_request = (settings.set_request.iter().map(|(name, _)| name))
            .chain(&settings.remove_request)
            .filter(|name| name.as_str().contains('-'))
            .cloned()
            .collect();
        settings
    }

    /// Whether the route changes nothing of a request's head or answer: the common case, left alone.
    pub fn edits_nothing(&self) -> bool {
        self.strip_prefix.is_none()
            && self.set_request.is_empty()
            && self.remove_request.is_empty()
            && self.set_response.is_empty()
            && self.remove_response.is_empty()
    }

    /// The request as the route sends it upstream: its prefix stripped, its fields set and removed.
    pub fn edit_request(&self, uri: &mut Uri, headers: &mut http::HeaderMap) {
        if let Some(prefix) = &self.strip_prefix {
            if let Some(stripped) = strip(uri, prefix) {
                *uri = stripped;
            }
        }
        for name in &self.remove_request {
            headers.remove(name);
        }
        for (name, value) in &self.set_request {
            headers.insert(name.clone(), value.clone());
        }
    }

    /// The upstream's answer as the route passes it on.
    pub fn edit_response(&self, headers: &mut http::HeaderMap) {
        for name in &self.remove_response {
            headers.remove(name);
        }
        for (name, value) in &self.set_response {
            headers.insert(name.clone(), value.clone());
        }
    }
}

/// `uri` (origin form) without `prefix`, which it starts with on a segment boundary: `/api/x?q` → `/x?q`,
/// `/api` → `/`.
fn strip(uri: &Uri, prefix: &str) -> Option<Uri> {
    let rest = uri.path().strip_prefix(prefix)?;
    let path = if rest.is_empty() { "/" } else { rest };
    let target = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_string(),
    };
    target.parse().ok()
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
        routes: impl IntoIterator<Item = (RouteConfig, Arc<UpstreamPool>)>,
        pools: BTreeMap<String, Arc<UpstreamPool>>,
    ) -> Router {
        let mut routes: Vec<Route> = routes
            .into_iter()
            .map(|(route, pool)| {
                let priority = route.priority;
                let host = route
                    .host
                    .as_ref()
                    .map(|h| without_root_dot(strip_port(h)).to_ascii_lowercase());
                let prefix = route.path_prefix.as_ref().map(|p| {
                    let trimmed = p.trim_end_matches('/');
                    if trimmed.is_empty() {
                        "/".to_string()
                    } else {
                        trimmed.to_string()
                    }
                });
                let label = format!("{}{}", host.as_deref().unwrap_or("*"), prefix.as_deref().unwrap_or(""));
                let metrics = pool.metrics.route(&label);
                let settings = Arc::new(RouteSettings::of(&route, prefix.as_deref()));
                Route {
                    host,
                    prefix,
                    pool,
                    picked: Picked {
                        label: Arc::from(label),
                        priority,
                        metrics,
                        settings,
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
