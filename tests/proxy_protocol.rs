//! The PROXY protocol on the client listener: the client's address a trusted L4 load balancer puts before the
//! connection's first byte is the one X-Forwarded-For and the access log use; anyone else's header, or a malformed
//! one, closes the connection.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

const T: Duration = Duration::from_secs(10);

async fn proxy_trusting(upstream: &Upstream, trusted: &str) -> Proxy {
    Proxy::start_with_env(
        &["--upstream", &upstream.url(), "--log-format", "json"],
        &[
            ("FLOODGATE__PROXY_PROTOCOL", "true"),
            ("FLOODGATE__TRUSTED_PROXIES", trusted),
            ("FLOODGATE__ACCESS_LOG", "stdout"),
        ],
    )
    .await
}

/// Sends `preamble` and then a GET of `path` on one connection; the answer's status, if any came.
async fn through(proxy: &Proxy, preamble: &[u8], path: &str) -> Option<u16> {
    let mut conn = RawConn::connect(proxy.listen).await;
    let mut bytes = preamble.to_vec();
    bytes.extend_from_slice(format!("GET {path} HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n").as_bytes());
    conn.write(&bytes).await.ok()?;
    conn.read_response(false, T).await.ok().map(|response| response.status)
}

/// A v2 header: PROXY command, TCP over IPv4, from `source` to 10.0.0.1:443.
fn v2(command: u8, source: [u8; 4], port: u16) -> Vec<u8> {
    let mut header = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    header.push(0x20 | command);
    header.push(0x11);
    header.extend_from_slice(&12u16.to_be_bytes());
    header.extend_from_slice(&source);
    header.extend_from_slice(&[10, 0, 0, 1]);
    header.extend_from_slice(&port.to_be_bytes());
    header.extend_from_slice(&443u16.to_be_bytes());
    header
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_balancers_v1_and_v2_headers_name_the_client_upstream_and_in_the_access_log() {
    let upstream = Upstream::start().await;
    let proxy = proxy_trusting(&upstream, "127.0.0.1/32").await;
    let v1 = b"PROXY TCP4 203.0.113.7 10.0.0.1 56324 443\r\n";
    assert_eq!(through(&proxy, v1, "/v1").await, Some(200));
    assert_eq!(
        through(&proxy, &v2(1, [198, 51, 100, 9], 40000), "/v2").await,
        Some(200)
    );
    let v6 = b"PROXY TCP6 2001:db8::5 2001:db8::1 50000 443\r\n";
    assert_eq!(through(&proxy, v6, "/v6").await, Some(200));
    let forwarded = |path: &str| {
        upstream.recorded_with_prefix(path)[0]
            .header("x-forwarded-for")
            .map(str::to_string)
    };
    assert_eq!(forwarded("/v1").as_deref(), Some("203.0.113.7"));
    assert_eq!(forwarded("/v2").as_deref(), Some("198.51.100.9"));
    assert_eq!(forwarded("/v6").as_deref(), Some("2001:db8::5"));
    let lines = proxy.access_lines(3).await;
    let client = |path: &str| {
        let line = lines.iter().find(|line| line["url.path"] == path).unwrap();
        (line["client.address"].clone(), line["client.port"].clone())
    };
    assert_eq!(
        client("/v1"),
        (serde_json::json!("203.0.113.7"), serde_json::json!(56324))
    );
    assert_eq!(
        client("/v2"),
        (serde_json::json!("198.51.100.9"), serde_json::json!(40000))
    );
    // A balancer's own health check (v2 LOCAL), and a connection without a header: served as they are.
    assert_eq!(through(&proxy, &v2(0, [192, 0, 2, 1], 1), "/local").await, Some(200));
    assert_eq!(through(&proxy, b"", "/plain").await, Some(200));
    assert_eq!(forwarded("/local").as_deref(), Some("127.0.0.1"));
    assert_eq!(forwarded("/plain").as_deref(), Some("127.0.0.1"));
    // HTTP/2 prior knowledge behind a header: the header goes, the preface is read as usual.
    let mut stream = tokio::net::TcpStream::connect(proxy.listen).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, v1).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .handshake::<_, http_body_util::Empty<bytes::Bytes>>(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let request = http::Request::get("http://app.test/h2")
        .body(http_body_util::Empty::new())
        .unwrap();
    assert_eq!(sender.send_request(request).await.unwrap().status(), StatusCode::OK);
    assert_eq!(forwarded("/h2").as_deref(), Some("203.0.113.7"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peers_header_or_a_malformed_one_closes_the_connection() {
    let upstream = Upstream::start().await;
    let untrusting = proxy_trusting(&upstream, "10.0.0.0/8").await;
    let spoofed = b"PROXY TCP4 203.0.113.7 10.0.0.1 56324 443\r\n";
    assert_eq!(
        through(&untrusting, spoofed, "/spoofed").await,
        None,
        "closed without an answer"
    );
    assert_eq!(
        through(&untrusting, &v2(1, [203, 0, 113, 7], 1), "/spoofed").await,
        None
    );
    // Without a header, the same peer is an ordinary client, even one whose first bytes could begin a signature:
    // a leading empty line (RFC 9112 §2.2) sent on its own.
    assert_eq!(through(&untrusting, b"", "/direct").await, Some(200));
    let mut conn = RawConn::connect(untrusting.listen).await;
    conn.write(b"\r\n").await.unwrap();
    // Apart from the request, so that the proxy sees the two bytes alone (no signal tells when it has).
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.write(b"GET /direct HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(conn.read_response(false, T).await.unwrap().status, 200);
    let trusting = proxy_trusting(&upstream, "127.0.0.1/32").await;
    for malformed in [
        &b"PROXY TCP4 999.0.113.7 10.0.0.1 56324 443\r\n"[..],
        b"PROXY TCP4 203.0.113.7\r\n",
        b"PROXY UDP9 a b c d\r\n",
    ] {
        assert_eq!(through(&trusting, malformed, "/malformed").await, None, "{malformed:?}");
    }
    assert!(upstream.recorded_with_prefix("/spoofed").is_empty());
    assert!(upstream.recorded_with_prefix("/malformed").is_empty());
    assert_eq!(upstream.recorded_with_prefix("/direct").len(), 2);
}
