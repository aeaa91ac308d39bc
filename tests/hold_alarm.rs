//! The hold-time alarm (`hold_warn_after`, HikariCP's `leakDetectionThreshold`): an exchange holding its upstream
//! slot longer than the bound logs one warning with its request ID, and is counted; a quick one says nothing.

mod support;

use http::StatusCode;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_holding_its_slot_past_hold_warn_after_is_named_once_with_its_request_id() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        2,
        &[],
        &[("FLOODGATE__UPSTREAMS__DEFAULT__HOLD_WARN_AFTER", "200ms")],
    )
    .await;
    let quick = get(proxy.listen, "/quick").await;
    assert_eq!(quick.status, StatusCode::OK);
    let slow = get(proxy.listen, "/delay/600").await;
    assert_eq!(slow.status, StatusCode::OK);
    let id = slow.header("x-request-id").expect("a request ID").to_owned();
    let long_holds = || async {
        metric_sum(
            &parse_metrics(&proxy.metrics().await),
            "floodgate_upstream_long_holds_total",
            &[],
        )
    };
    assert_eq!(long_holds().await, 1.0, "the slow exchange, and only it");
    let output = proxy.output();
    let warnings: Vec<&str> = output
        .lines()
        .filter(|line| line.contains("longer than hold_warn_after"))
        .collect();
    assert_eq!(warnings.len(), 1, "{output}");
    assert!(
        warnings[0].contains(&id),
        "the warning names the request: {}",
        warnings[0]
    );
    let quick_id = quick.header("x-request-id").expect("a request ID");
    assert!(!output.contains(&format!("request_id={quick_id}")), "{output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_hold_warn_after_a_long_hold_says_nothing() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    assert_eq!(get(proxy.listen, "/delay/300").await.status, StatusCode::OK);
    let long_holds = metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_upstream_long_holds_total",
        &[],
    );
    assert_eq!(long_holds, 0.0);
    assert!(!proxy.output().contains("hold_warn_after"));
}
