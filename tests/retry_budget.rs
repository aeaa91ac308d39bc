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
    attempt_at(proxy.listen, "/", retry).await
}

/// [`attempt`] of `path` at `listen`, for a request sent from a task of its own.
async fn attempt_at(listen: std::net::SocketAddr, path: &str, retry: bool) -> (StatusCode, Option<String>) {
    let mut client = H1Conn::connect(listen).await;
    let mut request = Request::builder().method(Method::GET).uri(path).header("host", "app");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pressure_retries_are_shed_before_first_attempts_with_tokens_to_spare() {
    // One slot, a queue of 4 and tokens aplenty: a retry waits while the queue is under half full, and is shed at
    // once once it is half full, where a first attempt still gets a place.
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        "[upstreams.a]\nurl = \"{}\"\nmax_connections = 1\nmax_queue = 4\nqueue_timeout = \"10s\"\n\
         retry_budget = {{ ratio = 1.0, min_per_second = 100 }}\n[[routes]]\nupstream = \"a\"\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let listen = proxy.listen;
    let send = |path: &'static str, retry: bool| tokio::spawn(attempt_at(listen, path, retry));
    let holder = send("/stall", false);
    wait_until_sync("the slot taken", std::time::Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    let early_retry = send("/", true);
    proxy.wait_queue_depth("a", 1, std::time::Duration::from_secs(5)).await;
    let first = send("/", false);
    proxy.wait_queue_depth("a", 2, std::time::Duration::from_secs(5)).await;
    // Half full: a retry goes no further, a first attempt still waits.
    let pressed = send("/", true).await.unwrap();
    assert_eq!(
        pressed,
        (StatusCode::SERVICE_UNAVAILABLE, Some("retry_budget".to_string()))
    );
    let later_first = send("/", false);
    proxy.wait_queue_depth("a", 3, std::time::Duration::from_secs(5)).await;
    upstream.release_stalled();
    for waiting in [holder, early_retry, first, later_first] {
        assert_eq!(waiting.await.unwrap().0, StatusCode::OK);
    }
    assert_eq!(proxy.outcome_count("a", "shed_retry_budget").await, 1.0);
    assert!(upstream.peak_inflight() <= 1, "peak {}", upstream.peak_inflight());
}
