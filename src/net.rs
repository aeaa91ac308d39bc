//! Sockets shared between hyper and the proxy.
//!
//! [`SharedStream`] lets hyper drive a TCP connection while the proxy keeps its own handle to the same socket: the
//! pool needs it to finish closing a connection after hyper has let go of it (the slot is only freed once the
//! upstream has closed its side), and the listener needs it to notice a queued client leaving. It owns no policy:
//! what to do with a socket is decided by the caller.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Called with every successful read that returned data, so the listener can tell a request head is arriving.
pub trait ReadObserver: Send + Sync {
    fn on_read(&self);
}

/// A TCP stream that can be shared: hyper reads and writes through this value, others hold `Arc` clones.
pub struct SharedStream {
    stream: Arc<TcpStream>,
    observer: Option<Arc<dyn ReadObserver>>,
}

impl SharedStream {
    pub fn new(stream: Arc<TcpStream>, observer: Option<Arc<dyn ReadObserver>>) -> Self {
        SharedStream { stream, observer }
    }
}

impl AsyncRead for SharedStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            match self.stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    if n > 0 {
                        if let Some(observer) = &self.observer {
                            observer.on_read();
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write(data) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                result => return Poll::Ready(result),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                result => return Poll::Ready(result),
            }
        }
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
pub fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    match SockRef::from(stream).shutdown(std::net::Shutdown::Write) {
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        other => other,
    }
}

/// Closes our side and waits for the peer's end of stream, discarding anything it still sends, for at most
/// `limit`; past that the socket is set to reset on close. Returns whether the peer closed in time.
pub async fn close_and_wait_for_peer(stream: &TcpStream, limit: Duration) -> bool {
    let _ = shutdown_write(stream);
    let mut scratch = [0u8; 4096];
    let peer_closed = tokio::time::timeout(limit, async {
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
    })
    .await
    .is_ok();
    if !peer_closed {
        let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
    }
    peer_closed
}

/// Resolves once the peer has closed its side of `stream` (or the socket failed), without consuming any of the
/// data waiting to be read: it watches a duplicate of the socket, whose readiness is its own.
pub async fn peer_closed(stream: &TcpStream) {
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
            Ok(_) => {
                // Unread data (a body we have not admitted yet): forget this readiness and wait for the next edge.
                let _ = watcher.try_io(tokio::io::Interest::READABLE, || {
                    Err::<(), _>(io::ErrorKind::WouldBlock.into())
                });
            }
            Err(_) => return,
        }
    }
}
