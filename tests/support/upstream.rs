//! The counting upstream: a hyper HTTP/1.1 origin server that counts its TCP connections and requests exactly
//! and whose behaviour is chosen by path.

use super::*;

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

pub(super) struct ConnInfo {
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
    pub(super) fn count_closed(&self, shared: &UpstreamShared) {
        if self.counted.swap(false, Ordering::SeqCst) {
            shared.conns_now.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

pub(super) struct UpstreamShared {
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
pub(super) struct ConnGuard(Arc<UpstreamShared>, Arc<ConnInfo>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.1.count_closed(&self.0);
    }
}

/// The upstream's end of a connection. It stops counting the connection just before it sends its FIN: from
/// then on the upstream has closed its side, which is all a proxy can observe before dialling a replacement (the
/// connection task itself may finish a little later, and counting until then would report a scheduling lag of
/// this process as an overlap).
pub(super) struct CountedStream {
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

pub(super) struct InflightGuard(Arc<UpstreamShared>);

impl InflightGuard {
    pub(super) fn new(shared: &Arc<UpstreamShared>) -> Self {
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
    /// Listen on every address (0.0.0.0), so that 127.0.0.1 and 127.0.0.2 are two addresses of one upstream.
    pub any_address: bool,
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

pub(super) const COMMANDS: &[&str] = &[
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
pub(super) fn bound_socket(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

pub(super) fn bind_listener(addr: SocketAddr, send_buffer: Option<u32>) -> std::io::Result<TcpListener> {
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
        let ip = if opts.any_address { "0.0.0.0" } else { "127.0.0.1" };
        let listener = bind_listener(format!("{ip}:0").parse().unwrap(), opts.send_buffer).expect("bind test upstream");
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

    pub(super) fn spawn_accept(&self, listener: TcpListener) {
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

pub(super) async fn sleep_until_or_never(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

pub(super) async fn serve_connection(
    stream: TcpStream,
    shared: Arc<UpstreamShared>,
    info: Arc<ConnInfo>,
    _guard: ConnGuard,
) {
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
pub(super) async fn reset_connection(
    shared: &Arc<UpstreamShared>,
    info: &Arc<ConnInfo>,
) -> Result<Response<UpstreamBody>, Infallible> {
    shared.resets.fetch_add(1, Ordering::SeqCst);
    info.reset.store(true, Ordering::SeqCst);
    info.kill.notify_one();
    std::future::pending().await
}

pub(super) fn octet_stream(body: UpstreamBody) -> Response<UpstreamBody> {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    resp
}

pub(super) const TRICKLE_CHUNK: u64 = 16;

/// `/trickle`: one small chunk every `every`.
pub(super) struct TrickleBody {
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
pub(super) struct CutBody {
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

pub(super) fn text_response(status: StatusCode, text: &str) -> Response<UpstreamBody> {
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

pub(super) fn empty_response(status: StatusCode) -> Response<UpstreamBody> {
    let mut resp = Response::new(Empty::new().map_err(|e| match e {}).boxed_unsync());
    *resp.status_mut() = status;
    resp
}

pub(super) fn version_str(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "?",
    }
}

pub(super) async fn handle(
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

pub(super) async fn route(
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
