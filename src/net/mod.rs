//! Sockets shared between their readers and writers.
//!
//! [`SharedStream`] lets hyper (or a TLS session) drive a TCP connection while the proxy keeps its own handle to
//! the same socket: the listener needs it to notice a queued client leaving and to bound a stalled write, and an
//! `https://` upstream's TLS session runs over one while the pool keeps the socket's handle (its idle watch, its
//! close).
//! [`ClientWire`] is the client's connection under floodgate's own HTTP/1 server, plain or TLS. It owns no policy:
//! what to do with a socket is decided by the caller.

mod client_wire;

pub(crate) use client_wire::ClientWire;

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// A TCP stream that can be shared: hyper reads and writes through this value, others hold `Arc` clones.
pub(crate) struct SharedStream {
    stream: Arc<TcpStream>,
    write_stall: Option<WriteStall>,
}

/// Fails writes that could make no progress for `limit`: a peer that stops reading must not hold a response
/// (and through it an upstream slot) forever. hyper stops polling a body while its socket is full, so the body's
/// own idle timer cannot see this case.
struct WriteStall {
    limit: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl WriteStall {
    fn progressed(&mut self) {
        self.armed = false;
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = tokio::time::Instant::now() + self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        timer.as_mut().poll(cx).is_ready()
    }
}

impl SharedStream {
    pub(crate) fn new(stream: Arc<TcpStream>) -> Self {
        SharedStream {
            stream,
            write_stall: None,
        }
    }

    /// Writes that cannot progress for `limit` fail with `TimedOut`.
    pub(crate) fn with_write_stall_limit(mut self, limit: Duration) -> Self {
        self.write_stall = Some(WriteStall {
            limit,
            timer: None,
            armed: false,
        });
        self
    }

    fn write_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&TcpStream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        loop {
            match self.stream.poll_write_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if let Some(stall) = self.write_stall.as_mut() {
                        if stall.expired(cx) {
                            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "peer stopped reading")));
                        }
                    }
                    return Poll::Pending;
                }
            }
            match write(&self.stream) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                result => {
                    if let Some(stall) = self.write_stall.as_mut() {
                        stall.progressed();
                    }
                    return Poll::Ready(result);
                }
            }
        }
    }
}

/// Bytes read per call at most; also the size of each worker thread's scratch buffer.
const SCRATCH_BYTES: usize = 64 * 1024;

thread_local! {
    /// Reads land here first and only the bytes received are copied into hyper's buffer. Reading straight into
    /// hyper's (uninitialised) buffer would mean zeroing all of it on every read without `unsafe`, which cost
    /// more than the copy of a typical request.
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; SCRATCH_BYTES].into_boxed_slice());
}

fn read_into(stream: &TcpStream, buf: &mut ReadBuf<'_>) -> io::Result<usize> {
    let want = buf.remaining().min(SCRATCH_BYTES);
    let copied = SCRATCH.with(|scratch| {
        let mut scratch = scratch.try_borrow_mut().ok()?;
        let target = scratch.get_mut(..want)?;
        Some(
            stream
                .try_read(target)
                .inspect(|&n| buf.put_slice(target.get(..n).unwrap_or_default())),
        )
    });
    match copied {
        Some(result) => result,
        None => {
            let n = stream.try_read(buf.initialize_unfilled())?;
            buf.advance(n);
            Ok(n)
        }
    }
}

impl AsyncRead for SharedStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            let asked = buf.remaining().min(SCRATCH_BYTES);
            let mut got = None;
            // A short read means the receive queue is drained: clear the readiness now, as tokio's own
            // `TcpStream::poll_read` does, rather than pay for a read that would only say EAGAIN. `try_io` clears
            // it with the readiness seen before the read, so data that arrived since is not missed.
            let read = self.stream.try_io(Interest::READABLE, || {
                let n = read_into(&self.stream, buf)?;
                got = Some(n);
                if n > 0 && n < asked {
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Ok(n)
                }
            });
            match got.map_or(read, Ok) {
                Ok(_) => return Poll::Ready(Ok(())),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().write_with(cx, |stream| stream.try_write(data))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write_with(cx, |stream| stream.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(shutdown_write(&self.stream))
    }
}

/// Sends our FIN; the peer may still send until it closes too.
pub(crate) fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    match SockRef::from(stream).shutdown(std::net::Shutdown::Write) {
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        other => other,
    }
}

/// Closes our side and waits for the peer's end of stream, discarding anything it still sends, for at most
/// `limit` (`None`: for as long as it takes; the socket's keep-alive still ends it if the peer's host is gone);
/// past that the socket is set to reset on close. Returns whether the peer closed in time.
pub(crate) async fn close_and_wait_for_peer(stream: &TcpStream, limit: Option<Duration>) -> bool {
    let _ = shutdown_write(stream);
    let mut scratch = [0u8; 4096];
    let peer_closed = async {
        loop {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut scratch) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return,
            }
        }
    };
    let peer_closed = match limit {
        Some(limit) => tokio::time::timeout(limit, peer_closed).await.is_ok(),
        None => {
            peer_closed.await;
            true
        }
    };
    if !peer_closed {
        let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
    }
    peer_closed
}

/// What is at the front of a socket's received bytes, looked at without waiting and without taking anything.
pub(crate) enum Peeked {
    /// Bytes to read.
    Data,
    /// The peer closed its side, and everything it sent has been read.
    Closed,
    /// Nothing yet.
    Nothing,
    /// The socket failed (reset, say).
    Failed,
}

/// `stream.try_read_buf(buf)`; a read that leaves room in `buf` unfilled shows the receive queue drained, and the
/// readiness is cleared then (as tokio's own `poll_read` does) rather than found out by a read that says only
/// EAGAIN. `try_io` clears the readiness it saw before the read, so data that arrived since is not missed.
pub(crate) fn try_read_drained(stream: &TcpStream, buf: &mut bytes::BytesMut) -> io::Result<usize> {
    let room = buf.capacity() - buf.len();
    read_drained(stream, room, || stream.try_read_buf(buf))
}

/// Reads what `stream` has into `buf`, as [`try_read_drained`] does; nothing added: the peer closed its side.
pub(crate) fn poll_read_into(stream: &TcpStream, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
    loop {
        ready!(stream.poll_read_ready(cx))?;
        match try_read_slice_drained(stream, buf.initialize_unfilled()) {
            Ok(n) => {
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            Err(err) => return Poll::Ready(Err(err)),
        }
    }
}

/// Writes some of `bytes` to `stream` once it takes them.
pub(crate) fn poll_write_some(stream: &TcpStream, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
    loop {
        ready!(stream.poll_write_ready(cx))?;
        match stream.try_write(bytes) {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            done => return Poll::Ready(done),
        }
    }
}

/// [`try_read_drained`] into a slice.
pub(crate) fn try_read_slice_drained(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let room = buf.len();
    read_drained(stream, room, || stream.try_read(buf))
}

/// A `read` of at most `room` bytes, the readiness cleared when it leaves room unfilled.
fn read_drained(stream: &TcpStream, room: usize, mut read: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
    let mut got = 0;
    let read = stream.try_io(Interest::READABLE, || {
        let n = read()?;
        if n > 0 && n < room {
            got = n;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match read {
        Err(err) if err.kind() == io::ErrorKind::WouldBlock && got > 0 => Ok(got),
        read => read,
    }
}

pub(crate) fn peek(stream: &TcpStream) -> Peeked {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match SockRef::from(stream).peek(&mut byte) {
        Ok(0) => Peeked::Closed,
        Ok(_) => Peeked::Data,
        Err(err) if err.kind() == io::ErrorKind::WouldBlock || err.kind() == io::ErrorKind::Interrupted => {
            Peeked::Nothing
        }
        Err(_) => Peeked::Failed,
    }
}

/// Forgets `stream`'s read readiness, so that the next wait is for something new: bytes left unread (a request not
/// yet wanted) would otherwise wake every wait at once.
pub(crate) fn forget_readable(stream: &TcpStream) {
    let _ = stream.try_io(tokio::io::Interest::READABLE, || {
        Err::<(), _>(io::ErrorKind::WouldBlock.into())
    });
}

/// Whether the peer has closed its side of `stream` (or the socket failed): pending data (a pipelined request)
/// means it has not.
pub(crate) fn peer_has_closed(stream: &TcpStream) -> bool {
    // Peeked only if the socket's readiness says something came since it was last read dry (a close sets it):
    // asked for every queued request, a peek each would be a system call each.
    let peeked = stream.try_io(Interest::READABLE, || match peek(stream) {
        Peeked::Nothing => Err(io::ErrorKind::WouldBlock.into()),
        seen => Ok(seen),
    });
    matches!(peeked, Ok(Peeked::Closed | Peeked::Failed))
}

/// Resolves once the peer has closed its side of `stream` (or the socket failed), without consuming any of the
/// data waiting to be read: it watches a duplicate of the socket, whose readiness is its own.
pub(crate) async fn peer_closed(stream: &TcpStream) {
    let watcher = match SockRef::from(stream).try_clone().and_then(|socket| {
        let std_stream: std::net::TcpStream = socket.into();
        std_stream.set_nonblocking(true)?;
        TcpStream::from_std(std_stream)
    }) {
        Ok(watcher) => watcher,
        // Without a duplicate we cannot watch; the request then leaves the queue by timeout or admission.
        Err(_) => return std::future::pending().await,
    };
    loop {
        match watcher.ready(tokio::io::Interest::READABLE).await {
            Ok(ready) if ready.is_read_closed() || ready.is_error() => return,
            // Unread data (a body we have not admitted yet): wait for the next edge.
            Ok(_) => forget_readable(&watcher),
            Err(_) => return,
        }
    }
}
