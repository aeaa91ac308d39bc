//! One upstream connection's bytes: its socket (plain, or TLS over the same socket), what has been read from it
//! and not yet taken, and whether it may carry another request. Shared by whoever moves bytes on the connection
//! at a time (the exchange writing a request and reading its answer's head, the answer's body as the client takes
//! it, the rest of a request body still going out), each holding the lock only inside one poll. While the
//! connection sits idle, its socket's read readiness wakes a waker of the wire's own, which tells the pool's
//! closing task to look (the upstream closing it, or speaking unasked): no task per connection, and nothing to
//! wake when an exchange takes it or gives it back.
//!
//! Between exchanges it also keeps the timer they bound their wait for an answer with.
//!
//! It never frames HTTP (`pool::client` does) and never counts connections (the connection's slot does).

use std::io::{self, ErrorKind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{ready, Context, Poll, Wake, Waker};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc::WeakUnboundedSender;
use tokio::sync::Notify;

use crate::upstream_lane::UpstreamLane;

use super::client::SentHead;
use super::Slot;
use crate::net::{self, Peeked, SharedStream};

type TlsStream = tokio_rustls::client::TlsStream<SharedStream>;

enum Transport {
    Plain(Arc<TcpStream>),
    /// Boxed: a TLS session is kilobytes, and most upstreams are plain.
    Tls(Box<TlsStream>),
}

/// An upstream connection's reading and writing, shared under a lock.
pub(crate) struct Wire {
    state: Mutex<WireState>,
    /// Told when a request body still going out after its answer came has finished (or failed).
    upload_over: Notify,
    /// The socket under the transport, whose read readiness is watched while the connection is idle.
    pub(crate) socket: Arc<TcpStream>,
    /// Registered for the socket's read readiness while the connection is idle; see [`Stirred`].
    watch: Waker,
    /// The same waker's own state: whether it was woken since it was last registered.
    stirred: Arc<Stirred>,
    /// The upstream lane of the worker thread that opened the connection (`None` off floodgate's worker threads):
    /// its socket's readiness comes from that thread's I/O driver, so its exchanges run there.
    home: Option<Arc<UpstreamLane>>,
}

/// Where a stir on an idle connection is told: the pool's closing task, which looks at the wire.
pub(crate) type StirTell = WeakUnboundedSender<Weak<Wire>>;

/// The idle watch's waker: the upstream stirred on a connection nobody reads (closed it, or spoke unasked), or a
/// readiness with nothing behind it. Holds weak handles only: it lives in the socket's own registration.
struct Stirred {
    wire: Weak<Wire>,
    tell: StirTell,
    /// Woken since the watch last registered it: the socket's readiness may have changed.
    woken: AtomicBool,
}

impl Wake for Stirred {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if let Some(tell) = self.tell.upgrade() {
            let _ = tell.send(self.wire.clone());
        }
    }
}

pub(crate) struct WireState {
    transport: Transport,
    /// Bytes read and not yet taken; empty (and unallocated) between exchanges.
    pub(crate) received: BytesMut,
    /// The connection cannot carry another request: the upstream closed it or sent what it should not have, an
    /// exchange on it failed, or its framing is in doubt.
    pub(crate) spent: bool,
    /// A request body is still being written after its answer's head came.
    pub(crate) uploading: bool,
    /// No exchange is using it (its last answer was read to the end, or it waits in the idle list): what its
    /// socket says is the idle watch's.
    pub(crate) idle: bool,
    /// The connection was let go of: a stir on it is no one's concern.
    gone: bool,
    /// A bodiless GET or HEAD's head as it went out, left here when its exchange failed before the answer's head
    /// came: what a replay sends again on a fresh connection (moved here, not copied).
    pub(crate) sent_head: Option<SentHead>,
    /// The connection's right to exist, given back by whoever closes the socket first: the connection when it is
    /// let go of, or its watch when the upstream closes it first.
    slot: Option<Slot>,
    /// The idle watch's waker is registered for the socket's read readiness, found not ready then, and nothing has
    /// polled that readiness since: until the waker is woken, looking again would only say the same.
    watched: bool,
    /// The timer the exchanges on the connection bound their wait for an answer with, one at a time, kept between
    /// them: moved on when it fires early, it costs no registration per request. With the thread it was made on:
    /// it fires from that thread's runtime, which may end before another thread's.
    answer_timer: Option<(std::thread::ThreadId, AnswerTimer)>,
}

/// A timer an exchange bounds its wait for the upstream's answer with.
pub(crate) type AnswerTimer = Pin<Box<tokio::time::Sleep>>;

thread_local! {
    /// This thread's id, read once: `thread::current()` clones a handle each time.
    static THREAD: std::thread::ThreadId = std::thread::current().id();
}

impl Wire {
    pub(crate) fn plain(stream: Arc<TcpStream>, tell: StirTell) -> Arc<Wire> {
        Self::over(Transport::Plain(stream.clone()), stream, tell)
    }

    /// `stream`'s TLS session over `socket`.
    pub(crate) fn tls(stream: TlsStream, socket: Arc<TcpStream>, tell: StirTell) -> Arc<Wire> {
        Self::over(Transport::Tls(Box::new(stream)), socket, tell)
    }

    fn over(transport: Transport, socket: Arc<TcpStream>, tell: StirTell) -> Arc<Wire> {
        Arc::new_cyclic(|wire| {
            let stirred = Arc::new(Stirred {
                wire: wire.clone(),
                tell,
                woken: AtomicBool::new(false),
            });
            Wire {
                state: Mutex::new(WireState {
                    transport,
                    received: BytesMut::new(),
                    spent: false,
                    uploading: false,
                    idle: false,
                    gone: false,
                    sent_head: None,
                    slot: None,
                    watched: false,
                    answer_timer: None,
                }),
                upload_over: Notify::new(),
                socket,
                watch: Waker::from(stirred.clone()),
                stirred,
                home: UpstreamLane::here(),
            }
        })
    }

    /// The lane of the thread whose I/O driver watches the socket, if it was opened on a floodgate worker thread.
    pub(crate) fn home(&self) -> Option<&Arc<UpstreamLane>> {
        self.home.as_ref()
    }

    /// A panic while the lock was held leaves the state as it was between two polls; `spent` is what matters, and
    /// the exchange that panicked does not return its connection.
    pub(crate) fn lock(&self) -> MutexGuard<'_, WireState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn is_spent(&self) -> bool {
        self.lock().spent
    }

    /// The timer the last exchange on the connection left, if it was made on this thread.
    pub(crate) fn take_answer_timer(&self) -> Option<AnswerTimer> {
        let (made_on, timer) = self.lock().answer_timer.take()?;
        (made_on == THREAD.with(|here| *here)).then_some(timer)
    }

    /// Keeps `timer`, made on this thread, for the next exchange on the connection.
    pub(crate) fn keep_answer_timer(&self, timer: AnswerTimer) {
        self.lock().answer_timer = Some((THREAD.with(|here| *here), timer));
    }

    /// Waits until no request body is going out on the connection any more.
    pub(crate) async fn upload_done(&self) {
        loop {
            let over = self.upload_over.notified();
            if !self.lock().uploading {
                return;
            }
            over.await;
        }
    }

    /// The request body that was going out has ended; `whole`: all of it was written. If the answer had ended
    /// already, the connection is now idle, and watched.
    pub(crate) fn upload_ended(&self, whole: bool) {
        {
            let mut state = self.lock();
            state.uploading = false;
            state.spent |= !whole;
            if state.idle {
                self.watch_while_idle(&mut state);
            }
        }
        self.upload_over.notify_waiters();
    }

    /// Whether an idle connection is still open and quiet, looked at without waiting: bytes or an end from the
    /// upstream while no request is out mean it cannot carry one (an HTTP/1 server says nothing unasked). A
    /// `peek` only if the socket's readiness says it has something; the idle watch stays on.
    pub(crate) fn is_quiet(&self) -> bool {
        let mut state = self.lock();
        !state.uploading && self.watch_while_idle(&mut state)
    }

    /// The head of the bodiless GET or HEAD whose exchange failed here before its answer's head came.
    pub(crate) fn take_sent_head(&self) -> Option<SentHead> {
        self.lock().sent_head.take()
    }

    /// An exchange takes the connection: what its socket says is the exchange's from here.
    pub(crate) fn take_for_exchange(&self) {
        let mut state = self.lock();
        state.idle = false;
        // The exchange's reads register its own waker in the watch's place.
        state.watched = false;
    }

    /// No exchange uses the connection any more: the upstream closing it is watched for from here.
    pub(crate) fn set_idle(&self) {
        let mut state = self.lock();
        state.idle = true;
        self.watch_while_idle(&mut state);
    }

    /// Registers the idle watch for the socket's next read readiness, the state locked and idle. Whether the
    /// connection is still quiet; one found spent (now, or by a readiness that was waiting) is told to the
    /// closing task at once, as a later stir would be.
    pub(crate) fn watch_while_idle(&self, state: &mut WireState) -> bool {
        let mut cx = Context::from_waker(&self.watch);
        loop {
            if state.spent || state.gone {
                break;
            }
            if state.uploading {
                // The upload looks again once the body is out.
                return true;
            }
            // A connection given back looks two or three times between exchanges (its answer's end, its return to
            // the idle list, its next lease); each look registers a waker anew.
            if state.watched && !self.stirred.woken.load(Ordering::SeqCst) {
                return true;
            }
            // Cleared before the look: a readiness after it wakes the waker, which sets it again.
            self.stirred.woken.store(false, Ordering::SeqCst);
            state.watched = false;
            match self.socket.poll_read_ready(&mut cx) {
                Poll::Pending => {
                    state.watched = true;
                    return true;
                }
                Poll::Ready(Ok(())) => {
                    if !state.quiet() {
                        break;
                    }
                    // A readiness with nothing behind it, or a TLS record that carried no data.
                    net::forget_readable(&self.socket);
                }
                Poll::Ready(Err(_)) => {
                    state.spent = true;
                    break;
                }
            }
        }
        if !state.gone {
            self.watch.wake_by_ref();
        }
        false
    }

    pub(crate) fn hold(&self, slot: Slot) {
        self.lock().slot = Some(slot);
    }

    /// The slot, to the one closing the socket; `None` if it is closed already.
    pub(crate) fn take_slot(&self) -> Option<Slot> {
        self.lock().slot.take()
    }

    /// The connection was let go of: spent for whoever still holds it, and a stir on it no one's concern. Its
    /// slot, unless the closing task has taken it already (the upstream closed the connection first).
    pub(crate) fn let_go(&self) -> Option<Slot> {
        let mut state = self.lock();
        state.spent = true;
        state.gone = true;
        state.slot.take()
    }

    /// The closing task's look at a connection its idle watch woke for: whether it is spent and its slot is to
    /// be taken back now. A connection an exchange has taken meanwhile is the exchange's (the readiness was its
    /// answer's); a quiet idle one is watched again.
    pub(crate) fn stirred(&self) -> bool {
        let mut state = self.lock();
        if state.gone || !state.idle || state.uploading {
            return false;
        }
        !self.watch_while_idle(&mut state)
    }
}

impl WireState {
    /// See [`Wire::is_quiet`]; a connection found not quiet is spent.
    fn quiet(&mut self) -> bool {
        if self.spent || self.uploading || !self.received.is_empty() {
            return false;
        }
        let quiet = match &mut self.transport {
            Transport::Plain(stream) => matches!(net::peek(stream), Peeked::Nothing),
            // Read through the session: a TLS record that carries no data (a session ticket) is not a word.
            Transport::Tls(tls) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                let mut probe = BytesMut::with_capacity(64);
                matches!(
                    tokio_util::io::poll_read_buf(Pin::new(&mut **tls), &mut cx, &mut probe),
                    Poll::Pending
                )
            }
        };
        self.spent |= !quiet;
        quiet
    }

    /// Reads what the socket has into `received`, with at least `room` to spare; `Ok(0)` when the upstream has
    /// closed its side.
    pub(crate) fn poll_fill(&mut self, cx: &mut Context<'_>, room: usize) -> Poll<io::Result<usize>> {
        self.watched = false;
        self.received.reserve(room);
        match &mut self.transport {
            Transport::Plain(stream) => loop {
                ready!(stream.poll_read_ready(cx))?;
                match net::try_read_drained(stream, &mut self.received) {
                    Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                    done => return Poll::Ready(done),
                }
            },
            Transport::Tls(tls) => tokio_util::io::poll_read_buf(Pin::new(&mut **tls), cx, &mut self.received),
        }
    }

    /// Writes some of `bytes`.
    pub(crate) fn poll_write(&mut self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.transport {
            Transport::Plain(stream) => net::poll_write_some(stream, cx, bytes),
            Transport::Tls(tls) => Pin::new(&mut **tls).poll_write(cx, bytes),
        }
    }

    /// Reads what the connection has into `buf`, for a tunnel's relay, which holds no buffer between reads (and
    /// takes `received`, what came behind the `101`, first). Nothing added to `buf`: the upstream closed its side.
    pub(crate) fn poll_read_into(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.watched = false;
        match &mut self.transport {
            Transport::Plain(stream) => net::poll_read_into(stream, cx, buf),
            Transport::Tls(tls) => Pin::new(&mut **tls).poll_read(cx, buf),
        }
    }

    /// Ends what goes to the upstream (a tunnel's client closed its side): our FIN, after TLS's close_notify.
    pub(crate) fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.transport {
            Transport::Plain(stream) => Poll::Ready(net::shutdown_write(stream)),
            Transport::Tls(tls) => Pin::new(&mut **tls).poll_shutdown(cx),
        }
    }

    /// Pushes out what the TLS session holds back; plain sockets hold nothing.
    pub(crate) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.transport {
            Transport::Plain(_) => Poll::Ready(Ok(())),
            Transport::Tls(tls) => Pin::new(&mut **tls).poll_flush(cx),
        }
    }
}

/// Writes all of `bytes` (each piece in turn) and flushes.
pub(crate) async fn write_all(wire: &Wire, pieces: &[&[u8]]) -> io::Result<()> {
    let mut at = 0;
    let mut piece = 0;
    std::future::poll_fn(|cx| {
        let mut state = wire.lock();
        while let Some(bytes) = pieces.get(piece) {
            let rest = bytes.get(at..).unwrap_or_default();
            if rest.is_empty() {
                piece += 1;
                at = 0;
                continue;
            }
            match ready!(state.poll_write(cx, rest)) {
                Ok(0) => return Poll::Ready(Err(ErrorKind::WriteZero.into())),
                Ok(n) => at += n,
                Err(err) => return Poll::Ready(Err(err)),
            }
        }
        state.poll_flush(cx)
    })
    .await
}
