//! What the two differential targets share: floodgate's decoding of a body, hyper's, and the one verdict on both.

use std::convert::Infallible;
use std::fmt::Debug;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::h1::chunked::{self, Chunk, ChunkedDecoder, ChunkedError};
use crate::h1::write;
use crate::h1::Framing;

/// A body as hyper read it: its bytes and trailers, or a failure.
pub(super) type BodyRead = Result<(Bytes, Option<HeaderMap>), ()>;

/// A body as floodgate's decoder read it.
pub(super) type OurBody = Result<(Bytes, Option<HeaderMap>), ChunkedError>;

/// How a body is delimited, on either side.
pub(super) enum Framed {
    Length(u64),
    Chunked { max_trailer_bytes: usize },
    UntilClose,
}

pub(super) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(super::runtime)
}

/// The body framed by `framed` at the start of `rest` (all that the peer sent after the head), as floodgate's
/// decoder reads it.
pub(super) fn ours(framed: Framed, rest: &[u8]) -> OurBody {
    let incomplete = ChunkedError("cut short");
    match framed {
        Framed::Length(length) => {
            let length = usize::try_from(length).map_err(|_| incomplete)?;
            let body = rest.get(..length).ok_or(incomplete)?;
            Ok((Bytes::copy_from_slice(body), None))
        }
        Framed::UntilClose => Ok((Bytes::copy_from_slice(rest), None)),
        Framed::Chunked { max_trailer_bytes } => {
            let mut decoder = ChunkedDecoder::new(max_trailer_bytes);
            let mut received = BytesMut::from(rest);
            let (mut data, mut trailers) = (BytesMut::new(), None);
            loop {
                match decoder.decode(&mut received)? {
                    Some(Chunk::Data(bytes)) => data.extend_from_slice(&bytes),
                    Some(Chunk::Trailers(fields)) => trailers = Some(fields),
                    Some(Chunk::End) => return Ok((data.freeze(), trailers)),
                    None => return Err(incomplete),
                }
            }
        }
    }
}

/// The body as hyper hands it on, read to its end.
pub(super) async fn theirs(body: Incoming) -> BodyRead {
    body.collect()
        .await
        .map(|collected| {
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        })
        .map_err(|_| ())
}

/// Panics unless both sides accepted the same head and read the same body, or both refused the head; `refusal`
/// is floodgate's own answer, shown when only hyper accepted.
pub(super) fn agree<H: PartialEq + Debug>(
    context: &str,
    ours: Option<(H, OurBody)>,
    theirs: Option<(H, BodyRead)>,
    refusal: &dyn Debug,
) {
    match (ours, theirs) {
        (None, None) => {}
        (Some(ours), None) => panic!("{context}: floodgate accepts a head hyper refuses: {:?}", ours.0),
        (None, Some(theirs)) => panic!(
            "{context}: floodgate refuses ({refusal:?}) a head hyper accepts: {:?}",
            theirs.0
        ),
        (Some((ours, ours_body)), Some((theirs, theirs_body))) => {
            assert_eq!(
                ours, theirs,
                "{context}: floodgate (left) and hyper (right) read the head differently"
            );
            match (ours_body, theirs_body) {
                // Where floodgate is stricter on purpose.
                (Err(stricter), Ok(_))
                    if stricter == chunked::TOO_MANY_DIGITS || stricter == chunked::BARE_LF_IN_TRAILERS => {}
                (ours, theirs) => assert_eq!(
                    ours.map_err(|_| ()),
                    theirs,
                    "{context}: floodgate (left) and hyper (right) read the body differently"
                ),
            }
        }
    }
}

/// A body of one frame, its length told or not.
pub(super) struct OneFrame {
    pub data: Option<Bytes>,
    pub known: bool,
}

impl http_body::Body for OneFrame {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(
            self.data
                .take()
                .filter(|data| !data.is_empty())
                .map(|data| Ok(Frame::data(data))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.known && self.data.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.data, self.known) {
            (Some(data), true) => SizeHint::with_exact(data.len() as u64),
            (None, true) => SizeHint::with_exact(0),
            (_, false) => SizeHint::default(),
        }
    }
}

/// `body` in `encoding`, as a writer of floodgate's sends it; a stated length shorter than the body sends that
/// much of it.
pub(super) fn put_body(dst: &mut BytesMut, encoding: Framing, body: &[u8]) {
    match encoding {
        Framing::Length(length) => {
            let length = usize::try_from(length).unwrap_or(usize::MAX).min(body.len());
            dst.extend_from_slice(body.get(..length).unwrap_or_default());
        }
        Framing::Chunked => {
            write::put_chunk(dst, body);
            dst.extend_from_slice(write::LAST_CHUNK);
        }
        Framing::UntilClose => dst.extend_from_slice(body),
    }
}
