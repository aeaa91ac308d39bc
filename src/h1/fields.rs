//! The pieces of a header field's value the head readers act on (RFC 9110 §5.6: lists, tokens, numbers), and
//! the names of httparse's errors. Each is one definition shared by the request and the response side.

use http::header::HeaderName;
use http::{header, HeaderMap, HeaderValue, Version};

use std::ops::Range;

use super::HeadError;

/// A plain decimal number: no sign, no space, no list.
pub(super) fn digits(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() {
        return None;
    }
    bytes.iter().try_fold(0u64, |total, &byte| {
        let digit = char::from(byte).to_digit(10)?;
        total.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// The one length every `Content-Length` line and list element states (`5, 5` is 5), if they all state the same.
pub(super) fn stated_length(headers: &HeaderMap) -> Option<u64> {
    // The usual head: one line of digits alone, read as it is (what the list's reading below makes of it too).
    let all = headers.get_all(header::CONTENT_LENGTH);
    let mut lines = all.iter();
    let first = lines.next()?;
    if lines.next().is_none() && first.as_bytes().iter().all(u8::is_ascii_digit) {
        return digits(first.as_bytes());
    }
    let mut length = None;
    for line in &all {
        for element in line.to_str().ok()?.split(',') {
            let this = digits(element.trim_matches([' ', '\t']).as_bytes())?;
            if length.is_some_and(|length| length != this) {
                return None;
            }
            length = Some(this);
        }
    }
    length
}

/// Whether the line's last coding is `chunked` (RFC 9112 §6.3: it must be the final one).
pub(super) fn last_coding_is_chunked(value: &HeaderValue) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|line| line.rsplit(',').next())
        .is_some_and(|coding| coding.trim_matches([' ', '\t']).eq_ignore_ascii_case("chunked"))
}

/// One header line as httparse tokenized it, as a name and a value; the error names which was invalid.
pub(super) fn field(line: &httparse::Header<'_>) -> Result<(HeaderName, HeaderValue), &'static str> {
    let name = read_name(line.name.as_bytes())?;
    let value = HeaderValue::from_bytes(line.value).map_err(|_| "invalid header value")?;
    Ok((name, value))
}

/// One header line as a name and a value that shares `value`'s bytes; the error names which was invalid.
pub(super) fn shared_field(name: &[u8], value: bytes::Bytes) -> Result<(HeaderName, HeaderValue), &'static str> {
    let name = read_name(name)?;
    let value = HeaderValue::from_maybe_shared(value).map_err(|_| "invalid header value")?;
    Ok((name, value))
}

/// A name httparse read (a token): the usual ones known by their spelling, any other parsed.
fn read_name(name: &[u8]) -> Result<HeaderName, &'static str> {
    match super::names::usual(name) {
        Some(known) => Ok(known),
        None => HeaderName::from_bytes(name).map_err(|_| "invalid header name"),
    }
}

/// A head's lines as the ranges of their names and values, kept while the head is split off its buffer.
pub(super) type Lines = Vec<(Range<usize>, Range<usize>)>;

/// Where the slices httparse hands out lie in the bytes it read, as ranges: kept while the bytes are split off.
pub(super) struct Offsets(usize);

impl Offsets {
    pub(super) fn of(bytes: &[u8]) -> Offsets {
        Offsets(bytes.as_ptr() as usize)
    }

    /// A header line's name and value as ranges of the bytes `self` was made of.
    pub(super) fn line(&self, line: &httparse::Header<'_>) -> (Range<usize>, Range<usize>) {
        (self.range(line.name.as_bytes()), self.range(line.value))
    }

    /// `part`, a slice of the bytes `self` was made of, as a range of them.
    pub(super) fn range(&self, part: &[u8]) -> Range<usize> {
        let start = (part.as_ptr() as usize).saturating_sub(self.0);
        start..start + part.len()
    }
}

/// How long a head httparse found complete is; `None` while it is incomplete and `received` (all the bytes read
/// for it) is still below `max_head_bytes`.
pub(super) fn head_len(
    parsed: httparse::Result<usize>,
    received: usize,
    max_head_bytes: usize,
) -> Result<Option<usize>, HeadError> {
    match parsed {
        Ok(httparse::Status::Complete(len)) if len > max_head_bytes => Err(HeadError::TooLarge),
        Ok(httparse::Status::Complete(len)) => Ok(Some(len)),
        Ok(httparse::Status::Partial) if received >= max_head_bytes => Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(HeadError::TooLarge),
        Err(err) => Err(HeadError::Malformed(tokenizer_error(err))),
    }
}

/// The version of a start line httparse read (it reads only `HTTP/1.0` and `HTTP/1.1`).
pub(super) fn version(minor: u8) -> Version {
    if minor == 1 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    }
}

pub(super) fn tokenizer_error(err: httparse::Error) -> &'static str {
    match err {
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Token => "invalid method or request target",
        httparse::Error::Version => "invalid HTTP version",
        httparse::Error::Status => "invalid status code",
        httparse::Error::TooManyHeaders => "too many header lines",
    }
}

/// Which of the fields floodgate reads or rewrites a head carries, found by one look at each of its names: most
/// heads carry few of them, and each lookup in a [`HeaderMap`] hashes the name it looks for, present or not.
/// Valid for the map it was made of until that map changes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Present {
    pub(crate) connection: bool,
    /// A field only `Connection` can make hop-by-hop is not counted: [`Present::hop_by_hop`] is true with it.
    pub(crate) other_hop_by_hop: bool,
    pub(crate) transfer_encoding: bool,
    pub(crate) content_length: bool,
    pub(crate) expect: bool,
    pub(crate) cookie: bool,
    pub(crate) forwarded: bool,
    pub(crate) x_forwarded: bool,
    /// A name that begins with `x` and has an `_`: it may alias an `X-` field floodgate sets (its own all begin so).
    pub(crate) x_underscore: bool,
}

impl Present {
    pub(crate) fn of(headers: &HeaderMap) -> Present {
        let mut present = Present::default();
        for name in headers.keys() {
            present.note(name);
        }
        present
    }

    /// Notes one name, for a reader that looks at each as it reads the head.
    pub(super) fn note(&mut self, name: &HeaderName) {
        match *name {
            header::CONNECTION => self.connection = true,
            header::TRANSFER_ENCODING => self.transfer_encoding = true,
            header::CONTENT_LENGTH => self.content_length = true,
            header::EXPECT => self.expect = true,
            header::COOKIE => self.cookie = true,
            header::FORWARDED => self.forwarded = true,
            header::TE | header::TRAILER | header::UPGRADE => self.other_hop_by_hop = true,
            _ => {
                let name = name.as_str().as_bytes();
                if name.first() == Some(&b'x') {
                    self.x_forwarded |= name.starts_with(b"x-forwarded-");
                    self.x_underscore |= name.contains(&b'_');
                } else if name == b"keep-alive" || name == b"proxy-connection" {
                    self.other_hop_by_hop = true;
                }
            }
        }
    }

    /// Any field of RFC 9110 §7.6.1's hop-by-hop set (a `Connection` line may name more).
    pub(crate) fn hop_by_hop(&self) -> bool {
        self.connection || self.transfer_encoding || self.other_hop_by_hop
    }
}
