//! One upstream connection: dialling it, what a request holds of it, and closing it completely.
//!
//! A connection has no task of its own: its bytes are moved by whoever uses it ([`Wire`]), which also holds its
//! [`Slot`]; when the [`Conn`] is dropped, a closing task takes the slot from the wire: only when the upstream
//! has closed its side too (or `close_timeout` has passed and the socket was reset) is the slot dropped. So a
//! replacement is never dialled while its predecessor still exists as the upstream counts them. For an `https://`
//! upstream the TLS session runs over the same socket, so none of that changes; a handshake that fails or runs out
//! of time closes the socket before the slot goes.

use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::slots::ClosingMark;
use super::wire::Wire;
use super::{Slot, UpstreamPool};
use crate::config::{Origin, UpstreamConfig};
use crate::error::ProxyError;
use crate::net::{self, SharedStream};

/// A live HTTP/1.1 connection to the upstream, as a request sees it. Dropping it closes it.
pub struct Conn {
    /// Its bytes, and the socket under them, closed completely (our FIN, then the upstream's) before the slot goes.
    pub(crate) wire: Arc<Wire>,
    /// Whether the pool counts this connection as closing; see [`super::slots::Slots::start_closing`].
    pub(super) closing: ClosingMark,
    /// An exchange was given up mid-way: the upstream may still be working on it, so the socket (and the slot)
    /// is held until the upstream closes its side, however long that takes.
    upstream_working: bool,
    born: Instant,
    pub(super) served: u64,
    /// The endpoint it is connected to (an index into [`UpstreamPool::endpoints`]).
    pub(super) endpoint: usize,
}

impl Conn {
    pub fn is_closed(&self) -> bool {
        self.wire.is_spent()
    }

    /// An exchange was given up mid-way: the slot is held until the upstream has closed its side, which a
    /// thread-per-connection server does only once it has finished the request.
    pub(super) fn close_when_upstream_done(&mut self) {
        self.upstream_working = true;
    }

    /// Whether the connection may carry another request under the configured limits.
    pub(super) fn is_usable(&self, limits: &UpstreamConfig) -> bool {
        let too_old =
            !limits.max_connection_lifetime.is_zero() && self.born.elapsed() >= limits.max_connection_lifetime;
        let worn_out = limits.max_requests_per_connection > 0 && self.served >= limits.max_requests_per_connection;
        !(self.is_closed() || too_old || worn_out)
    }

    /// [`Conn::is_usable`], and the upstream has not closed it or spoken on it while it sat idle (looked at
    /// without waiting; see [`Wire::is_quiet`]).
    pub(super) fn is_usable_idle(&self, limits: &UpstreamConfig) -> bool {
        self.is_usable(limits) && self.wire.is_quiet()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Whoever still holds the wire (an answer's body, a request body going out) finds it spent.
        let Some(slot) = self.wire.let_go() else {
            // The closing task took it already, when the upstream closed it.
            return;
        };
        let pool = slot.pool().clone();
        let limit = (!self.upstream_working).then(|| pool.limits().close_timeout);
        pool.close_later(Closing {
            stream: self.wire.socket.clone(),
            slot,
            limit,
        });
    }
}

impl UpstreamPool {
    /// The upstream closed (or spoke on) a connection no exchange was using: closed now, whether it waits in the
    /// idle list or a lease still holds it (which then finds it spent), so its slot comes back at once.
    fn upstream_closed(&self, wire: &Wire) {
        self.close_spent_idle();
        if let Some(slot) = wire.take_slot() {
            self.close_later(Closing {
                stream: wire.socket.clone(),
                slot,
                limit: Some(self.limits().close_timeout),
            });
        }
    }
}

/// A connection on its way out: its socket and its slot, the slot to go once the socket has.
pub(super) struct Closing {
    stream: Arc<TcpStream>,
    slot: Slot,
    /// How long the upstream's side of the close is waited for (`None`: as long as it takes).
    limit: Option<std::time::Duration>,
}

/// Closes the pool's connections as they come, each completely (our FIN, then the upstream's, or a reset after
/// its limit) before its slot goes; ends once the pool is gone and the last has closed. Connections are let go of
/// under the pool's lock, where their slots could not be given back: they come here instead. It also looks at
/// each idle connection its watch woke for (`stirs`), and closes those the upstream closed.
pub(super) async fn close_connections(
    mut closings: tokio::sync::mpsc::UnboundedReceiver<Closing>,
    mut stirs: tokio::sync::mpsc::UnboundedReceiver<std::sync::Weak<Wire>>,
    pool: std::sync::Weak<UpstreamPool>,
) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let mut running = FuturesUnordered::new();
    let mut watching = true;
    let close = |closing: Closing| async move {
        net::close_and_wait_for_peer(&closing.stream, closing.limit).await;
        // Order matters: the socket is closed before the slot is given back (and the connection stops counting as
        // closing in the same step).
        drop(closing.stream);
        drop(closing.slot);
    };
    loop {
        tokio::select! {
            next = closings.recv() => match next {
                Some(closing) => running.push(close(closing)),
                None => break,
            },
            Some(()) = running.next(), if !running.is_empty() => {}
            stirred = stirs.recv(), if watching => match stirred {
                Some(wire) => {
                    if let (Some(wire), Some(pool)) = (wire.upgrade(), pool.upgrade()) {
                        if wire.stirred() {
                            pool.upstream_closed(&wire);
                        }
                    }
                }
                None => watching = false,
            },
        }
    }
    while running.next().await.is_some() {}
}

impl UpstreamPool {
    /// Dials a new connection with the right `slot` gives; the slot moves into the connection's wire. For an
    /// `https://` upstream the TLS handshake is part of the dial and shares `connect_timeout` with the TCP connect.
    /// The endpoint is chosen first (see [`UpstreamPool::choose_endpoint`]) and told how the dial went.
    pub(crate) async fn dial(self: &Arc<Self>, mut slot: Slot) -> Result<Conn, ProxyError> {
        let chosen = self.choose_endpoint(&mut slot);
        let Some((endpoint, origin)) = chosen.and_then(|at| self.endpoints().get(at).map(|(origin, _)| (at, origin)))
        else {
            return Err(ProxyError::Connect(
                "no endpoint has room for another connection".into(),
            ));
        };
        let dialled = self.dial_endpoint(slot, origin, endpoint).await;
        self.dialled(endpoint, dialled.is_ok());
        dialled
    }

    /// Dials `endpoint` (at `origin`) with `slot`, which is already counted there.
    pub(super) async fn dial_endpoint(
        self: &Arc<Self>,
        slot: Slot,
        origin: &Origin,
        endpoint: usize,
    ) -> Result<Conn, ProxyError> {
        let limit = self.limits().connect_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let stream = match connect(origin, deadline).await {
            Ok(stream) => stream,
            Err(Dial::Failed(err)) => return Err(ProxyError::Connect(err.to_string())),
            Err(Dial::TimedOut(attempt)) => {
                if let Some(attempt) = attempt {
                    // The handshake may complete just as we give up; the slot stays taken until that
                    // connection is gone too.
                    let close_timeout = self.limits().close_timeout;
                    self.spawn(async move {
                        abandon_attempt(&attempt, close_timeout).await;
                        drop(attempt);
                        drop(slot);
                    });
                }
                return Err(ProxyError::ConnectTimeout(limit));
            }
        };
        // Requests are small and latency-bound; Nagle would add a round trip to every exchange.
        let _ = stream.set_nodelay(true);
        let stream = Arc::new(stream);
        let Some(tls) = self.tls.load_full() else {
            let wire = Wire::plain(stream.clone(), self.stirs.downgrade());
            return Ok(self.start(wire, slot, endpoint));
        };
        // TLS wraps a SharedStream, not the socket, so the connection still holds the socket itself and can close
        // it completely before giving the slot back, as for plain HTTP.
        let io = SharedStream::new(stream.clone());
        let failure = match tokio::time::timeout_at(deadline, tls.connect(io)).await {
            Ok(Ok(tls_stream)) => {
                let wire = Wire::tls(tls_stream, stream.clone(), self.stirs.downgrade());
                return Ok(self.start(wire, slot, endpoint));
            }
            Ok(Err(err)) => {
                tls.handshake_failed(&self.name, &err);
                ProxyError::UpstreamTls(err.to_string())
            }
            Err(_) => ProxyError::ConnectTimeout(limit),
        };
        // The handshake, and its handle on the socket, is gone; the socket is closed before the slot is freed.
        self.close_then_free(stream, slot);
        Err(failure)
    }

    /// The connection over `wire` (plain or TLS); the wire holds `slot` until the connection is closed.
    fn start(self: &Arc<Self>, wire: Arc<Wire>, mut slot: Slot, endpoint: usize) -> Conn {
        // A tunnel is counted when its upstream switches (`proxy::tunnel`).
        if !slot.tunnel {
            self.metrics.opened.inc();
        }
        let closing = ClosingMark::default();
        slot.connected(closing.clone());
        wire.hold(slot);
        Conn {
            wire,
            closing,
            upstream_working: false,
            born: Instant::now(),
            served: 0,
            endpoint,
        }
    }

    /// A connection that never became usable: closed like any other, by the closing task (our FIN, then the
    /// upstream's, or a reset after `close_timeout`), so the request's answer does not wait for it; the slot goes
    /// only once the socket has.
    fn close_then_free(&self, stream: Arc<TcpStream>, slot: Slot) {
        self.close_later(Closing {
            stream,
            slot,
            limit: Some(self.limits().close_timeout),
        });
    }
}

enum Dial {
    Failed(std::io::Error),
    /// The deadline passed; the attempt in progress then, if any, is handed back to be closed with care.
    TimedOut(Option<TcpStream>),
}

/// Resolves the host at every dial and tries each address in turn, all before `deadline`.
async fn connect(origin: &Origin, deadline: tokio::time::Instant) -> Result<TcpStream, Dial> {
    let resolved = tokio::time::timeout_at(deadline, tokio::net::lookup_host((origin.host.as_str(), origin.port)));
    let addresses = match resolved.await {
        Ok(Ok(addresses)) => addresses,
        Ok(Err(err)) => return Err(Dial::Failed(err)),
        Err(_) => return Err(Dial::TimedOut(None)),
    };
    let mut last_error = None;
    for address in addresses {
        let attempt = match start_connect(address) {
            Ok(attempt) => attempt,
            Err(err) => {
                last_error = Some(err);
                continue;
            }
        };
        match tokio::time::timeout_at(deadline, attempt.writable()).await {
            Err(_) => return Err(Dial::TimedOut(Some(attempt))),
            Ok(Err(err)) => last_error = Some(err),
            Ok(Ok(())) => match attempt.take_error() {
                Ok(None) => return Ok(attempt),
                Ok(Some(err)) | Err(err) => last_error = Some(err),
            },
        }
    }
    Err(Dial::Failed(last_error.unwrap_or_else(|| {
        std::io::Error::other(format!("{} resolved to no address", origin.host))
    })))
}

/// Starts a non-blocking connect whose socket stays ours even if we stop waiting for it (tokio's own connect
/// future would close it on cancellation, possibly just after the upstream accepted it).
fn start_connect(address: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_nonblocking(true)?;
    // A connection whose slot waits for the upstream to close (an abandoned exchange) is ended by these probes if
    // the upstream's host is gone, rather than never.
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(60))
        .with_interval(std::time::Duration::from_secs(10))
        .with_retries(3);
    socket.set_tcp_keepalive(&keepalive)?;
    match socket.connect(&address.into()) {
        Ok(()) => {}
        Err(err) if err.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(err) => return Err(err),
    }
    TcpStream::from_std(socket.into())
}

/// An attempt that timed out: if it got connected after all, close it like any connection (waiting for the
/// upstream's side); if not, reset it so a late handshake cannot complete.
async fn abandon_attempt(attempt: &TcpStream, close_timeout: std::time::Duration) {
    if attempt.peer_addr().is_ok() {
        net::close_and_wait_for_peer(attempt, Some(close_timeout)).await;
    } else {
        let _ = socket2::SockRef::from(attempt).set_linger(Some(std::time::Duration::ZERO));
    }
}
