//! Self-tests of the test support code (no proxy involved): the counting
//! upstream counts what the other tests rely on it counting.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_counts_concurrent_and_total_connections_exactly() {
    let upstream = Upstream::start().await;
    let mut conns = Vec::new();
    for _ in 0..7 {
        let mut c = H1Conn::connect(upstream.addr()).await;
        assert_eq!(c.get("/").await.status, StatusCode::OK);
        conns.push(c);
    }
    assert_eq!(upstream.connections(), 7);
    assert_eq!(upstream.peak_connections(), 7);
    assert_eq!(upstream.accepted(), 7);
    // Keep-alive reuse is not a new connection.
    assert_eq!(conns[0].get("/").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 7);
    drop(conns);
    wait_until_sync("closed connections are counted down", Duration::from_secs(5), || {
        upstream.connections() == 0
    })
    .await;
    assert_eq!(upstream.peak_connections(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_notices_a_peer_close_while_a_request_stalls() {
    let upstream = Upstream::start().await;
    let mut raw = RawConn::connect(upstream.addr()).await;
    raw.write(b"GET /stall HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
    wait_until_sync("stalled", Duration::from_secs(5), || upstream.inflight() == 1).await;
    drop(raw);
    wait_until_sync(
        "connection and in-flight request counted down",
        Duration::from_secs(5),
        || upstream.connections() == 0 && upstream.inflight() == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_rejects_missing_host_and_absolute_form() {
    let upstream = Upstream::start().await;
    let t = Duration::from_secs(5);
    let mut raw = RawConn::connect(upstream.addr()).await;
    raw.write(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert_eq!(raw.read_response(false, t).await.unwrap().status, 400);
    raw.write(b"GET http://x/ HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    assert_eq!(raw.read_response(false, t).await.unwrap().status, 400);
    raw.write(b"GET /headers HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let ok = raw.read_response(false, t).await.unwrap();
    assert_eq!(ok.status, 200);
    let json: serde_json::Value = serde_json::from_slice(&ok.body).unwrap();
    assert_eq!(json["version"], "HTTP/1.1");
    assert_eq!(upstream.rejected(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_behaviours_by_path() {
    let upstream = Upstream::start().await;
    let mut c = H1Conn::connect(upstream.addr()).await;
    assert_eq!(c.get("/status/503").await.status, 503);
    let bytes = c.get("/x/bytes/200000").await;
    assert_eq!(bytes.body.len(), 200_000);
    assert!(pattern_matches(0, &bytes.body));
    assert_eq!(upstream.bytes_streamed(), 200_000);
    let echo = c
        .try_request(http::Method::POST, "/echo", body_pattern(300_000))
        .await
        .unwrap();
    assert_eq!(echo.text(), "300000");
    assert_eq!(echo.header("x-pattern-ok"), Some("true"));
    let close = c.get("/close").await;
    assert_eq!(close.header("connection"), Some("close"));
    wait_until_sync("closed after /close", Duration::from_secs(5), || {
        upstream.connections() == 0
    })
    .await;

    upstream.set_close_every(true);
    let r = get(upstream.addr(), "/").await;
    assert_eq!(r.header("connection"), Some("close"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_stops_and_restarts_on_the_same_port() {
    let upstream = Upstream::start().await;
    let mut c = H1Conn::connect(upstream.addr()).await;
    assert_eq!(c.get("/").await.status, StatusCode::OK);
    upstream.stop().await;
    assert_eq!(upstream.connections(), 0);
    assert!(try_get(upstream.addr(), "/").await.is_err(), "refused while stopped");
    upstream.restart().await;
    assert_eq!(get(upstream.addr(), "/").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_upstream_refuses_connects_and_keeps_its_port_bound() {
    let upstream = Upstream::start().await;
    upstream.stop().await;
    let refused = tokio::net::TcpStream::connect(upstream.addr()).await;
    assert_eq!(
        refused.map(|_| ()).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused)
    );
    let taken = tokio::net::TcpSocket::new_v4().unwrap().bind(upstream.addr());
    assert!(taken.is_err(), "the port is still held while the upstream is down");
    upstream.restart().await;
    assert_eq!(get(upstream.addr(), "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_resets_trickles_and_cuts_bodies_on_request() {
    let upstream = Upstream::start().await;
    let t = Duration::from_secs(5);

    let (data, end) = raw_exchange(upstream.addr(), b"GET /reset HTTP/1.1\r\nHost: t\r\n\r\n", t).await;
    assert!(data.is_empty());
    assert_eq!(end, ReadEnd::Reset, "/reset answers with RST");

    let (data, end) = raw_exchange(upstream.addr(), b"GET /reset-body/100 HTTP/1.1\r\nHost: t\r\n\r\n", t).await;
    assert_eq!(first_status(&data), Some(200));
    assert_eq!(end, ReadEnd::Reset, "/reset-body resets after the head and some body");

    let (data, end) = raw_exchange(upstream.addr(), b"GET /cut/100 HTTP/1.1\r\nHost: t\r\n\r\n", t).await;
    let text = String::from_utf8_lossy(&data).to_ascii_lowercase();
    assert!(text.contains("content-length: 200"), "{text}");
    assert_eq!(end, ReadEnd::Eof, "/cut closes after half the promised body");
    assert_eq!(upstream.resets(), 2);

    let mut c = H1Conn::connect(upstream.addr()).await;
    let trickled = c.get("/trickle/4/20").await;
    assert_eq!(trickled.status, StatusCode::OK);
    assert_eq!(trickled.body.len(), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_resets_a_seeded_share_of_requests() {
    let upstream = Upstream::start_with(UpstreamOptions {
        reset_per_mille: 500,
        seed: 7,
        ..Default::default()
    })
    .await;
    let mut answered = 0;
    for _ in 0..40 {
        if try_get(upstream.addr(), "/").await.is_ok() {
            answered += 1;
        }
    }
    assert_eq!(answered + upstream.resets(), 40);
    assert!((8..=32).contains(&answered), "about half answered, got {answered}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_closes_keep_alive_connections_idle_past_idle_close() {
    let upstream = Upstream::start_with(UpstreamOptions {
        idle_close: Some(Duration::from_millis(100)),
        ..Default::default()
    })
    .await;
    let mut c = H1Conn::connect(upstream.addr()).await;
    assert_eq!(c.get("/").await.status, StatusCode::OK);
    assert_eq!(c.get("/").await.status, StatusCode::OK);
    wait_until_sync("idle connection closed early", Duration::from_secs(5), || {
        upstream.connections() == 0
    })
    .await;
    assert_eq!(upstream.idle_closes(), 1);
    assert!(c.try_get("/").await.is_err(), "the closed connection is not reusable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_closes_idle_connections_and_kills_reused_ones_on_request() {
    let upstream = Upstream::start().await;
    let mut c = H1Conn::connect(upstream.addr()).await;
    assert_eq!(c.get("/").await.status, StatusCode::OK);
    upstream.close_idle_connections();
    wait_until_sync("idle connection closed", Duration::from_secs(5), || {
        upstream.connections() == 0
    })
    .await;

    let mut c = H1Conn::connect(upstream.addr()).await;
    assert_eq!(c.get("/").await.status, StatusCode::OK);
    upstream.kill_next_reused_connection();
    assert!(c.try_get("/").await.is_err(), "killed without an answer");
    assert_eq!(upstream.killed(), 1);
}

#[test]
fn metrics_parser_reads_openmetrics_text() {
    let text = "# HELP floodgate_requests Requests.\n\
        # TYPE floodgate_requests counter\n\
        floodgate_requests_total{upstream=\"api\",outcome=\"ok\",code=\"2xx\"} 6\n\
        floodgate_requests_total{upstream=\"api\",outcome=\"ok\",code=\"5xx\"} 2\n\
        floodgate_requests_total{upstream=\"-\",outcome=\"no_route\",code=\"4xx\"} 1\n\
        floodgate_queue_wait_seconds_bucket{le=\"+Inf\",upstream=\"a,b\\\"c\"} 3\n\
        floodgate_client_connections 4\n\
        # EOF\n";
    let m = parse_metrics(text);
    assert_eq!(m.len(), 5);
    assert_eq!(metric_sum(&m, "floodgate_requests_total", &[("outcome", "ok")]), 8.0);
    assert_eq!(metric_sum(&m, "floodgate_requests_total", &[("code", "4xx")]), 1.0);
    assert_eq!(m[3].labels["upstream"], "a,b\"c");
    assert_eq!(m[3].labels["le"], "+Inf");
    assert_eq!(metric_sum(&m, "floodgate_client_connections", &[]), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_stall_body_sends_half_then_stalls_until_released() {
    let upstream = Upstream::start().await;
    let mut raw = RawConn::connect(upstream.addr()).await;
    raw.write(b"GET /stall-body/1000 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let head = raw.read_head(Duration::from_secs(5)).await.unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("2000"));
    let mut got = Vec::new();
    while got.len() < 1000 {
        let data = raw.read_some(4096, Duration::from_secs(5)).await.unwrap();
        assert!(!data.is_empty(), "EOF after {} bytes", got.len());
        got.extend(data);
    }
    assert_eq!(got.len(), 1000, "no more than the first half before the release");
    assert!(pattern_matches(0, &got));
    // Stalled: nothing more arrives (checked for 200 ms) until the release.
    let more = raw.read_some(4096, Duration::from_millis(200)).await;
    assert!(
        matches!(&more, Err(e) if e.kind() == std::io::ErrorKind::TimedOut),
        "{more:?}"
    );
    upstream.release_stalled();
    while got.len() < 2000 {
        let data = raw.read_some(4096, Duration::from_secs(5)).await.unwrap();
        assert!(!data.is_empty(), "EOF after {} bytes", got.len());
        got.extend(data);
    }
    assert_eq!(got.len(), 2000);
}
