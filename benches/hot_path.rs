//! Rough timings of the proxy's hot path, run by `cargo bench` (no external harness: each case is timed over
//! many iterations and reported as ns per operation). Side-by-side comparisons with other proxies live in the
//! load stand; these numbers are for spotting regressions in one place at a time.

use std::hint::black_box;
use std::time::{Duration, Instant};

use floodgate::admission::WaitQueue;
use floodgate::config::{Origin, UpstreamConfig};
use floodgate::forward::strip_hop_by_hop;
use floodgate::metrics::Metrics;
use floodgate::pool::UpstreamPool;
use http::{HeaderMap, HeaderValue};

fn time(name: &str, iterations: u32, mut op: impl FnMut()) {
    for _ in 0..iterations / 10 {
        op();
    }
    let start = Instant::now();
    for _ in 0..iterations {
        op();
    }
    let per_op = start.elapsed().as_nanos() as f64 / f64::from(iterations);
    println!("{name:<40} {per_op:>10.1} ns/op");
}

fn main() {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => return eprintln!("cannot start a runtime: {err}"),
    };

    time("admission queue join + pop", 1_000_000, || {
        let mut queue: WaitQueue<u32> = WaitQueue::new(16);
        let ticket = queue.join(false);
        black_box(queue.pop_oldest());
        black_box(ticket.is_ok());
    });

    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("host", "example.com"),
        ("user-agent", "bench/1"),
        ("accept", "*/*"),
        ("connection", "keep-alive, x-trace"),
        ("keep-alive", "timeout=5"),
        ("x-trace", "abc"),
        ("cookie", "a=b; c=d"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    time("strip hop-by-hop headers (7 headers)", 500_000, || {
        let mut copy = headers.clone();
        strip_hop_by_hop(&mut copy);
        black_box(copy);
    });

    runtime.block_on(async {
        let origin = Origin {
            host: "127.0.0.1".into(),
            port: 9,
        };
        let metrics = Metrics::new();
        let pool = UpstreamPool::new("bench", origin, UpstreamConfig::default(), metrics.upstream("bench"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
        // A slot is free, so admission takes the fast path; dropping the lease frees the slot again.
        let iterations = 500_000u32;
        let start = Instant::now();
        for _ in 0..iterations {
            let lease = pool.admit(false, deadline, std::future::pending()).await;
            black_box(lease.is_ok());
        }
        let per_op = start.elapsed().as_nanos() as f64 / f64::from(iterations);
        println!("{:<40} {per_op:>10.1} ns/op", "admission fast path (admit + release)");
    });
}
