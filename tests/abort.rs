//! Clients that go away never leak a slot and never make the proxy
//! reconnect to the upstream.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

const UP: &str = "default";
const N: usize = 2;

/// Fills every slot with `/stall` requests and waits until the upstream
/// holds them all. Returns the client tasks.
async fn occupy_all_slots(proxy: &Proxy, upstream: &Upstream) -> Vec<tokio::task::JoinHandle<StatusCode>> {
    let before = upstream.inflight();
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, &format!("/stall?occupant={i}")).await.status })
        })
        .collect();
    wait_until_sync(
        "every slot is held by a stalled request",
        Duration::from_secs(5),
        || upstream.inflight() == before + N,
    )
    .await;
    tasks
}

/// After aborts: the slots all come back, N fresh requests reach the
/// upstream at the same time, and no new upstream connection was opened.
async fn assert_slots_intact(proxy: &Proxy, upstream: &Upstream, accepted_before: usize) {
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(proxy.upstream_field(UP, "queue_depth").await, 0);

    // All N slots usable: N stalled requests are at the upstream together.
    upstream.restall();
    let again = occupy_all_slots(proxy, upstream).await;
    upstream.release_stalled();
    for t in again {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(
        upstream.accepted(),
        accepted_before,
        "client aborts must not cost an upstream reconnect"
    );
}

/// Polls /metrics until `floodgate_requests_total{labels}` sums to
/// `expected`; an error with the family's lines when it does not within 5 s.
async fn metric_reaches(proxy: &Proxy, labels: &[(&str, &str)], expected: f64) -> Result<(), String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = proxy.metrics().await;
        let got = metric_sum(&parse_metrics(&text), "floodgate_requests_total", labels);
        if got == expected {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            let family: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("floodgate_requests_total"))
                .collect();
            return Err(format!(
                "floodgate_requests_total{labels:?} = {got}, expected {expected}; family: [{}]",
                family.join(" | ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[derive(Clone, Copy, Debug)]
enum QueuedKind {
    HeadOnly,
    WholeBody,
    HalfBody,
}

async fn abort_while_queued(kind: QueuedKind) -> Proxy {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, N, &["--max-queue", "100", "--queue-timeout", "20s"]).await;

    let occupants = occupy_all_slots(&proxy, &upstream).await;
    let accepted_before = upstream.accepted();
    assert_eq!(accepted_before, N);

    let mut queued = Vec::new();
    for i in 0..10 {
        let mut conn = RawConn::connect(proxy.listen).await;
        let request = match kind {
            QueuedKind::HeadOnly => format!("GET /abandoned/{i} HTTP/1.1\r\nHost: client.test\r\n\r\n").into_bytes(),
            QueuedKind::WholeBody => {
                format!("POST /abandoned/{i} HTTP/1.1\r\nHost: client.test\r\nContent-Length: 11\r\n\r\nhello world")
                    .into_bytes()
            }
            QueuedKind::HalfBody => {
                let mut r =
                    format!("POST /abandoned/{i} HTTP/1.1\r\nHost: client.test\r\nContent-Length: 100000\r\n\r\n")
                        .into_bytes();
                r.extend(std::iter::repeat_n(b'x', 1000));
                r
            }
        };
        conn.write(&request).await.unwrap();
        queued.push(conn);
    }
    proxy.wait_queue_depth(UP, 10, Duration::from_secs(5)).await;

    // Half leave politely (FIN), half with a reset.
    for (i, conn) in queued.into_iter().enumerate() {
        if i % 2 == 0 {
            drop(conn);
        } else {
            conn.abort_with_reset();
        }
    }
    // An aborted request leaves the queue (it does not wait to be skipped).
    proxy.wait_queue_depth(UP, 0, Duration::from_secs(5)).await;

    upstream.release_stalled();
    for t in occupants {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    assert_slots_intact(&proxy, &upstream, accepted_before).await;
    assert!(
        upstream.recorded_with_prefix("/abandoned").is_empty(),
        "aborted queued requests must not be sent upstream"
    );
    proxy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_aborting_while_queued_without_body_leak_no_slot() {
    abort_while_queued(QueuedKind::HeadOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_aborting_while_queued_after_sending_a_complete_body_leak_no_slot() {
    abort_while_queued(QueuedKind::WholeBody).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_aborting_while_queued_mid_request_body_leak_no_slot() {
    abort_while_queued(QueuedKind::HalfBody).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_client_aborts_are_counted_as_client_abort_in_metrics() {
    // 10 aborted while queued, for each kind of request.
    let mut failures = Vec::new();
    for kind in [QueuedKind::HeadOnly, QueuedKind::WholeBody, QueuedKind::HalfBody] {
        let proxy = abort_while_queued(kind).await;
        if let Err(e) = metric_reaches(&proxy, &[("upstream", UP), ("outcome", "client_abort")], 10.0).await {
            failures.push(format!("{kind:?}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_cancelled_while_queued_leak_no_slot() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, N, &["--max-queue", "100", "--queue-timeout", "20s"]).await;
    let occupants = occupy_all_slots(&proxy, &upstream).await;
    let accepted_before = upstream.accepted();

    let client = H2Conn::connect(proxy.listen).await;
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move { client.try_get(&format!("/abandoned-h2/{i}")).await.is_ok() })
        })
        .collect();
    proxy.wait_queue_depth(UP, 6, Duration::from_secs(5)).await;
    // Dropping the response futures resets the streams; the connection stays.
    for s in &streams {
        s.abort();
    }
    for s in streams {
        let _ = s.await;
    }
    proxy.wait_queue_depth(UP, 0, Duration::from_secs(5)).await;

    upstream.release_stalled();
    for t in occupants {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    assert_slots_intact(&proxy, &upstream, accepted_before).await;
    assert!(upstream.recorded_with_prefix("/abandoned-h2").is_empty());
    // The same HTTP/2 connection still works.
    let mut client = client;
    assert_eq!(client.try_get("/").await.unwrap().status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_aborting_before_the_response_head_leak_no_slot_and_cause_no_reconnect() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, N, &["--max-queue", "100"]).await;

    let mut clients = Vec::new();
    for i in 0..N {
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(format!("GET /delay/300?aborted={i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        clients.push(conn);
    }
    wait_until_sync("both requests reached the upstream", Duration::from_secs(5), || {
        upstream.inflight() == N
    })
    .await;
    let accepted_before = upstream.accepted();
    assert_eq!(accepted_before, N);
    drop(clients);

    assert_slots_intact(&proxy, &upstream, accepted_before).await;
    assert_eq!(upstream.connections(), N, "upstream connections kept open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_aborting_mid_response_body_leak_no_slot_and_cause_no_reconnect() {
    // The rest of an abandoned response is read as long as it is within abort_drain_bytes; 16 MiB bodies fit.
    let upstream = Upstream::start().await;
    let (proxy, _config) = proxy_with_drain_bound(&upstream, 32 * MIB).await;
    let accepted_before = warm_pool(&proxy, &upstream).await;
    abort_mid_body(&proxy, 16 * MIB).await;
    assert_slots_intact(&proxy, &upstream, accepted_before).await;
    assert_eq!(upstream.connections(), N, "upstream connections kept open");
}

#[tokio::test]
async fn clients_aborting_past_the_drain_bound_close_the_connection_but_leak_no_slot() {
    // Past abort_drain_bytes the connection is closed rather than read further: reconnects are allowed here,
    // leaked slots are not.
    let upstream = Upstream::start().await;
    let (proxy, _config) = proxy_with_drain_bound(&upstream, MIB).await;
    warm_pool(&proxy, &upstream).await;
    abort_mid_body(&proxy, 16 * MIB).await;
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    upstream.restall();
    let again = occupy_all_slots(&proxy, &upstream).await;
    upstream.release_stalled();
    for t in again {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    assert!(
        upstream.peak_connections() <= N,
        "peak {} > {N}",
        upstream.peak_connections()
    );
}

async fn proxy_with_drain_bound(upstream: &Upstream, bytes: u64) -> (Proxy, TempConfig) {
    let config = TempConfig::new(&format!(
        "[upstreams.default]\nurl = \"{}\"\nabort_drain_bytes = {bytes}\n[[routes]]\nupstream = \"default\"\n",
        upstream.url()
    ));
    let path = config.path_str();
    let proxy = Proxy::for_upstream(upstream, N, &["--max-queue", "100", "--config", &path]).await;
    (proxy, config)
}

/// Opens N connections to the upstream through the proxy and lets them go idle; returns the accepted count.
async fn warm_pool(proxy: &Proxy, upstream: &Upstream) -> usize {
    let occupants = occupy_all_slots(proxy, upstream).await;
    upstream.release_stalled();
    for t in occupants {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    let accepted = upstream.accepted();
    assert_eq!(accepted, N);
    accepted
}

/// N clients each read the head and 256 KiB of a `size`-byte body, then leave (half close, half reset).
async fn abort_mid_body(proxy: &Proxy, size: u64) {
    let mut readers = Vec::new();
    for i in 0..N {
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(format!("GET /bytes/{size}?aborted={i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let head = conn.read_head(Duration::from_secs(10)).await.unwrap();
        assert_eq!(head.status, 200);
        let mut got = 0usize;
        while got < 256 * 1024 {
            let data = conn.read_some(64 * 1024, Duration::from_secs(10)).await.unwrap();
            assert!(!data.is_empty(), "body ended early");
            got += data.len();
        }
        readers.push(conn);
    }
    for (i, conn) in readers.into_iter().enumerate() {
        if i % 2 == 0 {
            drop(conn);
        } else {
            conn.abort_with_reset();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_request_granted_at_once_keeps_its_slot_until_the_upstream_is_done() {
    // A request granted with the cap mostly free is run by its client's own task: when that client leaves, the
    // exchange must go on elsewhere, holding its slot, while the upstream still works on it, and its answer be
    // drained so that the connection is kept. One thread: every exchange here is granted on a connection of its own
    // thread, so the first is run by its client's task.
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, N, &["--max-queue", "100", "--threads", "1"]).await;
    let mut left = RawConn::connect(proxy.listen).await;
    left.write(b"GET /stall?left=1 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    wait_until_sync("the request at the upstream", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    drop(left);
    metric_reaches(&proxy, &[("upstream", UP), ("outcome", "client_abort")], 1.0)
        .await
        .unwrap();

    // The one slot left serves one of two more requests; the other waits for the abandoned exchange's.
    let more: Vec<_> = (0..2)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, &format!("/stall?after={i}")).await.status })
        })
        .collect();
    proxy.wait_queue_depth(UP, 1, Duration::from_secs(5)).await;
    assert_eq!(upstream.inflight(), N, "the abandoned request and one more");
    upstream.release_stalled();
    for request in more {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(upstream.peak_inflight(), N, "never more at the upstream than the cap");
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(
        upstream.accepted(),
        N,
        "the abandoned answer was drained and its connection kept"
    );
}
