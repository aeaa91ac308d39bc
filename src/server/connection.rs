//! One client connection: the TLS handshake (when configured) or protocol sniffing, then HTTP/1.1 on floodgate's
//! own server (`h1_conn`) or HTTP/2 on hyper's, with its deadlines.
//!
//! Owns the first bytes' and the handshake's deadline, and for HTTP/2 the client-side timeouts (header block,
//! idle keep-alive) and the connection's part in a graceful shutdown. It never takes an upstream slot: requests are handed to the [`Proxy`], which admits them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::h2_frames::{FrameWatch, PingAcks};
use super::{h1_conn, proxy_header, OpenClient};
use crate::activity::{ClientActivity, Expired};
use crate::body::ClientBody;
use crate::config::Config;
use crate::error::Outcome;
use crate::forward::ClientInfo;
use crate::net::{ClientWire, SharedStream};
use crate::proxy::Proxy;
use crate::tls::ALPN_H2;

const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

use crate::buffer::HTTP2_STREAM_WINDOW;

const HTTP2_CONNECTION_WINDOW: u32 = 4 * HTTP2_STREAM_WINDOW;

/// How long an idle connection closing politely waits for its peer to finish the goodbye (see `drive`).
const GOODBYE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Waits for the first bytes and tells HTTP/2 prior knowledge from HTTP/1 by peeking, so nothing is consumed.
async fn sniff(stream: &TcpStream) -> std::io::Result<Protocol> {
    let mut buf = [0u8; 24];
    let mut pause = Duration::from_millis(1);
    loop {
        let n = stream.peek(&mut buf).await?;
        let seen = buf.get(..n).unwrap_or_default();
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if n == buf.len() && seen == H2_PREFACE {
            return Ok(Protocol::Http2);
        }
        if !H2_PREFACE.starts_with(seen) || n == buf.len() {
            return Ok(Protocol::Http1);
        }
        // A preface split across packets is rare; peek returns at once while data is pending, so back off instead
        // of spinning until the rest arrives (the caller's first_byte_timeout bounds this).
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Serves one accepted connection until it closes, a deadline passes, or shutdown has drained it. With `tls`,
/// the connection is TLS and the ALPN the client picked decides the protocol; otherwise the first bytes do. An
/// HTTP/1 client moves to a task of its own (on `tracker`), served by floodgate's own server, which holds only
/// what that server needs while the connection idles; an HTTP/2 client is served by hyper's.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<TlsAcceptor>,
    proxy: Arc<Proxy>,
    config: Arc<Config>,
    shutdown: CancellationToken,
    open: OpenClient,
    tracker: TaskTracker,
) {
    let _ = stream.set_nodelay(true);
    // Behind an L4 load balancer the client's address comes first, in a PROXY header (see `proxy_header`).
    let peer = if config.proxy_protocol {
        let trusted = proxy.is_trusted(peer.ip());
        match tokio::time::timeout(config.first_byte_timeout, proxy_header::read(&stream, peer, trusted)).await {
            Ok(Ok(client)) => client.unwrap_or(peer),
            Ok(Err(refused)) => {
                tracing::debug!(%peer, error = %refused, "connection closed at its PROXY header");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "no PROXY header or request within first_byte_timeout; closing");
                return;
            }
        }
    } else {
        peer
    };
    let stream = Arc::new(stream);
    // TLS wraps the SharedStream rather than the socket, so the write-stall limit below sees the bytes actually
    // moving on the wire, encrypted or not.
    let shared = || SharedStream::new(stream.clone()).with_write_stall_limit(config.client_write_stall_limit());
    let Some(acceptor) = tls else {
        let protocol = match tokio::time::timeout(config.first_byte_timeout, sniff(&stream)).await {
            Ok(Ok(protocol)) => protocol,
            Ok(Err(_)) => return,
            Err(_) => {
                tracing::debug!(%peer, "client sent nothing before first_byte_timeout; closing");
                return;
            }
        };
        if protocol == Protocol::Http1 {
            tracker.spawn(own_http1(
                ClientWire::plain(stream),
                peer,
                proxy,
                config,
                shutdown,
                open,
            ));
            return;
        }
        // Boxed, as the TLS path below: hyper's connection is kilobytes of future, which every connection's task
        // would otherwise carry.
        return Box::pin(serve_http2(shared(), false, peer, proxy, config, shutdown)).await;
    };
    // first_byte_timeout bounds the whole handshake: a client that trickles its ClientHello holds a
    // max_client_connections permit just like one that sends nothing.
    let tls_stream = match tokio::time::timeout(config.first_byte_timeout, Box::pin(acceptor.accept(shared()))).await {
        Ok(Ok(tls_stream)) => tls_stream,
        Ok(Err(err)) => {
            tracing::debug!(%peer, error = %err, "TLS handshake failed; closing");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake not complete within first_byte_timeout; closing");
            return;
        }
    };
    // No ALPN (or http/1.1) means HTTP/1.1, as RFC 9113 requires h2 over TLS to be negotiated.
    match tls_stream.get_ref().1.alpn_protocol() {
        Some(ALPN_H2) => Box::pin(serve_http2(tls_stream, true, peer, proxy, config, shutdown)).await,
        _ => {
            let wire = ClientWire::tls(stream, tls_stream);
            tracker.spawn(own_http1(wire, peer, proxy, config, shutdown, open));
        }
    }
}

/// Serves an HTTP/1 client with floodgate's own server (`server::h1_conn`). Not an `async fn`, and holding
/// handles only: its arguments would be stored twice in the future every idle connection holds.
fn own_http1(
    wire: Arc<ClientWire>,
    peer: SocketAddr,
    proxy: Arc<Proxy>,
    config: Arc<Config>,
    shutdown: CancellationToken,
    open: OpenClient,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    // peer_closed watches the socket itself, so it works under TLS as well: the client's FIN is what it waits for,
    // whatever (close_notify included) comes before it.
    let socket = wire.socket().clone();
    let client = ClientInfo::new(peer, proxy.is_trusted(peer.ip()), Some(socket)).over_tls(wire.is_tls());
    let client = Arc::new(client);
    async move {
        // Made per request; no ClientActivity: this server keeps the connection's deadlines itself.
        let service = || crate::edge::stack(proxy.clone(), client.clone(), None);
        let ended = h1_conn::serve(&wire, &service, &config, &proxy.metrics, &shutdown).await;
        // An exchange still reading (or abandoned with) the request body holds the socket too: the client must see
        // the connection end now all the same.
        let _ = socket2::SockRef::from(&**wire.socket()).shutdown(std::net::Shutdown::Both);
        let peer = client.peer;
        match ended {
            h1_conn::Ended::HeaderTimeout => {
                tracing::debug!(%peer, "request head not complete within header_read_timeout; closing");
                proxy.metrics.client_side(Outcome::ClientTimeout, None);
            }
            h1_conn::Ended::Error(err) => {
                tracing::debug!(%peer, error = %err, "client connection ended with an error")
            }
            h1_conn::Ended::Refused(refused) => tracing::debug!(%peer, error = %refused, "request head refused"),
            h1_conn::Ended::Closed => {}
        }
        drop(open);
    }
}

/// Serves HTTP/2 over `io` (the plain or the TLS stream on `stream`) with hyper's server.
async fn serve_http2<I>(
    io: I,
    tls: bool,
    peer: SocketAddr,
    proxy: Arc<Proxy>,
    config: Arc<Config>,
    shutdown: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = ClientActivity::new();
    let client = Arc::new(ClientInfo::new(peer, proxy.is_trusted(peer.ip()), None).over_tls(tls));
    let service = TowerToHyperService::new(
        tower::ServiceBuilder::new()
            .map_request(|request: http::Request<hyper::body::Incoming>| request.map(ClientBody::Hyper))
            .service(crate::edge::stack(proxy.clone(), client, Some(activity.clone()))),
    );
    let deadlines = activity.expired(config.header_read_timeout, config.client_idle_timeout);
    // A peer that does not answer a polite goodbye (GOAWAY and PING) is cut off after this, once no request of its
    // own is in flight: it would otherwise hold its connection, and a place among max_client_connections, for as
    // long as it stays silent.
    let goodbye = activity.quiet_for(GOODBYE_GRACE);
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.max_concurrent_streams)
        // What a client may send before anyone reads it is what a request waiting in the queue can make floodgate
        // hold: the protocol's default per stream, not hyper's 1 MiB, and four times that per connection.
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .max_header_list_size(u32::try_from(config.max_header_bytes).unwrap_or(u32::MAX))
        // WebSockets over HTTP/2 (RFC 8441): an extended CONNECT becomes a tunnel (`proxy::tunnel`).
        .enable_connect_protocol();
    // No keep-alive or adaptive-window PINGs: the goodbye's is the one PING floodgate sends, which bounds the
    // acknowledgements a client may send before `h2_frames` counts them as unsolicited.
    let ping_acks = PingAcks::new(proxy.metrics.http2_unsolicited_ping_acks.clone(), peer);
    let watched = FrameWatch::new(io, activity.clone(), ping_acks);
    let conn = builder.serve_connection(TokioIo::new(watched), service);
    match drive(conn, deadlines, goodbye, shutdown, |c| c.graceful_shutdown()).await {
        Ended::Error(err) if err.is_parse_too_large() => proxy.metrics.client_side(
            Outcome::HeaderTooLarge,
            Some(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        ),
        Ended::Error(err) if err.is_parse() => proxy
            .metrics
            .client_side(Outcome::BadRequest, Some(http::StatusCode::BAD_REQUEST)),
        Ended::Error(err) => tracing::debug!(%peer, error = %err, "client connection ended with an error"),
        Ended::HeaderTimeout => {
            tracing::debug!(%peer, "request head not complete within header_read_timeout; closing");
            proxy.metrics.client_side(Outcome::ClientTimeout, None);
        }
        Ended::GoodbyeUnanswered => {
            tracing::debug!(%peer, "client did not complete the connection's goodbye; closing");
        }
        Ended::Closed => {}
    }
}

enum Ended {
    Closed,
    Error(hyper::Error),
    HeaderTimeout,
    GoodbyeUnanswered,
}

/// Polls a hyper connection while watching its deadlines and the shutdown signal. Idle expiry and shutdown ask
/// hyper to finish gracefully (GOAWAY), and an idle connection whose peer does not complete that goodbye is
/// dropped after `goodbye`; a header block left open past its deadline drops the connection.
async fn drive<C>(
    conn: C,
    deadlines: impl std::future::Future<Output = Expired>,
    goodbye: impl std::future::Future<Output = ()>,
    shutdown: CancellationToken,
    graceful: impl Fn(std::pin::Pin<&mut C>),
) -> Ended
where
    C: std::future::Future<Output = hyper::Result<()>>,
{
    tokio::pin!(conn);
    // Both wait on the connection's activity, one at a time: the deadlines until the goodbye starts.
    let mut deadlines = Some(Box::pin(deadlines));
    let mut goodbye = Some(Box::pin(goodbye));
    let mut closing = false;
    loop {
        let waiting = async {
            match (closing, deadlines.as_mut(), goodbye.as_mut()) {
                (false, Some(deadlines), _) => Wait::Expired(deadlines.await),
                (true, _, Some(goodbye)) => {
                    goodbye.await;
                    Wait::GoodbyeUnanswered
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            result = conn.as_mut() => {
                return match result {
                    Ok(()) => Ended::Closed,
                    Err(err) => Ended::Error(err),
                };
            }
            waited = waiting => match waited {
                Wait::Expired(Expired::HeaderRead) => return Ended::HeaderTimeout,
                Wait::Expired(Expired::Idle) => {
                    closing = true;
                    deadlines = None;
                    graceful(conn.as_mut());
                }
                Wait::GoodbyeUnanswered => return Ended::GoodbyeUnanswered,
            },
            _ = shutdown.cancelled(), if !closing => {
                closing = true;
                deadlines = None;
                graceful(conn.as_mut());
            }
        }
    }
}

enum Wait {
    Expired(Expired),
    GoodbyeUnanswered,
}
