//! What a hostile client cannot make floodgate do: hold a connection past every deadline, lock the admin port, or
//! make it hold memory outside its bounds.

mod support;

use std::time::{Duration, Instant};

use support::h2_raw::{frame, hello, unsolicited_ping_acks};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An h2c client that sends the preface and its SETTINGS, then `then`, then nothing at all: it acknowledges
/// nothing and answers no PING.
async fn silent_h2c(addr: std::net::SocketAddr, then: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut hello = hello();
    hello.extend_from_slice(then);
    stream.write_all(&hello).await.unwrap();
    stream
}

/// Reads and discards until floodgate closes the connection; the time that took, or `None` within `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_http2_connections_are_closed_after_the_idle_timeout_and_let_new_clients_in() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        2,
        &["--client-idle-timeout", "1s"],
        &[("FLOODGATE__MAX_CLIENT_CONNECTIONS", "4")],
    )
    .await;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(silent_h2c(proxy.listen, &[]).await);
    }
    for stream in &mut silent {
        let took = closed_within(stream, Duration::from_secs(10)).await;
        // Idle timeout, then the goodbye's grace (2 s): never for as long as the client stays silent.
        assert!(took.is_some(), "a silent HTTP/2 connection was still open after 10 s");
    }
    // Their places among max_client_connections are free again.
    assert_eq!(get(proxy.listen, "/after").await.status, http::StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_header_block_left_open_is_cut_at_header_read_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(
        &upstream,
        2,
        &["--header-read-timeout", "1s", "--client-idle-timeout", "60s"],
    )
    .await;
    // HEADERS on stream 1 without END_HEADERS (:method GET, :scheme http, :path /), and no CONTINUATION.
    let mut stream = silent_h2c(proxy.listen, &frame(0x1, 0x0, 1, &[0x82, 0x86, 0x84])).await;
    let took = closed_within(&mut stream, Duration::from_secs(8)).await;
    let took = took.expect("an open header block held the connection for 8 s");
    assert!(
        took >= Duration::from_millis(900),
        "cut before header_read_timeout: {took:?}"
    );
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_request_in_flight_is_not_cut_by_an_idle_or_goodbye_deadline() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--client-idle-timeout", "1s"]).await;
    let mut h2 = H2Conn::connect(proxy.listen).await;
    // Longer than the idle timeout and its goodbye's grace together.
    let resp = h2.try_get("/delay/3500").await.unwrap();
    assert_eq!(resp.status, http::StatusCode::OK);
}

/// The lines of floodgate's log that speak of PINGs.
fn ping_lines(output: &str) -> Vec<&str> {
    output.lines().filter(|line| line.contains("PING")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unsolicited_http2_ping_acks_is_counted_and_closed_and_writes_one_log_line() {
    let upstream = Upstream::start().await;
    // floodgate's own debug lines on, to see the one line it writes about the flood.
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        2,
        &["--client-idle-timeout", "60s"],
        &[("FLOODGATE__LOG_LEVEL", "info,floodgate=debug")],
    )
    .await;
    let mut stream = silent_h2c(proxy.listen, &[]).await;
    // 10,000 acknowledgements of PINGs floodgate never sent, about 170 KB; writing may fail once floodgate closes.
    let _ = stream.write_all(&unsolicited_ping_acks(10_000)).await;
    let took = closed_within(&mut stream, Duration::from_secs(10)).await;
    assert!(
        took.is_some(),
        "a connection flooding PING ACKs was still open after 10 s"
    );
    h2_raw::assert_unsolicited_ping_acks_counted(&proxy).await;
    // Other clients are served as before, over HTTP/2 too.
    let mut h2 = H2Conn::connect(proxy.listen).await;
    assert_eq!(h2.try_get("/after").await.unwrap().status, http::StatusCode::OK);
    let output = proxy.output();
    let lines = ping_lines(&output);
    assert_eq!(
        lines.len(),
        1,
        "{} lines about PINGs, the first: {:?}",
        lines.len(),
        &lines[..lines.len().min(3)]
    );
    assert!(
        lines[0].contains("never sent") && lines[0].contains("closing"),
        "{}",
        lines[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_hold_the_admin_port_silently_cannot_keep_probes_out() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    let admin = proxy.admin;
    // 64 connections (the admin listener's whole budget) that send nothing, each reopened as soon as it is
    // closed.
    let stop = tokio_util::sync::CancellationToken::new();
    let connected = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut holders = Vec::new();
    for _ in 0..64 {
        let stop = stop.clone();
        let connected = connected.clone();
        holders.push(tokio::spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut held) = TcpStream::connect(admin).await else {
                    continue;
                };
                connected.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut buf = [0u8; 64];
                tokio::select! {
                    _ = held.read(&mut buf) => {}
                    () = stop.cancelled() => return,
                }
            }
        }));
    }
    wait_until_sync("the holders fill the admin listener", Duration::from_secs(5), || {
        connected.load(std::sync::atomic::Ordering::SeqCst) >= 64
    })
    .await;
    let mut answered = 0;
    for _ in 0..30 {
        let probe = tokio::time::timeout(Duration::from_secs(1), try_get(admin, "/healthz")).await;
        if matches!(probe, Ok(Ok(resp)) if resp.status == http::StatusCode::OK) {
            answered += 1;
        }
        // A probe every 100 ms, as a kubelet's would come every few seconds.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    for holder in holders {
        let _ = holder.await;
    }
    assert_eq!(answered, 30, "only {answered} of 30 probes answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_http2_uploads_hold_no_more_than_their_stream_windows_and_count_them() {
    const UPLOADS: usize = 100;
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "200", "--queue-timeout", "30s"]).await;
    // The one slot is busy, so every upload waits in the queue with its body unread.
    let busy = tokio::spawn(get(proxy.listen, "/stall"));
    wait_until_sync("the slot is busy", Duration::from_secs(5), || upstream.inflight() == 1).await;
    let before = proxy.rss_kib();
    let mut uploads = Vec::new();
    for i in 0..UPLOADS {
        let mut h2 = H2Conn::connect(proxy.listen).await;
        let uri = format!("http://{}/echo?upload={i}", proxy.listen);
        uploads.push(tokio::spawn(async move {
            // 10 MB each, sent as fast as flow control lets it.
            let req = http::Request::post(uri).body(body_pattern(10_000_000)).unwrap();
            let _ = h2.send(req).await;
        }));
    }
    proxy
        .wait_queue_depth("default", UPLOADS as u64, Duration::from_secs(10))
        .await;
    let window = 65_535.0;
    let counted = metric_sum(&parse_metrics(&proxy.metrics().await), "floodgate_buffered_bytes", &[]);
    assert!(
        counted >= UPLOADS as f64 * window,
        "queued uploads' windows counted as {counted} buffered bytes"
    );
    let pid_rss = || proxy.rss_kib();
    let after = wait_until_stable(
        "floodgate's RSS",
        Duration::from_secs(10),
        Duration::from_millis(500),
        pid_rss,
    )
    .await;
    let grown_mib = after.saturating_sub(before) as f64 / 1024.0;
    eprintln!("RSS {before} -> {after} KiB (+{grown_mib:.1} MiB) with {UPLOADS} queued 10 MB HTTP/2 uploads");
    // 100 windows of 64 KiB are 6.25 MiB; hyper's default 1 MiB windows let the same uploads add about 100 MiB.
    assert!(
        grown_mib < 40.0,
        "{UPLOADS} queued uploads grew floodgate by {grown_mib:.1} MiB"
    );
    upstream.release_stalled();
    let _ = busy.await;
    for upload in uploads {
        upload.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_chunked_twice_is_refused_400_and_never_reaches_the_upstream() {
    // "hello", chunked, then chunked again: decoded once, the inner framing would go upstream as the content.
    let inner = b"5\r\nhello\r\n0\r\n\r\n";
    let mut body = format!("{:x}\r\n", inner.len()).into_bytes();
    body.extend_from_slice(inner);
    body.extend_from_slice(b"\r\n0\r\n\r\n");
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    for codings in [
        "Transfer-Encoding: chunked, chunked\r\n",
        "Transfer-Encoding: Chunked\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: identity, chunked,chunked\r\n",
    ] {
        let mut request = format!("POST /echo HTTP/1.1\r\nHost: client.test\r\n{codings}\r\n").into_bytes();
        request.extend_from_slice(&body);
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(&request).await.unwrap();
        let answer = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
        assert_eq!(answer.status, 400, "{codings:?}: {}", answer.text());
    }
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_target_with_raw_non_ascii_bytes_is_refused_400() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    for target in [&b"/caf\xc3\xa9"[..], b"/search?q=\xc3\xa9t\xc3\xa9", b"/\xe2\x80\xae/x"] {
        let mut request = b"GET ".to_vec();
        request.extend_from_slice(target);
        request.extend_from_slice(b" HTTP/1.1\r\nHost: client.test\r\n\r\n");
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(&request).await.unwrap();
        let answer = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            answer.status,
            400,
            "{}: {}",
            String::from_utf8_lossy(target),
            answer.text()
        );
    }
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get("/caf\u{e9}").await.unwrap();
    assert_eq!(resp.status, http::StatusCode::BAD_REQUEST, "{}", resp.text());
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());
    // The same bytes percent-encoded are an ordinary target.
    assert_eq!(get(proxy.listen, "/caf%C3%A9").await.status, http::StatusCode::OK);
    assert_eq!(upstream.recorded()[0].uri, "/caf%C3%A9");
}
