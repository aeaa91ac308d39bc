//! The deadline a client sends with its request: `X-Request-Timeout` (or the configured header) in
//! milliseconds, and gRPC's `grpc-timeout`.
//!
//! Owns reading those headers, leniently: a value that does not parse is no deadline. It never decides what a
//! deadline does to a request; the queue does.

use std::time::Duration;

use http::HeaderName;

/// gRPC's deadline header, as a name made once: a name given as text is parsed (checked and lowercased) at each
/// look-up.
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The timeout a request's client sent with it: `header` (milliseconds, digits only) and, when `grpc` is set,
/// `grpc-timeout` (1 to 8 digits and a unit: `H`, `M`, `S`, `m`, `u`, `n`); the shorter when both are there. A
/// value that does not parse is no deadline: shedding a request for a header it cannot read would turn a client's
/// typo into failures.
pub(crate) fn client_timeout(headers: &http::HeaderMap, header: Option<&HeaderName>, grpc: bool) -> Option<Duration> {
    let millis = header
        .and_then(|header| headers.get(header))
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|text| !text.is_empty() && text.len() <= 12 && text.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|text| text.parse::<u64>().ok())
        .map(Duration::from_millis);
    let grpc = grpc
        .then(|| headers.get(&GRPC_TIMEOUT))
        .flatten()
        .and_then(|value| value.to_str().ok())
        .and_then(grpc_timeout);
    match (millis, grpc) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// gRPC's `TimeoutValue TimeoutUnit`.
fn grpc_timeout(text: &str) -> Option<Duration> {
    let digits = text.get(..text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match text.get(text.len() - 1..)? {
        "H" => Duration::from_secs(value.checked_mul(3600)?),
        "M" => Duration::from_secs(value.checked_mul(60)?),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// Whether a request is a gRPC call over HTTP/2 framing (`application/grpc`, `application/grpc+proto`, …; not
/// gRPC-Web, whose status travels in its body).
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|value| {
        let value = value.as_bytes();
        value
            .get(..16)
            .is_some_and(|start| start.eq_ignore_ascii_case(b"application/grpc"))
            && matches!(value.get(16), None | Some(b'+' | b';'))
    })
}
