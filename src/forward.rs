//! Forwarding: the request as the upstream sees it, and the bodies relayed both ways.
//!
//! Owns header rewriting (hop-by-hop headers removed, `X-Forwarded-*` set, Host kept less a trailing dot, an
//! HTTP/2 cookie joined into one line), the request body that times out when the client stops sending (sent from
//! memory when it was read before admission), and the response body that holds the lease until its last byte read
//! from the upstream: it returns the connection when the body ends, and when the client leaves early it reads the
//! rest of the response (bounded) so the connection can still be reused. A response small enough to buffer is read
//! in full first and relayed from memory without a lease. It never decides admission or counts connections.

use std::future::Future;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use crate::access::Entry;
use crate::buffer::{self, BufferBudget, Buffered, ReadError};
use crate::error::{Outcome, ProxyError, ShedAdvice};
use crate::metrics::OutcomeCounters;
use crate::pool::{Lease, UploadProgress, UpstreamPool};
use crate::server::activity::InFlight;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removes the hop-by-hop headers of RFC 9110 §7.6.1, including every header the `Connection` field names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = connection_options(headers)
        .filter_map(|option| HeaderName::from_bytes(option).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
}

/// The options of every `Connection` line, read as bytes: a line with a non-ASCII byte still names its other
/// options (reading it as text would drop the whole line, and with it a `close` or a header to strip).
fn connection_options(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
}

/// The host a request is for: the URI's authority (absolute form, HTTP/2 `:authority`) wins over `Host`, as
/// RFC 9112 §3.2.2 asks of a proxy. Routing and the upstream's Host header both use it.
pub fn target_host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    uri.authority()
        .map(|authority| authority.as_str())
        .or_else(|| headers.get(header::HOST).and_then(|host| host.to_str().ok()))
}

/// The request as it goes upstream: HTTP/1.1, origin form, with Host and `X-Forwarded-*`.
pub fn to_upstream(
    request: Request<Incoming>,
    client: &ClientInfo,
    pool: &UpstreamPool,
) -> Result<Request<RequestBody>, ProxyError> {
    let (mut parts, body) = request.into_parts();
    upstream_head(&mut parts, client, &pool.authority)?;
    let body = RequestBody::new(body, pool.limits().body_idle_timeout);
    Ok(Request::from_parts(parts, body))
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
    let host = match (parts.uri.authority(), parts.headers.get(header::HOST)) {
        // RFC 9110 §4.2.4: userinfo in a request target is an error; it must never become the upstream's Host.
        (Some(authority), _) if authority.as_str().contains('@') => return Err(ProxyError::InvalidHost),
        (Some(authority), _) => HeaderValue::from_str(authority.as_str()).map_err(|_| ProxyError::MissingHost)?,
        (None, Some(host)) => host.clone(),
        // HTTP/1.0 had no Host; the upstream still gets one.
        (None, None) if parts.version == Version::HTTP_10 => default_host.clone(),
        (None, None) => return Err(ProxyError::MissingHost),
    };
    // Routing matched the name without its root dot; the upstream is given that name, so it cannot read another.
    let host = match without_root_dot(host.as_bytes()) {
        Some(bare) => HeaderValue::from_bytes(&bare).unwrap_or(host),
        None => host,
    };
    // RFC 9113 §8.2.3 (RFC 9114 §4.2.1 for HTTP/3): a cookie split into fields goes to HTTP/1.1 as one line.
    if matches!(parts.version, Version::HTTP_2 | Version::HTTP_3) {
        join_cookie(&mut parts.headers);
    }
    // A message with both framings is a smuggling attempt's tell; the upstream only ever sees one of them.
    if parts.headers.contains_key(header::TRANSFER_ENCODING) {
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(&mut parts.headers);
    // We answer `Expect: 100-continue` ourselves once admitted (hyper sends 100 when the body is first read).
    parts.headers.remove(header::EXPECT);
    parts.headers.insert(header::HOST, host.clone());
    set_forwarded(&mut parts.headers, client, host);
    parts.uri = origin_form(&parts.uri, &parts.method);
    parts.version = Version::HTTP_11;
    Ok(())
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

fn origin_form(uri: &Uri, method: &Method) -> Uri {
    if method == Method::OPTIONS && uri.path() == "*" {
        return uri.clone();
    }
    match uri.path_and_query().map(|pq| Uri::from(pq.clone())) {
        Some(origin) if origin.path().starts_with('/') => origin,
        // Neither path nor query (`http://host#f` is kept as an empty one, which would print as no target).
        _ => Uri::from_static("/"),
    }
}

fn set_forwarded(headers: &mut HeaderMap, client: &ClientInfo, host: HeaderValue) {
    let previous: Vec<&str> = if client.trusted {
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
    let proto = client.trusted.then(|| one_line(headers, &X_FORWARDED_PROTO)).flatten();
    let scheme = if client.tls { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO, proto.unwrap_or(HeaderValue::from_static(scheme)));
    let forwarded_host = client.trusted.then(|| one_line(headers, &X_FORWARDED_HOST)).flatten();
    headers.insert(X_FORWARDED_HOST, forwarded_host.unwrap_or(host));
    if !client.trusted {
        headers.remove(header::FORWARDED);
    }
}

/// All lines of a field as one, joined by commas as RFC 9110 §5.3 reads them; `None` without any.
fn one_line(headers: &HeaderMap, name: &HeaderName) -> Option<HeaderValue> {
    joined(headers, name, b", ")
}

/// All lines of a field as one, `separator` between them; `None` without any.
fn joined(headers: &HeaderMap, name: &HeaderName, separator: &[u8]) -> Option<HeaderValue> {
    let mut lines = headers.get_all(name).iter();
    let first = lines.next()?.clone();
    lines.try_fold(first, |joined, line| {
        HeaderValue::from_bytes(&[joined.as_bytes(), separator, line.as_bytes()].concat()).ok()
    })
}

/// Cookie is no comma list (RFC 6265 §5.4): its crumbs are joined by `; `.
fn join_cookie(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    if let Some(cookie) = joined(headers, &header::COOKIE, b"; ") {
        headers.insert(header::COOKIE, cookie);
    }
}

/// RFC 9112 §3.2: more than one Host line, or a target host (Host, or the URI's authority that wins over it) that
/// is not a valid `host[:port]`, is a bad request: the proxy would route by one reading of it while the upstream
/// might act on another. A missing Host is decided by [`to_upstream`] (HTTP/1.0 may omit it).
pub fn check_host(uri: &Uri, headers: &HeaderMap) -> Result<(), ProxyError> {
    let authority_ok = uri
        .authority()
        .is_none_or(|authority| valid_authority(authority.as_str().as_bytes()));
    let mut lines = headers.get_all(header::HOST).iter();
    let host_ok = match lines.next() {
        Some(host) => lines.next().is_none() && valid_authority(host.as_bytes()),
        None => true,
    };
    if authority_ok && host_ok {
        Ok(())
    } else {
        Err(ProxyError::InvalidHost)
    }
}

/// A `host[:port]` every reader takes the same way: no userinfo; a port, when there is one, is a 16-bit number
/// (past it, one reader wraps it and another refuses it); a name has no empty label but the root's trailing one.
fn valid_authority(bytes: &[u8]) -> bool {
    let (name, port) = split_port(bytes);
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

/// `host[:port]` split at the port's colon, the first one after an IPv6 literal's `]`.
fn split_port(authority: &[u8]) -> (&[u8], Option<&[u8]>) {
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

/// `host[:port]` less the name's trailing dot, the DNS root's empty label (RFC 1034 §3.1): `a.example.:80` names
/// what `a.example:80` does. `None` when there is none to drop, or nothing of the name would be left.
fn without_root_dot(authority: &[u8]) -> Option<Vec<u8>> {
    let (name, port) = split_port(authority);
    let bare = name.strip_suffix(b".").filter(|bare| !bare.is_empty())?;
    let mut host = bare.to_vec();
    if let Some(port) = port {
        host.push(b':');
        host.extend_from_slice(port);
    }
    Some(host)
}

/// `name` or `name:port` in letters, digits, `.` and `-`: a subset of what [`http::uri::Authority`] accepts.
fn plain_host(bytes: &[u8]) -> bool {
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
/// (`,chunked`) are no coding: RFC 9110 §5.6.1 has recipients ignore them.
pub fn check_transfer_coding(headers: &HeaderMap) -> Result<(), ProxyError> {
    let understood = |coding: &str| {
        coding.is_empty() || coding.eq_ignore_ascii_case("chunked") || coding.eq_ignore_ascii_case("identity")
    };
    let all_understood = headers.get_all(header::TRANSFER_ENCODING).iter().all(|line| {
        line.to_str()
            .is_ok_and(|line| line.split(',').map(str::trim).all(understood))
    });
    if all_understood {
        Ok(())
    } else {
        Err(ProxyError::UnsupportedTransferCoding)
    }
}

/// Whether the upstream keeps the connection open after this response.
pub fn keeps_alive(version: Version, headers: &HeaderMap) -> bool {
    let connection_has =
        |token: &str| connection_options(headers).any(|option| option.eq_ignore_ascii_case(token.as_bytes()));
    match version {
        Version::HTTP_11 => !connection_has("close"),
        Version::HTTP_10 => connection_has("keep-alive") && !connection_has("close"),
        _ => false,
    }
}

/// Fails a body that has made no progress for `timeout`; the timer is only armed while the body waits.
struct IdleTimer {
    timeout: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    progressed: bool,
}

impl IdleTimer {
    fn new(timeout: Duration) -> Self {
        IdleTimer {
            timeout,
            sleep: None,
            progressed: true,
        }
    }

    fn progressed(&mut self) {
        self.progressed = true;
    }

    /// Called when the inner body is pending: true once it has been pending for the whole timeout.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = Instant::now() + self.timeout;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if self.progressed {
            sleep.as_mut().reset(deadline);
            self.progressed = false;
        }
        sleep.as_mut().poll(cx).is_ready()
    }
}

/// The client's request body on its way upstream; fails if the client stops sending for too long.
pub struct RequestBody {
    /// What is still to be read from the client; `None` once all of it is read (or there was none).
    inner: Option<Incoming>,
    /// Read before admission ([`RequestBody::buffer`]): sent before anything still in `inner`.
    buffered: Option<Buffered>,
    /// The body came without a length (chunked): it goes upstream chunked too, buffered or not, so buffering
    /// never changes the framing the upstream reads.
    chunked: bool,
    timer: IdleTimer,
    /// How far the body has gone (see [`UploadProgress`]); only requests that have a body pay for it.
    upload: Option<UploadProgress>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0} sent nothing for {1:?}")]
pub struct BodyStalled(&'static str, Duration);

/// An exchange that failed because the client's request body did (bad chunked framing, cut short, or stalled past
/// body_idle_timeout) failed on the client's side, not the upstream's: 400 or 408, counted as such. hyper reports
/// a failed request body as a user error whose cause is the error [`RequestBody`] yielded.
pub fn client_body_failure(err: &hyper::Error) -> Option<ProxyError> {
    if !err.is_user() {
        return None;
    }
    let cause = std::error::Error::source(err)?;
    if let Some(stalled) = cause.downcast_ref::<BodyStalled>() {
        return Some(ProxyError::ClientBodyTimeout(stalled.1));
    }
    let failed = cause.downcast_ref::<hyper::Error>()?;
    Some(client_body_error(failed))
}

/// What a failure reading the client's body (hyper's own error) means for the client.
fn client_body_error(failed: &hyper::Error) -> ProxyError {
    // The client closed or reset its connection mid-body: it is gone, not malformed.
    let gone = std::error::Error::source(failed)
        .and_then(|io| io.downcast_ref::<std::io::Error>())
        .is_some_and(|io| {
            matches!(
                io.kind(),
                ErrorKind::UnexpectedEof
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
            )
        });
    if gone || failed.is_incomplete_message() {
        ProxyError::ClientGone
    } else {
        ProxyError::ClientBody(failed.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the exchange was cut off: its body made no progress for body_idle_timeout")]
pub struct CutOff;

impl RequestBody {
    pub fn new(inner: Incoming, idle_timeout: Duration) -> Self {
        let upload = (!inner.is_end_stream()).then(UploadProgress::default);
        RequestBody {
            inner: Some(inner),
            buffered: None,
            chunked: false,
            timer: IdleTimer::new(idle_timeout),
            upload,
        }
    }

    pub fn empty() -> Self {
        RequestBody {
            inner: None,
            buffered: None,
            chunked: false,
            timer: IdleTimer::new(Duration::from_secs(1)),
            upload: None,
        }
    }

    /// Reads the body into memory, before the request is admitted, if it fits in `limit`: one with a known
    /// length up to `limit`, or, when `unknown_length` allows, one of unknown length, read until it ends or
    /// `limit` is reached (what was read is then sent first and the rest streams once admitted). Each wait is
    /// bounded by `body_idle_timeout` as when the body streams, and the whole read by `within`, which bounds a
    /// body trickled a byte at a time as `request_timeout` does once admitted. Returns whether all of it is now in
    /// memory. Without room in `budget` nothing is read: the body streams.
    pub async fn buffer(
        &mut self,
        limit: u64,
        unknown_length: bool,
        within: Duration,
        budget: &Arc<BufferBudget>,
    ) -> Result<bool, ProxyError> {
        let Some(inner) = self.inner.as_mut() else {
            return Ok(true);
        };
        if inner.is_end_stream() {
            return Ok(true);
        }
        if limit == 0 {
            return Ok(false);
        }
        let hint = inner.size_hint();
        let wanted = match hint.exact() {
            Some(length) if length <= limit => length,
            None if unknown_length && hint.lower() <= limit => limit,
            _ => return Ok(false),
        };
        let Some(reservation) = budget.reserve(wanted) else {
            return Ok(false);
        };
        let filling = buffer::fill(inner, limit, self.timer.timeout, reservation);
        let buffered = match tokio::time::timeout(within, filling).await {
            Ok(Ok(buffered)) => buffered,
            Err(_) => return Err(ProxyError::ClientTooSlow(within)),
            Ok(Err(ReadError::Stalled(limit))) => return Err(ProxyError::ClientBodyTimeout(limit)),
            Ok(Err(ReadError::Body(err))) => return Err(client_body_error(&err)),
        };
        let complete = buffered.is_complete();
        if complete {
            self.inner = None;
        }
        self.chunked = hint.exact().is_none();
        self.buffered = Some(buffered);
        Ok(complete)
    }

    /// How far the body has gone, for the exchange to look at later; `None` for a request without a body.
    pub fn upload(&self) -> Option<UploadProgress> {
        self.upload.clone()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(buffered) = this.buffered.as_mut() {
            if let Some(frame) = buffered.next_frame(None) {
                let sent = buffered.is_empty() && this.inner.is_none();
                if buffered.is_empty() {
                    this.buffered = None;
                }
                if let Some(upload) = &this.upload {
                    upload.polled(false, sent);
                }
                this.timer.progressed();
                return Poll::Ready(Some(Ok(frame)));
            }
            this.buffered = None;
        }
        let Some(inner) = this.inner.as_mut() else {
            // Nothing was left to read from the client: what was buffered is all of the body.
            if let Some(upload) = &this.upload {
                upload.polled(false, true);
            }
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        if let Some(upload) = &this.upload {
            // hyper stops pulling a body of known length once it reports its end, so the end may never be
            // polled for.
            let sent = matches!(polled, Poll::Ready(None))
                || (matches!(polled, Poll::Ready(Some(Ok(_)))) && inner.is_end_stream());
            upload.polled(polled.is_pending(), sent);
        }
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending if this.timer.expired(cx) => {
                Poll::Ready(Some(Err(BodyStalled("client", this.timer.timeout).into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        // A buffer is dropped once handed on; until then, even an empty one (a chunked body with no data) is still
        // to be sent, as its framing's end.
        self.buffered.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.buffered.as_ref().map_or(0, Buffered::remaining);
        let rest = match &self.inner {
            Some(inner) => inner.size_hint(),
            // hyper frames an upload by its length when the hint is exact and chunked otherwise.
            None if self.chunked => SizeHint::new(),
            None => SizeHint::with_exact(0),
        };
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(held));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}

/// How a request's end is counted once its answer is done with: the one place that counts the outcome and
/// writes the access-log line, for relayed and local answers alike.
pub struct Completion {
    pub counters: Arc<OutcomeCounters>,
    pub status: StatusCode,
    /// Present only while the access log is on; it also counts the body bytes relayed.
    pub access: Option<Box<Entry>>,
}

impl Completion {
    pub fn record(self, outcome: Outcome) {
        let bytes = self.access.as_ref().map_or(0, |entry| entry.relayed_bytes());
        complete(&self.counters, Some(self.status), self.access, outcome, bytes);
    }
}

/// Counts how a request ended and writes its access-log line (when `access` is there): every request the proxy
/// answers, or loses to its client, ends here exactly once.
pub fn complete(
    counters: &OutcomeCounters,
    status: Option<StatusCode>,
    access: Option<Box<Entry>>,
    outcome: Outcome,
    bytes: u64,
) {
    counters.record(outcome, status);
    if let Some(entry) = access {
        entry.write(outcome, status, bytes);
    }
}

/// Where a relayed response body comes from.
enum Source {
    /// The upstream connection, read as the client takes the body; the relay holds the lease until its end.
    Upstream(Incoming),
    /// A body already read in full at upstream speed; its lease was given back before the client got anything.
    /// Boxed: the relay, one per response, stays the size it is for streamed bodies.
    Memory(Box<Buffered>),
}

/// How an exchange's body ended, for what becomes of its connection.
enum Ending {
    /// Read to its end: the connection may be reused.
    Whole,
    /// The upstream's side failed (reset, bad framing): it is done with the request; the connection is closed.
    Failed,
    /// Given up before its end: the upstream may still be working, so the slot waits for it to close.
    GivenUp,
}

/// An upstream response in flight: its body, the lease it holds until the end, and how the end is counted.
struct Relay {
    inner: Option<Source>,
    lease: Option<Lease>,
    completion: Option<Completion>,
    /// Cut off by the stall watchdog: the client is told by an error, not a clean end.
    cut_off: bool,
    /// Largest data frame handed on, if bounded; what is left of a larger one waits in `rest`.
    /// `NonZeroUsize`: half the size of `Option<usize>`, which keeps the relay (one per response) small.
    max_frame: Option<std::num::NonZeroUsize>,
    rest: Option<Bytes>,
    /// A frame read before the head went out (see [`to_client`]), handed on first.
    first: Option<Frame<Bytes>>,
    /// The upstream's failure, handed on one poll after it came (see [`Relay::poll_frame`]).
    failed: Option<BoxError>,
}

/// HTTP/2 asks for the next frame only once the client has room for the last one; small frames make that
/// evidence of progress frequent, so a slow but steady reader is never mistaken for a stalled one.
const WATCHED_FRAME_BYTES: usize = 16 * 1024;

/// hyper takes a frame only when it can queue it for the socket, and queues a few at most. A body held in memory
/// is handed on in pieces of this size, so that it stays counted against `max_buffered_bytes` (and its request
/// open) until the client has taken nearly all of it, instead of vanishing into hyper's queue at once.
const MEMORY_FRAME_BYTES: usize = 16 * 1024;

impl Relay {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.cut_off {
            return Poll::Ready(Some(Err(CutOff.into())));
        }
        if let Some(err) = self.failed.take() {
            return Poll::Ready(Some(Err(err)));
        }
        if let Some(first) = self.first.take() {
            if let (Some(data), Some(entry)) = (
                first.data_ref(),
                self.completion.as_mut().and_then(|done| done.access.as_mut()),
            ) {
                entry.relayed(data.len());
            }
            if self.source_ended() || first.is_trailers() {
                self.finish(Outcome::Ok, true);
            }
            return Poll::Ready(Some(Ok(match first.into_data() {
                Ok(data) => self.bounded(data),
                Err(frame) => frame,
            })));
        }
        if let Some(rest) = self.rest.take() {
            return Poll::Ready(Some(Ok(self.bounded(rest))));
        }
        let inner = match self.inner.as_mut() {
            None => return Poll::Ready(None),
            Some(Source::Memory(memory)) => {
                let max = self.max_frame.map_or(MEMORY_FRAME_BYTES, std::num::NonZeroUsize::get);
                let frame = memory.next_frame(Some(max));
                return Poll::Ready(self.hand_on_from_memory(frame));
            }
            Some(Source::Upstream(inner)) => inner,
        };
        match Pin::new(&mut *inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(entry)) = (
                    frame.data_ref(),
                    self.completion.as_mut().and_then(|done| done.access.as_mut()),
                ) {
                    entry.relayed(data.len());
                }
                // Trailers end a body, though hyper's chunked body says so only when polled once more, which
                // hyper's HTTP/1 server never does: the relay would be dropped unfinished, counted a client abort.
                if inner.is_end_stream() || frame.is_trailers() {
                    // All of the response is read from the upstream: the connection can go back now, whatever
                    // the client still has to take.
                    self.finish(Outcome::Ok, true);
                }
                match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(self.bounded(data)))),
                    Err(frame) => Poll::Ready(Some(Ok(frame))),
                }
            }
            Poll::Ready(Some(Err(err))) => {
                self.finish(Outcome::UpstreamError, false);
                // hyper's HTTP/1 server drops what it has not yet written (the head, the data before this) when a
                // body fails; a poll's pause first lets it flush that, so the client sees an honest cut rather
                // than an empty reply.
                self.failed = Some(err.into());
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Ready(None) => {
                self.finish(Outcome::Ok, true);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// A frame of a body held in memory is counted as handed on; the request ends when the last one is.
    fn hand_on_from_memory(&mut self, frame: Option<Frame<Bytes>>) -> Option<Result<Frame<Bytes>, BoxError>> {
        if let (Some(data), Some(entry)) = (
            frame.as_ref().and_then(Frame::data_ref),
            self.completion.as_mut().and_then(|done| done.access.as_mut()),
        ) {
            entry.relayed(data.len());
        }
        let ended = match &self.inner {
            Some(Source::Memory(memory)) => memory.is_empty(),
            _ => true,
        };
        if ended {
            self.inner = None;
            self.finish(Outcome::Ok, true);
        }
        frame.map(Ok)
    }

    fn bounded(&mut self, mut data: Bytes) -> Frame<Bytes> {
        if let Some(max) = self.max_frame.map(std::num::NonZeroUsize::get) {
            if data.len() > max {
                let head = data.split_to(max);
                self.rest = Some(data);
                return Frame::data(head);
            }
        }
        Frame::data(data)
    }

    fn source_ended(&self) -> bool {
        match &self.inner {
            None => true,
            Some(Source::Upstream(inner)) => inner.is_end_stream(),
            Some(Source::Memory(memory)) => memory.is_empty(),
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.cut_off && self.failed.is_none() && self.first.is_none() && self.rest.is_none() && self.source_ended()
    }

    fn size_hint(&self) -> SizeHint {
        let hint = match &self.inner {
            None => SizeHint::default(),
            Some(Source::Upstream(inner)) => inner.size_hint(),
            Some(Source::Memory(memory)) => SizeHint::with_exact(memory.remaining()),
        };
        let held = self
            .first
            .as_ref()
            .and_then(Frame::data_ref)
            .map_or(0, |data| data.len() as u64);
        if held == 0 {
            return hint;
        }
        let mut with_held = SizeHint::new();
        with_held.set_lower(hint.lower().saturating_add(held));
        if let Some(upper) = hint.upper() {
            with_held.set_upper(upper.saturating_add(held));
        }
        with_held
    }

    /// Counted already: by its end, a cut-off or its client leaving.
    fn is_finished(&self) -> bool {
        self.completion.is_none()
    }

    /// Ends the exchange: the lease goes back (reused or closed) and the outcome is counted, once.
    fn finish(&mut self, outcome: Outcome, reusable: bool) {
        self.end(outcome, if reusable { Ending::Whole } else { Ending::Failed });
    }

    fn end(&mut self, outcome: Outcome, ending: Ending) {
        if let Some(mut lease) = self.lease.take() {
            match ending {
                Ending::Whole => {}
                Ending::Failed => lease.forbid_reuse(),
                Ending::GivenUp => lease.abandon(),
            }
        }
        if let Some(done) = self.completion.take() {
            done.record(outcome);
        }
    }

    /// The stream stopped moving for too long: dropping the unread body makes hyper close the upstream
    /// connection, whose task frees the slot once the upstream, which may still be sending, has closed too.
    fn cut_off(&mut self, outcome: Outcome) {
        self.inner = None;
        self.rest = None;
        self.cut_off = true;
        self.end(outcome, Ending::GivenUp);
    }

    /// The answer was dropped before its end. An empty body (HEAD, 204, 304) is complete; otherwise the client
    /// left mid-body, and what is left is handed back for draining.
    fn abandon(&mut self) -> Option<(Incoming, Lease)> {
        // Already finished (or cut off): nothing is left to count or drain.
        if self.is_finished() {
            return None;
        }
        if self.is_end_stream() {
            self.finish(Outcome::Ok, true);
            return None;
        }
        if let Some(done) = self.completion.take() {
            done.record(Outcome::ClientAbort);
        }
        match (self.inner.take(), self.lease.take()) {
            (Some(Source::Upstream(body)), Some(lease)) => Some((body, lease)),
            (_, lease) => {
                if let Some(mut lease) = lease {
                    lease.forbid_reuse();
                }
                None
            }
        }
    }
}

/// A relay an outside watchdog can cut off: an HTTP/2 client can stop reading one stream without blocking its
/// socket, and hyper then stops polling that stream's body, so no timer inside the body would ever run.
struct Watched {
    relay: Mutex<Relay>,
    epoch: Instant,
    /// Milliseconds since `epoch` of the last time hyper asked for more (it asks once the client has room).
    progress_ms: AtomicU64,
    /// The body is waiting on the upstream, not on the client: that stall is the body's own timer's to judge.
    awaiting_upstream: AtomicBool,
    ended: Notify,
}

impl Watched {
    fn relay(&self) -> MutexGuard<'_, Relay> {
        self.relay.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

async fn watch_for_stall(watched: Arc<Watched>, limit: Duration) {
    let mut deadline = Instant::now() + limit;
    loop {
        tokio::select! {
            _ = watched.ended.notified() => return,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let due = watched.epoch + Duration::from_millis(watched.progress_ms.load(Ordering::Acquire)) + limit;
        let now = Instant::now();
        if due > now {
            deadline = due;
            continue;
        }
        if watched.awaiting_upstream.load(Ordering::Acquire) {
            deadline = now + limit;
            continue;
        }
        let mut relay = watched.relay();
        if !relay.is_finished() {
            relay.cut_off(Outcome::ClientAbort);
        }
        return;
    }
}

// One per response and moved only at its start; boxing the relay would add an allocation to every request.
#[allow(clippy::large_enum_variant)]
enum RelayHandle {
    Owned(Relay),
    Watched(Arc<Watched>),
}

impl RelayHandle {
    fn with_mut<R>(&mut self, f: impl FnOnce(&mut Relay) -> R) -> R {
        match self {
            RelayHandle::Owned(relay) => f(relay),
            RelayHandle::Watched(watched) => f(&mut watched.relay()),
        }
    }

    fn read<R>(&self, f: impl FnOnce(&Relay) -> R) -> R {
        match self {
            RelayHandle::Owned(relay) => f(relay),
            RelayHandle::Watched(watched) => f(&watched.relay()),
        }
    }

    /// The watchdog has nothing left to watch.
    fn unwatch(&self) {
        if let RelayHandle::Watched(watched) = self {
            watched.ended.notify_one();
        }
    }
}

/// An upstream response body in flight, holding the lease until its end.
pub struct UpstreamBody {
    relay: RelayHandle,
    timer: IdleTimer,
}

impl UpstreamBody {
    /// `watch`: also cut the exchange off when the client stops taking the body (HTTP/2 streams).
    pub fn new(inner: Incoming, lease: Lease, completion: Completion, watch: bool) -> Self {
        let idle_timeout = lease.pool().limits().body_idle_timeout;
        Self::relaying(Source::Upstream(inner), Some(lease), completion, watch, idle_timeout)
    }

    /// A frame read ahead of the body, to be handed on before the rest.
    pub fn starting_with(mut self, first: Option<Frame<Bytes>>) -> Self {
        if first.is_some() {
            self.relay.with_mut(|relay| relay.first = first);
        }
        self
    }

    /// A body already read in full: no lease is held; an HTTP/2 stream that stops taking it is still cut off
    /// after `idle_timeout`, which gives its memory back.
    pub fn buffered(body: Buffered, completion: Completion, watch: bool, idle_timeout: Duration) -> Self {
        Self::relaying(Source::Memory(Box::new(body)), None, completion, watch, idle_timeout)
    }

    fn relaying(
        inner: Source,
        lease: Option<Lease>,
        completion: Completion,
        watch: bool,
        idle_timeout: Duration,
    ) -> Self {
        let relay = Relay {
            inner: Some(inner),
            lease,
            completion: Some(completion),
            cut_off: false,
            max_frame: watch
                .then(|| std::num::NonZeroUsize::new(WATCHED_FRAME_BYTES))
                .flatten(),
            rest: None,
            first: None,
            failed: None,
        };
        let relay = if watch && !relay.is_end_stream() {
            let watched = Arc::new(Watched {
                relay: Mutex::new(relay),
                epoch: Instant::now(),
                progress_ms: AtomicU64::new(0),
                awaiting_upstream: AtomicBool::new(false),
                ended: Notify::new(),
            });
            tokio::spawn(watch_for_stall(watched.clone(), idle_timeout));
            RelayHandle::Watched(watched)
        } else {
            RelayHandle::Owned(relay)
        };
        UpstreamBody {
            relay,
            timer: IdleTimer::new(idle_timeout),
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = match &mut this.relay {
            RelayHandle::Owned(relay) => relay.poll_frame(cx),
            RelayHandle::Watched(watched) => {
                watched.progress_ms.store(watched.now_ms(), Ordering::Release);
                let (polled, finished) = {
                    let mut relay = watched.relay();
                    let polled = relay.poll_frame(cx);
                    (polled, relay.is_finished())
                };
                watched.awaiting_upstream.store(polled.is_pending(), Ordering::Release);
                if finished {
                    watched.ended.notify_one();
                }
                polled
            }
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.timer.progressed();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending if this.timer.expired(cx) => {
                let limit = this.timer.timeout;
                this.relay.with_mut(|relay| relay.cut_off(Outcome::UpstreamTimeout));
                this.relay.unwatch();
                Poll::Ready(Some(Err(BodyStalled("upstream", limit).into())))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.relay.read(Relay::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.relay.read(Relay::size_hint)
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        self.relay.unwatch();
        let abandoned = self.relay.with_mut(Relay::abandon);
        let Some((body, lease)) = abandoned else { return };
        // The client left mid-body. Dropping the connection now would leave the upstream working on the old
        // request while a replacement brings new work; read the rest instead, on the upstream side, and keep the
        // connection.
        let pool = lease.pool().clone();
        pool.spawn(drain_then_release(body, lease));
    }
}

async fn drain_then_release(mut body: Incoming, mut lease: Lease) {
    let limits = lease.pool().limits();
    let (max_bytes, limit) = (limits.abort_drain_bytes, limits.abort_drain_timeout);
    let drained = tokio::time::timeout(limit, async {
        let mut read: u64 = 0;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                    if read > max_bytes {
                        return Ending::GivenUp;
                    }
                }
                Err(_) => return Ending::Failed,
            }
        }
        Ending::Whole
    })
    .await;
    match drained.unwrap_or(Ending::GivenUp) {
        Ending::Whole => {}
        Ending::Failed => lease.forbid_reuse(),
        Ending::GivenUp => lease.abandon(),
    }
    // The body first: a connection whose response is still open must not go back to the pool.
    drop(body);
    drop(lease);
}

/// The body of every answer floodgate sends: the upstream's, or a short one of its own.
pub struct ResponseBody {
    kind: Kind,
    /// Ends the request's in-flight period on its client connection when the answer is done with.
    _in_flight: Option<InFlight>,
}

// As for `RelayHandle`: a local answer is rare, and the upstream's body is not worth an allocation to shrink it.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Upstream(UpstreamBody),
    Local(Option<Bytes>),
}

impl ResponseBody {
    pub fn upstream(body: UpstreamBody) -> Self {
        ResponseBody {
            kind: Kind::Upstream(body),
            _in_flight: None,
        }
    }

    pub fn local(text: &'static str) -> Self {
        ResponseBody {
            kind: Kind::Local(Some(Bytes::from_static(text.as_bytes()))),
            _in_flight: None,
        }
    }

    pub fn tracked(mut self, in_flight: InFlight) -> Self {
        self._in_flight = Some(in_flight);
        self
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            Kind::Upstream(body) => Pin::new(body).poll_frame(cx),
            Kind::Local(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Upstream(body) => body.is_end_stream(),
            Kind::Local(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Upstream(body) => body.size_hint(),
            Kind::Local(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}

/// Names why a request was shed, in the words of the metrics' outcomes (`queue_full`, `queue_timeout`,
/// `overload`, `deadline`, `quota`), for clients and load balancers that act on the reason.
pub const SHED_REASON: HeaderName = HeaderName::from_static("x-floodgate-shed-reason");

/// A plain-text answer of floodgate's own; `advice` is the upstream's, for a shed request.
pub fn local_response(error: &ProxyError, advice: Option<&ShedAdvice>) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::local(error.reason()));
    *response.status_mut() = error.status_with(advice);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if error.asks_for_retry() {
        let seconds = advice.map_or(1, |advice| advice.retry_after_secs.max(1));
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if let Some(shed) = error.shed() {
        headers.insert(SHED_REASON, HeaderValue::from_static(shed.as_str()));
    }
    response
}

/// How long a streamed response's first chunk is waited for before its head goes out: long enough for one that
/// arrived with the head, short enough not to hold back a stream whose first event comes later.
const FIRST_FRAME_WAIT: Duration = Duration::from_millis(1);

/// Why a response head cannot be passed on, if it cannot: its framing is ambiguous (RFC 9112 §6.3: a message with
/// both is a smuggling or splitting attempt, to be handled as an error; an invalid Content-Length is an
/// unrecoverable error, a 502 for a proxy), its content coded in a way it cannot declare to the client, or it
/// switches protocols when nothing asked it to (floodgate forwards no upgrade). A Content-Length that lists one
/// number several times goes on as that number (RFC 9110 §8.6).
fn malformed(parts: &mut http::response::Parts) -> Option<&'static str> {
    if parts.status == StatusCode::SWITCHING_PROTOCOLS {
        return Some("101 Switching Protocols to a request that asked for no upgrade");
    }
    if parts.headers.contains_key(header::TRANSFER_ENCODING) && parts.headers.contains_key(header::CONTENT_LENGTH) {
        return Some("both Content-Length and Transfer-Encoding");
    }
    // Transfer-Encoding is hop-by-hop and stops here: content in a coding hyper does not decode (gzip) would reach
    // the client as if it had none.
    if check_transfer_coding(&parts.headers).is_err() {
        return Some("a transfer coding other than chunked");
    }
    // hyper checks it only where it frames the body: HEAD, 204 and 304 answers would carry it on as it came.
    match content_length(&parts.headers) {
        ContentLength::Plain => None,
        ContentLength::Repeated(length) => {
            parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
            None
        }
        ContentLength::Invalid => Some("an invalid Content-Length"),
    }
}

enum ContentLength {
    /// None, or one line of digits: passed on as it is.
    Plain,
    /// One number, given more than once.
    Repeated(u64),
    Invalid,
}

fn content_length(headers: &HeaderMap) -> ContentLength {
    let mut lines = headers.get_all(header::CONTENT_LENGTH).iter();
    let digits = |value: &[u8]| !value.is_empty() && value.iter().all(u8::is_ascii_digit);
    match (lines.next(), lines.next()) {
        (None, _) => return ContentLength::Plain,
        // 19 digits always fit a u64: the common case needs no parsing.
        (Some(line), None) if line.len() <= 19 && digits(line.as_bytes()) => return ContentLength::Plain,
        _ => {}
    }
    let mut length = None;
    for value in headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .flat_map(|line| line.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
    {
        let number = std::str::from_utf8(value)
            .ok()
            .filter(|_| digits(value))
            .and_then(|digits| digits.parse::<u64>().ok());
        match (number, length) {
            (Some(number), None) => length = Some(number),
            (Some(number), Some(before)) if number == before => {}
            _ => return ContentLength::Invalid,
        }
    }
    length.map_or(ContentLength::Invalid, ContentLength::Repeated)
}

/// Turns the upstream's response into the client's, deciding whether the connection may be reused. A body whose
/// Content-Length is within the upstream's `buffer_response_bytes` (and fits the global bound) is read in full
/// first, at the upstream's speed, and the lease given back before the client is sent anything: a slow client
/// then holds memory, never a slot. Any other body streams, holding the lease until its last byte. A failure while
/// buffering is answered by the caller (nothing has reached the client yet), with the access entry handed back.
pub async fn to_client(
    response: Response<Incoming>,
    mut lease: Lease,
    counters: Arc<OutcomeCounters>,
    access: Option<Box<Entry>>,
    watch: bool,
    budget: &Arc<BufferBudget>,
) -> Result<Response<ResponseBody>, (ProxyError, Option<Box<Entry>>)> {
    let (mut parts, mut body) = response.into_parts();
    if let Some(malformed) = malformed(&mut parts) {
        // Nothing has reached the client yet: it gets a 502, not a response that lies about itself.
        lease.forbid_reuse();
        return Err((ProxyError::UpstreamMalformed(malformed), access));
    }
    if !keeps_alive(parts.version, &parts.headers) {
        lease.forbid_reuse();
    }
    strip_hop_by_hop(&mut parts.headers);
    parts.version = Version::HTTP_11;
    let completion = Completion {
        counters,
        status: parts.status,
        access,
    };
    let limits = lease.pool().limits();
    let (limit, idle_timeout) = (limits.buffer_response_bytes, limits.body_idle_timeout);
    drop(limits);
    // An empty body (HEAD, 204, 304) ends the exchange as soon as the answer is sent; unknown lengths may be
    // streams of events, which must not wait for a buffer to fill.
    let length = body.size_hint().exact().filter(|&length| length <= limit);
    let reservation = match length {
        Some(length) if !body.is_end_stream() => budget.reserve(length),
        _ => None,
    };
    let Some(reservation) = reservation else {
        // Streamed: a first chunk that is already here is looked at before the head goes out, so that a body
        // broken from its first byte is a 502 rather than a head followed by nothing.
        let first = match tokio::time::timeout(FIRST_FRAME_WAIT, body.frame()).await {
            Ok(Some(Err(err))) => {
                lease.forbid_reuse();
                return Err((ProxyError::Upstream(err), completion.access));
            }
            Ok(Some(Ok(frame))) => Some(frame),
            Ok(None) | Err(_) => None,
        };
        let streamed = UpstreamBody::new(body, lease, completion, watch).starting_with(first);
        return Ok(Response::from_parts(parts, ResponseBody::upstream(streamed)));
    };
    // One byte past the length: the read then ends at the body's end, never at the limit.
    let read = buffer::fill(&mut body, limit.saturating_add(1), idle_timeout, reservation).await;
    // The body first: a connection whose response is still open must not go back to the pool.
    match &read {
        Ok(buffered) if buffered.is_complete() => {}
        // Failed on the upstream's side: it is done with the request.
        Err(ReadError::Body(_)) => lease.forbid_reuse(),
        // Stalled, or going on past its length: the upstream may still be sending.
        _ => lease.abandon(),
    }
    drop(body);
    drop(lease);
    let failed = match read {
        Ok(buffered) if buffered.is_complete() => {
            let body = UpstreamBody::buffered(buffered, completion, watch, idle_timeout);
            return Ok(Response::from_parts(parts, ResponseBody::upstream(body)));
        }
        // hyper ends a body at its Content-Length; this would be a body going on past it.
        Ok(_) => ProxyError::UpstreamBodyTooLong,
        Err(ReadError::Stalled(limit)) => ProxyError::UpstreamTimeout(limit),
        Err(ReadError::Body(err)) => ProxyError::Upstream(err),
    };
    Err((failed, completion.access))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_host_is_one_that_authority_parsing_accepts_too() {
        for host in [
            "app.example",
            "app.example:8080",
            "a-b.c",
            "10.0.0.1:1",
            "x:65535",
            "x:0",
        ] {
            assert!(plain_host(host.as_bytes()), "{host}");
            assert!(http::uri::Authority::try_from(host.as_bytes()).is_ok(), "{host}");
        }
        for host in ["", "a:b:c", "host:", ":80", "[::1]:80", "a_b", "h\u{e9}", "a@b"] {
            assert!(!plain_host(host.as_bytes()), "{host}");
        }
    }

    #[test]
    fn a_target_host_has_a_16_bit_port_and_no_empty_label_but_the_root() {
        for host in [
            "app.example",
            "app.example.",
            "app.example.:8080",
            "x:65535",
            "x:0",
            "x:",
            "[::1]",
            "[::1]:443",
            "a!b",
        ] {
            assert!(valid_authority(host.as_bytes()), "{host}");
        }
        for host in [
            "",
            "host:99999999",
            "x:65536",
            "x:+80",
            "x:8o",
            "[::1]:70000",
            "[::1].",
            ".",
            ".:80",
            ":80",
            "a..b",
            ".a",
            "a..",
            "user@a",
            "a b",
        ] {
            assert!(!valid_authority(host.as_bytes()), "{host}");
        }
    }

    #[test]
    fn the_root_dot_is_dropped_from_the_name_and_the_port_kept() {
        let dropped = |host: &str| without_root_dot(host.as_bytes()).map(|h| String::from_utf8_lossy(&h).into_owned());
        assert_eq!(dropped("a.example.").as_deref(), Some("a.example"));
        assert_eq!(dropped("A.Example.:8080").as_deref(), Some("A.Example:8080"));
        assert_eq!(dropped("a.example"), None);
        assert_eq!(dropped("a.example:80"), None);
        assert_eq!(dropped("[::1]:80"), None);
        assert_eq!(dropped("."), None);
    }

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert(KEEP_ALIVE, HeaderValue::from_static("timeout=5"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn the_uri_authority_wins_over_host_and_host_is_the_fallback() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("spoofed.example"));
        let absolute: Uri = "http://real.example:8080/x".parse().unwrap();
        assert_eq!(target_host(&absolute, &headers), Some("real.example:8080"));
        let origin: Uri = "/x".parse().unwrap();
        assert_eq!(target_host(&origin, &headers), Some("spoofed.example"));
        assert_eq!(target_host(&origin, &HeaderMap::new()), None);
    }

    #[test]
    fn a_content_length_is_one_number_however_often_it_is_given() {
        let length = |lines: &[&'static str]| {
            let mut headers = HeaderMap::new();
            for line in lines {
                headers.append(header::CONTENT_LENGTH, HeaderValue::from_static(line));
            }
            match content_length(&headers) {
                ContentLength::Plain => Some(None),
                ContentLength::Repeated(length) => Some(Some(length)),
                ContentLength::Invalid => None,
            }
        };
        assert_eq!(length(&[]), Some(None));
        assert_eq!(length(&["42"]), Some(None));
        assert_eq!(length(&["42, 42"]), Some(Some(42)));
        assert_eq!(length(&["42", "42"]), Some(Some(42)));
        assert_eq!(length(&["18446744073709551615"]), Some(Some(u64::MAX)));
        for invalid in [
            &["3", "5"][..],
            &["3, 5"],
            &["abc"],
            &["+3"],
            &[""],
            &["3,"],
            &["18446744073709551616"],
        ] {
            assert_eq!(length(invalid), None, "{invalid:?}");
        }
    }

    #[test]
    fn keep_alive_follows_version_and_connection_header() {
        let mut headers = HeaderMap::new();
        assert!(keeps_alive(Version::HTTP_11, &headers));
        assert!(!keeps_alive(Version::HTTP_10, &headers));
        headers.insert(header::CONNECTION, HeaderValue::from_static("Close"));
        assert!(!keeps_alive(Version::HTTP_11, &headers));
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(keeps_alive(Version::HTTP_10, &headers));
    }
}
