//! Hold through a restart (`hold_while_down`): while no endpoint of an upstream can be dialled, its requests wait
//! (nothing of them was sent) and are served once it answers again, instead of a 502; within their queue_timeout.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

async fn held(upstream: &Upstream, queue_timeout: &str) -> Proxy {
    Proxy::for_upstream_with_env(
        upstream,
        2,
        &["--queue-timeout", queue_timeout],
        &[("FLOODGATE__UPSTREAMS__DEFAULT__HOLD_WHILE_DOWN", "true")],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_arriving_while_the_upstream_restarts_are_served_once_it_is_back_not_answered_502() {
    let upstream = Upstream::start().await;
    let proxy = held(&upstream, "10s").await;
    assert_eq!(get(proxy.listen, "/before").await.status, StatusCode::OK);
    upstream.stop().await;
    let listen = proxy.listen;
    let waiting: Vec<_> = (0..3)
        .map(|i| tokio::spawn(async move { try_request_post(listen, i).await }))
        .collect();
    // They are held: floodgate counts them, and none is answered while the upstream refuses connections.
    wait_until("the requests held", Duration::from_secs(5), || async {
        metric_sum(
            &parse_metrics(&proxy.metrics().await),
            "floodgate_upstream_held_while_down_total",
            &[],
        ) >= 3.0
    })
    .await;
    assert!(
        waiting.iter().all(|task| !task.is_finished()),
        "none answered while the upstream is down"
    );
    upstream.restart().await;
    for task in waiting {
        assert_eq!(task.await.unwrap(), StatusCode::OK, "served once the upstream is back");
    }
    assert_eq!(
        upstream.recorded_with_prefix("/held").len(),
        3,
        "each POST reached the upstream once"
    );
    assert!(upstream.peak_connections() <= 2);
}

/// A POST (not idempotent: holding it is safe only because nothing of it was sent).
async fn try_request_post(listen: std::net::SocketAddr, i: usize) -> StatusCode {
    let mut client = H1Conn::connect(listen).await;
    client
        .try_request(http::Method::POST, &format!("/held/{i}"), body_full("sent once"))
        .await
        .expect("an answer")
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_held_past_its_queue_timeout_is_answered_with_the_dial_error() {
    let upstream = Upstream::start().await;
    let proxy = held(&upstream, "400ms").await;
    upstream.stop().await;
    let answer = get(proxy.listen, "/held").await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_hold_while_down_a_request_to_a_stopped_upstream_is_a_502_at_once() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &["--queue-timeout", "10s"]).await;
    upstream.stop().await;
    let answer = get(proxy.listen, "/now").await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    let held = metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_upstream_held_while_down_total",
        &[],
    );
    assert_eq!(held, 0.0);
}
