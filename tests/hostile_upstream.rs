//! What a misbehaving or merely slow upstream cannot make floodgate do: work more requests at once than the cap
//! after a timeout, or pass on a response that lies about itself.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

/// An upstream that finishes every request it started before it acts on a close, as a thread-per-connection
/// server does (its thread is busy until then), and counts that work in flight whatever floodgate does to the
/// connection meanwhile.
async fn thread_per_connection_upstream() -> Upstream {
    Upstream::start_with(UpstreamOptions {
        finish_before_close: true,
        ..Default::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_504_the_late_answer_is_read_before_the_connection_serves_again() {
    let upstream = thread_per_connection_upstream().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--request-timeout", "1s", "--queue-timeout", "30s"]).await;
    let slow = tokio::spawn(get(proxy.listen, "/work/2500"));
    wait_until_sync(
        "the upstream works on the first request",
        Duration::from_secs(5),
        || upstream.inflight() == 1,
    )
    .await;
    // Queued behind the slow one: it may only reach the upstream once the upstream has finished the first.
    let next = tokio::spawn(get(proxy.listen, "/work/100"));
    proxy.wait_queue_depth("default", 1, Duration::from_secs(5)).await;
    assert_eq!(slow.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(next.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        upstream.peak_inflight(),
        1,
        "the upstream worked on two requests at once at cap 1"
    );
    // The late answer was read to its end within abort_drain_timeout: the connection was whole and served on.
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_drain_a_timed_out_exchange_holds_its_slot_until_the_upstream_closes() {
    let upstream = thread_per_connection_upstream().await;
    let proxy = Proxy::start_with_env(
        &[
            "--upstream",
            &upstream.url(),
            "--max-connections",
            "1",
            "--request-timeout",
            "1s",
            "--queue-timeout",
            "30s",
        ],
        // Gives up on the late answer long before it comes.
        &[("FLOODGATE__UPSTREAMS__DEFAULT__ABORT_DRAIN_TIMEOUT", "200ms")],
    )
    .await;
    let slow = tokio::spawn(get(proxy.listen, "/work/2500"));
    wait_until_sync(
        "the upstream works on the first request",
        Duration::from_secs(5),
        || upstream.inflight() == 1,
    )
    .await;
    let next = tokio::spawn(get(proxy.listen, "/work/100"));
    proxy.wait_queue_depth("default", 1, Duration::from_secs(5)).await;
    assert_eq!(slow.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(next.await.unwrap().status, StatusCode::OK);
    assert_eq!(
        upstream.peak_inflight(),
        1,
        "the upstream worked on two requests at once at cap 1"
    );
    assert_eq!(upstream.peak_connections(), 1);
    // The first connection was closed (the answer was not waited for); the second request had a new one.
    assert_eq!(upstream.accepted(), 2);
}
