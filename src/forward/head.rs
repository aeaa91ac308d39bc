//! The request as the upstream sees it: hop-by-hop headers removed, `X-Forwarded-*` set (and names that alias them with
//! `_` dropped), Host kept less a trailing dot, an HTTP/2 cookie joined into one line, `Content-Length` in its
//! canonical form, the target checked and put in origin form. It never touches a body.

use std::net::SocketAddr;
use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Method, Request, Uri, Version};
use tokio::net::TcpStream;

use crate::error::ProxyError;
use crate::h1::{connection_options, Present};
use crate::pool::UpstreamPool;

use super::{RequestBody, UpstreamRequest};
use crate::body::ClientBody;

/// What the proxy knows about the client connection a request came on; made once per connection.
pub struct ClientInfo {
    pub peer: SocketAddr,
    /// Whether the peer is a trusted proxy whose `X-Forwarded-*` we extend rather than replace.
    pub trusted: bool,
    /// The peer's address as an `X-Forwarded-For` value.
    peer_ip: HeaderValue,
    /// The HTTP/1 client socket, watched for the client leaving while a request with an unread body is queued
    /// (hyper notices that by itself otherwise; HTTP/2 streams are cancelled by hyper).
    pub http1_stream: Option<Arc<TcpStream>>,
    /// Whether the client reached us over TLS: `X-Forwarded-Proto` says `https` then.
    pub tls: bool,
}

impl ClientInfo {
    pub fn new(peer: SocketAddr, trusted: bool, http1_stream: Option<Arc<TcpStream>>) -> Self {
        let peer_ip = HeaderValue::from_str(&peer.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static(""));
        ClientInfo {
            peer,
            trusted,
            peer_ip,
            http1_stream,
            tls: false,
        }
    }

    /// Marks the client as connected over TLS.
    pub fn over_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }
}

pub(super) use crate::h1::{KEEP_ALIVE, X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO};
pub(super) const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes the hop-by-hop headers of RFC 9110 §7.6.1, including every header the `Connection` field names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One look over the names first: most messages carry none of these, and each removal is a hash lookup.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = connection_options(headers)
        .filter_map(|option| HeaderName::from_bytes(option).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The host a request is for: the URI's authority (absolute form, HTTP/2 `:authority`) wins over `Host`, as
/// RFC 9112 §3.2.2 asks of a proxy. Routing and the upstream's Host header both use it.
pub fn target_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    chosen_host(uri.authority(), headers.get(header::HOST))
}

/// The authority when there is one, else the Host line (as text).
fn chosen_host<'a>(authority: Option<&'a Authority>, host: Option<&'a HeaderValue>) -> Option<&'a str> {
    authority
        .map(Authority::as_str)
        .or_else(|| host.and_then(|host| host.to_str().ok()))
}

/// The request as it goes upstream: HTTP/1.1, origin form, with Host and `X-Forwarded-*`.
pub fn to_upstream(
    request: Request<ClientBody>,
    client: &ClientInfo,
    pool: &UpstreamPool,
) -> Result<UpstreamRequest, ProxyError> {
    let (mut parts, body) = request.into_parts();
    upstream_head(&mut parts, client, &pool.authority)?;
    let body = RequestBody::new(body, pool.limits().body_idle_timeout);
    Ok(Box::new(Request::from_parts(parts, body)))
}

/// The head half of [`to_upstream`]; `default_host` is the Host given to an HTTP/1.0 request that has none.
// Public only for benches/hot_path.rs: `to_upstream` needs a hyper `Incoming` body, which only a live connection
// makes, and this is all of its header work.
#[doc(hidden)]
pub fn upstream_head(
    parts: &mut http::request::Parts,
    client: &ClientInfo,
    default_host: &HeaderValue,
) -> Result<(), ProxyError> {
    check_target(&parts.method, &parts.uri)?;
    let present = Present::of(&parts.headers);
    let mut host_lines = parts.headers.get_all(header::HOST).iter();
    let given = host_lines.next();
    // The Host line goes on untouched when it is the one line and the name it states is the upstream's.
    let mut as_given = given.is_some() && host_lines.next().is_none();
    let host = match (parts.uri.authority(), given) {
        // RFC 9110 §4.2.4: userinfo in a request target is an error; it must never become the upstream's Host.
        (Some(authority), _) if authority.as_str().contains('@') => return Err(ProxyError::InvalidHost),
        (Some(authority), given) => {
            let host = HeaderValue::from_str(authority.as_str()).map_err(|_| ProxyError::MissingHost)?;
            as_given &= given == Some(&host);
            host
        }
        (None, Some(host)) => host.clone(),
        // HTTP/1.0 had no Host; the upstream still gets one.
        (None, None) if parts.version == Version::HTTP_10 => default_host.clone(),
        (None, None) => return Err(ProxyError::MissingHost),
    };
    // Routing matched the name without its root dot; the upstream is given that name, so it cannot read another.
    let host = match without_root_dot(host.as_bytes()) {
        Some(bare) => {
            as_given = false;
            HeaderValue::from_bytes(&bare).unwrap_or(host)
        }
        None => host,
    };
    // RFC 9113 §8.2.3 (RFC 9114 §4.2.1 for HTTP/3): a cookie split into fields goes to HTTP/1.1 as one line.
    if present.cookie && matches!(parts.version, Version::HTTP_2 | Version::HTTP_3) {
        join_cookie(&mut parts.headers);
    }
    // A message with both framings is a smuggling attempt's tell; the upstream only ever sees one of them.
    if present.transfer_encoding {
        parts.headers.remove(header::CONTENT_LENGTH);
    } else if present.content_length {
        canonical_length(&mut parts.headers);
    }
    // Every step from here removes fields or replaces one it found: what `present` says is absent stays absent.
    if present.hop_by_hop() {
        strip_hop_by_hop(&mut parts.headers);
        // `Connection` may have named Host itself.
        as_given = false;
    }
    if present.x_underscore {
        drop_underscore_aliases(&mut parts.headers, &SET_HERE);
    }
    // We answer `Expect: 100-continue` ourselves once admitted (hyper sends 100 when the body is first read).
    if present.expect {
        parts.headers.remove(header::EXPECT);
    }
    if !as_given {
        parts.headers.insert(header::HOST, host.clone());
    }
    set_forwarded(&mut parts.headers, client, host, &present);
    parts.uri = origin_form(&parts.uri, &parts.method);
    parts.version = Version::HTTP_11;
    Ok(())
}

/// RFC 9110 §8.6: the length goes upstream as the number it states, in one line. `0000000000000000000000000000005`
/// is 5 to floodgate's reader and hyper's, and may be a number too long to read, or octal, to the upstream's; `5, 5`
/// is one length to floodgate and two to a reader that takes lists as they come.
fn canonical_length(headers: &mut HeaderMap) {
    let mut lines = headers.get_all(header::CONTENT_LENGTH).iter();
    let plain = match (lines.next(), lines.next()) {
        (None, _) => return,
        (Some(line), None) => {
            let digits = line.as_bytes();
            !digits.is_empty()
                && digits.iter().all(u8::is_ascii_digit)
                && (digits.len() == 1 || digits.first() != Some(&b'0'))
        }
        _ => false,
    };
    if plain {
        return;
    }
    // A length that states no one number is left for the framing to refuse (`h1::write` sends such a body chunked).
    if let Some(length) = stated_length(headers) {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
}

/// The one number every `Content-Length` line and list element states, if they all state the same one.
fn stated_length(headers: &HeaderMap) -> Option<u64> {
    let mut length = None;
    let elements = headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii);
    for element in elements {
        if element.is_empty() || !element.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let number = std::str::from_utf8(element).ok()?.parse::<u64>().ok()?;
        if length.is_some_and(|length| length != number) {
            return None;
        }
        length = Some(number);
    }
    length
}

/// The fields floodgate sets on every request, by names with a `-`: `set_forwarded`'s and the request ID that
/// `edge` sets. (Host, `Forwarded` and the trace context's `traceparent`/`tracestate` have no `-` to alias.) Each
/// begins with `x-`: [`Present::x_underscore`] looks for aliases only among names that begin with `x`.
pub(super) const SET_HERE: [HeaderName; 4] = [
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    X_FORWARDED_HOST,
    crate::access::X_REQUEST_ID,
];

/// Removes every field whose name has an `_` and reads as one of `names` when each `_` is taken for a `-`
/// (`X_Forwarded_For`, `x-forwarded_for`): CGI, WSGI and the servers that follow them name a field's variable
/// with both as `_` (RFC 3875 §4.1.18, `HTTP_X_FORWARDED_FOR`), so such a field would reach the upstream as the
/// one floodgate sets, beside it or instead of it. Other names with an `_` pass.
pub fn drop_underscore_aliases(headers: &mut HeaderMap, names: &[HeaderName]) {
    // One look over the names first: a name with an underscore is rare.
    if names.is_empty() || !headers.keys().any(|name| name.as_str().contains('_')) {
        return;
    }
    let aliases: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().contains('_') && names.iter().any(|own| reads_as(name.as_str(), own.as_str())))
        .cloned()
        .collect();
    for alias in aliases {
        headers.remove(alias);
    }
}

/// Whether `alias` is `own` with some of its `-` written as `_` (both are lower case, as header names are kept).
fn reads_as(alias: &str, own: &str) -> bool {
    alias.len() == own.len()
        && alias
            .bytes()
            .zip(own.bytes())
            .all(|(a, o)| a == o || (a == b'_' && o == b'-'))
}

/// The request target's form (RFC 9112 §3.2): origin or absolute form, `*` for OPTIONS. Authority form is for
/// CONNECT alone, refused before this as a tunnel; elsewhere it would be routed by an authority that is no target.
/// An absolute form names an `http` or `https` origin (the listener, not the scheme, says how the client came, so
/// `https://` on a plain listener is served as `http://` is); a proxy in front of origins serves no other scheme.
pub fn check_target(method: &Method, uri: &Uri) -> Result<(), ProxyError> {
    // RFC 9112 §3.2.4: the asterisk form is for OPTIONS alone; another method with it is no valid request line.
    if uri.path() == "*" && method != Method::OPTIONS {
        return Err(ProxyError::AsteriskTarget);
    }
    match uri.scheme_str() {
        Some(scheme) if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") => Ok(()),
        Some(_) => Err(ProxyError::UnsupportedScheme),
        None if uri.authority().is_some() => Err(ProxyError::AuthorityFormTarget),
        None => Ok(()),
    }
}

pub(super) fn origin_form(uri: &Uri, method: &Method) -> Uri {
    if method == Method::OPTIONS && uri.path() == "*" {
        return uri.clone();
    }
    match uri.path_and_query().map(|pq| Uri::from(pq.clone())) {
        Some(origin) if origin.path().starts_with('/') => origin,
        // Neither path nor query (`http://host#f` is kept as an empty one, which would print as no target).
        _ => Uri::from_static("/"),
    }
}

pub(super) fn set_forwarded(headers: &mut HeaderMap, client: &ClientInfo, host: HeaderValue, present: &Present) {
    // A trusted hop's own values are read only when it sent some; an untrusted one's are replaced.
    let trusted_sent = client.trusted && present.x_forwarded;
    let previous: Vec<&str> = if trusted_sent {
        // Every field line counts: earlier hops may have sent theirs separately.
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    } else {
        Vec::new()
    };
    let value = if previous.is_empty() {
        client.peer_ip.clone()
    } else {
        let joined = format!("{}, {}", previous.join(", "), client.peer.ip());
        HeaderValue::from_str(&joined).unwrap_or_else(|_| client.peer_ip.clone())
    };
    headers.insert(X_FORWARDED_FOR, value);
    // A trusted hop's own values stay, as one line each: with several, the upstream might read another one than
    // the hop meant.
    let proto = trusted_sent.then(|| one_line(headers, &X_FORWARDED_PROTO)).flatten();
    let scheme = if client.tls { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO, proto.unwrap_or(HeaderValue::from_static(scheme)));
    let forwarded_host = trusted_sent.then(|| one_line(headers, &X_FORWARDED_HOST)).flatten();
    headers.insert(X_FORWARDED_HOST, forwarded_host.unwrap_or(host));
    if !client.trusted && present.forwarded {
        headers.remove(header::FORWARDED);
    }
}

/// All lines of a field as one, joined by commas as RFC 9110 §5.3 reads them; `None` without any.
pub(super) fn one_line(headers: &HeaderMap, name: &HeaderName) -> Option<HeaderValue> {
    joined(headers, name, b", ")
}

/// All lines of a field as one, `separator` between them; `None` without any.
pub(super) fn joined(headers: &HeaderMap, name: &HeaderName, separator: &[u8]) -> Option<HeaderValue> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next()?.clone();
    lines.try_fold(first, |joined, line| {
        HeaderValue::from_bytes(&[joined.as_bytes(), separator, line.as_bytes()].concat()).ok()
    })
}

/// Cookie is no comma list (RFC 6265 §5.4): its crumbs are joined by `; `.
pub(super) fn join_cookie(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    if let Some(cookie) = joined(headers, &header::COOKIE, b"; ") {
        headers.insert(header::COOKIE, cookie);
    }
}

/// RFC 9112 §3.2: more than one Host line, or a target host (Host, or the URI's authority that wins over it) that
/// is not a valid `host[:port]`, is a bad request: the proxy would route by one reading of it while the upstream
/// might act on another. A missing Host is decided by [`to_upstream`] (HTTP/1.0 may omit it). Passed, the host
/// the request is for, as [`target_host`] gives it (read here once for both).
pub fn check_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Result<Option<&'a str>, ProxyError> {
    let authority = uri.authority();
    let authority_ok = authority.is_none_or(|authority| valid_authority(authority.as_str().as_bytes()));
    let mut lines = headers.get_all(header::HOST).iter();
    let host = lines.next();
    let host_ok = match host {
        Some(host) => lines.next().is_none() && valid_authority(host.as_bytes()),
        None => true,
    };
    if !(authority_ok && host_ok) {
        return Err(ProxyError::InvalidHost);
    }
    Ok(chosen_host(authority, host))
}

/// A `host[:port]` every reader takes the same way: no userinfo; a port, when there is one, is a 16-bit number
/// (past it, one reader wraps it and another refuses it); a name has no empty label but the root's trailing one.
pub(super) fn valid_authority(bytes: &[u8]) -> bool {
    plainly_valid(bytes) || valid_authority_in_full(bytes)
}

/// Whether `bytes` is a `name[:port]` of letters, digits, `-` and dots whose labels are not empty (a trailing dot
/// aside), with a port of digits that fits 16 bits: nearly every Host, judged in one pass. `false` says nothing:
/// [`valid_authority_in_full`] decides then.
pub(super) fn plainly_valid(bytes: &[u8]) -> bool {
    // The name, to the first `:`: a byte at a time, each a range test.
    let mut label = 0usize;
    let mut name_len = 0usize;
    for &byte in bytes {
        match byte {
            b'-' | b'a'..=b'z' | b'0'..=b'9' | b'A'..=b'Z' => label += 1,
            b'.' if label > 0 => label = 0,
            b':' => break,
            _ => return false,
        }
        name_len += 1;
    }
    // A label ends with a dot or the name; only the last may be empty, after the root's trailing dot.
    let labels_ok = label > 0 || (name_len > 0 && bytes.get(name_len - 1) == Some(&b'.'));
    let port_ok = match bytes.get(name_len + 1..) {
        // No `:`, so no port.
        None => true,
        Some(digits) => {
            !digits.is_empty()
                && digits
                    .iter()
                    .try_fold(0u32, |value, &digit| {
                        digit
                            .is_ascii_digit()
                            .then(|| (value * 10 + u32::from(digit - b'0')).min(1 << 16))
                    })
                    .is_some_and(|value| value <= u32::from(u16::MAX))
        }
    };
    labels_ok && port_ok
}

/// [`valid_authority`], every rule checked on its own.
pub(super) fn valid_authority_in_full(bytes: &[u8]) -> bool {
    let (name, port) = crate::h1::split_port(bytes);
    // RFC 3986 §3.2.3 lets the port be empty (`host:`): it means the default.
    let port_ok = port.is_none_or(|port| {
        port.is_empty()
            || (port.iter().all(u8::is_ascii_digit)
                && std::str::from_utf8(port).is_ok_and(|port| port.parse::<u16>().is_ok()))
    });
    let name_ok = if name.starts_with(b"[") {
        name.ends_with(b"]")
    } else {
        let name = name.strip_suffix(b".").unwrap_or(name);
        !name.is_empty() && name.split(|&b| b == b'.').all(|label| !label.is_empty())
    };
    // Parsing an Authority copies the value; a plain `name[:port]` (nearly every request) is known good without it.
    port_ok && name_ok && !bytes.contains(&b'@') && (plain_host(bytes) || http::uri::Authority::try_from(bytes).is_ok())
}

/// `host[:port]` less the name's trailing dot, the DNS root's empty label (RFC 1034 §3.1): `a.example.:80` names
/// what `a.example:80` does. `None` when there is none to drop, or nothing of the name would be left.
pub(super) fn without_root_dot(authority: &[u8]) -> Option<Vec<u8>> {
    let (name, port) = crate::h1::split_port(authority);
    let bare = name.strip_suffix(b".").filter(|bare| !bare.is_empty())?;
    let mut host = bare.to_vec();
    if let Some(port) = port {
        host.push(b':');
        host.extend_from_slice(port);
    }
    Some(host)
}

/// `name` or `name:port` in letters, digits, `.` and `-`: a subset of what [`http::uri::Authority`] accepts.
pub(super) fn plain_host(bytes: &[u8]) -> bool {
    let name_byte = |b: &u8| b.is_ascii_alphanumeric() || *b == b'.' || *b == b'-';
    let (name, port) = match bytes.iter().position(|&b| b == b':') {
        Some(colon) => (bytes.get(..colon), bytes.get(colon + 1..)),
        None => (Some(bytes), None),
    };
    let name_ok = name.is_some_and(|name| !name.is_empty() && name.iter().all(name_byte));
    let port_ok = port.is_none_or(|port| !port.is_empty() && port.iter().all(u8::is_ascii_digit));
    name_ok && port_ok
}

/// hyper decodes the `chunked` transfer coding and no other, and Transfer-Encoding is hop-by-hop: a body sent with
/// another coding (gzip, say) would reach the upstream with that coding undeclared. RFC 9112 §6.1 answers a coding
/// the server does not understand with 501. `identity` (a no-op from older RFCs) passes. A list whose last coding
/// is not chunked, and Transfer-Encoding on HTTP/1.0, hyper refuses itself (400). Empty list elements
/// (`,chunked`) are no coding: RFC 9110 §5.6.1 has recipients ignore them. `chunked` more than once, in one line
/// or over several, is malformed (RFC 9112 §6.1: it is applied only once): the body is decoded once, and what the
/// inner coding framed would go on as the content (h11 refuses it too).
pub fn check_transfer_coding(headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut chunked = 0;
    for line in headers.get_all(header::TRANSFER_ENCODING) {
        let line = line.to_str().map_err(|_| ProxyError::UnsupportedTransferCoding)?;
        for coding in line.split(',').map(str::trim) {
            if coding.eq_ignore_ascii_case("chunked") {
                chunked += 1;
            } else if !(coding.is_empty() || coding.eq_ignore_ascii_case("identity")) {
                return Err(ProxyError::UnsupportedTransferCoding);
            }
        }
    }
    if chunked > 1 {
        Err(ProxyError::ChunkedTwice)
    } else {
        Ok(())
    }
}
