//! HTTP/2 upstreams: the cap counts TCP connections and, on each, the streams at work, never more than the
//! configured most or the upstream's own SETTINGS_MAX_CONCURRENT_STREAMS; answers come back whole, trailers too.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use support::h2_upstream::H2Upstream;
use support::*;

/// floodgate in front of `upstream` over HTTP/2, with `connections` connections of `streams` streams each.
async fn proxy_for(upstream: &H2Upstream, connections: usize, streams: usize, extra: &[&str]) -> Proxy {
    let mut args = vec![
        "--upstream".to_owned(),
        upstream.url(),
        "--max-connections".to_owned(),
        connections.to_string(),
        "--upstream-protocol".to_owned(),
        "http2".to_owned(),
        "--max-streams-per-connection".to_owned(),
        streams.to_string(),
    ];
    args.extend(extra.iter().map(|arg| arg.to_string()));
    Proxy::start(&args).await
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
