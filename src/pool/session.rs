//! One HTTP/2 connection to the upstream: its h2 client, the task that drives it (and holds its slot until its
//! socket is closed), how many of its streams are at work against the stream limit, and the PINGs that tell when
//! the upstream has read a reset.
//!
//! A session is shared by the stream permits the pool hands out (each a [`super::Conn`]); the last one dropped
//! lets h2 close the connection, and the driver gives the slot back once the socket is closed. It never frames a
//! request (`pool::client_h2` does) and never counts connections (the slot does).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::Slot;
use crate::net;

/// An HTTP/2 connection's shared state, as its stream permits see it.
pub(crate) struct Session {
    send: Mutex<h2::client::SendRequest<Bytes>>,
    /// Streams handed out (to requests, or held for an abandoned one) and not back in the idle list.
    out: AtomicUsize,
    /// The connection ended or is ending (closed, failed, GOAWAY): no new stream goes on it.
    gone: Arc<AtomicBool>,
    /// Permits in existence (at work or idle): fewer than the limit allows, and more are made as one comes back.
    minted: AtomicUsize,
    /// Asks the driver for a PING round trip; answered (or dropped, the connection gone) once it is done.
    pings: mpsc::UnboundedSender<oneshot::Sender<()>>,
    pub(super) born: Instant,
    pub(super) served: AtomicU64,
    /// When its last stream came back (microseconds since `born`): its idle permits expire together from then.
    idle_since_us: AtomicU64,
}

impl Session {
    /// The streams it may have at work now: `configured` (`max_streams_per_connection` in force, which a reload
    /// or the admin API may change), and never more than the upstream's `SETTINGS_MAX_CONCURRENT_STREAMS` as last
    /// received (h2 applies a lowered one as it reads it).
    pub(super) fn stream_limit(&self, configured: usize) -> usize {
        let allowed = self
            .send
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .current_max_send_streams();
        configured.min(allowed)
    }

    /// One more stream may start on it now.
    pub(super) fn has_room(&self, configured: usize) -> bool {
        !self.is_gone() && self.out.load(Ordering::Acquire) < self.stream_limit(configured)
    }

    /// More streams are at work than the limit now allows (lowered by the upstream or a reload): a stream coming
    /// back is not handed on.
    pub(super) fn over_limit(&self, configured: usize) -> bool {
        self.out.load(Ordering::Acquire) > self.stream_limit(configured)
    }

    /// How many more permits the limit allows than exist (it was raised since they were made).
    pub(super) fn permits_missing(&self, configured: usize) -> usize {
        if self.is_gone() {
            return 0;
        }
        self.stream_limit(configured)
            .saturating_sub(self.minted.load(Ordering::Acquire))
    }

    pub(super) fn permit_made(&self) {
        self.minted.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn permit_gone(&self) {
        self.minted.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// No stream goes on it any more (a GOAWAY, or a failure that is the connection's).
    pub(crate) fn give_up(&self) {
        self.gone.store(true, Ordering::Release);
    }

    pub(super) fn stream_out(&self) {
        self.out.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn stream_back(&self, idle: bool) {
        let _ = self
            .out
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |out| out.checked_sub(1));
        if idle && self.out.load(Ordering::Acquire) == 0 {
            let since = self.born.elapsed().as_micros().try_into().unwrap_or(u64::MAX);
            self.idle_since_us.store(since, Ordering::Release);
        }
    }

    /// Streams at work now.
    pub(super) fn streams_out(&self) -> usize {
        self.out.load(Ordering::Acquire)
    }

    /// Since when no stream has been at work on it (`None`: some are).
    pub(super) fn idle_since(&self) -> Option<Instant> {
        (self.streams_out() == 0).then(|| self.born + Duration::from_micros(self.idle_since_us.load(Ordering::Acquire)))
    }

    /// A handle to open one stream with.
    pub(crate) fn sender(&self) -> h2::client::SendRequest<Bytes> {
        self.send
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Resolves once the upstream has answered a PING sent after everything floodgate sent on the connection
    /// before this call (a reset included), or the connection is gone. Two round trips: the first PING may leave
    /// in the same write as frames queued just before it, in either order; the second leaves after it came back.
    pub(crate) async fn acknowledged(&self) {
        for _ in 0..2 {
            let (told, heard) = oneshot::channel();
            if self.pings.send(told).is_err() {
                return;
            }
            if heard.await.is_err() {
                return;
            }
        }
    }
}

/// Each stream's flow-control window.
const STREAM_WINDOW: u32 = 256 * 1024;

/// The largest window HTTP/2 allows (RFC 9113 §6.9.1).
const MAX_WINDOW: u32 = (1 << 31) - 1;

/// The upstream's settings a session starts with (a later change of the stream limit applies as it is read).
pub(super) struct Terms {
    pub(super) max_streams: usize,
    pub(super) close_timeout: Duration,
    pub(super) ping_interval: Duration,
}

/// What a dial of an HTTP/2 upstream made: the session, and how many streams it may carry at first.
pub(super) struct Started {
    pub(super) session: Arc<Session>,
    pub(super) streams: usize,
}

/// Runs the HTTP/2 handshake over `io` (the socket, or TLS over it) and starts the driver, which holds `slot`
/// and `socket` until the connection has ended and the socket is closed. Waits for one PING round trip, so the
/// upstream's SETTINGS (sent before it answers any PING) are in force before the first stream is counted.
/// Everything here runs before `deadline`.
pub(super) async fn start<T>(
    io: T,
    socket: Arc<TcpStream>,
    slot: Slot,
    terms: Terms,
    deadline: Instant,
    spawn: impl FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>),
) -> Result<Started, Failed>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Terms {
        max_streams,
        close_timeout,
        ping_interval,
    } = terms;
    let mut builder = h2::client::Builder::new();
    // Each stream's window is what one client that stops reading can leave floodgate holding; the connection's
    // has room for every stream's, so one stalled stream never stops the others (the protocol's 64 KiB for the
    // whole connection would).
    let connection_window = STREAM_WINDOW.saturating_mul(u32::try_from(max_streams).unwrap_or(u32::MAX));
    builder
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(connection_window.min(MAX_WINDOW))
        .enable_push(false)
        // Until the upstream's SETTINGS say otherwise: the configured most (an upstream that names no limit
        // allows any number, RFC 9113 §6.5.2).
        .initial_max_send_streams(max_streams)
        .max_header_list_size(64 * 1024);
    let handshake = tokio::time::timeout_at(deadline, builder.handshake::<T, Bytes>(io)).await;
    let (send, mut connection) = match handshake {
        Ok(Ok(started)) => started,
        Ok(Err(err)) => return Err(Failed::with(socket, slot, format!("HTTP/2 handshake: {err}"))),
        Err(_) => return Err(Failed::with(socket, slot, "timed out".into())),
    };
    let (pings, asked) = mpsc::unbounded_channel();
    let gone = Arc::new(AtomicBool::new(false));
    let ping_pong = connection.ping_pong();
    let session = Arc::new(Session {
        send: Mutex::new(send),
        out: AtomicUsize::new(0),
        gone: gone.clone(),
        minted: AtomicUsize::new(0),
        pings,
        born: Instant::now(),
        served: AtomicU64::new(0),
        idle_since_us: AtomicU64::new(0),
    });
    let driver = Driver {
        ping_pong,
        asked,
        gone,
        socket,
        slot,
        close_timeout,
        ping_interval,
    };
    spawn(Box::pin(driver.drive(connection)));
    if tokio::time::timeout_at(deadline, session.first_round()).await != Ok(true) {
        session.give_up();
        return Err(Failed::Later(
            "no answer to the first PING (is it an HTTP/2 server?)".into(),
        ));
    }
    let streams = session.stream_limit(max_streams);
    if streams == 0 {
        session.give_up();
        return Err(Failed::Later(
            "the upstream allows no stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)".into(),
        ));
    }
    Ok(Started { session, streams })
}

impl Session {
    /// One PING round trip; `false` when the connection ended first.
    async fn first_round(&self) -> bool {
        let (told, heard) = oneshot::channel();
        self.pings.send(told).is_ok() && heard.await.is_ok() && !self.is_gone()
    }
}

/// Why a session did not start. `With`: the socket and slot are handed back, to be closed with care; `Later`: the
/// driver has them and closes them itself.
pub(super) enum Failed {
    With(Arc<TcpStream>, Slot, String),
    Later(String),
}

impl Failed {
    fn with(socket: Arc<TcpStream>, slot: Slot, why: String) -> Failed {
        Failed::With(socket, slot, why)
    }
}

/// What drives one session's connection, beside the connection itself.
struct Driver {
    ping_pong: Option<h2::PingPong>,
    asked: mpsc::UnboundedReceiver<oneshot::Sender<()>>,
    gone: Arc<AtomicBool>,
    socket: Arc<TcpStream>,
    slot: Slot,
    close_timeout: Duration,
    /// A PING this often, and the connection is taken for dead when one is not answered by the next (zero: none).
    ping_interval: Duration,
}

impl Driver {
    /// Drives the connection until it ends (every handle gone and every stream over, the upstream's close or
    /// GOAWAY, a failure, a keep-alive PING unanswered), answering PING round trips asked for on the way; then
    /// closes the socket completely and only then gives the slot back.
    async fn drive<T>(mut self, mut connection: h2::client::Connection<T, Bytes>)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        // Asked for since the PING in flight left, and the ones it answers.
        let mut waiting: Vec<oneshot::Sender<()>> = Vec::new();
        let mut answering: Option<Vec<oneshot::Sender<()>>> = None;
        let mut asking = true;
        let keepalive = !self.ping_interval.is_zero();
        let mut ticks = tokio::time::interval_at(
            Instant::now() + self.ping_interval,
            self.ping_interval.max(Duration::from_millis(1)),
        );
        let mut unanswered: Option<oneshot::Receiver<()>> = None;
        loop {
            if answering.is_none() && !waiting.is_empty() {
                match self.ping_pong.as_mut().map(|pp| pp.send_ping(h2::Ping::opaque())) {
                    Some(Ok(())) => answering = Some(std::mem::take(&mut waiting)),
                    // No PING can go: whoever waits is told by its sender's drop, as when the connection is gone.
                    _ => waiting.clear(),
                }
            }
            let awaiting = answering.is_some();
            let ping_pong = &mut self.ping_pong;
            let pong = async move {
                match (ping_pong.as_mut(), awaiting) {
                    (Some(pp), true) => std::future::poll_fn(|cx| pp.poll_pong(cx)).await.is_ok(),
                    _ => std::future::pending().await,
                }
            };
            tokio::select! {
                ended = &mut connection => {
                    if let Err(err) = ended {
                        tracing::debug!(error = %err, "an HTTP/2 upstream connection ended");
                    }
                    break;
                }
                told = self.asked.recv(), if asking => match told {
                    Some(told) => waiting.push(told),
                    None => asking = false,
                },
                answered = pong => {
                    let answered_ones = answering.take().unwrap_or_default();
                    if !answered {
                        break;
                    }
                    for told in answered_ones {
                        let _ = told.send(());
                    }
                }
                _ = ticks.tick(), if keepalive => {
                    let dead = unanswered
                        .as_mut()
                        .is_some_and(|heard| matches!(heard.try_recv(), Err(oneshot::error::TryRecvError::Empty)));
                    if dead {
                        tracing::debug!("an HTTP/2 upstream connection did not answer its keep-alive PING; closed");
                        break;
                    }
                    let (told, heard) = oneshot::channel();
                    waiting.push(told);
                    unanswered = Some(heard);
                }
            }
        }
        self.gone.store(true, Ordering::Release);
        drop((waiting, answering, self.ping_pong.take(), connection));
        net::close_and_wait_for_peer(&self.socket, Some(self.close_timeout)).await;
        // Order matters: the socket is closed before the slot is given back.
        let Driver { socket, slot, .. } = self;
        drop(socket);
        drop(slot);
    }
}
