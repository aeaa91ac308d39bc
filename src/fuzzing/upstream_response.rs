//! The `upstream_response` target: the input is what an upstream writes back to a request (then it closes its
//! side), relayed by a whole proxy to an HTTP/1 client three times: a GET through an upstream that buffers
//! small bodies, a GET through one that streams every body, and a HEAD.
//!
//! What the client gets must be a response head, never a `101`, never with both `Content-Length` and
//! `Transfer-Encoding`, and then either its whole body as framed or an honest cut (closed short, no last chunk), never
//! more, and a `204` without `Content-Length`. An upstream head hyper cannot read, a `101`, both framings, a
//! Content-Length that is not one number, a transfer coding other than chunked or chunked twice is a `502`. A plain,
//! complete upstream message arrives with its status and body intact; a truncated one never arrives whole. Each request
//! is counted once: `ok` only for a whole answer, `upstream_error`/`upstream_timeout` for a `502`, `504` or a cut.

use super::upstream_oracle::{dechunk, decode, digits, find, values, Chunked, Expect, MAX_HEADERS};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::config::{Config, Overrides};
use crate::error::Outcome;
use crate::forward::ClientInfo;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::reload::Plan;
use crate::upstream_lane::UpstreamLane;

/// What both upstreams share. The timeouts bound what a hang would cost; nothing here waits on them.
const LIMITS: &str = r#"url = "http://UPSTREAM"
max_connections = 8
request_timeout = "2s"
body_idle_timeout = "2s"
connect_timeout = "2s"
abort_drain_timeout = "300ms"
close_timeout = "300ms""#;

/// `buffered` reads a body of up to 64 KiB before the head goes out (the default), `streamed` none: both ways of
/// relaying a body see every input.
const UPSTREAMS: &str = r#"
[upstreams.buffered]
LIMITS
[upstreams.streamed]
LIMITS
buffer_response_bytes = 0
[[routes]]
path_prefix = "/s/"
upstream = "streamed"
[[routes]]
upstream = "buffered"
"#;

/// The requests each input answers, in order: what the client writes, and whether it is a HEAD.
const REQUESTS: [(&[u8], bool); 3] = [
    (b"GET /x HTTP/1.1\r\nHost: app\r\n\r\n", false),
    (b"GET /s/x HTTP/1.1\r\nHost: app\r\n\r\n", false),
    (b"HEAD /s/x HTTP/1.1\r\nHost: app\r\n\r\n", true),
];

/// An exchange that has not ended by then is stuck; one not counted by then never will be.
const STUCK_AFTER: Duration = Duration::from_secs(10);
/// How long the upstream waits for floodgate to close a connection it has answered.
const UPSTREAM_LINGER: Duration = Duration::from_secs(2);

/// floodgate's own answers to an upstream that failed, with how they are counted.
const LOCAL_ANSWERS: [(u16, &[u8], Outcome); 2] = [
    (502, b"upstream error\n", Outcome::UpstreamError),
    (504, b"upstream timeout\n", Outcome::UpstreamTimeout),
];

struct Fixture {
    runtime: tokio::runtime::Runtime,
    proxy: Arc<Proxy>,
    client: Arc<ClientInfo>,
    /// What the upstream writes to the next request that reaches it.
    answer: Arc<Mutex<Arc<[u8]>>>,
}

/// Built once per process: a runtime, the upstream's listener and its task, the proxy in front of it, and the
/// proxy's upstream lane, spawned here since nothing admitted reaches the upstream without it.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = super::runtime();
        let answer: Arc<Mutex<Arc<[u8]>>> = Arc::new(Mutex::new(Arc::from(&b""[..])));
        let proxy = runtime.block_on(async {
            let listener = match TcpListener::bind("127.0.0.1:0").await {
                Ok(listener) => listener,
                Err(err) => panic!("cannot bind the upstream: {err}"),
            };
            let address = match listener.local_addr() {
                Ok(address) => address,
                Err(err) => panic!("the upstream has no address: {err}"),
            };
            tokio::spawn(upstream(listener, answer.clone()));
            let proxy = Arc::new(proxy_for(address));
            tokio::spawn(proxy.lane().run());
            proxy
        });
        let peer = SocketAddr::from(([192, 0, 2, 7], 40000));
        let client = Arc::new(ClientInfo::new(peer, false, None));
        Fixture {
            runtime,
            proxy,
            client,
            answer,
        }
    })
}

fn proxy_for(upstream: SocketAddr) -> Proxy {
    let toml = UPSTREAMS
        .replace("LIMITS", LIMITS)
        .replace("UPSTREAM", &upstream.to_string());
    let config = match Config::load_toml(&toml, "upstream_response upstreams", &Overrides::default()) {
        Ok(config) => config,
        Err(err) => panic!("the fixture's config is refused: {err}"),
    };
    let metrics = Arc::new(Metrics::new());
    let lane = UpstreamLane::new();
    let router = match Plan::starting(&config, &metrics, &lane) {
        Ok(router) => router,
        Err(problem) => panic!("the fixture's configuration is refused: {problem}"),
    };
    Proxy::new(router, metrics, config.trusted_proxies.clone(), lane)
}

/// Answers every connection's first request head with the current answer, then closes its sending side.
async fn upstream(listener: TcpListener, answer: Arc<Mutex<Arc<[u8]>>>) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(answer_one(stream, answer.clone()));
    }
}

async fn answer_one(mut stream: TcpStream, answer: Arc<Mutex<Arc<[u8]>>>) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while find(&seen, b"\r\n\r\n").is_none() {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => seen.extend_from_slice(buf.get(..n).unwrap_or_default()),
        }
    }
    let bytes = answer.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
    if stream.write_all(&bytes).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    // Until floodgate closes too, so that its close is a FIN, never a reset over unread bytes.
    let _ = tokio::time::timeout(UPSTREAM_LINGER, async {
        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// `bytes` as the upstream's answer to each request of [`REQUESTS`], each from a client of its own.
pub fn upstream_response(bytes: &[u8]) {
    let fixture = fixture();
    *fixture.answer.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::from(bytes);
    for (request, head) in REQUESTS {
        let what = String::from_utf8_lossy(request.split(|&b| b == b'\r').next().unwrap_or_default()).into_owned();
        let before = counted(&fixture.proxy);
        let got = fixture.runtime.block_on(async {
            match tokio::time::timeout(STUCK_AFTER, exchange(&fixture.proxy, &fixture.client, request)).await {
                Ok(got) => got,
                Err(_) => panic!("{what}: the exchange is stuck after {STUCK_AFTER:?}"),
            }
        });
        let outcome = fixture.runtime.block_on(outcome_since(&fixture.proxy, &before, &what));
        let got = Got::read(&got, head, &what);
        check(&what, &decode(bytes, head), &got, outcome);
    }
}

/// Serves `request` the way a floodgate listener does, from a client that then closes its sending side; all the
/// client receives until the connection ends.
async fn exchange(proxy: &Arc<Proxy>, client: &Arc<ClientInfo>, request: &[u8]) -> Vec<u8> {
    let (mut socket, server_side) = tokio::io::duplex(64 * 1024);
    let service = service_fn(|request| {
        let (proxy, client) = (proxy.clone(), client.clone());
        async move { Ok::<_, Infallible>(proxy.serve(request.map(crate::body::ClientBody::Hyper), client).await) }
    });
    // As `server::connection` builds it; half-closing lets the answer go out after the client's FIN.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true)
        .half_close(true);
    let connection = builder.serve_connection(TokioIo::new(server_side), service);
    let client_side = async {
        let mut got = Vec::new();
        if socket.write_all(request).await.is_ok() {
            let _ = socket.shutdown().await;
        }
        let _ = socket.read_to_end(&mut got).await;
        got
    };
    let (_, got) = tokio::join!(connection, client_side);
    got
}

/// Requests counted so far under each outcome, over both upstreams; the client side's refusals must not move.
fn counted(proxy: &Proxy) -> Vec<u64> {
    let mut counts = vec![0; Outcome::ALL.len()];
    let router = proxy.router();
    let client_side = proxy.metrics.client_side_counters();
    for counters in router
        .pools()
        .values()
        .map(|pool| &*pool.metrics.requests)
        .chain([client_side])
    {
        for (outcome, total) in counters.totals() {
            if let Some(count) = counts.get_mut(outcome.index()) {
                *count += total;
            }
        }
    }
    counts
}

/// The one outcome counted since `before`; it may be counted a moment after the client's connection ends.
async fn outcome_since(proxy: &Proxy, before: &[u64], what: &str) -> Outcome {
    let started = tokio::time::Instant::now();
    loop {
        let now = counted(proxy);
        let new: Vec<(Outcome, u64)> = Outcome::ALL
            .iter()
            .zip(now.iter().zip(before))
            .filter(|(_, (now, before))| now > before)
            .map(|(outcome, (now, before))| (*outcome, now - before))
            .collect();
        match new.as_slice() {
            [] if started.elapsed() < STUCK_AFTER => tokio::time::sleep(Duration::from_millis(1)).await,
            [] => panic!("{what}: the request was never counted"),
            [(outcome, 1)] => return *outcome,
            more => panic!("{what}: one request counted as {more:?}"),
        }
    }
}

/// How a response's body reached the client.
#[derive(Debug, PartialEq)]
enum Body {
    /// HEAD, 204, 304: no body, and none followed.
    Empty,
    /// All of it as its framing announced, then a clean end.
    Whole(Vec<u8>),
    /// Less than announced, then the connection closed.
    Cut,
}

/// What the client got, read with the parser hyper uses, with the rules every answer must keep checked on the way.
#[derive(Debug)]
struct Got {
    status: u16,
    /// Its Content-Length: a HEAD's answer has no body to tell floodgate's own from the upstream's by.
    length: Option<u64>,
    body: Body,
}

impl Got {
    fn read(bytes: &[u8], head: bool, what: &str) -> Got {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let head_len = match response.parse(bytes) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => panic!("{what}: the client got no response head, only {}", show(bytes)),
            Err(err) => panic!("{what}: the client got a head it cannot read ({err}): {}", show(bytes)),
        };
        let status = response.code.unwrap_or(0);
        assert!(status >= 200, "{what}: the client got a {status}: {}", show(bytes));
        let lengths = values(response.headers, "content-length");
        let codings = values(response.headers, "transfer-encoding");
        assert!(
            lengths.is_empty() || codings.is_empty(),
            "{what}: the client got both Content-Length and Transfer-Encoding: {}",
            show(bytes)
        );
        // The upstream's hop-by-hop headers are its connection's, never the client's.
        for name in ["keep-alive", "proxy-connection", "te", "trailer", "upgrade"] {
            assert!(
                values(response.headers, name).is_empty(),
                "{what}: the client got {name}: {}",
                show(bytes)
            );
        }
        // RFC 9110 §8.6: a 204 never states a length, whatever its upstream did.
        assert!(
            status != 204 || lengths.is_empty(),
            "{what}: the client got a 204 with Content-Length: {}",
            show(bytes)
        );
        let rest = bytes.get(head_len..).unwrap_or_default();
        let length = match lengths.as_slice() {
            [] => None,
            [length] => {
                Some(digits(length).unwrap_or_else(|| panic!("{what}: the client got Content-Length {}", show(length))))
            }
            _ => panic!("{what}: the client got Content-Length {lengths:?}"),
        };
        let body = if head || status == 204 || status == 304 {
            assert!(
                rest.is_empty(),
                "{what}: {} bytes follow a {status} that has no body: {}",
                rest.len(),
                show(bytes)
            );
            Body::Empty
        } else {
            match (length, codings.as_slice()) {
                (Some(length), []) => match (rest.len() as u64).cmp(&length) {
                    std::cmp::Ordering::Equal => Body::Whole(rest.to_vec()),
                    std::cmp::Ordering::Less => Body::Cut,
                    std::cmp::Ordering::Greater => panic!(
                        "{what}: {} body bytes after Content-Length {length}: {}",
                        rest.len(),
                        show(bytes)
                    ),
                },
                (None, [coding]) if coding.eq_ignore_ascii_case(b"chunked") => match dechunk(rest) {
                    Chunked::Whole { data, end } if end == rest.len() => Body::Whole(data),
                    Chunked::Whole { end, .. } => panic!(
                        "{what}: {} bytes follow the chunked body: {}",
                        rest.len() - end,
                        show(bytes)
                    ),
                    Chunked::Partial => Body::Cut,
                    Chunked::Malformed => panic!("{what}: the client got a malformed chunked body: {}", show(bytes)),
                },
                // Without either, a cut would look like the end: the client could not tell a lie from the truth.
                _ => panic!(
                    "{what}: the client got a {status} framed by neither one Content-Length nor chunked: {}",
                    show(bytes)
                ),
            }
        };
        Got { status, length, body }
    }

    /// floodgate's own answer to a failed upstream, and how it is counted.
    fn local(&self) -> Option<Outcome> {
        LOCAL_ANSWERS
            .iter()
            .find(|(status, text, _)| {
                self.status == *status
                    && match &self.body {
                        Body::Empty => self.length == Some(text.len() as u64),
                        body => *body == Body::Whole(text.to_vec()),
                    }
            })
            .map(|(_, _, outcome)| *outcome)
    }
}

/// The rules linking the upstream's bytes, what the client got, and how the request was counted.
fn check(what: &str, expect: &Expect, got: &Got, outcome: Outcome) {
    let upstream_failed = matches!(outcome, Outcome::UpstreamError | Outcome::UpstreamTimeout);
    match got.local() {
        // The upstream may have answered with floodgate's very words itself.
        Some(local) => assert!(
            outcome == local || (outcome == Outcome::Ok && expect.status() == Some(got.status)),
            "{what}: floodgate's own {} counted as {outcome:?}",
            got.status
        ),
        None if got.body == Body::Cut => assert!(upstream_failed, "{what}: a cut counted as {outcome:?}"),
        None => assert!(
            outcome == Outcome::Ok,
            "{what}: a whole {} relayed, counted as {outcome:?}",
            got.status
        ),
    }
    match expect {
        Expect::BadGateway(why) => assert!(
            got.status == 502 && got.local().is_some(),
            "{what}: {why}, yet the client got {got:?}"
        ),
        Expect::Whole { status, body } => {
            let body = body.clone().map_or(Body::Empty, Body::Whole);
            assert!(
                got.status == *status && got.body == body,
                "{what}: a whole {status} with {body:?} reached the client as {got:?}"
            );
        }
        Expect::Truncated { status } => assert!(
            got.local().is_some() || (got.status == *status && got.body == Body::Cut),
            "{what}: a truncated {status} reached the client as {got:?}"
        ),
        Expect::Undecided { .. } => {}
    }
}

/// Bytes for a failure message: lossy text, cut at 600 characters.
fn show(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let shown: String = text.chars().take(600).collect();
    if shown.len() < text.len() {
        format!("{shown:?}… ({} bytes)", bytes.len())
    } else {
        format!("{shown:?}")
    }
}
