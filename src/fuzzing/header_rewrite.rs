//! The `header_rewrite` target: a request head, given in a small line format, rewritten for the upstream; the
//! same headers also read as an upstream's response head.
//!
//! The format is text a person can write and a fuzzer can mutate, and it reaches heads hyper's HTTP/1 parser
//! never hands over (HTTP/2 requests, an authority beside a different Host, any header value a `HeaderValue`
//! may hold). The first line is `METHOD URI VERSION PEER-IP [trusted]`, each part falling back to
//! `GET / HTTP/1.1 192.0.2.7` when missing or invalid; every later line is `name: value`, and a line that is no
//! valid header is skipped. Lines end with LF or CRLF.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Uri, Version};

use super::upstream_head::{self, connection_options, ClientHead, HOP_BY_HOP};
use crate::error::ProxyError;
use crate::forward::{self, ClientInfo};

/// The Host an HTTP/1.0 request without one is given: its upstream's authority.
const UPSTREAM_AUTHORITY: &str = "127.0.0.1:9000";

/// Decodes `bytes` as a head and checks `strip_hop_by_hop`, `keeps_alive` and the upstream rewrite on it.
pub fn header_rewrite(bytes: &[u8]) {
    let (head, client) = decode(bytes);
    check_strip(&head.headers);
    check_keep_alive(head.version, &head.headers);
    check_rewrite(&head, &client);
}

fn decode(bytes: &[u8]) -> (ClientHead, ClientInfo) {
    let mut lines = bytes
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line));
    let first = lines.next().unwrap_or_default();
    let mut fields = first.split(|&b| b == b' ').filter(|field| !field.is_empty());
    let method = fields
        .next()
        .and_then(|f| Method::from_bytes(f).ok())
        .unwrap_or(Method::GET);
    let uri = fields
        .next()
        .and_then(|f| Uri::try_from(f).ok())
        .unwrap_or_else(|| Uri::from_static("/"));
    let version = match fields.next().unwrap_or_default() {
        b"HTTP/0.9" => Version::HTTP_09,
        b"HTTP/1.0" => Version::HTTP_10,
        b"HTTP/2" | b"HTTP/2.0" => Version::HTTP_2,
        b"HTTP/3" => Version::HTTP_3,
        _ => Version::HTTP_11,
    };
    let ip = fields
        .next()
        .and_then(|f| std::str::from_utf8(f).ok())
        .and_then(|f| f.parse::<IpAddr>().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)));
    let trusted = fields.next() == Some(b"trusted".as_slice());
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = line.split_at(colon);
        let value = value.get(1..).unwrap_or_default();
        let value = value
            .iter()
            .position(|&b| b != b' ' && b != b'\t')
            .map_or(&[][..], |start| value.get(start..).unwrap_or_default());
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            headers.append(name, value);
        }
    }
    let head = ClientHead {
        method,
        uri,
        version,
        headers,
    };
    (head, ClientInfo::new(SocketAddr::new(ip, 40000), trusted, None))
}

/// No hop-by-hop header survives, nor any the `Connection` field names; the rest is untouched; twice is once.
fn check_strip(headers: &HeaderMap) {
    let mut stripped = headers.clone();
    forward::strip_hop_by_hop(&mut stripped);
    let named: Vec<HeaderName> = connection_options(headers)
        .iter()
        .filter_map(|option| HeaderName::from_bytes(option).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        assert!(!stripped.contains_key(name), "{name} survives strip_hop_by_hop");
    }
    for name in headers
        .keys()
        .filter(|name| !HOP_BY_HOP.contains(name) && !named.contains(name))
    {
        let before: Vec<_> = headers.get_all(name).iter().collect();
        let after: Vec<_> = stripped.get_all(name).iter().collect();
        assert_eq!(before, after, "strip_hop_by_hop changes end-to-end {name}");
    }
    let mut again = stripped.clone();
    forward::strip_hop_by_hop(&mut again);
    assert_eq!(again, stripped, "strip_hop_by_hop is not idempotent");
}

/// RFC 9112 §9.3: HTTP/1.1 persists unless an option says `close`; HTTP/1.0 only when one says `keep-alive`.
fn check_keep_alive(version: Version, headers: &HeaderMap) {
    let options = connection_options(headers);
    let close = options.iter().any(|option| option == b"close");
    let keep_alive = options.iter().any(|option| option == b"keep-alive");
    let expected = match version {
        Version::HTTP_11 => !close,
        Version::HTTP_10 => keep_alive && !close,
        _ => false,
    };
    assert_eq!(
        forward::keeps_alive(version, headers),
        expected,
        "keeps_alive({version:?}) with Connection options {:?}",
        options.iter().map(|o| String::from_utf8_lossy(o)).collect::<Vec<_>>()
    );
}

/// The head as sent upstream holds every invariant; rewriting it again changes nothing, except that a trusted
/// peer is appended to X-Forwarded-For once more.
fn check_rewrite(head: &ClientHead, client: &ClientInfo) {
    let default_host = HeaderValue::from_static(UPSTREAM_AUTHORITY);
    let mut parts = parts_of(head);
    match forward::upstream_head(&mut parts, client, &default_host) {
        Ok(()) => upstream_head::check(head, &parts, client, &default_host),
        Err(ProxyError::MissingHost) => {
            assert!(
                head.uri.authority().is_none()
                    && !head.headers.contains_key(http::header::HOST)
                    && head.version != Version::HTTP_10,
                "refused for a missing Host: {head:?}"
            );
            return;
        }
        Err(ProxyError::InvalidHost) => {
            let userinfo = head.uri.authority().is_some_and(|a| a.as_str().contains('@'));
            assert!(userinfo, "refused for an invalid Host: {head:?}");
            return;
        }
        Err(ProxyError::AuthorityFormTarget) => {
            assert!(
                head.uri.scheme().is_none() && head.uri.authority().is_some(),
                "refused for an authority-form target: {head:?}"
            );
            return;
        }
        Err(ProxyError::UnsupportedScheme) => {
            assert!(
                head.uri
                    .scheme_str()
                    .is_some_and(|s| !s.eq_ignore_ascii_case("http") && !s.eq_ignore_ascii_case("https")),
                "refused for its scheme: {head:?}"
            );
            return;
        }
        Err(ProxyError::AsteriskTarget) => {
            assert!(
                head.uri.path() == "*" && head.method != Method::OPTIONS,
                "refused for an asterisk target: {head:?}"
            );
            return;
        }
        Err(err) => panic!("upstream_head fails with {err}: {head:?}"),
    }
    let once = ClientHead::of(&parts);
    let mut twice = parts_of(&once);
    if let Err(err) = forward::upstream_head(&mut twice, client, &default_host) {
        panic!("a rewritten head is refused when rewritten again: {err}");
    }
    let mut expected = once.headers.clone();
    if client.trusted {
        let forwarded_for = once.headers.get("x-forwarded-for").and_then(|v| v.to_str().ok());
        let appended = format!("{}, {}", forwarded_for.unwrap_or_default(), client.peer.ip());
        if let Ok(appended) = HeaderValue::from_str(&appended) {
            expected.insert("x-forwarded-for", appended);
        }
    }
    assert_eq!(
        (&twice.method, &twice.uri, twice.version, &twice.headers),
        (&once.method, &once.uri, once.version, &expected),
        "rewriting for the upstream twice is not rewriting once"
    );
}

fn parts_of(head: &ClientHead) -> Parts {
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = head.method.clone();
    parts.uri = head.uri.clone();
    parts.version = head.version;
    parts.headers = head.headers.clone();
    parts
}
