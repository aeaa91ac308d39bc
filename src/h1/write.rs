//! Writing an answer to an HTTP/1 client: its head (status line, header lines, the framing and connection lines
//! it needs) and then its body in that framing. The answers are floodgate's, whose hop-by-hop lines the relay
//! has already removed; what reaches the client is what hyper's server wrote for them (checked by the
//! `h1_response_head` fuzz target, byte for byte but the date). It never touches a socket.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use bytes::{BufMut, BytesMut};
use http::header::{self, HeaderMap};
use http::{Method, StatusCode, Version};

use super::fields::digits;
use super::Framing;

/// What is known of a body when its head is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodySize {
    /// Already over: nothing follows the head.
    Empty,
    Known(u64),
    /// A stream whose end will be known when it comes.
    Unknown,
}

/// The client the answer is for, as its request said.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client<'a> {
    pub method: &'a Method,
    pub version: Version,
    /// Whether the connection is to carry another request after this answer.
    pub keep_alive: bool,
}

/// What the head written commits the rest of the exchange to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Written {
    pub encoding: Framing,
    /// The connection closes once the body is written.
    pub closes: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WriteError {
    #[error("an answer with Content-Length values that differ or are not numbers, or one on a tunnel's answer")]
    ContentLength,
}

/// Writes the head of an answer with `status`, its reason phrase when not the usual one, and `headers` into `dst`.
pub(crate) fn response_head(
    dst: &mut BytesMut,
    status: StatusCode,
    reason: Option<&[u8]>,
    headers: &HeaderMap,
    body: BodySize,
    client: Client<'_>,
) -> Result<Written, WriteError> {
    let http10 = client.version == Version::HTTP_10;
    let connect_tunnel = *client.method == Method::CONNECT && status.is_success();
    let no_body_ever =
        status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let may_have_length = !no_body_ever && !connect_tunnel;
    let may_be_chunked = may_have_length && *client.method != Method::HEAD && !http10;

    dst.reserve(64 + headers.len() * 32);
    dst.put_slice(if http10 { b"HTTP/1.0 " } else { b"HTTP/1.1 " });
    dst.put_slice(status.as_str().as_bytes());
    dst.put_u8(b' ');
    match reason {
        Some(reason) => dst.put_slice(reason),
        None => dst.put_slice(status.canonical_reason().unwrap_or("<none>").as_bytes()),
    }
    dst.put_slice(b"\r\n");

    // Set by the first `Content-Length` line written, when the answer states its own length.
    let mut encoding = None;
    let mut wrote_date = false;
    for (name, value) in headers {
        if *name == header::CONTENT_LENGTH {
            // A tunnel's answer has no body to state a length for.
            if connect_tunnel {
                return Err(WriteError::ContentLength);
            }
            match body {
                BodySize::Empty if *client.method != Method::HEAD => continue,
                // A HEAD's answer states the length its GET would have had, in one line.
                BodySize::Empty if encoding.is_some() => return Err(WriteError::ContentLength),
                BodySize::Empty => {}
                BodySize::Known(known) => {
                    if encoding.is_none() {
                        encoding = Some(Framing::Length(known));
                        line(dst, b"content-length", value.as_bytes());
                    }
                    continue;
                }
                BodySize::Unknown => {
                    let stated = digits(value.as_bytes()).ok_or(WriteError::ContentLength)?;
                    match encoding {
                        Some(Framing::Length(first)) if first != stated => return Err(WriteError::ContentLength),
                        Some(_) => {}
                        None => {
                            encoding = Some(Framing::Length(stated));
                            line(dst, b"content-length", value.as_bytes());
                        }
                    }
                    continue;
                }
            }
            encoding.get_or_insert(Framing::Length(0));
        } else if *name == header::DATE {
            wrote_date = true;
        }
        line(dst, name.as_str().as_bytes(), value.as_bytes());
    }

    // The connection's own line, as hyper adds it, after the answer's lines: HTTP/1.0 is told it may stay,
    // HTTP/1.1 that it will not.
    if http10 && client.keep_alive {
        dst.put_slice(b"connection: keep-alive\r\n");
    } else if !http10 && !client.keep_alive {
        dst.put_slice(b"connection: close\r\n");
    }
    let encoding = match encoding {
        Some(encoding) => encoding,
        None => match body {
            BodySize::Unknown if may_be_chunked => {
                dst.put_slice(b"transfer-encoding: chunked\r\n");
                Framing::Chunked
            }
            BodySize::Unknown => Framing::UntilClose,
            BodySize::Empty | BodySize::Known(0) => {
                if may_have_length && *client.method != Method::HEAD {
                    dst.put_slice(b"content-length: 0\r\n");
                }
                Framing::Length(0)
            }
            BodySize::Known(known) if may_have_length => {
                let _ = write!(dst, "content-length: {known}\r\n");
                Framing::Length(known)
            }
            BodySize::Known(_) => Framing::Length(0),
        },
    };
    let encoding = if no_body_ever || connect_tunnel || *client.method == Method::HEAD {
        Framing::Length(0)
    } else {
        encoding
    };
    let closes = !client.keep_alive
        || status == StatusCode::SWITCHING_PROTOCOLS
        || connect_tunnel
        || encoding == Framing::UntilClose;
    if !wrote_date {
        dst.put_slice(b"date: ");
        put_date(dst);
        dst.put_slice(b"\r\n");
    }
    dst.put_slice(b"\r\n");
    Ok(Written { encoding, closes })
}

fn line(dst: &mut BytesMut, name: &[u8], value: &[u8]) {
    dst.put_slice(name);
    dst.put_slice(b": ");
    dst.put_slice(value);
    dst.put_slice(b"\r\n");
}

/// Writes the head of a request to an upstream: `method target HTTP/1.1`, then `headers` in their order after the
/// framing lines are put right for `body` (what is written is what hyper's client writes for the same request).
/// The headers are changed in place as hyper changes its copy; returns how the body goes.
pub(crate) fn request_head(
    dst: &mut BytesMut,
    method: &Method,
    target: &http::Uri,
    headers: &mut HeaderMap,
    body: BodySize,
) -> Framing {
    let encoding = request_framing(method, headers, body);
    dst.reserve(32 + headers.len() * 32);
    dst.put_slice(method.as_str().as_bytes());
    dst.put_u8(b' ');
    // What `Display` writes, without its formatting machinery for the usual origin-form target.
    if target.scheme().is_none() && target.authority().is_none() {
        dst.put_slice(target.path().as_bytes());
        if let Some(query) = target.query() {
            dst.put_u8(b'?');
            dst.put_slice(query.as_bytes());
        }
    } else {
        let _ = write!(dst, "{target}");
    }
    dst.put_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers.iter() {
        line(dst, name.as_str().as_bytes(), value.as_bytes());
    }
    dst.put_slice(b"\r\n");
    encoding
}

/// RFC 9112 §6.3 from the sender's side: a coding the request states wins and ends in `chunked`; else a length
/// it states; else what the body says (a stream goes chunked, whatever the method: a GET's too, which the sender
/// passes as `Empty` when it has none).
fn request_framing(method: &Method, headers: &mut HeaderMap, body: BodySize) -> Framing {
    let known = match body {
        BodySize::Empty => {
            headers.remove(header::TRANSFER_ENCODING);
            return Framing::Length(0);
        }
        BodySize::Known(known) => Some(known),
        BodySize::Unknown => None,
    };
    let stated = super::fields::stated_length(headers);
    if let header::Entry::Occupied(mut codings) = headers.entry(header::TRANSFER_ENCODING) {
        let ends_chunked = codings
            .iter()
            .next_back()
            .is_some_and(super::fields::last_coding_is_chunked);
        if !ends_chunked {
            if let Some(last) = codings.iter_mut().next_back() {
                let mut value = last.as_bytes().to_vec();
                value.extend_from_slice(b", chunked");
                if let Ok(value) = http::HeaderValue::from_bytes(&value) {
                    *last = value;
                }
            }
        }
        headers.remove(header::CONTENT_LENGTH);
        return Framing::Chunked;
    }
    if let Some(stated) = stated {
        return Framing::Length(stated);
    }
    match known {
        Some(known) => {
            headers.insert(header::CONTENT_LENGTH, http::HeaderValue::from(known));
            Framing::Length(known)
        }
        None if *method == Method::CONNECT => Framing::Length(0),
        None => {
            headers.insert(header::TRANSFER_ENCODING, http::HeaderValue::from_static("chunked"));
            headers.remove(header::CONTENT_LENGTH);
            Framing::Chunked
        }
    }
}

/// One chunk of a chunked body: its size line, `data` and the CRLF that ends it (an empty `data` is no chunk:
/// that would be the last).
pub(crate) fn put_chunk(dst: &mut BytesMut, data: &[u8]) {
    if !data.is_empty() {
        put_chunk_size(dst, data.len());
        dst.put_slice(data);
        dst.put_slice(b"\r\n");
    }
}

/// The size line of a chunk of `len` bytes, for data written apart from it (then followed by CRLF).
pub(crate) fn put_chunk_size(dst: &mut BytesMut, len: usize) {
    let _ = write!(dst, "{len:X}\r\n");
}

/// What ends a chunked body without trailers. An answer's trailers go only to a client whose request said
/// `TE: trailers` (no `Trailer` line announces them, and a client that did not ask may not expect any).
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Whether a request's `TE` names `trailers`.
pub(crate) fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers.get_all(http::header::TE).iter().any(|value| {
        value
            .as_bytes()
            .split(|byte| *byte == b',')
            .any(|option| option.trim_ascii().eq_ignore_ascii_case(b"trailers"))
    })
}

/// The last chunk with `trailers` in it. Fields that frame, route or describe the message (RFC 9110 §6.5.1) are
/// left out: a recipient may not take them from a trailer.
pub(crate) fn put_last_chunk_with(dst: &mut BytesMut, trailers: &HeaderMap) {
    const NEVER: [&str; 13] = [
        "content-length",
        "transfer-encoding",
        "trailer",
        "host",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "proxy-connection",
        "content-type",
        "content-encoding",
        "content-range",
        "authorization",
    ];
    dst.put_slice(b"0\r\n");
    for (name, value) in trailers {
        if NEVER.contains(&name.as_str()) {
            continue;
        }
        dst.put_slice(name.as_str().as_bytes());
        dst.put_slice(b": ");
        dst.put_slice(value.as_bytes());
        dst.put_slice(b"\r\n");
    }
    dst.put_slice(b"\r\n");
}

/// The `Date` value of this second, formatted once a second per thread.
fn put_date(dst: &mut BytesMut) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let second = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    DATE.with_borrow_mut(|(at, text)| {
        if *at != second {
            *at = second;
            *text = httpdate::fmt_http_date(now);
        }
        dst.put_slice(text.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(headers: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap_or(header::WARNING),
                http::HeaderValue::from_str(value).unwrap_or(http::HeaderValue::from_static("?")),
            );
        }
        map
    }

    fn written(status: StatusCode, headers: &[(&str, &str)], body: BodySize, client: Client<'_>) -> (String, Written) {
        let mut dst = BytesMut::new();
        let written =
            response_head(&mut dst, status, None, &map(headers), body, client).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8_lossy(&dst).into_owned();
        // The date's value changes every second.
        let text = match text.find("date: ") {
            Some(at) => format!("{}date: -\r\n\r\n", &text[..at]),
            None => text,
        };
        (text, written)
    }

    const GET11: Client<'static> = Client {
        method: &Method::GET,
        version: Version::HTTP_11,
        keep_alive: true,
    };

    #[test]
    fn a_request_line_states_its_target_as_display_writes_it() {
        for target in [
            "/",
            "/a/b?x=1&y",
            "/a?",
            "/?",
            "*",
            "/%20a?q=%2F",
            "http://example.test:8080/p?q",
            "example.test:443",
        ] {
            let uri: http::Uri = target.parse().unwrap();
            let mut dst = BytesMut::new();
            request_head(&mut dst, &Method::GET, &uri, &mut HeaderMap::new(), BodySize::Empty);
            let wanted = format!("GET {uri} HTTP/1.1\r\n\r\n");
            assert_eq!(std::str::from_utf8(&dst).unwrap(), wanted, "{target}");
        }
    }

    #[test]
    fn a_stream_goes_chunked_to_http_1_1_and_until_the_close_to_http_1_0() {
        let (text, how) = written(StatusCode::OK, &[("x-a", "1")], BodySize::Unknown, GET11);
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\nx-a: 1\r\ntransfer-encoding: chunked\r\ndate: -\r\n\r\n"
        );
        assert_eq!(
            how,
            Written {
                encoding: Framing::Chunked,
                closes: false
            }
        );
        let old = Client {
            version: Version::HTTP_10,
            ..GET11
        };
        let (text, how) = written(StatusCode::OK, &[], BodySize::Unknown, old);
        assert_eq!(text, "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ndate: -\r\n\r\n");
        assert_eq!(
            how,
            Written {
                encoding: Framing::UntilClose,
                closes: true
            }
        );
    }

    #[test]
    fn lengths_known_or_stated_and_heads_without_a_body() {
        let (text, how) = written(StatusCode::NOT_FOUND, &[], BodySize::Known(5), GET11);
        assert_eq!(text, "HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\ndate: -\r\n\r\n");
        assert_eq!(how.encoding, Framing::Length(5));
        let head = Client {
            method: &Method::HEAD,
            keep_alive: false,
            ..GET11
        };
        let (text, how) = written(StatusCode::OK, &[("content-length", "42")], BodySize::Empty, head);
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\ncontent-length: 42\r\nconnection: close\r\ndate: -\r\n\r\n"
        );
        assert_eq!(
            how,
            Written {
                encoding: Framing::Length(0),
                closes: true
            }
        );
        let (text, _) = written(StatusCode::NO_CONTENT, &[], BodySize::Empty, GET11);
        assert_eq!(text, "HTTP/1.1 204 No Content\r\ndate: -\r\n\r\n");
    }

    fn sent(method: Method, headers: &[(&str, &str)], body: BodySize) -> (String, Framing) {
        let mut dst = BytesMut::new();
        let target = http::Uri::from_static("/up?x=1");
        let encoding = request_head(&mut dst, &method, &target, &mut map(headers), body);
        (String::from_utf8_lossy(&dst).into_owned(), encoding)
    }

    #[test]
    fn a_request_states_its_framing_once_and_in_the_form_its_body_needs() {
        let (text, how) = sent(Method::POST, &[("host", "a")], BodySize::Known(3));
        assert_eq!(text, "POST /up?x=1 HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\n\r\n");
        assert_eq!(how, Framing::Length(3));
        let (text, how) = sent(Method::POST, &[("content-length", "7")], BodySize::Unknown);
        assert_eq!(text, "POST /up?x=1 HTTP/1.1\r\ncontent-length: 7\r\n\r\n");
        assert_eq!(how, Framing::Length(7), "a stated length is kept over an unknown body");
        let (text, how) = sent(Method::PUT, &[("content-length", "x")], BodySize::Unknown);
        assert_eq!(text, "PUT /up?x=1 HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n");
        assert_eq!(how, Framing::Chunked, "a bad stated length gives way to chunked");
        let (text, how) = sent(Method::GET, &[], BodySize::Unknown);
        assert_eq!(text, "GET /up?x=1 HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n");
        assert_eq!(how, Framing::Chunked, "a GET's body is sent as any other's");
        let (text, how) = sent(Method::GET, &[], BodySize::Empty);
        assert_eq!(text, "GET /up?x=1 HTTP/1.1\r\n\r\n");
        assert_eq!(how, Framing::Length(0));
    }

    #[test]
    fn a_coding_that_does_not_end_in_chunked_is_made_to() {
        let (text, how) = sent(
            Method::POST,
            &[("transfer-encoding", "gzip"), ("content-length", "5")],
            BodySize::Known(5),
        );
        assert_eq!(
            text,
            "POST /up?x=1 HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
        );
        assert_eq!(how, Framing::Chunked);
        let (text, how) = sent(Method::POST, &[("transfer-encoding", "chunked")], BodySize::Empty);
        assert_eq!(text, "POST /up?x=1 HTTP/1.1\r\n\r\n");
        assert_eq!(how, Framing::Length(0), "an ended body sends no coding");
    }
}
