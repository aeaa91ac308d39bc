//! Criterion micro-benchmarks of the proxy's hot path, run by `cargo bench`: admission's fast path, the queued
//! hand-off, pool checkout/return of a real keep-alive connection, and header rewriting. Each calls the library
//! itself; none copies its code. They are for spotting regressions in one piece at a time; side-by-side
//! comparisons with other proxies live in the load stand.
//!
//! Everything async runs on one current-thread runtime, as a request's own steps do on a worker: the figures are
//! the cost of the code, not of moving work between threads. The upstream for the connection benches is a tiny
//! hyper server on loopback, started on that same runtime; it only ever sees the handshake, since checkout and
//! return send no request.

use std::convert::Infallible;
use std::future::{pending, Future};
use std::hint::black_box;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use floodgate::config::{Origin, Scheme, UpstreamConfig};
use floodgate::forward::{strip_hop_by_hop, upstream_head, ClientInfo};
use floodgate::metrics::Metrics;
use floodgate::pool::{Lease, UpstreamPool};
use http::{HeaderValue, Request, Response};
use http_body_util::Empty;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

/// Far enough away that no admission in a bench ever times out.
fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(3600)
}

/// A loopback upstream answering every request with an empty 200, and the count of connections it accepted (so a
/// bench can check it measured the one pooled connection, not a dial per iteration).
async fn start_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let address = listener.local_addr().expect("the listener's address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::Relaxed);
            let answer = service_fn(|_: Request<hyper::body::Incoming>| async {
                Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
            });
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), answer));
        }
    });
    (address, accepted)
}

/// A pool for `port`; it must be made inside the runtime (it spawns its idle-expiry task there).
fn pool(port: u16, max_connections: usize) -> Arc<UpstreamPool> {
    let limits = UpstreamConfig {
        max_connections,
        // Criterion pauses between samples; an idle connection must not expire meanwhile and turn a checkout into
        // a dial.
        idle_timeout: Duration::from_secs(3600),
        ..UpstreamConfig::default()
    };
    let origin = Origin {
        scheme: Scheme::Http,
        host: "127.0.0.1".into(),
        port,
    };
    UpstreamPool::new("bench", origin, limits, None, Metrics::new().upstream("bench"))
}

/// Admits a request that cannot wait (the fast path), panicking if it would have had to.
async fn admit_now(pool: &Arc<UpstreamPool>) -> Lease {
    let mut admission = pin!(pool.admit(false, deadline(), pending()));
    match poll_once(admission.as_mut()).await {
        Some(lease) => lease.expect("admitted"),
        None => panic!("the fast path waited"),
    }
}

/// Dials the pool's first connection and leaves it idle, as after a finished exchange.
async fn with_idle_connection(pool: &Arc<UpstreamPool>) {
    let mut lease = admit_now(pool).await;
    lease.connection().await.expect("dial the loopback upstream");
    drop(lease);
    assert_eq!(pool.snapshot().connections_idle, 1, "the connection did not go idle");
}

/// Polls `future` once; `Some` if it finished.
async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| match future.as_mut().poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// Admission with nothing to wait for: `admit` and dropping the lease, with a free slot (the lease holds the right
/// to dial, which goes straight back) and with an idle connection (which goes back to the idle list).
fn admission_fast_path(c: &mut Criterion) {
    let runtime = runtime();
    let (upstream, accepted) = runtime.block_on(start_upstream());
    let mut group = c.benchmark_group("admission");

    // Made once: reading the clock is not admission's cost.
    let deadline = deadline();
    let free = runtime.block_on(async { pool(upstream.port(), 8) });
    group.bench_function("free_slot", |b| {
        b.to_async(&runtime)
            .iter(|| async { black_box(free.admit(false, deadline, pending()).await) })
    });

    let idle = runtime.block_on(async {
        let idle = pool(upstream.port(), 8);
        with_idle_connection(&idle).await;
        idle
    });
    group.bench_function("idle_connection", |b| {
        b.to_async(&runtime).iter(|| async {
            let lease = idle.admit(false, deadline, pending()).await.expect("admitted");
            // A lease that is not reused was granted a slot: the idle connection was lost and this measured
            // something else.
            assert!(lease.reused(), "admitted without the idle connection");
            black_box(lease)
        })
    });
    group.finish();
    assert_eq!(accepted.load(Ordering::Relaxed), 1, "the idle connection was redialled");
}

/// A request queued behind a full pool (one connection) is handed what the current lease gives back when it ends:
/// join the queue, end the other lease, wake with the grant. Each iteration's waiter holds the lease the next
/// iteration's waiter queues behind. Measured for a slot (no connection yet) and for a live idle connection.
fn queued_hand_off(c: &mut Criterion) {
    let runtime = runtime();
    let (upstream, accepted) = runtime.block_on(start_upstream());
    let mut group = c.benchmark_group("hand_off");

    let slots = runtime.block_on(async { pool(upstream.port(), 1) });
    group.bench_function("slot", |b| {
        b.iter_custom(|iterations| runtime.block_on(hand_off_loop(&slots, iterations, false)))
    });

    let connections = runtime.block_on(async {
        let connections = pool(upstream.port(), 1);
        with_idle_connection(&connections).await;
        connections
    });
    group.bench_function("idle_connection", |b| {
        b.iter_custom(|iterations| runtime.block_on(hand_off_loop(&connections, iterations, true)))
    });
    group.finish();
    assert_eq!(
        accepted.load(Ordering::Relaxed),
        1,
        "the handed-off connection was redialled"
    );
}

async fn hand_off_loop(pool: &Arc<UpstreamPool>, iterations: u64, reused: bool) -> Duration {
    let mut held = admit_now(pool).await;
    let deadline = deadline();
    let start = Instant::now();
    for _ in 0..iterations {
        let mut waiter = pin!(pool.admit(false, deadline, pending()));
        assert!(poll_once(waiter.as_mut()).await.is_none(), "admitted past a full pool");
        drop(held);
        held = waiter.await.expect("handed the lease that ended");
    }
    let elapsed = start.elapsed();
    assert_eq!(held.reused(), reused, "handed the wrong kind of grant");
    drop(held);
    elapsed
}

/// What a request does with the pool around its exchange: admit, take the idle keep-alive connection and wait
/// until hyper says it can send (`Lease::connection`), then give it back by ending the lease.
fn pool_checkout_return(c: &mut Criterion) {
    let runtime = runtime();
    let (upstream, accepted) = runtime.block_on(start_upstream());
    let pool = runtime.block_on(async {
        let pool = pool(upstream.port(), 8);
        with_idle_connection(&pool).await;
        pool
    });
    let deadline = deadline();
    c.bench_function("pool/checkout_return", |b| {
        b.to_async(&runtime).iter(|| async {
            let mut lease = pool.admit(false, deadline, pending()).await.expect("admitted");
            assert!(lease.reused(), "checked out a new connection");
            black_box(
                lease
                    .connection()
                    .await
                    .expect("the idle connection is ready")
                    .is_closed(),
            );
            lease
        })
    });
    assert_eq!(
        accepted.load(Ordering::Relaxed),
        1,
        "the pooled connection was redialled"
    );
}

/// A browser's navigation request as a proxy in front of the app would get it: 18 headers, a `Connection` that
/// names another header, and an `X-Forwarded-For` from an earlier hop.
fn browser_head() -> http::request::Parts {
    let mut builder = Request::get("/products/42?ref=home&utm_source=newsletter");
    for (name, value) in [
        ("host", "shop.example.com"),
        (
            "user-agent",
            "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0",
        ),
        (
            "accept",
            "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8",
        ),
        ("accept-language", "en-GB,en;q=0.7,de;q=0.3"),
        ("accept-encoding", "gzip, deflate, br, zstd"),
        ("referer", "https://shop.example.com/"),
        (
            "cookie",
            "session=9f86d081884c7d659a2feaa0c55ad015; theme=dark; _ga=GA1.2.1234567890.1700000000",
        ),
        ("connection", "keep-alive, x-debug-trace"),
        ("keep-alive", "timeout=5"),
        ("x-debug-trace", "7f3a9c"),
        ("upgrade-insecure-requests", "1"),
        ("sec-fetch-dest", "document"),
        ("sec-fetch-mode", "navigate"),
        ("sec-fetch-site", "same-origin"),
        ("sec-fetch-user", "?1"),
        ("priority", "u=0, i"),
        ("x-forwarded-for", "198.51.100.23, 10.0.0.4"),
        ("x-forwarded-proto", "https"),
    ] {
        builder = builder.header(name, value);
    }
    builder.body(()).expect("a valid request").into_parts().0
}

/// The least a request can be: `GET /` with only a Host.
fn minimal_head() -> http::request::Parts {
    Request::get("/")
        .header("host", "api.internal")
        .body(())
        .expect("a valid request")
        .into_parts()
        .0
}

/// The head rewrite of `to_upstream` (`upstream_head`: Host, hop-by-hop headers, `X-Forwarded-*`, origin form)
/// and `strip_hop_by_hop` alone. The copy of the head each iteration starts from is made outside the timing.
fn header_rewriting(c: &mut Criterion) {
    let peer: SocketAddr = "203.0.113.9:51234".parse().expect("a socket address");
    let untrusted = ClientInfo::new(peer, false, None);
    let trusted = ClientInfo::new(peer, true, None);
    let default_host = HeaderValue::from_static("127.0.0.1:8080");
    let browser = browser_head();
    let minimal = minimal_head();

    // The rewrite must succeed on these heads, or the benches would time the error path.
    let mut check = browser.clone();
    upstream_head(&mut check, &trusted, &default_host).expect("the browser head rewrites");
    assert!(
        !check.headers.contains_key("x-debug-trace"),
        "the header Connection names was kept"
    );
    assert_eq!(
        check.headers.get("x-forwarded-for").map(HeaderValue::as_bytes),
        Some(&b"198.51.100.23, 10.0.0.4, 203.0.113.9"[..])
    );

    let mut group = c.benchmark_group("header_rewrite");
    for (name, head, client) in [
        ("upstream_head/browser_untrusted_peer", &browser, &untrusted),
        ("upstream_head/browser_trusted_peer", &browser, &trusted),
        ("upstream_head/minimal", &minimal, &untrusted),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched_ref(
                || head.clone(),
                |parts| upstream_head(parts, client, &default_host),
                BatchSize::SmallInput,
            )
        });
    }
    for (name, head) in [
        ("strip_hop_by_hop/browser", &browser),
        ("strip_hop_by_hop/minimal", &minimal),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched_ref(|| head.headers.clone(), strip_hop_by_hop, BatchSize::SmallInput)
        });
    }
    group.finish();
}

/// Short warm-up and measurement: ten benches, each a few hundred nanoseconds or less, finish in about a minute
/// on 2 cores with enough samples for a stable median. Command-line options (`--warm-up-time`,
/// `--measurement-time`, `--quick`) override these.
fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(100)
}

criterion_group! {
    name = hot_path;
    config = config();
    targets = admission_fast_path, queued_hand_off, pool_checkout_return, header_rewriting
}
criterion_main!(hot_path);
