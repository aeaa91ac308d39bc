//! An HTTP/2 origin (hyper's server, cleartext with prior knowledge) that counts its TCP connections and the
//! requests at work in it exactly: a request counts from the moment its handler starts until the handler is
//! dropped (its answer sent whole, or its stream reset by the client).
//!
//! Paths: `/sleep/MS` answers after MS milliseconds; `/trailers` answers a body and a `grpc-status: 0` trailer;
//! `/hold` answers only when the test releases it ([`H2Upstream::release`]); anything else answers at once.

use super::*;

#[derive(Default)]
struct Counts {
    conns_now: AtomicUsize,
    conns_peak: AtomicUsize,
    accepted: AtomicUsize,
    at_work: AtomicUsize,
    at_work_peak: AtomicUsize,
    requests: AtomicUsize,
    /// Handlers dropped before they answered: their streams were reset.
    reset: AtomicUsize,
    released: Notify,
}

/// Counts one up and keeps the peak.
fn up(now: &AtomicUsize, peak: &AtomicUsize) {
    let value = now.fetch_add(1, Ordering::SeqCst) + 1;
    peak.fetch_max(value, Ordering::SeqCst);
}

struct AtWork(Arc<Counts>, bool);

impl Drop for AtWork {
    fn drop(&mut self) {
        self.0.at_work.fetch_sub(1, Ordering::SeqCst);
        if !self.1 {
            self.0.reset.fetch_add(1, Ordering::SeqCst);
        }
    }
}

struct ConnCounted(Arc<Counts>);

impl Drop for ConnCounted {
    fn drop(&mut self) {
        self.0.conns_now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The server's end of a connection: it stops counting as it sends its FIN (or is dropped), all a proxy can see
/// before it may dial a replacement.
struct CountedStream {
    inner: TcpStream,
    counted: Option<ConnCounted>,
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
        self.counted = None;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

pub struct H2Upstream {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl Drop for H2Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl H2Upstream {
    /// Listens on an ephemeral port; each connection allows `max_streams` concurrent streams.
    pub async fn start(max_streams: u32) -> H2Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let shared = counts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                up(&shared.conns_now, &shared.conns_peak);
                let stream = CountedStream {
                    inner: stream,
                    counted: Some(ConnCounted(shared.clone())),
                };
                let counts = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let counts = counts.clone();
                        async move { Ok::<_, Infallible>(answer(counts, request).await) }
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(max_streams)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        H2Upstream { addr, counts, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn connections(&self) -> usize {
        self.counts.conns_now.load(Ordering::SeqCst)
    }

    pub fn peak_connections(&self) -> usize {
        self.counts.conns_peak.load(Ordering::SeqCst)
    }

    pub fn accepted(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    pub fn at_work(&self) -> usize {
        self.counts.at_work.load(Ordering::SeqCst)
    }

    pub fn peak_at_work(&self) -> usize {
        self.counts.at_work_peak.load(Ordering::SeqCst)
    }

    /// Starts the peak of requests at work again from those at work now.
    pub fn reset_peak_at_work(&self) {
        self.counts.at_work_peak.store(self.at_work(), Ordering::SeqCst);
    }

    pub fn requests(&self) -> usize {
        self.counts.requests.load(Ordering::SeqCst)
    }

    pub fn resets(&self) -> usize {
        self.counts.reset.load(Ordering::SeqCst)
    }

    /// Lets every `/hold` request waiting now answer.
    pub fn release(&self) {
        self.counts.released.notify_waiters();
    }
}

async fn answer(counts: Arc<Counts>, request: Request<Incoming>) -> Response<UpstreamBody> {
    counts.requests.fetch_add(1, Ordering::SeqCst);
    up(&counts.at_work, &counts.at_work_peak);
    let mut at_work = AtWork(counts.clone(), false);
    let path = request.uri().path().to_owned();
    let version = format!("{:?}", request.version());
    if let Some(ms) = path.strip_prefix("/sleep/").and_then(|ms| ms.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    } else if path == "/hold" {
        counts.released.notified().await;
    }
    let body: UpstreamBody = if path == "/trailers" {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"payload"))),
            Ok(Frame::trailers(trailers)),
        ];
        http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
    } else {
        Full::new(Bytes::from(format!("{path} over {version}")))
            .map_err(|never| match never {})
            .boxed_unsync()
    };
    at_work.1 = true;
    // Counted until the handler is dropped: hyper drops it once the answer's head is handed on.
    drop(at_work);
    Response::new(body)
}
