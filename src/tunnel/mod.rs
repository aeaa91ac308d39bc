//! Tunnels: a request that asks to leave HTTP (a WebSocket's HTTP/1.1 `Upgrade`, or an HTTP/2 extended CONNECT,
//! RFC 8441), the head that goes upstream for it, the client's `101` (or `200` over HTTP/2) built from the
//! upstream's, and the [`Tunnel`] that relays bytes both ways once both sides have switched ([`relay`]).
//!
//! Owns what a tunnel is as HTTP and as bytes. It never takes a slot (the pool's `tunnels` does, under
//! `max_tunnels`), never answers an error (the proxy does) and never reads a client's socket but through the
//! stream it is handed.

mod relay;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

use crate::access::Entry;
use crate::activity::InFlight;
use crate::forward::strip_hop_by_hop;
use crate::net::ClientWire;
use crate::pool::{Conn, UpstreamPool};

/// An HTTP/2 extended CONNECT (RFC 8441) for a WebSocket: a WebSocket over HTTP/2, not a forward-proxy tunnel.
pub(crate) fn extended_connect<B>(request: &Request<B>) -> bool {
    request.method() == Method::CONNECT
        && request
            .extensions()
            .get::<hyper::ext::Protocol>()
            .is_some_and(|protocol| protocol.as_str().eq_ignore_ascii_case("websocket"))
}

/// What `request` asks to switch to, as the `Upgrade` value to send upstream: an HTTP/1.1 request with an
/// `Upgrade` line named in `Connection` (RFC 9110 §7.8), or an HTTP/2 extended CONNECT (its `:protocol`). `None`
/// for any other request, whose `Upgrade` (if any) is then a hop-by-hop line dropped on the way. `h2c` is never
/// tunnelled: a server may ignore it (RFC 9113 §3.1), and passing it on would let a client speak HTTP/2 to the
/// upstream behind floodgate's back; such a request is served over HTTP/1.1.
pub(crate) fn asked<B>(request: &Request<B>) -> Option<HeaderValue> {
    // Only WebSockets over HTTP/2: `extended_connect` asks for `websocket`.
    if extended_connect(request) {
        return Some(HeaderValue::from_static("websocket"));
    }
    if request.version() != Version::HTTP_11 {
        return None;
    }
    let headers = request.headers();
    let mut lines = headers.get_all(header::UPGRADE).iter();
    let (Some(upgrade), None) = (lines.next(), lines.next()) else {
        return None;
    };
    let named = crate::forward::connection_options(headers).any(|option| option.eq_ignore_ascii_case(b"upgrade"));
    let h2c = upgrade
        .as_bytes()
        .split(|&b| b == b',')
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"h2c"));
    (named && !h2c && !upgrade.is_empty()).then(|| upgrade.clone())
}

/// Puts the upgrade back on the head going upstream (the rewrite drops `Connection` and `Upgrade` as hop-by-hop).
/// An HTTP/2 extended CONNECT becomes the HTTP/1.1 GET a WebSocket opens with (RFC 8441 §5): the key HTTP/1.1
/// needs is made here, and the answer's `Sec-WebSocket-Accept` is not passed on (RFC 8441 has none).
pub(crate) fn upstream_head<B>(request: &mut Request<B>, upgrade: HeaderValue) {
    if request.method() == Method::CONNECT {
        *request.method_mut() = Method::GET;
        if !request.headers().contains_key(SEC_WEBSOCKET_KEY) {
            request.headers_mut().insert(SEC_WEBSOCKET_KEY, websocket_key());
        }
    }
    let headers = request.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, upgrade);
}

const SEC_WEBSOCKET_KEY: header::HeaderName = header::HeaderName::from_static("sec-websocket-key");
const SEC_WEBSOCKET_ACCEPT: header::HeaderName = header::HeaderName::from_static("sec-websocket-accept");

/// A fresh `Sec-WebSocket-Key`: 16 bytes, base64 (RFC 6455 §4.1). It proves nothing between floodgate and its
/// upstream; it only has to be well formed and fresh, so it comes from the standard library's random hasher keys
/// rather than a random number generator of its own.
fn websocket_key() -> HeaderValue {
    use std::hash::{BuildHasher, Hasher};
    let mut bytes = [0u8; 16];
    for half in bytes.chunks_mut(8) {
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        half.copy_from_slice(&random.to_le_bytes());
    }
    use base64::Engine;
    let key = base64::engine::general_purpose::STANDARD.encode(bytes);
    HeaderValue::from_str(&key).unwrap_or_else(|_| HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ=="))
}

/// The client's answer to an upgrade to `offered` (the `Upgrade` sent upstream) that the upstream accepted with
/// `switched` (its `101` head): the upstream's fields but the hop-by-hop ones and `Content-Length` (RFC 9110 §8.6:
/// none on a `1xx`), and the switch itself. Over HTTP/2 it is a `200` without the HTTP/1.1 fields (RFC 8441 §5).
/// Refused, with why, when the `101` names no protocol, or one the client did not offer (RFC 9110 §7.8: a server
/// must not switch to it; the client would speak one protocol and the upstream another): neither can be relayed.
pub(crate) fn client_answer(
    switched: &HeaderMap,
    offered: &HeaderValue,
    version: Version,
) -> Result<(StatusCode, HeaderMap), &'static str> {
    let upgrade = switched
        .get(header::UPGRADE)
        .ok_or("101 Switching Protocols without Upgrade")?
        .clone();
    if protocols(&upgrade).next().is_none() {
        return Err("101 Switching Protocols without Upgrade");
    }
    if !protocols(&upgrade).all(|chosen| protocols(offered).any(|asked| asked.eq_ignore_ascii_case(chosen))) {
        return Err("101 Switching Protocols to a protocol the client did not offer");
    }
    let mut headers = switched.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::CONTENT_LENGTH);
    if version == Version::HTTP_2 {
        headers.remove(SEC_WEBSOCKET_ACCEPT);
        return Ok((StatusCode::OK, headers));
    }
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, upgrade);
    Ok((StatusCode::SWITCHING_PROTOCOLS, headers))
}

/// The protocols an `Upgrade` value names (`websocket`, `IRC/6.9`), empty list elements passed over.
fn protocols(upgrade: &HeaderValue) -> impl Iterator<Item = &[u8]> {
    upgrade
        .as_bytes()
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|protocol| !protocol.is_empty())
}

/// A tunnel the upstream has accepted: its socket, open until the relay ends, then closed by the pool's closing
/// task (both sides) before its slot goes back.
pub(crate) struct Tunnel {
    conn: Conn,
    pool: Arc<UpstreamPool>,
    access: Option<Box<Entry>>,
    idle_timeout: Duration,
    /// How long a client may keep its side open once the upstream has closed its own.
    linger: Duration,
    /// Cancelled when floodgate's `shutdown_timeout` has passed.
    stop: CancellationToken,
    span: tracing::Span,
}

impl Tunnel {
    pub(crate) fn new(
        conn: Conn,
        pool: Arc<UpstreamPool>,
        access: Option<Box<Entry>>,
        stop: CancellationToken,
        span: tracing::Span,
    ) -> Tunnel {
        let (idle_timeout, linger) = {
            let limits = pool.limits();
            (limits.tunnel_idle_timeout, limits.close_timeout)
        };
        Tunnel {
            conn,
            pool,
            access,
            idle_timeout,
            linger,
            stop,
            span,
        }
    }

    /// Relays bytes between `client` (already switched; `early`: bytes it sent behind its request, to go first)
    /// and the upstream until both sides have closed, one fails, nothing moves for `tunnel_idle_timeout`, or
    /// floodgate's `shutdown_timeout` passes. The access-log line is written then.
    pub(crate) async fn run<C>(self, client: C, early: Bytes)
    where
        C: AsyncRead + AsyncWrite + Unpin,
    {
        // Tunnels go to HTTP/1 upstreams only (`open` refuses others): an HTTP/2 stream has no wire to relay.
        let Some(wire) = self.conn.wire().cloned() else {
            return self.not_switched();
        };
        let relayed = relay::relay(client, early, &wire, self.bounds()).await;
        self.ended(relayed);
    }

    /// [`Tunnel::run`] for a client of floodgate's own HTTP/1 server, on its connection.
    pub(crate) async fn run_on_wire(self, client: Arc<ClientWire>, early: Bytes) {
        let Some(wire) = self.conn.wire().cloned() else {
            return self.not_switched();
        };
        let relayed = relay::relay_on_wire(client, early, &wire, self.bounds()).await;
        self.ended(relayed);
    }

    /// The client's connection ended before the switch reached it: nothing was relayed.
    pub(crate) fn not_switched(self) {
        let relayed = relay::Relayed {
            closed_by: relay::ClosedBy::ClientError,
            to_upstream: 0,
            to_client: 0,
        };
        self.ended(relayed);
    }

    fn bounds(&self) -> relay::Bounds<'_> {
        let metrics = &self.pool.metrics;
        relay::Bounds {
            idle_timeout: self.idle_timeout,
            linger: self.linger,
            stop: &self.stop,
            counted: (&metrics.tunnel_bytes_to_upstream, &metrics.tunnel_bytes_to_client),
        }
    }

    fn ended(self, relayed: relay::Relayed) {
        tracing::debug!(
            parent: &self.span,
            upstream = %self.pool.name,
            closed_by = relayed.closed_by.as_str(),
            to_upstream = relayed.to_upstream,
            to_client = relayed.to_client,
            "tunnel ended"
        );
        if let Some(entry) = &self.access {
            let closed_by = relayed.closed_by.as_str();
            entry.write_tunnel(relayed.to_client, relayed.to_upstream, closed_by);
        }
        // The socket goes to the pool's closing task: our FIN (sent already if the client closed first), the
        // upstream's, then the slot.
        drop(self.conn);
    }
}

/// A tunnel handed from the proxy to the client connection's server with the `101` (a response extension, which
/// must be `Clone`): floodgate's own HTTP/1 server takes it once the `101` is written and runs it on the
/// connection's task.
#[derive(Clone)]
pub(crate) struct Handoff(Arc<Mutex<Option<Tunnel>>>);

impl Handoff {
    pub(crate) fn new(tunnel: Tunnel) -> Handoff {
        Handoff(Arc::new(Mutex::new(Some(tunnel))))
    }

    pub(crate) fn take(&self) -> Option<Tunnel> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take()
    }
}

/// What an HTTP/2 client connection holds while a request is at work, kept by a tunnel's task for the tunnel's
/// life: the request's in-flight mark, so that the connection's idle timeout and a drain's goodbye do not cut a
/// connection with tunnels on it. Put on an upgrade request by the edge.
#[derive(Clone)]
pub(crate) struct Hold {
    _mark: Arc<InFlight>,
}

impl Hold {
    /// Puts `mark` on `request`, for its tunnel's task to keep.
    pub(crate) fn put<B>(request: &mut Request<B>, mark: InFlight) {
        request.extensions_mut().insert(Hold { _mark: Arc::new(mark) });
    }
}

/// The client's `101` (or HTTP/2 `200`) as a response floodgate's servers write.
pub(crate) fn switched_response<B>(status: StatusCode, headers: HeaderMap, body: B) -> Response<B> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(lines: &[(&str, &str)]) -> Request<()> {
        let mut builder = Request::get("/chat").version(Version::HTTP_11);
        for (name, value) in lines {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap()
    }

    #[test]
    fn an_upgrade_is_asked_only_with_its_connection_option_and_never_for_h2c() {
        let asked = |lines| asked(&request(lines)).map(|value| value.to_str().unwrap().to_string());
        assert_eq!(
            asked(&[("connection", "keep-alive, Upgrade"), ("upgrade", "websocket")]).as_deref(),
            Some("websocket")
        );
        assert_eq!(
            asked(&[("upgrade", "websocket")]),
            None,
            "Upgrade not named in Connection"
        );
        assert_eq!(asked(&[("connection", "upgrade"), ("upgrade", "h2c")]), None);
        assert_eq!(asked(&[("connection", "upgrade"), ("upgrade", "websocket, H2C")]), None);
        let mut old = request(&[("connection", "upgrade"), ("upgrade", "websocket")]);
        *old.version_mut() = Version::HTTP_10;
        assert_eq!(super::asked(&old), None, "HTTP/1.0 cannot upgrade");
    }

    #[test]
    fn websocket_keys_are_sixteen_bytes_of_base64() {
        let key = websocket_key();
        assert_eq!(key.len(), 24);
        assert_ne!(key, websocket_key());
    }

    #[test]
    fn the_clients_answer_keeps_the_switch_and_drops_other_hop_by_hop_lines() {
        let mut switched = HeaderMap::new();
        switched.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        switched.insert(header::CONNECTION, HeaderValue::from_static("Upgrade, x-secret"));
        switched.insert("x-secret", HeaderValue::from_static("1"));
        switched.insert(
            SEC_WEBSOCKET_ACCEPT,
            HeaderValue::from_static("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
        );
        switched.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        let offered = HeaderValue::from_static("WebSocket");
        let (status, headers) = client_answer(&switched, &offered, Version::HTTP_11).unwrap();
        assert_eq!(status, StatusCode::SWITCHING_PROTOCOLS);
        assert_eq!(headers[header::CONNECTION], "upgrade");
        assert_eq!(headers[header::UPGRADE], "websocket");
        assert!(!headers.contains_key("x-secret"));
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
        let (status, headers) = client_answer(&switched, &offered, Version::HTTP_2).unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(headers.is_empty(), "{headers:?}");
        assert!(client_answer(&HeaderMap::new(), &offered, Version::HTTP_11).is_err());
    }

    #[test]
    fn a_switch_names_only_protocols_the_client_offered() {
        let switched = |protocol: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::UPGRADE, HeaderValue::from_static(protocol));
            headers
        };
        let offered = HeaderValue::from_static("foo/2, websocket");
        for accepted in ["websocket", "WEBSOCKET", "foo/2, websocket", "Foo/2"] {
            assert!(
                client_answer(&switched(accepted), &offered, Version::HTTP_11).is_ok(),
                "{accepted}"
            );
        }
        for refused in ["IRC/6.9", "foo", "foo/3", "websocket, h2c", ""] {
            assert!(
                client_answer(&switched(refused), &offered, Version::HTTP_11).is_err(),
                "{refused:?}"
            );
        }
    }
}
