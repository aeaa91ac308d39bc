//! What a strict HTTP/1 reader makes of the bytes an upstream wrote, for the `upstream_response` target: the
//! answer the client must get (the message whole, an honest cut, or a `502`), decoded here independently of
//! floodgate's own reader.

/// hyper's own limit on the header lines of a response head.
pub(super) const MAX_HEADERS: usize = 100;

/// What the upstream's bytes must become, as far as a strict reading of them can tell.
#[derive(Debug)]
pub(super) enum Expect {
    /// No head that can be passed on: a `502`.
    BadGateway(&'static str),
    /// A plain, complete message: its status, and its body (`None`: it has none).
    Whole { status: u16, body: Option<Vec<u8>> },
    /// A body that ends before its framing says it does: never relayed whole.
    Truncated { status: u16 },
    /// Framing outside the strict reading below (hyper is more lenient): only the rules every answer keeps.
    Undecided { status: u16 },
}

impl Expect {
    /// The status the upstream answered with, if it has one to pass on.
    pub(super) fn status(&self) -> Option<u16> {
        match self {
            Expect::BadGateway(_) => None,
            Expect::Whole { status, .. } | Expect::Truncated { status } | Expect::Undecided { status } => Some(*status),
        }
    }
}

/// Reads the upstream's bytes as hyper's client does (the same parser, 1xx skipped), but decides the body only
/// where its framing cannot be read two ways: one Content-Length (a list of one number repeated counts as it, as
/// for hyper), one `chunked` in the strict form of [`dechunk`], or neither (the body runs to the close).
pub(super) fn decode(bytes: &[u8], head: bool) -> Expect {
    let mut rest = bytes;
    // Interim heads are bounded in number and bytes (floodgate's, not hyper's: hyper has no bound).
    let (mut interim, mut interim_bytes) = (0usize, 0usize);
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let len = match response.parse(rest) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Expect::BadGateway("no whole response head before the close"),
            Err(_) => return Expect::BadGateway("a response head hyper's parser refuses"),
        };
        rest = rest.get(len..).unwrap_or_default();
        let status = match response.code {
            Some(status @ 100..=999) => status,
            _ => return Expect::BadGateway("a status below 100"),
        };
        if status == 101 {
            return Expect::BadGateway("101 to a request that asked for no upgrade");
        }
        if status < 200 {
            interim += 1;
            interim_bytes += len;
            if interim > crate::h1::response_head::MAX_INTERIM_HEADS
                || interim_bytes > crate::h1::response_head::MAX_RESPONSE_HEAD_BYTES
            {
                return Expect::BadGateway("more interim (1xx) answers than floodgate reads");
            }
            continue;
        }
        let lengths = values(response.headers, "content-length");
        let codings = values(response.headers, "transfer-encoding");
        if !lengths.is_empty() && !codings.is_empty() {
            return Expect::BadGateway("both Content-Length and Transfer-Encoding");
        }
        // Empty list elements are ignored (RFC 9110 §5.6.1), as floodgate does for requests and answers alike.
        let understood = |coding: &[u8]| {
            coding.is_empty() || coding.eq_ignore_ascii_case(b"chunked") || coding.eq_ignore_ascii_case(b"identity")
        };
        if !codings
            .iter()
            .flat_map(|line| line.split(|&b| b == b','))
            .all(|coding| understood(coding.trim_ascii()))
        {
            return Expect::BadGateway("a transfer coding other than chunked");
        }
        // RFC 9112 §6.1: chunked is applied once; twice, a reader decoding once takes the inner framing for content.
        let chunked = codings
            .iter()
            .flat_map(|line| line.split(|&b| b == b','))
            .filter(|coding| coding.trim_ascii().eq_ignore_ascii_case(b"chunked"))
            .count();
        if chunked > 1 {
            return Expect::BadGateway("chunked more than once");
        }
        let length = match content_length(&lengths) {
            Ok(length) => length,
            Err(()) => return Expect::BadGateway("an invalid Content-Length"),
        };
        if head || status == 204 || status == 304 {
            return Expect::Whole { status, body: None };
        }
        return match (length, codings.as_slice(), response.version) {
            (None, [], _) => Expect::Whole {
                status,
                body: Some(rest.to_vec()),
            },
            (Some(length), [], _) => match usize::try_from(length).ok().and_then(|length| rest.get(..length)) {
                Some(body) => Expect::Whole {
                    status,
                    body: Some(body.to_vec()),
                },
                None => Expect::Truncated { status },
            },
            (None, [coding], Some(1)) if coding.eq_ignore_ascii_case(b"chunked") => match dechunk(rest) {
                Chunked::Whole { data, .. } => Expect::Whole {
                    status,
                    body: Some(data),
                },
                Chunked::Partial => Expect::Truncated { status },
                Chunked::Malformed => Expect::Undecided { status },
            },
            _ => Expect::Undecided { status },
        };
    }
}

/// The length the Content-Length lines give (RFC 9110 §8.6): every comma-separated value the same decimal number.
pub(super) fn content_length(lines: &[&[u8]]) -> Result<Option<u64>, ()> {
    let mut length = None;
    for value in lines.iter().flat_map(|line| line.split(|&b| b == b',')) {
        let value = value.trim_ascii();
        if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
            return Err(());
        }
        let number = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or(())?;
        if length.is_some_and(|length| length != number) {
            return Err(());
        }
        length = Some(number);
    }
    Ok(length)
}

/// A chunked body read the strict way hyper's encoder writes one: hex sizes without extensions or spaces, CRLF
/// after each line and chunk, plain `name: value` trailers. hyper's decoder reads whatever fits it the same way.
#[derive(Debug)]
pub(super) enum Chunked {
    /// Its last chunk and trailers ended `end` bytes in.
    Whole { data: Vec<u8>, end: usize },
    /// Strict so far, but the bytes end before the body does.
    Partial,
    /// Outside the strict form.
    Malformed,
}

pub(super) const MAX_TRAILERS: usize = 8;

pub(super) fn dechunk(bytes: &[u8]) -> Chunked {
    let mut data = Vec::new();
    let mut rest = bytes;
    loop {
        let Some(at) = find(rest, b"\r\n") else {
            return Chunked::Partial;
        };
        let (line, after) = rest.split_at(at);
        let after = after.get(2..).unwrap_or_default();
        let Some(size) = hex(line) else {
            return Chunked::Malformed;
        };
        if size == 0 {
            return trailers(after, data, bytes.len());
        }
        let Some(chunk) = after.get(..size) else {
            return Chunked::Partial;
        };
        match after.get(size..).unwrap_or_default() {
            [b'\r', b'\n', ..] => {}
            [] | [b'\r'] => return Chunked::Partial,
            _ => return Chunked::Malformed,
        }
        data.extend_from_slice(chunk);
        rest = after.get(size + 2..).unwrap_or_default();
    }
}

pub(super) fn trailers(mut rest: &[u8], data: Vec<u8>, total: usize) -> Chunked {
    for _ in 0..=MAX_TRAILERS {
        match find(rest, b"\r\n") {
            None => return Chunked::Partial,
            Some(0) => {
                return Chunked::Whole {
                    data,
                    end: total - rest.len() + 2,
                }
            }
            Some(at) if plain_field(rest.get(..at).unwrap_or_default()) => {
                rest = rest.get(at + 2..).unwrap_or_default();
            }
            Some(_) => return Chunked::Malformed,
        }
    }
    Chunked::Malformed
}

/// `name: value`, a token name and a value of visible ASCII and spaces, short.
pub(super) fn plain_field(line: &[u8]) -> bool {
    let Some(colon) = line.iter().position(|&b| b == b':') else {
        return false;
    };
    let (name, value) = line.split_at(colon);
    let token = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    !name.is_empty()
        && name.len() <= 64
        && name.iter().all(token)
        && value.len() <= 256
        && value.iter().skip(1).all(|&b| b == b' ' || b.is_ascii_graphic())
}

/// 1 to 8 hex digits: a chunk size hyper reads the same.
pub(super) fn hex(line: &[u8]) -> Option<usize> {
    if line.is_empty() || line.len() > 8 {
        return None;
    }
    let text = std::str::from_utf8(line).ok()?;
    if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    usize::from_str_radix(text, 16).ok()
}

/// A plain decimal length.
pub(super) fn digits(value: &[u8]) -> Option<u64> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// The values of every line of the header `name`.
pub(super) fn values<'a>(headers: &[httparse::Header<'a>], name: &str) -> Vec<&'a [u8]> {
    headers
        .iter()
        .filter(|header| header.name.eq_ignore_ascii_case(name))
        .map(|header| header.value)
        .collect()
}

pub(super) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}
