//! floodgate's HTTP/1 client, on a pool connection's wire: a request written onto an upstream connection's wire (`h1::write`), the answer's
//! head read off it (`h1::response_head`), and the answer's body read from it by whoever takes the body, with no
//! task of the connection's own between them. A request body the upstream answers before it has all of it goes
//! on being written beside the answer ([`Upload`]), as hyper's client did.
//!
//! It never decides whether a connection is reused (the lease does, from what it reports: `spent`, keep-alive)
//! and never counts anything.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{Method, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use super::wire::{self, Wire};
use crate::body::{BodyStalled, BoxError, ClientBodyError, RequestBody, UpstreamRequest};
use crate::error::{ProxyError, UpstreamError};
use crate::h1::body::{BodyFault, Delimited};
use crate::h1::chunked::ChunkedDecoder;
use crate::h1::response_head::{self, MAX_INTERIM_HEADS, MAX_RESPONSE_HEAD_BYTES};
use crate::h1::write::{self, BodySize, LAST_CHUNK};
use crate::h1::Framing;

/// Room asked for by each read of a head, and of a body.
const HEAD_ROOM: usize = 4 * 1024;
const BODY_ROOM: usize = 16 * 1024;

/// Body pieces up to this size go out in one write with their framing (and the first with the head).
const COALESCE: usize = 8 * 1024;

/// The largest trailer section of a chunked answer, as hyper's client bounds it.
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// The rest of a request body still going out once the answer's head came: to be run to its end (see
/// [`UpstreamPool::spawn`](crate::pool::UpstreamPool::spawn)), or dropped, which leaves the connection spent. Its
/// failure (the client's body cut short, the upstream no longer reading) leaves it spent too, the body unended.
pub type Upload = Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>>;

/// Sends `request` on `wire` and reads the answer's head. The answer's body reads the same wire as it is taken.
pub(crate) async fn send(
    wire: &Arc<Wire>,
    request: UpstreamRequest,
) -> Result<(Response<UpstreamIncoming>, Option<Upload>), ProxyError> {
    wire.take_for_exchange();
    let (mut parts, mut body) = (*request).into_parts();
    let declared = body.size_hint().exact();
    // What of the body is already read goes out with the head, as one piece (one chunk); a large piece goes out as
    // it is, between its framing (in `out` before it, in `tail` after it). Read before the head is written, so
    // that a body that turned out empty (an HTTP/2 GET whose stream ended with no data) is sent as none.
    let ended_at_start = body.is_end_stream();
    let mut first_done = ended_at_start;
    let mut gathered = BytesMut::new();
    let mut large = Bytes::new();
    while !first_done && gathered.len() < COALESCE {
        match body.frame().now_or_never() {
            Some(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else { continue };
                first_done = body.is_end_stream();
                if gathered.is_empty() && data.len() > COALESCE {
                    large = data;
                    break;
                }
                gathered.extend_from_slice(&data);
            }
            Some(Some(Err(err))) => return Err(fail(wire, client_body_error(err))),
            Some(None) => first_done = true,
            None => break,
        }
    }
    let piece = if large.is_empty() { gathered.freeze() } else { large };
    // The body's framing follows the body, whatever the method: a GET that carries one (RFC 9110 §9.3.1 gives it no
    // meaning, and a proxy forwards it) sends it, however its bytes are timed.
    // A body read whole keeps the framing its client gave it (buffering changes nothing the upstream reads): an
    // empty chunked POST goes chunked. Only a GET or HEAD whose stream turned out empty goes as none, as it did.
    let bodiless = matches!(parts.method, Method::GET | Method::HEAD);
    let size = if ended_at_start || (bodiless && first_done && piece.is_empty()) {
        BodySize::Empty
    } else {
        declared.map_or(BodySize::Unknown, BodySize::Known)
    };
    let mut out = BytesMut::new();
    let encoding = write::request_head(&mut out, &parts.method, &parts.uri, &mut parts.headers, size);
    let mut sending = Sending {
        encoding,
        left: match encoding {
            Framing::Length(length) => length,
            _ => 0,
        },
    };
    let mut tail = BytesMut::new();
    let large = if piece.is_empty() {
        piece
    } else {
        sending
            .frame(&mut out, &mut tail, piece)
            .map_err(|err| fail(wire, err))?
    };
    if first_done && size != BodySize::Empty {
        sending.finish(&mut tail).map_err(|err| fail(wire, err))?;
    }
    let written = wire::write_all(wire, &[&out, &large, &tail]).await;
    drop((large, tail));
    // What a replay would send, should the upstream fail this exchange before it answers: moved, not copied.
    let sent = (bodiless && size == BodySize::Empty).then(|| SentHead {
        bytes: out,
        method: parts.method.clone(),
    });
    if let Err(err) = written {
        return Err(fail_replayable(wire, ProxyError::Upstream(err.into()), sent));
    }
    let method = parts.method;
    let head = read_head(wire, &method, sent);
    if first_done {
        return Ok((head.await?, None));
    }
    // The body goes out while the answer is awaited: an upstream may answer before it has all of it.
    wire.lock().uploading = true;
    let mut upload = Box::pin(upload(wire.clone(), body, sending));
    tokio::pin!(head);
    let mut uploaded = false;
    let answer = loop {
        tokio::select! {
            biased;
            answer = &mut head => break answer,
            done = &mut upload, if !uploaded => match done {
                Ok(()) => uploaded = true,
                // An upstream that stopped reading may still have answered (a 413, say): its answer is awaited.
                Err(ProxyError::Upstream(_)) => uploaded = true,
                // The client's body failed: that is the request's failure, whatever the upstream would answer.
                Err(client) => return Err(client),
            },
        }
    };
    // Failed before the answer came, an upload still going is dropped, which leaves the connection spent.
    let response = answer?;
    if uploaded {
        return Ok((response, None));
    }
    // An upload that fails after the answer came only spends the connection: the answer stands.
    Ok((response, Some(Box::pin(upload))))
}

/// A bodiless GET or HEAD's head as it was written, left on its wire when the exchange fails before the answer's
/// head comes ([`Wire::take_sent_head`]): sent again as it is ([`resend`]) when the upstream closed a reused
/// connection just as the request went out, without the copy of the request's head that keeping it in advance
/// would cost.
pub(crate) struct SentHead {
    bytes: BytesMut,
    method: Method,
}

/// Sends `head` again, on a fresh connection's `wire`, and reads the answer's head.
pub(crate) async fn resend(
    wire: &Arc<Wire>,
    head: SentHead,
) -> Result<(Response<UpstreamIncoming>, Option<Upload>), ProxyError> {
    wire.take_for_exchange();
    wire::write_all(wire, &[&head.bytes])
        .await
        .map_err(|err| fail(wire, ProxyError::Upstream(err.into())))?;
    Ok((read_head(wire, &head.method, None).await?, None))
}

/// The answer's head, past any interim `1xx`: each is taken off the buffer as soon as it is read (never parsed
/// again with the next read), and they are bounded in number and bytes.
/// `sent`: the head to leave on the wire for a replay if no answer's head comes.
async fn read_head(
    wire: &Arc<Wire>,
    method: &Method,
    sent: Option<SentHead>,
) -> Result<Response<UpstreamIncoming>, ProxyError> {
    let (mut interim, mut interim_bytes) = (0usize, 0usize);
    let head = std::future::poll_fn(|cx| {
        let mut state = wire.lock();
        loop {
            if !state.received.is_empty() {
                let before = state.received.len();
                match response_head::next(&mut state.received, method, MAX_RESPONSE_HEAD_BYTES) {
                    Ok(Some(Some(head))) => return Poll::Ready(Ok(head)),
                    Ok(Some(None)) => {
                        let len = before - state.received.len();
                        interim += 1;
                        interim_bytes += len;
                        if interim > MAX_INTERIM_HEADS || interim_bytes > MAX_RESPONSE_HEAD_BYTES {
                            return Poll::Ready(Err(UpstreamError::TooManyInterim));
                        }
                        continue;
                    }
                    Ok(None) => {}
                    Err(err) => return Poll::Ready(Err(UpstreamError::Head(err))),
                }
            }
            match ready!(state.poll_fill(cx, HEAD_ROOM)) {
                Ok(0) => return Poll::Ready(Err(UpstreamError::ClosedBeforeHead)),
                Ok(_) => {}
                Err(err) => return Poll::Ready(Err(UpstreamError::Io(err))),
            }
        }
    })
    .await
    .map_err(|err| fail_replayable(wire, ProxyError::Upstream(err), sent))?;
    let mut parts = head.parts;
    if let Some(reason) = head
        .reason
        .and_then(|reason| hyper::ext::ReasonPhrase::try_from(reason).ok())
    {
        parts.extensions.insert(reason);
    }
    let framing = match head.body {
        Framing::Length(length) => Delimited::Length(length),
        Framing::Chunked => Delimited::Chunked(ChunkedDecoder::new(MAX_TRAILER_BYTES)),
        Framing::UntilClose => Delimited::UntilClose,
    };
    if !head.keep_alive || head.upgrade || matches!(framing, Delimited::UntilClose) {
        wire.lock().spent = true;
    }
    let upgrade = head.upgrade;
    let body = H1Incoming {
        wire: wire.clone(),
        framing,
    };
    // A switch leaves the connection to the tunnel, which reads it from here: it is not idle, nor watched.
    if !upgrade {
        body.ended_if_over();
    }
    Ok(Response::from_parts(parts, UpstreamIncoming::H1(body)))
}

fn fail(wire: &Wire, err: ProxyError) -> ProxyError {
    fail_replayable(wire, err, None)
}

/// [`fail`], leaving `sent` on the wire for a replay.
fn fail_replayable(wire: &Wire, err: ProxyError, sent: Option<SentHead>) -> ProxyError {
    let mut state = wire.lock();
    state.spent = true;
    state.sent_head = sent;
    err
}

/// A request body's failure, as the client's (400, 408) when it was the client's.
pub fn client_body_error(err: BoxError) -> ProxyError {
    if let Some(stalled) = err.downcast_ref::<BodyStalled>() {
        return ProxyError::ClientBodyTimeout(stalled.1);
    }
    match err.downcast::<ClientBodyError>() {
        Ok(client) => client.meaning(),
        Err(other) => ProxyError::ClientBody(other.to_string()),
    }
}

/// The framing a request body goes out in, and what of a stated length is still owed.
#[derive(Clone, Copy)]
struct Sending {
    encoding: Framing,
    left: u64,
}

impl Sending {
    /// Frames `data`: a small piece is copied into `before` with its framing, and nothing is returned; a large one
    /// is returned to be written as it is, its framing put in `before` and `after`.
    fn frame(&mut self, before: &mut BytesMut, after: &mut BytesMut, data: Bytes) -> Result<Bytes, ProxyError> {
        let large = data.len() > COALESCE;
        match self.encoding {
            Framing::Chunked if large => {
                write::put_chunk_size(before, data.len());
                after.extend_from_slice(b"\r\n");
            }
            Framing::Chunked => write::put_chunk(before, &data),
            Framing::Length(_) | Framing::UntilClose => {
                self.count(data.len())?;
                if !large {
                    before.extend_from_slice(&data);
                }
            }
        }
        Ok(if large { data } else { Bytes::new() })
    }

    /// Counts `len` bytes against the stated length.
    fn count(&mut self, len: usize) -> Result<(), ProxyError> {
        let len = len as u64;
        if len > self.left {
            return Err(ProxyError::ClientBody(
                "the request body is longer than its Content-Length".into(),
            ));
        }
        self.left -= len;
        Ok(())
    }

    /// The body's end: the last chunk, or a check that the stated length was all sent.
    fn finish(&self, out: &mut BytesMut) -> Result<(), ProxyError> {
        match self.encoding {
            Framing::Chunked => out.extend_from_slice(LAST_CHUNK),
            Framing::Length(_) | Framing::UntilClose if self.left > 0 => {
                return Err(ProxyError::ClientGone);
            }
            Framing::Length(_) | Framing::UntilClose => {}
        }
        Ok(())
    }
}

/// Writes the rest of `body` in its framing; a failure is the client's when its body failed, else the upstream's.
/// Whatever of the body is already read when a piece comes goes out with it, as one chunk in one write: a client
/// sending one-byte chunks would otherwise cost a system call (and five bytes of framing upstream) per byte.
async fn upload(wire: Arc<Wire>, mut body: RequestBody, mut sending: Sending) -> Result<(), ProxyError> {
    let mut ends = UploadEnds {
        wire: wire.clone(),
        whole: false,
    };
    let mut out = BytesMut::new();
    let written = async {
        let mut ended = false;
        while !ended {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(err)) => return Err(client_body_error(err)),
            };
            let Ok(mut data) = frame.into_data() else { continue };
            ended = body.is_end_stream();
            if data.len() < COALESCE && !ended {
                let mut gathered = BytesMut::from(&data[..]);
                while gathered.len() < COALESCE && !ended {
                    match body.frame().now_or_never() {
                        Some(Some(Ok(frame))) => {
                            if let Ok(more) = frame.into_data() {
                                gathered.extend_from_slice(&more);
                            }
                            ended = body.is_end_stream();
                        }
                        Some(Some(Err(err))) => return Err(client_body_error(err)),
                        Some(None) => ended = true,
                        None => break,
                    }
                }
                data = gathered.freeze();
            }
            let mut after = BytesMut::new();
            let large = sending.frame(&mut out, &mut after, data)?;
            wire::write_all(&wire, &[&out, &large, &after])
                .await
                .map_err(upstream_io)?;
            out.clear();
        }
        sending.finish(&mut out)?;
        if !out.is_empty() {
            wire::write_all(&wire, &[&out]).await.map_err(upstream_io)?;
        }
        Ok(())
    }
    .await;
    ends.whole = written.is_ok();
    written
}

/// Tells the wire the upload is over however it ends: run to its end, failed, or dropped unfinished.
struct UploadEnds {
    wire: Arc<Wire>,
    whole: bool,
}

impl Drop for UploadEnds {
    fn drop(&mut self) {
        self.wire.upload_ended(self.whole);
    }
}

fn upstream_io(err: io::Error) -> ProxyError {
    ProxyError::Upstream(UpstreamError::Io(err))
}

/// An answer's body, read off the upstream connection (or its HTTP/2 stream) as it is taken.
pub enum UpstreamIncoming {
    H1(H1Incoming),
    H2(super::client_h2::H2Incoming),
}

impl Body for UpstreamIncoming {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        match self.get_mut() {
            UpstreamIncoming::H1(body) => Pin::new(body).poll_frame(cx),
            UpstreamIncoming::H2(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamIncoming::H1(body) => body.is_end_stream(),
            UpstreamIncoming::H2(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamIncoming::H1(body) => body.size_hint(),
            UpstreamIncoming::H2(body) => body.size_hint(),
        }
    }
}

/// An HTTP/1 answer's body, read off the upstream connection as it is taken.
pub struct H1Incoming {
    wire: Arc<Wire>,
    framing: Delimited,
}

impl H1Incoming {
    fn is_over(&self) -> bool {
        self.framing.is_over()
    }

    /// At the body's end: bytes past it are what no request asked for, and leave the connection spent; without
    /// them, the read buffer goes (an idle connection holds none).
    /// No exchange uses the connection after that: its watch looks out for the upstream closing it.
    fn ended_if_over(&self) {
        if self.is_over() {
            let mut state = self.wire.lock();
            if state.received.is_empty() {
                state.received = BytesMut::new();
            } else {
                state.spent = true;
            }
            state.idle = true;
            self.wire.watch_while_idle(&mut state);
        }
    }

    fn failed(&mut self, err: UpstreamError) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        self.framing = Delimited::Broken;
        self.wire.lock().spent = true;
        Poll::Ready(Some(Err(err)))
    }
}

impl Body for H1Incoming {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = &mut *self;
        // Over already: the connection may be carrying another exchange by now, and is not touched again.
        if this.is_over() {
            return Poll::Ready(None);
        }
        loop {
            let mut state = this.wire.lock();
            let read = match this.framing.next_piece(&mut state.received) {
                Ok(Some(frame)) => {
                    drop(state);
                    this.ended_if_over();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Ok(None) if this.framing.is_over() => {
                    drop(state);
                    this.ended_if_over();
                    return Poll::Ready(None);
                }
                Ok(None) => ready!(state.poll_fill(cx, BODY_ROOM)),
                Err(fault) => {
                    drop(state);
                    return this.failed(match fault {
                        BodyFault::Broken => UpstreamError::BodyCutShort,
                        BodyFault::Chunked(what) => UpstreamError::Chunked(what),
                    });
                }
            };
            drop(state);
            match read {
                Ok(0) if matches!(this.framing, Delimited::UntilClose) => {
                    this.framing = Delimited::Over;
                    return Poll::Ready(None);
                }
                Ok(0) => return this.failed(UpstreamError::BodyCutShort),
                Ok(_) => {}
                Err(err) => return this.failed(UpstreamError::Io(err)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.is_over()
    }

    fn size_hint(&self) -> SizeHint {
        self.framing.size_hint()
    }
}

impl Drop for H1Incoming {
    fn drop(&mut self) {
        // A body left before its end leaves the rest of it on the connection.
        if !self.is_over() {
            self.wire.lock().spent = true;
        }
    }
}
