//! Request IDs and request spans through the real binary: every request carries an `X-Request-Id` to the upstream,
//! back to the client and into the access log; a client's own ID is kept only from a trusted peer; a log line
//! written while a request is handled carries the request's span.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

const ID: &str = "x-request-id";

/// One GET for `/headers` with `head_extra` in its head: the answer and what the upstream received.
async fn through(proxy: &Proxy, upstream: &Upstream, head_extra: &str) -> (RawResponse, RecordedRequest) {
    let before = upstream.recorded_with_prefix("/headers").len();
    let mut conn = RawConn::connect(proxy.listen).await;
    let head = format!("GET /headers HTTP/1.1\r\nHost: app.example\r\n{head_extra}\r\n");
    conn.write(head.as_bytes()).await.unwrap();
    let answer = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    let seen = upstream.recorded_with_prefix("/headers");
    assert_eq!(seen.len(), before + 1);
    (answer, seen[before].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_an_id_gets_one_that_the_upstream_the_client_and_the_access_log_all_see() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start_with_env(
        &["--upstream", &upstream.url(), "--log-format", "json"],
        &[("FLOODGATE__ACCESS_LOG", "stdout")],
    )
    .await;

    let (first, first_seen) = through(&proxy, &upstream, "").await;
    let (second, _) = through(&proxy, &upstream, "").await;
    let id = first
        .header(ID)
        .unwrap_or_else(|| panic!("no {ID} on the answer: {}", first.text()));
    assert!(!id.is_empty());
    assert_eq!(
        first_seen.header(ID),
        Some(id),
        "the upstream got another ID: {first_seen:?}"
    );
    assert_ne!(second.header(ID), Some(id), "two requests, one ID");

    let lines = proxy.access_lines(2).await;
    assert_eq!(lines[0]["http.request.header.x-request-id"], id, "{}", lines[0]);
    assert_eq!(
        lines[1]["http.request.header.x-request-id"],
        second.header(ID).unwrap_or_default(),
        "{}",
        lines[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_id_is_replaced_unless_it_comes_from_a_trusted_peer() {
    let upstream = Upstream::start().await;
    let untrusting = Proxy::for_upstream(&upstream, 1, &[]).await;
    let (answer, seen) = through(&untrusting, &upstream, "X-Request-Id: chosen-by-the-client\r\n").await;
    let id = seen.header(ID).unwrap_or_default().to_owned();
    assert!(!id.is_empty() && id != "chosen-by-the-client", "{seen:?}");
    assert_eq!(seen.header_all(ID).len(), 1, "{seen:?}");
    assert_eq!(answer.header(ID), Some(id.as_str()));

    let config = TempConfig::new("trusted_proxies = [\"127.0.0.1/32\"]\n");
    let path = config.path_str();
    let trusting = Proxy::for_upstream(&upstream, 1, &["--config", &path]).await;
    let (answer, seen) = through(&trusting, &upstream, "X-Request-Id: from-the-load-balancer\r\n").await;
    assert_eq!(seen.header_all(ID), vec!["from-the-load-balancer"], "{seen:?}");
    assert_eq!(answer.header(ID), Some("from-the-load-balancer"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_line_written_while_a_request_is_handled_carries_its_span() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start_with_env(
        &[
            "--upstream",
            &upstream.url(),
            "--max-connections",
            "1",
            "--max-queue",
            "0",
            "--log-format",
            "json",
        ],
        // The request span is at debug, under its own target.
        &[
            ("RUST_LOG", ""),
            ("FLOODGATE__LOG_LEVEL", "info,floodgate::request=debug"),
        ],
    )
    .await;
    // The only slot held and no queue: the next request is shed, and the shed is logged while it is handled.
    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    let shed = get(proxy.listen, "/shed-me").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    let id = shed
        .header(ID)
        .unwrap_or_else(|| panic!("a shed answer without {ID}"))
        .to_owned();

    let warned = || {
        proxy
            .output()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(|line| line["message"] == "shedding requests")
    };
    wait_until_sync("the shed is logged", Duration::from_secs(5), || warned().is_some()).await;
    let line = warned().unwrap_or_default();
    assert_eq!(line["span"]["name"], "request", "{line}");
    assert_eq!(line["span"]["id"], id.as_str(), "{line}");
    assert_eq!(line["span"]["upstream"], "default", "{line}");

    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap().status, StatusCode::OK);
}
