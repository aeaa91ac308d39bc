//! The adaptive concurrency limit through the real binary: against an upstream whose response time rises past a
//! knee, the limit settles near the knee and the upstream sees that many requests at once instead of the cap,
//! with nothing shed; off, the upstream sees the cap. Bands, not exact values: the machine is shared.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const CAP: usize = 32;
const CLIENTS: usize = 40;
const KNEE: usize = 4;
/// The knee upstream's time per request at or below the knee.
const BASE_MS: u64 = 20;

fn config(url: &str, adaptive: &str) -> String {
    format!(
        "[upstreams.a]\nurl = \"{url}\"\nmax_connections = {CAP}\nmax_queue = 1024\nqueue_timeout = \"30s\"\n\
         adaptive_limit = \"{adaptive}\"\n\n[[routes]]\nupstream = \"a\"\n"
    )
}

/// What a closed-loop run saw.
struct Run {
    answered: usize,
    not_ok: usize,
    /// The limit in force, read from /status every 100 ms after the warm-up.
    limits: Vec<u64>,
    /// Most requests in flight at the upstream after the warm-up.
    peak_after_warm_up: usize,
}

/// `CLIENTS` clients, each sending `/knee/KNEE/BASE_MS` again as soon as it has its answer, for `warm_up` and
/// then `measured`.
async fn closed_loop(proxy: &Proxy, upstream: &Upstream, warm_up: Duration, measured: Duration) -> Run {
    let end = Instant::now() + warm_up + measured;
    let answered = Arc::new(AtomicUsize::new(0));
    let not_ok = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (addr, answered, not_ok) = (proxy.listen, answered.clone(), not_ok.clone());
        clients.push(tokio::spawn(async move {
            let mut conn = H1Conn::connect(addr).await;
            let path = format!("/knee/{KNEE}/{BASE_MS}");
            while Instant::now() < end {
                let resp = conn.get(&path).await;
                answered.fetch_add(1, Ordering::SeqCst);
                if resp.status != StatusCode::OK {
                    not_ok.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    tokio::time::sleep(warm_up).await;
    upstream.reset_peak_inflight();
    let mut limits = Vec::new();
    while Instant::now() < end {
        limits.push(proxy.upstream_field("a", "limit").await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for client in clients {
        client.await.unwrap();
    }
    Run {
        answered: answered.load(Ordering::SeqCst),
        not_ok: not_ok.load(Ordering::SeqCst),
        limits,
        peak_after_warm_up: upstream.peak_inflight(),
    }
}

#[tokio::test]
async fn the_adaptive_limit_settles_near_the_upstreams_knee_and_sheds_nothing_while_off_the_upstream_sees_the_cap() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(&upstream.url(), "gradient"));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let run = closed_loop(&proxy, &upstream, Duration::from_secs(3), Duration::from_secs(2)).await;
    eprintln!(
        "adaptive: {} answered, limits after warm-up {:?}, upstream peak in flight {}",
        run.answered, run.limits, run.peak_after_warm_up
    );
    assert_eq!(run.not_ok, 0, "requests shed or failed with a queue large enough");
    assert!(!run.limits.is_empty());
    // The knee is 4; the estimate's fixed point is 1.5 × 4 + √limit ≈ 9, and it dips while probing.
    for &limit in &run.limits {
        assert!((2..=14).contains(&limit), "limit {limit} out of band: {:?}", run.limits);
    }
    assert!(
        run.peak_after_warm_up <= 16,
        "the upstream saw {} in flight after the warm-up (cap {CAP})",
        run.peak_after_warm_up
    );
    let status = proxy.upstream_status("a").await;
    let adaptive = &status["adaptive"];
    assert!(adaptive["rtt_baseline_seconds"].as_f64().unwrap_or(0.0) >= BASE_MS as f64 / 1000.0);
    assert!(adaptive["rtt_short_seconds"].as_f64().unwrap_or(0.0) > 0.0);
    let metrics = proxy.metrics().await;
    let samples = parse_metrics(&metrics);
    let limit = metric_sum(&samples, "floodgate_adaptive_limit", &[("upstream", "a")]);
    assert!((2.0..=14.0).contains(&limit), "floodgate_adaptive_limit {limit}");
    for kind in ["short", "baseline"] {
        let rtt = metric_sum(
            &samples,
            "floodgate_adaptive_rtt_seconds",
            &[("upstream", "a"), ("kind", kind)],
        );
        assert!(rtt > 0.0, "floodgate_adaptive_rtt_seconds{{kind={kind}}} {rtt}");
    }
    // The limit bounds requests in flight, not connections: those opened stay open, idle or busy.
    assert!(
        status["connections_open"].as_u64().unwrap_or(0) >= run.peak_after_warm_up as u64,
        "{status}"
    );

    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(&upstream.url(), "off"));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let run = closed_loop(&proxy, &upstream, Duration::from_secs(1), Duration::from_secs(1)).await;
    eprintln!(
        "off: {} answered, upstream peak in flight {}",
        run.answered, run.peak_after_warm_up
    );
    assert_eq!(run.not_ok, 0);
    assert_eq!(run.peak_after_warm_up, CAP, "off, the cap is the only bound");
    assert!(run.limits.iter().all(|&limit| limit == CAP as u64), "{:?}", run.limits);
    assert!(proxy.upstream_status("a").await.get("adaptive").is_none());
}

#[tokio::test]
async fn turning_the_adaptive_limit_on_and_off_by_reload_applies_in_place() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(&upstream.url(), "off"));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    assert_eq!(proxy.upstream_field("a", "limit").await, CAP as u64);

    std::fs::write(
        file.path(),
        config(&upstream.url(), "gradient").replace("max_queue", "min_connections = 3\nmax_queue"),
    )
    .unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(resp.text().contains("adaptive_limit"), "{}", resp.text());
    // Turned on, it starts from min_connections.
    assert_eq!(proxy.upstream_field("a", "limit").await, 3);
    // A lowered cap bounds it too.
    let resp = proxy
        .admin_request(http::Method::PUT, "/upstreams/a/max_connections", "2", None)
        .await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(proxy.upstream_field("a", "limit").await, 2);

    std::fs::write(file.path(), config(&upstream.url(), "off")).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(proxy.upstream_field("a", "limit").await, CAP as u64);
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}
