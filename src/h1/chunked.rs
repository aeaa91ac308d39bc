//! The chunked transfer coding read from received bytes (RFC 9112 §7.1): each chunk's data handed on as it
//! arrives, split off the caller's buffer without a copy, then the trailer section. Size lines are httparse's
//! (`parse_chunk_size`), trailer fields too (`parse_headers`); what hyper refuses beyond them (a size line without
//! a digit or with a bare LF, extensions of 16 KiB or more in all) is refused here as well. Stricter than hyper,
//! on purpose: a size of more than 16 hex digits (leading zeros included) and a bare LF in the trailer section,
//! which hyper takes as a line's end. It never reads a socket: the caller feeds it bytes and owns the buffer.

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;

use super::MAX_HEADERS;

/// Bytes of chunk extensions taken over one body, all chunks together (hyper's bound).
const MAX_EXTENSION_BYTES: usize = 16 * 1024;

/// How much more chunk framing (size lines, CRLFs) than data a client's body may carry: tiny chunks cost work per
/// chunk for no data, and no client needs them (ten-byte chunks carry half as much framing as data).
const FRAMING_SLACK: u64 = 64 * 1024;

/// What [`FRAMING_SLACK`] refuses.
pub(crate) const FRAMING_OUTWEIGHS_DATA: ChunkedError =
    ChunkedError("more chunk framing than data (chunks of a few bytes): send larger chunks");

/// What the decoder made of the bytes it was given.
#[derive(Debug, PartialEq)]
pub(crate) enum Chunk {
    /// Body bytes, in the order sent.
    Data(Bytes),
    /// The trailer section, when the body had one; [`Chunk::End`] follows.
    Trailers(HeaderMap),
    /// The body is complete; bytes after it belong to the next message.
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body: {0}")]
pub(crate) struct ChunkedError(pub(crate) &'static str);

/// The two refusals hyper would not make (see the module's header).
pub(crate) const TOO_MANY_DIGITS: ChunkedError = ChunkedError("a chunk size of more than 16 hex digits");
pub(crate) const BARE_LF_IN_TRAILERS: ChunkedError = ChunkedError("trailer line not ended by CRLF");

#[derive(Debug)]
enum State {
    SizeLine,
    Data { left: u64 },
    DataEnd,
    Trailers,
    Ended,
}

/// One chunked body being read.
#[derive(Debug)]
pub(crate) struct ChunkedDecoder {
    state: State,
    extension_bytes: usize,
    /// A trailer section must be smaller than this.
    max_trailer_bytes: usize,
    /// A client's body: its framing may not outweigh its data by more than [`FRAMING_SLACK`].
    bounded_framing: bool,
    framing_bytes: u64,
    data_bytes: u64,
}

impl ChunkedDecoder {
    /// `max_trailer_bytes`: as for a head (hyper takes its `max_header_size`, else 16 KiB).
    pub(crate) fn new(max_trailer_bytes: usize) -> Self {
        ChunkedDecoder {
            state: State::SizeLine,
            extension_bytes: 0,
            max_trailer_bytes,
            bounded_framing: false,
            framing_bytes: 0,
            data_bytes: 0,
        }
    }

    /// A decoder for a client's request body: as [`Self::new`], and its framing bounded by its data (see
    /// [`FRAMING_SLACK`]). An upstream's answer is not bounded so: floodgate chose it.
    pub(crate) fn for_request(max_trailer_bytes: usize) -> Self {
        ChunkedDecoder {
            bounded_framing: true,
            ..ChunkedDecoder::new(max_trailer_bytes)
        }
    }

    fn framed(&mut self, bytes: usize) -> Result<(), ChunkedError> {
        self.framing_bytes += bytes as u64;
        if self.bounded_framing && self.framing_bytes > self.data_bytes.saturating_add(FRAMING_SLACK) {
            return Err(FRAMING_OUTWEIGHS_DATA);
        }
        Ok(())
    }

    /// The next piece of the body from the front of `received` (what it takes is removed); `Ok(None)`: more bytes
    /// are needed.
    pub(crate) fn decode(&mut self, received: &mut BytesMut) -> Result<Option<Chunk>, ChunkedError> {
        loop {
            match self.state {
                State::SizeLine => {
                    let Some(size) = self.size_line(received)? else {
                        return Ok(None);
                    };
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Data { left: size }
                    };
                }
                State::Data { left } => {
                    if received.is_empty() {
                        return Ok(None);
                    }
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(received.len());
                    let data = received.split_to(take).freeze();
                    self.data_bytes += take as u64;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        State::DataEnd
                    } else {
                        State::Data { left }
                    };
                    return Ok(Some(Chunk::Data(data)));
                }
                State::DataEnd => {
                    match received.get(..2) {
                        Some(b"\r\n") => {
                            received.advance(2);
                            self.framed(2)?;
                        }
                        Some(_) => return Err(ChunkedError("chunk data not followed by CRLF")),
                        None if received.first().is_some_and(|&b| b != b'\r') => {
                            return Err(ChunkedError("chunk data not followed by CRLF"))
                        }
                        None => return Ok(None),
                    }
                    self.state = State::SizeLine;
                }
                State::Trailers => return self.trailers(received),
                State::Ended => return Ok(Some(Chunk::End)),
            }
        }
    }

    /// A complete size line's chunk size, taken off `received`.
    fn size_line(&mut self, received: &mut BytesMut) -> Result<Option<u64>, ChunkedError> {
        let line_end = received.iter().position(|&b| b == b'\n');
        let line = received.get(..line_end.unwrap_or(received.len())).unwrap_or_default();
        let content = line.split(|&b| b == b'\r').next().unwrap_or_default();
        // Checked before the line is complete, so that a line that never ends cannot grow without bound.
        match received.first() {
            None => return Ok(None),
            Some(b) if !b.is_ascii_hexdigit() => return Err(ChunkedError("chunk size line without a size")),
            Some(_) => {}
        }
        let extension = content
            .iter()
            .position(|&b| b == b';')
            .map_or(0, |at| content.len() - at - 1);
        if self.extension_bytes + extension >= MAX_EXTENSION_BYTES {
            return Err(ChunkedError("chunk extensions over 16 KiB"));
        }
        let Some(end) = line_end else {
            return Ok(None);
        };
        if content.len() + 1 != end {
            return Err(ChunkedError("chunk size line not ended by CRLF"));
        }
        if content.iter().take_while(|b| b.is_ascii_hexdigit()).count() > 16 {
            return Err(TOO_MANY_DIGITS);
        }
        match httparse::parse_chunk_size(received) {
            Ok(httparse::Status::Complete((len, size))) if len == end + 1 => {
                received.advance(len);
                self.extension_bytes += extension;
                self.framed(len)?;
                Ok(Some(size))
            }
            _ => Err(ChunkedError("invalid chunk size line")),
        }
    }

    /// The trailer section (possibly empty) and its final CRLF.
    fn trailers(&mut self, received: &mut BytesMut) -> Result<Option<Chunk>, ChunkedError> {
        match received.get(..2) {
            Some(b"\r\n") => {
                received.advance(2);
                self.state = State::Ended;
                return Ok(Some(Chunk::End));
            }
            None if received.first().is_none_or(|&b| b == b'\r') => return Ok(None),
            _ => {}
        }
        let Some(section_end) = received.windows(4).position(|window| window == b"\r\n\r\n") else {
            if received.len() >= self.max_trailer_bytes {
                return Err(ChunkedError("trailer section too large"));
            }
            return Ok(None);
        };
        let section_len = section_end + 4;
        if section_len >= self.max_trailer_bytes {
            return Err(ChunkedError("trailer section too large"));
        }
        let section = received.get(..section_len).unwrap_or_default();
        // Stricter than hyper, which reads a bare LF as the end of a trailer line.
        if section
            .windows(2)
            .any(|pair| pair.get(1) == Some(&b'\n') && pair.first() != Some(&b'\r'))
            || section.first() == Some(&b'\n')
        {
            return Err(BARE_LF_IN_TRAILERS);
        }
        let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let trailers = match httparse::parse_headers(section, &mut lines) {
            Ok(httparse::Status::Complete((len, fields))) if len == section_len => {
                let mut trailers = HeaderMap::with_capacity(fields.len());
                for line in fields {
                    let (name, value) = super::fields::field(line).map_err(ChunkedError)?;
                    trailers.append(name, value);
                }
                trailers
            }
            _ => return Err(ChunkedError("invalid trailer section")),
        };
        received.advance(section_len);
        self.state = State::Ended;
        Ok(Some(Chunk::Trailers(trailers)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything `bytes` decodes to, fed whole and then one byte at a time: both must agree.
    fn decode_all(bytes: &[u8]) -> Result<(Vec<u8>, Option<HeaderMap>, usize), ChunkedError> {
        let whole = decode_fed(bytes, bytes.len());
        let by_byte = decode_fed(bytes, 1);
        assert_eq!(whole, by_byte, "fed whole and byte by byte: {bytes:?}");
        whole
    }

    fn decode_fed(bytes: &[u8], step: usize) -> Result<(Vec<u8>, Option<HeaderMap>, usize), ChunkedError> {
        let mut decoder = ChunkedDecoder::new(16 * 1024);
        let mut received = BytesMut::new();
        let (mut data, mut trailers) = (Vec::new(), None);
        let mut fed = 0;
        loop {
            match decoder.decode(&mut received)? {
                Some(Chunk::Data(bytes)) => data.extend_from_slice(&bytes),
                Some(Chunk::Trailers(fields)) => trailers = Some(fields),
                Some(Chunk::End) => return Ok((data, trailers, received.len() + bytes.len() - fed)),
                None if fed == bytes.len() => return Err(ChunkedError("incomplete")),
                None => {
                    let next = (fed + step).min(bytes.len());
                    received.extend_from_slice(&bytes[fed..next]);
                    fed = next;
                }
            }
        }
    }

    #[test]
    fn chunks_extensions_and_trailers() {
        let (data, trailers, left) =
            decode_all(b"4;a=b\r\nWiki\r\n5 \r\npedia\r\n0\r\nX-Sum: 1\r\nX-More: 2\r\n\r\nNEXT").unwrap_or_default();
        assert_eq!(data, b"Wikipedia");
        let trailers = trailers.unwrap_or_default();
        assert_eq!(
            (trailers.len(), &trailers["x-sum"]),
            (2, &http::HeaderValue::from_static("1"))
        );
        assert_eq!(left, 4, "what follows the body stays");
        let (data, trailers, _) = decode_all(b"0\r\n\r\n").unwrap_or_default();
        assert!(data.is_empty() && trailers.is_none());
    }

    #[test]
    fn what_hyper_refuses_is_refused() {
        for bad in [
            &b"\r\n\r\n"[..],
            b"\n",
            b"x\r\n",
            b"4\nWiki\r\n0\r\n\r\n",
            b"4;ext\nWiki\r\n0\r\n\r\n",
            b"4\r\nWikiX\r\n0\r\n\r\n",
            b"0\r\nX-A: 1\n\r\n",
            b"fffffffffffffffff\r\n",
        ] {
            assert!(decode_all(bad).is_err(), "{bad:?}");
        }
        // Refused as soon as the bytes say so, not when the body would have ended.
        for early in [&b"\nabc"[..], b"4\r\nWikiX", b"4;x\ny"] {
            let mut received = BytesMut::from(early);
            let mut decoder = ChunkedDecoder::new(16 * 1024);
            let refused = std::iter::from_fn(|| Some(decoder.decode(&mut received)))
                .take(4)
                .any(|step| step.is_err());
            assert!(refused, "{early:?}");
        }
        let long_extension = format!("1;{}\r\na\r\n0\r\n\r\n", "e".repeat(MAX_EXTENSION_BYTES));
        assert!(decode_all(long_extension.as_bytes()).is_err());
    }

    #[test]
    fn a_requests_framing_may_not_outweigh_its_data_an_answers_may() {
        let tiny = b"1\r\nx\r\n".repeat(20_000);
        let mut received = BytesMut::from(&tiny[..]);
        let mut request = ChunkedDecoder::for_request(1024);
        let refused = loop {
            match request.decode(&mut received) {
                Ok(Some(_)) => {}
                Ok(None) => break None,
                Err(err) => break Some(err),
            }
        };
        assert_eq!(refused, Some(FRAMING_OUTWEIGHS_DATA));
        let mut received = BytesMut::from(&tiny[..]);
        let mut answer = ChunkedDecoder::new(1024);
        while let Ok(Some(_)) = answer.decode(&mut received) {}
        assert!(received.is_empty(), "an upstream's tiny chunks are read");
        // Ten-byte chunks: half as much framing as data, never refused.
        let mut received = BytesMut::from(&b"a\r\n0123456789\r\n".repeat(20_000)[..]);
        let mut request = ChunkedDecoder::for_request(1024);
        while let Ok(Some(_)) = request.decode(&mut received) {}
        assert!(received.is_empty());
    }
}
