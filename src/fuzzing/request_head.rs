//! The `request_head` target: bytes from a client socket through hyper's HTTP/1 server with floodgate's settings,
//! then floodgate's own steps before admission (tunnel check, target, route, rewrite). The
//! path goes upstream as RFC 3986 §5.2.4 resolves it, found here apart from floodgate's code
//! (`upstream_head::routed_target`), and a target it cannot resolve is refused.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, Version};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::upstream_head::{self, ClientHead};
use crate::config::{Config, Overrides};
use crate::error::ProxyError;
use crate::forward::{self, ClientInfo};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::reload::Plan;
use crate::upstream_lane::UpstreamLane;

/// Routes of every kind, so that picking one is exercised too; the catch-all means every request is routed.
const ROUTES: &str = r#"
trusted_proxies = ["10.0.0.0/8"]
[upstreams.app]
url = "http://127.0.0.1:9"
[upstreams.api]
url = "127.0.0.1:9"
[upstreams.www]
url = "http://[::1]:9"
[upstreams.assets]
url = "localhost:9"
[[routes]]
host = "example.com"
path_prefix = "/api"
upstream = "api"
[[routes]]
host = "WWW.example.com:8080"
upstream = "www"
[[routes]]
path_prefix = "/static/"
upstream = "assets"
[[routes]]
host = "[::1]"
upstream = "www"
[[routes]]
upstream = "app"
"#;

/// One client that is a trusted proxy and one that is not: each input is served to both.
const PEERS: [&str; 2] = ["192.0.2.7:40000", "10.1.2.3:40000"];

/// A connection that has not finished with all of its input by then is stuck.
const STUCK_AFTER: Duration = Duration::from_secs(10);

struct Fixture {
    runtime: tokio::runtime::Runtime,
    config: Config,
    proxy: Proxy,
}

/// Built once per process: a runtime, the pools (they spawn their idle reaper) and the proxy over them.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = super::runtime();
        let config = match Config::load_toml(ROUTES, "request_head routes", &Overrides::default()) {
            Ok(config) => config,
            Err(err) => panic!("the fixture's config is refused: {err}"),
        };
        let proxy = runtime.block_on(async { proxy_for(&config) });
        Fixture { runtime, config, proxy }
    })
}

/// The proxy `server::Floodgate::bind` would build, without binding anything.
fn proxy_for(config: &Config) -> Proxy {
    let metrics = Arc::new(Metrics::new());
    // Nothing is admitted here, so the lane is never run.
    let lane = UpstreamLane::new();
    let router = match Plan::starting(config, &metrics, &lane) {
        Ok(router) => router,
        Err(problem) => panic!("the fixture's configuration is refused: {problem}"),
    };
    Proxy::new(router, metrics, config.trusted_proxies.clone(), lane)
}

/// Serves `bytes`, sent by a client that then closes its sending side, on one HTTP/1 connection; every request
/// hyper parses out of them is checked on its way to the upstream.
pub fn request_head(bytes: &[u8]) {
    let fixture = fixture();
    for peer in PEERS {
        let peer: SocketAddr = match peer.parse() {
            Ok(peer) => peer,
            Err(err) => panic!("bad fixture peer {peer}: {err}"),
        };
        let client = ClientInfo::new(peer, fixture.proxy.is_trusted(peer.ip()), None);
        let served = fixture.runtime.block_on(async {
            tokio::time::timeout(STUCK_AFTER, serve(&fixture.config, &fixture.proxy, &client, bytes)).await
        });
        assert!(served.is_ok(), "the connection is stuck after {STUCK_AFTER:?}");
    }
}

async fn serve(config: &Config, proxy: &Proxy, client: &ClientInfo, bytes: &[u8]) {
    let (socket, server_side) = tokio::io::duplex(64 * 1024);
    let service = service_fn(|request: Request<Incoming>| async move {
        on_request(proxy, client, request).await;
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    });
    let connection =
        super::listener_http1(config.max_header_bytes).serve_connection(TokioIo::new(server_side), service);
    let (_, ()) = tokio::join!(connection, super::client_sends(socket, bytes));
}

async fn on_request(proxy: &Proxy, client: &ClientInfo, request: Request<Incoming>) {
    let (parts, body) = request.into_parts();
    let client_head = ClientHead::of(&parts);
    // An upgrade is served as a tunnel before this step (`proxy::tunnel`); here it is an ordinary request.
    let tunnel = parts.method == Method::CONNECT;
    // What the path must be routed and forwarded as, its dot segments resolved; `None`: it must be refused.
    let routed = upstream_head::routed_target(&client_head.uri);
    match proxy.prepare(Request::from_parts(parts, crate::body::ClientBody::Hyper(body)), client) {
        Ok((pool, _, upstream_request)) => {
            assert!(!tunnel, "a tunnel request is forwarded");
            let Some(routed) = routed else {
                panic!("a target that must be refused is forwarded: {client_head:?}");
            };
            // RFC 9112 §6.1: decoded once, a body chunked twice would go upstream with its inner framing as content.
            assert!(
                chunked(&client_head.headers) <= 1,
                "a body chunked twice is forwarded: {client_head:?}"
            );
            let (sent, body) = (*upstream_request).into_parts();
            upstream_head::check(&client_head.as_routed(&routed), &sent, client, &pool.authority);
            // hyper has already resolved the framing: one Content-Length, a plain number.
            let lengths: Vec<_> = sent.headers.get_all(header::CONTENT_LENGTH).iter().collect();
            assert!(
                lengths.len() <= 1 && lengths.iter().all(|l| l.as_bytes().iter().all(u8::is_ascii_digit)),
                "Content-Length goes upstream as {lengths:?}"
            );
            // RFC 9112 §3.2: the Host is a plain `host[:port]`, one the upstream cannot read another way.
            if let Some(host) = sent.headers.get(header::HOST) {
                assert!(valid_host(host.as_bytes()), "Host {host:?} goes upstream");
            }
            // The upstream's Host routes where the client's request was routed.
            let host = forward::target_host(&sent.uri, &sent.headers);
            let router = proxy.router();
            let again = router.pick(host, sent.uri.path());
            assert!(
                again.is_some_and(|again| Arc::ptr_eq(again, &pool)),
                "the request as sent upstream routes elsewhere"
            );
            // The exchange reads the body to its end; so does this, to reach the next request on the connection.
            let _ = body.collect().await;
        }
        Err(ProxyError::ConnectRefused) => assert!(tunnel, "refused as a tunnel: {client_head:?}"),
        Err(ProxyError::MissingHost) => assert!(
            client_head.uri.authority().is_none()
                && !client_head.headers.contains_key(header::HOST)
                && client_head.version != Version::HTTP_10,
            "refused for a missing Host: {client_head:?}"
        ),
        Err(ProxyError::InvalidHost) => {
            let hosts: Vec<_> = client_head.headers.get_all(header::HOST).iter().collect();
            let bad_authority = client_head
                .uri
                .authority()
                .is_some_and(|a| !valid_host(a.as_str().as_bytes()));
            assert!(
                bad_authority || !matches!(hosts.as_slice(), [host] if valid_host(host.as_bytes())),
                "refused for an invalid Host: {client_head:?}"
            );
        }
        Err(ProxyError::AuthorityFormTarget) => assert!(
            client_head.uri.scheme().is_none() && client_head.uri.authority().is_some(),
            "refused for an authority-form target: {client_head:?}"
        ),
        Err(ProxyError::UnsupportedScheme) => assert!(
            client_head
                .uri
                .scheme_str()
                .is_some_and(|s| !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("https")),
            "refused for its scheme: {client_head:?}"
        ),
        Err(ProxyError::UnsupportedTransferCoding) => {
            let codings: Vec<&[u8]> = client_head
                .headers
                .get_all(header::TRANSFER_ENCODING)
                .iter()
                .flat_map(|line| line.as_bytes().split(|&b| b == b','))
                .map(<[u8]>::trim_ascii)
                .filter(|coding| !coding.is_empty())
                .collect();
            // An empty list element is no coding (RFC 9110 §5.6.1): never the reason for a refusal.
            assert!(
                !codings
                    .iter()
                    .all(|c| c.eq_ignore_ascii_case(b"chunked") || c.eq_ignore_ascii_case(b"identity")),
                "refused for a transfer coding: {client_head:?}"
            );
        }
        Err(ProxyError::InvalidTarget(why)) => {
            assert!(routed.is_none(), "refused for its target ({why}): {client_head:?}")
        }
        Err(ProxyError::ChunkedTwice) => assert!(
            chunked(&client_head.headers) > 1,
            "refused as chunked twice: {client_head:?}"
        ),
        Err(ProxyError::AsteriskTarget) => assert!(
            client_head.uri.path() == "*" && client_head.method != Method::OPTIONS,
            "refused for an asterisk target: {client_head:?}"
        ),
        Err(err) => panic!("refused before admission for {err}: {client_head:?}"),
    }
}

/// How many times the `Transfer-Encoding` lines name `chunked`.
fn chunked(headers: &http::HeaderMap) -> usize {
    headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b','))
        .filter(|coding| coding.trim_ascii().eq_ignore_ascii_case(b"chunked"))
        .count()
}

/// `host[:port]` with nothing else: no userinfo, path or whitespace; a port that fits 16 bits; a name without an
/// empty label, bar a trailing dot (the DNS root).
fn valid_host(host: &[u8]) -> bool {
    let Ok(authority) = http::uri::Authority::try_from(host) else {
        return false;
    };
    let text = authority.as_str();
    let name = authority.host();
    // Nothing between the host and the port's colon (`[::1]x` parses, and is no host).
    let port = match text.strip_prefix(name) {
        Some("") => None,
        Some(rest) => match rest.strip_prefix(':') {
            Some(port) => Some(port),
            None => return false,
        },
        None => return false,
    };
    let port_ok = port.is_none_or(|port| {
        port.is_empty() || (port.bytes().all(|b| b.is_ascii_digit()) && port.parse::<u16>().is_ok())
    });
    let labels_ok = name.starts_with('[') && name.ends_with(']')
        || name
            .strip_suffix('.')
            .unwrap_or(name)
            .split('.')
            .all(|label| !label.is_empty());
    !host.contains(&b'@') && port_ok && labels_ok
}
