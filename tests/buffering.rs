//! Slow clients never hold an upstream slot: small request bodies are read before admission, small responses
//! are read at upstream speed and the connection given back before the client is sent them. Each behaviour is
//! shown beside its counterpart with buffering off, so that each test would fail if buffering did nothing; and
//! larger bodies still stream whole, connections are reused, and outcomes, metrics and access lines stay right.

mod support;

use std::time::Duration;

use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use support::*;

const UP: &str = "default";
const T: Duration = Duration::from_secs(10);

/// floodgate in front of `upstream` with a cap of `cap`, `flags` added, and keys set through the environment: its
/// one upstream's (`("buffer_response_bytes", "0")`), or the global `max_buffered_bytes` and `access_log`.
async fn proxy_with(upstream: &Upstream, cap: usize, flags: &[&str], keys: &[(&str, &str)]) -> Proxy {
    let mut args = vec![
        "--upstream".to_string(),
        upstream.url(),
        "--max-connections".to_string(),
        cap.to_string(),
    ];
    args.extend(flags.iter().map(|flag| flag.to_string()));
    let env: Vec<(String, String)> = keys
        .iter()
        .map(|(key, value)| {
            let name = if ["max_buffered_bytes", "access_log"].contains(key) {
                format!("FLOODGATE__{}", key.to_ascii_uppercase())
            } else {
                format!("FLOODGATE__UPSTREAMS__DEFAULT__{}", key.to_ascii_uppercase())
            };
            (name, value.to_string())
        })
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Proxy::start_with_env(&args, &env).await
}

/// `floodgate_buffered_bytes`: body bytes the proxy holds in memory.
async fn buffered_bytes(proxy: &Proxy) -> f64 {
    metric_sum(&parse_metrics(&proxy.metrics().await), "floodgate_buffered_bytes", &[])
}

/// `len` bytes of the pattern the upstream's `/echo` checks (byte at offset `o` is `o % 256`).
fn pattern(offset: usize, len: usize) -> Vec<u8> {
    (offset..offset + len).map(|i| i as u8).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Slow readers
// ---------------------------------------------------------------------------------------------------------------

/// Large enough that a client which reads nothing stops the relay long before its end (the kernel and hyper
/// buffer far less than this between them on loopback), so without buffering its slot stays taken.
const SLOW_BODY: u64 = 4 * MIB;

/// `n` clients ask for `SLOW_BODY` over sockets with a tiny receive buffer, then read nothing.
async fn slow_readers(proxy: &Proxy, n: usize) -> Vec<RawConn> {
    let mut readers = Vec::new();
    for i in 0..n {
        let mut conn = RawConn::connect_with_recv_buffer(proxy.listen, 4096).await;
        conn.write(format!("GET /bytes/{SLOW_BODY}?slow={i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        readers.push(conn);
    }
    readers
}

/// `n` fast clients, all at once, each on its own connection: their statuses.
async fn fast_clients(proxy: &Proxy, n: usize) -> Vec<StatusCode> {
    let clients = (0..n).map(|i| {
        let addr = proxy.listen;
        tokio::spawn(async move { get(addr, &format!("/fast?{i}")).await.status })
    });
    let mut statuses = Vec::new();
    for client in clients {
        statuses.push(client.await.unwrap());
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_of_buffered_responses_hold_no_slot_so_fast_clients_are_served_at_once() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        2,
        &["--queue-timeout", "1s"],
        &[("buffer_response_bytes", &(2 * SLOW_BODY).to_string())],
    )
    .await;

    let slow = slow_readers(&proxy, 4).await;
    // Four requests through a cap of 2 while no slow client has read a byte: the first two gave their slots back
    // as soon as their bodies were read from the upstream.
    wait_until_sync("all four slow requests reached the upstream", T, || {
        upstream.recorded_with_prefix("/bytes").len() == 4
    })
    .await;
    proxy.wait_in_use_zero(UP, T).await;
    assert_eq!(
        buffered_bytes(&proxy).await,
        (4 * SLOW_BODY) as f64,
        "the four bodies wait in memory"
    );

    // A request that found no slot within queue_timeout would be shed (503).
    let statuses = fast_clients(&proxy, 8).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK), "{statuses:?}");
    assert!(
        upstream.accepted() <= 2,
        "buffered responses gave their connections back for reuse, yet the upstream accepted {}",
        upstream.accepted()
    );

    // The slow clients, reading at last, get their bodies whole.
    for mut conn in slow {
        let resp = conn.read_response(false, T).await.unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body.len() as u64, SLOW_BODY);
        assert!(pattern_matches(0, &resp.body), "a buffered body came out altered");
    }
    wait_until("the buffers are given back", T, || async {
        buffered_bytes(&proxy).await == 0.0
    })
    .await;
    assert_eq!(proxy.outcome_count(UP, "ok").await, 12.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_response_buffering_the_same_slow_readers_hold_every_slot_and_fast_clients_are_shed() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        2,
        &["--queue-timeout", "500ms"],
        &[("buffer_response_bytes", "0")],
    )
    .await;

    let _slow = slow_readers(&proxy, 4).await;
    wait_until_sync("two slow requests reached the upstream", T, || {
        upstream.recorded_with_prefix("/bytes").len() == 2
    })
    .await;
    assert_eq!(
        proxy.upstream_field(UP, "in_use").await,
        2,
        "the slow readers hold both slots"
    );

    let statuses = fast_clients(&proxy, 4).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "fast clients behind slow readers: {statuses:?}"
    );
    assert_eq!(
        upstream.recorded_with_prefix("/bytes").len(),
        2,
        "the queued slow requests never got a slot either"
    );
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 2);
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
}

// ---------------------------------------------------------------------------------------------------------------
// Slow uploaders
// ---------------------------------------------------------------------------------------------------------------

/// Sends the head of a 2000-byte upload and its first 1000 bytes, then stalls.
async fn half_an_upload(proxy: &Proxy) -> RawConn {
    let mut conn = RawConn::connect(proxy.listen).await;
    let mut request = b"POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: 2000\r\n\r\n".to_vec();
    request.extend(pattern(0, 1000));
    conn.write(&request).await.unwrap();
    conn
}

/// Sends the rest of [`half_an_upload`] and checks that the upstream received all of it, intact.
async fn finish_the_upload(mut conn: RawConn) {
    conn.write(&pattern(1000, 1000)).await.unwrap();
    let resp = conn.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.text(), "2000");
    assert_eq!(resp.header("x-pattern-ok"), Some("true"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalling_mid_upload_holds_no_slot_and_a_fast_client_is_served_meanwhile() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 1, &["--queue-timeout", "1s"], &[]).await;

    let slow = half_an_upload(&proxy).await;
    // The body's reservation is the sign that the proxy is reading it, before admission.
    wait_until("the upload is being buffered", T, || async {
        buffered_bytes(&proxy).await == 2000.0
    })
    .await;

    let fast = get(proxy.listen, "/fast").await;
    assert_eq!(fast.status, StatusCode::OK, "{}", fast.text());
    assert!(
        upstream.recorded_with_prefix("/echo").is_empty(),
        "the half-sent upload reached the upstream"
    );
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 0);

    finish_the_upload(slow).await;
    let echo = upstream.recorded_with_prefix("/echo");
    assert_eq!(echo[0].header("content-length"), Some("2000"), "{:?}", echo[0]);
    proxy.wait_in_use_zero(UP, T).await;
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_request_buffering_a_client_stalling_mid_upload_holds_the_only_slot() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        1,
        &["--queue-timeout", "500ms"],
        &[("buffer_request_bytes", "0")],
    )
    .await;

    let slow = half_an_upload(&proxy).await;
    wait_until_sync("the upload holds the upstream connection", T, || {
        upstream.inflight() == 1
    })
    .await;

    let fast = get(proxy.listen, "/fast").await;
    assert_eq!(fast.status, StatusCode::SERVICE_UNAVAILABLE, "{}", fast.text());
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 1);

    finish_the_upload(slow).await;
    proxy.wait_in_use_zero(UP, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_upload_that_ends_within_the_limit_is_read_before_admission_and_still_sent_chunked() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 1, &["--queue-timeout", "1s"], &[]).await;

    let mut slow = RawConn::connect(proxy.listen).await;
    let mut request = b"POST /echo HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n".to_vec();
    request.extend(pattern(0, 1000));
    request.extend(b"\r\n");
    slow.write(&request).await.unwrap();
    // Of unknown length: the whole limit is reserved while it is read.
    wait_until("the upload is being buffered", T, || async {
        buffered_bytes(&proxy).await == 65536.0
    })
    .await;
    assert_eq!(get(proxy.listen, "/fast").await.status, StatusCode::OK);
    assert!(upstream.recorded_with_prefix("/echo").is_empty());

    let mut rest = b"3e8\r\n".to_vec();
    rest.extend(pattern(1000, 1000));
    rest.extend(b"\r\n0\r\n\r\n");
    slow.write(&rest).await.unwrap();
    let resp = slow.read_response(false, T).await.unwrap();
    assert_eq!((resp.status, resp.text()), (200, "2000".to_string()));
    assert_eq!(resp.header("x-pattern-ok"), Some("true"));
    // Buffering does not change the framing the upstream reads.
    let echo = &upstream.recorded_with_prefix("/echo")[0];
    assert_eq!(echo.header("transfer-encoding"), Some("chunked"), "{echo:?}");
    assert_eq!(echo.header("content-length"), None, "{echo:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_stalling_before_admission_gets_408_and_one_cut_off_counts_as_a_client_abort() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 1, &["--body-idle-timeout", "300ms"], &[]).await;

    let mut stalled = half_an_upload(&proxy).await;
    let resp = stalled.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 408, "{}", resp.text());
    assert_eq!(proxy.outcome_count(UP, "client_timeout").await, 1.0);

    let gone = half_an_upload(&proxy).await;
    wait_until("the upload is being buffered", T, || async {
        buffered_bytes(&proxy).await == 2000.0
    })
    .await;
    gone.abort_with_reset();
    wait_until("the abort is counted", T, || async {
        proxy.outcome_count(UP, "client_abort").await == 1.0
    })
    .await;

    assert!(
        upstream.recorded_with_prefix("/echo").is_empty(),
        "neither upload reached the upstream"
    );
    assert_eq!(upstream.accepted(), 0, "no connection was dialled for them");
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
    assert_eq!(proxy.outcome_count(UP, "bad_request").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_trickled_before_admission_is_answered_408_at_request_timeout_without_a_slot() {
    // Each byte is progress to body_idle_timeout; the whole read is bounded as request_timeout bounds an upload
    // once admitted.
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        1,
        &["--request-timeout", "1s", "--body-idle-timeout", "5s"],
        &[],
    )
    .await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: 1000\r\n\r\n")
        .await
        .unwrap();
    // The load under test: a byte, then up to 200 ms of listening for the answer.
    let trickler = spawn_trickler(conn);
    wait_until("the upload is being buffered", T, || async {
        buffered_bytes(&proxy).await == 1000.0
    })
    .await;
    assert_eq!(get(proxy.listen, "/meanwhile").await.status, StatusCode::OK);

    let resp = trickler.await.unwrap();
    assert_eq!(resp.status, 408, "{resp:?}");
    assert_eq!(proxy.outcome_count(UP, "client_timeout").await, 1.0);
    assert!(upstream.recorded_with_prefix("/echo").is_empty());
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_buffered_bytes_a_response_streams_instead_of_failing() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        2,
        &["--queue-timeout", "1s"],
        &[
            ("buffer_response_bytes", &(2 * SLOW_BODY).to_string()),
            ("max_buffered_bytes", &(SLOW_BODY + SLOW_BODY / 2).to_string()),
        ],
    )
    .await;

    // The first slow reader's body fills most of the bound; the second's does not fit and streams, holding its
    // slot while its client reads nothing.
    let slow = slow_readers(&proxy, 2).await;
    wait_until_sync("both slow requests reached the upstream", T, || {
        upstream.recorded_with_prefix("/bytes").len() == 2
    })
    .await;
    wait_until("one body is buffered", T, || async {
        buffered_bytes(&proxy).await == SLOW_BODY as f64
    })
    .await;
    // The second response's head may reach floodgate a moment after the first body is in.
    wait_until("the other body streams instead", T, || async {
        let samples = parse_metrics(&proxy.metrics().await);
        metric_sum(&samples, "floodgate_buffer_fallbacks_total", &[]) == 1.0
    })
    .await;
    // The buffered one gives its slot back once its body is in; the streamed one holds its own.
    wait_until("only the streamed one holds a slot", T, || async {
        proxy.upstream_field(UP, "in_use").await == 1
    })
    .await;
    assert_eq!(get(proxy.listen, "/fast").await.status, StatusCode::OK);

    for mut conn in slow {
        let resp = conn.read_response(false, T).await.unwrap();
        assert_eq!(resp.body.len() as u64, SLOW_BODY);
        assert!(pattern_matches(0, &resp.body));
    }
    proxy.wait_in_use_zero(UP, T).await;
    assert_eq!(proxy.outcome_count(UP, "ok").await, 3.0);
}

// ---------------------------------------------------------------------------------------------------------------
// Larger bodies, reuse, accounting
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_larger_than_the_limits_stream_through_intact() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        1,
        &[],
        &[("buffer_request_bytes", "16384"), ("buffer_response_bytes", "16384")],
    )
    .await;
    let mut client = H1Conn::connect(proxy.listen).await;

    // Sized, and chunked (read up to the limit, then the rest streams after what was read).
    for (name, body) in [
        ("sized", body_pattern(MIB)),
        ("chunked", PatternBody::chunked(MIB).boxed()),
    ] {
        let resp = client.try_request(Method::POST, "/echo", body).await.unwrap();
        assert_eq!(resp.status, StatusCode::OK, "{name}: {}", resp.text());
        assert_eq!(resp.text(), MIB.to_string(), "{name}");
        assert_eq!(resp.header("x-pattern-ok"), Some("true"), "{name}");
    }
    for size in [MIB, 16384, 16385, 100] {
        let resp = client.get(&format!("/bytes/{size}")).await;
        assert_eq!(resp.body.len() as u64, size);
        assert!(pattern_matches(0, &resp.body), "/bytes/{size}");
    }
    proxy.wait_in_use_zero(UP, T).await;
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_of_a_buffered_response_goes_back_to_the_pool() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 2, &[], &[]).await;
    for i in 0..20 {
        // Each on a new client connection: the upstream connection is what is reused.
        let resp = get(proxy.listen, &format!("/bytes/30000?{i}")).await;
        assert_eq!(resp.body.len(), 30000);
    }
    assert_eq!(upstream.accepted(), 1);
    let conns: std::collections::BTreeSet<u64> = upstream.recorded().iter().map(|r| r.conn_id).collect();
    assert_eq!(conns.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_responses_are_counted_once_with_their_bytes_and_an_upstream_cut_is_answered_502() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 1, &["--log-format", "json"], &[("access_log", "stdout")]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET /bytes/5000 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(conn.read_response(false, T).await.unwrap().body.len(), 5000);
    conn.write(b"HEAD /bytes/5000 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let head = conn.read_response(true, T).await.unwrap();
    assert_eq!(head.status, 200);
    conn.write(b"GET /status/204 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(conn.read_response(false, T).await.unwrap().status, 204);

    // The upstream promises 10000 bytes and cuts the connection after 5000: the client has been sent nothing
    // yet, so it gets a 502 rather than a head and a truncated body.
    conn.write(b"GET /cut/5000 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let cut = conn.read_response(false, T).await.unwrap();
    assert_eq!(cut.status, 502, "{}", cut.text());

    let lines = proxy.access_lines(4).await;
    let summary: Vec<(String, u64, u64, String)> = lines
        .iter()
        .map(|line| {
            (
                line["url.path"].as_str().unwrap_or_default().to_string(),
                line["http.response.status_code"].as_u64().unwrap_or_default(),
                line["http.response.body.size"].as_u64().unwrap_or(u64::MAX),
                line["floodgate.outcome"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("/bytes/5000".to_string(), 200, 5000, "ok".to_string()),
            ("/bytes/5000".to_string(), 200, 0, "ok".to_string()),
            ("/status/204".to_string(), 204, 0, "ok".to_string()),
            (
                "/cut/5000".to_string(),
                502,
                cut.body.len() as u64,
                "upstream_error".to_string()
            ),
        ]
    );
    assert_eq!(proxy.outcome_count(UP, "ok").await, 3.0);
    assert_eq!(proxy.outcome_count(UP, "upstream_error").await, 1.0);

    // The cut connection was not pooled: the next request gets a new one.
    assert_eq!(get(proxy.listen, "/next").await.status, StatusCode::OK);
    let conn_of = |prefix: &str| upstream.recorded_with_prefix(prefix).last().map(|r| r.conn_id);
    assert_ne!(conn_of("/cut"), conn_of("/next"));
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_stalling_mid_body_of_a_buffered_response_is_answered_504_and_the_slot_freed() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(&upstream, 1, &["--body-idle-timeout", "300ms"], &[]).await;
    // Head and 1000 of 2000 bytes, then nothing: the client has been sent nothing, so it can still be told.
    let resp = get(proxy.listen, "/stall-body/1000").await;
    assert_eq!(resp.status, StatusCode::GATEWAY_TIMEOUT, "{}", resp.text());
    proxy.wait_in_use_zero(UP, T).await;
    assert_eq!(proxy.outcome_count(UP, "upstream_timeout").await, 1.0);
    assert_eq!(buffered_bytes(&proxy).await, 0.0);
    // The half-read connection is not reused.
    assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 2);
    upstream.release_stalled();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_stops_reading_a_buffered_response_is_cut_off_and_its_memory_given_back() {
    let upstream = Upstream::start().await;
    let proxy = proxy_with(
        &upstream,
        1,
        &["--body-idle-timeout", "500ms"],
        &[("buffer_response_bytes", "1048576")],
    )
    .await;
    let mut client = H2Conn::connect_with(
        proxy.listen,
        H2Options {
            initial_stream_window_size: Some(65_535),
        },
    )
    .await;
    let request = Request::get(proxy.url("/bytes/500000")).body(body_empty()).unwrap();
    let resp = client.send(request).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // Read in full from the upstream: the slot is free while the stream's window is still closed.
    proxy.wait_in_use_zero(UP, T).await;

    wait_until("the stalled stream's memory is given back", T, || async {
        buffered_bytes(&proxy).await == 0.0
    })
    .await;
    assert_eq!(proxy.outcome_count(UP, "client_abort").await, 1.0);
    let mut body = resp.into_body();
    let ended = tokio::time::timeout(T, async {
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                return false;
            }
        }
        true
    })
    .await
    .expect("the cut-off stream ends");
    assert!(!ended, "a cut-off body must not look complete");
}
