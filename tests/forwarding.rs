//! What goes through the proxy and how: upstream failures and recovery,
//! large bodies and back-pressure, bodiless responses, header rewriting.

mod support;

use std::time::{Duration, Instant};

use http::{Method, Request, StatusCode, Version};
use support::*;

const UP: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gives_502_then_requests_pass_again_once_it_is_back() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--connect-timeout", "1s"]).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);

    upstream.stop().await;
    for _ in 0..3 {
        let started = Instant::now();
        let resp = get(proxy.listen, "/while-down").await;
        assert_eq!(resp.status, StatusCode::BAD_GATEWAY, "body {:?}", resp.text());
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(proxy.outcome_count(UP, "upstream_error").await, 3.0);

    upstream.restart().await;
    wait_until("requests pass again", Duration::from_secs(5), || async {
        get(proxy.listen, "/").await.status == StatusCode::OK
    })
    .await;
    for _ in 0..5 {
        assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connection_closed_by_the_upstream_is_replaced_transparently() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut client = H1Conn::connect(proxy.listen).await;
    assert_eq!(client.get("/").await.status, StatusCode::OK);

    for round in 1..=5 {
        let accepted = upstream.accepted();
        upstream.close_idle_connections();
        wait_until_sync("upstream closed its idle connection", Duration::from_secs(5), || {
            upstream.connections() == 0
        })
        .await;
        let resp = client.get(&format!("/after-idle-close?round={round}")).await;
        assert_eq!(resp.status, StatusCode::OK, "round {round}: {}", resp.text());
        assert_eq!(upstream.accepted(), accepted + 1, "one new connection");
    }
}

/// The idle watch: an upstream's close of a connection nobody uses gives its slot back with no request to find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_the_upstream_closes_gives_its_slot_back_before_any_request() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    wait_until("the connection is idle in the pool", Duration::from_secs(5), || async {
        proxy.upstream_field(UP, "connections_idle").await == 1
    })
    .await;

    upstream.close_idle_connections();
    wait_until("its slot is back", Duration::from_secs(5), || async {
        proxy.upstream_field(UP, "connections_open").await == 0
    })
    .await;
    assert_eq!(proxy.upstream_field(UP, "connections_idle").await, 0);
    assert_eq!(upstream.accepted(), 1, "nothing dialled meanwhile");
    assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 2, "the next request dials afresh");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_connection_closed_by_the_upstream_without_answer_is_retried_for_get() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    assert_eq!(get(proxy.listen, "/warm").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 1);

    // The keep-alive connection dies exactly as the next request arrives
    // (the race every pool loses now and then): nothing was answered.
    upstream.kill_next_reused_connection();
    let resp = get(proxy.listen, "/retried").await;
    assert_eq!(resp.status, StatusCode::OK, "body {:?}", resp.text());
    assert_eq!(upstream.killed(), 1, "the stale connection was used");
    assert_eq!(upstream.accepted(), 2);
    assert_eq!(upstream.recorded_with_prefix("/retried").len(), 2);
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_dropping_the_connection_without_answer_gives_502() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    let resp = get(proxy.listen, "/drop").await;
    assert_eq!(resp.status, StatusCode::BAD_GATEWAY, "body {:?}", resp.text());
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_not_answering_within_request_timeout_gives_504() {
    let upstream = Upstream::start().await;
    // A timed-out exchange keeps its lease while its late answer may still come (abort_drain_timeout, 5 s by
    // default): shortened here, so that the slot's return is seen well within the wait below.
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        1,
        &["--request-timeout", "300ms"],
        &[("FLOODGATE__UPSTREAMS__DEFAULT__ABORT_DRAIN_TIMEOUT", "200ms")],
    )
    .await;
    let started = Instant::now();
    let resp = get(proxy.listen, "/stall").await;
    assert_eq!(resp.status, StatusCode::GATEWAY_TIMEOUT, "body {:?}", resp.text());
    assert!(started.elapsed() >= Duration::from_millis(250));
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert_eq!(proxy.outcome_count(UP, "upstream_timeout").await, 1.0);
    upstream.release_stalled();
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabyte_upload_and_download_pass_with_bounded_proxy_memory() {
    const SIZE: u64 = 100 * MIB;
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    let mut client = H1Conn::connect(proxy.listen).await;
    assert_eq!(client.get("/").await.status, StatusCode::OK);
    let baseline = proxy.peak_rss_kib();

    // Upload with Content-Length.
    let resp = client
        .try_request(Method::POST, "/echo", body_pattern(SIZE))
        .await
        .expect("100 MB upload");
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.text(), SIZE.to_string(), "upstream received every byte");
    assert_eq!(resp.header("x-pattern-ok"), Some("true"), "bytes intact");

    // Upload chunked (no length known in advance).
    let resp = client
        .try_request(
            Method::POST,
            "/echo",
            http_body_util::BodyExt::boxed(PatternBody::chunked(10 * MIB)),
        )
        .await
        .expect("chunked upload");
    assert_eq!(resp.text(), (10 * MIB).to_string());
    assert_eq!(resp.header("x-pattern-ok"), Some("true"));

    // Download, checked byte for byte.
    let head = client
        .send(http::Request::get(format!("/bytes/{SIZE}")).body(body_empty()).unwrap())
        .await
        .expect("download head");
    assert_eq!(head.status(), StatusCode::OK);
    let mut body = head.into_body();
    let mut offset = 0u64;
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(15), http_body_util::BodyExt::frame(&mut body))
        .await
        .expect("download stalled")
    {
        let frame = frame.expect("download body error");
        if let Ok(data) = frame.into_data() {
            assert!(pattern_matches(offset, &data), "corrupt at {offset}");
            offset += data.len() as u64;
        }
    }
    assert_eq!(offset, SIZE, "downloaded every byte");

    let grown_kib = proxy.peak_rss_kib().saturating_sub(baseline);
    eprintln!("proxy VmHWM baseline {baseline} KiB, grew by {grown_kib} KiB");
    assert!(
        grown_kib < 32 * 1024,
        "proxy peak RSS grew by {grown_kib} KiB moving 100 MB each way"
    );
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stops_reading_stalls_the_upstream_instead_of_filling_proxy_memory() {
    const SIZE: u64 = 256 * MIB;
    let upstream = Upstream::start_with(UpstreamOptions {
        send_buffer: Some(64 * 1024),
        ..Default::default()
    })
    .await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--body-idle-timeout", "60s"]).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    let baseline = proxy.peak_rss_kib();

    let mut conn = RawConn::connect_with_recv_buffer(proxy.listen, 64 * 1024).await;
    conn.write(format!("GET /bytes/{SIZE} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = conn.read_head(Duration::from_secs(10)).await.unwrap();
    assert_eq!(head.status, 200);
    let mut got = 0usize;
    while got < MIB as usize {
        got += conn.read_some(64 * 1024, Duration::from_secs(10)).await.unwrap().len();
    }
    // Stop reading. The upstream must soon be unable to write any more.
    let written = wait_until_stable(
        "bytes the upstream managed to write",
        Duration::from_secs(20),
        Duration::from_millis(700),
        || upstream.bytes_streamed(),
    )
    .await;
    eprintln!("upstream wrote {written} bytes before stalling");
    assert!(
        written < 64 * MIB,
        "upstream wrote {} MiB to a client that stopped after 1 MiB",
        written / MIB
    );
    let grown_kib = proxy.peak_rss_kib().saturating_sub(baseline);
    eprintln!("proxy VmHWM baseline {baseline} KiB, grew by {grown_kib} KiB");
    assert!(
        grown_kib < 32 * 1024,
        "proxy peak RSS grew by {grown_kib} KiB buffering for a stalled reader"
    );
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 1);
    drop(conn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_204_and_304_responses_carry_no_body() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    let t = Duration::from_secs(10);

    conn.write(b"HEAD /bytes/1000 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let head = conn.read_response(true, t).await.unwrap();
    assert_eq!(head.status, 200);
    if let Some(len) = head.header("content-length") {
        assert_eq!(len, "1000", "HEAD keeps the GET's Content-Length");
    }

    conn.write(b"GET /status/204 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let r204 = conn.read_response(false, t).await.unwrap();
    assert_eq!(r204.status, 204);
    assert!(!r204.has_header("transfer-encoding"));

    conn.write(b"GET /status/304 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let r304 = conn.read_response(false, t).await.unwrap();
    assert_eq!(r304.status, 304);

    // Had any of them carried body bytes, they would show up here.
    conn.write(b"GET /after HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let last = conn.read_response(false, t).await.unwrap();
    assert_eq!(last.status, 200);
    assert_eq!(last.text(), "ok");
    let (extra, end) = conn.read_until_close(Duration::from_millis(300)).await;
    assert!(extra.is_empty(), "stray bytes {:?}", String::from_utf8_lossy(&extra));
    assert_eq!(end, ReadEnd::Timeout, "keep-alive connection stays open");
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_stripped_and_x_forwarded_headers_replaced() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let r = upstream_view(
        &proxy,
        &upstream,
        b"GET /headers?hop=1 HTTP/1.1\r\n\
          Host: app.example:8443\r\n\
          Connection: keep-alive, X-Hop-Custom, x-hop-other\r\n\
          Keep-Alive: timeout=5, max=100\r\n\
          TE: trailers\r\n\
          Proxy-Connection: keep-alive\r\n\
          X-Hop-Custom: secret\r\n\
          X-Hop-Other: secret2\r\n\
          X-Forwarded-For: 6.6.6.6\r\n\
          X-Forwarded-Proto: https\r\n\
          X-Forwarded-Host: evil.example\r\n\
          Forwarded: for=6.6.6.6;proto=https;host=evil.example\r\n\
          X-End-To-End: kept\r\n\
          X-Multi: one\r\n\
          X-Multi: two\r\n\
          \r\n",
    )
    .await;
    for hop in [
        "keep-alive",
        "te",
        "proxy-connection",
        "x-hop-custom",
        "x-hop-other",
        "forwarded",
    ] {
        assert!(r.header(hop).is_none(), "{hop} reached the upstream: {r:?}");
    }
    for v in r.header_all("connection") {
        for token in v.split(',') {
            let token = token.trim();
            assert!(
                token.eq_ignore_ascii_case("keep-alive") || token.eq_ignore_ascii_case("close"),
                "client Connection token {token:?} forwarded: {r:?}"
            );
        }
    }
    assert_eq!(r.header_all("x-forwarded-for"), vec!["127.0.0.1"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-proto"), vec!["http"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-host"), vec!["app.example:8443"], "{r:?}");
    assert_eq!(r.header_all("x-end-to-end"), vec!["kept"]);
    assert_eq!(
        joined(&r, "x-multi"),
        vec!["one", "two"],
        "repeated header kept in order"
    );
    assert!(r.header("host").is_some());
    assert_eq!(r.version, Version::HTTP_11);
    assert_eq!(r.uri, "/headers?hop=1");
    assert_eq!(upstream.rejected(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_always_gets_http11_origin_form_with_host() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let t = Duration::from_secs(10);

    // Absolute-form from the client.
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET http://app.example/headers?form=absolute HTTP/1.1\r\nHost: app.example\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(conn.read_response(false, t).await.unwrap().status, 200);

    // HTTP/1.0 without Host.
    let (data, _) = raw_exchange(proxy.listen, b"GET /headers?form=http10 HTTP/1.0\r\n\r\n", t).await;
    assert_eq!(first_status(&data), Some(200), "{:?}", String::from_utf8_lossy(&data));

    // HTTP/2.
    let mut h2 = H2Conn::connect(proxy.listen).await;
    assert_eq!(h2.try_get("/headers?form=h2").await.unwrap().status, StatusCode::OK);

    let seen = upstream.recorded_with_prefix("/headers");
    assert_eq!(seen.len(), 3, "{seen:?}");
    for r in &seen {
        assert_eq!(r.version, Version::HTTP_11, "{r:?}");
        assert!(r.uri.starts_with("/headers?form="), "origin form: {r:?}");
        let host = r.header_all("host");
        assert_eq!(host.len(), 1, "exactly one Host: {r:?}");
        assert!(!host[0].is_empty());
    }
    assert_eq!(upstream.rejected(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connection_close_does_not_close_the_client_connection() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    let t = Duration::from_secs(10);
    for _ in 0..3 {
        conn.write(b"GET /close HTTP/1.1\r\nHost: client.test\r\n\r\n")
            .await
            .unwrap();
        let resp = conn.read_response(false, t).await.unwrap();
        assert_eq!(resp.status, 200);
        assert!(
            resp.header("connection")
                .map(|v| !v.eq_ignore_ascii_case("close"))
                .unwrap_or(true),
            "upstream's Connection: close is hop-by-hop"
        );
    }
    assert_eq!(upstream.accepted(), 3, "each /close costs one upstream connection");
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_and_response_bodies_stream_both_ways() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut client = H1Conn::connect(proxy.listen).await;
    let resp = client
        .try_request(Method::POST, "/echo-stream", body_pattern(3 * MIB))
        .await
        .unwrap();
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.body.len() as u64, 3 * MIB);
    assert!(pattern_matches(0, &resp.body));
}

/// Sends one request with the client's own forwarding headers through a proxy trusting `trusted` and returns
/// what the upstream received.
async fn forwarded_via(trusted: &str, extra_head: &str) -> RecordedRequest {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!("trusted_proxies = {trusted}\n"));
    let path = config.path_str();
    let proxy = Proxy::for_upstream(&upstream, 1, &["--config", &path]).await;
    upstream_view(
        &proxy,
        &upstream,
        format!(
            "GET /headers?trust=1 HTTP/1.1\r\n\
             Host: app.example:8443\r\n\
             {extra_head}\
             X-Forwarded-Proto: https\r\n\
             X-Forwarded-Host: orig.example\r\n\
             Forwarded: for=1.2.3.4;proto=https;host=orig.example\r\n\
             \r\n"
        )
        .as_bytes(),
    )
    .await
}

/// Sends one raw request `head` for `/headers` and returns what the upstream received.
async fn upstream_view(proxy: &Proxy, upstream: &Upstream, head: &[u8]) -> RecordedRequest {
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(head).await.unwrap();
    let resp = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    let seen = upstream.recorded_with_prefix("/headers");
    assert_eq!(seen.len(), 1);
    seen[0].clone()
}

/// The values of `name`, all lines joined into one comma-separated list.
fn joined(r: &RecordedRequest, name: &str) -> Vec<String> {
    r.header_all(name)
        .iter()
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_proxy_forwarding_headers_are_appended_to_and_kept() {
    let r = forwarded_via(r#"["127.0.0.1/32"]"#, "X-Forwarded-For: 1.2.3.4\r\n").await;
    assert_eq!(joined(&r, "x-forwarded-for"), vec!["1.2.3.4", "127.0.0.1"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-proto"), vec!["https"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-host"), vec!["orig.example"], "{r:?}");
    assert_eq!(
        r.header_all("forwarded"),
        vec!["for=1.2.3.4;proto=https;host=orig.example"],
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_peer_forwarding_headers_are_replaced_even_when_other_proxies_are_trusted() {
    // Trusting some other network must not extend trust to this peer.
    let r = forwarded_via(r#"["10.0.0.0/8", "::1/128"]"#, "X-Forwarded-For: 1.2.3.4\r\n").await;
    assert_eq!(r.header_all("x-forwarded-for"), vec!["127.0.0.1"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-proto"), vec!["http"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-host"), vec!["app.example:8443"], "{r:?}");
    assert!(r.header("forwarded").is_none(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_proxy_x_forwarded_for_on_several_lines_keeps_every_hop() {
    let r = forwarded_via(
        r#"["127.0.0.1/32"]"#,
        "X-Forwarded-For: 1.2.3.4\r\nX-Forwarded-For: 5.6.7.8, 9.9.9.9\r\n",
    )
    .await;
    assert_eq!(
        joined(&r, "x-forwarded-for"),
        vec!["1.2.3.4", "5.6.7.8", "9.9.9.9", "127.0.0.1"],
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_fields_of_an_http2_request_go_upstream_joined_into_one_line() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    // RFC 9113 §8.2.3: HTTP/2 may split Cookie into one field per crumb; HTTP/1.1 wants one line, joined by "; ".
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let request = Request::builder()
        .uri(format!("http://{}/headers?cookies=h2", proxy.listen))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .header("cookie", "c=3")
        .header("x-multi", "one")
        .header("x-multi", "two")
        .body(body_empty())
        .unwrap();
    let resp = collect(h2.send(request).await.unwrap()).await.unwrap();
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let seen = upstream.recorded_with_prefix("/headers");
    assert_eq!(seen.len(), 1, "{seen:?}");
    let r = &seen[0];
    assert_eq!(r.header_all("cookie"), vec!["a=1; b=2; c=3"], "{r:?}");
    // Only Cookie: any other repeated field keeps its lines.
    assert_eq!(r.header_all("x-multi"), vec!["one", "two"], "{r:?}");
    assert_eq!(upstream.rejected(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_with_a_trailing_dot_takes_its_host_route_and_goes_upstream_without_the_dot() {
    let secret = Upstream::start().await;
    let dotted = Upstream::start().await;
    let other = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.secret]
url = "{secret}"
max_connections = 1

[upstreams.dotted]
url = "{dotted}"
max_connections = 1

[upstreams.other]
url = "{other}"
max_connections = 1

[[routes]]
host = "secret.internal"
upstream = "secret"

[[routes]]
host = "dotted.example."
upstream = "dotted"

[[routes]]
upstream = "other"
"#,
        secret = secret.url(),
        dotted = dotted.url(),
        other = other.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    // A fully qualified name ends with the root's empty label (RFC 1034 §3.1): `secret.internal.` is
    // `secret.internal`. The upstream gets the name it was routed by, so it cannot read the request apart.
    let sent = [
        (
            "Host with a dot",
            "GET /dot/host HTTP/1.1\r\nHost: secret.internal.\r\n\r\n",
        ),
        (
            "Host with a dot and a port",
            "GET /dot/port HTTP/1.1\r\nHost: Secret.Internal.:8080\r\n\r\n",
        ),
        (
            "absolute form with a dot",
            "GET http://secret.internal./dot/absolute HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
    ];
    for (what, request) in sent {
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(request.as_bytes()).await.unwrap();
        let resp = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
        assert_eq!(resp.status, 200, "{what}: {resp:?}");
    }
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get_uri("http://secret.internal./dot/h2").await.unwrap();
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());

    let seen: Vec<(String, Vec<String>, Vec<String>)> = secret
        .recorded()
        .into_iter()
        .map(|r| {
            let host = r.header_all("host").into_iter().map(String::from).collect();
            let forwarded = r.header_all("x-forwarded-host").into_iter().map(String::from).collect();
            (r.uri, host, forwarded)
        })
        .collect();
    let expected = [
        ("/dot/host", "secret.internal"),
        ("/dot/port", "Secret.Internal:8080"),
        ("/dot/absolute", "secret.internal"),
        ("/dot/h2", "secret.internal"),
    ];
    let expected: Vec<(String, Vec<String>, Vec<String>)> = expected
        .iter()
        .map(|(uri, host)| (uri.to_string(), vec![host.to_string()], vec![host.to_string()]))
        .collect();
    assert_eq!(seen, expected);
    assert!(other.recorded().is_empty(), "{:?}", other.recorded());

    // A route written with the dot matches the name without it.
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET /dot/route HTTP/1.1\r\nHost: dotted.example\r\n\r\n")
        .await
        .unwrap();
    let resp = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(dotted.recorded_with_prefix("/dot/route").len(), 1);
    assert!(other.recorded().is_empty(), "{:?}", other.recorded());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    // Three requests in one write, a body in the middle one: each is read only after the one before it.
    conn.write(
        b"GET /status/201 HTTP/1.1\r\nHost: client.test\r\n\r\n\
          POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: 5\r\n\r\nhello\
          GET /status/203 HTTP/1.1\r\nHost: client.test\r\n\r\n",
    )
    .await
    .unwrap();
    let timeout = Duration::from_secs(5);
    let first = conn.read_response(false, timeout).await.unwrap();
    let second = conn.read_response(false, timeout).await.unwrap();
    let third = conn.read_response(false, timeout).await.unwrap();
    assert_eq!((first.status, second.status, third.status), (201, 200, 203));
    assert_eq!(second.text(), "5", "the echo counts the body it read");
    assert_eq!(
        upstream.accepted(),
        1,
        "one upstream connection carried them one after another"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_pipelined_while_the_one_before_is_at_the_upstream_is_answered_right_after_it() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--client-idle-timeout", "60s"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET /delay/800 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    // The second request arrives while the first is being answered: floodgate watches the socket for the client
    // leaving meanwhile, and that watch must leave the waiting request readable.
    wait_until("the first request at the upstream", Duration::from_secs(5), || async {
        upstream.inflight() == 1
    })
    .await;
    conn.write(b"GET /status/203 HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let timeout = Duration::from_secs(5);
    let first = conn.read_response(false, timeout).await.unwrap();
    let second = conn.read_response(false, timeout).await.unwrap();
    assert_eq!((first.status, second.status), (200, 203));
}

/// Sends `request` (head and body in one go, from a task of its own, as a client that does not wait) and reads the
/// status of the answer.
async fn status_of_upload(addr: std::net::SocketAddr, request: Vec<u8>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from, mut to) = tokio::net::TcpStream::connect(addr).await.unwrap().into_split();
    let writing = tokio::spawn(async move {
        // Refused midway once answered (floodgate closes a connection whose body it will not read): that is fine.
        let _ = to.write_all(&request).await;
        to
    });
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), from.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap_or(0);
        assert!(n > 0, "closed before an answer: {:?}", String::from_utf8_lossy(&head));
        head.extend_from_slice(&buf[..n]);
    }
    drop(writing);
    first_status(&head).expect("a status line")
}

/// A chunked upload: its head, then `chunks` chunks of `size` bytes, then its last chunk.
fn chunked_upload(chunks: usize, size: usize) -> Vec<u8> {
    let mut request = b"POST /upload HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    let chunk = format!("{size:X}\r\n{}\r\n", "x".repeat(size));
    for _ in 0..chunks {
        request.extend_from_slice(chunk.as_bytes());
    }
    request.extend_from_slice(b"0\r\n\r\n");
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_upload_answered_early_is_never_sent_upstream_short_and_framed_complete() {
    // An upstream that answers 202 on the head, then waits before reading, through a small window: floodgate's
    // upload is held up with pieces of the body read from the client and not yet sent, which the client's
    // connection, done with the request once answered, drops.
    let mut upstream = support::early::BodyUpstream::start_with(
        b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n",
        support::early::AnswerAt::Head {
            then_wait: Duration::from_millis(200),
        },
        Some(4096),
    )
    .await;
    // Not read before admission: the body streams.
    let proxy = Proxy::start(&[
        "--upstream",
        &upstream.url(),
        "--max-connections",
        "1",
        "--buffer-request-bytes",
        "0",
    ])
    .await;
    let (chunks, size) = (5_000, 1_000);
    let mut cut = 0;
    for run in 0..4 {
        assert_eq!(
            status_of_upload(proxy.listen, chunked_upload(chunks, size)).await,
            202,
            "run {run}"
        );
        let received = upstream.next(Duration::from_secs(10)).await;
        // Whole, or visibly cut (no last chunk, the connection closed): never a shorter body framed as complete.
        assert!(
            (received.bytes, received.ended) == (chunks * size, true) || !received.ended,
            "run {run}: the upstream got {received:?}"
        );
        cut += usize::from(!received.ended);
    }
    assert!(
        cut > 0,
        "no run had its body cut: the case this test is for never happened"
    );
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_upstream_request_bodies_cut_total", &[]),
        cut as f64,
        "each cut body is counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_chunks_go_upstream_gathered_and_framing_that_outweighs_its_data_is_refused() {
    let mut upstream = support::early::BodyUpstream::start(
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        support::early::AnswerAt::BodyEnd,
    )
    .await;
    // The body streams (not read before admission).
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--buffer-request-bytes", "0"]).await;
    // 2,600 one-byte chunks in one write: what is read together goes up together, in a handful of chunks and
    // writes, not one system call and five bytes of framing per byte.
    assert_eq!(status_of_upload(proxy.listen, chunked_upload(2_600, 1)).await, 200);
    let received = upstream.next(Duration::from_secs(10)).await;
    assert_eq!((received.bytes, received.ended), (2_600, true), "{received:?}");
    assert!(received.chunks <= 10, "{} chunks went upstream", received.chunks);
    // 30,000 of them: 150 KB of framing for 30 KB of data, more than the 64 KiB of slack a body has.
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(&chunked_upload(30_000, 1)).await.unwrap();
    let refused = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!(refused.status, 400, "{refused:?}");
    assert_eq!(refused.text(), "bad request body\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_body_has_it_forwarded_whenever_its_bytes_come() {
    let upstream = Upstream::start().await;
    let head = b"GET /echo HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n";
    let body = b"5\r\nhello\r\n0\r\n\r\n";
    // Read before admission (the default) or streamed; the body with the head, or after the request went on.
    for buffering in ["65536", "0"] {
        let proxy = Proxy::for_upstream(&upstream, 2, &["--buffer-request-bytes", buffering]).await;
        for together in [true, false] {
            let mut conn = RawConn::connect(proxy.listen).await;
            if together {
                conn.write(&[&head[..], &body[..]].concat()).await.unwrap();
            } else {
                let before = upstream.requests();
                conn.write(head).await.unwrap();
                if buffering == "0" {
                    // Streamed: the GET is at the upstream before its body has left the client.
                    wait_until("the GET at the upstream", Duration::from_secs(5), || async {
                        upstream.requests() > before
                    })
                    .await;
                }
                conn.write(body).await.unwrap();
            }
            let resp = conn.read_response(false, Duration::from_secs(5)).await.unwrap();
            assert_eq!(
                (resp.status, resp.text().as_str()),
                (200, "5"),
                "buffer {buffering}, body with the head: {together}"
            );
        }
    }
    // Over HTTP/2 too: DATA on a GET is its body.
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let request = http::Request::get("http://client.test/echo")
        .body(body_full("hello"))
        .unwrap();
    let resp = collect(h2.send(request).await.unwrap()).await.unwrap();
    assert_eq!((resp.status, resp.text().as_str()), (StatusCode::OK, "5"));
}

/// An upstream connection keeps its answer timer between exchanges (`kept_timer`); one left set for the upstream's
/// 10 s must not let the next exchange, on a route with 200 ms, wait past its own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_shorter_request_timeout_holds_on_a_connection_a_longer_one_used_before() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
threads = 1

[upstreams.app]
url = "{}"
max_connections = 1
request_timeout = "10s"

[[routes]]
path_prefix = "/quick"
upstream = "app"
request_timeout = "200ms"

[[routes]]
upstream = "app"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    assert_eq!(get(proxy.listen, "/delay/10").await.status, StatusCode::OK);
    let started = std::time::Instant::now();
    assert_eq!(
        get(proxy.listen, "/quick/delay/3000").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    // Both went over the one connection: the second took the timer the first left.
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_set_their_own_timeouts_strip_their_prefix_and_edit_header_fields_on_one_upstream() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.app]
url = "{}"
request_timeout = "10s"
body_idle_timeout = "10s"

[[routes]]
path_prefix = "/quick"
upstream = "app"
request_timeout = "200ms"

[[routes]]
path_prefix = "/api"
upstream = "app"
strip_prefix = true
set_request_headers = {{ "x-route" = "api", "x-client-said" = "overridden" }}
remove_request_headers = ["x-secret"]
set_response_headers = {{ "cache-control" = "no-store" }}
remove_response_headers = ["x-powered-by"]

[[routes]]
upstream = "app"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    // The route's timeout, not the upstream's 10 s.
    let started = std::time::Instant::now();
    assert_eq!(
        get(proxy.listen, "/quick/delay/2000").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    // The upstream's own on another route of the same upstream.
    assert_eq!(get(proxy.listen, "/delay/300").await.status, StatusCode::OK);

    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/api/orders/7?full=1")
        .header("x-secret", "s3cr3t")
        .header("x-client-said", "hello")
        .body(body_empty())
        .unwrap();
    let answer = collect(conn.send(request).await.unwrap()).await.unwrap();
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    let seen = upstream
        .recorded()
        .into_iter()
        .find(|r| r.path() == "/orders/7")
        .expect("the stripped path");
    assert_eq!(seen.uri, "/orders/7?full=1");
    assert_eq!(seen.header("x-route"), Some("api"));
    assert_eq!(seen.header_all("x-client-said"), vec!["overridden"]);
    assert_eq!(seen.header("x-secret"), None);
    // The prefix alone goes as the root.
    assert_eq!(get(proxy.listen, "/api").await.status, StatusCode::OK);
    assert!(
        upstream.recorded().iter().any(|r| r.uri == "/"),
        "{:?}",
        upstream.recorded()
    );
    // Other routes are left as they came.
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/plain")
        .header("x-secret", "kept")
        .body(body_empty())
        .unwrap();
    let answer = collect(conn.send(request).await.unwrap()).await.unwrap();
    assert_eq!(answer.header("cache-control"), None);
    let seen = upstream.recorded().into_iter().find(|r| r.path() == "/plain").unwrap();
    assert_eq!(seen.header("x-secret"), Some("kept"));
    assert_eq!(seen.header("x-route"), None);
}

#[test]
fn bad_route_settings_stop_start_up_naming_the_key() {
    for (settings, key) in [
        ("strip_prefix = true", "routes[0].strip_prefix"),
        ("request_timeout = \"0s\"", "routes[0].request_timeout"),
        (
            "set_request_headers = { \"bad name\" = \"x\" }",
            "routes[0].set_request_headers",
        ),
        (
            "set_response_headers = { \"content-length\" = \"5\" }",
            "routes[0].set_response_headers",
        ),
        (
            "remove_request_headers = [\"host\"]",
            "routes[0].remove_request_headers",
        ),
    ] {
        let config = TempConfig::new(&format!(
            "[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nupstream = \"app\"\n{settings}\n"
        ));
        let (status, _, stderr) = run_to_exit(&["check", "--config", &config.path_str()], Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "{settings}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid configuration: {key}")),
            "{settings}: {stderr}"
        );
    }
}

/// The answer to a GET of `target`, written on the wire byte for byte, on a fresh raw HTTP/1 connection.
async fn raw_get(proxy: &Proxy, target: &[u8]) -> RawResponse {
    let mut conn = RawConn::connect(proxy.listen).await;
    let head = [b"GET ", target, b" HTTP/1.1\r\nHost: client.test\r\n\r\n"].concat();
    conn.write(&head).await.unwrap();
    conn.read_response(false, Duration::from_secs(10)).await.unwrap()
}

/// A proxy whose only route is `/public`, its prefix stripped, to `upstream`: no catch-all behind it.
async fn public_only(upstream: &Upstream) -> (Proxy, TempConfig) {
    let config = TempConfig::new(&format!(
        "[upstreams.public]\nurl = \"{}\"\nmax_connections = 2\n\n\
         [[routes]]\npath_prefix = \"/public\"\nupstream = \"public\"\nstrip_prefix = true\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    (proxy, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_are_resolved_before_routing_and_the_upstream_gets_the_path_that_was_routed() {
    let upstream = Upstream::start().await;
    let (proxy, _config) = public_only(&upstream).await;
    // Each climbs out of /public to /admin, which no route serves; percent-encoded dots are dots (RFC 3986 §2.3).
    for target in [
        "/public/../admin",
        "/public/%2e%2e/admin",
        "/public/%2E%2E/admin",
        "/public/.%2e/admin",
        "/public/%2e./admin",
        "/public/./../admin",
        "/public/x/../../admin?q=1",
    ] {
        let resp = raw_get(&proxy, target.as_bytes()).await;
        assert_eq!(resp.status, 404, "{target}: {}", resp.text());
    }
    // Resolved within the route: forwarded as resolved, then stripped of the prefix it matched.
    for (target, forwarded) in [
        ("/public/a/./b/../c?q=/../x", "/a/c?q=/../x"),
        ("/public/%2e/x", "/x"),
        ("/public/a/%2E%2e", "/"),
        ("/public/a/b/..", "/a/"),
        ("/public/a%2Fb/c", "/a%2Fb/c"),
    ] {
        let resp = raw_get(&proxy, target.as_bytes()).await;
        assert_eq!(resp.status, 200, "{target}: {}", resp.text());
        let seen: Vec<String> = upstream.recorded().into_iter().map(|r| r.uri).collect();
        assert_eq!(seen.last().map(String::as_str), Some(forwarded), "{target}: {seen:?}");
    }
    // HTTP/2 alike.
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get("/public/%2e%2E/admin").await.unwrap();
    assert_eq!(resp.status, StatusCode::NOT_FOUND, "{}", resp.text());
    let resp = h2.try_get("/public/a/../b").await.unwrap();
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let seen: Vec<String> = upstream.recorded().into_iter().map(|r| r.uri).collect();
    assert_eq!(seen, ["/a/c?q=/../x", "/x", "/", "/a/", "/a%2Fb/c", "/b"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_climbs_above_the_root_or_hides_a_dot_segment_is_refused_400() {
    let upstream = Upstream::start().await;
    let (proxy, _config) = public_only(&upstream).await;
    for target in [
        &b"/../public/x"[..],
        b"/public/../../public/x",
        b"/%2e%2e/public/x",
        // An upstream that reads an encoded slash or a backslash as `/` would see `..` here.
        b"/public/..%2fadmin",
        b"/public/x%2F%2e%2E%2F..%2Fadmin",
        b"/public/..%5Cadmin",
        b"/public/..\\admin",
        // A servlet container reads `..;x` as `..`.
        b"/public/..;/admin",
    ] {
        let resp = raw_get(&proxy, target).await;
        assert_eq!(resp.status, 400, "{}: {}", String::from_utf8_lossy(target), resp.text());
        assert_eq!(resp.text(), "invalid request target\n");
    }
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get("/public/../../public/x").await.unwrap();
    assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{}", resp.text());
    assert!(upstream.recorded().is_empty(), "{:?}", upstream.recorded());
    let metrics = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "floodgate_requests_total", &[("outcome", "bad_request")]),
        9.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_padded_content_length_goes_upstream_as_the_number_it_states() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(
        b"POST /echo HTTP/1.1\r\nHost: client.test\r\n\
          Content-Length: 0000000000000000000000000000005\r\n\r\nhello",
    )
    .await
    .unwrap();
    let resp = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!((resp.status, resp.text()), (200, "5".to_string()));
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].header_all("content-length"), ["5"], "{:?}", seen[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_with_underscores_that_read_as_floodgates_own_fields_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        "[upstreams.app]\nurl = \"{}\"\nmax_connections = 1\n\n\
         [[routes]]\nupstream = \"app\"\nset_request_headers = {{ \"x-user-role\" = \"guest\" }}\n\
         remove_request_headers = [\"x-internal-token\"]\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    // A CGI or WSGI upstream reads `X_Forwarded_For` and `X-Forwarded-For` as the one HTTP_X_FORWARDED_FOR.
    let r = upstream_view(
        &proxy,
        &upstream,
        b"GET /headers?underscores=1 HTTP/1.1\r\n\
          Host: app.example\r\n\
          X_Forwarded_For: 6.6.6.6\r\n\
          x_forwarded-proto: https\r\n\
          X-Forwarded_Host: evil.example\r\n\
          X_Request_Id: chosen-by-the-client\r\n\
          X_User_Role: admin\r\n\
          X_Internal_Token: forged\r\n\
          X_Custom_Field: kept\r\n\
          \r\n",
    )
    .await;
    let underscored: Vec<&str> = r
        .headers
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| name.contains('_'))
        .collect();
    assert_eq!(underscored, ["x_custom_field"], "{r:?}");
    assert_eq!(r.header_all("x-forwarded-for"), ["127.0.0.1"], "{r:?}");
    assert_eq!(r.header_all("x-user-role"), ["guest"], "{r:?}");
}
