//! The client-facing listener: requests refused before they reach an
//! upstream, and connections that never say anything.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const UP: &str = "default";

fn status_of(data: &[u8]) -> Option<u16> {
    first_status(data)
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
    // The only upstream slot stays free for real requests meanwhile (nothing here depends on doing this
    // before the silent connections are cut off).
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 0);

    // Each one is closed by the proxy (which shows it was accepted, not left in the backlog), and not before
    // the deadline.
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

/// One `GET /` on `conn`, answered 200.
async fn served(conn: &mut RawConn) {
    conn.write(b"GET / HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(
        conn.read_response(false, Duration::from_secs(5)).await.unwrap().status,
        200
    );
}

/// [`served`], then the connection left idle until the proxy closes it: how long after the request that came.
/// Idle time starts after the request is sent (once the response is written), so a lower bound on it holds under
/// load.
async fn served_then_closed_after(conn: &mut RawConn) -> Duration {
    let sent = Instant::now();
    served(conn).await;
    let (_, end) = conn.read_until_close(Duration::from_secs(5)).await;
    assert_ne!(end, ReadEnd::Timeout, "idle client still open after 5 s");
    sent.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_client_is_closed_after_client_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--client-idle-timeout", "400ms"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    let closed_after = served_then_closed_after(&mut conn).await;
    assert!(
        closed_after >= Duration::from_millis(380),
        "closed {closed_after:?} after the request, before the 400ms client_idle_timeout"
    );
    // The upstream connection is not tied to the client's.
    assert_eq!(upstream.connections(), 1);
}

/// The connection keeps one idle timer, set at its start and moved on when it fires early: each idle spell still
/// lasts the whole `client_idle_timeout` from its own last answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_spell_runs_from_the_last_answer_not_from_an_earlier_one() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--client-idle-timeout", "600ms"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    served(&mut conn).await;
    // The client's own pause: its next request comes before the first idle spell would have ended.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let closed_after = served_then_closed_after(&mut conn).await;
    assert!(
        closed_after >= Duration::from_millis(580),
        "closed {closed_after:?} after the second request, before its 600ms client_idle_timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_client_connections_holds_further_clients_back_until_one_closes() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new("max_client_connections = 3\n");
    let path = config.path_str();
    let proxy = Proxy::for_upstream(&upstream, 2, &["--config", &path]).await;

    // Three keep-alive clients, served once each and then idle.
    let mut held = Vec::new();
    for i in 0..3 {
        let mut conn = H1Conn::connect(proxy.listen).await;
        assert_eq!(conn.get(&format!("/held?i={i}")).await.status, StatusCode::OK);
        held.push(conn);
    }

    // A fourth connects (the kernel's backlog takes it) but is not served while the three are open.
    let mut fourth = RawConn::connect(proxy.listen).await;
    fourth
        .write(b"GET /fourth HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    match fourth.read_head(Duration::from_millis(300)).await {
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
        other => panic!("the fourth client was dealt with past max_client_connections = 3: {other:?}"),
    }
    assert!(upstream.recorded_with_prefix("/fourth").is_empty());
    assert_eq!(proxy.status().await["client_connections"].as_u64(), Some(3));

    // One of the three leaves: the fourth is accepted and answered.
    drop(held.remove(0));
    let resp = fourth.read_response(false, Duration::from_secs(5)).await.unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(upstream.recorded_with_prefix("/fourth").len(), 1);
    // The remaining two are still usable.
    for conn in &mut held {
        assert_eq!(conn.get("/still").await.status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_client_connections_are_closed_after_client_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--client-idle-timeout", "300ms"]).await;

    // One connection never opens a stream; the other serves one and then has none.
    let connected = Instant::now();
    let fresh = H2Conn::connect(proxy.listen).await;
    let mut used = H2Conn::connect(proxy.listen).await;
    // Its idle time starts after this instant (when the stream ends), so the lower bound holds under any load.
    let sent = Instant::now();
    let resp = used.try_get("/").await.unwrap();
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.version, http::Version::HTTP_2);

    wait_until_sync(
        "the stream-less h2 connection is closed",
        Duration::from_secs(5),
        || fresh.has_ended(),
    )
    .await;
    assert!(
        connected.elapsed() >= Duration::from_millis(280),
        "closed {:?} after connecting, before the 300ms client_idle_timeout",
        connected.elapsed()
    );
    wait_until_sync("the idle h2 connection is closed", Duration::from_secs(5), || {
        used.has_ended()
    })
    .await;
    assert!(
        sent.elapsed() >= Duration::from_millis(280),
        "closed {:?} after its last request, before the 300ms client_idle_timeout",
        sent.elapsed()
    );
    wait_until("client connections drop back", Duration::from_secs(3), || async {
        proxy.status().await["client_connections"].as_u64() == Some(0)
    })
    .await;
    // The upstream connection is not tied to the client's.
    assert_eq!(upstream.connections(), 1);
}
