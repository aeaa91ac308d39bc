//! `body_idle_timeout` after the response head, both ways: an upstream that stalls mid-body, a client that stops
//! sending mid-upload, and an HTTP/2 client that stops reading. Each aborts the exchange and frees the slot.

mod support;

use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use support::*;

const UP: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_stalling_mid_body_cuts_the_response_off_after_body_idle_timeout_and_frees_the_slot() {
    let upstream = Upstream::start().await;
    // The streaming path: a buffered response is never sent a head before its body is in (tests/buffering.rs).
    let proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--body-idle-timeout", "500ms", "--buffer-response-bytes", "0"],
    )
    .await;

    // Head and the first 1000 of 2000 bytes, then nothing. Timed from before the request: the stall cannot
    // start earlier, so the lower bound below holds under any load.
    let mut conn = RawConn::connect(proxy.listen).await;
    let sent_at = Instant::now();
    conn.write(b"GET /stall-body/1000 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let head = conn.read_head(Duration::from_secs(10)).await.unwrap();
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("2000"), "{head:?}");

    let (body, end) = conn.read_until_close(Duration::from_secs(5)).await;
    let cut_after = sent_at.elapsed();
    assert_ne!(
        end,
        ReadEnd::Timeout,
        "response still open 5 s into an upstream stall with a 500ms body_idle_timeout ({} bytes read)",
        body.len()
    );
    assert!(
        body.len() < 2000,
        "the client got all {} bytes although the upstream stalled",
        body.len()
    );
    assert!(
        cut_after >= Duration::from_millis(480),
        "cut off {cut_after:?} after the request, before the 500ms body_idle_timeout"
    );

    proxy.wait_in_use_zero(UP, Duration::from_secs(3)).await;
    // The slot is usable again (the half-sent connection is not reused: it is mid-message).
    assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    proxy.wait_in_use_zero(UP, Duration::from_secs(3)).await;
    upstream.release_stalled();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_stopping_mid_upload_is_aborted_after_body_idle_timeout_and_frees_the_slot() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--body-idle-timeout", "500ms"]).await;

    // Announce 100 000 bytes, send 1000, then go quiet with the connection open.
    let mut conn = RawConn::connect(proxy.listen).await;
    let mut request = b"POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: 100000\r\n\r\n".to_vec();
    request.extend(std::iter::repeat_n(b'x', 1000));
    let written_at = Instant::now();
    conn.write(&request).await.unwrap();
    wait_until_sync("the upload reached the upstream", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    proxy.wait_in_use_zero(UP, Duration::from_secs(3)).await;
    let freed_after = written_at.elapsed();
    assert!(
        freed_after >= Duration::from_millis(480),
        "slot freed {freed_after:?} after the last byte, before the 500ms body_idle_timeout"
    );
    // The upstream's half of the exchange was aborted too (its handler saw the body end early).
    wait_until_sync("the upstream handler ended", Duration::from_secs(3), || {
        upstream.inflight() == 0
    })
    .await;
    // The client is told: an error response or a closed connection, not silence.
    match conn.read_head(Duration::from_secs(3)).await {
        Ok(resp) => assert!(resp.status >= 400, "stalled upload answered {resp:?}"),
        Err(e) => assert_ne!(
            e.kind(),
            std::io::ErrorKind::TimedOut,
            "the stalled uploader was neither answered nor disconnected"
        ),
    }
    assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_client_that_stops_reading_does_not_hold_the_slot_past_body_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--body-idle-timeout", "1s", "--queue-timeout", "3s"]).await;

    // A 64 KiB stream window that is never handed back: hyper releases window only as the body is read.
    let mut client = H2Conn::connect_with(
        proxy.listen,
        H2Options {
            initial_stream_window_size: Some(65_535),
        },
    )
    .await;
    let req = Request::get(proxy.url(&format!("/bytes/{}", 64 * MIB)))
        .body(body_empty())
        .unwrap();
    // Timed from before the request: the body cannot stop making progress earlier.
    let sent_at = Instant::now();
    let resp = client.send(req).await.expect("response head");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        proxy.upstream_field(UP, "in_use").await,
        1,
        "the download holds the slot"
    );

    // The body is not polled from here on.
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    let freed_after = sent_at.elapsed();
    assert!(
        freed_after >= Duration::from_millis(980),
        "slot freed {freed_after:?} after the request, before the 1s body_idle_timeout"
    );
    let other = get(proxy.listen, "/other").await;
    assert_eq!(other.status, StatusCode::OK, "{}", other.text());

    // The stalled stream was aborted, not left hanging: reading it now ends in an error before all 64 MiB.
    let mut body = resp.into_body();
    let mut got = 0u64;
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => got += frame.into_data().map(|d| d.len() as u64).unwrap_or(0),
                Some(Err(e)) => return Err(e.to_string()),
                None => return Ok(()),
            }
        }
    })
    .await;
    match ended {
        Ok(Err(_)) => {}
        Ok(Ok(())) => panic!("the aborted stream ended cleanly after {got} of {} bytes", 64 * MIB),
        Err(_) => panic!("the aborted stream still hangs ({got} bytes read): the client was never told"),
    }
    assert!(got < 64 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_client_reading_slowly_but_steadily_is_not_cut_off() {
    // About 100 KB/s through the default 64 KiB stream window, for 3 s, with a 1 s body_idle_timeout: the
    // stall watchdog must see the steady progress.
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--body-idle-timeout", "1s"]).await;
    let mut client = H2Conn::connect(proxy.listen).await;
    let request = Request::get(proxy.url("/bytes/20000000")).body(body_empty()).unwrap();
    let mut body = client.send(request).await.unwrap().into_body();
    let started = Instant::now();
    let mut got = 0usize;
    while started.elapsed() < Duration::from_secs(3) {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("a frame within 5 s")
            .expect("the body does not end early")
            .unwrap_or_else(|err| panic!("a steady reader was cut off after {got} bytes: {err}"));
        let n = frame.into_data().map(|d| d.len()).unwrap_or(0);
        got += n;
        tokio::time::sleep(Duration::from_micros(n as u64 * 10)).await;
    }
    assert_eq!(proxy.outcome_count(UP, "client_abort").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_upstream_stall_is_counted_as_an_upstream_timeout_not_a_client_abort() {
    let upstream = Upstream::start().await;
    // The streaming path, as above.
    let proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--body-idle-timeout", "300ms", "--buffer-response-bytes", "0"],
    )
    .await;
    for i in 0..3 {
        let mut client = H2Conn::connect(proxy.listen).await;
        let request = Request::get(proxy.url(&format!("/stall-body/1000?{i}")))
            .body(body_empty())
            .unwrap();
        let response = client.send(request).await.expect("head");
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = response.into_body();
        let mut failed = false;
        while let Some(frame) = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("cut off")
        {
            if frame.is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "a stalled body must not look complete");
        proxy.wait_in_use_zero(UP, Duration::from_secs(3)).await;
        upstream.release_stalled();
        upstream.restall();
    }
    assert_eq!(proxy.outcome_count(UP, "upstream_timeout").await, 3.0);
    assert_eq!(proxy.outcome_count(UP, "client_abort").await, 0.0);
}
