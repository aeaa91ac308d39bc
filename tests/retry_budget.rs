//! The clients' retry budget (`retry_budget`): requests that say they are retries are admitted only while first
//! attempts have earned them; beyond, they are shed at once with reason `retry_budget`, first attempts never.

mod support;

use http::{Method, Request, StatusCode};
use support::*;

/// floodgate with a budget of `ratio` retries per first attempt and `per_second` a second.
async fn budgeted(upstream: &Upstream, ratio: &str, per_second: u32) -> (TempConfig, Proxy) {
    let config = TempConfig::new(&format!(
        r#"
[upstreams.a]
url = "{}"
max_connections = 4
retry_budget = {{ ratio = {ratio}, min_per_second = {per_second} }}

[[routes]]
upstream = "a"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    (config, proxy)
}

/// A GET marked as the client's retry (`x-retry-attempt`), or not; its status and shed reason.
async fn attempt(proxy: &Proxy, retry: bool) -> (StatusCode, Option<String>) {
    let mut client = H1Conn::connect(proxy.listen).await;
    let mut request = Request::builder().method(Method::GET).uri("/").header("host", "app");
    if retry {
        request = request.header("x-retry-attempt", "1");
    }
    let response = client
        .send(request.body(body_empty()).unwrap())
        .await
        .expect("an answer");
    let reason = response
        .headers()
        .get("x-floodgate-shed-reason")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (response.status(), reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_beyond_what_first_attempts_earned_are_shed_at_once_and_first_attempts_never() {
    // No earning from first attempts, one retry a second: of ten retries sent at once, about one passes.
    let upstream = Upstream::start().await;
    let (_config, proxy) = budgeted(&upstream, "0", 1).await;
    let mut passed = 0;
    let mut shed = 0;
    for _ in 0..10 {
        match attempt(&proxy, true).await {
            (StatusCode::OK, _) => passed += 1,
            (StatusCode::SERVICE_UNAVAILABLE, Some(reason)) if reason == "retry_budget" => shed += 1,
            other => panic!("neither served nor shed for its budget: {other:?}"),
        }
    }
    assert!((1..=2).contains(&passed), "{passed} retries passed");
    assert!(shed >= 8, "{shed} shed");
    for _ in 0..5 {
        assert_eq!(
            attempt(&proxy, false).await.0,
            StatusCode::OK,
            "a first attempt is never held to the budget"
        );
    }
    assert_eq!(proxy.outcome_count("a", "shed_retry_budget").await, shed as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_first_attempt_earns_its_ratio_of_a_retry() {
    // Each first attempt earns one retry: after the second's worth is spent, five first attempts let five through.
    let upstream = Upstream::start().await;
    let (_config, proxy) = budgeted(&upstream, "1.0", 1).await;
    while attempt(&proxy, true).await.0 == StatusCode::OK {}
    for _ in 0..5 {
        assert_eq!(attempt(&proxy, false).await.0, StatusCode::OK);
    }
    // /status shows the balance: the five earned, and what time added meanwhile (one a second).
    let tokens = proxy.upstream_status("a").await["retry_budget_tokens"].as_f64();
    assert!(tokens.is_some_and(|tokens| (5.0..7.0).contains(&tokens)), "{tokens:?}");
    for _ in 0..5 {
        assert_eq!(
            attempt(&proxy, true).await.0,
            StatusCode::OK,
            "earned by the first attempts"
        );
    }
}
