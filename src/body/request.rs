//! The request body on its way upstream: sent from memory when it was read before admission, else relayed from the
//! client with a timeout when the client stops sending, its progress reported to the lease. It never answers.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use super::{BodyStalled, BoxError, ClientBody, IdleTimer, UploadProgress};
use crate::buffer::{self, BufferBudget, Buffered, ReadError};
use crate::error::ProxyError;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

/// The client's request body on its way upstream; fails if the client stops sending for too long.
pub struct RequestBody {
    /// What is still to be read from the client; `None` once all of it is read (or there was none).
    inner: Option<ClientBody>,
    /// Read before admission ([`RequestBody::buffer`]): sent before anything still in `inner`.
    buffered: Option<Buffered>,
    /// The body came without a length (chunked): it goes upstream chunked too, buffered or not, so buffering
    /// never changes the framing the upstream reads.
    chunked: bool,
    timer: IdleTimer,
    /// How far the body has gone (see [`UploadProgress`]); only requests that have a body pay for it.
    upload: Option<UploadProgress>,
    /// Where the bytes handed upstream are counted (the route's `floodgate_request_bytes_total`).
    counted: Option<prometheus_client::metrics::counter::Counter>,
    /// And this request's own count, for its access-log line (only with the access log on).
    counted_for_log: Option<prometheus_client::metrics::counter::Counter>,
}

/// A request on its way upstream, boxed once its head is rewritten: it is moved a dozen times between the
/// client's task, admission, the exchange and the connection that sends it, and a pointer moves cheaper than its
/// 392 bytes (docs/data-path.md).
pub type UpstreamRequest = Box<http::Request<RequestBody>>;

#[derive(Debug, thiserror::Error)]
#[error("the exchange was cut off: its body made no progress for body_idle_timeout")]
pub struct CutOff;

impl RequestBody {
    pub fn new(inner: ClientBody, idle_timeout: Duration) -> Self {
        let upload = (!inner.is_end_stream()).then(UploadProgress::default);
        RequestBody {
            inner: Some(inner),
            buffered: None,
            chunked: false,
            timer: IdleTimer::new(idle_timeout),
            upload,
            counted: None,
            counted_for_log: None,
        }
    }

    /// How long the body may make no progress (`body_idle_timeout`): the upstream not taking it counts too.
    pub fn idle_timeout(&self) -> Duration {
        self.timer.timeout
    }

    /// A route's own `body_idle_timeout`, instead of its upstream's.
    pub fn set_idle_timeout(&mut self, timeout: Duration) {
        self.timer = IdleTimer::new(timeout);
    }

    /// Counts the body's bytes as they are handed upstream in `counter` (its route's), and in `for_log` (this
    /// request's own, for its access-log line) when there is one.
    pub fn counted_in(
        &mut self,
        counter: prometheus_client::metrics::counter::Counter,
        for_log: Option<prometheus_client::metrics::counter::Counter>,
    ) {
        self.counted = Some(counter);
        self.counted_for_log = for_log;
    }

    fn count(&self, frame: &Frame<Bytes>) {
        let Some(data) = frame.data_ref() else { return };
        for counter in [&self.counted, &self.counted_for_log].into_iter().flatten() {
            counter.inc_by(data.len() as u64);
        }
    }

    /// A body sent again as it first went out (an HTTP/2 stream the upstream did not process): `data` and
    /// `trailers`, held in `budget`, framed as one of unknown length.
    pub fn resent(data: Bytes, trailers: Option<HeaderMap>, budget: &Arc<BufferBudget>) -> Self {
        let reservation = budget.hold(data.len() as u64);
        RequestBody {
            buffered: Some(Buffered::whole(data, trailers, reservation)),
            chunked: true,
            upload: Some(UploadProgress::default()),
            ..RequestBody::empty()
        }
    }

    pub fn empty() -> Self {
        RequestBody {
            inner: None,
            buffered: None,
            chunked: false,
            timer: IdleTimer::new(Duration::from_secs(1)),
            upload: None,
            counted: None,
            counted_for_log: None,
        }
    }

    /// Reads the body into memory, before the request is admitted, if it fits in `limit`: one with a known
    /// length up to `limit`, or, when `unknown_length` allows, one of unknown length, read until it ends or
    /// `limit` is reached (what was read is then sent first and the rest streams once admitted). Each wait is
    /// bounded by `body_idle_timeout` as when the body streams, and the whole read by `within`, which bounds a
    /// body trickled a byte at a time as `request_timeout` does once admitted. Returns whether all of it is now in
    /// memory. Without room in `budget` nothing is read: the body streams.
    pub async fn buffer(
        &mut self,
        limit: u64,
        unknown_length: bool,
        within: Duration,
        budget: &Arc<BufferBudget>,
    ) -> Result<bool, ProxyError> {
        let Some(inner) = self.inner.as_mut() else {
            return Ok(true);
        };
        if inner.is_end_stream() {
            return Ok(true);
        }
        if limit == 0 {
            return Ok(false);
        }
        let hint = inner.size_hint();
        let wanted = match hint.exact() {
            Some(length) if length <= limit => length,
            None if unknown_length && hint.lower() <= limit => limit,
            _ => return Ok(false),
        };
        let Some(reservation) = budget.reserve(wanted) else {
            return Ok(false);
        };
        let filling = buffer::fill(inner, limit, self.timer.timeout, reservation);
        let buffered = match tokio::time::timeout(within, filling).await {
            Ok(Ok(buffered)) => buffered,
            Err(_) => return Err(ProxyError::ClientTooSlow(within)),
            Ok(Err(ReadError::Stalled(limit))) => return Err(ProxyError::ClientBodyTimeout(limit)),
            Ok(Err(ReadError::Body(err))) => return Err(err.meaning()),
        };
        let complete = buffered.is_complete();
        if complete {
            self.inner = None;
        }
        self.chunked = hint.exact().is_none();
        self.buffered = Some(buffered);
        Ok(complete)
    }

    /// How far the body has gone, for the exchange to look at later; `None` for a request without a body.
    pub fn upload(&self) -> Option<UploadProgress> {
        self.upload.clone()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(buffered) = this.buffered.as_mut() {
            if let Some(frame) = buffered.next_frame(None) {
                let sent = buffered.is_empty() && this.inner.is_none();
                if buffered.is_empty() {
                    this.buffered = None;
                }
                if let Some(upload) = &this.upload {
                    upload.polled(false, sent);
                }
                this.timer.progressed();
                this.count(&frame);
                return Poll::Ready(Some(Ok(frame)));
            }
            this.buffered = None;
        }
        let Some(inner) = this.inner.as_mut() else {
            // Nothing was left to read from the client: what was buffered is all of the body.
            if let Some(upload) = &this.upload {
                upload.polled(false, true);
            }
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        if let Some(upload) = &this.upload {
            // hyper stops pulling a body of known length once it reports its end, so the end may never be
            // polled for.
            let sent = matches!(polled, Poll::Ready(None))
                || (matches!(polled, Poll::Ready(Some(Ok(_)))) && inner.is_end_stream());
            upload.polled(polled.is_pending(), sent);
        }
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.progressed();
                this.count(&frame);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending if this.timer.expired(cx) => {
                Poll::Ready(Some(Err(BodyStalled("client", this.timer.timeout).into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        // A buffer is dropped once handed on; until then, even an empty one (a chunked body with no data) is still
        // to be sent, as its framing's end.
        self.buffered.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.buffered.as_ref().map_or(0, Buffered::remaining);
        let rest = match &self.inner {
            Some(inner) => inner.size_hint(),
            // hyper frames an upload by its length when the hint is exact and chunked otherwise.
            None if self.chunked => SizeHint::new(),
            None => SizeHint::with_exact(0),
        };
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(held));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}
