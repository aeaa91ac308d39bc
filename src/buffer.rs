//! Buffering: small bodies read in full into memory, so that a slow client never holds an upstream slot.
//!
//! Owns the global bound on buffered bytes (`max_buffered_bytes`, a [`BufferBudget`] shared by every request)
//! and the read that fills a buffer within `body_idle_timeout` per wait. A body that does not fit what is left of
//! the bound is not buffered, and streams as it would with buffering off: the bound never fails a request. This
//! module never admits, never holds a lease and never answers; the request and response bodies that send a buffer
//! on live in `forward`, and the decisions of what to buffer in `proxy` and `forward`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

/// HTTP/2 flow-control window per client stream (RFC 9113 §6.9.2's default): the most a queued h2 upload can make
/// floodgate hold before it is admitted, counted in the budget (`proxy`) and advertised by the listener (`server`).
pub(crate) const HTTP2_STREAM_WINDOW: u32 = 65_535;

/// The bytes all buffered bodies may hold at once, and what they hold now.
pub struct BufferBudget {
    limit: AtomicU64,
    /// The bytes reserved now; it is also the `floodgate_buffered_bytes` gauge, so the two never disagree.
    used: Gauge,
    fallbacks: Counter,
}

impl BufferBudget {
    pub fn new(limit: u64, used: Gauge, fallbacks: Counter) -> Arc<Self> {
        Arc::new(BufferBudget {
            limit: AtomicU64::new(limit),
            used,
            fallbacks,
        })
    }

    /// A reload's new bound applies to reservations from then on; ones already made keep their bytes.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        u64::try_from(self.used.get()).unwrap_or(0)
    }

    /// Reserves `bytes` if they fit under the bound; `None` (counted as a fallback to streaming) if not.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let limit = self.limit.load(Ordering::Relaxed);
        let wanted = i64::try_from(bytes).ok()?;
        let fits = self
            .used
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let after = used.checked_add(wanted)?;
                (u64::try_from(after).is_ok_and(|after| after <= limit)).then_some(after)
            })
            .is_ok();
        if !fits {
            self.fallbacks.inc();
            return None;
        }
        Some(Reservation {
            budget: self.clone(),
            bytes: wanted,
        })
    }

    /// Counts `bytes` floodgate holds whether or not they fit (a queued HTTP/2 upload's stream window: the client
    /// may fill it whatever floodgate does), so that the gauge shows them and optional buffering makes room.
    pub fn hold(self: &Arc<Self>, bytes: u64) -> Reservation {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.used.inc_by(bytes);
        Reservation {
            budget: self.clone(),
            bytes,
        }
    }
}

/// Bytes taken from the [`BufferBudget`] until dropped.
pub struct Reservation {
    budget: Arc<BufferBudget>,
    bytes: i64,
}

impl Reservation {
    /// Makes the reservation exactly `bytes`: a body read up to its limit may have come out shorter, or longer by
    /// part of its last read (what was read has to be kept; the excess is bounded by one read).
    pub fn resize(&mut self, bytes: u64) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.budget.used.inc_by(bytes - self.bytes);
        self.bytes = bytes;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.dec_by(self.bytes);
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation({} bytes)", self.bytes)
    }
}

/// A body, or the first part of one, held in memory and handed on frame by frame.
#[derive(Debug)]
pub struct Buffered {
    data: Bytes,
    /// Boxed: rare, and a header map is large.
    trailers: Option<Box<HeaderMap>>,
    /// Whether this is all of the body.
    complete: bool,
    _reservation: Reservation,
}

impl Buffered {
    /// A whole body already in memory, `data` then `trailers`, its bytes counted by `reservation`.
    pub fn whole(data: Bytes, trailers: Option<HeaderMap>, reservation: Reservation) -> Buffered {
        Buffered {
            data,
            trailers: trailers.map(Box::new),
            complete: true,
            _reservation: reservation,
        }
    }

    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Bytes not handed on yet (trailers not counted).
    pub fn remaining(&self) -> u64 {
        self.data.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty() && self.trailers.is_none()
    }

    /// The next frame: data of at most `max` bytes (all of it without a bound), then the trailers.
    pub fn next_frame(&mut self, max: Option<usize>) -> Option<Frame<Bytes>> {
        if !self.data.is_empty() {
            let take = max.map_or(self.data.len(), |max| max.min(self.data.len()));
            return Some(Frame::data(self.data.split_to(take)));
        }
        self.trailers.take().map(|trailers| Frame::trailers(*trailers))
    }
}

/// Why filling a buffer stopped short.
#[derive(Debug)]
pub(crate) enum ReadError<E> {
    /// No frame came for this long.
    Stalled(Duration),
    /// The body itself failed.
    Body(E),
}

/// Reads `body` until its end, or until at least `limit` bytes are read, waiting at most `idle` for each frame.
/// `reservation` must hold the bytes expected; it is resized to what was read. What was read is kept whether or
/// not the body ended there: a body that goes on is continued by its caller after the part returned.
pub(crate) async fn fill<B>(
    body: &mut B,
    limit: u64,
    idle: Duration,
    mut reservation: Reservation,
) -> Result<Buffered, ReadError<B::Error>>
where
    B: Body<Data = Bytes> + Unpin,
{
    let expected = body.size_hint().exact().unwrap_or(limit).min(limit);
    // A small body usually arrives as one frame that is already in hyper's buffer: it is kept as it came (no
    // copy), and looked for without a timer first (arming one costs a clock read and a timer-wheel entry).
    let mut first: Option<Bytes> = None;
    let mut more = BytesMut::new();
    let mut read: u64 = 0;
    let mut trailers = None;
    let mut complete = body.is_end_stream();
    while !complete && read < limit {
        let mut next = body.frame();
        let ready = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut next).poll(cx))).await;
        let polled = match ready {
            Poll::Ready(polled) => polled,
            // Boxed: the wait and its timer would be most of every buffered answer's future, and it is rarely taken.
            Poll::Pending => match Box::pin(tokio::time::timeout(idle, next)).await {
                Err(_) => return Err(ReadError::Stalled(idle)),
                Ok(polled) => polled,
            },
        };
        let frame = match polled {
            None => {
                complete = true;
                break;
            }
            Some(Err(err)) => return Err(ReadError::Body(err)),
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(chunk) => {
                read += chunk.len() as u64;
                match first.take() {
                    None if more.is_empty() => first = Some(chunk),
                    earlier => {
                        if let Some(earlier) = earlier {
                            more.reserve(usize::try_from(expected).unwrap_or(0));
                            more.extend_from_slice(&earlier);
                        }
                        more.extend_from_slice(&chunk);
                    }
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(Box::<HeaderMap>::default).extend(more);
                }
            }
        }
        complete = body.is_end_stream();
    }
    let data = first.unwrap_or_else(|| more.freeze());
    reservation.resize(data.len() as u64);
    Ok(Buffered {
        data,
        trailers,
        complete,
        _reservation: reservation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    fn budget(limit: u64) -> Arc<BufferBudget> {
        BufferBudget::new(limit, Gauge::default(), Counter::default())
    }

    /// A body of the given chunks, of unknown length; then its end, or nothing ever again if `stall_at_end`.
    struct Chunks {
        chunks: VecDeque<&'static str>,
        stall_at_end: bool,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.chunks.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(chunk.as_bytes()))))),
                None if self.stall_at_end => Poll::Pending,
                None => Poll::Ready(None),
            }
        }
    }

    #[test]
    fn reservations_never_exceed_the_bound_and_give_their_bytes_back_when_dropped() {
        let budget = budget(100);
        let first = budget.reserve(60).unwrap();
        assert!(budget.reserve(41).is_none(), "60 + 41 is over 100");
        let second = budget.reserve(40).unwrap();
        assert_eq!(budget.used(), 100);
        drop(first);
        assert_eq!(budget.used(), 40);
        assert!(budget.reserve(60).is_some());
        drop(second);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.fallbacks.get(), 1);
    }

    #[test]
    fn a_lowered_bound_applies_to_new_reservations_only() {
        let budget = budget(100);
        let held = budget.reserve(80).unwrap();
        budget.set_limit(50);
        assert!(budget.reserve(1).is_none());
        drop(held);
        assert!(budget.reserve(50).is_some());
    }

    #[tokio::test]
    async fn a_body_that_ends_within_the_limit_is_complete_and_one_that_goes_on_is_a_prefix() {
        let budget = budget(1 << 20);
        let mut whole = Chunks {
            chunks: ["hel", "lo"].into(),
            stall_at_end: false,
        };
        let reservation = budget.reserve(10).unwrap();
        let read = fill(&mut whole, 10, Duration::from_secs(1), reservation).await.unwrap();
        assert!(read.is_complete());
        assert_eq!(read.remaining(), 5);
        assert_eq!(budget.used(), 5, "the reservation is resized to what was read");

        let mut longer = Chunks {
            chunks: ["abcd"; 5].into(),
            stall_at_end: false,
        };
        let reservation = budget.reserve(6).unwrap();
        let mut read = fill(&mut longer, 6, Duration::from_secs(1), reservation).await.unwrap();
        assert!(!read.is_complete());
        assert_eq!(
            read.remaining(),
            8,
            "two reads of four: the second crosses the limit and is kept"
        );
        assert_eq!(longer.chunks.len(), 3, "nothing more was read");
        assert_eq!(read.next_frame(Some(3)).unwrap().into_data().unwrap(), "abc");
        assert_eq!(read.next_frame(None).unwrap().into_data().unwrap(), "dabcd");
        assert!(read.next_frame(None).is_none());
        drop(read);
        assert_eq!(budget.used(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_fails_after_the_idle_time_and_gives_its_reservation_back() {
        let budget = budget(100);
        let mut stalled = Chunks {
            chunks: ["ab"].into(),
            stall_at_end: true,
        };
        let reservation = budget.reserve(10).unwrap();
        let read = fill(&mut stalled, 10, Duration::from_secs(3), reservation).await;
        assert!(matches!(read, Err(ReadError::Stalled(d)) if d == Duration::from_secs(3)));
        assert_eq!(budget.used(), 0);
    }
}
