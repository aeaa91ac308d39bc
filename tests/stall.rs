//! The stall guard (`stall_timeout`): an upstream with every slot busy and no exchange finished for that long is
//! taken for stalled, and its waiting and new requests are refused at once instead of each waiting out its
//! `queue_timeout`; the moment an exchange finishes, admission resumes. An upstream that is slow but moving never
//! trips it.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const UP: &str = "default";

/// floodgate with `cap` slots, a 10 s queue and the stall guard at `stall_timeout`.
async fn guarded(upstream: &Upstream, cap: usize, stall_timeout: &str) -> Proxy {
    Proxy::for_upstream_with_env(
        upstream,
        cap,
        &["--queue-timeout", "10s"],
        &[("FLOODGATE__UPSTREAMS__DEFAULT__STALL_TIMEOUT", stall_timeout)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_upstream_is_refused_at_once_after_stall_timeout_and_served_again_once_an_exchange_finishes() {
    let upstream = Upstream::start().await;
    let proxy = guarded(&upstream, 2, "300ms").await;
    let listen = proxy.listen;
    // Both slots held by requests that take 2 s: nothing finishes meanwhile.
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { get(listen, "/delay/2000").await }))
        .collect();
    wait_until_sync("both slots busy", Duration::from_secs(5), || upstream.inflight() == 2).await;
    let started = Instant::now();
    let queued = tokio::spawn(async move { get(listen, "/queued").await });
    proxy.wait_queue_depth(UP, 1, Duration::from_secs(5)).await;
    // The waiting request is refused when the stall is seen, long before its 10 s queue_timeout.
    let queued = queued.await.unwrap();
    assert_eq!(queued.status, StatusCode::SERVICE_UNAVAILABLE, "{}", queued.text());
    assert_eq!(queued.header("x-floodgate-shed-reason"), Some("upstream_stalled"));
    assert!(queued.header("retry-after").is_some());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused after {:?}",
        started.elapsed()
    );
    // A new request meanwhile is refused at once, without joining the queue.
    let new = get(listen, "/new").await;
    assert_eq!(new.header("x-floodgate-shed-reason"), Some("upstream_stalled"));
    let status = proxy.upstream_status(UP).await;
    assert_eq!(status["stalled"], true, "{status}");
    // The held requests finish: the upstream moved, and the next request is served.
    for held in held {
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
    }
    let after = get(listen, "/after").await;
    assert_eq!(after.status, StatusCode::OK, "{}", after.text());
    assert_eq!(proxy.upstream_status(UP).await["stalled"], false);
    assert_eq!(proxy.outcome_count(UP, "shed_upstream_stalled").await, 2.0);
    let stalls = metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_upstream_stalls_total",
        &[],
    );
    assert_eq!(stalls, 1.0, "one stall, said once");
    assert!(upstream.peak_inflight() <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_slow_but_moving_within_stall_timeout_never_trips_the_guard() {
    // One slot; each exchange takes 200 ms, so one finishes every 200 ms while four clients keep the slot busy and
    // the queue standing: under the 500 ms guard (the margin is for a loaded machine's scheduling, not the rule's).
    let upstream = Upstream::start().await;
    let proxy = guarded(&upstream, 1, "500ms").await;
    let listen = proxy.listen;
    let clients: Vec<_> = (0..4)
        .map(|client| {
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for request in 0..4 {
                    statuses.push(get(listen, &format!("/delay/200?c={client}&r={request}")).await.status);
                }
                statuses
            })
        })
        .collect();
    for client in clients {
        for status in client.await.unwrap() {
            assert_eq!(status, StatusCode::OK);
        }
    }
    assert_eq!(proxy.outcome_count(UP, "shed_upstream_stalled").await, 0.0);
    assert_eq!(upstream.requests(), 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_stall_timeout_a_stuck_upstreams_queue_waits_its_queue_timeout() {
    // The guard is off by default: the same stuck slots, and the waiting request is shed at its queue_timeout.
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--queue-timeout", "500ms"]).await;
    let listen = proxy.listen;
    let held = tokio::spawn(async move { get(listen, "/delay/1500").await });
    wait_until_sync("the slot busy", Duration::from_secs(5), || upstream.inflight() == 1).await;
    let queued = get(listen, "/queued").await;
    assert_eq!(queued.header("x-floodgate-shed-reason"), Some("queue_timeout"));
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_spell_after_a_quiet_one_is_not_taken_for_a_stall() {
    // The last answer was long ago (a quiet spell longer than the guard), and now every slot is busy with a
    // request waiting: the guard measures from the spell's start, and nothing is shed.
    let upstream = Upstream::start().await;
    let proxy = guarded(&upstream, 2, "300ms").await;
    assert_eq!(get(proxy.listen, "/first").await.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let listen = proxy.listen;
    let burst: Vec<_> = (0..3)
        .map(|i| tokio::spawn(async move { get(listen, &format!("/delay/100?i={i}")).await }))
        .collect();
    for answer in burst {
        let answer = answer.await.unwrap();
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "{:?}",
            answer.header("x-floodgate-shed-reason")
        );
    }
    assert_eq!(proxy.outcome_count(UP, "shed_upstream_stalled").await, 0.0);
}
