//! A counting gRPC upstream for `benches/grpc.sh`: a tonic server (HTTP/2 over cleartext) with one unary method,
//! `/bench.Echo/Call`, that sleeps `--delay-ms` and answers with the bytes it was sent.
//!
//! It counts, exactly, what a proxy in front of it does to it: RPCs at work now, at their peak and in total (from
//! the moment a handler starts until its future is dropped, answered or cancelled), and TCP connections open now,
//! at their peak and in total (from accept until the server drops the socket). Each peak is the maximum over every
//! value its counter took (`fetch_add` returns each one exactly once), not a sample. `--max-streams N` sets the
//! SETTINGS_MAX_CONCURRENT_STREAMS it advertises (none by default: tonic then sets no limit).
//!
//! The counts are served on a control listener of their own, so reading them never shows up in them: any request
//! to it (`curl http://CONTROL/`) gets them as one JSON object. The service time is tokio's timer, which rounds a
//! sleep up to its next millisecond tick (a 20 ms service takes 20-21 ms).
//!
//! ```sh
//! cargo run --release --example grpc_upstream -- --delay-ms 20 --max-streams 4
//! # grpc_upstream ready listen=127.0.0.1:41234 control=127.0.0.1:41235
//! ```

#[path = "support/raw_codec.rs"]
mod raw_codec;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use raw_codec::{RawCodec, ECHO_PATH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::body::Body;
use tonic::server::Grpc;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::Status;

#[derive(Parser)]
#[command(about = "A counting gRPC echo upstream for benches/grpc.sh")]
struct Args {
    /// Where the gRPC server listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where the counts are served.
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
    /// Service time of every RPC, in milliseconds.
    #[arg(long, default_value_t = 20)]
    delay_ms: u64,
    /// SETTINGS_MAX_CONCURRENT_STREAMS advertised on every connection (none: no limit).
    #[arg(long)]
    max_streams: Option<u32>,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// Something counted now, at its peak and in total.
#[derive(Default)]
struct Gauge {
    now: AtomicU64,
    peak: AtomicU64,
    total: AtomicU64,
}

impl Gauge {
    fn hold(self: &Arc<Self>) -> Held {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        self.total.fetch_add(1, Ordering::SeqCst);
        Held(Arc::clone(self))
    }

    fn json(&self) -> String {
        format!(
            r#"{{"now":{},"peak":{},"total":{}}}"#,
            self.now.load(Ordering::SeqCst),
            self.peak.load(Ordering::SeqCst),
            self.total.load(Ordering::SeqCst)
        )
    }
}

/// One unit of a gauge, given back when dropped.
struct Held(Arc<Gauge>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An accepted connection, counted for as long as the server holds it.
struct CountedStream {
    stream: TcpStream,
    _held: Held,
}

impl Connected for CountedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The method: hold an RPC slot, sleep the service time, echo. (tonic's `UnaryService` is implemented for every
/// such tower service.)
#[derive(Clone)]
struct Echo {
    delay: Duration,
    rpcs: Arc<Gauge>,
}

impl tower_service::Service<tonic::Request<Bytes>> for Echo {
    type Response = tonic::Response<Bytes>;
    type Error = Status;
    type Future = BoxFuture<Result<tonic::Response<Bytes>, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let (delay, rpcs) = (self.delay, Arc::clone(&self.rpcs));
        Box::pin(async move {
            let _held = rpcs.hold();
            tokio::time::sleep(delay).await;
            Ok(tonic::Response::new(request.into_inner()))
        })
    }
}

/// The routing, by hand: the one path goes to `Echo`, anything else is UNIMPLEMENTED.
#[derive(Clone)]
struct Router(Echo);

impl tower_service::Service<http::Request<Body>> for Router {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let echo = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != ECHO_PATH {
                return Ok(Status::unimplemented(request.uri().path().to_string()).into_http());
            }
            Ok(Grpc::new(RawCodec).unary(echo, request).await)
        })
    }
}

/// Answers every connection to the control listener with the counts, then closes it.
async fn serve_counts(listener: TcpListener, conns: Arc<Gauge>, rpcs: Arc<Gauge>) {
    while let Ok((mut stream, _)) = listener.accept().await {
        let body = format!(r#"{{"connections":{},"rpcs":{}}}"#, conns.json(), rpcs.json());
        tokio::spawn(async move {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request).await;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len() + 1
            );
            let _ = stream.write_all(format!("{head}{body}\n").as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let (conns, rpcs) = (Arc::new(Gauge::default()), Arc::new(Gauge::default()));
    let listener = TcpListener::bind(args.listen).await?;
    let control = TcpListener::bind(args.control).await?;
    println!(
        "grpc_upstream ready listen={} control={}",
        listener.local_addr()?,
        control.local_addr()?
    );
    tokio::spawn(serve_counts(control, Arc::clone(&conns), Arc::clone(&rpcs)));
    let incoming = futures_util::stream::unfold((listener, conns), |(listener, conns)| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            CountedStream {
                stream,
                _held: conns.hold(),
            }
        });
        Some((accepted, (listener, conns)))
    });
    let router = Router(Echo {
        delay: Duration::from_millis(args.delay_ms),
        rpcs,
    });
    tonic::transport::Server::builder()
        .max_concurrent_streams(args.max_streams)
        .serve_with_incoming(router, incoming)
        .await?;
    Ok(())
}
