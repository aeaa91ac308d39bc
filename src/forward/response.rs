//! The answer the client gets: the upstream's head checked for framing it must not pass on (and a 204's
//! `Content-Length` dropped), a small body read in full first and relayed from memory without a lease, or a short
//! answer of floodgate's own. It never dials.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::admission::Shed;
use crate::buffer::{self, BufferBudget, ReadError};
use crate::error::{Outcome, ProxyError, ShedAdvice};
use crate::h1::{keeps_alive_given, Present};
use crate::pool::Lease;
use crate::record::Record;

use super::{check_transfer_coding, strip_hop_by_hop, BoxError, UpstreamBody, UpstreamIncoming};

/// The body of every answer floodgate sends: the upstream's, or a short one of its own.
pub struct ResponseBody {
    kind: Kind,
}

// As for `RelayHandle`: a local answer is rare, and the upstream's body is not worth an allocation to shrink it.
#[allow(clippy::large_enum_variant)]
pub(super) enum Kind {
    Upstream(UpstreamBody),
    Local(Option<Bytes>),
}

impl ResponseBody {
    pub fn upstream(body: UpstreamBody) -> Self {
        ResponseBody {
            kind: Kind::Upstream(body),
        }
    }

    /// A body already in memory (an upstream's refusal of an upgrade, read in full).
    pub fn full(bytes: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Local((!bytes.is_empty()).then_some(bytes)),
        }
    }

    pub fn local(text: &'static str) -> Self {
        ResponseBody {
            kind: Kind::Local(Some(Bytes::from_static(text.as_bytes()))),
        }
    }

    /// The request's record, finished by this body's end. An answer of floodgate's own was finished when it was
    /// made (its whole body is known then); one that was not is finished now, as served.
    pub(crate) fn recorded(mut self, mut record: Record) -> Self {
        if !record.is_finished() {
            match &mut self.kind {
                Kind::Upstream(body) => body.record(record),
                Kind::Local(bytes) => {
                    record.relayed(bytes.as_ref().map_or(0, Bytes::len));
                    record.finish(Outcome::Ok);
                }
            }
        }
        self
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            Kind::Upstream(body) => Pin::new(body).poll_frame(cx),
            Kind::Local(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Upstream(body) => body.is_end_stream(),
            Kind::Local(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Upstream(body) => body.size_hint(),
            Kind::Local(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}

/// Names why a request was shed, in the words of the metrics' outcomes (`queue_full`, `queue_timeout`,
/// `overload`, `deadline`, `quota`), for clients and load balancers that act on the reason.
pub const SHED_REASON: HeaderName = HeaderName::from_static("x-floodgate-shed-reason");

/// A plain-text answer of floodgate's own; `advice` is the upstream's, for a shed request.
pub fn local_response(error: &ProxyError, advice: Option<&ShedAdvice>) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::local(error.reason()));
    *response.status_mut() = error.status_with(advice);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if error.asks_for_retry() {
        let seconds = advice.map_or(1, |advice| advice.retry_after_secs.max(1));
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if let Some(reason) = error.shed_reason() {
        headers.insert(SHED_REASON, HeaderValue::from_static(reason));
    }
    response
}

/// A shed gRPC call's answer as gRPC clients read one: `200` with the status in its head and no body (a
/// trailers-only answer). `UNAVAILABLE` (14) for capacity, the code gRPC's retry policies retry and its clients
/// take as transient; `RESOURCE_EXHAUSTED` (8) for a client's own quota (`fair_max_queue`); `DEADLINE_EXCEEDED` (4)
/// for its own deadline. `grpc-message` names the reason, and `grpc-retry-pushback-ms` (gRFC A6) the queue's drain
/// pace where `Retry-After` would be sent.
pub fn grpc_shed_response(error: &ProxyError, advice: Option<&ShedAdvice>) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::local(""));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let code = match error.shed() {
        Some(Shed::Deadline) => "4",
        Some(Shed::Quota) => "8",
        _ => "14",
    };
    headers.insert(GRPC_STATUS, HeaderValue::from_static(code));
    if let Ok(message) = HeaderValue::from_str(error.reason_for_grpc()) {
        headers.insert(GRPC_MESSAGE, message);
    }
    if error.asks_for_retry() {
        let pushback = advice.map_or(1000, |advice| advice.retry_after_ms.max(1));
        headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(pushback));
    }
    if let Some(reason) = error.shed_reason() {
        headers.insert(SHED_REASON, HeaderValue::from_static(reason));
    }
    response
}

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// How long a streamed response's first chunk is waited for before its head goes out: long enough for one that
/// arrived with the head, short enough not to hold back a stream whose first event comes later.
pub(super) const FIRST_FRAME_WAIT: Duration = Duration::from_millis(1);

/// Why a response head cannot be passed on, if it cannot: its framing is ambiguous (RFC 9112 §6.3: a message with
/// both is a smuggling or splitting attempt, to be handled as an error; an invalid Content-Length is an
/// unrecoverable error, a 502 for a proxy), its content coded in a way it cannot declare to the client, or it
/// switches protocols when nothing asked it to (floodgate forwards no upgrade). A Content-Length that lists one
/// number several times goes on as that number (RFC 9110 §8.6).
pub(super) fn malformed(parts: &mut http::response::Parts, present: &Present) -> Option<&'static str> {
    if parts.status == StatusCode::SWITCHING_PROTOCOLS {
        return Some("101 Switching Protocols to a request that asked for no upgrade");
    }
    if present.transfer_encoding && present.content_length {
        return Some("both Content-Length and Transfer-Encoding");
    }
    // Transfer-Encoding is hop-by-hop and stops here: content in a coding hyper does not decode (gzip) would reach
    // the client as if it had none, and a body chunked twice is decoded once, its inner framing taken for content.
    if present.transfer_encoding {
        match check_transfer_coding(&parts.headers) {
            Ok(()) => {}
            Err(ProxyError::ChunkedTwice) => return Some("chunked more than once"),
            Err(_) => return Some("a transfer coding other than chunked"),
        }
    }
    if !present.content_length {
        return None;
    }
    // hyper checks it only where it frames the body: HEAD, 204 and 304 answers would carry it on as it came.
    match content_length(&parts.headers) {
        ContentLength::Plain => None,
        ContentLength::Repeated(length) => {
            parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
            None
        }
        ContentLength::Invalid => Some("an invalid Content-Length"),
    }
}

pub(super) enum ContentLength {
    /// None, or one line of digits: passed on as it is.
    Plain,
    /// One number, given more than once.
    Repeated(u64),
    Invalid,
}

pub(super) fn content_length(headers: &HeaderMap) -> ContentLength {
    let mut lines = headers.get_all(header::CONTENT_LENGTH).iter();
    let digits = |value: &[u8]| !value.is_empty() && value.iter().all(u8::is_ascii_digit);
    match (lines.next(), lines.next()) {
        (None, _) => return ContentLength::Plain,
        // 19 digits always fit a u64: the common case needs no parsing.
        (Some(line), None) if line.len() <= 19 && digits(line.as_bytes()) => return ContentLength::Plain,
        _ => {}
    }
    let mut length = None;
    for value in headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
    {
        let number = std::str::from_utf8(value)
            .ok()
            .filter(|_| digits(value))
            .and_then(|digits| digits.parse::<u64>().ok());
        match (number, length) {
            (Some(number), None) => length = Some(number),
            (Some(number), Some(before)) if number == before => {}
            _ => return ContentLength::Invalid,
        }
    }
    length.map_or(ContentLength::Invalid, ContentLength::Repeated)
}

/// What the request's route asks of its answer, as the proxy resolved it: its header edits and its own
/// `body_idle_timeout` (`None`: the upstream's).
pub(crate) struct RouteEdits<'a> {
    pub(crate) edit_response: &'a (dyn Fn(&mut http::HeaderMap) + Sync),
    pub(crate) body_idle_timeout: Option<std::time::Duration>,
}

/// Turns the upstream's response into the client's, deciding whether the connection may be reused. A body whose
/// Content-Length is within the upstream's `buffer_response_bytes` (and fits the global bound) is read in full
/// first, at the upstream's speed, and the lease given back before the client is sent anything: a slow client
/// then holds memory, never a slot. Any other body streams, holding the lease until its last byte. A failure while
/// buffering is answered by the caller (nothing has reached the client yet).
///
/// The answer comes as its head and body, taken apart by the caller.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice in its state"
)]
pub(crate) fn to_client<'a>(
    mut parts: http::response::Parts,
    mut body: UpstreamIncoming,
    mut lease: Lease,
    watch: bool,
    budget: &'a Arc<BufferBudget>,
    route: RouteEdits<'a>,
) -> impl std::future::Future<Output = Result<Response<ResponseBody>, ProxyError>> + 'a {
    async move {
        let present = Present::of(&parts.headers);
        if let Some(malformed) = malformed(&mut parts, &present) {
            // Nothing has reached the client yet: it gets a 502, not a response that lies about itself.
            lease.forbid_reuse();
            return Err(ProxyError::UpstreamMalformed(malformed));
        }
        // An HTTP/2 answer never ends its connection; an HTTP/1 one may.
        if parts.version != Version::HTTP_2 && !keeps_alive_given(parts.version, &parts.headers, present.connection) {
            lease.forbid_reuse();
        }
        if present.hop_by_hop() {
            strip_hop_by_hop(&mut parts.headers);
        }
        // RFC 9110 §8.6: a 204 has no Content-Length (a 304's states its representation's length, and stays).
        if parts.status == StatusCode::NO_CONTENT && present.content_length {
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        (route.edit_response)(&mut parts.headers);
        parts.version = Version::HTTP_11;
        let limits = lease.pool().limits();
        let (limit, idle_timeout) = (
            limits.buffer_response_bytes,
            route.body_idle_timeout.unwrap_or(limits.body_idle_timeout),
        );
        drop(limits);
        // An empty body (HEAD, 204, 304) ends the exchange as soon as the answer is sent; unknown lengths may be
        // streams of events, which must not wait for a buffer to fill.
        let length = body.size_hint().exact().filter(|&length| length <= limit);
        let reservation = match length {
            Some(length) if !body.is_end_stream() => budget.reserve(length),
            _ => None,
        };
        let Some(reservation) = reservation else {
            // Streamed: a first chunk that is already here is looked at before the head goes out, so that a body
            // broken from its first byte is a 502 rather than a head followed by nothing.
            let first = match tokio::time::timeout(FIRST_FRAME_WAIT, body.frame()).await {
                Ok(Some(Err(err))) => {
                    lease.forbid_reuse();
                    return Err(ProxyError::Upstream(err));
                }
                Ok(Some(Ok(frame))) => Some(frame),
                Ok(None) | Err(_) => None,
            };
            let streamed = UpstreamBody::new(body, lease, watch, idle_timeout).starting_with(first);
            return Ok(Response::from_parts(parts, ResponseBody::upstream(streamed)));
        };
        // One byte past the length: the read then ends at the body's end, never at the limit.
        let read = buffer::fill(&mut body, limit.saturating_add(1), idle_timeout, reservation).await;
        // The body first: a connection whose response is still open must not go back to the pool.
        match &read {
            Ok(buffered) if buffered.is_complete() => {}
            // Failed on the upstream's side: it is done with the request.
            Err(ReadError::Body(_)) => lease.forbid_reuse(),
            // Stalled, or going on past its length: the upstream may still be sending.
            _ => lease.abandon(),
        }
        drop(body);
        drop(lease);
        let failed = match read {
            Ok(buffered) if buffered.is_complete() => {
                let body = UpstreamBody::buffered(buffered, watch, idle_timeout);
                return Ok(Response::from_parts(parts, ResponseBody::upstream(body)));
            }
            // hyper ends a body at its Content-Length; this would be a body going on past it.
            Ok(_) => ProxyError::UpstreamBodyTooLong,
            Err(ReadError::Stalled(limit)) => ProxyError::UpstreamTimeout(limit),
            Err(ReadError::Body(err)) => ProxyError::Upstream(err),
        };
        Err(failed)
    }
}
