//! [`ClientWire`]: the byte stream floodgate's HTTP/1 server reads and writes, a plain socket or a TLS session
//! over one, shared by the connection's task, the request body's reader and a tunnel.
//!
//! Owns how bytes move on a client's connection and nothing of HTTP. A plain socket is read and written directly
//! (no copy, no lock); a TLS session sits behind a lock, which the connection's writer and a body's reader take in
//! turn. It never decides when to read or how long to wait: its callers do.

use std::io::{self, ErrorKind};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use super::{Peeked, SharedStream};

/// A TLS session over the client's socket, its handshake done; writes that stall past the client's limit fail in
/// the `SharedStream` under it.
pub(crate) type TlsSession = tokio_rustls::server::TlsStream<SharedStream>;

/// A client's connection as floodgate's HTTP/1 server sees it.
pub(crate) struct ClientWire {
    socket: Arc<TcpStream>,
    /// Boxed: a TLS session is more than a kilobyte, which every plain client's connection would otherwise carry
    /// for as long as it idles.
    tls: Option<Box<Mutex<TlsSession>>>,
}

impl std::fmt::Debug for ClientWire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientWire")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl ClientWire {
    pub(crate) fn plain(socket: Arc<TcpStream>) -> Arc<ClientWire> {
        Arc::new(ClientWire { socket, tls: None })
    }

    /// `session` runs over `socket` (inside its `SharedStream`).
    pub(crate) fn tls(socket: Arc<TcpStream>, session: TlsSession) -> Arc<ClientWire> {
        Arc::new(ClientWire {
            socket,
            tls: Some(Box::new(Mutex::new(session))),
        })
    }

    /// The TCP socket under the connection: for noticing the client leave, and for cutting the connection.
    pub(crate) fn socket(&self) -> &Arc<TcpStream> {
        &self.socket
    }

    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// A panic while the lock was held left the session as rustls left it; going on from there is safe.
    fn session(tls: &Mutex<TlsSession>) -> MutexGuard<'_, TlsSession> {
        tls.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reads what the client sent into `buf`, with `room` more room asked of it first; 0 when it closed its side.
    pub(crate) fn poll_fill(&self, cx: &mut Context<'_>, buf: &mut BytesMut, room: usize) -> Poll<io::Result<usize>> {
        match &self.tls {
            None => loop {
                ready!(self.socket.poll_read_ready(cx))?;
                buf.reserve(room);
                match super::try_read_drained(&self.socket, buf) {
                    Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                    read => return Poll::Ready(read),
                }
            },
            Some(tls) => {
                buf.reserve(room);
                tokio_util::io::poll_read_buf(Pin::new(&mut *Self::session(tls)), cx, buf)
            }
        }
    }

    /// Waits, holding no buffer while nothing is readable, until the client sends something: what it sent, in a
    /// buffer of `room` taken only then, or `None` when it closed its side first.
    pub(crate) fn poll_next_bytes(&self, cx: &mut Context<'_>, room: usize) -> Poll<io::Result<Option<BytesMut>>> {
        loop {
            let mut received;
            let read = match &self.tls {
                None => {
                    ready!(self.socket.poll_read_ready(cx))?;
                    received = BytesMut::with_capacity(room);
                    super::try_read_drained(&self.socket, &mut received)
                }
                // The session may hold decrypted bytes already, with nothing left on the socket: it is asked
                // directly, and a buffer taken for a wait that ends pending goes again.
                Some(_) => {
                    received = BytesMut::with_capacity(room);
                    ready!(self.poll_fill(cx, &mut received, 0))
                }
            };
            match read {
                Ok(0) => return Poll::Ready(Ok(None)),
                Ok(_) => return Poll::Ready(Ok(Some(received))),
                // A readiness left from bytes already taken (the buffer goes again).
                Err(err) if err.kind() == ErrorKind::WouldBlock => {}
                Err(err) if is_reset(&err) => return Poll::Ready(Ok(None)),
                Err(err) => return Poll::Ready(Err(err)),
            }
        }
    }

    /// Reads into `buf`, as a tunnel's relay does; nothing added: the client closed its side.
    pub(crate) fn poll_read_into(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match &self.tls {
            None => super::poll_read_into(&self.socket, cx, buf),
            Some(tls) => Pin::new(&mut *Self::session(tls)).poll_read(cx, buf),
        }
    }

    /// Writes some of `bytes` once the connection takes them. Under TLS they may wait in the session until
    /// [`ClientWire::poll_flush`].
    pub(crate) fn poll_write(&self, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        match &self.tls {
            None => super::poll_write_some(&self.socket, cx, bytes),
            Some(tls) => Pin::new(&mut *Self::session(tls)).poll_write(cx, bytes),
        }
    }

    pub(crate) fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &self.tls {
            None => Poll::Ready(Ok(())),
            Some(tls) => Pin::new(&mut *Self::session(tls)).poll_flush(cx),
        }
    }

    /// Ends our side: TLS's `close_notify`, then our FIN.
    pub(crate) fn poll_shutdown(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &self.tls {
            None => Poll::Ready(super::shutdown_write(&self.socket)),
            Some(tls) => Pin::new(&mut *Self::session(tls)).poll_shutdown(cx),
        }
    }

    /// Writes all of `bytes` (and, under TLS, out of the session); fails with `TimedOut` when the client takes
    /// none of them for `stall`.
    pub(crate) async fn write_all(&self, mut bytes: &[u8], stall: Duration) -> io::Result<()> {
        if let Some(tls) = &self.tls {
            // The session's SharedStream fails a write that stalls for the client's limit.
            return std::future::poll_fn(|cx| Self::poll_write_all(tls, cx, &mut bytes)).await;
        }
        while !bytes.is_empty() {
            match self.socket.try_write(bytes) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => bytes = bytes.get(n..).unwrap_or_default(),
                // Boxed: a wait with its timer is 300 bytes of every answer's future, and most answers fit the
                // socket's buffer at once.
                Err(err) if err.kind() == ErrorKind::WouldBlock => {
                    Box::pin(tokio::time::timeout(stall, self.socket.writable()))
                        .await
                        .map_err(|_| io::Error::from(ErrorKind::TimedOut))??;
                }
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// Puts all of `bytes` into the session and the session's bytes on the socket.
    fn poll_write_all(tls: &Mutex<TlsSession>, cx: &mut Context<'_>, bytes: &mut &[u8]) -> Poll<io::Result<()>> {
        let mut session = Self::session(tls);
        while !bytes.is_empty() {
            match ready!(Pin::new(&mut *session).poll_write(cx, bytes))? {
                0 => return Poll::Ready(Err(ErrorKind::WriteZero.into())),
                n => *bytes = bytes.get(n..).unwrap_or_default(),
            }
        }
        Pin::new(&mut *session).poll_flush(cx)
    }

    /// Resolves once a plain client has closed its side (or its socket failed), without reading what it sent. (A
    /// TLS client's bytes are ciphertext that only its session can read: `server::h1_conn` watches it by reading.)
    pub(crate) async fn left(&self) {
        let stream = &*self.socket;
        loop {
            match stream.ready(Interest::READABLE).await {
                Ok(ready) if ready.is_read_closed() || ready.is_error() => return,
                Ok(_) => match super::peek(stream) {
                    Peeked::Closed | Peeked::Failed => return,
                    // A pipelined request waits its turn, and the socket's readiness with it: forgotten, it would
                    // not come again for bytes already there, and the request would never be read. The client is
                    // still there; whether it leaves later is seen when that request is read.
                    Peeked::Data => std::future::pending::<()>().await,
                    // A readiness with nothing behind it.
                    Peeked::Nothing => super::forget_readable(stream),
                },
                Err(_) => return,
            }
        }
    }
}

fn is_reset(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an idle plain client's connection keeps of its wire: a few words, not a TLS session's room.
    #[test]
    fn a_plain_clients_wire_is_a_few_words() {
        assert!(
            std::mem::size_of::<ClientWire>() <= 32,
            "{}",
            std::mem::size_of::<ClientWire>()
        );
        assert!(std::mem::size_of::<TlsSession>() > 512, "the box is worth it");
    }
}
