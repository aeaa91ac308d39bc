//! The bounded FIFO queue in front of each upstream: order, shedding when
//! full, shedding on timeout.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const UP: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_sheds_with_503_queue_full_and_retry_after() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "0"]).await;

    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    for _ in 0..3 {
        let resp = get(proxy.listen, "/shed-me").await;
        assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.header("retry-after"), Some("1"));
        assert!(resp.text().contains("queue full"), "body {:?}", resp.text());
    }
    assert!(upstream.recorded_with_prefix("/shed-me").is_empty());

    upstream.release_stalled();
    let resp = stalled.await.unwrap();
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.text(), "released");
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    // The slot is usable again.
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_sheds_with_503_queue_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "10", "--queue-timeout", "300ms"]).await;

    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    let started = Instant::now();
    let resp = get(proxy.listen, "/timed-out").await;
    let waited = started.elapsed();
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.header("retry-after"), Some("1"));
    assert!(resp.text().contains("queue timeout"), "body {:?}", resp.text());
    assert!(
        waited >= Duration::from_millis(250),
        "shed after {waited:?}, before the 300ms queue timeout"
    );
    assert!(waited < Duration::from_secs(5), "shed after {waited:?}");
    assert!(upstream.recorded_with_prefix("/timed-out").is_empty());
    assert_eq!(proxy.upstream_field(UP, "queue_depth").await, 0);

    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap().status, StatusCode::OK);
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_are_forwarded_in_arrival_order() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "100", "--queue-timeout", "20s"]).await;

    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await.status });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    let mut queued = Vec::new();
    for seq in 1..=8u64 {
        let addr = proxy.listen;
        queued.push(tokio::spawn(async move {
            get(addr, &format!("/fifo?seq={seq}")).await.status
        }));
        // Next one only once this one is in the queue: arrival order is known.
        proxy.wait_queue_depth(UP, seq, Duration::from_secs(5)).await;
    }

    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap(), StatusCode::OK);
    for q in queued {
        assert_eq!(q.await.unwrap(), StatusCode::OK);
    }
    let order: Vec<String> = upstream
        .recorded_with_prefix("/fifo")
        .into_iter()
        .map(|r| r.uri)
        .collect();
    let expected: Vec<String> = (1..=8).map(|s| format!("/fifo?seq={s}")).collect();
    assert_eq!(order, expected, "queue is FIFO");
    let status = proxy.upstream_status(UP).await;
    assert!(status["queue_peak"].as_u64().unwrap_or(0) >= 8, "/status: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_only_once_the_request_is_admitted() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "10", "--queue-timeout", "20s"]).await;

    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await.status });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    proxy.wait_queue_depth(UP, 1, Duration::from_secs(5)).await;
    // Queued: no 100 Continue (nor anything else) yet.
    let early = conn.read_some(1024, Duration::from_millis(300)).await;
    match early {
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
        other => panic!(
            "a queued Expect: 100-continue request got an answer before admission: {:?}",
            other.map(|b| String::from_utf8_lossy(&b).into_owned())
        ),
    }

    // Admitted: 100 first, then the body goes up and the final answer comes back.
    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap(), StatusCode::OK);
    let interim = conn.read_head(Duration::from_secs(5)).await.unwrap();
    assert_eq!(interim.status, 100, "{interim:?}");
    conn.write(b"hello world").await.unwrap();
    let resp = conn.read_response(false, Duration::from_secs(5)).await.unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.text(), "11", "the upstream received the whole body");

    let seen = upstream.recorded_with_prefix("/echo");
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].header("expect").is_none(),
        "Expect reached the upstream: {:?}",
        seen[0]
    );
    assert_eq!(seen[0].header("content-length"), Some("11"), "{:?}", seen[0]);
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}
