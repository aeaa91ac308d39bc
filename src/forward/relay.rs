//! The response body from the upstream: it holds the lease until its last byte is read, returns the connection
//! when the body ends, and when the client leaves early reads the rest (bounded) so the connection can still be
//! reused. How it ends is the request's outcome: it finishes the request's [`Record`] then. It never decides
//! admission.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::buffer::Buffered;
use crate::error::Outcome;
use crate::pool::Lease;
use crate::record::Record;

use super::{BodyStalled, BoxError, CutOff, IdleTimer, UpstreamIncoming};

/// Where a relayed response body comes from.
pub(super) enum Source {
    /// The upstream connection, read as the client takes the body; the relay holds the lease until its end.
    Upstream(UpstreamIncoming),
    /// A body already read in full at upstream speed; its lease was given back before the client got anything.
    /// Boxed: the relay, one per response, stays the size it is for streamed bodies.
    Memory(Box<Buffered>),
}

/// How an exchange's body ended, for what becomes of its connection.
pub(super) enum Ending {
    /// Read to its end: the connection may be reused.
    Whole,
    /// The upstream's side failed (reset, bad framing): it is done with the request; the connection is closed.
    Failed,
    /// Given up before its end: the upstream may still be working, so the slot waits for it to close.
    GivenUp,
}

/// An upstream response in flight: its body, the lease it holds until the end, and the request's record, finished
/// by the end.
pub(super) struct Relay {
    inner: Option<Source>,
    lease: Option<Lease>,
    /// Given by the client's side once the answer reaches it ([`UpstreamBody::record`]).
    record: Option<Record>,
    /// How the body ended, once it has; an end that came before the record is passed on to it.
    ended: Option<Outcome>,
    /// Cut off by the stall watchdog: the client is told by an error, not a clean end.
    cut_off: bool,
    /// Largest data frame handed on, if bounded; what is left of a larger one waits in `rest`.
    /// `NonZeroUsize`: half the size of `Option<usize>`, which keeps the relay (one per response) small.
    max_frame: Option<std::num::NonZeroUsize>,
    rest: Option<Bytes>,
    /// A frame read before the head went out (see [`to_client`]), handed on first.
    first: Option<Frame<Bytes>>,
    /// The upstream's failure, handed on one poll after it came (see [`Relay::poll_frame`]).
    failed: Option<BoxError>,
}

/// HTTP/2 asks for the next frame only once the client has room for the last one; small frames make that
/// evidence of progress frequent, so a slow but steady reader is never mistaken for a stalled one.
pub(super) const WATCHED_FRAME_BYTES: usize = 16 * 1024;

/// hyper takes a frame only when it can queue it for the socket, and queues a few at most. A body held in memory
/// is handed on in pieces of this size, so that it stays counted against `max_buffered_bytes` (and its request
/// open) until the client has taken nearly all of it, instead of vanishing into hyper's queue at once.
pub(super) const MEMORY_FRAME_BYTES: usize = 16 * 1024;

impl Relay {
    /// The record's count of body bytes handed on; a field apart, for it is counted while the source is borrowed.
    fn count_relayed(record: &mut Option<Record>, frame: &Frame<Bytes>) {
        if let (Some(data), Some(record)) = (frame.data_ref(), record.as_mut()) {
            record.relayed(data.len());
        }
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.cut_off {
            return Poll::Ready(Some(Err(CutOff.into())));
        }
        if let Some(err) = self.failed.take() {
            return Poll::Ready(Some(Err(err)));
        }
        if let Some(first) = self.first.take() {
            Self::count_relayed(&mut self.record, &first);
            if self.source_ended() || first.is_trailers() {
                self.finish(Outcome::Ok, true);
            }
            return Poll::Ready(Some(Ok(match first.into_data() {
                Ok(data) => self.bounded(data),
                Err(frame) => frame,
            })));
        }
        if let Some(rest) = self.rest.take() {
            return Poll::Ready(Some(Ok(self.bounded(rest))));
        }
        let inner = match self.inner.as_mut() {
            None => return Poll::Ready(None),
            Some(Source::Memory(memory)) => {
                let max = self.max_frame.map_or(MEMORY_FRAME_BYTES, std::num::NonZeroUsize::get);
                let frame = memory.next_frame(Some(max));
                return Poll::Ready(self.hand_on_from_memory(frame));
            }
            Some(Source::Upstream(inner)) => inner,
        };
        match Pin::new(&mut *inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                Self::count_relayed(&mut self.record, &frame);
                // Trailers end a body, though hyper's chunked body says so only when polled once more, which the
                // client's server need not do: the relay would be dropped unfinished, counted a client abort.
                if inner.is_end_stream() || frame.is_trailers() {
                    // All of the response is read from the upstream: the connection can go back now, whatever
                    // the client still has to take.
                    self.finish(Outcome::Ok, true);
                }
                match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(self.bounded(data)))),
                    Err(frame) => Poll::Ready(Some(Ok(frame))),
                }
            }
            Poll::Ready(Some(Err(err))) => {
                self.finish(Outcome::UpstreamError, false);
                // A server may drop what it has not yet written (the head, the data before this) when a body
                // fails, as hyper's HTTP/1 server did; a poll's pause first lets it flush that, so the client sees
                // an honest cut rather than an empty reply.
                self.failed = Some(err.into());
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Ready(None) => {
                self.finish(Outcome::Ok, true);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// A frame of a body held in memory is counted as handed on; the request ends when the last one is.
    fn hand_on_from_memory(&mut self, frame: Option<Frame<Bytes>>) -> Option<Result<Frame<Bytes>, BoxError>> {
        if let (Some(data), Some(record)) = (frame.as_ref().and_then(Frame::data_ref), self.record.as_mut()) {
            record.relayed(data.len());
        }
        let ended = match &self.inner {
            Some(Source::Memory(memory)) => memory.is_empty(),
            _ => true,
        };
        if ended {
            self.inner = None;
            self.finish(Outcome::Ok, true);
        }
        frame.map(Ok)
    }

    fn bounded(&mut self, mut data: Bytes) -> Frame<Bytes> {
        if let Some(max) = self.max_frame.map(std::num::NonZeroUsize::get) {
            if data.len() > max {
                let head = data.split_to(max);
                self.rest = Some(data);
                return Frame::data(head);
            }
        }
        Frame::data(data)
    }

    fn source_ended(&self) -> bool {
        match &self.inner {
            None => true,
            Some(Source::Upstream(inner)) => inner.is_end_stream(),
            Some(Source::Memory(memory)) => memory.is_empty(),
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.cut_off && self.failed.is_none() && self.first.is_none() && self.rest.is_none() && self.source_ended()
    }

    fn size_hint(&self) -> SizeHint {
        let hint = match &self.inner {
            None => SizeHint::default(),
            Some(Source::Upstream(inner)) => inner.size_hint(),
            Some(Source::Memory(memory)) => SizeHint::with_exact(memory.remaining()),
        };
        let held = self
            .first
            .as_ref()
            .and_then(Frame::data_ref)
            .map_or(0, |data| data.len() as u64);
        if held == 0 {
            return hint;
        }
        let mut with_held = SizeHint::new();
        with_held.set_lower(hint.lower().saturating_add(held));
        if let Some(upper) = hint.upper() {
            with_held.set_upper(upper.saturating_add(held));
        }
        with_held
    }

    /// Counted already: by its end, a cut-off or its client leaving.
    fn is_finished(&self) -> bool {
        self.ended.is_some()
    }

    /// The request's record, finished at once if the body has already ended.
    fn record(&mut self, mut record: Record) {
        match self.ended {
            Some(outcome) => record.finish(outcome),
            None => self.record = Some(record),
        }
    }

    /// Ends the exchange: the lease goes back (reused or closed) and the outcome is counted, once.
    fn finish(&mut self, outcome: Outcome, reusable: bool) {
        self.end(outcome, if reusable { Ending::Whole } else { Ending::Failed });
    }

    fn end(&mut self, outcome: Outcome, ending: Ending) {
        if let Some(mut lease) = self.lease.take() {
            match ending {
                Ending::Whole => {}
                Ending::Failed => lease.forbid_reuse(),
                Ending::GivenUp => lease.abandon(),
            }
        }
        if self.ended.is_none() {
            self.ended = Some(outcome);
            if let Some(mut record) = self.record.take() {
                record.finish(outcome);
            }
        }
    }

    /// The stream stopped moving for too long: the unread body leaves the connection spent, and the lease, given
    /// up, closes it and frees the slot once the upstream, which may still be sending, has closed too.
    fn cut_off(&mut self, outcome: Outcome) {
        self.inner = None;
        self.rest = None;
        self.cut_off = true;
        self.end(outcome, Ending::GivenUp);
    }

    /// The answer was dropped before its end. An empty body (HEAD, 204, 304) is complete; otherwise the client
    /// left mid-body, and what is left is handed back for draining.
    fn abandon(&mut self) -> Option<(UpstreamIncoming, Lease)> {
        // Already finished (or cut off): nothing is left to count or drain.
        if self.is_finished() {
            return None;
        }
        if self.is_end_stream() {
            self.finish(Outcome::Ok, true);
            return None;
        }
        self.ended = Some(Outcome::ClientAbort);
        if let Some(mut record) = self.record.take() {
            record.finish(Outcome::ClientAbort);
        }
        match (self.inner.take(), self.lease.take()) {
            (Some(Source::Upstream(body)), Some(lease)) => Some((body, lease)),
            (_, lease) => {
                if let Some(mut lease) = lease {
                    lease.forbid_reuse();
                }
                None
            }
        }
    }
}

/// A relay an outside watchdog can cut off: an HTTP/2 client can stop reading one stream without blocking its
/// socket, and hyper then stops polling that stream's body, so no timer inside the body would ever run.
pub(super) struct Watched {
    relay: Mutex<Relay>,
    epoch: Instant,
    /// Milliseconds since `epoch` of the last time hyper asked for more (it asks once the client has room).
    progress_ms: AtomicU64,
    /// The body is waiting on the upstream, not on the client: that stall is the body's own timer's to judge.
    awaiting_upstream: AtomicBool,
    ended: Notify,
}

impl Watched {
    fn relay(&self) -> MutexGuard<'_, Relay> {
        self.relay.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

pub(super) async fn watch_for_stall(watched: Arc<Watched>, limit: Duration) {
    let mut deadline = Instant::now() + limit;
    loop {
        tokio::select! {
            _ = watched.ended.notified() => return,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let due = watched.epoch + Duration::from_millis(watched.progress_ms.load(Ordering::Acquire)) + limit;
        let now = Instant::now();
        if due > now {
            deadline = due;
            continue;
        }
        if watched.awaiting_upstream.load(Ordering::Acquire) {
            deadline = now + limit;
            continue;
        }
        let mut relay = watched.relay();
        if !relay.is_finished() {
            relay.cut_off(Outcome::ClientAbort);
        }
        return;
    }
}

/// Boxed: the answer that carries it is moved from the exchange to the client's task, through a channel and
/// several futures, and one allocation costs less than those moves of a relay held inline.
pub(super) enum RelayHandle {
    Owned(Box<Relay>),
    Watched(Arc<Watched>),
}

impl RelayHandle {
    fn with_mut<R>(&mut self, f: impl FnOnce(&mut Relay) -> R) -> R {
        match self {
            RelayHandle::Owned(relay) => f(relay),
            RelayHandle::Watched(watched) => f(&mut watched.relay()),
        }
    }

    fn read<R>(&self, f: impl FnOnce(&Relay) -> R) -> R {
        match self {
            RelayHandle::Owned(relay) => f(relay),
            RelayHandle::Watched(watched) => f(&watched.relay()),
        }
    }

    /// The watchdog has nothing left to watch.
    fn unwatch(&self) {
        if let RelayHandle::Watched(watched) = self {
            watched.ended.notify_one();
        }
    }
}

/// An upstream response body in flight, holding the lease until its end.
pub struct UpstreamBody {
    relay: RelayHandle,
    timer: IdleTimer,
}

impl UpstreamBody {
    /// `watch`: also cut the exchange off when the client stops taking the body (HTTP/2 streams).
    /// `idle_timeout`: the route's or upstream's `body_idle_timeout`.
    pub fn new(inner: UpstreamIncoming, lease: Lease, watch: bool, idle_timeout: Duration) -> Self {
        Self::relaying(Source::Upstream(inner), Some(lease), watch, idle_timeout)
    }

    /// A frame read ahead of the body, to be handed on before the rest.
    pub fn starting_with(mut self, first: Option<Frame<Bytes>>) -> Self {
        if first.is_some() {
            self.relay.with_mut(|relay| relay.first = first);
        }
        self
    }

    /// A body already read in full: no lease is held; an HTTP/2 stream that stops taking it is still cut off
    /// after `idle_timeout`, which gives its memory back.
    pub fn buffered(body: Buffered, watch: bool, idle_timeout: Duration) -> Self {
        Self::relaying(Source::Memory(Box::new(body)), None, watch, idle_timeout)
    }

    /// The request's record, finished by the body's end.
    pub(crate) fn record(&mut self, record: Record) {
        self.relay.with_mut(|relay| relay.record(record));
    }

    fn relaying(inner: Source, lease: Option<Lease>, watch: bool, idle_timeout: Duration) -> Self {
        let relay = Relay {
            inner: Some(inner),
            lease,
            record: None,
            ended: None,
            cut_off: false,
            max_frame: watch
                .then(|| std::num::NonZeroUsize::new(WATCHED_FRAME_BYTES))
                .flatten(),
            rest: None,
            first: None,
            failed: None,
        };
        let relay = if watch && !relay.is_end_stream() {
            let watched = Arc::new(Watched {
                relay: Mutex::new(relay),
                epoch: Instant::now(),
                progress_ms: AtomicU64::new(0),
                awaiting_upstream: AtomicBool::new(false),
                ended: Notify::new(),
            });
            tokio::spawn(watch_for_stall(watched.clone(), idle_timeout));
            RelayHandle::Watched(watched)
        } else {
            RelayHandle::Owned(Box::new(relay))
        };
        UpstreamBody {
            relay,
            timer: IdleTimer::new(idle_timeout),
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = match &mut this.relay {
            RelayHandle::Owned(relay) => relay.poll_frame(cx),
            RelayHandle::Watched(watched) => {
                watched.progress_ms.store(watched.now_ms(), Ordering::Release);
                let (polled, finished) = {
                    let mut relay = watched.relay();
                    let polled = relay.poll_frame(cx);
                    (polled, relay.is_finished())
                };
                watched.awaiting_upstream.store(polled.is_pending(), Ordering::Release);
                if finished {
                    watched.ended.notify_one();
                }
                polled
            }
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending if this.timer.expired(cx) => {
                let limit = this.timer.timeout;
                this.relay.with_mut(|relay| relay.cut_off(Outcome::UpstreamTimeout));
                this.relay.unwatch();
                Poll::Ready(Some(Err(BodyStalled("upstream", limit).into())))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.relay.read(Relay::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.relay.read(Relay::size_hint)
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        self.relay.unwatch();
        let abandoned = self.relay.with_mut(Relay::abandon);
        let Some((body, lease)) = abandoned else { return };
        // The client left mid-body. Dropping the connection now would leave the upstream working on the old
        // request while a replacement brings new work; read the rest instead, on the upstream side, and keep the
        // connection.
        let pool = lease.pool().clone();
        pool.spawn(drain_then_release(body, lease));
    }
}

pub(super) async fn drain_then_release(mut body: UpstreamIncoming, mut lease: Lease) {
    let limits = lease.pool().limits();
    let (max_bytes, limit) = (limits.abort_drain_bytes, limits.abort_drain_timeout);
    let drained = tokio::time::timeout(limit, async {
        let mut read: u64 = 0;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                    if read > max_bytes {
                        return Ending::GivenUp;
                    }
                }
                Err(_) => return Ending::Failed,
            }
        }
        Ending::Whole
    })
    .await;
    match drained.unwrap_or(Ending::GivenUp) {
        Ending::Whole => {}
        Ending::Failed => lease.forbid_reuse(),
        Ending::GivenUp => lease.abandon(),
    }
    // The body first: a connection whose response is still open must not go back to the pool.
    drop(body);
    drop(lease);
}
