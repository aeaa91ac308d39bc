//! hyper's HTTP/1 server (`http1_server = "hyper"`, and TLS clients) reads its client through floodgate's own
//! request reader: each request's head and body framing are read by `h1` first, and hyper is handed only bytes
//! that reader has taken. hyper takes a bare LF in a last chunk or a trailer section as a line's end, and would
//! read the request pipelined behind it as trailers where a strict reader sees a request (a desync behind any
//! LF-tolerant front); here the same bytes are refused as floodgate's own server refuses them.
//!
//! What is refused reaches hyper as a refusal of its own: a head as bytes hyper answers `400` (or `431`, for one
//! too large), a body as a byte hyper's chunked reader refuses and the stream's end, which fail the request's
//! body (answered `400`) and end the connection. It never changes a byte hyper is given, and holds no more than one
//! incomplete head, size line or trailer section of a client's.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::h1::body::Delimited;
use crate::h1::chunked::ChunkedDecoder;
use crate::h1::request_head::{self, BodyFraming};
use crate::h1::HeadError;

/// Room asked of each read from the client, as for floodgate's own server's first read of a request.
const READ_BYTES: usize = 8 * 1024;

/// A request line hyper refuses (`400`): a method cannot start with a NUL.
const REFUSED_HEAD: &[u8] = b"\0 / HTTP/1.1\r\n\r\n";

/// A byte hyper's chunked reader refuses wherever the refused part of a body began (a size line, a chunk's CRLF, a
/// trailer section); the end of the stream follows, so the body fails either way and hyper answers it (`400`).
const REFUSED_BODY: &[u8] = b"\0";

/// The start of a head hyper is then fed filler for until it refuses it as too large (`431`).
const TOO_LARGE_HEAD: &[u8] = b"GET / HTTP/1.1\r\nx-refused: ";

const FILLER: [u8; 1024] = [b'a'; 1024];

/// Where the client's byte stream is, as floodgate's reader reads it.
enum Reading {
    /// At a request head (the bytes so far, if any, in `unread`).
    Head,
    /// In a request's body; `then_opaque` once the request asked to leave HTTP.
    Body { body: Delimited, then_opaque: bool },
    /// After a request that asked for an upgrade (or CONNECT): what follows may be a tunnel's bytes, and is not
    /// read here. A refused upgrade closes the connection (see [`refused_upgrade`]), so no request is read
    /// unchecked after one.
    Opaque,
    /// A head was refused: hyper is fed `feed` (then, for one too large, filler) and then the end of the stream.
    HeadRefused {
        feed: &'static [u8],
        fed: usize,
        filler: usize,
    },
    /// A body was refused: hyper is fed [`REFUSED_BODY`], then the end of the stream.
    BodyRefused { fed: bool },
}

impl Reading {
    /// Where a request's body, `body`, leaves the stream.
    fn after(body: Delimited, asked_upgrade: bool) -> Reading {
        match (body.is_over(), asked_upgrade) {
            (true, false) => Reading::Head,
            (true, true) => Reading::Opaque,
            (false, then_opaque) => Reading::Body { body, then_opaque },
        }
    }
}

/// A client's stream, read by floodgate's request reader before hyper reads it.
pub(super) struct StrictRequests<I> {
    inner: I,
    /// Bytes read from the client and not yet handed to hyper; the first `taken` of them the reader has taken.
    held: BytesMut,
    taken: usize,
    /// A copy of what of `held` the reader has not taken yet: the reader splits what it takes off its front.
    unread: BytesMut,
    reading: Reading,
    max_header_bytes: usize,
}

impl<I> StrictRequests<I> {
    pub(super) fn new(inner: I, max_header_bytes: usize) -> Self {
        StrictRequests {
            inner,
            held: BytesMut::new(),
            taken: 0,
            unread: BytesMut::new(),
            reading: Reading::Head,
            max_header_bytes,
        }
    }

    /// Reads on through `unread` as far as it goes, counting what the reader takes as `taken`.
    fn read_on(&mut self) {
        loop {
            if matches!(self.reading, Reading::Opaque) {
                self.unread.clear();
                self.taken = self.held.len();
                return;
            }
            let before = self.unread.len();
            let went_on = match &mut self.reading {
                Reading::Head => match request_head::take(&mut self.unread, self.max_header_bytes) {
                    Ok(Some(head)) => {
                        let body = match head.body {
                            BodyFraming::Length(length) => Delimited::Length(length),
                            BodyFraming::Chunked => {
                                Delimited::Chunked(ChunkedDecoder::for_request(self.max_header_bytes))
                            }
                        };
                        self.reading = Reading::after(body, head.wants_upgrade);
                        true
                    }
                    Ok(None) => false,
                    Err(refused) => {
                        self.refuse_head(refused);
                        return;
                    }
                },
                Reading::Body { body, then_opaque } => match body.next_piece(&mut self.unread) {
                    Ok(Some(_)) => true,
                    Ok(None) if body.is_over() => {
                        self.reading = Reading::after(Delimited::Over, *then_opaque);
                        true
                    }
                    Ok(None) => false,
                    Err(_) => {
                        self.refuse(Reading::BodyRefused { fed: false });
                        return;
                    }
                },
                Reading::Opaque | Reading::HeadRefused { .. } | Reading::BodyRefused { .. } => return,
            };
            self.taken += before - self.unread.len();
            if !went_on {
                return;
            }
        }
    }

    fn refuse_head(&mut self, refused: HeadError) {
        self.refuse(match refused {
            HeadError::TooLarge => Reading::HeadRefused {
                feed: TOO_LARGE_HEAD,
                fed: 0,
                filler: self.max_header_bytes.saturating_add(1),
            },
            HeadError::TargetTooLong | HeadError::Malformed(_) => Reading::HeadRefused {
                feed: REFUSED_HEAD,
                fed: 0,
                filler: 0,
            },
        });
    }

    /// What the reader took before the refusal still goes to hyper; what it refused never does.
    fn refuse(&mut self, refusal: Reading) {
        self.held.truncate(self.taken);
        self.unread = BytesMut::new();
        self.reading = refusal;
    }
}

/// Whether an answer to a request that asked for an upgrade (`connect`: a CONNECT) refused it: such an answer ends
/// its connection, since [`StrictRequests`] no longer reads what the client sends after such a request.
pub(super) fn refused_upgrade(status: http::StatusCode, connect: bool) -> bool {
    if connect {
        !status.is_success()
    } else {
        status != http::StatusCode::SWITCHING_PROTOCOLS
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for StrictRequests<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.taken > 0 {
                let give = this.taken.min(buf.remaining());
                buf.put_slice(this.held.get(..give).unwrap_or_default());
                this.held.advance(give);
                this.taken -= give;
                return Poll::Ready(Ok(()));
            }
            match &mut this.reading {
                Reading::HeadRefused { feed, fed, filler } => {
                    let rest = feed.get(*fed..).unwrap_or_default();
                    if !rest.is_empty() {
                        let give = rest.len().min(buf.remaining());
                        buf.put_slice(rest.get(..give).unwrap_or_default());
                        *fed += give;
                    } else {
                        let give = (*filler).min(buf.remaining()).min(FILLER.len());
                        buf.put_slice(FILLER.get(..give).unwrap_or_default());
                        *filler -= give;
                    }
                    return Poll::Ready(Ok(()));
                }
                Reading::BodyRefused { fed } => {
                    if !*fed && buf.remaining() > 0 {
                        buf.put_slice(REFUSED_BODY);
                        *fed = true;
                    }
                    return Poll::Ready(Ok(()));
                }
                // Nothing held: bytes that are a tunnel's, or a body's counted by its length, go straight to hyper.
                Reading::Opaque if this.held.is_empty() => return Pin::new(&mut this.inner).poll_read(cx, buf),
                Reading::Body {
                    body: Delimited::Length(left),
                    then_opaque,
                } if this.held.is_empty() && *left > 0 => {
                    let (left, then_opaque) = (*left, *then_opaque);
                    let before = buf.filled().len();
                    ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
                    let read = buf.filled().get(before..).unwrap_or_default();
                    let body_bytes = usize::try_from(left).unwrap_or(usize::MAX).min(read.len());
                    // What follows the body is the next request's: the reader reads it before hyper may.
                    if let Some(past) = read.get(body_bytes..).filter(|past| !past.is_empty()) {
                        this.held.extend_from_slice(past);
                        this.unread.extend_from_slice(past);
                        buf.set_filled(before + body_bytes);
                    }
                    this.reading = Reading::after(Delimited::Length(left - body_bytes as u64), then_opaque);
                    this.read_on();
                    return Poll::Ready(Ok(()));
                }
                _ => {}
            }
            this.held.reserve(READ_BYTES);
            let before = this.held.len();
            if ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut this.held
            ))? == 0
            {
                // The client's end: hyper is handed it, and what was incomplete it never sees.
                this.held.clear();
                this.unread.clear();
                return Poll::Ready(Ok(()));
            }
            let read = this.held.get(before..).unwrap_or_default();
            this.unread.extend_from_slice(read);
            this.read_on();
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for StrictRequests<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A client that sends its bytes `step` at a time.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl AsyncRead for Trickle {
        fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            let end = (self.at + self.step).min(self.bytes.len());
            let give = (end - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.bytes[at..at + give]);
            self.at += give;
            Poll::Ready(Ok(()))
        }
    }

    async fn through(bytes: &[u8], step: usize) -> Vec<u8> {
        let client = Trickle {
            bytes: bytes.to_vec(),
            at: 0,
            step,
        };
        let mut strict = StrictRequests::new(client, 16 * 1024);
        let mut seen = Vec::new();
        let mut piece = [0u8; 7];
        loop {
            let n = strict.read(&mut piece).await.unwrap();
            if n == 0 {
                return seen;
            }
            seen.extend_from_slice(&piece[..n]);
            assert!(seen.len() < bytes.len() + 64 * 1024, "fed without end");
        }
    }

    #[tokio::test]
    async fn requests_it_takes_reach_hyper_unchanged_however_they_are_cut() {
        let mut stream = Vec::new();
        stream.extend_from_slice(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
        stream.extend_from_slice(b"GET /b HTTP/1.1\nHost: x\n\n");
        stream.extend_from_slice(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
        stream.extend_from_slice(b"3;ext=1\r\nabc\r\n0\r\nx-t: 1\r\n\r\n");
        stream.extend_from_slice(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n");
        // A tunnel's bytes after an upgrade are not HTTP, and pass as they are.
        stream.extend_from_slice(b"\x81\x05hello\n\n\r\x00");
        for step in [1, 2, 3, 5, 64, 4096] {
            assert_eq!(through(&stream, step).await, stream, "step {step}");
        }
    }

    #[tokio::test]
    async fn a_refused_body_reaches_hyper_as_far_as_was_taken_then_as_a_byte_it_refuses() {
        let good = b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n";
        let mut stream = good.to_vec();
        stream.extend_from_slice(b"x-t: 1\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n");
        // As far as was taken: whole pieces, so where a piece ends depends on how the bytes came.
        let head_and_data = good.len() - b"\r\n0\r\n".len();
        for step in [1, 4096] {
            let seen = through(&stream, step).await;
            let (given, fed) = seen.split_at(seen.len() - REFUSED_BODY.len());
            assert_eq!(fed, REFUSED_BODY, "step {step}");
            assert!(
                good.starts_with(given) && given.len() >= head_and_data,
                "step {step}: {given:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_refused_head_reaches_hyper_as_one_it_refuses() {
        let good = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut stream = good.to_vec();
        stream.extend_from_slice(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab");
        let mut expected = good.to_vec();
        expected.extend_from_slice(REFUSED_HEAD);
        assert_eq!(through(&stream, 3).await, expected);

        let mut too_large = good.to_vec();
        too_large.extend_from_slice(b"GET /b HTTP/1.1\r\nx: ");
        too_large.extend_from_slice(&[b'b'; 20 * 1024]);
        let seen = through(&too_large, 4096).await;
        assert!(seen.starts_with(good));
        assert!(seen[good.len()..].starts_with(TOO_LARGE_HEAD));
        assert!(
            seen.len() > good.len() + 16 * 1024,
            "filler past the limit: {}",
            seen.len()
        );
    }
}
