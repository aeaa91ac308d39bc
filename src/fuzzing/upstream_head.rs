//! What must hold of every request head floodgate sends upstream, whatever its client sent.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Uri, Version};

use crate::forward::ClientInfo;

/// The client's request head as it arrived, kept to judge the rewritten one against.
#[derive(Debug)]
pub(super) struct ClientHead {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
}

impl ClientHead {
    pub(super) fn of(parts: &Parts) -> Self {
        ClientHead {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            version: parts.version,
            headers: parts.headers.clone(),
        }
    }

    /// The head with `routed` (from [`routed_target`]) as its path and query: what the upstream is to get.
    pub(super) fn as_routed(&self, routed: &str) -> ClientHead {
        let mut uri = self.uri.clone();
        if self
            .uri
            .path_and_query()
            .is_some_and(|target| target.as_str() != routed)
        {
            let mut parts = self.uri.clone().into_parts();
            parts.path_and_query = http::uri::PathAndQuery::try_from(routed).ok();
            match Uri::from_parts(parts) {
                Ok(resolved) => uri = resolved,
                Err(err) => panic!("the resolved target {routed:?} is no target: {err}"),
            }
        }
        ClientHead {
            method: self.method.clone(),
            uri,
            version: self.version,
            headers: self.headers.clone(),
        }
    }
}

/// The path and query as floodgate must route and forward them, by RFC 3986 §5.2.4's own steps (an input and an
/// output buffer), each segment that is only dots, as they are or as `%2e`, read as that dot segment; `None` when
/// the target must be refused: a byte that is not ASCII, a path that climbs above the root, or a segment with a
/// dot segment between `%2f`, `%5c`, `\` or `;`. Written apart from `forward::path`, which it judges.
pub(super) fn routed_target(uri: &Uri) -> Option<String> {
    let Some(target) = uri.path_and_query() else {
        return Some(String::new());
    };
    if target.as_str().bytes().any(|b| b >= 0x80) {
        return None;
    }
    let path = uri.path();
    let query = uri.query().map(|query| format!("?{query}")).unwrap_or_default();
    let Some(segments) = path.strip_prefix('/') else {
        return Some(target.as_str().to_string());
    };
    let as_dots = |segment: &str| -> Option<&'static str> {
        match segment.to_ascii_lowercase().replace("%2e", ".").as_str() {
            "." => Some("."),
            ".." => Some(".."),
            _ => None,
        }
    };
    let mut written = Vec::new();
    for segment in segments.split('/') {
        let lower = segment.to_ascii_lowercase();
        let parts = lower.replace("%2f", "/").replace("%5c", "/").replace(['\\', ';'], "/");
        if parts.contains('/') && parts.split('/').any(|part| as_dots(part).is_some()) {
            return None;
        }
        written.push(as_dots(segment).unwrap_or(segment));
    }
    let mut input = format!("/{}", written.join("/"));
    let mut output = String::new();
    let mut climbed = false;
    let mut remove_last = |output: &mut String| match output.rfind('/') {
        Some(at) => output.truncate(at),
        None => climbed = true,
    };
    while !input.is_empty() {
        if input.starts_with("/./") {
            input.replace_range(..3, "/");
        } else if input == "/." {
            input = "/".to_string();
        } else if input.starts_with("/../") {
            input.replace_range(..4, "/");
            remove_last(&mut output);
        } else if input == "/.." {
            input = "/".to_string();
            remove_last(&mut output);
        } else {
            let end = input
                .get(1..)
                .and_then(|rest| rest.find('/'))
                .map_or(input.len(), |at| at + 1);
            output.extend(input.drain(..end));
        }
    }
    (!climbed).then(|| format!("{output}{query}"))
}

/// RFC 9110 §7.6.1 and the obsolete ones still seen on the wire.
pub(super) const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// floodgate sets these itself after the client's hop-by-hop headers are gone, so a client's `Connection` may
/// name them without keeping them from the upstream.
const SET_BY_PROXY: [HeaderName; 4] = [
    header::HOST,
    HeaderName::from_static("x-forwarded-for"),
    HeaderName::from_static("x-forwarded-proto"),
    HeaderName::from_static("x-forwarded-host"),
];

/// The comma-separated options of every `Connection` field line, lower-cased, read byte by byte: a value need not
/// be ASCII for its ASCII options to count.
pub(super) fn connection_options(headers: &HeaderMap) -> Vec<Vec<u8>> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(|option| option.trim_ascii().to_ascii_lowercase())
        .filter(|option| !option.is_empty())
        .collect()
}

/// Checks the head `sent` upstream against the `client`'s request it was made from.
pub(super) fn check(client_head: &ClientHead, sent: &Parts, client: &ClientInfo, default_host: &HeaderValue) {
    let headers = &sent.headers;
    for (name, value) in headers {
        let bytes = value.as_bytes();
        assert!(
            !bytes.iter().any(|b| matches!(b, b'\r' | b'\n' | b'\0')),
            "{name} value {value:?} would split or end the head"
        );
    }

    // The request line: HTTP/1.1, origin form (`*` only for OPTIONS), the client's path and query unchanged.
    assert_eq!(sent.version, Version::HTTP_11, "upstream requests are HTTP/1.1");
    let target = sent.uri.to_string();
    assert!(
        sent.uri.scheme().is_none() && sent.uri.authority().is_none(),
        "request target {target:?} is not in origin form"
    );
    assert!(
        target.starts_with('/') || (target == "*" && sent.method == Method::OPTIONS),
        "request target {target:?} is neither origin form nor OPTIONS *"
    );
    // hyper passes bytes above 0x7f in a target through, and so does floodgate; no space or control byte, though.
    assert!(
        !target.bytes().any(|b| b <= b' ' || b == 0x7f),
        "request target {target:?} would break the request line"
    );
    // Only origin form, `*` and absolute form naming an http(s) origin are served; authority form is CONNECT's.
    let client_scheme = client_head.uri.scheme_str();
    assert!(
        client_scheme.is_some_and(|scheme| scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https"))
            || (client_scheme.is_none() && client_head.uri.authority().is_none()),
        "the client's target {:?} is forwarded",
        client_head.uri
    );
    // An absolute URI's empty path becomes `/`.
    let client_path = match client_head.uri.path() {
        "" => "/",
        path => path,
    };
    let client_target = match client_head.uri.query() {
        Some(query) => format!("{client_path}?{query}"),
        None => client_path.to_string(),
    };
    assert_eq!(target, client_target, "the path and query are forwarded unchanged");
    assert_eq!(sent.method, client_head.method, "the method is forwarded unchanged");

    // Exactly one Host, the target's: the URI's authority wins over the client's Host (RFC 9112 §3.2.2).
    let hosts: Vec<&HeaderValue> = headers.get_all(header::HOST).iter().collect();
    let [host] = hosts.as_slice() else {
        panic!("upstream gets {} Host lines: {hosts:?}", hosts.len());
    };
    let expected_host = match (client_head.uri.authority(), client_head.headers.get(header::HOST)) {
        (Some(authority), _) => authority.as_str().as_bytes(),
        (None, Some(host)) => host.as_bytes(),
        (None, None) => default_host.as_bytes(),
    };
    assert_eq!(
        host.as_bytes(),
        without_root_dot(expected_host),
        "Host is the request's target host, less its name's trailing dot"
    );

    // Nothing hop-by-hop, nothing the client's Connection named, no Expect (answered here).
    for name in HOP_BY_HOP.iter().chain([&header::EXPECT]) {
        assert!(!headers.contains_key(name), "hop-by-hop {name} goes upstream");
    }
    for option in connection_options(&client_head.headers) {
        let Ok(name) = HeaderName::from_bytes(&option) else {
            continue;
        };
        if !SET_BY_PROXY.contains(&name) {
            assert!(
                !headers.contains_key(&name),
                "{name}, named by the client's Connection, goes upstream"
            );
        }
    }

    // One framing at most, and an unambiguous one: a length as the plain number the client stated, in one line.
    let lengths: Vec<&HeaderValue> = headers.get_all(header::CONTENT_LENGTH).iter().collect();
    if client_head.headers.contains_key(header::TRANSFER_ENCODING) {
        assert!(
            lengths.is_empty(),
            "a chunked request goes upstream with Content-Length {lengths:?}"
        );
    } else if let Some(stated) = stated_length(&client_head.headers).filter(|_| {
        // A client's Connection may name it: then it is hop-by-hop, and goes nowhere.
        !connection_options(&client_head.headers).contains(&b"content-length".to_vec())
    }) {
        assert_eq!(
            lengths,
            [&HeaderValue::from(stated)],
            "Content-Length {stated} goes upstream as it came, not as the number"
        );
    }

    // A name that is one floodgate sets with `_` for `-` would reach a CGI-style upstream as floodgate's own.
    for name in headers.keys() {
        let aliases = SET_BY_PROXY
            .iter()
            .chain([&X_REQUEST_ID])
            .any(|own| is_alias(name, own));
        assert!(!aliases, "{name} goes upstream beside floodgate's own field");
    }

    // X-Forwarded-*: one line each; an untrusted client's own are replaced, a trusted one's extended.
    let one = |name: &str| -> &HeaderValue {
        let values: Vec<&HeaderValue> = headers.get_all(name).iter().collect();
        match values.as_slice() {
            [value] => value,
            _ => panic!("upstream gets {} {name} lines: {values:?}", values.len()),
        }
    };
    let peer_ip = client.peer.ip().to_string();
    let forwarded_for = one("x-forwarded-for").to_str().unwrap_or_default();
    let forwarded_proto = one("x-forwarded-proto");
    let forwarded_host = one("x-forwarded-host");
    if client.trusted {
        assert!(
            forwarded_for == peer_ip || forwarded_for.ends_with(&format!(", {peer_ip}")),
            "X-Forwarded-For {forwarded_for:?} does not end with the peer {peer_ip}"
        );
    } else {
        assert_eq!(
            forwarded_for, peer_ip,
            "an untrusted client's X-Forwarded-For is replaced"
        );
        assert_eq!(
            forwarded_proto, "http",
            "an untrusted client's X-Forwarded-Proto is replaced"
        );
        assert_eq!(
            forwarded_host, host,
            "an untrusted client's X-Forwarded-Host is replaced"
        );
        assert!(
            !headers.contains_key(header::FORWARDED),
            "an untrusted client's Forwarded goes upstream"
        );
    }

    // Every other header of the client's goes upstream as it came, all of its lines in order.
    let named: Vec<HeaderName> = connection_options(&client_head.headers)
        .iter()
        .filter_map(|option| HeaderName::from_bytes(option).ok())
        .collect();
    let chunked = client_head.headers.contains_key(header::TRANSFER_ENCODING);
    // RFC 9113 §8.2.3: an HTTP/2 (or HTTP/3) cookie split into fields goes upstream as one line, joined by "; ".
    let joins_cookie =
        matches!(client_head.version, Version::HTTP_2 | Version::HTTP_3) && !named.contains(&header::COOKIE);
    if joins_cookie {
        let crumbs: Vec<&[u8]> = client_head
            .headers
            .get_all(header::COOKIE)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        let sent: Vec<&[u8]> = headers
            .get_all(header::COOKIE)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        let expected = crumbs.join(&b"; "[..]);
        if crumbs.is_empty() {
            assert!(sent.is_empty(), "a cookie goes upstream that the client never sent");
        } else {
            assert_eq!(
                sent,
                [expected.as_slice()],
                "an HTTP/2 cookie goes upstream as one line"
            );
        }
    }
    for name in client_head.headers.keys() {
        let rewritten = SET_BY_PROXY.contains(name)
            || SET_BY_PROXY
                .iter()
                .chain([&X_REQUEST_ID])
                .any(|own| is_alias(name, own))
            || (name == header::CONTENT_LENGTH && stated_length(&client_head.headers).is_some())
            || HOP_BY_HOP.contains(name)
            || named.contains(name)
            || [header::EXPECT, header::FORWARDED].contains(name)
            || (chunked && name == header::CONTENT_LENGTH)
            || (joins_cookie && name == header::COOKIE);
        if !rewritten {
            let before: Vec<&HeaderValue> = client_head.headers.get_all(name).iter().collect();
            let after: Vec<&HeaderValue> = headers.get_all(name).iter().collect();
            assert_eq!(before, after, "{name} is changed on its way upstream");
        }
    }
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Whether `name` has an `_` and is `own` once each `_` is read as `-`.
fn is_alias(name: &HeaderName, own: &HeaderName) -> bool {
    name.as_str().contains('_') && name.as_str().replace('_', "-") == own.as_str()
}

/// The one number all of a head's `Content-Length` lines and their list elements state, if they state one.
fn stated_length(headers: &HeaderMap) -> Option<u64> {
    let mut numbers = headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b','))
        .map(|element| {
            let element = element.trim_ascii();
            let digits = !element.is_empty() && element.iter().all(u8::is_ascii_digit);
            digits
                .then(|| std::str::from_utf8(element).ok()?.parse::<u64>().ok())
                .flatten()
        });
    let first = numbers.next()??;
    numbers.all(|number| number == Some(first)).then_some(first)
}

/// `host[:port]` less a trailing dot on the name (the part before the first `:` past any `]`), unless nothing of
/// the name would be left; found here on its own terms, not with floodgate's code.
fn without_root_dot(host: &[u8]) -> Vec<u8> {
    let after_literal = host.iter().rposition(|&b| b == b']').map_or(0, |end| end + 1);
    let mut name_len = host.len();
    for (at, &b) in host.iter().enumerate().skip(after_literal) {
        if b == b':' {
            name_len = at;
            break;
        }
    }
    let (name, port) = host.split_at(name_len);
    match name.strip_suffix(b".") {
        Some(bare) if !bare.is_empty() => [bare, port].concat(),
        _ => host.to_vec(),
    }
}
