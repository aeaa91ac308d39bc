//! Abuse: what hostile or broken clients send, judged by what the client is answered and by what the upstream
//! actually receives (and never receives). Malformed heads, request smuggling through the framing headers, a body
//! that breaks after its head went upstream, slowloris, ten thousand idle clients, and running out of file
//! descriptors. listener.rs holds the first 400/431 cases and the silent client; these extend them.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const UP: &str = "default";
const T: Duration = Duration::from_secs(10);

/// Writes `request` on a new connection and reads one response; the write may fail half way (the proxy answered
/// and closed before reading everything), the answer is still read.
async fn answer(addr: SocketAddr, request: &[u8]) -> std::io::Result<RawResponse> {
    let mut conn = RawConn::connect(addr).await;
    let _ = conn.write(request).await;
    conn.read_response(false, T).await
}

/// `floodgate_requests_total` for `outcome`, summed over upstreams and the client side.
async fn outcome_total(proxy: &Proxy, outcome: &str) -> f64 {
    metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_requests_total",
        &[("outcome", outcome)],
    )
}

/// What every test ends with: no slot held, never more upstream connections than `cap`, and still serving.
async fn assert_still_sound(proxy: &Proxy, upstream: &Upstream, cap: usize) {
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    assert!(
        upstream.peak_connections() <= cap,
        "upstream saw {} connections at once, cap {cap}",
        upstream.peak_connections()
    );
    let resp = get(proxy.listen, "/still-serving").await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
}

fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------------------------------
// Malformed heads
// ---------------------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_request_lines_and_header_fields_get_400_and_nothing_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    // RFC 9112 / 9110 say each of these is invalid; hyper (httparse) refuses most before floodgate sees them,
    // floodgate refuses the Host cases (RFC 9112 §3.2: missing on HTTP/1.1, repeated, or not a valid host).
    let cases: &[(&str, &[u8])] = &[
        (
            "method with a non-token byte",
            b"G@T / HTTP/1.1\r\nHost: client.test\r\n\r\n",
        ),
        ("lower-case version", b"GET / http/1.1\r\nHost: client.test\r\n\r\n"),
        // RFC 9110 §2.5 would serve HTTP/1.2 as 1.1; httparse only knows 1.0 and 1.1, so refusing is what happens.
        ("unknown minor version", b"GET / HTTP/1.2\r\nHost: client.test\r\n\r\n"),
        (
            "HTTP/2.0 in a request line",
            b"GET / HTTP/2.0\r\nHost: client.test\r\n\r\n",
        ),
        ("HTTP/0.9 request line", b"GET /\r\n\r\n"),
        (
            "two spaces after the method",
            b"GET  / HTTP/1.1\r\nHost: client.test\r\n\r\n",
        ),
        (
            "space inside the target",
            b"GET /a b HTTP/1.1\r\nHost: client.test\r\n\r\n",
        ),
        (
            "control byte in the target",
            b"GET /\x01 HTTP/1.1\r\nHost: client.test\r\n\r\n",
        ),
        (
            "non-ASCII byte in the target",
            b"GET /\xff HTTP/1.1\r\nHost: client.test\r\n\r\n",
        ),
        (
            "space before the colon",
            b"GET / HTTP/1.1\r\nHost : client.test\r\n\r\n",
        ),
        (
            "whitespace before the first field",
            b"GET / HTTP/1.1\r\n Host: client.test\r\n\r\n",
        ),
        (
            "empty field name",
            b"GET / HTTP/1.1\r\nHost: client.test\r\n: x\r\n\r\n",
        ),
        (
            "NUL in a field name",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX\x00Y: 1\r\n\r\n",
        ),
        (
            "NUL in a field value",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\x00b\r\n\r\n",
        ),
        (
            "control byte in a field value",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\x01b\r\n\r\n",
        ),
        (
            "DEL in a field value",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\x7fb\r\n\r\n",
        ),
        (
            "bare CR ending the request line",
            b"GET / HTTP/1.1\rHost: client.test\r\n\r\n",
        ),
        (
            "bare CR inside a field value",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\rb\r\n\r\n",
        ),
        (
            "obs-fold continuation (SP)",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\r\n b\r\n\r\n",
        ),
        (
            "obs-fold continuation (HTAB)",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nX-A: a\r\n\tb\r\n\r\n",
        ),
        ("HTTP/1.1 without Host", b"GET / HTTP/1.1\r\nX-A: 1\r\n\r\n"),
        (
            "two different Host lines",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nHost: other.test\r\n\r\n",
        ),
        (
            "the same Host twice",
            b"GET / HTTP/1.1\r\nHost: client.test\r\nHost: client.test\r\n\r\n",
        ),
        ("empty Host", b"GET / HTTP/1.1\r\nHost:\r\n\r\n"),
        (
            "Host with a space and a path",
            b"GET / HTTP/1.1\r\nHost: client.test /x\r\n\r\n",
        ),
        (
            "Host with userinfo",
            b"GET / HTTP/1.1\r\nHost: user@client.test\r\n\r\n",
        ),
    ];
    for (what, request) in cases {
        let resp = answer(proxy.listen, request)
            .await
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        assert_eq!(resp.status, 400, "{what}: {:?} answered {resp:?}", show(request));
    }
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());
    assert_eq!(upstream.accepted(), 0, "no upstream connection was even opened");
    // Every refusal is counted, whoever made it (hyper's parse errors are counted when the connection ends).
    let expected = cases.len() as f64;
    wait_until(
        "every refusal is counted as bad_request",
        Duration::from_secs(5),
        || async { outcome_total(&proxy, "bad_request").await == expected },
    )
    .await;
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_lf_line_endings_are_accepted_and_reach_the_upstream_as_a_normal_request() {
    // RFC 9112 §2.2 lets a recipient accept a lone LF as a line terminator; hyper does, and what goes upstream is
    // re-serialised by floodgate, so the upstream never sees the odd line endings.
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let resp = answer(proxy.listen, b"GET /lf HTTP/1.1\nHost: client.test\nX-Lf: 1\n\n")
        .await
        .unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    let seen = upstream.recorded_with_prefix("/lf");
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].header_all("x-lf"), vec!["1"]);
    assert_eq!(seen[0].header_all("host"), vec!["client.test"]);
    assert_eq!(upstream.rejected(), 0);
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authority_form_targets_and_schemes_other_than_http_get_400_and_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    // RFC 9112 §3.2.3: authority form is for CONNECT alone (CONNECT itself is refused as a tunnel, 501); a proxy
    // in front of an origin serves http and https targets and nothing else.
    let cases: &[(&str, &[u8])] = &[
        (
            "authority form on GET",
            b"GET evil.example:81 HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        (
            "authority form on OPTIONS",
            b"OPTIONS evil.example:81 HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        (
            "authority form on POST",
            b"POST evil.example:81 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab",
        ),
        (
            "gopher scheme",
            b"GET gopher://evil.example/x HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        ("ftp scheme", b"GET ftp://evil.example/ HTTP/1.1\r\nHost: x\r\n\r\n"),
        (
            "ws scheme without Upgrade",
            b"GET ws://evil.example/ HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
    ];
    for (what, request) in cases {
        let resp = answer(proxy.listen, request)
            .await
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        assert_eq!(resp.status, 400, "{what}: {:?} answered {resp:?}", show(request));
    }
    // HTTP/2 carries the scheme as `:scheme`.
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get_uri("gopher://evil.example/h2").await.unwrap();
    assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{}", resp.text());
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());

    // https in absolute form on a plain listener is served as http is: the scheme names the origin, and what
    // goes upstream (X-Forwarded-Proto included) depends on how the client reached floodgate, not on it.
    for target in ["https://app.example/abs-https", "HTTP://app.example/abs-http-upper"] {
        let request = format!("GET {target} HTTP/1.1\r\nHost: x\r\n\r\n");
        let resp = answer(proxy.listen, request.as_bytes()).await.unwrap();
        assert_eq!(resp.status, 200, "{target}: {resp:?}");
    }
    let seen = upstream.recorded_with_prefix("/abs-");
    assert_eq!(seen.len(), 2, "{seen:?}");
    for r in &seen {
        assert_eq!(r.header_all("host"), vec!["app.example"], "{r:?}");
        assert_eq!(r.header_all("x-forwarded-proto"), vec!["http"], "{r:?}");
    }
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_with_a_port_past_65535_or_an_empty_label_get_400_and_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    // A port is a 16-bit number (RFC 6335): past it, one reader wraps it and another refuses it. A name with an
    // empty label other than the final root one is no DNS name; routing and the upstream might read it apart.
    let refused = [
        ("port 99999", "GET / HTTP/1.1\r\nHost: x:99999\r\n\r\n"),
        ("port 65536", "GET / HTTP/1.1\r\nHost: x:65536\r\n\r\n"),
        (
            "port past u64",
            "GET / HTTP/1.1\r\nHost: x:99999999999999999999999\r\n\r\n",
        ),
        ("port with a letter", "GET / HTTP/1.1\r\nHost: x:8o\r\n\r\n"),
        (
            "IPv6 literal, port 70000",
            "GET / HTTP/1.1\r\nHost: [::1]:70000\r\n\r\n",
        ),
        (
            "absolute form, port 99999",
            "GET http://x:99999/ HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        ("two trailing dots", "GET / HTTP/1.1\r\nHost: secret.internal..\r\n\r\n"),
        ("a leading dot", "GET / HTTP/1.1\r\nHost: .secret.internal\r\n\r\n"),
        ("an empty inner label", "GET / HTTP/1.1\r\nHost: a..b\r\n\r\n"),
        ("the root alone", "GET / HTTP/1.1\r\nHost: .\r\n\r\n"),
    ];
    for (what, request) in refused {
        let resp = answer(proxy.listen, request.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        assert_eq!(resp.status, 400, "{what}: {request:?} answered {resp:?}");
    }
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get_uri("http://x:99999/h2").await.unwrap();
    assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{}", resp.text());
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());

    // The ends of the range, and a name's one trailing dot, pass.
    for host in ["x:65535", "x:0", "[::1]:443", "app.example."] {
        let request = format!("GET /port-ok HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let resp = answer(proxy.listen, request.as_bytes()).await.unwrap();
        assert_eq!(resp.status, 200, "{host}: {resp:?}");
    }
    assert_eq!(upstream.recorded_with_prefix("/port-ok").len(), 4);
    assert_still_sound(&proxy, &upstream, 1).await;
}

/// A request head of `fields` lines of 64 bytes each, plus the request line and Host.
fn head_with_fields(path: &str, fields: usize) -> Vec<u8> {
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: client.test\r\n").into_bytes();
    for i in 0..fields {
        head.extend_from_slice(format!("X-Pad-{i:03}: {}\r\n", "p".repeat(50)).as_bytes());
    }
    head.extend_from_slice(b"\r\n");
    head
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_past_a_configured_max_header_bytes_get_431_however_they_arrive_and_smaller_ones_pass() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new("max_header_bytes = 4096\n");
    let path = config.path_str();
    let proxy = Proxy::for_upstream(&upstream, 1, &["--config", &path]).await;

    // Well under the limit: served.
    let under = head_with_fields("/under", 40);
    assert!(under.len() < 3000);
    assert_eq!(answer(proxy.listen, &under).await.unwrap().status, 200);

    // Over it: a long request target, many fields in one write, and the same head in small pieces (the limit is
    // on the head as a whole, not on each read).
    let long_target = format!("GET /{} HTTP/1.1\r\nHost: client.test\r\n\r\n", "t".repeat(5000));
    let (data, _) = raw_exchange(proxy.listen, long_target.as_bytes(), T).await;
    assert_eq!(first_status(&data), Some(431), "long target: {:?}", show(&data));
    let over = head_with_fields("/over", 100);
    let (data, _) = raw_exchange(proxy.listen, &over, T).await;
    assert_eq!(first_status(&data), Some(431), "many fields: {:?}", show(&data));
    let mut conn = RawConn::connect(proxy.listen).await;
    for piece in head_with_fields("/pieces", 100).chunks(200) {
        if conn.write(piece).await.is_err() {
            break; // answered and closed before the rest was sent
        }
    }
    let (data, end) = conn.read_until_close(T).await;
    assert_eq!(first_status(&data), Some(431), "in pieces: {:?}", show(&data));
    assert_ne!(end, ReadEnd::Timeout);
    wait_until("the three are counted as header_too_large", T, || async {
        outcome_total(&proxy, "header_too_large").await == 3.0
    })
    .await;

    // HTTP/2: the h2 layer answers 431 itself (so floodgate does not count it) and the connection lives on.
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let big = http::Request::get(proxy.url("/h2-over"))
        .header("x-big", "b".repeat(8000))
        .body(body_empty())
        .unwrap();
    assert_eq!(
        h2.send(big).await.unwrap().status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(h2.try_get("/h2-after").await.unwrap().status, StatusCode::OK);

    let paths: Vec<String> = upstream.recorded().into_iter().map(|r| r.uri).collect();
    assert_eq!(paths, vec!["/under", "/h2-after"]);
    assert_still_sound(&proxy, &upstream, 1).await;
}

// ---------------------------------------------------------------------------------------------------------------
// Framing: Content-Length and Transfer-Encoding
// ---------------------------------------------------------------------------------------------------------------

/// A request that carries both framings and, past the end of the body as chunked framing reads it, a second
/// request a front end reading Content-Length would take as body (CL.TE); or a chunk whose data is a request a
/// back end reading Content-Length would take as the next one (TE.CL).
fn smuggling_request(case: &str, cl_first: bool, te_cl: bool) -> (Vec<u8>, usize) {
    let inner = b"GET /smuggled HTTP/1.1\r\nHost: client.test\r\n\r\n";
    let (content_length, body, decoded_len) = if te_cl {
        let mut body = format!("{:x}\r\n", inner.len()).into_bytes();
        body.extend_from_slice(inner);
        body.extend_from_slice(b"\r\n0\r\n\r\n");
        (4, body, inner.len())
    } else {
        let mut body = b"0\r\n\r\n".to_vec();
        body.extend_from_slice(inner);
        (6, body, 0)
    };
    let cl = format!("Content-Length: {content_length}\r\n");
    let te = "Transfer-Encoding: chunked\r\n";
    let (first, second) = if cl_first { (cl.as_str(), te) } else { (te, cl.as_str()) };
    let mut request =
        format!("POST /echo?case={case} HTTP/1.1\r\nHost: client.test\r\n{first}{second}\r\n").into_bytes();
    request.extend_from_slice(&body);
    (request, decoded_len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_with_transfer_encoding_reaches_the_upstream_as_chunked_only_and_ends_the_client_connection() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    for (case, cl_first, te_cl) in [
        ("cl-te-order-cl-te", true, false),
        ("cl-te-order-te-cl", false, false),
        ("te-cl-order-cl-te", true, true),
        ("te-cl-order-te-cl", false, true),
    ] {
        let (request, decoded_len) = smuggling_request(case, cl_first, te_cl);
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(&request).await.unwrap();
        let resp = conn.read_response(false, T).await.unwrap();
        assert_eq!(resp.status, 200, "{case}: {resp:?}");
        // The upstream read the body by chunked framing: exactly the chunk data, not 4 or 6 bytes.
        assert_eq!(
            resp.text(),
            decoded_len.to_string(),
            "{case}: bytes the upstream read as body"
        );
        // RFC 9112 §6.1: the server must close the connection after answering such a request, so whatever followed
        // the body on it is never read as a request.
        assert_eq!(
            resp.header("connection").map(str::to_ascii_lowercase).as_deref(),
            Some("close"),
            "{case}: {resp:?}"
        );
        let (rest, end) = conn.read_until_close(T).await;
        assert_ne!(end, ReadEnd::Timeout, "{case}: client connection left open");
        assert!(
            rest.is_empty(),
            "{case}: a second answer on the connection: {:?}",
            show(&rest)
        );

        let seen = upstream.recorded_with_prefix("/echo");
        let this: Vec<_> = seen.iter().filter(|r| r.uri.ends_with(case)).collect();
        assert_eq!(this.len(), 1, "{case}: {seen:?}");
        assert_eq!(
            this[0].header_all("transfer-encoding"),
            vec!["chunked"],
            "{case}: {:?}",
            this[0]
        );
        assert!(
            this[0].header("content-length").is_none(),
            "{case}: both framings went upstream: {:?}",
            this[0]
        );
    }
    assert!(
        upstream.recorded_with_prefix("/smuggled").is_empty(),
        "{:?}",
        upstream.recorded()
    );
    assert_eq!(upstream.requests(), 4, "{:?}", upstream.recorded());
    assert_eq!(upstream.rejected(), 0);
    assert_still_sound(&proxy, &upstream, 1).await;
}

/// `POST /echo` with the given framing lines and raw body bytes.
fn framed(framing: &str, body: &str) -> Vec<u8> {
    format!("POST /echo HTTP/1.1\r\nHost: client.test\r\n{framing}\r\n{body}").into_bytes()
}

/// A bare LF where the end of a chunked body needs CRLF. hyper's own reader takes it as a line's end and reads the
/// request pipelined behind it as trailers, where a strict reader (and an LF-tolerant front) sees that request: the
/// two disagree on where the next request starts. floodgate refuses the body instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_lf_in_a_last_chunk_or_trailers_is_refused_and_nothing_behind_it_read() {
    let upstream = Upstream::start().await;
    let cases: &[(&str, &[u8])] = &[
        ("bare LF ends the last chunk", b"0\n\r\n"),
        ("bare LF ends a trailer line", b"0\r\nx-t: 1\n\r\n"),
        ("bare LF ends the trailer section", b"0\r\n\n"),
        ("bare LF ends a trailer line and the section", b"0\r\nx-t: 1\n\n"),
    ];
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    for (i, (what, end)) in cases.iter().enumerate() {
        let mut request =
            format!("POST /echo/{i} HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
                .into_bytes();
        request.extend_from_slice(end);
        request.extend_from_slice(format!("GET /smuggled/{i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes());
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(&request).await.unwrap();
        let resp = conn.read_response(false, T).await.unwrap();
        assert_eq!(resp.status, 400, "{what}: {resp:?}");
        let (rest, end) = conn.read_until_close(T).await;
        assert_ne!(end, ReadEnd::Timeout, "{what}: connection left open");
        assert!(rest.is_empty(), "{what}: a second answer: {:?}", show(&rest));
    }
    // A body read whole before admission: one refused never goes upstream, nor does what followed it.
    let reached: Vec<_> = upstream
        .recorded()
        .into_iter()
        .filter(|r| r.uri.starts_with("/echo") || r.uri.starts_with("/smuggled"))
        .collect();
    assert!(reached.is_empty(), "{reached:?}");
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_encodings_other_than_one_final_chunked_are_refused_and_its_other_spellings_normalised() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let body = "3\r\nabc\r\n0\r\n\r\n";
    // Refused: RFC 9112 §6.3 (chunked must be final: 400), §6.1 (chunked applied once: 400, as h11 answers; a coding
    // the server does not understand: 501, as floodgate would otherwise drop it with the hop-by-hop header and hand
    // the upstream an undeclared coding).
    let refused: &[(&str, String, u16)] = &[
        (
            "chunked on two lines",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n".into(),
            400,
        ),
        (
            "chunked twice in one line",
            "Transfer-Encoding: chunked, chunked\r\n".into(),
            400,
        ),
        (
            "chunked then identity",
            "Transfer-Encoding: chunked, identity\r\n".into(),
            400,
        ),
        ("xchunked", "Transfer-Encoding: xchunked\r\n".into(), 400),
        (
            "chunked line then identity line",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n".into(),
            400,
        ),
        ("space before the colon", "Transfer-Encoding : chunked\r\n".into(), 400),
        (
            "vertical tab before chunked",
            "Transfer-Encoding:\x0bchunked\r\n".into(),
            400,
        ),
        ("gzip then chunked", "Transfer-Encoding: gzip, chunked\r\n".into(), 501),
        (
            "unknown line then chunked line",
            "Transfer-Encoding: x-custom\r\nTransfer-Encoding: chunked\r\n".into(),
            501,
        ),
    ];
    for (what, framing, status) in refused {
        let resp = answer(proxy.listen, &framed(framing, body)).await.unwrap();
        assert_eq!(resp.status, *status, "{what}: {resp:?}");
    }
    let http10 = format!("POST /echo HTTP/1.0\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n{body}");
    let resp = answer(proxy.listen, http10.as_bytes()).await.unwrap();
    assert_eq!(
        resp.status, 400,
        "Transfer-Encoding on HTTP/1.0 (RFC 9112 §6.1): {resp:?}"
    );
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());

    // Accepted, and normalised: the upstream gets one `Transfer-Encoding: chunked` and the decoded bytes.
    let normalised = [
        ("capitalised", "Transfer-Encoding: Chunked\r\n"),
        ("identity then chunked", "Transfer-Encoding: identity, chunked\r\n"),
    ];
    goes_upstream_chunked(&proxy, &upstream, &normalised, body, 0).await;
    assert_still_sound(&proxy, &upstream, 1).await;
}

/// Each of `cases` (a name and the request's framing lines) is answered 200 by an upstream that got one
/// `Transfer-Encoding: chunked` and the decoded body (`abc`); `before` requests reached the upstream earlier.
async fn goes_upstream_chunked(proxy: &Proxy, upstream: &Upstream, cases: &[(&str, &str)], body: &str, before: usize) {
    for (i, (what, framing)) in cases.iter().enumerate() {
        let resp = answer(proxy.listen, &framed(framing, body)).await.unwrap();
        assert_eq!(resp.status, 200, "{what}: {resp:?}");
        assert_eq!(resp.text(), "3", "{what}: the upstream read the decoded body");
        let seen = upstream.recorded();
        assert_eq!(seen.len(), before + i + 1, "{what}: {seen:?}");
        let last = &seen[before + i];
        assert_eq!(
            last.header_all("transfer-encoding"),
            vec!["chunked"],
            "{what}: {last:?}"
        );
        assert!(last.header("content-length").is_none(), "{what}: {last:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_transfer_encoding_list_elements_are_ignored_and_the_body_goes_upstream_chunked() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let body = "3\r\nabc\r\n0\r\n\r\n";
    // RFC 9110 §5.6.1: a recipient ignores empty list elements.
    let accepted = [
        ("a leading comma", "Transfer-Encoding: ,chunked\r\n"),
        ("a leading comma and a space", "Transfer-Encoding: , chunked\r\n"),
        ("an empty element between", "Transfer-Encoding: identity,,chunked\r\n"),
        (
            "an empty line before chunked",
            "Transfer-Encoding: ,\r\nTransfer-Encoding: chunked\r\n",
        ),
    ];
    goes_upstream_chunked(&proxy, &upstream, &accepted, body, 0).await;
    // An empty element does not hide a coding floodgate cannot pass on.
    let resp = answer(proxy.listen, &framed("Transfer-Encoding: gzip,,chunked\r\n", body))
        .await
        .unwrap();
    assert_eq!(resp.status, 501, "{resp:?}");
    // hyper reads only the last element of the last line, so an empty one there hides the final chunked from it:
    // refused (400), which is the safe side of the rule, before floodgate sees the request.
    let resp = answer(proxy.listen, &framed("Transfer-Encoding: chunked,\r\n", body))
        .await
        .unwrap();
    assert_eq!(resp.status, 400, "{resp:?}");
    assert_eq!(upstream.requests(), accepted.len(), "{:?}", upstream.recorded());
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_or_malformed_content_lengths_are_refused_and_identical_repeats_go_upstream_once() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    // RFC 9112 §6.3: an invalid or conflicting Content-Length is unrecoverable (400). "1, 1" is a list RFC 9110
    // §8.6 lets a recipient either collapse or refuse; hyper refuses it, which is the safe side.
    let refused = [
        ("two different lengths", "Content-Length: 1\r\nContent-Length: 2\r\n"),
        ("a list of equal lengths", "Content-Length: 1, 1\r\n"),
        ("a list of different lengths", "Content-Length: 1, 2\r\n"),
        ("a sign", "Content-Length: +1\r\n"),
        ("negative", "Content-Length: -1\r\n"),
        ("hexadecimal", "Content-Length: 0x1\r\n"),
        ("past u64", "Content-Length: 99999999999999999999999\r\n"),
        ("empty", "Content-Length:\r\n"),
    ];
    for (what, framing) in refused {
        let resp = answer(proxy.listen, &framed(framing, "ab")).await.unwrap();
        assert_eq!(resp.status, 400, "{what}: {resp:?}");
    }
    assert_eq!(upstream.requests(), 0, "{:?}", upstream.recorded());

    let resp = answer(
        proxy.listen,
        &framed("Content-Length: 2\r\nContent-Length: 2\r\n", "ab"),
    )
    .await
    .unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.text(), "2");
    let seen = upstream.recorded();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].header_all("content-length"), vec!["2"], "{:?}", seen[0]);
    assert!(seen[0].header("transfer-encoding").is_none());
    assert_still_sound(&proxy, &upstream, 1).await;
}

// ---------------------------------------------------------------------------------------------------------------
// A body that breaks after its head went upstream
// ---------------------------------------------------------------------------------------------------------------

/// How a chunked request body goes wrong after its first chunk.
enum Break {
    /// These bytes follow the first chunk.
    With(&'static [u8]),
    /// The client shuts its sending side (it still reads).
    HalfClose,
    /// The client sends nothing more, connection open.
    GoQuiet,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_that_breaks_after_the_head_went_upstream_is_answered_4xx_and_its_upstream_connection_closed_not_pooled() {
    let upstream = Upstream::start().await;
    // The streaming path: a body read before admission never gets its head upstream (tests/buffering.rs).
    let proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--body-idle-timeout", "500ms", "--buffer-request-bytes", "0"],
    )
    .await;
    assert_eq!(get(proxy.listen, "/warm").await.status, StatusCode::OK);
    let warm_conn = upstream.recorded_with_prefix("/warm")[0].conn_id;
    let cases = [
        (
            "chunk size that is not hex",
            Break::With(b"zz\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        (
            "chunk longer than its size",
            Break::With(b"3\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        (
            "chunk size past u64",
            Break::With(b"1ffffffffffffffffff\r\nx\r\n0\r\n\r\n"),
            400,
        ),
        ("client closes its side mid-body", Break::HalfClose, 400),
        ("client goes quiet mid-body past body_idle_timeout", Break::GoQuiet, 408),
    ];
    let mut previous_conn = warm_conn;
    for (i, (what, how, status)) in cases.iter().enumerate() {
        let path = format!("/echo/broken-{i}");
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(
            format!("POST {path} HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        // The head is at the upstream (and the connection it came on is the pooled one) before the body breaks.
        wait_until_sync("the head reached the upstream", T, || {
            !upstream.recorded_with_prefix(&path).is_empty()
        })
        .await;
        let used = upstream.recorded_with_prefix(&path)[0].conn_id;
        assert_eq!(used, previous_conn, "{what}: the head went over the pooled connection");
        let accepted = upstream.accepted();
        match how {
            Break::With(bytes) => conn.write(bytes).await.unwrap(),
            Break::HalfClose => conn.stream.shutdown().await.unwrap(),
            Break::GoQuiet => {}
        }
        // The client's own failure: a 4xx, not a 502 that would blame the upstream.
        let resp = conn.read_response(false, T).await.unwrap();
        assert_eq!(resp.status, *status, "{what}: {resp:?}");
        let (_, end) = conn.read_until_close(T).await;
        assert_ne!(
            end,
            ReadEnd::Timeout,
            "{what}: the client connection stays open after a broken body"
        );

        // The upstream saw its connection end: half a body on it, it can never carry another request.
        wait_until_sync("the upstream connection is closed", T, || upstream.connections() == 0).await;
        proxy.wait_in_use_zero(UP, T).await;
        // The proxy's count follows once its side of the close is done too.
        wait_until(&format!("{what}: no connection open"), T, || async {
            proxy.upstream_field(UP, "connections_open").await == 0
        })
        .await;
        let resp = get(proxy.listen, &format!("/after/broken-{i}")).await;
        assert_eq!(resp.status, StatusCode::OK, "{what}: {}", resp.text());
        let after = upstream.recorded_with_prefix(&format!("/after/broken-{i}"));
        assert_eq!(after.len(), 1);
        assert_ne!(
            after[0].conn_id, used,
            "{what}: the next request went over the broken connection"
        );
        assert_eq!(
            upstream.accepted(),
            accepted + 1,
            "{what}: one fresh connection for the next request"
        );
        previous_conn = after[0].conn_id;
    }
    let n = cases.len();
    assert_eq!(
        upstream.recorded_with_prefix("/echo").len(),
        n,
        "each broken request reached the upstream once"
    );
    assert_eq!(proxy.outcome_count(UP, "bad_request").await, (n - 2) as f64);
    // A body cut short by the client closing its side is an abort (the 400 is for a client still reading).
    assert_eq!(proxy.outcome_count(UP, "client_abort").await, 1.0);
    assert_eq!(proxy.outcome_count(UP, "client_timeout").await, 1.0);
    assert_eq!(
        proxy.outcome_count(UP, "upstream_error").await,
        0.0,
        "the upstream is not blamed"
    );
    assert_still_sound(&proxy, &upstream, 1).await;
}

// ---------------------------------------------------------------------------------------------------------------
// Slowloris
// ---------------------------------------------------------------------------------------------------------------

/// Trickles a request head that never ends, one byte every `every`, until the proxy closes the connection.
/// Returns how long after the first byte that was, and what the proxy sent before closing.
async fn trickle_head(addr: SocketAddr, every: Duration) -> (Duration, Vec<u8>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (mut read, mut write) = stream.into_split();
    let started = Instant::now();
    let writer = async move {
        let head = b"GET /slowloris HTTP/1.1\r\nHost: client.test\r\nX-Slow: ";
        for byte in head.iter().chain(std::iter::repeat(&b'a')) {
            if write.write_all(&[*byte]).await.is_err() {
                break;
            }
            // The load under test: a client that keeps the head alive with a byte at a time.
            tokio::time::sleep(every).await;
        }
        std::future::pending::<()>().await
    };
    let reader = async move {
        let mut received = Vec::new();
        let _ = tokio::time::timeout(T, read.read_to_end(&mut received)).await;
        received
    };
    tokio::select! {
        received = reader => (started.elapsed(), received),
        _ = writer => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_trickling_heads_are_cut_off_at_header_read_timeout_and_never_take_a_slot() {
    const TRICKLERS: usize = 20;
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--header-read-timeout", "1s"]).await;
    let tricklers: Vec<_> = (0..TRICKLERS)
        .map(|_| tokio::spawn(trickle_head(proxy.listen, Duration::from_millis(150))))
        .collect();
    wait_until("the tricklers are connected", T, || async {
        proxy.status().await["client_connections"].as_u64() == Some(TRICKLERS as u64)
    })
    .await;
    // Meanwhile the one slot is free for a real client, which is served at once.
    let started = Instant::now();
    assert_eq!(get(proxy.listen, "/real").await.status, StatusCode::OK);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "served after {:?}",
        started.elapsed()
    );
    assert_eq!(proxy.upstream_field(UP, "in_use").await, 0);

    for trickler in tricklers {
        let (closed_after, received) = trickler.await.unwrap();
        // Each byte is progress to a naive timer; header_read_timeout counts from the first byte regardless.
        assert!(
            closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(5),
            "trickled head closed {closed_after:?} after its first byte, header_read_timeout 1s"
        );
        // floodgate drops the connection itself (hyper has no hook to answer 408 on a deadline it does not own).
        assert!(
            received.is_empty() || first_status(&received) == Some(408),
            "answered {:?}",
            show(&received)
        );
    }
    assert!(upstream.recorded_with_prefix("/slowloris").is_empty());
    assert_eq!(
        upstream.accepted(),
        1,
        "only the real client's request made an upstream connection"
    );
    wait_until("every trickler is counted as a client timeout", T, || async {
        outcome_total(&proxy, "client_timeout").await == TRICKLERS as f64
    })
    .await;
    wait_until("the tricklers' connections are gone", T, || async {
        proxy.status().await["client_connections"].as_u64() == Some(0)
    })
    .await;
    assert_still_sound(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_post_trickling_its_body_holds_its_slot_no_longer_than_request_timeout() {
    // Past the head, every body byte is progress to body_idle_timeout; what bounds a body trickled forever is
    // request_timeout, which runs from dispatch to the upstream's response head.
    let upstream = Upstream::start().await;
    // The streaming path; a body read before admission is bounded the same way (tests/buffering.rs).
    let proxy = Proxy::for_upstream(
        &upstream,
        1,
        &[
            "--request-timeout",
            "1s",
            "--body-idle-timeout",
            "5s",
            "--buffer-request-bytes",
            "0",
        ],
    )
    .await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"POST /echo/slow-post HTTP/1.1\r\nHost: client.test\r\nContent-Length: 1000\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    // One byte, then up to 200 ms of listening for the answer (the load under test), until answered.
    let trickler = spawn_trickler(conn);
    wait_until_sync("the head reached the upstream", T, || upstream.requests() == 1).await;
    // A client queued behind it gets the slot once request_timeout has passed.
    let queued = get(proxy.listen, "/queued-behind").await;
    assert_eq!(queued.status, StatusCode::OK);
    let freed_after = started.elapsed();
    assert!(
        freed_after >= Duration::from_millis(900) && freed_after < Duration::from_secs(4),
        "the slot came free {freed_after:?} into a trickled body, request_timeout 1s"
    );
    // The trickler is answered 408: when the time ran out, the upstream was waiting on the client's body.
    let resp = trickler.await.unwrap();
    assert_eq!(resp.status, 408, "{resp:?}");
    assert_eq!(proxy.outcome_count("default", "client_timeout").await, 1.0);
    assert_eq!(proxy.outcome_count("default", "upstream_timeout").await, 0.0);
    assert_eq!(upstream.accepted(), 2, "the trickled connection was not reused");
    assert_still_sound(&proxy, &upstream, 1).await;
}

// ---------------------------------------------------------------------------------------------------------------
// Ten thousand idle clients
// ---------------------------------------------------------------------------------------------------------------

const IDLE_CLIENTS: usize = 10_000;
/// The proxy's own open-files limit for that test: the idle clients, the upstream pool and some headroom.
const IDLE_TEST_PROXY_FDS: u64 = 12_000;
/// Resident memory the proxy may add per idle client connection. Measured on Linux x86_64: about 5 KiB for one
/// that has sent nothing yet and 17 KiB for a keep-alive one between requests (hyper's read buffer).
const MAX_KIB_PER_IDLE_CLIENT: u64 = 24;

/// Raises this process's soft open-files limit as far as the hard limit allows; None (with the reason printed)
/// when the hard limit is below `needed`.
fn raise_fd_limit(needed: u64) -> Option<u64> {
    let (_, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).ok()?;
    if hard < needed {
        println!(
            "SKIPPED: this test needs an open-files hard limit of at least {needed}, the hard limit here is {hard}"
        );
        return None;
    }
    rlimit::increase_nofile_limit(u64::MAX).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_client_connections_leave_others_served_promptly_with_bounded_proxy_memory() {
    let Some(limit) = raise_fd_limit(IDLE_TEST_PROXY_FDS) else {
        return;
    };
    assert!(limit >= IDLE_TEST_PROXY_FDS, "soft limit only raised to {limit}");
    let upstream = Upstream::start().await;
    // Room for all of them, and deadlines that do not close them during the test.
    let config = TempConfig::new(
        "max_client_connections = 11000\nfirst_byte_timeout = \"60s\"\nclient_idle_timeout = \"60s\"\n",
    );
    let args = [
        "--upstream".to_owned(),
        upstream.url(),
        "--max-connections".to_owned(),
        "4".to_owned(),
        "--config".to_owned(),
        config.path_str(),
    ];
    let proxy = Proxy::start_with_fd_limit(&args, IDLE_TEST_PROXY_FDS).await;
    assert_eq!(get(proxy.listen, "/warm").await.status, StatusCode::OK);
    let baseline_kib = proxy.rss_kib();

    // Half have sent nothing yet; half made one request and sit idle on a keep-alive connection.
    let started = Instant::now();
    let silent_count = IDLE_CLIENTS / 2;
    let mut silent = Vec::with_capacity(silent_count);
    for _ in 0..silent_count {
        silent.push(TcpStream::connect(proxy.listen).await.unwrap());
    }
    const WORKERS: usize = 20;
    let per_worker = (IDLE_CLIENTS - silent_count) / WORKERS;
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let addr = proxy.listen;
            tokio::spawn(async move {
                let mut held = Vec::with_capacity(per_worker);
                for i in 0..per_worker {
                    let mut conn = RawConn::connect(addr).await;
                    conn.write(format!("GET /idle?w={w}&i={i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
                        .await
                        .unwrap();
                    let resp = conn.read_response(false, T).await.unwrap();
                    assert_eq!(resp.status, 200, "{resp:?}");
                    held.push(conn);
                }
                held
            })
        })
        .collect();
    let mut keep_alive = Vec::with_capacity(IDLE_CLIENTS - silent_count);
    for worker in workers {
        keep_alive.extend(worker.await.unwrap());
    }
    let total = (silent.len() + keep_alive.len()) as u64;
    assert_eq!(total, IDLE_CLIENTS as u64);
    wait_until("the proxy holds every idle client", Duration::from_secs(30), || async {
        proxy.status().await["client_connections"].as_u64() == Some(total)
    })
    .await;
    println!("{total} idle clients connected in {:?}", started.elapsed());

    // Others are still served promptly, new clients and an idle one waking up alike.
    let mut slowest = Duration::ZERO;
    for i in 0..20 {
        let sent = Instant::now();
        let resp = get(proxy.listen, &format!("/other?{i}")).await;
        assert_eq!(resp.status, StatusCode::OK);
        slowest = slowest.max(sent.elapsed());
    }
    let woken = keep_alive.last_mut().unwrap();
    woken
        .write(b"GET /woken HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(woken.read_response(false, T).await.unwrap().status, 200);
    println!("slowest of 20 requests beside {total} idle clients: {slowest:?}");
    assert!(
        slowest < Duration::from_secs(2),
        "a request took {slowest:?} beside the idle clients"
    );

    let grown_kib = proxy.rss_kib().saturating_sub(baseline_kib);
    println!(
        "proxy RSS {baseline_kib} KiB before, +{grown_kib} KiB with {total} idle clients ({} KiB each)",
        grown_kib / total
    );
    assert!(
        grown_kib < total * MAX_KIB_PER_IDLE_CLIENT,
        "proxy RSS grew by {grown_kib} KiB for {total} idle clients"
    );
    assert!(upstream.peak_connections() <= 4);

    // Released, they are all gone from the proxy's count.
    drop(silent);
    drop(keep_alive);
    wait_until(
        "the client-connection gauge is back to 0",
        Duration::from_secs(30),
        || async { proxy.client_connections().await == 0.0 },
    )
    .await;
    assert_still_sound(&proxy, &upstream, 4).await;
}

// ---------------------------------------------------------------------------------------------------------------
// Out of file descriptors
// ---------------------------------------------------------------------------------------------------------------

/// utime + stime of a process, in clock ticks (USER_HZ, 100 a second on Linux).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("reading /proc/PID/stat");
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15 of the whole line.
    let after_name = &stat[stat.rfind(')').expect("comm field") + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count() as u64)
}

fn count_lines(output: &str, needle: &str) -> usize {
    output.lines().filter(|line| line.contains(needle)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_backs_accept_off_without_spinning_and_serving_resumes() {
    const FD_LIMIT: u64 = 64;
    let upstream = Upstream::start().await;
    let args = [
        "--upstream".to_owned(),
        upstream.url(),
        "--max-connections".to_owned(),
        "2".to_owned(),
        "--first-byte-timeout".to_owned(),
        "60s".to_owned(),
    ];
    let proxy = Proxy::start_with_fd_limit(&args, FD_LIMIT).await;
    let pid = proxy.pid();

    // Accepted before the descriptors run out: a client with a pooled upstream connection behind it, and one
    // that has not sent its request yet.
    let mut pooled = H1Conn::connect(proxy.listen).await;
    assert_eq!(pooled.get("/warm").await.status, StatusCode::OK);
    let mut late_request = RawConn::connect(proxy.listen).await;
    wait_until("both clients are accepted", T, || async {
        proxy.status().await["client_connections"].as_u64() == Some(2)
    })
    .await;

    // Idle clients until accept fails for want of descriptors; the rest wait in the kernel's backlog.
    let mut hogs = Vec::new();
    for _ in 0..FD_LIMIT + 16 {
        hogs.push(RawConn::connect(proxy.listen).await);
    }
    wait_until_sync("accept fails for want of descriptors", T, || {
        proxy.output().contains("accept failed")
    })
    .await;
    assert!(open_fds(pid) >= FD_LIMIT - 2, "{} descriptors open", open_fds(pid));
    // A client arriving now waits in the backlog: not answered, not refused.
    let mut backlogged = RawConn::connect(proxy.listen).await;
    backlogged
        .write(b"GET /backlogged HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();

    // A second of exhaustion costs next to no CPU: accept backs off rather than retrying in a loop.
    let (ticks_before, lines_before) = (cpu_ticks(pid), proxy.output().lines().count());
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await; // the observation window, not a synchronisation
    let window = window.elapsed();
    let ticks = cpu_ticks(pid) - ticks_before;
    let new_lines = proxy.output().lines().count() - lines_before;
    println!("exhausted for {window:?}: {ticks} ticks of CPU, {new_lines} log lines");
    assert!(
        ticks <= 20,
        "{ticks} CPU ticks in {window:?} of exhaustion: a busy loop"
    );
    // One warning per episode, not per retry. A second episode is possible and not a loop: the admin connection of
    // the last `/status` poll above may close after the descriptors ran out, letting one more client in.
    let episodes = count_lines(&proxy.output(), "accept failed");
    assert!((1..=2).contains(&episodes), "{episodes} episodes:\n{}", proxy.output());
    match backlogged.read_head(Duration::from_millis(200)).await {
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
        other => panic!("a client past the descriptor limit was dealt with: {other:?}"),
    }

    // Clients already accepted are still served: over the pooled connection...
    let stalled = tokio::spawn(async move {
        let resp = pooled.get("/stall").await;
        (resp.status, pooled)
    });
    wait_until_sync("the pooled connection carries /stall", T, || upstream.inflight() == 1).await;
    // ...and a request that needs a new upstream connection is answered 502 at once, not left hanging.
    let sent = Instant::now();
    late_request
        .write(b"GET /needs-a-dial HTTP/1.1\r\nHost: client.test\r\n\r\n")
        .await
        .unwrap();
    let resp = late_request.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 502, "{resp:?}");
    assert!(
        sent.elapsed() < Duration::from_secs(2),
        "502 after {:?}",
        sent.elapsed()
    );
    upstream.release_stalled();
    let (status, mut pooled) = stalled.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        upstream.accepted(),
        1,
        "no upstream connection could be opened meanwhile"
    );

    // Descriptors freed: the backlogged client is served, new ones too, and the log says so.
    drop(hogs);
    let resp = backlogged.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(upstream.recorded_with_prefix("/backlogged").len(), 1);
    assert_eq!(pooled.get("/pooled-again").await.status, StatusCode::OK);
    assert_eq!(get(proxy.listen, "/fresh").await.status, StatusCode::OK);
    // One warning per episode, each closed by one line saying so (freeing descriptors can make a brief second
    // episode while the backlog is worked through).
    wait_until_sync("the log says accepting resumed after each episode", T, || {
        let output = proxy.output();
        count_lines(&output, "accepting again") == count_lines(&output, "accept failed")
    })
    .await;
    assert!(count_lines(&proxy.output(), "accept failed") <= 3, "{}", proxy.output());
    assert!(upstream.recorded_with_prefix("/needs-a-dial").is_empty());
    assert_still_sound(&proxy, &upstream, 2).await;
}
