//! An upstream's HTTP/1 response head, read from the bytes received so far: `httparse` tokenizes it, and the
//! rules here decide how its body is delimited (RFC 9112 §6.3, which depends on the request's method) and whether
//! the connection may carry another request. Interim `1xx` heads before the final one are passed over. It never
//! reads a socket and never holds a buffer.
//!
//! It accepts and refuses what hyper's HTTP/1 client does with floodgate's settings, and yields the same
//! message; `fuzzing::h1_response_head` checks that on every input of the corpus. What floodgate then refuses to
//! relay (both framings, a `101` it did not ask for) is decided later, as for hyper's reading.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use http::header;
use http::{HeaderMap, Method, Response, StatusCode, Version};

use super::fields::{self, last_coding_is_chunked, stated_length, Present};
use super::keeps_alive_given;
use super::{Framing, HeadError, ADDED_FIELDS, MAX_CONTENT_LENGTH, MAX_HEADERS};

/// The largest response head read, as hyper's client bounds it (its largest read buffer).
pub(crate) const MAX_RESPONSE_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// Interim (`1xx`) heads passed over before a final one: a `100 Continue` and a few `103 Early Hints` are what
/// servers send; more is a flood, each one held and read for nothing.
pub(crate) const MAX_INTERIM_HEADS: usize = 16;

/// A complete final response head and what it says of the rest of the connection.
#[derive(Debug)]
pub(crate) struct ResponseHead {
    pub parts: http::response::Parts,
    /// The reason phrase, when it is not the status's usual one.
    pub reason: Option<Bytes>,
    pub body: Framing,
    /// Whether the connection may carry another request after this response's body.
    pub keep_alive: bool,
    /// A `101`, or a `2xx` to `CONNECT`: the connection leaves HTTP.
    pub upgrade: bool,
}

/// Reads the final head at the start of `received` to a request made with `method`, past any interim `1xx`:
/// `Ok(None)` while it is incomplete (and all of it smaller than `max_head_bytes`), else the head and how many
/// bytes of `received` it and the interim heads took. What the fuzz target holds against hyper's whole-buffer
/// reading; the upstream client reads head by head ([`next`]).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn parse(
    received: &[u8],
    method: &Method,
    max_head_bytes: usize,
) -> Result<Option<(ResponseHead, usize)>, HeadError> {
    let mut buffer = BytesMut::from(received);
    while !buffer.is_empty() {
        match take_one(&mut buffer, method, max_head_bytes, received.len())? {
            None => return Ok(None),
            Some(Some(head)) => return Ok(Some((head, received.len() - buffer.len()))),
            Some(None) => {}
        }
    }
    Ok(None)
}

/// The next head at the start of `received`, interim or final, taken off it once complete: `Some(None)` for an
/// interim `1xx` passed over, `Ok(None)` while it is incomplete (and smaller than `max_head_bytes`). A final
/// head's field values are slices of the bytes read (no allocation or copy per value); what follows the head
/// stays in `received`. A reader that takes each interim head off as it comes parses each once, where [`parse`]
/// would parse them all again at every read.
pub(crate) fn next(
    received: &mut BytesMut,
    method: &Method,
    max_head_bytes: usize,
) -> Result<Option<Option<ResponseHead>>, HeadError> {
    let counted = received.len();
    take_one(received, method, max_head_bytes, counted)
}

/// One head at the start of `received`, taken off it once complete; `counted` is what the size bound is held to
/// while it is incomplete.
fn take_one(
    received: &mut BytesMut,
    method: &Method,
    max_head_bytes: usize,
    counted: usize,
) -> Result<Option<Option<ResponseHead>>, HeadError> {
    // First where everything is, while httparse borrows the bytes; then the head is split off and read from.
    let (head_len, status, minor, reason, lines) = {
        // Left uninitialised, as the request head's lines are.
        let mut lines = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut []);
        let parsed =
            httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut response, received, &mut lines);
        let Some(head_len) = fields::head_len(parsed, counted, max_head_bytes)? else {
            return Ok(None);
        };
        let (Some(minor), Some(code), Some(reason)) = (response.version, response.code, response.reason) else {
            return Err(HeadError::Malformed("incomplete status line"));
        };
        let status = StatusCode::from_u16(code).map_err(|_| HeadError::Malformed("invalid status code"))?;
        let at = fields::Offsets::of(received);
        let lines: fields::Lines = response.headers.iter().map(|line| at.line(line)).collect();
        // A status line without a reason gives a static "", not a slice of the bytes read: no range of them.
        let reason = (status.canonical_reason() != Some(reason)).then(|| {
            if reason.is_empty() {
                0..0
            } else {
                at.range(reason.as_bytes())
            }
        });
        (head_len, status, minor, reason, lines)
    };
    let head = received.split_to(head_len).freeze();
    let version = fields::version(minor);
    // Room for what the proxy adds (a request ID, the shed and retry fields): growing a map rehashes it.
    let mut headers = HeaderMap::with_capacity(lines.len() + ADDED_FIELDS);
    // Noted as the lines are read: each lookup of an absent field would hash its name for nothing.
    let mut seen = Present::default();
    for (name, value) in lines {
        let name = head.get(name).unwrap_or_default();
        let (name, value) = fields::shared_field(name, head.slice(value)).map_err(HeadError::Malformed)?;
        seen.note(&name);
        headers.append(name, value);
    }
    let Some((body, upgrade)) = framing(status, version, method, &headers, &seen)? else {
        return Ok(Some(None));
    };
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = status;
    parts.version = version;
    parts.headers = headers;
    Ok(Some(Some(ResponseHead {
        keep_alive: keeps_alive_given(version, &parts.headers, seen.connection) && !upgrade,
        parts,
        reason: reason.and_then(|reason| head.get(reason.clone()).map(|_| head.slice(reason))),
        body,
        upgrade,
    })))
}

/// RFC 9112 §6.3 for a response: its body's framing and whether it leaves HTTP; `None` for an interim `1xx`.
fn framing(
    status: StatusCode,
    version: Version,
    method: &Method,
    headers: &HeaderMap,
    seen: &Present,
) -> Result<Option<(Framing, bool)>, HeadError> {
    match status.as_u16() {
        101 => return Ok(Some((Framing::Length(0), true))),
        100..=199 => return Ok(None),
        204 | 304 => return Ok(Some((Framing::Length(0), false))),
        _ => {}
    }
    if *method == Method::HEAD {
        return Ok(Some((Framing::Length(0), false)));
    }
    if *method == Method::CONNECT && status.is_success() {
        return Ok(Some((Framing::Length(0), true)));
    }
    let coding = seen
        .transfer_encoding
        .then(|| headers.get_all(header::TRANSFER_ENCODING).iter().next_back());
    if let Some(last) = coding.flatten() {
        if version == Version::HTTP_10 {
            return Err(HeadError::Malformed("Transfer-Encoding in an HTTP/1.0 response"));
        }
        // A coding list that does not end in chunked is delimited by the close (RFC 9112 §6.3 rule 4).
        let body = if last_coding_is_chunked(last) {
            Framing::Chunked
        } else {
            Framing::UntilClose
        };
        return Ok(Some((body, false)));
    }
    if !seen.content_length {
        return Ok(Some((Framing::UntilClose, false)));
    }
    let length = stated_length(headers)
        .filter(|&length| length <= MAX_CONTENT_LENGTH)
        .ok_or(HeadError::Malformed("invalid Content-Length"))?;
    Ok(Some((Framing::Length(length), false)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 64 * 1024;

    fn head(text: &str, method: &Method) -> (ResponseHead, usize) {
        match parse(text.as_bytes(), method, MAX) {
            Ok(Some(read)) => read,
            other => panic!("{text:?} gave {other:?}"),
        }
    }

    #[test]
    fn a_length_a_chunked_body_and_a_close_delimited_one() {
        let (ok, len) = head("HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc", &Method::GET);
        assert_eq!(
            (ok.body, len, ok.keep_alive, ok.reason),
            (Framing::Length(3), 38, true, None)
        );
        let (chunked, _) = head(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            &Method::GET,
        );
        assert_eq!(chunked.body, Framing::Chunked);
        let (until_close, _) = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", &Method::GET);
        assert_eq!(until_close.body, Framing::UntilClose);
        let (old, _) = head("HTTP/1.0 200 Fine\r\n\r\n", &Method::GET);
        assert_eq!(old.body, Framing::UntilClose);
        assert!(!old.keep_alive);
        assert_eq!(old.reason.as_deref(), Some(&b"Fine"[..]));
    }

    #[test]
    fn a_status_line_without_a_reason_phrase_has_an_empty_one() {
        for text in ["HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 299 \r\n\r\n"] {
            let (read, _) = head(text, &Method::GET);
            assert_eq!(read.reason.as_deref(), Some(&b""[..]), "{text:?}");
        }
    }

    #[test]
    fn heads_without_a_body_whatever_their_headers_say() {
        for (text, method) in [
            ("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", Method::HEAD),
            ("HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n", Method::GET),
            (
                "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
                Method::GET,
            ),
        ] {
            assert_eq!(head(text, &method).0.body, Framing::Length(0), "{text:?}");
        }
        let (upgrade, _) = head("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", &Method::GET);
        assert!(upgrade.upgrade && !upgrade.keep_alive);
    }

    #[test]
    fn interim_heads_are_passed_over_and_counted_in_what_was_taken() {
        let text = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        let (ok, len) = head(text, &Method::POST);
        assert_eq!((ok.parts.status, len), (StatusCode::OK, text.len()));
        assert!(!ok.parts.headers.contains_key(header::LINK));
        assert!(matches!(parse(&text.as_bytes()[..30], &Method::POST, MAX), Ok(None)));
    }

    #[test]
    fn lengths_must_agree_and_be_numbers() {
        let (listed, _) = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 4, 4\r\nContent-Length: 4\r\n\r\n",
            &Method::GET,
        );
        assert_eq!(listed.body, Framing::Length(4));
        for text in [
            "HTTP/1.1 200 OK\r\nContent-Length: 4, 5\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\n",
            "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(parse(text.as_bytes(), &Method::GET, MAX), Err(HeadError::Malformed(_))),
                "{text:?}"
            );
        }
    }
}
