//! The client's request body as it comes off the client's connection: hyper's (HTTP/2) or floodgate's own HTTP/1
//! reader ([`Http1Body`]), which reads straight from the connection (a socket or a TLS session) into its read
//! buffer only while the body is wanted. It never buffers beyond what one read brings.

use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use crate::error::ProxyError;
use crate::h1::body::{BodyFault, Delimited};
use crate::net::ClientWire;

/// How much room a read of body bytes asks for.
const READ_ROOM: usize = 16 * 1024;

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// A request body from a client, whichever server read its head.
pub enum ClientBody {
    Hyper(Incoming),
    Http1(Http1Body),
}

/// Why a client's request body could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    #[error(transparent)]
    Hyper(hyper::Error),
    /// The connection ended (closed, reset) before the body did.
    #[error("the client's connection ended before its request body did")]
    Gone,
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
    /// The connection dropped the rest of the body once the answer was written (see [`discard_received`]): what
    /// was still going upstream must not end as if whole.
    #[error("the rest of the request body was dropped once its answer was written")]
    Cut,
}

impl ClientBodyError {
    /// What the failure means for the client: it left, or it sent a body that is not one.
    pub fn meaning(&self) -> ProxyError {
        match self {
            ClientBodyError::Gone => ProxyError::ClientGone,
            ClientBodyError::Chunked(_) | ClientBodyError::Cut => ProxyError::ClientBody(self.to_string()),
            ClientBodyError::Hyper(failed) => {
                // The client closed or reset its connection mid-body: it is gone, not malformed.
                let gone = std::error::Error::source(failed)
                    .and_then(|io| io.downcast_ref::<std::io::Error>())
                    .is_some_and(|io| is_gone(io.kind()));
                if gone || failed.is_incomplete_message() {
                    ProxyError::ClientGone
                } else {
                    ProxyError::ClientBody(failed.to_string())
                }
            }
        }
    }
}

fn is_gone(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        match self.get_mut() {
            ClientBody::Hyper(inner) => Pin::new(inner)
                .poll_frame(cx)
                .map(|polled| polled.map(|frame| frame.map_err(ClientBodyError::Hyper))),
            ClientBody::Http1(inner) => inner.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Hyper(inner) => inner.is_end_stream(),
            ClientBody::Http1(inner) => {
                let reading = inner.lock();
                reading.framing.is_over() && !reading.cut
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Hyper(inner) => inner.size_hint(),
            ClientBody::Http1(inner) => inner.lock().framing.size_hint(),
        }
    }
}

/// The reading side of an HTTP/1 client connection while a request's body is read: shared by the connection's
/// task, which read the head and takes the buffer back once the exchange is over, and the body, which the
/// exchange polls wherever it runs.
#[derive(Debug)]
pub(crate) struct Reading {
    wire: Arc<ClientWire>,
    /// Bytes read and not yet taken: the body's, and then maybe the next request's.
    pub(crate) received: BytesMut,
    /// How the rest of the body is delimited; `Broken` once the client left or sent what is not a body.
    pub(crate) framing: Delimited,
    /// Of the `100 Continue` owed to a client that asked for it before sending its body: bytes still to write.
    continue_left: usize,
    /// Told once the body has been read to its end (or given up on); none for a body over before it began (no
    /// body at all, most requests), which has nothing to tell.
    over: Option<Arc<tokio::sync::Notify>>,
    /// Pieces of the body were dropped rather than taken by the body's reader: from here the body only fails.
    cut: bool,
    /// The `100 Continue` is (being) written and may still be in a TLS session.
    flushing: bool,
}

impl Reading {
    /// `expects_continue`: the client waits for a `100` before it sends the body; it is sent when the body is
    /// first wanted.
    pub(crate) fn new(wire: Arc<ClientWire>, received: BytesMut, framing: Delimited, expects_continue: bool) -> Self {
        let over = framing.is_over();
        Reading {
            wire,
            received,
            framing,
            continue_left: if expects_continue && !over { CONTINUE.len() } else { 0 },
            over: (!over).then(Arc::default),
            cut: false,
            flushing: false,
        }
    }

    /// What is told once the body has been read to its end; `None`: it was over before it began.
    pub(crate) fn body_over(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.over.clone()
    }

    /// A panic while the lock was held left the state as it was; reading on from it is safe.
    pub(crate) fn lock(reading: &Mutex<Reading>) -> MutexGuard<'_, Reading> {
        reading.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn fail(&mut self, err: ClientBodyError) -> ClientBodyError {
        self.framing = Delimited::Broken;
        err
    }

    fn send_continue(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ClientBodyError>> {
        while self.continue_left > 0 {
            self.flushing = true;
            let start = CONTINUE.len() - self.continue_left;
            match ready!(self.wire.poll_write(cx, CONTINUE.get(start..).unwrap_or_default())) {
                Ok(0) | Err(_) => return Poll::Ready(Err(ClientBodyError::Gone)),
                Ok(n) => self.continue_left -= n.min(self.continue_left),
            }
        }
        if self.flushing {
            // Under TLS the `100` may still be in the session.
            ready!(self.wire.poll_flush(cx)).map_err(|_| ClientBodyError::Gone)?;
            self.flushing = false;
        }
        Poll::Ready(Ok(()))
    }

    /// The next piece of the body from what is received, if it holds one.
    /// The connection's task is told once the body reaches its end here.
    fn next_piece(&mut self) -> Result<Option<Frame<Bytes>>, ClientBodyError> {
        let was_over = self.framing.is_over();
        let piece = self.framing.next_piece(&mut self.received);
        if !was_over && self.framing.is_over() {
            if let Some(over) = &self.over {
                over.notify_one();
            }
        }
        piece.map_err(|fault| match fault {
            BodyFault::Broken => ClientBodyError::Gone,
            BodyFault::Chunked(what) => ClientBodyError::Chunked(what),
        })
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        if self.cut {
            return Poll::Ready(Some(Err(ClientBodyError::Cut)));
        }
        if let Err(err) = ready!(self.send_continue(cx)) {
            return Poll::Ready(Some(Err(err)));
        }
        loop {
            match self.next_piece() {
                Ok(Some(frame)) => return Poll::Ready(Some(Ok(frame))),
                Err(err) => return Poll::Ready(Some(Err(err))),
                Ok(None) if self.framing.is_over() => return Poll::Ready(None),
                Ok(None) => {}
            }
            match ready!(self.wire.poll_fill(cx, &mut self.received, READ_ROOM)) {
                Ok(0) | Err(_) => return Poll::Ready(Some(Err(self.fail(ClientBodyError::Gone)))),
                Ok(_) => {}
            }
        }
    }
}

/// An HTTP/1 request body read by floodgate's own server, straight off the client's socket.
pub struct Http1Body {
    reading: Arc<Mutex<Reading>>,
}

impl Http1Body {
    pub(crate) fn new(reading: Arc<Mutex<Reading>>) -> Self {
        Http1Body { reading }
    }

    fn lock(&self) -> MutexGuard<'_, Reading> {
        Reading::lock(&self.reading)
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        self.lock().poll_frame(cx)
    }
}

/// Drops what is left of a body already `received` in full (a small remainder an upstream did not wait for), so
/// the connection can carry the next request; `false` when more of it is still on the way.
///
/// A body the exchange is still sending upstream (an answer came before the upload's end) fails from here rather
/// than ending short: its framing would otherwise say it ended whole, and a chunked body go up with its last chunk,
/// complete to the upstream and shorter than the client's.
pub(crate) fn discard_received(reading: &mut Reading) -> bool {
    loop {
        match reading.next_piece() {
            Ok(Some(piece)) => {
                if piece.data_ref().is_some_and(|data| !data.is_empty()) {
                    reading.cut = true;
                }
            }
            // No piece left in what is received: either the body is over, or the rest is still to come.
            Ok(None) => return reading.framing.is_over(),
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h1::chunked::ChunkedDecoder;
    use tokio::net::TcpStream;

    #[test]
    fn chunked_body_pieces_come_off_the_received_bytes_and_leave_the_next_request() {
        let received = BytesMut::from(&b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\r\n"[..]);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
            let mut reading = Reading::new(
                ClientWire::plain(Arc::new(client)),
                received,
                Delimited::Chunked(ChunkedDecoder::new(1024)),
                false,
            );
            assert!(discard_received(&mut reading));
            assert_eq!(&reading.received[..], b"GET / HTTP/1.1\r\n");
        });
    }

    #[test]
    fn a_body_whose_rest_was_dropped_for_the_next_request_fails_instead_of_ending() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
            let received = BytesMut::from(&b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n"[..]);
            let reading = Arc::new(Mutex::new(Reading::new(
                ClientWire::plain(Arc::new(client)),
                received,
                Delimited::Chunked(ChunkedDecoder::new(1024)),
                false,
            )));
            let mut body = ClientBody::Http1(Http1Body::new(reading.clone()));
            // The upload has taken the first chunk when the answer comes; the connection drops the rest.
            let first = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
            assert_eq!(first.unwrap().unwrap().into_data().unwrap(), Bytes::from_static(b"abc"));
            assert!(discard_received(&mut Reading::lock(&reading)), "the body was all here");
            assert!(!body.is_end_stream(), "a body missing its rest must not read as ended");
            let next = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
            assert!(matches!(next, Some(Err(ClientBodyError::Cut))), "{next:?}");
        });
    }
}
