//! The client-facing listener: requests refused before they reach an
//! upstream, and connections that never say anything.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const UP: &str = "default";

/// The 501 body says tunnels are not supported (wording may vary).
fn mentions_tunnels_unsupported(body: &str) -> bool {
    let body = body.to_ascii_lowercase();
    body.contains("tunnel") && body.contains("not supported")
}

fn status_of(data: &[u8]) -> Option<u16> {
    first_status(data)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_websocket_and_connect_are_refused_with_501() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let t = Duration::from_secs(10);

    let websocket = b"GET /chat HTTP/1.1\r\n\
        Host: client.test\r\n\
        Connection: Upgrade\r\n\
        Upgrade: websocket\r\n\
        Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
        Sec-WebSocket-Version: 13\r\n\
        \r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(websocket).await.unwrap();
    let resp = conn.read_response(false, t).await.unwrap();
    assert_eq!(resp.status, 501, "websocket upgrade: {}", resp.text());
    assert!(mentions_tunnels_unsupported(&resp.text()), "body {:?}", resp.text());

    let h2c = b"GET /h2c HTTP/1.1\r\n\
        Host: client.test\r\n\
        Connection: Upgrade, HTTP2-Settings\r\n\
        Upgrade: h2c\r\n\
        HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\
        \r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(h2c).await.unwrap();
    let resp = conn.read_response(false, t).await.unwrap();
    assert_eq!(resp.status, 501, "h2c upgrade: {}", resp.text());

    let connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(connect).await.unwrap();
    let resp = conn.read_response(false, t).await.unwrap();
    assert_eq!(resp.status, 501, "CONNECT: {}", resp.text());
    assert!(mentions_tunnels_unsupported(&resp.text()), "body {:?}", resp.text());

    assert_eq!(upstream.requests(), 0, "nothing reached the upstream");
    assert_eq!(upstream.accepted(), 0);
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_head_is_refused_with_431() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;

    // One huge header (100 KiB > the 64 KiB default).
    let mut big = b"GET /big HTTP/1.1\r\nHost: client.test\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 100 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    let (data, _) = raw_exchange(proxy.listen, &big, Duration::from_secs(10)).await;
    assert_eq!(
        status_of(&data),
        Some(431),
        "{:?}",
        String::from_utf8_lossy(&data[..data.len().min(300)])
    );

    // Many moderate headers adding up past the limit.
    let mut many = b"GET /many HTTP/1.1\r\nHost: client.test\r\n".to_vec();
    for i in 0..200 {
        many.extend_from_slice(format!("X-H{i}: {}\r\n", "b".repeat(500)).as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    let (data, _) = raw_exchange(proxy.listen, &many, Duration::from_secs(10)).await;
    assert_eq!(
        status_of(&data),
        Some(431),
        "{:?}",
        String::from_utf8_lossy(&data[..data.len().min(300)])
    );

    assert_eq!(upstream.requests(), 0);
    // The proxy is fine afterwards.
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_with_400() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let cases: [&[u8]; 3] = [
        b"THIS IS NOT HTTP\r\n\r\n",
        b"GET / HTTP/1.1 trailing-garbage\r\nHost: client.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: client.test\r\nno colon in this header\r\n\r\n",
    ];
    for case in cases {
        let (data, _) = raw_exchange(proxy.listen, case, Duration::from_secs(10)).await;
        assert_eq!(
            status_of(&data),
            Some(400),
            "request {:?} answered {:?}",
            String::from_utf8_lossy(case),
            String::from_utf8_lossy(&data)
        );
    }
    assert_eq!(upstream.requests(), 0);
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_closed_after_first_byte_timeout_without_taking_a_slot() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--first-byte-timeout", "400ms"]).await;

    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..5 {
        silent.push(RawConn::connect(proxy.listen).await);
    }
    wait_until(
        "the proxy counts the silent clients",
        Duration::from_secs(3),
        || async { proxy.status().await["client_connections"].as_u64().unwrap_or(0) >= 5 },
    )
    .await;
    // The only upstream slot is free for real requests meanwhile.
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 0);

    for mut conn in silent {
        let (data, end) = conn.read_until_close(Duration::from_secs(5)).await;
        assert_ne!(end, ReadEnd::Timeout, "silent connection still open after 5 s");
        let _ = data; // a 408 before closing is fine
        assert!(
            opened.elapsed() >= Duration::from_millis(350),
            "closed after {:?}, before the 400ms first-byte timeout",
            opened.elapsed()
        );
    }
    assert_eq!(upstream.requests(), 1);
    assert_eq!(upstream.accepted(), 1);
    wait_until("client connections drop back", Duration::from_secs(3), || async {
        proxy.status().await["client_connections"].as_u64() == Some(0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_request_head_is_closed_after_header_read_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--header-read-timeout", "400ms"]).await;

    // Slowloris: a head that never ends.
    let mut slow = RawConn::connect(proxy.listen).await;
    let started = Instant::now();
    slow.write(b"GET /never-finished HTTP/1.1\r\nHost: client.test\r\nX-Slow: 1\r\n")
        .await
        .unwrap();
    let (_, end) = slow.read_until_close(Duration::from_secs(5)).await;
    assert_ne!(end, ReadEnd::Timeout, "incomplete head still open after 5 s");
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "closed after {:?}",
        started.elapsed()
    );
    assert!(upstream.recorded_with_prefix("/never-finished").is_empty());
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_client_is_closed_after_client_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--client-idle-timeout", "400ms"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET / HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(
        conn.read_response(false, Duration::from_secs(5)).await.unwrap().status,
        200
    );
    let answered = Instant::now();
    let (_, end) = conn.read_until_close(Duration::from_secs(5)).await;
    assert_ne!(end, ReadEnd::Timeout, "idle client still open after 5 s");
    assert!(
        answered.elapsed() >= Duration::from_millis(350),
        "closed after {:?} idle",
        answered.elapsed()
    );
    // The upstream connection is not tied to the client's.
    assert_eq!(upstream.connections(), 1);
}
