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

use tokio::sync::oneshot;

use super::session::{self, Session};
use super::slots::ClosingMark;
use super::wire::Wire;
use super::{Slot, UpstreamPool};
use crate::config::{Origin, UpstreamConfig, UpstreamProtocol};
use crate::error::ProxyError;
use crate::net::{self, SharedStream};
use crate::upstream_lane::UpstreamLane;

/// A live connection to the upstream as a request sees it: an HTTP/1.1 connection, or one stream's permit on an
/// HTTP/2 session. Dropping it closes it (an HTTP/2 session closes with its last permit).
pub struct Conn {
    pub(crate) link: Link,
    /// Whether the pool counts this connection as closing; see [`super::slots::Slots::start_closing`]. An HTTP/2
    /// session's permits share one.
    pub(super) closing: ClosingMark,
    /// An exchange was given up mid-way: the upstream may still be working on it, so the socket (and the slot)
    /// is held until the upstream closes its side, however long that takes.
    upstream_working: bool,
    born: Instant,
    pub(super) served: u64,
    /// The endpoint it is connected to (an index into [`UpstreamPool::endpoints`]).
    pub(super) endpoint: usize,
}

/// What a [`Conn`] moves its bytes through.
pub(crate) enum Link {
    /// Its bytes, and the socket under them, closed completely (our FIN, then the upstream's) before the slot goes.
    H1(Arc<Wire>),
    /// One stream's permit on an HTTP/2 session.
    H2(StreamPermit),
}

/// The right to run one stream on an HTTP/2 session, counted among its streams at work while it is out of the
/// idle list.
pub(crate) struct StreamPermit {
    pub(crate) session: Arc<Session>,
    /// In the idle list: not counted among the streams at work.
    idle: bool,
    /// The stream it runs now: resolves once every handle on it (the answer's body, the upload) is gone, so h2 has
    /// reset it or it ended.
    ended: Option<oneshot::Receiver<()>>,
}

impl StreamPermit {
    fn new(session: Arc<Session>) -> StreamPermit {
        session.permit_made();
        session.stream_out();
        StreamPermit {
            session,
            idle: false,
            ended: None,
        }
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if !self.idle {
            self.session.stream_back(false);
        }
        self.session.permit_gone();
    }
}

impl Conn {
    pub fn is_closed(&self) -> bool {
        match &self.link {
            Link::H1(wire) => wire.is_spent(),
            Link::H2(permit) => permit.session.is_gone(),
        }
    }

    /// The HTTP/1 connection's wire; `None` for an HTTP/2 stream.
    pub(crate) fn wire(&self) -> Option<&Arc<Wire>> {
        match &self.link {
            Link::H1(wire) => Some(wire),
            Link::H2(_) => None,
        }
    }

    /// The HTTP/2 session this permit is a stream of; `None` for HTTP/1.
    pub(crate) fn session(&self) -> Option<&Arc<Session>> {
        match &self.link {
            Link::H1(_) => None,
            Link::H2(permit) => Some(&permit.session),
        }
    }

    /// The stream this permit runs from now on, for [`crate::pool::client_h2::send`]: what it hands the stream's
    /// handles so the permit knows when they are gone.
    pub(crate) fn open_stream(&mut self) -> Option<(Arc<Session>, StreamLive)> {
        let Link::H2(permit) = &mut self.link else {
            return None;
        };
        let (live, ended) = oneshot::channel();
        permit.ended = Some(ended);
        Some((permit.session.clone(), StreamLive(Arc::new(live))))
    }

    /// An HTTP/2 stream whose handles are not all gone yet: its permit is held until they are.
    pub(super) fn stream_still_live(&mut self) -> bool {
        let Link::H2(permit) = &mut self.link else {
            return false;
        };
        let live = permit
            .ended
            .as_mut()
            .is_some_and(|ended| matches!(ended.try_recv(), Err(oneshot::error::TryRecvError::Empty)));
        // Over: the receiver is done with (awaiting it again would panic).
        if !live {
            permit.ended = None;
        }
        live
    }

    /// Waits until every handle on this permit's stream is gone.
    pub(super) async fn stream_over(&mut self) {
        if let Link::H2(StreamPermit { ended: Some(ended), .. }) = &mut self.link {
            let _ = ended.await;
        }
        if let Link::H2(permit) = &mut self.link {
            permit.ended = None;
        }
    }

    /// Another permit on the same HTTP/2 session, counted at work.
    pub(super) fn sibling(&self) -> Option<Conn> {
        let session = self.session()?.clone();
        Some(Conn {
            link: Link::H2(StreamPermit::new(session)),
            closing: self.closing.clone(),
            upstream_working: false,
            born: self.born,
            served: 0,
            endpoint: self.endpoint,
        })
    }

    /// Whether `other` is a stream of the same HTTP/2 session.
    pub(super) fn same_session(&self, other: &Conn) -> bool {
        match (self.session(), other.session()) {
            (Some(one), Some(two)) => Arc::ptr_eq(one, two),
            _ => false,
        }
    }

    /// The connection enters the idle list: an HTTP/1 one's watch starts, an HTTP/2 stream stops counting.
    pub(super) fn set_idle(&mut self) {
        match &mut self.link {
            Link::H1(wire) => wire.set_idle(),
            Link::H2(permit) => {
                if !permit.idle {
                    permit.idle = true;
                    permit.session.stream_back(true);
                }
            }
        }
    }

    /// The connection leaves the idle list to carry a request.
    pub(super) fn set_busy(&mut self) {
        if let Link::H2(permit) = &mut self.link {
            if permit.idle {
                permit.idle = false;
                permit.session.stream_out();
            }
        }
    }

    /// The lane of the worker thread that opened this HTTP/1 connection, when that is not the caller's thread: its
    /// socket's answers are seen by that thread's I/O driver, so its exchanges run there.
    pub(super) fn home_elsewhere(&self) -> Option<&Arc<UpstreamLane>> {
        self.wire().and_then(|wire| wire.home()).filter(|home| !home.is_here())
    }

    /// An idle HTTP/2 stream that may not start now: its session has its limit's worth at work (the upstream
    /// lowered it, or its other permits are out).
    pub(super) fn lacks_room(&self, limits: &UpstreamConfig) -> bool {
        self.session()
            .is_some_and(|session| !session.has_room(limits.max_streams_per_connection))
    }

    /// An HTTP/2 stream coming back that may not be handed on: its session has more at work than it now allows.
    pub(super) fn over_stream_limit(&self, limits: &UpstreamConfig) -> bool {
        self.session()
            .is_some_and(|session| session.over_limit(limits.max_streams_per_connection))
    }

    /// Permits its HTTP/2 session's limit allows beyond those that exist (it was raised since they were made),
    /// made now and counted at work: for the caller to hand on.
    pub(super) fn more_permits(&self, limits: &UpstreamConfig) -> Vec<Conn> {
        let missing = self
            .session()
            .map_or(0, |session| session.permits_missing(limits.max_streams_per_connection));
        (0..missing).filter_map(|_| self.sibling()).collect()
    }

    /// When this idle connection's idleness began, as its expiry reads it: an HTTP/2 session's permits expire
    /// together, from when its last stream came back, and never while one is at work.
    pub(super) fn idle_since(&self, listed: Instant) -> Option<Instant> {
        match self.session() {
            None => Some(listed),
            Some(session) => session.idle_since(),
        }
    }

    /// An exchange was given up mid-way: the slot is held until the upstream has closed its side, which a
    /// thread-per-connection server does only once it has finished the request.
    pub(super) fn close_when_upstream_done(&mut self) {
        self.upstream_working = true;
    }

    /// One more request served on it (on its session, for HTTP/2).
    pub(super) fn count_served(&mut self) {
        self.served += 1;
        if let Some(session) = self.session() {
            session.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether the connection may carry another request under the configured limits.
    pub(super) fn is_usable(&self, limits: &UpstreamConfig) -> bool {
        let (born, served) = match self.session() {
            Some(session) => (session.born, session.served.load(std::sync::atomic::Ordering::Relaxed)),
            None => (self.born, self.served),
        };
        let too_old = !limits.max_connection_lifetime.is_zero() && born.elapsed() >= limits.max_connection_lifetime;
        let worn_out = limits.max_requests_per_connection > 0 && served >= limits.max_requests_per_connection;
        !(self.is_closed() || too_old || worn_out)
    }

    /// [`Conn::is_usable`], and the upstream has not closed it or spoken on it while it sat idle (looked at
    /// without waiting; see [`Wire::is_quiet`]).
    pub(super) fn is_usable_idle(&self, limits: &UpstreamConfig) -> bool {
        self.is_usable(limits) && self.wire().is_none_or(|wire| wire.is_quiet())
    }
}

/// Held by every handle on one HTTP/2 stream (the answer's body, the upload): the last one dropped tells the
/// stream's permit.
#[derive(Clone)]
pub(crate) struct StreamLive(#[allow(dead_code)] Arc<oneshot::Sender<()>>);

impl Drop for Conn {
    fn drop(&mut self) {
        let Link::H1(wire) = &self.link else {
            // An HTTP/2 session closes with its last permit; its driver gives the slot back.
            return;
        };
        // Whoever still holds the wire (an answer's body, a request body going out) finds it spent.
        let Some(slot) = wire.let_go() else {
            // The closing task took it already, when the upstream closed it.
            return;
        };
        let pool = slot.pool().clone();
        let limit = (!self.upstream_working).then(|| pool.limits().close_timeout);
        pool.close_later(Closing {
            stream: wire.socket.clone(),
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
        let list = self.endpoints();
        let Some((endpoint, origin)) = chosen.and_then(|at| list.get(at).map(|(origin, _)| (at, origin))) else {
            return Err(ProxyError::NoEndpointRoom);
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
        let http2 = self.limits().protocol == UpstreamProtocol::Http2;
        let Some(tls) = self.tls.load_full() else {
            if http2 {
                return self
                    .start_session(SharedStream::new(stream.clone()), stream, slot, endpoint, deadline)
                    .await;
            }
            let wire = Wire::plain(stream.clone(), self.stirs.downgrade());
            return Ok(self.start(wire, slot, endpoint));
        };
        // TLS wraps a SharedStream, not the socket, so the connection still holds the socket itself and can close
        // it completely before giving the slot back, as for plain HTTP.
        let io = SharedStream::new(stream.clone());
        let failure = match tokio::time::timeout_at(deadline, tls.connect(io)).await {
            Ok(Ok(tls_stream)) => {
                let chosen = tls_stream.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2);
                match (http2, chosen) {
                    (true, true) => return self.start_session(tls_stream, stream, slot, endpoint, deadline).await,
                    (false, _) => {
                        let wire = Wire::tls(tls_stream, stream.clone(), self.stirs.downgrade());
                        return Ok(self.start(wire, slot, endpoint));
                    }
                    (true, false) => {
                        ProxyError::Connect("the upstream did not choose HTTP/2 (ALPN h2) in its TLS handshake".into())
                    }
                }
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
            link: Link::H1(wire),
            closing,
            upstream_working: false,
            born: Instant::now(),
            served: 0,
            endpoint,
        }
    }

    /// An HTTP/2 session over `io` (the socket, or TLS over it): its driver holds `slot` and `socket` until the
    /// connection has ended. The first stream's permit is the caller's; the others the upstream allows go to
    /// waiters, or to the idle list.
    async fn start_session<T>(
        self: &Arc<Self>,
        io: T,
        socket: Arc<TcpStream>,
        mut slot: Slot,
        endpoint: usize,
        deadline: Instant,
    ) -> Result<Conn, ProxyError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let closing = ClosingMark::default();
        slot.connected(closing.clone());
        let terms = {
            let limits = self.limits();
            session::Terms {
                max_streams: limits.max_streams_per_connection,
                close_timeout: limits.close_timeout,
                ping_interval: limits.ping_interval,
            }
        };
        let spawner = self.clone();
        let spawn = move |task| spawner.spawn_boxed(task);
        let started = session::start(io, socket, slot, terms, deadline, spawn).await;
        let started = match started {
            Ok(started) => started,
            Err(session::Failed::With(socket, slot, why)) => {
                self.close_then_free(socket, slot);
                return Err(ProxyError::Connect(why));
            }
            Err(session::Failed::Later(why)) => return Err(ProxyError::Connect(why)),
        };
        self.metrics.opened.inc();
        let first = Conn {
            link: Link::H2(StreamPermit::new(started.session)),
            closing,
            upstream_working: false,
            born: Instant::now(),
            served: 0,
            endpoint,
        };
        for _ in 1..started.streams {
            if let Some(more) = first.sibling() {
                self.hand_on(super::Grant::Idle(more), false);
            }
        }
        Ok(first)
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
