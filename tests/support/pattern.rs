//! Pattern bodies: the byte at absolute offset `o` is `o % 256`, so any slice can be checked on its own.

use super::*;

pub(super) const CHUNK: usize = 64 * 1024;

pub(super) fn pattern_chunk() -> Bytes {
    static CHUNK_BYTES: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    CHUNK_BYTES
        .get_or_init(|| (0..CHUNK).map(|i| i as u8).collect::<Vec<u8>>().into())
        .clone()
}

/// Checks that `data`, found at absolute offset `offset` of a pattern body,
/// holds the pattern.
pub fn pattern_matches(offset: u64, data: &[u8]) -> bool {
    let chunk = pattern_chunk();
    let mut pos = 0usize;
    while pos < data.len() {
        let start = ((offset + pos as u64) % CHUNK as u64) as usize;
        let take = (CHUNK - start).min(data.len() - pos);
        if data[pos..pos + take] != chunk[start..start + take] {
            return false;
        }
        pos += take;
    }
    true
}

/// A streamed body of `len` pattern bytes in 64 KiB chunks. Produced lazily,
/// so a stalled reader stalls the producer. Optionally counts produced bytes.
pub struct PatternBody {
    remaining: u64,
    exact_size: bool,
    counter: Option<Arc<AtomicU64>>,
}

impl PatternBody {
    /// With an exact size hint (Content-Length framing).
    pub fn new(len: u64) -> Self {
        PatternBody {
            remaining: len,
            exact_size: true,
            counter: None,
        }
    }

    /// Without a size hint (chunked framing).
    pub fn chunked(len: u64) -> Self {
        PatternBody {
            remaining: len,
            exact_size: false,
            counter: None,
        }
    }

    pub fn counting(mut self, counter: Arc<AtomicU64>) -> Self {
        self.counter = Some(counter);
        self
    }
}

impl Body for PatternBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = this.remaining.min(CHUNK as u64) as usize;
        this.remaining -= n as u64;
        if let Some(c) = &this.counter {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
        Poll::Ready(Some(Ok(Frame::data(pattern_chunk().slice(0..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact_size {
            SizeHint::with_exact(self.remaining)
        } else {
            SizeHint::default()
        }
    }
}

/// `/stall-body`: the first half of a pattern body, a pause until the gate
/// opens, then the second half (its pattern restarts at offset 0; no test
/// checks those bytes).
pub(super) struct StallBody {
    pub(super) first: PatternBody,
    pub(super) gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    pub(super) rest: PatternBody,
}

impl Body for StallBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if !this.first.is_end_stream() {
            return Pin::new(&mut this.first).poll_frame(cx);
        }
        if let Some(gate) = this.gate.as_mut() {
            match gate.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) => this.gate = None,
            }
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.gate.is_none() && self.first.is_end_stream() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.first.remaining + self.rest.remaining)
    }
}

pub fn body_empty() -> TestBody {
    Empty::<Bytes>::new().map_err(|e| match e {}).boxed()
}

pub fn body_full(data: impl Into<Bytes>) -> TestBody {
    Full::new(data.into()).map_err(|e| match e {}).boxed()
}

pub fn body_pattern(len: u64) -> TestBody {
    PatternBody::new(len).boxed()
}
