//! HTTP/2 upstreams: the cap counts TCP connections and, on each, the streams at work, never more than the
//! configured most or the upstream's own SETTINGS_MAX_CONCURRENT_STREAMS; answers come back whole, trailers too.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use support::h2_scripted::H2Scripted;
use support::h2_upstream::H2Upstream;
use support::*;

/// floodgate in front of `upstream` over HTTP/2, with `connections` connections of `streams` streams each.
async fn proxy_for(upstream: &H2Upstream, connections: usize, streams: usize, extra: &[&str]) -> Proxy {
    Proxy::for_h2_upstream(&upstream.url(), connections, streams, extra).await
}

/// `clients` HTTP/1 clients at once, each one GET of `path`; every answer's status and body.
async fn clients_at_once(proxy: &Proxy, clients: usize, path: &'static str) -> Vec<(StatusCode, String)> {
    let listen = proxy.listen;
    let tasks: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(async move { try_get(listen, path).await.map(|resp| (resp.status, resp.text())) }))
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("a client task").expect("an answer"));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_reach_an_http2_upstream_over_two_connections_of_four_streams() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 2, 4, &[]).await;
    let answers = clients_at_once(&proxy, 200, "/sleep/20").await;
    for (status, body) in &answers {
        assert_eq!(*status, StatusCode::OK, "every client is served: {body}");
        assert_eq!(body, "/sleep/20 over HTTP/2.0", "the upstream was spoken to in HTTP/2");
    }
    assert!(
        upstream.peak_connections() <= 2,
        "connections: {}",
        upstream.peak_connections()
    );
    assert!(
        upstream.peak_at_work() <= 8,
        "at work at once: {}",
        upstream.peak_at_work()
    );
    assert!(
        upstream.peak_at_work() > 2,
        "streams were multiplexed on the connections: at most {} at work",
        upstream.peak_at_work()
    );
    assert_eq!(upstream.requests(), 200);
    eprintln!(
        "peak connections {}, peak at work {}",
        upstream.peak_connections(),
        upstream.peak_at_work()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_own_stream_limit_holds_when_it_is_below_the_configured_one() {
    // The upstream allows 2 streams per connection; floodgate is told 8.
    let upstream = H2Upstream::start(2).await;
    let proxy = proxy_for(&upstream, 2, 8, &[]).await;
    let answers = clients_at_once(&proxy, 100, "/sleep/20").await;
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    assert!(
        upstream.peak_connections() <= 2,
        "connections: {}",
        upstream.peak_connections()
    );
    assert!(
        upstream.peak_at_work() <= 4,
        "at work at once: {}",
        upstream.peak_at_work()
    );
    assert_eq!(upstream.resets(), 0, "no stream was refused or reset");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_upstreams_trailers_reach_an_http2_client() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 1, 4, &[]).await;
    let mut client = H2Conn::connect(proxy.listen).await;
    let response = client
        .send(
            Request::get(format!("http://{}/trailers", proxy.listen))
                .header("te", "trailers")
                .body(body_empty())
                .unwrap(),
        )
        .await
        .expect("an answer");
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await.expect("the whole body");
    let trailers = collected.trailers().cloned().expect("trailers came");
    assert_eq!(trailers.get("grpc-status").map(|v| v.as_bytes()), Some(&b"0"[..]));
    assert_eq!(collected.to_bytes(), Bytes::from_static(b"payload"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_upstream_connection_is_reused_rather_than_dialled_again() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 2, 4, &[]).await;
    for _ in 0..20 {
        assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    }
    assert_eq!(upstream.accepted(), 1, "one connection carried every request in turn");
    // /status counts connections, not streams: one open and idle, though four of its streams are free.
    wait_until("the request's lease over", Duration::from_secs(5), || async {
        proxy.upstream_field("default", "in_use").await == 0
    })
    .await;
    assert_eq!(proxy.upstream_field("default", "connections_open").await, 1);
    assert_eq!(proxy.upstream_field("default", "connections_idle").await, 1);
}

/// A gRPC call's request (the body is not read by the shed answers under test).
fn grpc_call(proxy: &Proxy, path: &str, timeout: Option<&str>) -> Request<TestBody> {
    let mut request = Request::post(format!("http://{}{path}", proxy.listen))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(timeout) = timeout {
        request = request.header("grpc-timeout", timeout);
    }
    request.body(body_empty()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_grpc_call_is_answered_in_grpc_terms_with_a_pushback_and_its_deadline_shed_too() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 1, 1, &["--max-queue", "1"]).await;
    let mut client = H2Conn::connect(proxy.listen).await;
    // One call holds the one stream; a second waits in the one place of the queue.
    let holding = {
        let mut client = client.clone();
        let request = grpc_call(&proxy, "/hold", None);
        tokio::spawn(async move { client.send(request).await })
    };
    wait_until_sync("the first call at work", Duration::from_secs(5), || {
        upstream.at_work() == 1
    })
    .await;
    let waiting = {
        let mut client = client.clone();
        let request = grpc_call(&proxy, "/hold", Some("300m"));
        tokio::spawn(async move { client.send(request).await })
    };
    wait_until("the second call queued", Duration::from_secs(5), || async {
        metric_sum(&parse_metrics(&proxy.metrics().await), "floodgate_queue_depth", &[]) >= 1.0
    })
    .await;
    // The queue is full: shed for capacity, as gRPC's UNAVAILABLE with the queue's pace as pushback.
    let shed = client.send(grpc_call(&proxy, "/", None)).await.expect("an answer");
    assert_eq!(
        shed.status(),
        StatusCode::OK,
        "gRPC answers are 200 with their status in the head"
    );
    let header = |name: &str| {
        shed.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(header("grpc-status").as_deref(), Some("14"));
    assert_eq!(header("grpc-message").as_deref(), Some("queue full"));
    assert_eq!(header("content-type").as_deref(), Some("application/grpc"));
    assert_eq!(header("x-floodgate-shed-reason").as_deref(), Some("queue_full"));
    let pushback: u64 = header("grpc-retry-pushback-ms")
        .expect("a pushback")
        .parse()
        .expect("milliseconds");
    assert!((1..=60_000).contains(&pushback), "pushback {pushback} ms");
    // The queued call's own deadline (300 ms) passes first: DEADLINE_EXCEEDED, and no pushback.
    let late = waiting.await.unwrap().expect("an answer");
    assert_eq!(late.status(), StatusCode::OK);
    assert_eq!(late.headers().get("grpc-status").map(|v| v.as_bytes()), Some(&b"4"[..]));
    assert!(late.headers().get("grpc-retry-pushback-ms").is_none());
    upstream.release();
    let held = holding.await.unwrap().expect("the held call answered");
    assert_eq!(held.status(), StatusCode::OK);
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_requests_total", &[("outcome", "shed_queue_full")]),
        1.0,
        "a gRPC shed is counted as a shed"
    );
    assert_eq!(
        metric_sum(&samples, "floodgate_requests_total", &[("outcome", "shed_deadline")]),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_lowers_its_stream_limit_mid_connection_is_obeyed_once_it_is_read() {
    // One connection of up to 4 streams; once it has had 4, the upstream lowers its limit to 1.
    let upstream = H2Scripted::start(4, Duration::from_millis(30)).await;
    upstream.lower_limit_after(4, 1);
    let proxy = Proxy::for_h2_upstream(&upstream.url(), 1, 4, &[]).await;
    let answers = clients_at_once(&proxy, 24, "/").await;
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    assert_eq!(upstream.peak_connections(), 1);
    assert_eq!(
        upstream.peak_open(),
        4,
        "four streams at once before the limit was lowered"
    );
    assert_eq!(
        upstream.over_limit(),
        0,
        "no stream began while the lowered limit's worth were open, once floodgate had acknowledged it"
    );
    assert_eq!(upstream.answered(), 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_above_a_goaways_last_id_are_sent_again_on_a_new_connection_within_the_cap() {
    // Once a connection has all 6 streams, the upstream says GOAWAY naming the second: the 4 after it were not
    // processed, and go again on a new connection, dialled only once the first has closed.
    let upstream = H2Scripted::start(8, Duration::from_millis(50)).await;
    upstream.goaway_naming_after(2, 6);
    let proxy = Proxy::for_h2_upstream(&upstream.url(), 1, 8, &[]).await;
    let answers = clients_at_once(&proxy, 6, "/").await;
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    assert_eq!(upstream.unprocessed(), 4, "the streams above the GOAWAY's last id");
    assert_eq!(upstream.accepted(), 2, "one connection after the first");
    assert_eq!(upstream.peak_connections(), 1, "never two at once: the cap is 1");
    assert_eq!(upstream.answered(), 6, "each request processed once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_given_up_on_holds_its_place_until_the_upstream_has_read_its_reset() {
    // One stream in all. The first request never gets its answer in time (504); the one queued behind it may
    // start only once the upstream has let the first go, which it does when it reads floodgate's reset.
    let upstream = H2Upstream::start(100).await;
    let env = [("FLOODGATE__UPSTREAMS__DEFAULT__ABORT_DRAIN_TIMEOUT", "50ms")];
    let proxy = Proxy::for_h2_upstream_with_env(&upstream.url(), 1, 1, &["--request-timeout", "200ms"], &env).await;
    for round in 0..5 {
        let listen = proxy.listen;
        let given_up = tokio::spawn(async move { try_get(listen, "/hold").await });
        wait_until_sync("the held request at work", Duration::from_secs(5), || {
            upstream.at_work() == 1
        })
        .await;
        let queued = tokio::spawn(async move { try_get(listen, "/sleep/0").await });
        let given_up = given_up.await.unwrap().expect("an answer");
        assert_eq!(given_up.status, StatusCode::GATEWAY_TIMEOUT, "round {round}");
        let queued = queued.await.unwrap().expect("an answer");
        assert_eq!(queued.status, StatusCode::OK, "round {round}");
        assert_eq!(upstream.resets(), round + 1, "the held request's stream was reset");
    }
    assert_eq!(
        upstream.peak_at_work(),
        1,
        "never two requests at work in the upstream at once"
    );
}

/// One HTTP/2 upstream `a` of one connection with `streams` streams, taking every request.
fn one_h2_upstream(url: &str, streams: usize) -> String {
    format!(
        r#"
[upstreams.a]
url = "{url}"
max_connections = 1
protocol = "http2"
max_streams_per_connection = {streams}

[[routes]]
upstream = "a"
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_raises_and_lowers_the_streams_of_a_live_http2_connection_in_place() {
    let upstream = H2Upstream::start(100).await;
    let config = TempConfig::new(&one_h2_upstream(&upstream.url(), 1));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let mut peaks = Vec::new();
    for streams in [1, 4, 2] {
        std::fs::write(config.path(), one_h2_upstream(&upstream.url(), streams)).unwrap();
        let reloaded = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
        assert_eq!(reloaded.status, StatusCode::OK, "{}", reloaded.text());
        upstream.reset_peak_at_work();
        let answers = clients_at_once(&proxy, 40, "/sleep/20").await;
        assert!(
            answers.iter().all(|(status, _)| *status == StatusCode::OK),
            "{answers:?}"
        );
        peaks.push(upstream.peak_at_work());
    }
    assert_eq!(peaks, [1, 4, 2], "the streams at work follow the limit in force");
    assert_eq!(upstream.accepted(), 1, "on the one connection, never dialled again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_keep_alive_pings_is_closed_and_replaced() {
    // The dial's own PING and two keep-alive ones are answered; then the upstream falls silent.
    let upstream = H2Scripted::start(8, Duration::from_millis(1)).await;
    upstream.answer_pings_up_to(3);
    let env = [("FLOODGATE__UPSTREAMS__DEFAULT__PING_INTERVAL", "100ms")];
    let proxy = Proxy::for_h2_upstream_with_env(&upstream.url(), 1, 1, &[], &env).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    wait_until_sync("the silent connection closed", Duration::from_secs(5), || {
        upstream.accepted() == 1 && upstream.connections() == 0
    })
    .await;
    assert_eq!(
        get(proxy.listen, "/").await.status,
        StatusCode::OK,
        "served on a new connection"
    );
    assert_eq!(upstream.accepted(), 2);
}

/// The raw HTTP/1.1 answer to a GET of `path` with `extra` header lines, read until floodgate closes.
async fn raw_http1_get(proxy: &Proxy, path: &str, extra: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(proxy.listen).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: app\r\n{extra}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(CLIENT_TIMEOUT, stream.read_to_end(&mut answer))
        .await
        .expect("the answer in time")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_that_takes_trailers_gets_them_in_the_last_chunk_and_others_do_not() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 1, 4, &[]).await;
    let asked = raw_http1_get(&proxy, "/trailers", "TE: trailers\r\n").await;
    assert!(asked.starts_with("HTTP/1.1 200"), "{asked}");
    assert!(
        asked.to_ascii_lowercase().contains("transfer-encoding: chunked"),
        "{asked}"
    );
    assert!(
        asked.ends_with("7\r\npayload\r\n0\r\ngrpc-status: 0\r\n\r\n"),
        "{asked:?}"
    );
    let not_asked = raw_http1_get(&proxy, "/trailers", "").await;
    assert!(not_asked.ends_with("7\r\npayload\r\n0\r\n\r\n"), "{not_asked:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_cap_closes_an_http2_connection_once_its_streams_are_over_and_holds_under_load() {
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 2, 2, &[]).await;
    let answers = clients_at_once(&proxy, 40, "/sleep/20").await;
    assert!(answers.iter().all(|(status, _)| *status == StatusCode::OK));
    assert_eq!(upstream.peak_connections(), 2);
    let lowered = proxy
        .admin_request(http::Method::PUT, "/upstreams/default/max_connections", "1", None)
        .await;
    assert_eq!(lowered.status, StatusCode::OK, "{}", lowered.text());
    wait_until_sync("one connection left", Duration::from_secs(5), || {
        upstream.connections() == 1
    })
    .await;
    upstream.reset_peak_at_work();
    let answers = clients_at_once(&proxy, 40, "/sleep/20").await;
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    assert_eq!(upstream.connections(), 1, "no second connection under a cap of 1");
    assert_eq!(upstream.peak_at_work(), 2, "its two streams at work");
    assert_eq!(upstream.accepted(), 2, "nothing dialled again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_is_retired_after_max_requests_per_connection_streams() {
    let upstream = H2Upstream::start(100).await;
    let env = [("FLOODGATE__UPSTREAMS__DEFAULT__MAX_REQUESTS_PER_CONNECTION", "5")];
    let proxy = Proxy::for_h2_upstream_with_env(&upstream.url(), 1, 4, &[], &env).await;
    for _ in 0..20 {
        assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    }
    assert_eq!(upstream.accepted(), 4, "a new connection every 5 requests");
    assert_eq!(upstream.peak_connections(), 1, "each one only once the last had closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_a_body_meeting_a_going_away_connection_goes_whole_on_the_next_one() {
    // The upstream says GOAWAY as its first stream arrives, and keeps the connection until that stream's answer
    // (300 ms later). A POST sent once floodgate has read the GOAWAY cannot open a stream there: nothing of it was
    // sent, and it goes, body and all, on the next connection, dialled once the first has closed (cap 1).
    let upstream = H2Scripted::start(8, Duration::from_millis(300)).await;
    upstream.goaway_after(1);
    let proxy = Proxy::for_h2_upstream(&upstream.url(), 1, 8, &[]).await;
    let listen = proxy.listen;
    let first = tokio::spawn(async move { get(listen, "/first").await });
    wait_until_sync("the GOAWAY read", Duration::from_secs(5), || upstream.goaway_read()).await;
    let mut client = H1Conn::connect(listen).await;
    let posted = client
        .try_request(Method::POST, "/posted", body_full("a body that must arrive once"))
        .await
        .expect("an answer");
    assert_eq!(posted.status, StatusCode::OK, "{}", posted.text());
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 2);
    assert_eq!(upstream.peak_connections(), 1);
    assert_eq!(
        upstream.unprocessed(),
        0,
        "the POST never opened a stream on the going connection"
    );
    assert_eq!(upstream.answered(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_shed_grpc_calls_never_ends_their_clients_connection() {
    // Each call's body ends in a DATA frame of its own, as tonic's and hyper's clients send it; the shed answer
    // goes before that frame arrives. Thousands on one connection: floodgate's h2 server must not reset so many
    // streams that it ends the connection (`too_many_internal_resets`).
    let upstream = H2Upstream::start(100).await;
    let proxy = proxy_for(&upstream, 1, 1, &["--max-queue", "0"]).await;
    let client = H2Conn::connect(proxy.listen).await;
    let holding = {
        let mut client = client.clone();
        let request = grpc_call(&proxy, "/hold", None);
        tokio::spawn(async move { client.send(request).await })
    };
    wait_until_sync("the one stream at work", Duration::from_secs(5), || {
        upstream.at_work() == 1
    })
    .await;
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let mut client = client.clone();
            let uri = format!("http://{}/shed", proxy.listen);
            tokio::spawn(async move {
                let mut codes = Vec::new();
                for _ in 0..300 {
                    let message: Vec<Result<Frame<Bytes>, BoxError>> =
                        vec![Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x05hello")))];
                    let body = http_body_util::StreamBody::new(futures_util::stream::iter(message)).boxed();
                    let request = Request::post(uri.as_str())
                        .header("content-type", "application/grpc")
                        .header("te", "trailers")
                        .body(body)
                        .unwrap();
                    let answer = client.send(request).await.expect("an answer on the same connection");
                    codes.push(answer.headers().get("grpc-status").cloned());
                }
                codes
            })
        })
        .collect();
    for caller in callers {
        for code in caller.await.unwrap() {
            assert_eq!(code.as_ref().map(|v| v.as_bytes()), Some(&b"14"[..]));
        }
    }
    assert!(!client.has_ended(), "the client's connection is still up");
    upstream.release();
    assert_eq!(
        holding.await.unwrap().expect("the held call answered").status(),
        StatusCode::OK
    );
}

/// Each body POSTed to `/posted` on a connection of its own, all at once; the answers' statuses, in turn.
fn post_each(listen: std::net::SocketAddr, bodies: Vec<TestBody>) -> Vec<tokio::task::JoinHandle<StatusCode>> {
    bodies
        .into_iter()
        .map(|body| {
            tokio::spawn(async move {
                let mut client = H1Conn::connect(listen).await;
                client
                    .try_request(Method::POST, "/posted", body)
                    .await
                    .expect("an answer")
                    .status
            })
        })
        .collect()
}

/// Three POSTs of ten bytes each met a GOAWAY naming the first: all answered, the two above it sent again and
/// processed once, every body whole where it was processed, one connection at a time.
async fn two_refused_went_again_whole(upstream: &H2Scripted, posts: Vec<tokio::task::JoinHandle<StatusCode>>) {
    for post in posts {
        assert_eq!(post.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(upstream.unprocessed(), 2, "two were sent above the GOAWAY's last id");
    assert_eq!(upstream.answered(), 3, "each processed once");
    assert_eq!(
        upstream.body_bytes(),
        30,
        "every body arrived whole where it was processed"
    );
    assert_eq!(upstream.accepted(), 2);
    assert_eq!(upstream.peak_connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_above_a_goaways_last_id_go_again_with_their_bodies_on_the_next_connection() {
    // Three POSTs at once on one connection; once the upstream has all three it says GOAWAY naming the first. The
    // other two were not processed: each goes again, its body as it first went out, on the next connection.
    let upstream = H2Scripted::start(8, Duration::from_millis(100)).await;
    upstream.goaway_naming_after(1, 3);
    let proxy = Proxy::for_h2_upstream(&upstream.url(), 1, 8, &[]).await;
    let posts = post_each(proxy.listen, (0..3).map(|_| body_full("ten bytes!")).collect());
    two_refused_went_again_whole(&upstream, posts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_refused_by_a_goaway_before_their_bodies_came_go_again_with_them() {
    // As above, but nothing is read ahead of admission and each body comes only once floodgate has read the
    // GOAWAY: the two refused streams' bodies are still on their way in when their refusal is, and are read in
    // before they go again.
    let upstream = H2Scripted::start(8, Duration::from_secs(1)).await;
    upstream.goaway_naming_after(1, 3);
    let proxy = Proxy::for_h2_upstream(&upstream.url(), 1, 8, &["--buffer-request-bytes", "0"]).await;
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let late_bodies = (0..3)
        .map(|_| {
            let gate = gate.clone();
            let late = futures_util::stream::once(async move {
                gate.acquire().await.expect("the gate stays").forget();
                Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"ten bytes!")))
            });
            http_body_util::StreamBody::new(late).boxed()
        })
        .collect();
    let posts = post_each(proxy.listen, late_bodies);
    wait_until_sync("floodgate has read the GOAWAY", Duration::from_secs(5), || {
        upstream.goaway_read()
    })
    .await;
    gate.add_permits(3);
    two_refused_went_again_whole(&upstream, posts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_the_upstream_stops_taking_after_it_answered_is_cut_at_the_bodys_idle_bound() {
    // The upstream answers at once and never gives window back: the rest of a 200 KB body cannot go. The stream
    // is cut after body_idle_timeout (its place held until the upstream has read the reset), and the one stream
    // there is serves the next request, instead of being held for good.
    let upstream = H2Scripted::start(8, Duration::from_millis(1)).await;
    let proxy = Proxy::for_h2_upstream(
        &upstream.url(),
        1,
        1,
        &["--body-idle-timeout", "300ms", "--queue-timeout", "5s"],
    )
    .await;
    let mut client = H1Conn::connect(proxy.listen).await;
    let posted = client
        .try_request(Method::POST, "/upload", body_pattern(200 * KIB))
        .await
        .expect("an answer");
    assert_eq!(posted.status, StatusCode::OK);
    let next = get(proxy.listen, "/next").await;
    assert_eq!(next.status, StatusCode::OK, "{}", next.text());
    assert_eq!(upstream.answered(), 2);
    assert_eq!(upstream.peak_open(), 1, "never two streams at work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unroutable_posts_with_their_bodies_still_coming_never_ends_the_clients_connection() {
    // The same as a shed storm, for requests no route takes: each is answered 404 before its body's last frame.
    let upstream = H2Upstream::start(100).await;
    let config = TempConfig::new(&format!(
        "[upstreams.a]\nurl = \"{}\"\nprotocol = \"http2\"\n\n[[routes]]\nhost = \"app\"\nupstream = \"a\"\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let client = H2Conn::connect(proxy.listen).await;
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let mut client = client.clone();
            let uri = format!("http://elsewhere:{}/nowhere", proxy.listen.port());
            tokio::spawn(async move {
                for _ in 0..300 {
                    let message: Vec<Result<Frame<Bytes>, BoxError>> =
                        vec![Ok(Frame::data(Bytes::from_static(b"body")))];
                    let body = http_body_util::StreamBody::new(futures_util::stream::iter(message)).boxed();
                    let request = Request::post(uri.as_str()).body(body).unwrap();
                    let answer = client.send(request).await.expect("an answer on the same connection");
                    assert_eq!(answer.status(), StatusCode::NOT_FOUND);
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    assert!(!client.has_ended(), "the client's connection is still up");
    assert_eq!(upstream.requests(), 0);
}
