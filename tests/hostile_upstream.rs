//! What a misbehaving or merely slow upstream cannot make floodgate do: work more requests at once than the cap
//! after a timeout, or pass on a response that lies about itself.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::scripted::{ScriptedUpstream, Then};
use support::*;

const WAIT: Duration = Duration::from_secs(5);

/// An upstream that finishes every request it started before it acts on a close, as a thread-per-connection
/// server does (its thread is busy until then), and counts that work in flight whatever floodgate does to the
/// connection meanwhile.
async fn thread_per_connection_upstream() -> Upstream {
    Upstream::start_with(UpstreamOptions {
        finish_before_close: true,
        ..Default::default()
    })
    .await
}

/// A request the upstream works on for 2.5 s, answered 504 at 1 s, and one queued behind it: the second may
/// reach the upstream only once the upstream has finished the first. `drain` is `abort_drain_timeout`.
async fn a_504_then_a_queued_request(drain: &str) -> Upstream {
    let upstream = thread_per_connection_upstream().await;
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        1,
        &["--request-timeout", "1s", "--queue-timeout", "30s"],
        &[("FLOODGATE__UPSTREAMS__DEFAULT__ABORT_DRAIN_TIMEOUT", drain)],
    )
    .await;
    let slow = tokio::spawn(get(proxy.listen, "/work/2500"));
    let busy = || upstream.inflight() == 1;
    wait_until_sync("the upstream works on the first request", WAIT, busy).await;
    let next = tokio::spawn(get(proxy.listen, "/work/100"));
    proxy.wait_queue_depth("default", 1, WAIT).await;
    assert_eq!(slow.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(next.await.unwrap().status, StatusCode::OK);
    let peak = upstream.peak_inflight();
    assert_eq!(peak, 1, "the upstream worked on {peak} requests at once at cap 1");
    assert_eq!(upstream.peak_connections(), 1);
    upstream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_504_the_late_answer_is_read_before_the_connection_serves_again() {
    let upstream = a_504_then_a_queued_request("5s").await;
    // The late answer was read to its end within abort_drain_timeout: the connection was whole and served on.
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_drain_a_timed_out_exchange_holds_its_slot_until_the_upstream_closes() {
    // Gives up on the late answer long before it comes.
    let upstream = a_504_then_a_queued_request("200ms").await;
    // The first connection was closed (the answer was not waited for); the second request had a new one.
    assert_eq!(upstream.accepted(), 2);
}

// --- Broken framing: a 502 while nothing has been sent, an honest cut after ---------------------------------------

const GET: &[u8] = b"GET /x HTTP/1.1\r\nHost: app\r\n\r\n";

/// One request from a raw HTTP/1 client through floodgate in front of `answer`: the status it got (`None`: none,
/// only a closed connection), and the proxy and upstream for further looks.
async fn status_through(answer: &[u8], then: Then) -> (Option<u16>, Proxy, ScriptedUpstream) {
    let upstream = ScriptedUpstream::start(answer.to_vec(), then).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(GET).await.unwrap();
    let status = conn.read_response(false, WAIT).await.ok().map(|resp| resp.status);
    (status, proxy, upstream)
}

async fn upstream_errors(proxy: &Proxy) -> f64 {
    proxy.outcome_count("default", "upstream_error").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_with_both_content_length_and_chunked_is_a_502() {
    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
                   b\r\nhello world\r\n0\r\n\r\n";
    let (status, proxy, _up) = status_through(answer, Then::Close).await;
    assert_eq!(status, Some(502));
    assert_eq!(upstream_errors(&proxy).await, 1.0);
    assert_eq!(proxy.outcome_count("default", "ok").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interim_answers_are_passed_over_in_reason_and_a_flood_of_them_is_a_502() {
    // A 100 Continue and two 103 Early Hints before the answer: passed over, as servers send them.
    let answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n\
                   HTTP/1.1 103 Early Hints\r\nLink: </b.js>; rel=preload\r\n\r\n\
                   HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    let (status, proxy, _up) = status_through(answer, Then::Close).await;
    assert_eq!(status, Some(200));
    assert_eq!(proxy.outcome_count("default", "ok").await, 1.0);

    // 20,000 of them (500 KB, under the head bound of 408 KiB each would have had to pass): each was kept and
    // read again with every read, megabytes and seconds of CPU for one request. Now the seventeenth is the end.
    let mut flood = b"HTTP/1.1 100 Continue\r\n\r\n".repeat(20_000);
    flood.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
    let upstream = ScriptedUpstream::start(flood, Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(GET).await.unwrap();
    let resp = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!(resp.status, 502, "{resp:?}");
    assert_eq!(upstream_errors(&proxy).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_buffered_body_is_a_502() {
    let (status, proxy, _up) = status_through(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", Then::Close).await;
    assert_eq!(status, Some(502));
    assert_eq!(upstream_errors(&proxy).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_streamed_body_is_cut_not_ended_and_counted_as_the_upstreams_error() {
    // Larger than buffer_response_bytes (64 KiB): it streams, so the head has gone by the time the body fails.
    let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
    answer.extend(std::iter::repeat_n(b'a', 100_000));
    let upstream = ScriptedUpstream::start(answer, Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let (bytes, end) = raw_exchange(proxy.listen, GET, WAIT).await;
    assert_eq!(first_status(&bytes), Some(200));
    let head_end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| at + 4)
        .unwrap();
    assert!(
        bytes.len() - head_end < 200_000,
        "a short body reached the client as a whole one"
    );
    assert!(
        matches!(end, ReadEnd::Eof | ReadEnd::Reset),
        "the connection was not closed: {end:?}"
    );
    wait_until("the exchange is counted", WAIT, || async {
        upstream_errors(&proxy).await == 1.0
    })
    .await;
    assert_eq!(proxy.outcome_count("default", "ok").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_request_that_asked_for_no_upgrade_is_a_502() {
    let answer = b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n";
    let upstream = ScriptedUpstream::start(answer.to_vec(), Then::KeepOpen).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    // Pipelined: the second request must be answered too.
    let two = [GET, GET].concat();
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(&two).await.unwrap();
    let first = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!(first.status, 502);
    let second = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!(second.status, 502);
    assert_eq!(upstream_errors(&proxy).await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_response_whose_first_chunk_is_bad_is_a_502() {
    for (what, body) in [
        ("an invalid size", &b"zz\r\nhello\r\n0\r\n\r\n"[..]),
        (
            "a 100 KB chunk extension",
            &[b"5;".as_slice(), &[b'x'; 100_000], b"\r\nhello\r\n0\r\n\r\n"].concat()[..],
        ),
    ] {
        let answer = [&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..], body].concat();
        let (status, proxy, _up) = status_through(&answer, Then::Close).await;
        assert_eq!(status, Some(502), "{what}");
        assert_eq!(upstream_errors(&proxy).await, 1.0, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_a_response_with_both_framings_is_a_502_not_a_content_length_that_lies() {
    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
                   b\r\nhello world\r\n0\r\n\r\n";
    let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get("/x").await.unwrap();
    assert_eq!(resp.status, StatusCode::BAD_GATEWAY);
    assert_eq!(upstream_errors(&proxy).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_a_short_streamed_body_ends_in_a_stream_error_not_a_clean_end() {
    let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n".to_vec();
    answer.extend(std::iter::repeat_n(b'a', 100_000));
    let upstream = ScriptedUpstream::start(answer, Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let req = http::Request::get(format!("http://{}/x", proxy.listen))
        .body(body_empty())
        .unwrap();
    // The stream is reset either after the head (the body then fails) or, when the reset overtakes the head in
    // the h2 layer's send queue, before it; never ended as if whole.
    if let Ok(resp) = h2.send(req).await {
        assert_eq!(resp.status(), StatusCode::OK);
        let body = http_body_util::BodyExt::collect(resp.into_body()).await;
        assert!(
            body.is_err(),
            "a body 100,000 bytes short of its content-length ended cleanly"
        );
    }
    wait_until("the exchange is counted", WAIT, || async {
        upstream_errors(&proxy).await == 1.0
    })
    .await;
}

/// A request whose answer ends the connection, so that all of the answer can be read up to the close.
const GET_THEN_CLOSE: &[u8] = b"GET /x HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_broken_right_behind_its_first_bytes_is_a_502_or_a_cut_never_an_empty_reply() {
    for ((what, answer), threads) in [
        (
            "a bad second chunk",
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n world\r\n0\r\n\r\n"[..],
        ),
        (
            "no last chunk",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        ),
        (
            "a body short of its length",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",
        ),
    ]
    .into_iter()
    // The whole answer arrives at once; on one thread the upstream's side runs on the client's, and the failure
    // is there as soon as the first bytes are.
    .flat_map(|case| [(case, "1"), (case, "2")])
    {
        let what = format!("{what}, {threads} thread(s)");
        let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
        let proxy = Proxy::start_with_env(
            &[
                "--upstream",
                &upstream.url(),
                "--max-connections",
                "2",
                "--threads",
                threads,
            ],
            // Nothing is buffered: every body streams, as a large one would.
            &[("FLOODGATE__UPSTREAMS__DEFAULT__BUFFER_RESPONSE_BYTES", "0")],
        )
        .await;
        let (bytes, _) = raw_exchange(proxy.listen, GET_THEN_CLOSE, WAIT).await;
        match first_status(&bytes) {
            Some(502) => {}
            Some(200) => assert!(
                !bytes.ends_with(b"0\r\n\r\n"),
                "{what}: the client got a whole chunked body: {:?}",
                String::from_utf8_lossy(&bytes)
            ),
            other => panic!(
                "{what}: the client got {other:?}: {:?}",
                String::from_utf8_lossy(&bytes)
            ),
        }
        wait_until("the exchange is counted", WAIT, || async {
            upstream_errors(&proxy).await == 1.0
        })
        .await;
        assert_eq!(proxy.outcome_count("default", "ok").await, 0.0, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_that_is_not_one_number_is_a_502_even_where_no_body_follows() {
    const HEAD: &[u8] = b"HEAD /x HTTP/1.1\r\nHost: app\r\n\r\n";
    for (request, answer) in [
        (
            HEAD,
            &b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\n"[..],
        ),
        (HEAD, b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n"),
        (GET, b"HTTP/1.1 304 Not Modified\r\nContent-Length: 3, 5\r\n\r\n"),
    ] {
        let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
        let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(request).await.unwrap();
        let status = conn
            .read_response(request == HEAD, WAIT)
            .await
            .ok()
            .map(|resp| resp.status);
        let answer = String::from_utf8_lossy(answer);
        assert_eq!(status, Some(502), "{answer}");
        assert_eq!(upstream_errors(&proxy).await, 1.0, "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_listing_one_number_twice_goes_on_as_that_number() {
    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello";
    let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(GET).await.unwrap();
    let resp = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("5"));
    assert_eq!(resp.body, b"hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_response_with_trailers_is_counted_ok_not_as_a_client_abort() {
    let answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n\
                   5\r\nhello\r\n6\r\n world\r\n0\r\nX-Checksum: abc123\r\n\r\n";
    let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(GET).await.unwrap();
    let resp = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!((resp.status, resp.body.as_slice()), (200, &b"hello world"[..]));
    wait_until("the exchange is counted", WAIT, || async {
        proxy.outcome_count("default", "ok").await == 1.0
    })
    .await;
    assert_eq!(proxy.outcome_count("default", "client_abort").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_in_a_transfer_coding_other_than_chunked_is_a_502_not_passed_on_as_plain() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nnot really gzip"[..],
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\ngzip\r\n0\r\n\r\n",
    ] {
        let upstream = ScriptedUpstream::start(answer.to_vec(), Then::Close).await;
        let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "2"]).await;
        let mut conn = RawConn::connect(proxy.listen).await;
        conn.write(GET).await.unwrap();
        let status = conn.read_response(false, WAIT).await.ok().map(|resp| resp.status);
        let answer = String::from_utf8_lossy(answer);
        assert_eq!(status, Some(502), "{answer}");
        assert_eq!(upstream_errors(&proxy).await, 1.0, "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_chunked_twice_is_a_502() {
    // Decoded once, the inner chunked framing would reach the client as the content.
    let answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n\
                   f\r\n5\r\nhello\r\n0\r\n\r\n\r\n0\r\n\r\n";
    let (status, proxy, _up) = status_through(answer, Then::Close).await;
    assert_eq!(status, Some(502));
    assert_eq!(upstream_errors(&proxy).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_reaches_the_client_without_its_content_length_over_http1_and_http2() {
    let answer = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-Kept: yes\r\n\r\n";
    let upstream = ScriptedUpstream::start(answer.to_vec(), Then::KeepOpen).await;
    let proxy = Proxy::start(&["--upstream", &upstream.url(), "--max-connections", "1"]).await;
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(GET).await.unwrap();
    let resp = conn.read_response(false, WAIT).await.unwrap();
    assert_eq!(resp.status, 204);
    assert_eq!(resp.header("x-kept"), Some("yes"), "{resp:?}");
    assert!(!resp.has_header("content-length"), "{resp:?}");
    let mut h2 = H2Conn::connect(proxy.listen).await;
    let resp = h2.try_get("/x").await.unwrap();
    assert_eq!(resp.status, StatusCode::NO_CONTENT, "HTTP/2");
    assert_eq!(resp.header("content-length"), None, "HTTP/2: {:?}", resp.headers);
}
