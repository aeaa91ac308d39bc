//! How the rest of an HTTP/1 body is delimited (RFC 9112 §6.3), and its pieces taken off the bytes received: one
//! reader for a client's request body and an upstream's answer body alike. It never reads a socket: the caller
//! fills `received`, and decides what the connection's end means for the body.

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};

use super::chunked::{Chunk, ChunkedDecoder};

/// How the rest of a body is delimited, and how far it has come.
#[derive(Debug)]
pub(crate) enum Delimited {
    /// This many bytes are still to come.
    Length(u64),
    Chunked(ChunkedDecoder),
    /// Everything until the peer closes the connection (answers only).
    UntilClose,
    /// Read to its end: nothing more is read.
    Over,
    /// It failed: it never ends, and the connection closes.
    Broken,
}

/// Why no piece could be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFault {
    /// The body had failed already.
    Broken,
    /// The chunked coding is broken (what is wrong with it).
    Chunked(&'static str),
}

impl Delimited {
    pub(crate) fn is_over(&self) -> bool {
        matches!(self, Delimited::Over | Delimited::Length(0))
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        match self {
            Delimited::Length(left) => SizeHint::with_exact(*left),
            Delimited::Over => SizeHint::with_exact(0),
            Delimited::Chunked(_) | Delimited::UntilClose | Delimited::Broken => SizeHint::new(),
        }
    }

    /// The next piece `received` holds, split off it; `None` when it holds none (more is to be read, unless the
    /// body is now over). A broken chunked coding leaves the body `Broken`.
    pub(crate) fn next_piece(&mut self, received: &mut BytesMut) -> Result<Option<Frame<Bytes>>, BodyFault> {
        match self {
            Delimited::Over | Delimited::Length(0) => Ok(None),
            Delimited::Broken => Err(BodyFault::Broken),
            Delimited::Length(_) | Delimited::UntilClose if received.is_empty() => Ok(None),
            Delimited::Length(left) => {
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(received.len());
                *left -= take as u64;
                Ok(Some(Frame::data(received.split_to(take).freeze())))
            }
            Delimited::UntilClose => Ok(Some(Frame::data(received.split().freeze()))),
            Delimited::Chunked(decoder) => match decoder.decode(received) {
                Ok(Some(Chunk::Data(data))) => Ok(Some(Frame::data(data))),
                Ok(Some(Chunk::Trailers(trailers))) => Ok(Some(Frame::trailers(trailers))),
                Ok(Some(Chunk::End)) => {
                    *self = Delimited::Over;
                    Ok(None)
                }
                Ok(None) => Ok(None),
                Err(err) => {
                    *self = Delimited::Broken;
                    Err(BodyFault::Chunked(err.0))
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(frame: Option<Frame<Bytes>>) -> Bytes {
        frame.and_then(|frame| frame.into_data().ok()).unwrap_or_default()
    }

    #[test]
    fn a_length_takes_its_bytes_and_leaves_the_next_message() {
        let mut body = Delimited::Length(5);
        let mut received = BytesMut::from(&b"helloGET /"[..]);
        assert_eq!(data(body.next_piece(&mut received).unwrap()), "hello");
        assert!(body.is_over());
        assert!(body.next_piece(&mut received).unwrap().is_none());
        assert_eq!(&received[..], b"GET /");
    }

    #[test]
    fn until_close_takes_everything_received_and_wants_more() {
        let mut body = Delimited::UntilClose;
        let mut received = BytesMut::from(&b"abc"[..]);
        assert_eq!(data(body.next_piece(&mut received).unwrap()), "abc");
        assert!(body.next_piece(&mut received).unwrap().is_none());
        assert!(!body.is_over(), "only the connection's end ends it");
    }

    #[test]
    fn a_chunked_body_ends_over_and_a_broken_one_stays_broken() {
        let mut body = Delimited::Chunked(ChunkedDecoder::new(1024));
        let mut received = BytesMut::from(&b"3\r\nabc\r\n0\r\n\r\nnext"[..]);
        assert_eq!(data(body.next_piece(&mut received).unwrap()), "abc");
        assert!(body.next_piece(&mut received).unwrap().is_none());
        assert!(body.is_over());
        assert_eq!(&received[..], b"next");

        let mut broken = Delimited::Chunked(ChunkedDecoder::new(1024));
        let mut received = BytesMut::from(&b"zz\r\n"[..]);
        assert!(matches!(broken.next_piece(&mut received), Err(BodyFault::Chunked(_))));
        assert!(matches!(broken.next_piece(&mut received), Err(BodyFault::Broken)));
    }
}
