//! The pieces of a header field's value the head readers act on (RFC 9110 §5.6: lists, tokens, numbers), and
//! the names of httparse's errors. Each is one definition shared by the request and the response side.

use http::{header, HeaderMap, HeaderValue};

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
    let mut length = None;
    for line in headers.get_all(header::CONTENT_LENGTH) {
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

pub(super) fn has_token(value: &HeaderValue, token: &str) -> bool {
    value.to_str().is_ok_and(|line| {
        line.split(',')
            .any(|item| item.trim_matches([' ', '\t']).eq_ignore_ascii_case(token))
    })
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
