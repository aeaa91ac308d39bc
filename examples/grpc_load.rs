//! A closed-loop gRPC load generator for `benches/grpc.sh`: `--clients C` callers spread over `--connections K`
//! HTTP/2 connections (tonic Channels, one TCP connection each; default C / 10), each calling
//! `/bench.Echo/Call` (`examples/grpc_upstream.rs`) again as soon as its last call ended, for `--seconds D`.
//!
//! Every call carries a deadline (`--deadline-ms`, 2,000 by default) as `grpc-timeout`, which tonic's client also
//! enforces. The outcomes of the calls that ended inside the window are counted: OK; UNAVAILABLE with
//! `grpc-retry-pushback-ms` (a proxy's shed, gRFC A6); UNAVAILABLE without it (a bodiless 503 maps to it; one
//! with an HTML page fails as INTERNAL); DEADLINE_EXCEEDED (the client's own expiry, which tonic reports as
//! CANCELLED "Timeout expired", counts here too); anything else, by code. `samples` gives the first message of
//! each failing kind, with the errors under it. Calls still running when the window closes are awaited, so the
//! proxy has its answers in when this exits, and counted as `late` only. Latency p50/p99 are of the OK calls, in
//! µs. One JSON line on stdout.
//!
//! A request's body goes out as tonic frames it: the message's DATA frame, then an empty DATA frame with
//! END_STREAM. `--one-buffer` collects it into one buffer first, so END_STREAM rides on the message's DATA frame
//! instead (the two ways a client may end a unary call's stream; a proxy must pass on both).
//!
//! ```sh
//! cargo run --release --example grpc_load -- --target 127.0.0.1:8080 --clients 200 --seconds 5
//! ```

#[path = "support/raw_codec.rs"]
mod raw_codec;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use raw_codec::{RawCodec, ECHO_PATH};
use tonic::body::Body;
use tonic::client::Grpc;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

#[derive(Parser)]
#[command(about = "A closed-loop gRPC load generator for benches/grpc.sh")]
struct Args {
    /// host:port of the proxy (or the upstream).
    #[arg(long)]
    target: String,
    /// Concurrent callers.
    #[arg(long, default_value_t = 200)]
    clients: usize,
    /// HTTP/2 connections the callers share (default: clients / 10, at least 1).
    #[arg(long)]
    connections: Option<usize>,
    /// Length of the window, in seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Every call's deadline, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    deadline_ms: u64,
    /// Bytes in every request message (echoed back).
    #[arg(long, default_value_t = 64)]
    payload_bytes: usize,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// End each request's stream on the message's DATA frame, not on an empty DATA frame after it.
    #[arg(long)]
    one_buffer: bool,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The connection a caller's calls go over: a tonic Channel (one HTTP/2 connection), with each request body
/// collected into one buffer first if `one_buffer`.
#[derive(Clone)]
struct Transport {
    channel: Channel,
    one_buffer: bool,
}

impl tower_service::Service<http::Request<Body>> for Transport {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.channel.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The readied channel (its buffer slot) goes with this call; a fresh clone stays for the next.
        let fresh = self.channel.clone();
        let mut channel = std::mem::replace(&mut self.channel, fresh);
        let one_buffer = self.one_buffer;
        Box::pin(async move {
            let request = if one_buffer {
                let (parts, body) = request.into_parts();
                let whole = body.collect().await?.to_bytes();
                http::Request::from_parts(parts, Body::new(Full::new(whole)))
            } else {
                request
            };
            Ok(channel.call(request).await?)
        })
    }
}

/// One caller's counts; merged at the end.
struct Tally {
    ok: u64,
    shed: u64,
    unavailable: u64,
    deadline: u64,
    other: BTreeMap<String, u64>,
    late: u64,
    latency_us: Histogram<u64>,
    /// The first message seen of each failing kind, to say what the failures were.
    samples: BTreeMap<&'static str, String>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            ok: 0,
            shed: 0,
            unavailable: 0,
            deadline: 0,
            other: BTreeMap::new(),
            late: 0,
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds"),
            samples: BTreeMap::new(),
        }
    }

    fn count(&mut self, outcome: Result<(), Status>, took: Duration) {
        match outcome {
            Ok(()) => {
                self.ok += 1;
                self.latency_us.saturating_record(took.as_micros() as u64);
            }
            Err(status) => {
                let kind = match status.code() {
                    Code::Unavailable if status.metadata().get("grpc-retry-pushback-ms").is_some() => {
                        self.shed += 1;
                        "shed"
                    }
                    Code::Unavailable => {
                        self.unavailable += 1;
                        "unavailable"
                    }
                    Code::DeadlineExceeded => {
                        self.deadline += 1;
                        "deadline"
                    }
                    Code::Cancelled if status.message().contains("Timeout expired") => {
                        self.deadline += 1;
                        "deadline"
                    }
                    code => {
                        *self.other.entry(format!("{code:?}")).or_default() += 1;
                        "other"
                    }
                };
                self.samples.entry(kind).or_insert_with(|| describe(&status));
            }
        }
    }

    fn merge(&mut self, other: Tally) {
        self.ok += other.ok;
        self.shed += other.shed;
        self.unavailable += other.unavailable;
        self.deadline += other.deadline;
        self.late += other.late;
        for (code, n) in other.other {
            *self.other.entry(code).or_default() += n;
        }
        self.latency_us.add(&other.latency_us).expect("same bounds");
        for (kind, message) in other.samples {
            self.samples.entry(kind).or_insert(message);
        }
    }
}

/// A status's code and message, and the errors under it (what a transport error was).
fn describe(status: &Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        text.push_str(&format!(": {error}"));
        source = error.source();
    }
    text
}

/// Calls until `end`, one at a time.
async fn caller(transport: Transport, payload: Bytes, deadline: Duration, end: Instant) -> Tally {
    let mut tally = Tally::new();
    let mut client = Grpc::new(transport);
    let path = PathAndQuery::from_static(ECHO_PATH);
    while Instant::now() < end {
        let started = Instant::now();
        let mut request = tonic::Request::new(payload.clone());
        request.set_timeout(deadline);
        let outcome = match client.ready().await {
            Ok(()) => client.unary(request, path.clone(), RawCodec).await.map(|_| ()),
            Err(error) => Err(Status::unknown(format!("not ready: {error}"))),
        };
        if Instant::now() > end {
            tally.late += 1;
        } else {
            tally.count(outcome, started.elapsed());
        }
    }
    tally
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
    let connections = args
        .connections
        .unwrap_or(args.clients / 10)
        .clamp(1, args.clients.max(1));
    let endpoint = Endpoint::from_shared(format!("http://{}", args.target))?.tcp_nodelay(true);
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        channels.push(endpoint.connect().await?);
    }
    let payload = Bytes::from(vec![b'x'; args.payload_bytes]);
    let deadline = Duration::from_millis(args.deadline_ms);
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(args.seconds);
    let callers: Vec<_> = (0..args.clients)
        .map(|i| {
            let transport = Transport {
                channel: channels[i % connections].clone(),
                one_buffer: args.one_buffer,
            };
            tokio::spawn(caller(transport, payload.clone(), deadline, end))
        })
        .collect();
    let mut total = Tally::new();
    for caller in callers {
        total.merge(caller.await?);
    }
    let window = args.seconds;
    let quantile = |q| (total.ok > 0).then(|| total.latency_us.value_at_quantile(q));
    let line = serde_json::json!({
        "clients": args.clients,
        "connections": connections,
        "seconds": window,
        "ok": total.ok,
        "ok_per_s": total.ok as f64 / window,
        "shed": total.shed,
        "unavailable": total.unavailable,
        "deadline": total.deadline,
        "other": total.other.values().sum::<u64>(),
        "other_codes": total.other,
        "late": total.late,
        "samples": total.samples,
        "p50_us": quantile(0.5),
        "p99_us": quantile(0.99),
        "drained_s": started.elapsed().as_secs_f64() - window,
        "one_buffer": args.one_buffer,
    });
    println!("{line}");
    Ok(())
}
