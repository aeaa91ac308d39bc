//! floodgate's own HTTP/1 codec, for a data path in which a connection with no request in progress holds no
//! buffer: the readers of a client's request head ([`request_head`]), an upstream's response head
//! ([`response_head`]), a body's pieces ([`body`], chunked ones by [`chunked`]), and the writers of an answer to a
//! client and of a request to an upstream ([`write`]), the heads and writers each checked against hyper's reading
//! or writing by a differential fuzz target; what can go wrong with an upstream's side of an exchange
//! ([`UpstreamError`]). It never touches a socket, a pool or a metric.

pub(crate) mod body;
pub(crate) mod chunked;
mod fields;
mod names;
pub(crate) mod request_head;
pub(crate) mod response_head;
pub(crate) mod write;

use std::io;

use http::{header, HeaderMap, StatusCode, Version};

pub(crate) use fields::Present;
pub use names::X_REQUEST_ID;
pub(crate) use names::{KEEP_ALIVE, X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO};
use response_head::{MAX_INTERIM_HEADS, MAX_RESPONSE_HEAD_BYTES};

/// How many header lines a head may have, as hyper's default; more is answered `431`.
pub(crate) const MAX_HEADERS: usize = 100;

/// Fields the proxy may add to a message it passes on (Host, `X-Forwarded-*`, a request ID): a parsed head's
/// map is made with room for them, since growing one rehashes it.
const ADDED_FIELDS: usize = 6;

/// The largest `Content-Length` taken, as hyper takes it (the two values above are its body decoder's markers).
const MAX_CONTENT_LENGTH: u64 = u64::MAX - 2;

/// How a message's body is delimited after its head, read (an upstream's answer) or written (an answer to a
/// client, a request upstream). A request read from a client is never delimited by its end
/// ([`request_head::BodyFraming`] has no such case, RFC 9112 §6.3), and how far a body has come is
/// [`body::Delimited`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Exactly this many bytes, as they are; 0 for no body (`HEAD`, `204`, `304`, a `101`).
    Length(u64),
    /// Each piece as a chunk, then the last chunk.
    Chunked,
    /// Everything until the connection closes.
    UntilClose,
}

/// What went wrong on the upstream's side of an exchange.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("connection error: {0}")]
    Io(#[from] io::Error),
    #[error("connection closed before the answer's head was complete")]
    ClosedBeforeHead,
    #[error("the connection was closed (or spoken on unasked) while it sat idle")]
    Closed,
    #[error("invalid answer head: {0}")]
    Head(#[from] HeadError),
    #[error("answer body cut short: the connection ended before it did")]
    BodyCutShort,
    #[error("invalid chunked answer body: {0}")]
    Chunked(&'static str),
    /// An HTTP/2 upstream took none of a request body for its idle bound (no window given back).
    #[error("the upstream took none of the request body for {0:?}")]
    BodyStalled(std::time::Duration),
    /// An HTTP/2 stream or session failed (a reset, a protocol error, the connection lost).
    #[error("HTTP/2: {0}")]
    H2(h2::Error),
    /// An HTTP/2 stream the upstream did not process: refused (`REFUSED_STREAM`) or above the last stream id of
    /// its GOAWAY. Safe to send again, whatever the method.
    #[error("HTTP/2 stream not processed by the upstream: {0}")]
    NotProcessed(h2::Error),
    #[error("more than {MAX_INTERIM_HEADS} interim (1xx) answers, or {MAX_RESPONSE_HEAD_BYTES} bytes of them, before the final one")]
    TooManyInterim,
}

/// Why a head is refused; the connection ends after the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("the head is larger than its limit or has more than {MAX_HEADERS} lines")]
    TooLarge,
    #[error("the request target is too long")]
    TargetTooLong,
    #[error("malformed head: {0}")]
    Malformed(&'static str),
}

impl HeadError {
    /// The answer to a client whose request head this is.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            HeadError::TooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadError::TargetTooLong => StatusCode::URI_TOO_LONG,
            HeadError::Malformed(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// The options of every `Connection` line, read as bytes: a line with a non-ASCII byte still names its other
/// `host[:port]` split at the port's colon, the first one after an IPv6 literal's `]`.
// Inlined where it is called on every request's Host (forward::head), as it was while it lived there.
#[inline]
pub(crate) fn split_port(authority: &[u8]) -> (&[u8], Option<&[u8]>) {
    let literal_end = authority.iter().rposition(|&b| b == b']').map_or(0, |end| end + 1);
    let colon = authority
        .iter()
        .skip(literal_end)
        .position(|&b| b == b':')
        .map(|at| literal_end + at);
    match colon.and_then(|colon| Some((authority.get(..colon)?, authority.get(colon + 1..)?))) {
        Some((name, port)) => (name, Some(port)),
        None => (authority, None),
    }
}

/// options (reading it as text would drop the whole line, and with it a `close` or a header to strip).
pub(crate) fn connection_options(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
}

/// Whether the peer keeps the connection open after this message (HTTP/1.1 unless `close`, HTTP/1.0 only with
/// `keep-alive`).
pub fn keeps_alive(version: Version, headers: &HeaderMap) -> bool {
    keeps_alive_given(version, headers, true)
}

/// [`keeps_alive`] for a message whose reader knows whether it has a `Connection` line: without one, HTTP/1.1
/// persists and HTTP/1.0 does not, and no lookup is needed.
pub(crate) fn keeps_alive_given(version: Version, headers: &HeaderMap, has_connection: bool) -> bool {
    if !has_connection {
        return version == Version::HTTP_11;
    }
    let connection_has =
        |token: &str| connection_options(headers).any(|option| option.eq_ignore_ascii_case(token.as_bytes()));
    match version {
        Version::HTTP_11 => !connection_has("close"),
        Version::HTTP_10 => connection_has("keep-alive") && !connection_has("close"),
        _ => false,
    }
}
