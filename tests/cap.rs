//! The core promise: any number of clients in, at most `max_connections`
//! keep-alive connections out per upstream, without churn.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

/// Default upstream name when the proxy is started with `--upstream`.
const UP: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_concurrent_clients_are_served_over_exactly_four_upstream_connections() {
    // One thread: the single-thread runtime the benchmark's floodgate-1 runs on (other tests use the default).
    five_hundred_clients_over_four_connections("1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_threads_share_the_clients_and_still_hold_four_upstream_connections_between_them() {
    let proxy = five_hundred_clients_over_four_connections("4").await;
    // Each thread has its own lane and its own clients: every worker thread woke for its share of them (one that
    // got no connection would have slept since start-up, a switch or two).
    let workers = threads_named(proxy.pid(), "floodgate-worke");
    assert_eq!(workers.len(), 3, "three worker threads beside main's: {workers:?}");
    for (tid, switches) in &workers {
        assert!(
            *switches >= 20,
            "worker thread {tid} served nobody: {switches} wake-ups ({workers:?})"
        );
    }
}

/// Thread id and voluntary context switches of each of `pid`'s threads whose name is `name`.
fn threads_named(pid: u32, name: &str) -> Vec<(String, u64)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the proxy's threads") {
        let task = task.expect("a thread's entry").path();
        let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
        let field = |key: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(key))
                .map(|value| value.trim().to_string())
        };
        if field("Name:").as_deref() == Some(name) {
            let switches = field("voluntary_ctxt_switches:")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let tid = task
                .file_name()
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            found.push((tid, switches));
        }
    }
    found
}

/// 500 clients, all connected before any sends, each asking for a 5 ms answer through a cap of 4, with floodgate
/// on `threads` threads: every one answered, over the same four upstream connections.
async fn five_hundred_clients_over_four_connections(threads: &str) -> Proxy {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(
        &upstream,
        4,
        &["--max-queue", "1000", "--queue-timeout", "20s", "--threads", threads],
    )
    .await;

    // 500 client connections, all open before the first request is sent.
    let mut clients = Vec::with_capacity(500);
    for _ in 0..500 {
        clients.push(H1Conn::connect(proxy.listen).await);
    }
    wait_until(
        "the proxy holds all 500 client connections",
        Duration::from_secs(10),
        || async { proxy.status().await["client_connections"].as_u64().unwrap_or(0) >= 500 },
    )
    .await;
    let mut tasks = Vec::with_capacity(500);
    for (i, mut client) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let result = client.try_get(&format!("/delay/5?client={i}")).await;
            (i, result.map(|r| r.status).map_err(|e| e.to_string()))
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        let (i, result) = task.await.unwrap();
        if result.as_ref().ok() != Some(&StatusCode::OK) {
            failures.push((i, result));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 500 requests not answered 200, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_eq!(upstream.requests(), 500, "upstream saw every request once");
    assert_eq!(upstream.rejected(), 0, "upstream got well-formed requests");
    assert_eq!(upstream.peak_connections(), 4, "upstream peak concurrent connections");
    assert_eq!(
        upstream.accepted(),
        4,
        "exactly 4 upstream connections over the whole test (no churn)"
    );
    assert!(upstream.peak_inflight() <= 4);

    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    let status = proxy.upstream_status(UP).await;
    assert_eq!(status["connections_peak"], 4, "/status: {status}");
    assert_eq!(status["connections_opened_total"], 4, "/status: {status}");
    assert_eq!(status["max_connections"], 4, "/status: {status}");
    assert_eq!(status["queue_depth"], 0, "/status: {status}");
    proxy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_and_connection_close_clients_reuse_the_warm_upstream_connections() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--max-queue", "100"]).await;

    // Warm-up: two concurrent requests open the pool.
    let warm: Vec<_> = (0..2)
        .map(|_| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, "/delay/50").await.status })
        })
        .collect();
    for w in warm {
        assert_eq!(w.await.unwrap(), StatusCode::OK);
    }
    let warm_accepted = upstream.accepted();
    assert!((1..=2).contains(&warm_accepted));

    let mut tasks = Vec::new();
    for i in 0..20 {
        let addr = proxy.listen;
        tasks.push(tokio::spawn(async move {
            // HTTP/1.0, no keep-alive: the proxy closes the client side.
            let req = format!("GET /delay/2?http10={i} HTTP/1.0\r\nHost: client.test\r\n\r\n");
            let (data, end) = raw_exchange(addr, req.as_bytes(), Duration::from_secs(10)).await;
            assert_eq!(end, ReadEnd::Eof, "HTTP/1.0 response is closed by the proxy");
            assert_eq!(first_status(&data), Some(200), "{:?}", String::from_utf8_lossy(&data));
        }));
        let addr = proxy.listen;
        tasks.push(tokio::spawn(async move {
            let req = format!("GET /delay/2?close={i} HTTP/1.1\r\nHost: client.test\r\nConnection: close\r\n\r\n");
            let (data, end) = raw_exchange(addr, req.as_bytes(), Duration::from_secs(10)).await;
            assert_eq!(end, ReadEnd::Eof, "Connection: close is honoured");
            assert_eq!(first_status(&data), Some(200), "{:?}", String::from_utf8_lossy(&data));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    assert_eq!(
        upstream.accepted(),
        warm_accepted,
        "closing clients must not close upstream connections"
    );
    let seen: Vec<_> = upstream
        .recorded()
        .into_iter()
        .filter(|r| r.uri.contains("http10=") || r.uri.contains("close="))
        .collect();
    assert_eq!(seen.len(), 40);
    for r in &seen {
        assert_eq!(r.version, http::Version::HTTP_11, "upstream gets HTTP/1.1: {r:?}");
        assert!(
            r.header_all("connection")
                .iter()
                .all(|v| !v.eq_ignore_ascii_case("close")),
            "client's Connection: close is not forwarded: {r:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_that_closes_after_every_response_is_handled_within_the_cap() {
    let upstream = Upstream::start_with(UpstreamOptions {
        close_every: true,
        ..Default::default()
    })
    .await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "1000"]).await;

    let mut tasks = Vec::new();
    for worker in 0..20 {
        let addr = proxy.listen;
        tasks.push(tokio::spawn(async move {
            let mut client = H1Conn::connect(addr).await;
            let mut statuses = Vec::new();
            for i in 0..5 {
                let resp = client
                    .try_get(&format!("/delay/1?w={worker}&i={i}"))
                    .await
                    .map(|r| r.status)
                    .map_err(|e| e.to_string());
                statuses.push(resp);
            }
            statuses
        }));
    }
    for t in tasks {
        for status in t.await.unwrap() {
            assert_eq!(status, Ok(StatusCode::OK));
        }
    }
    assert_eq!(upstream.requests(), 100);
    assert!(
        upstream.peak_connections() <= 4,
        "peak {} > 4",
        upstream.peak_connections()
    );
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    let status = proxy.upstream_status(UP).await;
    assert!(
        status["connections_peak"].as_u64().unwrap_or(99) <= 4,
        "/status: {status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturating_one_upstream_does_not_delay_another() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.a]
url = "{a}"
max_connections = 2
max_queue = 100
queue_timeout = "20s"

[upstreams.b]
url = "{b}"
max_connections = 2
max_queue = 100
queue_timeout = "20s"

[[routes]]
path_prefix = "/a"
upstream = "a"

[[routes]]
path_prefix = "/b"
upstream = "b"
"#,
        a = a.url(),
        b = b.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    // Saturate a: 2 stalled in flight, 4 queued behind them.
    let stalled: Vec<_> = (0..6)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, &format!("/a/stall?i={i}")).await.status })
        })
        .collect();
    wait_until_sync("a has 2 stalled requests", Duration::from_secs(5), || a.inflight() == 2).await;
    proxy.wait_queue_depth("a", 4, Duration::from_secs(5)).await;

    // b answers promptly meanwhile.
    let started = Instant::now();
    let quick: Vec<_> = (0..20)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move {
                let t = Instant::now();
                let resp = get(addr, &format!("/b/delay/1?i={i}")).await;
                (resp.status, t.elapsed())
            })
        })
        .collect();
    for q in quick {
        let (status, took) = q.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(took < Duration::from_secs(2), "b request took {took:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(stalled.iter().all(|t| !t.is_finished()), "a's requests are still held");
    assert_eq!(a.accepted(), 2);
    assert!(b.peak_connections() <= 2);
    assert_eq!(b.requests(), 20);

    a.release_stalled();
    for s in stalled {
        assert_eq!(s.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(a.peak_connections(), 2);
    assert_eq!(a.accepted(), 2);
    proxy.wait_in_use_zero("a", Duration::from_secs(5)).await;
    proxy.wait_in_use_zero("b", Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_client_with_200_concurrent_streams_on_one_connection_respects_the_cap() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "1000", "--queue-timeout", "20s"]).await;

    let client = H2Conn::connect(proxy.listen).await;
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .try_get(&format!("/delay/5?stream={i}"))
                    .await
                    .map(|r| (r.status, r.version))
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    for t in tasks {
        let result = t.await.unwrap();
        assert_eq!(result, Ok((StatusCode::OK, http::Version::HTTP_2)));
    }
    assert_eq!(upstream.requests(), 200);
    assert!(upstream.peak_connections() <= 4, "peak {}", upstream.peak_connections());
    assert!(upstream.accepted() <= 4, "accepted {}", upstream.accepted());
    for r in upstream.recorded() {
        assert_eq!(r.version, http::Version::HTTP_11);
        assert!(r.header("host").is_some());
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}
