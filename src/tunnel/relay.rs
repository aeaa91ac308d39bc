//! A tunnel's bytes, both ways, on the task that runs it: each side read onto the stack and written to the other at
//! once, so a quiet tunnel holds no buffer; only what the other side could not take yet is kept, and nothing more is
//! read from that side until it has gone (backpressure both ways). One side's end is passed on as the other's
//! (a FIN, after TLS's close_notify), and the tunnel ends once both have ended, when either fails, or when no byte
//! has moved for the idle timeout. A client that keeps its side open after the upstream closed its own is given
//! `linger` (the upstream's `close_timeout`) to close too: a WebSocket's server closes first, and a client that
//! never does must not hold the tunnel's slot until the idle timeout.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::net::ClientWire;
use crate::pool::wire::Wire;

/// The most read from a side at once, onto the stack.
const READ_BYTES: usize = 16 * 1024;

/// Reads per side in one poll before the task lets others run: a side that is always ready must not hold the
/// thread.
const READS_PER_POLL: usize = 16;

/// Why a tunnel ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClosedBy {
    /// The client closed its side first.
    Client,
    /// The upstream closed its side first.
    Upstream,
    /// No byte moved either way for `tunnel_idle_timeout`.
    IdleTimeout,
    /// Reading from or writing to the client failed (a reset, say).
    ClientError,
    /// Reading from or writing to the upstream failed.
    UpstreamError,
    /// floodgate's `shutdown_timeout` passed with the tunnel open.
    Shutdown,
}

impl ClosedBy {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            ClosedBy::Client => "client",
            ClosedBy::Upstream => "upstream",
            ClosedBy::IdleTimeout => "idle_timeout",
            ClosedBy::ClientError => "client_error",
            ClosedBy::UpstreamError => "upstream_error",
            ClosedBy::Shutdown => "shutdown",
        }
    }
}

/// What a tunnel moved, and how it ended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Relayed {
    pub closed_by: ClosedBy,
    pub to_upstream: u64,
    pub to_client: u64,
}

/// One side of a tunnel, as the relay moves bytes on it.
trait Side {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>>;
    fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>>;
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

struct Client<C>(C);

impl<C: AsyncRead + AsyncWrite + Unpin> Side for Client<C> {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
    fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, bytes)
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A client of floodgate's own HTTP/1 server, on its connection (no copy through `SharedStream`'s scratch when it
/// is a plain socket).
struct OnWire(Arc<ClientWire>);

impl Side for OnWire {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.0.poll_read_into(cx, buf)
    }
    fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        self.0.poll_write(cx, bytes)
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_flush(cx)
    }
    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_shutdown(cx)
    }
}

struct Upstream<'a>(&'a Wire);

impl Side for Upstream<'_> {
    fn poll_read(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.0.lock().poll_read_into(cx, buf)
    }
    fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        self.0.lock().poll_write(cx, bytes)
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.lock().poll_flush(cx)
    }
    fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.lock().poll_shutdown(cx)
    }
}

/// Which end of a leg failed.
enum Failed {
    Read,
    Write,
}

/// One direction: bytes read from one side and not yet taken by the other (empty, and unallocated, while it
/// keeps up), and how far its end has come.
#[derive(Default)]
struct Leg {
    waiting: BytesMut,
    flush: bool,
    /// The source sent its end.
    ended: bool,
    /// The end was passed on.
    shut: bool,
    moved: u64,
    /// Bytes moved since the idle clock last looked.
    stirred: bool,
}

impl Leg {
    fn starting_with(bytes: &[u8]) -> Leg {
        Leg {
            waiting: BytesMut::from(bytes),
            ..Leg::default()
        }
    }

    /// Moves what `from` has to `to` until one of them must be waited for; `Ready(Ok)` once the end has been
    /// passed on.
    fn drive(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut impl Side,
        to: &mut impl Side,
        counted: &Counter,
    ) -> Poll<Result<(), Failed>> {
        let mut reads = 0;
        // Initialised once per poll, not per read: a ReadBuf remembers how much of it is.
        let mut scratch = [std::mem::MaybeUninit::<u8>::uninit(); READ_BYTES];
        let mut buf = ReadBuf::uninit(&mut scratch);
        loop {
            if !self.waiting.is_empty() {
                match to.poll_write(cx, &self.waiting) {
                    Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(Failed::Write)),
                    Poll::Ready(Ok(n)) => {
                        self.waiting.advance(n);
                        self.flush = true;
                        self.stirred = true;
                        if self.waiting.is_empty() {
                            // A quiet tunnel holds no buffer.
                            self.waiting = BytesMut::new();
                        }
                        continue;
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            if self.flush {
                match to.poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.flush = false,
                    Poll::Ready(Err(_)) => return Poll::Ready(Err(Failed::Write)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            if self.ended {
                if !self.shut {
                    // A side that cannot be shut down cleanly has failed otherwise already; the end still stands.
                    let _ = std::task::ready!(to.poll_shutdown(cx));
                    self.shut = true;
                }
                return Poll::Ready(Ok(()));
            }
            if reads == READS_PER_POLL {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            reads += 1;
            buf.clear();
            match from.poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => return Poll::Ready(Err(Failed::Read)),
                Poll::Ready(Ok(())) => {}
            }
            let read = buf.filled();
            if read.is_empty() {
                self.ended = true;
                continue;
            }
            self.moved += read.len() as u64;
            counted.inc_by(read.len() as u64);
            self.stirred = true;
            // Straight on from the stack; only what the other side cannot take now is kept.
            match to.poll_write(cx, read) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(Failed::Write)),
                Poll::Ready(Ok(n)) => {
                    self.flush = true;
                    self.waiting.extend_from_slice(read.get(n..).unwrap_or_default());
                }
                Poll::Pending => self.waiting.extend_from_slice(read),
            }
        }
    }
}

/// What ends a tunnel besides its sides, and what its bytes are counted in.
pub(super) struct Bounds<'a> {
    /// No byte moved either way for this long.
    pub idle_timeout: Duration,
    /// How long a client may keep its side open once the upstream has closed its own.
    pub linger: Duration,
    /// floodgate's `shutdown_timeout` has passed.
    pub stop: &'a CancellationToken,
    /// The bytes to the upstream and to the client.
    pub counted: (&'a Counter, &'a Counter),
}

/// Relays between `client` and the upstream on `wire` (see the module's doc); `early` is what the client sent
/// behind its request, and the wire may hold what the upstream sent behind its `101`: each goes first.
pub(super) async fn relay<C>(client: C, early: Bytes, wire: &Wire, bounds: Bounds<'_>) -> Relayed
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    relay_with(Client(client), early, wire, bounds).await
}

/// [`relay`] for a client of floodgate's own HTTP/1 server.
pub(super) async fn relay_on_wire(client: Arc<ClientWire>, early: Bytes, wire: &Wire, bounds: Bounds<'_>) -> Relayed {
    relay_with(OnWire(client), early, wire, bounds).await
}

async fn relay_with(mut client: impl Side, early: Bytes, wire: &Wire, bounds: Bounds<'_>) -> Relayed {
    let Bounds {
        idle_timeout,
        linger,
        stop,
        counted,
    } = bounds;
    let mut upstream = Upstream(wire);
    // Taken whole: the buffer the 101 was read into goes with the copy below.
    let behind_101 = std::mem::take(&mut wire.lock().received);
    let mut up = Leg::starting_with(&early);
    let mut down = Leg::starting_with(&behind_101);
    drop((early, behind_101));
    let mut first_end = None;
    let mut last_moved = Instant::now();
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let mut lingering: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    let closed_by = std::future::poll_fn(|cx| {
        let sent = up.drive(cx, &mut client, &mut upstream, counted.0);
        let received = down.drive(cx, &mut upstream, &mut client, counted.1);
        if stopped.as_mut().poll(cx).is_ready() {
            return Poll::Ready(ClosedBy::Shutdown);
        }
        match (sent, received) {
            (Poll::Ready(Err(Failed::Read)), _) | (_, Poll::Ready(Err(Failed::Write))) => {
                return Poll::Ready(ClosedBy::ClientError)
            }
            (Poll::Ready(Err(Failed::Write)), _) | (_, Poll::Ready(Err(Failed::Read))) => {
                return Poll::Ready(ClosedBy::UpstreamError)
            }
            _ => {}
        }
        if first_end.is_none() {
            if up.ended {
                first_end = Some(ClosedBy::Client);
            } else if down.ended {
                first_end = Some(ClosedBy::Upstream);
            }
        }
        if up.shut && down.shut {
            return Poll::Ready(first_end.unwrap_or(ClosedBy::Client));
        }
        if down.shut && !up.ended {
            let grace = lingering.get_or_insert_with(|| Box::pin(tokio::time::sleep(linger)));
            if grace.as_mut().poll(cx).is_ready() {
                return Poll::Ready(ClosedBy::Upstream);
            }
        }
        if std::mem::take(&mut up.stirred) | std::mem::take(&mut down.stirred) {
            last_moved = Instant::now();
        }
        while idle.as_mut().poll(cx).is_ready() {
            let due = last_moved + idle_timeout;
            if due <= Instant::now() {
                return Poll::Ready(ClosedBy::IdleTimeout);
            }
            idle.as_mut().reset(due);
        }
        Poll::Pending
    })
    .await;
    Relayed {
        closed_by,
        to_upstream: up.moved,
        to_client: down.moved,
    }
}
