//! The life of pooled upstream connections: replays that do not cost the warm pool, idle expiry, and the
//! per-connection request limit.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use support::*;

const UP: &str = "default";

/// Holds `n` `/stall` requests at the upstream at once; returns their tasks.
async fn stall_n(proxy: &Proxy, upstream: &Upstream, n: usize, tag: &str) -> Vec<tokio::task::JoinHandle<StatusCode>> {
    let before = upstream.inflight();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let addr = proxy.listen;
            let path = format!("/stall?{tag}={i}");
            tokio::spawn(async move { get(addr, &path).await.status })
        })
        .collect();
    wait_until_sync(
        &format!("{n} stalled requests at the upstream"),
        Duration::from_secs(5),
        || upstream.inflight() == before + n,
    )
    .await;
    tasks
}

async fn release_all(upstream: &Upstream, tasks: Vec<tokio::task::JoinHandle<StatusCode>>) {
    upstream.release_stalled();
    for t in tasks {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_head_as_it_first_went_out_and_a_replayed_head_request_ends_with_its_head() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    assert_eq!(get(proxy.listen, "/warm").await.status, StatusCode::OK);
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;

    for (method, path) in [(Method::GET, "/replayed-get"), (Method::HEAD, "/replayed-head")] {
        upstream.kill_next_reused_connection();
        let mut conn = H1Conn::connect(proxy.listen).await;
        let resp = conn.try_request(method.clone(), path, body_empty()).await.unwrap();
        assert_eq!(resp.status, StatusCode::OK, "{method} {}", resp.text());
        let seen = upstream.recorded_with_prefix(path);
        assert_eq!(seen.len(), 2, "{method}: sent, then replayed once");
        assert_ne!(
            seen[0].conn_id, seen[1].conn_id,
            "{method}: replayed on another connection"
        );
        assert_eq!(
            (&seen[1].method, &seen[1].uri, &seen[1].headers),
            (&seen[0].method, &seen[0].uri, &seen[0].headers),
            "{method}: the replay is the request as it first went out"
        );
        // A HEAD's answer has no body whatever its Content-Length says: had the replay been read as a GET's, the
        // connection would wait for a body that never comes and its lease would not end.
        proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    }
    assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    assert!(upstream.peak_connections() <= 2, "peak {}", upstream.peak_connections());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_replayed_after_a_reused_connection_fails_keeps_the_rest_of_the_warm_pool() {
    const N: usize = 4;
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, N, &["--max-queue", "100", "--queue-timeout", "10s"]).await;

    // Warm N connections.
    let warm = stall_n(&proxy, &upstream, N, "warm").await;
    release_all(&upstream, warm).await;
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(upstream.accepted(), N);

    // One of them dies as the next request arrives on it; the GET is replayed on a fresh connection.
    upstream.kill_next_reused_connection();
    let resp = get(proxy.listen, "/replayed").await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(upstream.killed(), 1, "the request met the dying connection");
    assert_eq!(
        upstream.recorded_with_prefix("/replayed").len(),
        2,
        "sent, then replayed once"
    );
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;

    // N requests at once fit on the N-1 surviving connections plus the one that replaced the dead one.
    upstream.restall();
    let again = stall_n(&proxy, &upstream, N, "again").await;
    let accepted = upstream.accepted();
    let status = proxy.upstream_status(UP).await;
    release_all(&upstream, again).await;
    assert_eq!(
        accepted,
        N + 1,
        "one replacement for the one dead connection; more means healthy idle connections were closed. /status: {status}"
    );
    assert!(upstream.peak_connections() <= N, "peak {}", upstream.peak_connections());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--idle-timeout", "300ms", "--max-queue", "10"]).await;

    let busy = stall_n(&proxy, &upstream, 2, "busy").await;
    // Both connections go idle after this instant, not before: the lower bound below holds under any load.
    let released_at = Instant::now();
    release_all(&upstream, busy).await;
    assert_eq!(upstream.accepted(), 2);

    wait_until(
        "/status connections_open == 0 after idle_timeout",
        Duration::from_secs(5),
        || async { proxy.upstream_field(UP, "connections_open").await == 0 },
    )
    .await;
    let closed_after = released_at.elapsed();
    assert!(
        closed_after >= Duration::from_millis(280),
        "idle connections closed {closed_after:?} after their last response, before the 300ms idle_timeout"
    );
    wait_until_sync(
        "the upstream sees both connections closed",
        Duration::from_secs(3),
        || upstream.connections() == 0,
    )
    .await;
    assert_eq!(proxy.upstream_field(UP, "connections_idle").await, 0);

    // The pool dials again when needed.
    assert_eq!(get(proxy.listen, "/later").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_requests_per_connection_closes_each_connection_after_that_many_requests() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        "[upstreams.default]\nurl = \"{}\"\nmax_requests_per_connection = 3\n[[routes]]\nupstream = \"default\"\n",
        upstream.url()
    ));
    let path = config.path_str();
    let proxy = Proxy::for_upstream(&upstream, 1, &["--config", &path, "--max-queue", "10"]).await;

    let mut client = H1Conn::connect(proxy.listen).await;
    for i in 0..9 {
        let resp = client.get(&format!("/seq?i={i}")).await;
        assert_eq!(resp.status, StatusCode::OK, "request {i}: {}", resp.text());
    }
    assert_eq!(upstream.requests(), 9);
    assert_eq!(upstream.accepted(), 3, "9 requests at 3 per connection");
    let mut per_conn: BTreeMap<u64, usize> = BTreeMap::new();
    for r in upstream.recorded() {
        *per_conn.entry(r.conn_id).or_default() += 1;
    }
    assert_eq!(
        per_conn.values().copied().collect::<Vec<_>>(),
        vec![3, 3, 3],
        "requests per upstream connection"
    );
    assert!(upstream.peak_connections() <= 1);
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(proxy.upstream_field(UP, "connections_opened_total").await, 3);
}
