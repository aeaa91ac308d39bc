//! Shared helpers for floodgate's integration tests.
//!
//! * [`Upstream`]: a hyper HTTP/1.1 origin server that counts its TCP
//!   connections and requests exactly and whose behaviour is chosen by path.
//! * [`Proxy`]: launches the `floodgate` binary on ephemeral ports and talks to
//!   its admin listener.
//! * Clients: [`H1Conn`] / [`H2Conn`] (hyper client connections) and
//!   [`RawConn`] (bytes on a TCP socket, for malformed requests).
//! * [`wait_until`]: poll a condition with a deadline (tests never sleep to
//!   synchronise).
//! * [`pki`]: a CA and certificates made at test time, TLS clients, and the
//!   check that a configuration is refused naming its key.
//!
//! Every test binary uses a different subset of this module.
#![allow(dead_code)]

pub mod chaos;
pub mod flood;
pub mod pki;
pub mod scripted;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Request body type used by the test clients.
pub type TestBody = BoxBody<Bytes, BoxError>;
/// Response body type used by the test upstream.
type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// Default deadline for a single client exchange; a hang fails the test
/// instead of hanging the suite.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------
// Polling helpers
// ---------------------------------------------------------------------------

/// Polls `cond` every 10 ms until it returns true; panics naming `what` when
/// `timeout` passes first.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`wait_until`] with a synchronous condition.
pub async fn wait_until_sync(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    wait_until(what, timeout, || std::future::ready(cond())).await
}

/// Polls `value` until it has not changed for `settle`; returns the settled
/// value. Panics when it keeps changing past `timeout`.
pub async fn wait_until_stable(what: &str, timeout: Duration, settle: Duration, mut value: impl FnMut() -> u64) -> u64 {
    let deadline = Instant::now() + timeout;
    let mut last = value();
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = value();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= settle {
            return now;
        }
        if Instant::now() >= deadline {
            panic!("{what} kept changing for {timeout:?} (last value {now})");
        }
    }
}

// ---------------------------------------------------------------------------
// Pattern body: byte at absolute offset `o` is `o % 256`.
// ---------------------------------------------------------------------------

const CHUNK: usize = 64 * 1024;

fn pattern_chunk() -> Bytes {
    static CHUNK_BYTES: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    CHUNK_BYTES
        .get_or_init(|| (0..CHUNK).map(|i| i as u8).collect::<Vec<u8>>().into())
        .clone()
}

/// Checks that `data`, found at absolute offset `offset` of a pattern body,
/// holds the pattern.
pub fn pattern_matches(offset: u64, data: &[u8]) -> bool {
    let chunk = pattern_chunk();
    let mut pos = 0usize;
    while pos < data.len() {
        let start = ((offset + pos as u64) % CHUNK as u64) as usize;
        let take = (CHUNK - start).min(data.len() - pos);
        if data[pos..pos + take] != chunk[start..start + take] {
            return false;
        }
        pos += take;
    }
    true
}

/// A streamed body of `len` pattern bytes in 64 KiB chunks. Produced lazily,
/// so a stalled reader stalls the producer. Optionally counts produced bytes.
pub struct PatternBody {
    remaining: u64,
    exact_size: bool,
    counter: Option<Arc<AtomicU64>>,
}

impl PatternBody {
    /// With an exact size hint (Content-Length framing).
    pub fn new(len: u64) -> Self {
        PatternBody {
            remaining: len,
            exact_size: true,
            counter: None,
        }
    }

    /// Without a size hint (chunked framing).
    pub fn chunked(len: u64) -> Self {
        PatternBody {
            remaining: len,
            exact_size: false,
            counter: None,
        }
    }

    pub fn counting(mut self, counter: Arc<AtomicU64>) -> Self {
        self.counter = Some(counter);
        self
    }
}

impl Body for PatternBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = this.remaining.min(CHUNK as u64) as usize;
        this.remaining -= n as u64;
        if let Some(c) = &this.counter {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
        Poll::Ready(Some(Ok(Frame::data(pattern_chunk().slice(0..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact_size {
            SizeHint::with_exact(self.remaining)
        } else {
            SizeHint::default()
        }
    }
}

/// `/stall-body`: the first half of a pattern body, a pause until the gate
/// opens, then the second half (its pattern restarts at offset 0; no test
/// checks those bytes).
struct StallBody {
    first: PatternBody,
    gate: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    rest: PatternBody,
}

impl Body for StallBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if !this.first.is_end_stream() {
            return Pin::new(&mut this.first).poll_frame(cx);
        }
        if let Some(gate) = this.gate.as_mut() {
            match gate.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) => this.gate = None,
            }
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.gate.is_none() && self.first.is_end_stream() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.first.remaining + self.rest.remaining)
    }
}

pub fn body_empty() -> TestBody {
    Empty::<Bytes>::new().map_err(|e| match e {}).boxed()
}

pub fn body_full(data: impl Into<Bytes>) -> TestBody {
    Full::new(data.into()).map_err(|e| match e {}).boxed()
}

pub fn body_pattern(len: u64) -> TestBody {
    PatternBody::new(len).boxed()
}

// ---------------------------------------------------------------------------
// Counting upstream
// ---------------------------------------------------------------------------

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub conn_id: u64,
    pub method: String,
    /// The request target exactly as received (origin form expected).
    pub uri: String,
    pub version: Version,
    pub headers: Vec<(String, String)>,
}

impl RecordedRequest {
    /// All values of header `name` (case-insensitive), in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_all(name).into_iter().next()
    }

    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or("")
    }
}

struct ConnInfo {
    id: u64,
    served: AtomicUsize,
    kill: Notify,
    /// When the connection is dropped, send RST instead of FIN.
    reset: AtomicBool,
    /// When the last request on this connection started (or the connection was accepted).
    last_request: Mutex<Instant>,
    /// Still counted in `conns_now`.
    counted: AtomicBool,
}

impl ConnInfo {
    /// Takes the connection out of `conns_now` (once).
    fn count_closed(&self, shared: &UpstreamShared) {
        if self.counted.swap(false, Ordering::SeqCst) {
            shared.conns_now.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

struct UpstreamShared {
    conns_now: AtomicUsize,
    conns_peak: AtomicUsize,
    accepted: AtomicUsize,
    inflight_now: AtomicUsize,
    inflight_peak: AtomicUsize,
    finish_before_close: bool,
    requests: AtomicUsize,
    rejected: AtomicUsize,
    killed: AtomicUsize,
    resets: AtomicUsize,
    idle_closes: AtomicUsize,
    bytes_streamed: Arc<AtomicU64>,
    close_every: AtomicBool,
    /// Chance, in 1/1000, that a request is answered by resetting its connection.
    reset_per_mille: AtomicU64,
    rng: Mutex<u64>,
    /// Close a keep-alive connection this long after its last request started (0: never), as Ktor CIO does.
    idle_close_ms: AtomicU64,
    kill_reused_once: AtomicBool,
    released: watch::Sender<bool>,
    graceful: watch::Sender<u64>,
    recorded: Mutex<Vec<RecordedRequest>>,
    next_conn_id: AtomicU64,
}

/// Counts the connection down when its task ends (or is aborted).
struct ConnGuard(Arc<UpstreamShared>, Arc<ConnInfo>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.1.count_closed(&self.0);
    }
}

/// The upstream's end of a connection. It stops counting the connection just before it sends its FIN: from
/// then on the upstream has closed its side, which is all a proxy can observe before dialling a replacement (the
/// connection task itself may finish a little later, and counting until then would report a scheduling lag of
/// this process as an overlap).
struct CountedStream {
    inner: TcpStream,
    shared: Arc<UpstreamShared>,
    info: Arc<ConnInfo>,
}

/// A connection hyper drops without a shutdown is closed (FIN) as the socket drops, right after this.
impl Drop for CountedStream {
    fn drop(&mut self) {
        if self.info.reset.load(Ordering::SeqCst) {
            // Linger 0: the close sends RST and discards whatever is unsent.
            let _ = socket2::SockRef::from(&self.inner).set_linger(Some(Duration::ZERO));
        }
        self.info.count_closed(&self.shared);
    }
}

impl tokio::io::AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for CountedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Counted before the FIN leaves: counting after it would race with a proxy that sees the FIN and dials
        // a replacement while this thread is preempted between the two.
        self.info.count_closed(&self.shared);
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

struct InflightGuard(Arc<UpstreamShared>);

impl InflightGuard {
    fn new(shared: &Arc<UpstreamShared>) -> Self {
        let now = shared.inflight_now.fetch_add(1, Ordering::SeqCst) + 1;
        shared.inflight_peak.fetch_max(now, Ordering::SeqCst);
        InflightGuard(shared.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight_now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Options of a test upstream.
#[derive(Clone, Debug, Default)]
pub struct UpstreamOptions {
    /// Answer every response with `Connection: close`.
    pub close_every: bool,
    /// Reset (RST) the connection instead of answering, for this share of requests in 1/1000.
    pub reset_per_mille: u64,
    /// Seed of the random choices (resets).
    pub seed: u64,
    /// Close keep-alive connections this long after their last request started; a request arriving in the last
    /// quarter of that time is taken to have crossed the close on the wire and gets no answer.
    pub idle_close: Option<Duration>,
    /// SO_SNDBUF of accepted sockets (inherited from the listener), to keep
    /// kernel buffering small in back-pressure tests.
    pub send_buffer: Option<u32>,
    /// Behave like a thread-per-connection server: a request in progress is finished (and answered) before a
    /// FIN from the proxy is acted on, and only then is the connection closed (hyper's half-close).
    pub finish_before_close: bool,
}

/// A counting HTTP/1.1 origin server on 127.0.0.1 (ephemeral port).
///
/// Paths (the first segment that is a known command counts, so `/a/stall`
/// and `/stall` are the same):
/// `/delay/{ms}`, `/work/{ms}` (like `delay`, but the work outlives a reset connection), `/status/{code}`,
/// `/bytes/{n}`, `/echo`, `/echo-stream`,
/// `/headers`, `/close`, `/stall`, `/stall-body/{n}`, `/drop`, `/knee/{k}/{ms}`;
/// anything else: 200 `ok`.
///
/// `/knee/{k}/{ms}` is an upstream with a knee at concurrency `k`: it answers
/// after `ms` while at most `k` requests are in flight on it (counted at the
/// request's arrival, all paths), and after `ms × in_flight / k` above that.
///
/// `/stall-body/{n}` answers 200 with `Content-Length: 2n`, sends `n` pattern
/// bytes and then stalls mid-body until [`Upstream::release_stalled`] (then
/// sends the rest).
///
/// Hostile behaviours: `/trickle/{chunks}/{ms}` sends a 16-byte chunk every
/// `ms`; `/cut/{n}` promises `2n` bytes, sends `n` and closes the connection;
/// `/reset` and `/reset-body/{n}` reset the connection (RST) before the head or
/// after `n` body bytes; [`UpstreamOptions`] adds random resets and early
/// closes of idle keep-alive connections; [`Upstream::stop`] refuses
/// connections (the port stays bound, so no other test can take it) until
/// [`Upstream::restart`].
pub struct Upstream {
    addr: SocketAddr,
    opts: UpstreamOptions,
    shared: Arc<UpstreamShared>,
    accept_task: Mutex<Option<JoinHandle<()>>>,
    /// While stopped: a socket bound to the port but not listening, so connects are refused and the port is ours.
    placeholder: Mutex<Option<TcpSocket>>,
    conn_tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

const COMMANDS: &[&str] = &[
    "delay",
    "work",
    "status",
    "bytes",
    "echo",
    "echo-stream",
    "headers",
    "close",
    "stall",
    "stall-body",
    "drop",
    "trickle",
    "cut",
    "reset",
    "reset-body",
    "knee",
];

/// Every socket on the port sets SO_REUSEPORT so that a bound, non-listening placeholder can hold the port while
/// the upstream is down and the listener can come back beside it.
fn bound_socket(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

fn bind_listener(addr: SocketAddr, send_buffer: Option<u32>) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    if let Some(size) = send_buffer {
        socket.set_send_buffer_size(size)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// splitmix64: a small deterministic generator, so a seeded test replays the same choices.
pub fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Upstream {
    pub async fn start() -> Upstream {
        Self::start_with(UpstreamOptions::default()).await
    }

    pub async fn start_with(opts: UpstreamOptions) -> Upstream {
        let listener = bind_listener("127.0.0.1:0".parse().unwrap(), opts.send_buffer).expect("bind test upstream");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(UpstreamShared {
            conns_now: AtomicUsize::new(0),
            conns_peak: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            inflight_now: AtomicUsize::new(0),
            inflight_peak: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            rejected: AtomicUsize::new(0),
            killed: AtomicUsize::new(0),
            resets: AtomicUsize::new(0),
            idle_closes: AtomicUsize::new(0),
            bytes_streamed: Arc::new(AtomicU64::new(0)),
            close_every: AtomicBool::new(opts.close_every),
            finish_before_close: opts.finish_before_close,
            reset_per_mille: AtomicU64::new(opts.reset_per_mille),
            rng: Mutex::new(opts.seed),
            idle_close_ms: AtomicU64::new(opts.idle_close.map_or(0, |d| d.as_millis() as u64)),
            kill_reused_once: AtomicBool::new(false),
            released: watch::Sender::new(false),
            graceful: watch::Sender::new(0),
            recorded: Mutex::new(Vec::new()),
            next_conn_id: AtomicU64::new(1),
        });
        let up = Upstream {
            addr,
            opts,
            shared,
            accept_task: Mutex::new(None),
            placeholder: Mutex::new(None),
            conn_tasks: Arc::new(Mutex::new(Vec::new())),
        };
        up.spawn_accept(listener);
        up
    }

    fn spawn_accept(&self, listener: TcpListener) {
        let shared = self.shared.clone();
        let tasks = self.conn_tasks.clone();
        let handle = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                let now = shared.conns_now.fetch_add(1, Ordering::SeqCst) + 1;
                shared.conns_peak.fetch_max(now, Ordering::SeqCst);
                let info = Arc::new(ConnInfo {
                    id: shared.next_conn_id.fetch_add(1, Ordering::SeqCst),
                    served: AtomicUsize::new(0),
                    kill: Notify::new(),
                    reset: AtomicBool::new(false),
                    last_request: Mutex::new(Instant::now()),
                    counted: AtomicBool::new(true),
                });
                let guard = ConnGuard(shared.clone(), info.clone());
                let task = tokio::spawn(serve_connection(stream, shared.clone(), info, guard));
                let mut tasks = tasks.lock().unwrap();
                tasks.retain(|t| !t.is_finished());
                tasks.push(task);
            }
        });
        *self.accept_task.lock().unwrap() = Some(handle);
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// TCP connections open right now.
    pub fn connections(&self) -> usize {
        self.shared.conns_now.load(Ordering::SeqCst)
    }

    /// Highest number of simultaneously open TCP connections.
    pub fn peak_connections(&self) -> usize {
        self.shared.conns_peak.load(Ordering::SeqCst)
    }

    /// Starts the peak of open connections again from the number open now, so that a later
    /// [`Upstream::peak_connections`] covers only what happened since.
    pub fn reset_peak_connections(&self) {
        let now = self.shared.conns_now.load(Ordering::SeqCst);
        self.shared.conns_peak.store(now, Ordering::SeqCst);
    }

    /// TCP connections accepted since start (across restarts).
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Requests whose handler is running right now.
    pub fn inflight(&self) -> usize {
        self.shared.inflight_now.load(Ordering::SeqCst)
    }

    pub fn peak_inflight(&self) -> usize {
        self.shared.inflight_peak.load(Ordering::SeqCst)
    }

    /// Starts the peak of in-flight requests again from the number in flight now.
    pub fn reset_peak_inflight(&self) {
        let now = self.shared.inflight_now.load(Ordering::SeqCst);
        self.shared.inflight_peak.store(now, Ordering::SeqCst);
    }

    /// Requests received (including rejected ones).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Requests rejected with 400 (no Host header, or absolute-form target).
    pub fn rejected(&self) -> usize {
        self.shared.rejected.load(Ordering::SeqCst)
    }

    /// Connections the upstream dropped on purpose (`/drop`,
    /// [`Upstream::kill_next_reused_connection`]).
    pub fn killed(&self) -> usize {
        self.shared.killed.load(Ordering::SeqCst)
    }

    /// Connections reset on purpose (random resets, `/reset`, `/reset-body`).
    pub fn resets(&self) -> usize {
        self.shared.resets.load(Ordering::SeqCst)
    }

    /// Keep-alive connections closed early for being idle (`idle_close`).
    pub fn idle_closes(&self) -> usize {
        self.shared.idle_closes.load(Ordering::SeqCst)
    }

    pub fn set_reset_per_mille(&self, per_mille: u64) {
        self.shared.reset_per_mille.store(per_mille, Ordering::SeqCst);
    }

    pub fn set_idle_close(&self, after: Option<Duration>) {
        let ms = after.map_or(0, |d| d.as_millis().max(1) as u64);
        self.shared.idle_close_ms.store(ms, Ordering::SeqCst);
    }

    /// Bytes produced by `/bytes/{n}` bodies so far (handed to hyper).
    pub fn bytes_streamed(&self) -> u64 {
        self.shared.bytes_streamed.load(Ordering::SeqCst)
    }

    pub fn recorded(&self) -> Vec<RecordedRequest> {
        self.shared.recorded.lock().unwrap().clone()
    }

    /// Recorded requests whose path starts with `prefix`.
    pub fn recorded_with_prefix(&self, prefix: &str) -> Vec<RecordedRequest> {
        self.recorded()
            .into_iter()
            .filter(|r| r.path().starts_with(prefix))
            .collect()
    }

    /// Lets every current and future `/stall` request answer (sticky).
    pub fn release_stalled(&self) {
        self.shared.released.send_replace(true);
    }

    /// Makes `/stall` stall again. Only call it when no `/stall` request is
    /// waiting (they could miss the earlier release).
    pub fn restall(&self) {
        self.shared.released.send_replace(false);
    }

    pub fn set_close_every(&self, on: bool) {
        self.shared.close_every.store(on, Ordering::SeqCst);
    }

    /// Gracefully closes every connection: idle ones at once, busy ones
    /// after their current response.
    pub fn close_idle_connections(&self) {
        self.shared.graceful.send_modify(|g| *g += 1);
    }

    /// The next request that arrives on an already used connection makes the
    /// upstream close that connection without answering (once).
    pub fn kill_next_reused_connection(&self) {
        self.shared.kill_reused_once.store(true, Ordering::SeqCst);
    }

    /// Stops listening and aborts every connection. Until [`Upstream::restart`] connects are refused, and the port
    /// stays bound by a placeholder socket so that nothing else can take it.
    pub async fn stop(&self) {
        {
            let mut placeholder = self.placeholder.lock().unwrap();
            if placeholder.is_none() {
                *placeholder = Some(bound_socket(self.addr).expect("placeholder socket on the upstream's port"));
            }
        }
        let accept = self.accept_task.lock().unwrap().take();
        if let Some(task) = accept {
            task.abort();
            let _ = task.await;
        }
        let tasks = std::mem::take(&mut *self.conn_tasks.lock().unwrap());
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Listens again on the same port (after [`Upstream::stop`]).
    pub async fn restart(&self) {
        let listener = bind_listener(self.addr, self.opts.send_buffer)
            .unwrap_or_else(|e| panic!("listening again on {}: {e}", self.addr));
        self.spawn_accept(listener);
        self.placeholder.lock().unwrap().take();
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(task) = self.accept_task.lock().unwrap().take() {
            task.abort();
        }
        for task in self.conn_tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

async fn sleep_until_or_never(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<UpstreamShared>, info: Arc<ConnInfo>, _guard: ConnGuard) {
    let svc = {
        let shared = shared.clone();
        let info = info.clone();
        service_fn(move |req| handle(shared.clone(), info.clone(), req))
    };
    let stream = CountedStream {
        inner: stream,
        shared: shared.clone(),
        info: info.clone(),
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .half_close(shared.finish_before_close)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let mut graceful = shared.graceful.subscribe();
    let mut closing_idle = false;
    loop {
        let idle_close_ms = shared.idle_close_ms.load(Ordering::SeqCst);
        let idle_deadline = (idle_close_ms > 0 && !closing_idle)
            .then(|| *info.last_request.lock().unwrap() + Duration::from_millis(idle_close_ms));
        tokio::select! {
            _ = conn.as_mut() => break,
            _ = sleep_until_or_never(idle_deadline) => {
                // A request that started meanwhile moved the deadline: look again.
                let last = *info.last_request.lock().unwrap();
                if last.elapsed() >= Duration::from_millis(idle_close_ms) {
                    closing_idle = true;
                    shared.idle_closes.fetch_add(1, Ordering::SeqCst);
                    // Closes at once when idle, after the response in flight otherwise.
                    conn.as_mut().graceful_shutdown();
                }
            }
            changed = graceful.changed() => {
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                } else {
                    let _ = conn.as_mut().await;
                    break;
                }
            }
            _ = info.kill.notified() => {
                shared.killed.fetch_add(1, Ordering::SeqCst);
                break;
            }
        }
    }
}

/// Answers by resetting the connection (RST): the request is read, nothing is written.
async fn reset_connection(
    shared: &Arc<UpstreamShared>,
    info: &Arc<ConnInfo>,
) -> Result<Response<UpstreamBody>, Infallible> {
    shared.resets.fetch_add(1, Ordering::SeqCst);
    info.reset.store(true, Ordering::SeqCst);
    info.kill.notify_one();
    std::future::pending().await
}

fn octet_stream(body: UpstreamBody) -> Response<UpstreamBody> {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    resp
}

const TRICKLE_CHUNK: u64 = 16;

/// `/trickle`: one small chunk every `every`.
struct TrickleBody {
    remaining: u64,
    every: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    counter: Arc<AtomicU64>,
}

impl Body for TrickleBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(this.every)));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        this.sleep = None;
        this.remaining -= 1;
        this.counter.fetch_add(TRICKLE_CHUNK, Ordering::SeqCst);
        Poll::Ready(Some(Ok(Frame::data(pattern_chunk().slice(0..TRICKLE_CHUNK as usize)))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining * TRICKLE_CHUNK)
    }
}

/// `/cut` and `/reset-body`: promises `promised` bytes, sends the first part, then fails, which makes hyper drop
/// the connection mid-body (with RST when `on_cut` asks for it).
struct CutBody {
    first: PatternBody,
    promised: u64,
    flushed: bool,
    on_cut: Option<Box<dyn FnOnce() + Send>>,
}

impl Body for CutBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if !this.first.is_end_stream() {
            return Pin::new(&mut this.first).poll_frame(cx);
        }
        if !this.flushed {
            // One Pending first makes hyper flush what it has, so the peer receives the head and the first part
            // before the cut (an RST would discard anything still unsent).
            this.flushed = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Some(on_cut) = this.on_cut.take() {
            on_cut();
        }
        Poll::Ready(Some(Err("upstream cuts the body off".into())))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.promised)
    }
}

fn text_response(status: StatusCode, text: &str) -> Response<UpstreamBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(text.to_owned()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp
}

fn empty_response(status: StatusCode) -> Response<UpstreamBody> {
    let mut resp = Response::new(Empty::new().map_err(|e| match e {}).boxed_unsync());
    *resp.status_mut() = status;
    resp
}

fn version_str(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "?",
    }
}

async fn handle(
    shared: Arc<UpstreamShared>,
    info: Arc<ConnInfo>,
    req: Request<Incoming>,
) -> Result<Response<UpstreamBody>, Infallible> {
    let served_before = info.served.fetch_add(1, Ordering::SeqCst);
    shared.requests.fetch_add(1, Ordering::SeqCst);
    let recorded = RecordedRequest {
        conn_id: info.id,
        method: req.method().to_string(),
        uri: req.uri().to_string(),
        version: req.version(),
        headers: req
            .headers()
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
    };
    shared.recorded.lock().unwrap().push(recorded.clone());

    if !req.headers().contains_key(HOST) || req.uri().authority().is_some() {
        shared.rejected.fetch_add(1, Ordering::SeqCst);
        return Ok(text_response(
            StatusCode::BAD_REQUEST,
            "upstream: request without Host or in absolute form",
        ));
    }

    let idle_for = std::mem::replace(&mut *info.last_request.lock().unwrap(), Instant::now()).elapsed();
    let idle_close_ms = shared.idle_close_ms.load(Ordering::SeqCst);
    if idle_close_ms > 0 && served_before > 0 && idle_for >= Duration::from_millis(idle_close_ms * 3 / 4) {
        // On a real network the upstream's FIN takes a while to arrive: a request sent in the last quarter of
        // the idle period crosses it on the wire, and the upstream closes without answering.
        shared.idle_closes.fetch_add(1, Ordering::SeqCst);
        info.kill.notify_one();
        return std::future::pending().await;
    }

    if served_before > 0 && shared.kill_reused_once.swap(false, Ordering::SeqCst) {
        info.kill.notify_one();
        return std::future::pending().await;
    }

    let per_mille = shared.reset_per_mille.load(Ordering::SeqCst);
    if per_mille > 0 && next_random(&mut shared.rng.lock().unwrap()) % 1000 < per_mille {
        return reset_connection(&shared, &info).await;
    }

    // `/work` counts its own work, which outlives this handler.
    let is_work = req.uri().path().split('/').any(|segment| segment == "work");
    let _inflight = (!is_work).then(|| InflightGuard::new(&shared));
    let mut resp = route(&shared, &info, &recorded, req).await;
    if shared.close_every.load(Ordering::SeqCst) {
        resp.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(resp)
}

async fn route(
    shared: &Arc<UpstreamShared>,
    info: &Arc<ConnInfo>,
    recorded: &RecordedRequest,
    req: Request<Incoming>,
) -> Response<UpstreamBody> {
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let command = segments
        .iter()
        .position(|s| COMMANDS.contains(s))
        .map(|p| (segments[p], segments.get(p + 1).copied()));
    match command {
        Some(("knee", Some(knee))) => {
            let knee: u64 = knee.parse().unwrap_or(1).max(1);
            let ms = segments.iter().skip_while(|s| **s != "knee").nth(2);
            let ms: u64 = ms.and_then(|s| s.parse().ok()).unwrap_or(10);
            let in_flight = shared.inflight_now.load(Ordering::SeqCst) as u64;
            tokio::time::sleep(Duration::from_millis(ms * in_flight.max(knee) / knee)).await;
            text_response(StatusCode::OK, "ok")
        }
        Some(("delay", Some(ms))) => {
            let ms: u64 = ms.parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            text_response(StatusCode::OK, "ok")
        }
        Some(("work", Some(ms))) => {
            // The work of a thread-per-connection server: it runs to its end, counted in flight, even if the
            // connection is reset meanwhile (this handler is then dropped, the work is not).
            let ms: u64 = ms.parse().unwrap_or(0);
            let inflight = InflightGuard::new(shared);
            let work = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                drop(inflight);
            });
            let _ = work.await;
            text_response(StatusCode::OK, "ok")
        }
        Some(("status", Some(code))) => {
            let status = code
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
                empty_response(status)
            } else {
                text_response(status, &format!("status {}", status.as_u16()))
            }
        }
        Some(("bytes", Some(n))) => {
            let n: u64 = n.parse().unwrap_or(0);
            let body = PatternBody::new(n).counting(shared.bytes_streamed.clone());
            let mut resp = Response::new(body.boxed_unsync());
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            resp
        }
        Some(("echo", _)) => {
            let mut body = req.into_body();
            let mut count = 0u64;
            let mut pattern_ok = true;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(frame) => {
                        if let Ok(data) = frame.into_data() {
                            pattern_ok &= pattern_matches(count, &data);
                            count += data.len() as u64;
                        }
                    }
                    Err(e) => {
                        return text_response(
                            StatusCode::BAD_REQUEST,
                            &format!("upstream: body error after {count} bytes: {e}"),
                        )
                    }
                }
            }
            let mut resp = text_response(StatusCode::OK, &count.to_string());
            resp.headers_mut().insert(
                "x-pattern-ok",
                HeaderValue::from_static(if pattern_ok { "true" } else { "false" }),
            );
            resp
        }
        Some(("echo-stream", _)) => {
            let body = req.into_body().map_err(|e| Box::new(e) as BoxError);
            Response::new(body.boxed_unsync())
        }
        Some(("headers", _)) => {
            let json = serde_json::json!({
                "method": recorded.method,
                "uri": recorded.uri,
                "version": version_str(recorded.version),
                "headers": recorded.headers,
            });
            let mut resp = text_response(StatusCode::OK, &json.to_string());
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            resp
        }
        Some(("close", _)) => {
            let mut resp = text_response(StatusCode::OK, "ok");
            resp.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            resp
        }
        Some(("stall", _)) => {
            let mut released = shared.released.subscribe();
            let _ = released.wait_for(|r| *r).await;
            text_response(StatusCode::OK, "released")
        }
        Some(("stall-body", Some(n))) => {
            let n: u64 = n.parse().unwrap_or(0);
            let mut released = shared.released.subscribe();
            let body = StallBody {
                first: PatternBody::new(n).counting(shared.bytes_streamed.clone()),
                gate: Some(Box::pin(async move {
                    let _ = released.wait_for(|r| *r).await;
                })),
                rest: PatternBody::new(n).counting(shared.bytes_streamed.clone()),
            };
            let mut resp = Response::new(body.boxed_unsync());
            resp.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            resp
        }
        Some(("drop", _)) => {
            info.kill.notify_one();
            std::future::pending().await
        }
        Some(("reset", _)) => reset_connection(shared, info).await.unwrap_or_else(|e| match e {}),
        Some(("reset-body", Some(n))) => {
            let n: u64 = n.parse().unwrap_or(0);
            let (shared, info) = (shared.clone(), info.clone());
            let body = CutBody {
                first: PatternBody::new(n).counting(shared.bytes_streamed.clone()),
                promised: 2 * n,
                flushed: false,
                on_cut: Some(Box::new(move || {
                    shared.resets.fetch_add(1, Ordering::SeqCst);
                    info.reset.store(true, Ordering::SeqCst);
                })),
            };
            octet_stream(body.boxed_unsync())
        }
        Some(("cut", Some(n))) => {
            let n: u64 = n.parse().unwrap_or(0);
            let body = CutBody {
                first: PatternBody::new(n).counting(shared.bytes_streamed.clone()),
                promised: 2 * n,
                flushed: false,
                on_cut: None,
            };
            octet_stream(body.boxed_unsync())
        }
        Some(("trickle", Some(chunks))) => {
            let chunks: u64 = chunks.parse().unwrap_or(0);
            let ms = segments.iter().skip_while(|s| **s != "trickle").nth(2);
            let every = Duration::from_millis(ms.and_then(|s| s.parse().ok()).unwrap_or(10));
            let body = TrickleBody {
                remaining: chunks,
                every,
                sleep: None,
                counter: shared.bytes_streamed.clone(),
            };
            octet_stream(body.boxed_unsync())
        }
        _ => text_response(StatusCode::OK, "ok"),
    }
}

// ---------------------------------------------------------------------------
// Proxy launcher
// ---------------------------------------------------------------------------

pub fn floodgate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_floodgate")
}

/// A running `floodgate` process (killed on drop).
pub struct Proxy {
    child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    output: Arc<Mutex<String>>,
    /// The threads copying stdout and stderr into `output`; they end at end of file.
    readers: [std::thread::JoinHandle<()>; 2],
    exit: Option<ExitStatus>,
}

const OUTPUT_CAP: usize = 4 << 20;

fn append_capped(buf: &Mutex<String>, text: &str) {
    let mut buf = buf.lock().unwrap();
    buf.push_str(text);
    if buf.len() > OUTPUT_CAP {
        let mut cut = buf.len() - OUTPUT_CAP / 2;
        while !buf.is_char_boundary(cut) {
            cut += 1;
        }
        buf.drain(..cut);
    }
}

fn parse_ready_line(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let rest = line.trim().strip_prefix("floodgate ready ")?;
    let mut listen = None;
    let mut admin = None;
    for token in rest.split_whitespace() {
        if let Some(v) = token.strip_prefix("listen=") {
            listen = v.parse().ok();
        } else if let Some(v) = token.strip_prefix("admin=") {
            admin = v.parse().ok();
        }
    }
    Some((listen?, admin?))
}

impl Proxy {
    /// Starts floodgate with `--listen 127.0.0.1:0 --admin 127.0.0.1:0`
    /// followed by `args`; panics (with its stderr) when it is not ready in
    /// 10 s.
    pub async fn start<S: AsRef<str>>(args: &[S]) -> Proxy {
        match Self::try_start(args).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    /// `--upstream URL --max-connections N` plus `extra`.
    pub async fn for_upstream(upstream: &Upstream, max_connections: usize, extra: &[&str]) -> Proxy {
        Self::for_upstream_with_env(upstream, max_connections, extra, &[]).await
    }

    /// [`Proxy::for_upstream`] with `env` added to floodgate's environment (settings without a flag).
    pub async fn for_upstream_with_env(
        upstream: &Upstream,
        max_connections: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Proxy {
        let mut args = vec![
            "--upstream".to_owned(),
            upstream.url(),
            "--max-connections".to_owned(),
            max_connections.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_with_env(&args, env).await
    }

    pub async fn try_start<S: AsRef<str>>(args: &[S]) -> Result<Proxy, String> {
        Self::try_start_with_fd_limit(args, None).await
    }

    /// Like [`Proxy::start`], with the process's soft limit on open files set to `limit` (through the shell's
    /// `ulimit -n`, then `exec`, so the pid is floodgate's).
    pub async fn start_with_fd_limit<S: AsRef<str>>(args: &[S], limit: u64) -> Proxy {
        match Self::try_start_with_fd_limit(args, Some(limit)).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    pub async fn try_start_with_fd_limit<S: AsRef<str>>(args: &[S], fd_limit: Option<u64>) -> Result<Proxy, String> {
        Self::try_start_with(args, fd_limit, &[]).await
    }

    /// Like [`Proxy::start`], with `env` added to the environment floodgate inherits.
    pub async fn start_with_env<S: AsRef<str>>(args: &[S], env: &[(&str, &str)]) -> Proxy {
        match Self::try_start_with(args, None, env).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    pub async fn try_start_with<S: AsRef<str>>(
        args: &[S],
        fd_limit: Option<u64>,
        env: &[(&str, &str)],
    ) -> Result<Proxy, String> {
        let mut command = match fd_limit {
            None => Command::new(floodgate_bin()),
            Some(limit) => {
                let mut sh = Command::new("sh");
                sh.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" \"$@\""),
                    floodgate_bin(),
                ]);
                sh
            }
        };
        // A test that places the admin listener itself (say on 0.0.0.0) gives --admin in `args`.
        if !args.iter().any(|arg| arg.as_ref() == "--admin") {
            command.args(["--admin", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(["--listen", "127.0.0.1:0"])
            .args(args.iter().map(|a| a.as_ref()))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", floodgate_bin()))?;
        let output = Arc::new(Mutex::new(String::new()));

        let mut stderr = child.stderr.take().unwrap();
        let err_buf = output.clone();
        let stderr_reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            loop {
                match stderr.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => append_capped(&err_buf, &String::from_utf8_lossy(&chunk[..n])),
                }
            }
        });

        let stdout = child.stdout.take().unwrap();
        let out_buf = output.clone();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<String>();
        let stdout_reader = std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("floodgate ready") {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(line);
                        continue;
                    }
                }
                append_capped(&out_buf, &format!("[stdout] {line}\n"));
            }
        });

        let failure = |child: &mut Child, why: String| {
            let _ = child.kill();
            let status = child.wait().ok();
            // Give the reader thread a moment to collect the last words.
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline && output.lock().unwrap().is_empty() {
                std::thread::sleep(Duration::from_millis(10));
            }
            format!("{why}; exit status {status:?}; output:\n{}", output.lock().unwrap())
        };
        match tokio::time::timeout(Duration::from_secs(10), ready_rx).await {
            Ok(Ok(line)) => match parse_ready_line(&line) {
                Some((listen, admin)) => Ok(Proxy {
                    child,
                    listen,
                    admin,
                    output,
                    readers: [stdout_reader, stderr_reader],
                    exit: None,
                }),
                None => Err(failure(&mut child, format!("unparsable ready line {line:?}"))),
            },
            Ok(Err(_)) => Err(failure(&mut child, "stdout closed before the ready line".into())),
            Err(_) => Err(failure(&mut child, "no ready line within 10 s".into())),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote to stderr (and unexpected stdout lines).
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Waits until stdout and stderr have both reached their end (the process has exited), so that
    /// [`Proxy::output`] holds everything it wrote.
    pub async fn wait_output_closed(&self, timeout: Duration) {
        wait_until_sync("floodgate's stdout and stderr closed", timeout, || {
            self.readers.iter().all(|reader| reader.is_finished())
        })
        .await;
    }

    /// Current resident set (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmRSS").expect("VmRSS")
    }

    /// Peak resident set (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmHWM").expect("VmHWM")
    }

    /// Sends SIGTERM (through `kill(1)`).
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Sends SIGHUP (through `kill(1)`): reload the configuration.
    pub fn sighup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -HUP failed: {status}");
    }

    /// A request to the admin listener with `body` and, when given, `Authorization: Bearer {token}`.
    pub async fn admin_request(&self, method: Method, path: &str, body: &str, token: Option<&str>) -> Resp {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let request = request.body(body_full(body.to_string())).unwrap();
        let mut conn = H1Conn::connect(self.admin).await;
        let resp = conn.send(request).await.unwrap_or_else(|e| panic!("{path}: {e}"));
        collect(resp).await.unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// Waits for the process to exit; `None` when it is still running at
    /// the deadline.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit {
                return Some(status);
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exit = Some(status);
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `http://127.0.0.1:PORT{path}` on the proxy listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub async fn admin_get(&self, path: &str) -> Resp {
        get(self.admin, path).await
    }

    pub async fn status(&self) -> serde_json::Value {
        let resp = self.admin_get("/status").await;
        assert_eq!(resp.status, StatusCode::OK, "GET /status: {}", resp.text());
        serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("GET /status is not JSON ({e}): {}", resp.text()))
    }

    /// `/status` → `upstreams.{name}`.
    pub async fn upstream_status(&self, name: &str) -> serde_json::Value {
        let status = self.status().await;
        status["upstreams"][name].clone()
    }

    /// `/status` → `upstreams.{name}.{field}` as u64 (panics when missing).
    pub async fn upstream_field(&self, name: &str, field: &str) -> u64 {
        let up = self.upstream_status(name).await;
        up[field]
            .as_u64()
            .unwrap_or_else(|| panic!("/status upstreams.{name}.{field} missing or not a number: {up}"))
    }

    pub async fn metrics(&self) -> String {
        let resp = self.admin_get("/metrics").await;
        assert_eq!(resp.status, StatusCode::OK, "GET /metrics");
        resp.text()
    }

    /// `floodgate_requests_total` summed over status classes for one upstream and outcome.
    pub async fn outcome_count(&self, upstream: &str, outcome: &str) -> f64 {
        let samples = parse_metrics(&self.metrics().await);
        metric_sum(
            &samples,
            "floodgate_requests_total",
            &[("upstream", upstream), ("outcome", outcome)],
        )
    }

    /// `floodgate_client_connections`: client connections the proxy has open.
    pub async fn client_connections(&self) -> f64 {
        metric_sum(
            &parse_metrics(&self.metrics().await),
            "floodgate_client_connections",
            &[],
        )
    }

    /// Waits until `upstreams.{name}.in_use` is 0.
    pub async fn wait_in_use_zero(&self, name: &str, timeout: Duration) {
        wait_until(&format!("upstreams.{name}.in_use == 0"), timeout, || async {
            self.upstream_field(name, "in_use").await == 0
        })
        .await
    }

    /// Waits until `upstreams.{name}.queue_depth` equals `depth`.
    pub async fn wait_queue_depth(&self, name: &str, depth: u64, timeout: Duration) {
        wait_until(&format!("upstreams.{name}.queue_depth == {depth}"), timeout, || async {
            self.upstream_field(name, "queue_depth").await == depth
        })
        .await
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.exit.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let out = self.output();
            let tail_start = out.len().saturating_sub(16 * 1024);
            let mut start = tail_start;
            while !out.is_char_boundary(start) {
                start += 1;
            }
            eprintln!(
                "---- floodgate (pid {}) output, last {} bytes ----\n{}\n---- end ----",
                self.child.id(),
                out.len() - start,
                &out[start..]
            );
        }
    }
}

/// A field of /proc/PID/status in KiB.
pub fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// A config file in the temp dir, removed on drop.
pub struct TempConfig {
    pub path: PathBuf,
}

impl TempConfig {
    pub fn new(contents: &str) -> TempConfig {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "floodgate-test-{}-{}.toml",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(&path, contents).expect("writing config");
        TempConfig { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn path_str(&self) -> String {
        self.path.display().to_string()
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs floodgate with `args` expecting it to exit by itself within
/// `timeout` (it is killed and the test fails otherwise). Returns exit
/// status, stdout, stderr.
pub fn run_to_exit(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    run_to_exit_with_env(args, &[], timeout)
}

/// [`run_to_exit`] with `env` added to the environment floodgate inherits.
pub fn run_to_exit_with_env(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> (ExitStatus, String, String) {
    let mut command = Command::new(floodgate_bin());
    command.args(args).envs(env.iter().copied());
    run_command_to_exit(command, timeout)
}

/// [`run_to_exit`] for a command built by the caller (floodgate behind `setpriv`, `sh -c 'ulimit …; exec …'`).
pub fn run_command_to_exit(mut command: Command, timeout: Duration) -> (ExitStatus, String, String) {
    let args: Vec<String> = command
        .get_args()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning floodgate");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let out = out_thread.join().unwrap_or_default();
            let err = err_thread.join().unwrap_or_default();
            panic!("floodgate {args:?} was still running after {timeout:?}\nstdout:\n{out}\nstderr:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = out_thread.join().unwrap_or_default();
    let err = err_thread.join().unwrap_or_default();
    (status, out, err)
}

// ---------------------------------------------------------------------------
// HTTP clients
// ---------------------------------------------------------------------------

/// A fully read response.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub async fn collect(resp: Response<Incoming>) -> Result<Resp, BoxError> {
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(CLIENT_TIMEOUT, body.collect())
        .await
        .map_err(|_| "timed out reading the response body")??
        .to_bytes();
    Ok(Resp {
        status: parts.status,
        version: parts.version,
        headers: parts.headers,
        body,
    })
}

/// One HTTP/1.1 client connection (keep-alive) made with hyper's
/// `client::conn::http1`. Dropping it closes the TCP connection.
pub struct H1Conn {
    sender: hyper::client::conn::http1::SendRequest<TestBody>,
    task: JoinHandle<()>,
    addr: SocketAddr,
}

impl H1Conn {
    pub async fn connect(addr: SocketAddr) -> H1Conn {
        Self::try_connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"))
    }

    pub async fn try_connect(addr: SocketAddr) -> Result<H1Conn, BoxError> {
        let stream = tokio::time::timeout(CLIENT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out")??;
        stream.set_nodelay(true)?;
        Self::over(stream, addr).await
    }

    pub async fn over(stream: TcpStream, addr: SocketAddr) -> Result<H1Conn, BoxError> {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H1Conn { sender, task, addr })
    }

    /// Sends `req` (adding `Host` when missing) and returns the response head.
    pub async fn send(&mut self, mut req: Request<TestBody>) -> Result<Response<Incoming>, BoxError> {
        if !req.headers().contains_key(HOST) {
            req.headers_mut()
                .insert(HOST, HeaderValue::from_str(&self.addr.to_string()).unwrap());
        }
        tokio::time::timeout(CLIENT_TIMEOUT, async {
            self.sender.ready().await?;
            self.sender.send_request(req).await
        })
        .await
        .map_err(|_| -> BoxError { "timed out waiting for the response head".into() })?
        .map_err(Into::into)
    }

    pub async fn try_request(&mut self, method: Method, path: &str, body: TestBody) -> Result<Resp, BoxError> {
        let req = Request::builder().method(method).uri(path).body(body).unwrap();
        let resp = self.send(req).await?;
        collect(resp).await
    }

    pub async fn try_get(&mut self, path: &str) -> Result<Resp, BoxError> {
        self.try_request(Method::GET, path, body_empty()).await
    }

    pub async fn get(&mut self, path: &str) -> Resp {
        self.try_get(path)
            .await
            .unwrap_or_else(|e| panic!("GET {path} via {}: {e}", self.addr))
    }

    /// True while hyper considers the connection usable.
    pub fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }
}

impl Drop for H1Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// GET on a fresh connection.
pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    H1Conn::connect(addr).await.get(path).await
}

/// GET on a fresh connection, errors returned.
pub async fn try_get(addr: SocketAddr, path: &str) -> Result<Resp, BoxError> {
    H1Conn::try_connect(addr).await?.try_get(path).await
}

/// An HTTP/2 prior-knowledge client connection.
#[derive(Clone)]
pub struct H2Conn {
    sender: hyper::client::conn::http2::SendRequest<TestBody>,
    addr: SocketAddr,
    _task: Arc<H2Task>,
    /// Turns true when the connection has ended (the peer closed it, or it failed).
    ended: watch::Receiver<bool>,
}

struct H2Task(JoinHandle<()>);

impl Drop for H2Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Settings of an [`H2Conn`] beyond hyper's defaults.
#[derive(Clone, Copy, Debug, Default)]
pub struct H2Options {
    /// The client's initial per-stream receive window (SETTINGS_INITIAL_WINDOW_SIZE). hyper only hands window
    /// back as the caller reads a body, so a small window and an unread body make a reader that stalls the
    /// sender.
    pub initial_stream_window_size: Option<u32>,
}

impl H2Conn {
    pub async fn connect(addr: SocketAddr) -> H2Conn {
        Self::connect_with(addr, H2Options::default()).await
    }

    pub async fn connect_with(addr: SocketAddr, opts: H2Options) -> H2Conn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        if let Some(window) = opts.initial_stream_window_size {
            builder.initial_stream_window_size(window);
        }
        let (sender, conn) = builder.handshake(TokioIo::new(stream)).await.expect("h2 handshake");
        let (ended_tx, ended) = watch::channel(false);
        let task = tokio::spawn(async move {
            let _ = conn.await;
            ended_tx.send_replace(true);
        });
        H2Conn {
            sender,
            addr,
            _task: Arc::new(H2Task(task)),
            ended,
        }
    }

    /// Sends `req` and returns the response head; the body is left unread for the caller.
    pub async fn send(&mut self, req: Request<TestBody>) -> Result<Response<Incoming>, BoxError> {
        tokio::time::timeout(CLIENT_TIMEOUT, async {
            self.sender.ready().await?;
            self.sender.send_request(req).await
        })
        .await
        .map_err(|_| -> BoxError { "timed out waiting for the response head".into() })?
        .map_err(Into::into)
    }

    /// GET of an absolute `uri`, whose authority becomes the `:authority` pseudo-header.
    pub async fn try_get_uri(&mut self, uri: &str) -> Result<Resp, BoxError> {
        let req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(body_empty())
            .unwrap();
        let resp = self.send(req).await?;
        collect(resp).await
    }

    pub async fn try_get(&mut self, path: &str) -> Result<Resp, BoxError> {
        let uri = format!("http://{}{}", self.addr, path);
        self.try_get_uri(&uri).await
    }

    /// True once the connection has ended (closed by the peer or failed).
    pub fn has_ended(&self) -> bool {
        *self.ended.borrow()
    }
}

// ---------------------------------------------------------------------------
// Raw TCP client
// ---------------------------------------------------------------------------

/// A response read off a raw socket.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    /// Minor version of `HTTP/1.x`.
    pub minor_version: u8,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How reading a socket ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadEnd {
    Eof,
    Reset,
    Timeout,
}

/// A TCP connection speaking bytes.
pub struct RawConn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl RawConn {
    pub async fn connect(addr: SocketAddr) -> RawConn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects with a small receive buffer (limits kernel buffering).
    pub async fn connect_with_recv_buffer(addr: SocketAddr, size: u32) -> RawConn {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(size).unwrap();
        let stream = socket.connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    pub async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(data).await
    }

    /// Reads more bytes into the buffer; Ok(0) at EOF.
    async fn fill(&mut self, deadline: Instant) -> std::io::Result<usize> {
        let mut chunk = vec![0u8; 64 * 1024];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "raw read timed out")),
        }
    }

    /// Reads one response head.
    pub async fn read_head(&mut self, timeout: Duration) -> std::io::Result<RawResponse> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 128];
            let mut parsed = httparse::Response::new(&mut headers);
            match parsed.parse(&self.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let resp = RawResponse {
                        status: parsed.code.unwrap_or(0),
                        minor_version: parsed.version.unwrap_or(0),
                        headers: parsed
                            .headers
                            .iter()
                            .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                            .collect(),
                        body: Vec::new(),
                    };
                    self.buf.drain(..len);
                    return Ok(resp);
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("bad response head {e}: {:?}", String::from_utf8_lossy(&self.buf)),
                    ))
                }
            }
            if self.fill(deadline).await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "EOF before a complete response head; got {:?}",
                        String::from_utf8_lossy(&self.buf)
                    ),
                ));
            }
        }
    }

    async fn read_exact_buf(&mut self, n: usize, deadline: Instant) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill(deadline).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    async fn read_line(&mut self, deadline: Instant) -> std::io::Result<String> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line: Vec<u8> = self.buf.drain(..pos + 2).collect();
                return Ok(String::from_utf8_lossy(&line[..pos]).into_owned());
            }
            if self.fill(deadline).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads one complete response (framing per RFC 9112). `head_request`
    /// says the request was HEAD (no body whatever the headers say).
    pub async fn read_response(&mut self, head_request: bool, timeout: Duration) -> std::io::Result<RawResponse> {
        let deadline = Instant::now() + timeout;
        let mut resp = self.read_head(timeout).await?;
        if head_request || resp.status < 200 || resp.status == 204 || resp.status == 304 {
            return Ok(resp);
        }
        let chunked = resp
            .header("transfer-encoding")
            .map(|v| v.to_ascii_lowercase().contains("chunked"))
            .unwrap_or(false);
        if chunked {
            loop {
                let line = self.read_line(deadline).await?;
                let size_str = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_str, 16).map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad chunk size line {line:?}"))
                })?;
                if size == 0 {
                    // trailers
                    while !self.read_line(deadline).await?.is_empty() {}
                    break;
                }
                let data = self.read_exact_buf(size, deadline).await?;
                resp.body.extend_from_slice(&data);
                let crlf = self.read_exact_buf(2, deadline).await?;
                if crlf != b"\r\n" {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "chunk not followed by CRLF",
                    ));
                }
            }
        } else if let Some(len) = resp.header("content-length") {
            let len: usize = len
                .trim()
                .parse()
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad content-length"))?;
            resp.body = self.read_exact_buf(len, deadline).await?;
        } else {
            // close-delimited
            let (rest, end) = self.read_until_close(timeout).await;
            if end == ReadEnd::Timeout {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "close-delimited body did not end",
                ));
            }
            resp.body = rest;
        }
        Ok(resp)
    }

    /// Reads until EOF, reset or timeout; returns everything not yet consumed.
    pub async fn read_until_close(&mut self, timeout: Duration) -> (Vec<u8>, ReadEnd) {
        let deadline = Instant::now() + timeout;
        let end = loop {
            match self.fill(deadline).await {
                Ok(0) => break ReadEnd::Eof,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break ReadEnd::Timeout,
                Err(_) => break ReadEnd::Reset,
            }
        };
        (std::mem::take(&mut self.buf), end)
    }

    /// Bytes buffered but not consumed by a parse.
    pub fn leftover(&self) -> &[u8] {
        &self.buf
    }

    /// Reads raw bytes (at most `max`) into the caller's hands.
    pub async fn read_some(&mut self, max: usize, timeout: Duration) -> std::io::Result<Vec<u8>> {
        if self.buf.is_empty() {
            let deadline = Instant::now() + timeout;
            if self.fill(deadline).await? == 0 {
                return Ok(Vec::new());
            }
        }
        let n = self.buf.len().min(max);
        Ok(self.buf.drain(..n).collect())
    }

    /// Closes with RST instead of FIN.
    pub fn abort_with_reset(self) {
        let _ = self.stream.set_zero_linger();
        drop(self.stream);
    }
}

/// Writes `request` on a fresh connection and reads until the proxy closes
/// it (or `timeout`). The write may fail half way (proxy gave up early);
/// whatever was answered is returned.
pub async fn raw_exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> (Vec<u8>, ReadEnd) {
    let mut conn = RawConn::connect(addr).await;
    let _ = conn.write(request).await;
    conn.read_until_close(timeout).await
}

/// Trickles the body of the request whose head `conn` has sent: one byte, then up to 200 ms of listening for the
/// answer, until answered (10 s at most, else the task panics); the task returns the answer.
pub fn spawn_trickler(mut conn: RawConn) -> JoinHandle<RawResponse> {
    tokio::spawn(async move {
        for _ in 0..50 {
            let _ = conn.write(b"x").await;
            match conn.read_response(false, Duration::from_millis(200)).await {
                Ok(resp) => return resp,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(e) => panic!("the trickler was not answered: {e}"),
            }
        }
        panic!("the trickler was not answered within 10 s");
    })
}

/// Status code of the first response in `data`.
pub fn first_status(data: &[u8]) -> Option<u16> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(data) {
        Ok(_) => resp.code,
        Err(_) => None,
    }
}

// ---------------------------------------------------------------------------
// Prometheus text
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses Prometheus / OpenMetrics text exposition (comments skipped).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) if line[..open].find(' ').is_none() => {
                let name = &line[..open];
                let mut labels = BTreeMap::new();
                let bytes = line.as_bytes();
                let mut i = open + 1;
                loop {
                    while i < bytes.len() && (bytes[i] == b',' || bytes[i] == b' ') {
                        i += 1;
                    }
                    if i >= bytes.len() || bytes[i] == b'}' {
                        i += 1;
                        break;
                    }
                    let eq = i + line[i..].find('=').expect("label without =");
                    let key = line[i..eq].trim().to_owned();
                    i = eq + 1;
                    assert_eq!(bytes[i], b'"', "label value not quoted in {line}");
                    i += 1;
                    let mut value = String::new();
                    while bytes[i] != b'"' {
                        if bytes[i] == b'\\' {
                            i += 1;
                            value.push(match bytes[i] {
                                b'n' => '\n',
                                other => other as char,
                            });
                        } else {
                            let ch = line[i..].chars().next().unwrap();
                            value.push(ch);
                            i += ch.len_utf8() - 1;
                        }
                        i += 1;
                    }
                    i += 1;
                    labels.insert(key, value);
                }
                (name.to_owned(), labels, &line[i.min(line.len())..])
            }
            _ => {
                let mut parts = line.splitn(2, ' ');
                let name = parts.next().unwrap_or("").to_owned();
                (name, BTreeMap::new(), parts.next().unwrap_or(""))
            }
        };
        let value = rest.split_whitespace().next().unwrap_or("");
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or(f64::NAN),
        };
        samples.push(Sample { name, labels, value });
    }
    samples
}

/// Sum of the samples named `name` whose labels include all of `labels`.
pub fn metric_sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// Whether any sample named `name` exists.
pub fn metric_exists(samples: &[Sample], name: &str) -> bool {
    samples.iter().any(|s| s.name == name)
}

// ---------------------------------------------------------------------------
// Closed-loop load
// ---------------------------------------------------------------------------

/// Clients in a closed loop, each on its own keep-alive connection, counting every answer that is not a 200.
pub struct Load {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    clients: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(addr: std::net::SocketAddr, clients: usize, path: &'static str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let clients = (0..clients)
            .map(|_| {
                let (stop, served, failed) = (stop.clone(), served.clone(), failed.clone());
                tokio::spawn(async move {
                    let mut conn = H1Conn::connect(addr).await;
                    while !stop.load(Ordering::SeqCst) {
                        match conn.try_get(path).await {
                            Ok(resp) if resp.status == StatusCode::OK => {
                                served.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(resp) => failed.lock().unwrap().push(format!("{} {}", resp.status, resp.text())),
                            Err(err) => {
                                failed.lock().unwrap().push(err.to_string());
                                conn = H1Conn::connect(addr).await;
                            }
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            served,
            failed,
            clients,
        }
    }

    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    /// Waits until `more` further requests have been served.
    pub async fn serve_more(&self, more: usize) {
        let target = self.served() + more;
        wait_until_sync(&format!("{more} more requests served"), Duration::from_secs(10), || {
            self.served() >= target
        })
        .await;
    }

    /// Stops the clients after their current request, failing the test when any answer was not a 200.
    pub async fn finish_without_failures(self) {
        self.stop.store(true, Ordering::SeqCst);
        for client in self.clients {
            client.await.unwrap();
        }
        let failed = self.failed.lock().unwrap();
        let served = self.served.load(Ordering::SeqCst);
        assert!(
            failed.is_empty(),
            "{} failed of {}: {:?}",
            failed.len(),
            served + failed.len(),
            &failed[..failed.len().min(5)]
        );
    }
}
