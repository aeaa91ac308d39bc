//! A client's HTTP/1 request head, read from the bytes received so far: `httparse` tokenizes it, and the rules
//! here decide what it means (its body's framing, whether the connection stays open) by RFC 9112 §6 and §9.
//! It never reads a socket and never holds a buffer: the caller owns the bytes and keeps what comes after the
//! head.
//!
//! It accepts and refuses exactly what hyper's HTTP/1 server does with floodgate's settings, and yields the same
//! message; `fuzzing::h1_request_head` checks that on every input of the corpus. Whether the connection stays open
//! is [`super::keeps_alive`]'s answer, the relay's own (it reads a `close` even in a `Connection` line with a
//! non-ASCII byte, which hyper passes over).

use std::mem::MaybeUninit;

use bytes::BytesMut;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Uri, Version};

use super::fields::{self, digits, last_coding_is_chunked};
use super::keeps_alive_given;
use super::{HeadError, ADDED_FIELDS, MAX_CONTENT_LENGTH, MAX_HEADERS};

/// The longest request target taken; longer is answered `414` (the most a `Uri` holds).
const MAX_TARGET_BYTES: usize = u16::MAX as usize - 1;

/// A complete request head and what it says of the rest of the connection.
#[derive(Debug)]
pub(crate) struct RequestHead {
    pub parts: http::request::Parts,
    pub body: BodyFraming,
    /// Whether another request may follow this one on the connection.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for a `100` before it sends the body.
    pub expects_continue: bool,
    /// `CONNECT`, or `Upgrade` on HTTP/1.1: the client asks to leave HTTP.
    pub wants_upgrade: bool,
    /// A `TE` line names `trailers`: the client takes an answer's trailers (gRPC's status travels in them).
    pub takes_trailers: bool,
}

/// How the request's body is delimited (RFC 9112 §6.3): never by the connection's end, which is what sets it apart
/// from [`super::Framing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// Exactly this many bytes; 0 for a request without a body.
    Length(u64),
    /// Chunked transfer coding, to its last chunk.
    Chunked,
}

/// Reads the head at the start of `received`: `Ok(None)` while it is incomplete (and smaller than
/// `max_head_bytes`), else the head and how many bytes of `received` it took. The head's fields are copies; see
/// [`take`] for a head whose fields share the bytes they were read from (the fuzz targets and tests use this one).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn parse(received: &[u8], max_head_bytes: usize) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let mut buffer = BytesMut::from(received);
    let head = take(&mut buffer, max_head_bytes)?;
    Ok(head.map(|head| (head, received.len() - buffer.len())))
}

/// [`parse`], the head split off the front of `received` once it is complete: its target and field values are
/// slices of those bytes (no allocation or copy per value), and what follows the head stays in `received`.
pub(crate) fn take(received: &mut BytesMut, max_head_bytes: usize) -> Result<Option<RequestHead>, HeadError> {
    // First where everything is, while httparse borrows the bytes; then the head is split off and read from.
    let (head_len, method, target, minor, lines) = {
        // Left uninitialised: the 3,200 bytes of empty lines cost a request more cache lines than its own head.
        let mut lines = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut []);
        let parsed = request.parse_with_uninit_headers(received, &mut lines);
        let Some(head_len) = fields::head_len(parsed, received.len(), max_head_bytes)? else {
            return Ok(None);
        };
        // A complete parse fills all three.
        let (Some(method), Some(target), Some(minor)) = (request.method, request.path, request.version) else {
            return Err(HeadError::Malformed("incomplete request line"));
        };
        let at = fields::Offsets::of(received);
        let lines: fields::Lines = request.headers.iter().map(|line| at.line(line)).collect();
        (
            head_len,
            at.range(method.as_bytes()),
            at.range(target.as_bytes()),
            minor,
            lines,
        )
    };
    let head = received.split_to(head_len).freeze();
    let text = |range: std::ops::Range<usize>| head.get(range).unwrap_or_default();
    if target.len() > MAX_TARGET_BYTES {
        return Err(HeadError::TargetTooLong);
    }
    let method = Method::from_bytes(text(method)).map_err(|_| HeadError::Malformed("invalid method"))?;
    let uri = Uri::from_maybe_shared(head.slice(target)).map_err(|_| HeadError::Malformed("invalid request target"))?;
    let version = fields::version(minor);
    let mut meaning = Meaning::new(version, method == Method::CONNECT);
    // Room for what the proxy adds (Host, X-Forwarded-*, a request ID): growing a map rehashes it.
    let mut headers = HeaderMap::with_capacity(lines.len() + ADDED_FIELDS);
    for (name, value) in lines {
        let (name, value) = fields::shared_field(text(name), head.slice(value)).map_err(HeadError::Malformed)?;
        if meaning.read(&name, &value, &mut headers)? {
            headers.append(name, value);
        }
    }
    let body = meaning.framing()?;
    // Set field by field: the builder moves its whole request through a `Result` at each step.
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.version = version;
    parts.headers = headers;
    // A message framed both ways was an attempt to confuse some hop: nothing more is read after it.
    let framed_twice = meaning.coded.is_some() && meaning.length_seen;
    let takes_trailers = meaning.te && super::write::accepts_trailers(&parts.headers);
    Ok(Some(RequestHead {
        keep_alive: keeps_alive_given(version, &parts.headers, meaning.connection) && !framed_twice,
        parts,
        body,
        expects_continue: meaning.expects_continue,
        wants_upgrade: meaning.wants_upgrade,
        takes_trailers,
    }))
}

/// What the framing and expectation headers say, read line by line in order.
struct Meaning {
    http11: bool,
    /// A `Transfer-Encoding` line was seen; whether the last one ends in `chunked`.
    coded: Option<bool>,
    /// A `Content-Length` line was seen (taken or not).
    length_seen: bool,
    length: Option<u64>,
    expects_continue: bool,
    wants_upgrade: bool,
    /// A `Connection` line was seen.
    connection: bool,
    /// A `TE` line was seen.
    te: bool,
}

impl Meaning {
    fn new(version: Version, connect: bool) -> Self {
        let http11 = version == Version::HTTP_11;
        Meaning {
            http11,
            coded: None,
            length_seen: false,
            length: None,
            expects_continue: false,
            wants_upgrade: connect,
            connection: false,
            te: false,
        }
    }

    /// Reads one header line; false when the line is not kept (a length made moot by a coding, or repeated).
    fn read(&mut self, name: &HeaderName, value: &HeaderValue, kept: &mut HeaderMap) -> Result<bool, HeadError> {
        match *name {
            header::TRANSFER_ENCODING => {
                if !self.http11 {
                    return Err(HeadError::Malformed("Transfer-Encoding in an HTTP/1.0 request"));
                }
                // RFC 9112 §6.3: a coding overrides any length, which then must not go on.
                if self.length.take().is_some() {
                    kept.remove(header::CONTENT_LENGTH);
                }
                self.coded = Some(last_coding_is_chunked(value));
            }
            header::CONTENT_LENGTH => {
                self.length_seen = true;
                if self.coded.is_some() {
                    return Ok(false);
                }
                let length = digits(value.as_bytes())
                    .filter(|&length| length <= MAX_CONTENT_LENGTH)
                    .ok_or(HeadError::Malformed("invalid Content-Length"))?;
                match self.length {
                    Some(earlier) if earlier != length => {
                        return Err(HeadError::Malformed("differing Content-Length values"))
                    }
                    Some(_) => return Ok(false),
                    None => self.length = Some(length),
                }
            }
            header::EXPECT => self.expects_continue = value.as_bytes().eq_ignore_ascii_case(b"100-continue"),
            header::UPGRADE => self.wants_upgrade = self.http11,
            header::CONNECTION => self.connection = true,
            header::TE => self.te = true,
            _ => {}
        }
        Ok(true)
    }

    fn framing(&self) -> Result<BodyFraming, HeadError> {
        match self.coded {
            Some(true) => Ok(BodyFraming::Chunked),
            Some(false) => Err(HeadError::Malformed("Transfer-Encoding that does not end in chunked")),
            None => Ok(BodyFraming::Length(self.length.unwrap_or(0))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    const MAX: usize = 64 * 1024;

    fn head(text: &str) -> RequestHead {
        match parse(text.as_bytes(), MAX) {
            Ok(Some((head, len))) => {
                assert_eq!(len, text.find("\r\n\r\n").map_or(0, |at| at + 4));
                head
            }
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    fn refused(text: &str) -> HeadError {
        match parse(text.as_bytes(), MAX) {
            Err(err) => err,
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    #[test]
    fn a_simple_get_has_no_body_and_keeps_the_connection_open() {
        let head = head("GET /a?b=c HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
        assert_eq!(head.parts.method, Method::GET);
        assert_eq!(head.parts.uri, "/a?b=c");
        assert_eq!(head.parts.headers["host"], "x");
        assert_eq!(head.body, BodyFraming::Length(0));
        assert!(head.keep_alive && !head.expects_continue && !head.wants_upgrade);
    }

    #[test]
    fn an_incomplete_head_waits_until_it_reaches_the_limit() {
        assert!(matches!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n", MAX), Ok(None)));
        assert_eq!(
            parse(b"GET / HTTP/1.1\r\nHost: x\r\n", 20).err(),
            Some(HeadError::TooLarge)
        );
    }

    #[test]
    fn a_coding_overrides_a_length_which_is_dropped_and_the_connection_closes_after() {
        for text in [
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
        ] {
            let head = head(text);
            assert_eq!(head.body, BodyFraming::Chunked);
            assert!(!head.parts.headers.contains_key(header::CONTENT_LENGTH));
            assert!(!head.keep_alive);
        }
    }

    #[test]
    fn bad_framing_is_refused() {
        for text in [
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 18446744073709551614\r\n\r\n",
        ] {
            assert!(matches!(refused(text), HeadError::Malformed(_)), "{text:?}");
        }
    }

    #[test]
    fn a_repeated_equal_length_is_kept_once() {
        let head = head("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n");
        assert_eq!(head.body, BodyFraming::Length(5));
        assert_eq!(head.parts.headers.get_all(header::CONTENT_LENGTH).iter().count(), 1);
    }

    #[test]
    fn http_1_0_closes_unless_it_asks_to_keep_alive_and_a_close_is_never_undone() {
        assert!(!head("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(head("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive);
        assert!(!head("GET / HTTP/1.1\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n").keep_alive);
    }

    #[test]
    fn too_many_lines_and_too_long_a_target_have_their_own_answers() {
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: y\r\n")).collect();
        assert_eq!(refused(&format!("GET / HTTP/1.1\r\n{many}\r\n")), HeadError::TooLarge);
        // Under a head limit above the target's own.
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_TARGET_BYTES));
        assert_eq!(parse(long.as_bytes(), 2 * MAX).err(), Some(HeadError::TargetTooLong));
        assert_eq!(HeadError::TargetTooLong.status(), StatusCode::URI_TOO_LONG);
    }

    #[test]
    fn expect_and_upgrade_are_noticed() {
        let head = head("PUT / HTTP/1.1\r\nExpect: 100-Continue\r\nUpgrade: websocket\r\n\r\n");
        assert!(head.expects_continue && head.wants_upgrade);
        assert!(!self::head("GET / HTTP/1.0\r\nUpgrade: websocket\r\n\r\n").wants_upgrade);
    }
}
