//! A real gRPC server and client for tests/grpc.rs, both tonic, with no protobuf: messages are raw bytes
//! ([`RawCodec`]) and the server routes by path by hand ([`Router`]).
//!
//! [`ProbeServer`] is tonic's own server (`tonic::transport::Server`) on a listener whose accepted sockets are
//! counted ([`Counted`]), and it counts its RPCs exactly: a guard made when a handler starts and dropped when the
//! handler's future, or the response stream it returned, ends or is dropped. Both counts keep their peaks. Its
//! methods (service `floodgate.test.Probe`):
//!
//! * `Sleep` (unary): answers its request (milliseconds, in decimal) after sleeping that long.
//! * `Hold` (unary): answers once the test calls [`ProbeServer::release`].
//! * `Fail` (unary): answers `NOT_FOUND` naming its request, a trailers-only answer (the status in the head).
//! * `FailAfter` (server streaming): sends its request back, then ends with `NOT_FOUND`: the status in trailers.
//! * `Sum` (client streaming): adds up the numbers it is sent.
//! * `Ticks` (server streaming): sends `0`..`n` (`n` in the request), tick `k` only once the client has said it
//!   has tick `k - 1` ([`ProbeServer::ack`]) and then a pause of [`TICK_PAUSE`].
//! * `Echo` (bidirectional): sends each message back as it comes.
//!
//! Clients: [`channel`] is tonic's `Channel`, what applications use; [`bare_client`] is tonic's client over one
//! plain hyper HTTP/2 connection, for the one test where Channel's own timer must not run (it enforces a call's
//! `grpc-timeout` itself and reports its expiry as `CANCELLED`).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, Stream};
use http::uri::PathAndQuery;
use http::Uri;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::body::Body;
use tonic::server::Grpc;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status, Streaming};
use tower_service::Service;

pub const SLEEP: &str = "/floodgate.test.Probe/Sleep";
pub const HOLD: &str = "/floodgate.test.Probe/Hold";
pub const FAIL: &str = "/floodgate.test.Probe/Fail";
pub const FAIL_AFTER: &str = "/floodgate.test.Probe/FailAfter";
pub const SUM: &str = "/floodgate.test.Probe/Sum";
pub const TICKS: &str = "/floodgate.test.Probe/Ticks";
pub const ECHO: &str = "/floodgate.test.Probe/Echo";

/// The pause before each tick after the first.
pub const TICK_PAUSE: Duration = Duration::from_millis(20);

/// A method's path, as tonic's client takes it.
pub fn path(method: &'static str) -> PathAndQuery {
    PathAndQuery::from_static(method)
}

/// Messages as they are, the bytes of a gRPC message: the benchmark's codec (`examples/support/raw_codec.rs`).
#[allow(dead_code)]
#[path = "../../examples/support/raw_codec.rs"]
mod raw_codec;
pub use raw_codec::RawCodec;

/// A message's bytes read as a decimal number.
pub fn number(message: &[u8]) -> Result<u64, Status> {
    std::str::from_utf8(message)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| Status::invalid_argument(format!("not a number: {message:?}")))
}

#[derive(Default)]
struct Counts {
    conns_now: AtomicUsize,
    conns_peak: AtomicUsize,
    accepted: AtomicUsize,
    rpcs_now: AtomicUsize,
    rpcs_peak: AtomicUsize,
    started: AtomicUsize,
}

/// Counts one up and keeps the peak.
fn up(now: &AtomicUsize, peak: &AtomicUsize) {
    let value = now.fetch_add(1, Ordering::SeqCst) + 1;
    peak.fetch_max(value, Ordering::SeqCst);
}

struct Shared {
    counts: Counts,
    released: watch::Sender<bool>,
    acked: watch::Sender<u64>,
}

impl Shared {
    /// A handler has started: counted until the guard is dropped.
    fn rpc(self: &Arc<Self>) -> RpcGuard {
        self.counts.started.fetch_add(1, Ordering::SeqCst);
        up(&self.counts.rpcs_now, &self.counts.rpcs_peak);
        RpcGuard(self.clone())
    }
}

struct RpcGuard(Arc<Shared>);

impl Drop for RpcGuard {
    fn drop(&mut self) {
        self.0.counts.rpcs_now.fetch_sub(1, Ordering::SeqCst);
    }
}

struct ConnGuard(Arc<Shared>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.counts.conns_now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An accepted socket, counted until tonic's server drops it.
pub struct Counted {
    stream: TcpStream,
    _guard: ConnGuard,
}

impl Connected for Counted {
    type ConnectInfo = ();

    fn connect_info(&self) {}
}

impl AsyncRead for Counted {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// tonic's gRPC server with the methods above; stopped on drop.
pub struct ProbeServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for ProbeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ProbeServer {
    pub async fn start() -> ProbeServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding the gRPC server");
        let addr = listener.local_addr().expect("its address");
        let shared = Arc::new(Shared {
            counts: Counts::default(),
            released: watch::Sender::new(false),
            acked: watch::Sender::new(0),
        });
        let incoming = stream::unfold((listener, shared.clone()), |(listener, shared)| async move {
            let accepted = listener.accept().await.map(|(stream, _)| {
                shared.counts.accepted.fetch_add(1, Ordering::SeqCst);
                up(&shared.counts.conns_now, &shared.counts.conns_peak);
                Counted {
                    stream,
                    _guard: ConnGuard(shared.clone()),
                }
            });
            Some((accepted, (listener, shared)))
        });
        let router = Router(shared.clone());
        let task = tokio::spawn(async move {
            if let Err(error) = Server::builder().serve_with_incoming(router, incoming).await {
                panic!("the gRPC server failed: {error}");
            }
        });
        ProbeServer { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn peak_connections(&self) -> usize {
        self.shared.counts.conns_peak.load(Ordering::SeqCst)
    }

    /// TCP connections accepted in all.
    pub fn accepted(&self) -> usize {
        self.shared.counts.accepted.load(Ordering::SeqCst)
    }

    /// Handlers at work now (their future or their response stream not yet over).
    pub fn rpcs(&self) -> usize {
        self.shared.counts.rpcs_now.load(Ordering::SeqCst)
    }

    pub fn peak_rpcs(&self) -> usize {
        self.shared.counts.rpcs_peak.load(Ordering::SeqCst)
    }

    /// Handlers started in all.
    pub fn started(&self) -> usize {
        self.shared.counts.started.load(Ordering::SeqCst)
    }

    /// Lets every `Hold` call answer, those waiting and those to come.
    pub fn release(&self) {
        self.shared.released.send_replace(true);
    }

    /// The client has ticks `0..count`: tick `count` may go.
    pub fn ack(&self, count: u64) {
        self.shared.acked.send_replace(count);
    }
}

/// A tower service out of a function, as tonic's server takes a handler.
struct Handler<F>(F);

impl<F, R, Fut, M> Service<Request<R>> for Handler<F>
where
    F: FnMut(Request<R>) -> Fut,
    Fut: Future<Output = Result<Response<M>, Status>>,
{
    type Response = Response<M>;
    type Error = Status;
    type Future = Fut;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<R>) -> Fut {
        (self.0)(request)
    }
}

type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

/// The hand-written router: one gRPC method per path.
#[derive(Clone)]
struct Router(Arc<Shared>);

impl Service<http::Request<Body>> for Router {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let shared = self.0.clone();
        Box::pin(async move { Ok(route(shared, request).await) })
    }
}

async fn route(shared: Arc<Shared>, request: http::Request<Body>) -> http::Response<Body> {
    let mut grpc = Grpc::new(RawCodec);
    let path = request.uri().path().to_owned();
    let s = shared;
    match path.as_str() {
        SLEEP => grpc.unary(Handler(|r| sleep(s.clone(), r)), request).await,
        HOLD => grpc.unary(Handler(|r| hold(s.clone(), r)), request).await,
        FAIL => grpc.unary(Handler(|r| fail(s.clone(), r)), request).await,
        FAIL_AFTER => {
            grpc.server_streaming(Handler(|r| fail_after(s.clone(), r)), request)
                .await
        }
        SUM => grpc.client_streaming(Handler(|r| sum(s.clone(), r)), request).await,
        TICKS => grpc.server_streaming(Handler(|r| ticks(s.clone(), r)), request).await,
        ECHO => grpc.streaming(Handler(|r| echo(s.clone(), r)), request).await,
        _ => Status::unimplemented(format!("no method {path}")).into_http(),
    }
}

async fn sleep(shared: Arc<Shared>, request: Request<Bytes>) -> Result<Response<Bytes>, Status> {
    let _rpc = shared.rpc();
    let message = request.into_inner();
    tokio::time::sleep(Duration::from_millis(number(&message)?)).await;
    Ok(Response::new(message))
}

async fn hold(shared: Arc<Shared>, request: Request<Bytes>) -> Result<Response<Bytes>, Status> {
    let _rpc = shared.rpc();
    let mut released = shared.released.subscribe();
    // The sender lives in `shared`, which this handler holds: the wait ends only when released.
    let _ = released.wait_for(|released| *released).await;
    Ok(Response::new(request.into_inner()))
}

async fn fail(shared: Arc<Shared>, request: Request<Bytes>) -> Result<Response<Bytes>, Status> {
    let _rpc = shared.rpc();
    let name = String::from_utf8_lossy(&request.into_inner()).into_owned();
    Err(Status::not_found(format!("no record named {name}")))
}

async fn fail_after(shared: Arc<Shared>, request: Request<Bytes>) -> Result<Response<ByteStream>, Status> {
    let rpc = shared.rpc();
    let message = request.into_inner();
    let name = String::from_utf8_lossy(&message).into_owned();
    let items = vec![
        Ok(message),
        Err(Status::not_found(format!("no more records after {name}"))),
    ];
    // The guard goes with the stream, dropped once its last item is taken.
    let answers = stream::unfold((items.into_iter(), Some(rpc)), |(mut items, mut rpc)| async move {
        let item = items.next()?;
        if items.as_slice().is_empty() {
            drop(rpc.take());
        }
        Some((item, (items, rpc)))
    });
    Ok(Response::new(Box::pin(answers) as ByteStream))
}

async fn sum(shared: Arc<Shared>, request: Request<Streaming<Bytes>>) -> Result<Response<Bytes>, Status> {
    let _rpc = shared.rpc();
    let mut numbers = request.into_inner();
    let mut total = 0;
    while let Some(message) = numbers.message().await? {
        total += number(&message)?;
    }
    Ok(Response::new(Bytes::from(total.to_string())))
}

async fn ticks(shared: Arc<Shared>, request: Request<Bytes>) -> Result<Response<ByteStream>, Status> {
    let rpc = shared.rpc();
    let count = number(&request.into_inner())?;
    let answers = stream::unfold((0, Some(rpc)), move |(tick, mut rpc)| {
        let shared = shared.clone();
        async move {
            if tick == count {
                drop(rpc.take());
                return None;
            }
            if tick > 0 {
                let mut acked = shared.acked.subscribe();
                let _ = acked.wait_for(|acked| *acked >= tick).await;
                tokio::time::sleep(TICK_PAUSE).await;
            }
            Some((Ok(Bytes::from(tick.to_string())), (tick + 1, rpc)))
        }
    });
    Ok(Response::new(Box::pin(answers) as ByteStream))
}

async fn echo(shared: Arc<Shared>, request: Request<Streaming<Bytes>>) -> Result<Response<ByteStream>, Status> {
    let rpc = shared.rpc();
    let incoming = request.into_inner();
    let answers = stream::unfold(Some((incoming, rpc)), |state| async move {
        let (mut incoming, rpc) = state?;
        match incoming.message().await {
            Ok(Some(message)) => Some((Ok(message), Some((incoming, rpc)))),
            // The request stream is over: so is the call, and its guard goes before the trailers do.
            Ok(None) => None,
            Err(status) => {
                drop(rpc);
                Some((Err(status), None))
            }
        }
    });
    Ok(Response::new(Box::pin(answers) as ByteStream))
}

/// tonic's `Channel` to `addr`: one HTTP/2 connection (cleartext, prior knowledge), as applications use it.
pub async fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("an endpoint")
        .connect()
        .await
        .expect("connecting a Channel")
}

/// tonic's gRPC client over one hyper HTTP/2 connection to `addr`, without Channel's layers (its timer above all).
pub async fn bare_client(addr: SocketAddr) -> tonic::client::Grpc<BareH2> {
    let stream = TcpStream::connect(addr).await.expect("connecting");
    let (send, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .expect("an HTTP/2 handshake");
    tokio::spawn(connection);
    let origin: Uri = format!("http://{addr}").parse().expect("a URI");
    tonic::client::Grpc::with_origin(BareH2(send), origin)
}

/// One HTTP/2 connection as the service tonic's client sends its calls through.
#[derive(Clone)]
pub struct BareH2(hyper::client::conn::http2::SendRequest<Body>);

impl Service<http::Request<Body>> for BareH2 {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, hyper::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.0.send_request(request))
    }
}
