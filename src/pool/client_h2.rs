//! floodgate's HTTP/2 client, on one stream of a pool session: the request's head sent as HTTP/2 (its
//! connection-specific fields dropped, its Host as the authority), its body and trailers streamed at the
//! upstream's flow-control pace beside the answer, and the answer's body and trailers read off the stream as they
//! are taken, its window given back as they are.
//!
//! It never decides whether a stream's permit is reused and never counts anything (the permit and its session
//! do).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use super::client::{client_body_error, Upload, UpstreamIncoming};
use super::session::Session;
use super::StreamLive;
use crate::body::{RequestBody, UpstreamRequest};
use crate::error::{ProxyError, UpstreamError};

/// Headers that mean something only on one HTTP/1 connection (RFC 9113 §8.2.2): an HTTP/2 request carrying one is
/// malformed.
const CONNECTION_SPECIFIC: [header::HeaderName; 4] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HeaderName::from_static("keep-alive"),
];

/// Sends `request` on a new stream of `session` (`scheme`: the upstream's, for the `:scheme` field) and waits for
/// the answer's head while its body goes out; what is left of the body then goes on beside the answer (the
/// returned [`Upload`]). `live` is held by every handle on the stream, so its permit knows when they are gone. A
/// request that could not open its stream (the session going away) is put in `unsent`, whole, to be sent again.
pub(crate) async fn send(
    session: &Arc<Session>,
    live: StreamLive,
    scheme: &'static str,
    request: UpstreamRequest,
    unsent: Option<&Unsent>,
    kept: Option<Arc<Kept>>,
) -> Result<(Response<UpstreamIncoming>, Option<Upload>), ProxyError> {
    let (mut parts, body) = (*request).into_parts();
    let authority = parts
        .headers
        .remove(header::HOST)
        .and_then(|host| host.to_str().ok().map(str::to_owned))
        .or_else(|| parts.uri.authority().map(|authority| authority.as_str().to_owned()))
        .unwrap_or_default();
    let path = parts.uri.path_and_query().map_or("/", |path| path.as_str()).to_owned();
    parts.uri = Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|err| ProxyError::Connect(format!("no HTTP/2 request could be made of this one: {err}")))?;
    parts.version = Version::HTTP_2;
    for name in CONNECTION_SPECIFIC {
        parts.headers.remove(name);
    }
    parts.headers.remove("proxy-connection");
    // TE may say only "trailers" in HTTP/2 (RFC 9113 §8.2.2), and a gRPC server expects it: floodgate relays
    // trailers, so a gRPC call says it does (the client's own TE is hop-by-hop and went with the client's hop).
    parts.headers.remove(header::TE);
    if crate::admission::is_grpc(&parts.headers) {
        parts.headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    let ended = body.is_end_stream();
    let mut sender = match session.sender().ready().await {
        Ok(sender) => sender,
        // The session is going away (a GOAWAY read, a failure) and no stream opened: nothing was sent, and the
        // request goes back whole, body and all, to be sent on another connection.
        Err(err) => {
            let whole = Unopened::Request(Box::new(Request::from_parts(parts, body)));
            return Err(not_opened(session, err, unsent, whole));
        }
    };
    let (answer, stream) = match sender.send_request(Request::from_parts(parts, ()), ended) {
        Ok(opened) => opened,
        // The GOAWAY came between the sender's readiness and the stream's opening: the head went nowhere and
        // the body was not read, so the body goes back to meet the exchange's copy of the head.
        Err(err) => return Err(not_opened(session, err, unsent, Unopened::Body(body))),
    };
    drop(sender);
    let mut upload: Option<Upload> = (!ended).then(|| -> Upload { Box::pin(pump(body, stream, live.clone(), kept)) });
    let mut answer = std::pin::pin!(answer);
    let head = loop {
        let Some(going) = upload.as_mut() else {
            break answer.as_mut().await;
        };
        tokio::select! {
            biased;
            head = answer.as_mut() => break head,
            sent = going => {
                upload = None;
                // The client's body failed: the stream is reset as its handles go, and the answer is not waited for.
                if let Err(err) = sent {
                    if !matches!(err, ProxyError::Upstream(_)) {
                        return Err(err);
                    }
                }
            }
        }
    };
    let response = match head {
        Ok(response) => response,
        Err(err) => {
            // Refused unprocessed while its body was still on its way in: the rest of the body is read into its
            // copy (the pump stops sending and keeps reading), so the request can go again whole.
            if let (true, Some(going)) = (not_processed(&err), upload) {
                let _ = going.await;
            }
            return Err(failed(session, err));
        }
    };
    let (parts, recv) = response.into_parts();
    let length = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    let body = H2Incoming {
        recv,
        trailers_done: false,
        length,
        _live: live,
    };
    Ok((Response::from_parts(parts, UpstreamIncoming::H2(body)), upload))
}

/// Where a request that opened no stream is handed back.
pub(crate) type Unsent = std::sync::Mutex<Option<Unopened>>;

/// What of a request that opened no stream comes back: all of it, or (its head having gone into the refused
/// stream's making) its untouched body, for the exchange's copy of the head.
pub(crate) enum Unopened {
    Request(UpstreamRequest),
    Body(RequestBody),
}

/// A copy of a request body as it went out, while it stays small: to send again on another connection if the
/// upstream says it did not process the stream (above its GOAWAY's last id, `REFUSED_STREAM`).
#[derive(Default)]
pub(crate) struct SentBody {
    data: bytes::BytesMut,
    trailers: Option<HeaderMap>,
    ended: bool,
    /// Past [`KEPT_BODY`]: no copy is kept, and the request cannot go again.
    too_large: bool,
}

/// The most of a request body copied in case its stream must go again.
const KEPT_BODY: usize = 64 * 1024;

impl SentBody {
    fn keep(&mut self, data: &Bytes) {
        if self.too_large || self.data.len() + data.len() > KEPT_BODY {
            self.too_large = true;
            self.data = bytes::BytesMut::new();
        } else {
            self.data.extend_from_slice(data);
        }
    }

    /// The whole body as it went out, if it ended and was kept.
    pub(crate) fn whole(&mut self) -> Option<(Bytes, Option<HeaderMap>)> {
        (self.ended && !self.too_large).then(|| (std::mem::take(&mut self.data).freeze(), self.trailers.take()))
    }
}

/// Where [`SentBody`] is kept, shared by the upload and the exchange.
pub(crate) type Kept = std::sync::Mutex<SentBody>;

/// The error a failed stream is answered with; one that is the connection's leaves the session to no new stream.
fn failed(session: &Session, err: h2::Error) -> ProxyError {
    if err.is_go_away() || err.is_io() {
        session.give_up();
    }
    if not_processed(&err) {
        ProxyError::Upstream(UpstreamError::NotProcessed(err))
    } else {
        ProxyError::Upstream(UpstreamError::H2(err))
    }
}

/// The error a request that opened no stream is answered with; when its session is going away, what of it was not
/// sent goes back in `unsent`, to be sent on another connection.
fn not_opened(session: &Session, err: h2::Error, unsent: Option<&Unsent>, unopened: Unopened) -> ProxyError {
    let refused = failed(session, err);
    let going = matches!(refused, ProxyError::Upstream(UpstreamError::NotProcessed(_))) || session.is_gone();
    if let (true, Some(unsent)) = (going, unsent) {
        *unsent.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(unopened);
    }
    refused
}

/// Whether the upstream says it did not process the stream: above its GOAWAY's last id, or refused.
fn not_processed(err: &h2::Error) -> bool {
    (err.is_go_away() && err.is_remote()) || err.reason() == Some(h2::Reason::REFUSED_STREAM)
}

/// Streams the request body out as the upstream's window allows, its trailers last.
async fn pump(
    mut body: RequestBody,
    stream: h2::SendStream<Bytes>,
    live: StreamLive,
    kept: Option<Arc<Kept>>,
) -> Result<(), ProxyError> {
    match pump_all(&mut body, stream, live, kept.as_deref()).await {
        // The upstream ended the stream with its answer and told us to stop sending (RFC 9113 §8.1): the call is
        // over, not cut short.
        Err(ProxyError::Upstream(UpstreamError::H2(err))) if err.reason() == Some(h2::Reason::NO_ERROR) => Ok(()),
        // The stream failed under the body, perhaps refused unprocessed (a GOAWAY): what is left of a small body
        // is read into its copy, for the exchange to send it again whole if it was refused so. Bounded by the
        // copy's size and the body's idle bound; dropped unawaited if the exchange has no use for it.
        Err(err @ ProxyError::Upstream(UpstreamError::H2(_) | UpstreamError::BodyCutShort)) => {
            if let Some(kept) = &kept {
                keep_the_rest(&mut body, kept).await;
            }
            Err(err)
        }
        pumped => pumped,
    }
}

/// Reads the rest of a body into its copy, until it ends, fails or outgrows the copy.
async fn keep_the_rest(body: &mut RequestBody, kept: &Kept) {
    let lock = || kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    loop {
        {
            let sent = lock();
            if sent.ended || sent.too_large {
                return;
            }
        }
        match body.frame().await {
            None => lock().ended = true,
            Some(Err(_)) => return,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let mut sent = lock();
                    sent.keep(&data);
                    sent.ended = body.is_end_stream();
                }
                Err(frame) => {
                    let mut sent = lock();
                    sent.trailers = frame.into_trailers().ok();
                    sent.ended = true;
                }
            },
        }
    }
}

async fn pump_all(
    body: &mut RequestBody,
    mut stream: h2::SendStream<Bytes>,
    _live: StreamLive,
    kept: Option<&Kept>,
) -> Result<(), ProxyError> {
    let upstream = |err: h2::Error| ProxyError::Upstream(UpstreamError::H2(err));
    let keep = |change: &dyn Fn(&mut SentBody)| {
        if let Some(kept) = kept {
            change(&mut kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        }
    };
    loop {
        match body.frame().await {
            None => {
                keep(&|sent| sent.ended = true);
                stream.send_data(Bytes::new(), true).map_err(upstream)?;
                return Ok(());
            }
            Some(Err(err)) => {
                stream.send_reset(h2::Reason::CANCEL);
                return Err(client_body_error(err));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    let last = body.is_end_stream();
                    keep(&|sent| {
                        sent.keep(&data);
                        sent.ended = last;
                    });
                    // A body's end may come as an empty frame of its own (hyper's and tonic's clients end a
                    // stream so): the end goes on, or the upstream waits for it forever.
                    if data.is_empty() && last {
                        stream.send_data(Bytes::new(), true).map_err(upstream)?;
                        return Ok(());
                    }
                    while !data.is_empty() {
                        stream.reserve_capacity(data.len());
                        // An upstream that gives no window back for the body's idle bound stalls it as a client
                        // that sends nothing would: the stream is reset, and its place held until that is read.
                        let idle = body.idle_timeout();
                        let waited = tokio::time::timeout(idle, std::future::poll_fn(|cx| stream.poll_capacity(cx)));
                        let room = match waited.await {
                            Ok(Some(Ok(room))) => room,
                            Ok(Some(Err(err))) => return Err(upstream(err)),
                            Ok(None) => return Err(ProxyError::Upstream(UpstreamError::BodyCutShort)),
                            Err(_) => {
                                stream.send_reset(h2::Reason::CANCEL);
                                return Err(ProxyError::Upstream(UpstreamError::BodyStalled(idle)));
                            }
                        };
                        let piece = data.split_to(room.min(data.len()));
                        stream.send_data(piece, last && data.is_empty()).map_err(upstream)?;
                    }
                    if last {
                        return Ok(());
                    }
                }
                Err(frame) => {
                    if let Ok(mut trailers) = frame.into_trailers() {
                        // A connection-specific field makes the message malformed (RFC 9113 §8.2.2), and an
                        // upstream may take that as the whole connection's error.
                        for name in CONNECTION_SPECIFIC {
                            trailers.remove(name);
                        }
                        trailers.remove(header::TE);
                        trailers.remove("proxy-connection");
                        keep(&|sent| {
                            sent.trailers = Some(trailers.clone());
                            sent.ended = true;
                        });
                        stream.send_trailers(trailers).map_err(upstream)?;
                        return Ok(());
                    }
                }
            },
        }
    }
}

/// An HTTP/2 answer's body: its data, then its trailers (gRPC's status is in them).
pub struct H2Incoming {
    recv: h2::RecvStream,
    trailers_done: bool,
    length: Option<u64>,
    _live: StreamLive,
}

impl Body for H2Incoming {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = &mut *self;
        if this.trailers_done {
            return Poll::Ready(None);
        }
        if !this.recv.is_end_stream() {
            match std::task::ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The window is given back as the bytes are taken: the client's pace is the upstream's.
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(err)) => {
                    this.trailers_done = true;
                    return Poll::Ready(Some(Err(UpstreamError::H2(err))));
                }
                None => {}
            }
        }
        let trailers: Option<HeaderMap> = match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(trailers) => trailers,
            Err(err) => {
                this.trailers_done = true;
                return Poll::Ready(Some(Err(UpstreamError::H2(err))));
            }
        };
        this.trailers_done = true;
        Poll::Ready(trailers.map(|trailers| Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.trailers_done
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(length) => SizeHint::with_exact(length),
            None => SizeHint::default(),
        }
    }
}
