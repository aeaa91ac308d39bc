//! Overload control through the real binary: queue disciplines, client deadlines, and shed answers that say why
//! and when to come back.

mod support;

use std::time::{Duration, Instant};

use http::{Method, Request, StatusCode};
use support::*;

const WAIT: Duration = Duration::from_secs(10);

/// One upstream `a` behind every route, with `extra` lines in its table.
fn config(url: &str, extra: &str) -> String {
    format!("[upstreams.a]\nurl = \"{url}\"\nqueue_timeout = \"30s\"\n{extra}\n\n[[routes]]\nupstream = \"a\"\n")
}

async fn get_with(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Resp {
    let mut request = Request::builder().method(Method::GET).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut conn = H1Conn::connect(addr).await;
    let resp = conn.send(request.body(body_empty()).unwrap()).await.unwrap();
    collect(resp).await.unwrap()
}

/// Holds the upstream's only slot with a stalled request until [`Upstream::release_stalled`].
async fn hold_the_slot(proxy: &Proxy, upstream: &Upstream) -> tokio::task::JoinHandle<Resp> {
    let addr = proxy.listen;
    let held = tokio::spawn(async move { get(addr, "/stall").await });
    wait_until_sync("the slot held", WAIT, || upstream.inflight() == 1).await;
    held
}

/// Queues requests for `paths` one after another, each in the queue before the next joins.
async fn queue_in_order(proxy: &Proxy, paths: &[&'static str]) -> Vec<tokio::task::JoinHandle<Resp>> {
    let mut queued = Vec::new();
    for (depth, &path) in paths.iter().enumerate() {
        let addr = proxy.listen;
        queued.push(tokio::spawn(async move { get(addr, path).await }));
        proxy.wait_queue_depth("a", depth as u64 + 1, WAIT).await;
    }
    queued
}

/// The order the upstream saw `paths` in.
fn served_order(upstream: &Upstream, paths: &[&str]) -> Vec<String> {
    upstream
        .recorded()
        .into_iter()
        .map(|r| r.path().to_string())
        .filter(|path| paths.contains(&path.as_str()))
        .collect()
}

#[tokio::test]
async fn fifo_serves_the_oldest_first_and_adaptive_lifo_the_newest_once_the_queue_has_stood() {
    let paths = ["/first", "/second", "/third"];
    for (discipline, expected) in [
        ("fifo", ["/first", "/second", "/third"]),
        ("adaptive-lifo", ["/third", "/second", "/first"]),
    ] {
        let upstream = Upstream::start().await;
        let file = TempConfig::new(&config(
            &upstream.url(),
            &format!("max_connections = 1\nqueue_discipline = \"{discipline}\"\ncodel_interval = \"20ms\""),
        ));
        let proxy = Proxy::start(&["--config", &file.path_str()]).await;
        let held = hold_the_slot(&proxy, &upstream).await;
        let queued = queue_in_order(&proxy, &paths).await;
        // Past codel_interval, the queue counts as standing.
        tokio::time::sleep(Duration::from_millis(40)).await;
        upstream.release_stalled();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        for request in queued {
            assert_eq!(request.await.unwrap().status, StatusCode::OK, "{discipline}");
        }
        assert_eq!(served_order(&upstream, &paths), expected, "{discipline}");
    }
}

#[tokio::test]
async fn codel_sheds_requests_that_waited_past_twice_the_target_once_the_queue_has_stood_and_fifo_serves_them() {
    let paths = ["/delay/80", "/delay/80", "/delay/80", "/delay/80"];
    for (discipline, served, shed) in [("fifo", 4, 0), ("codel", 1, 3)] {
        let upstream = Upstream::start().await;
        let file = TempConfig::new(&config(
            &upstream.url(),
            &format!(
                "max_connections = 1\nqueue_discipline = \"{discipline}\"\ncodel_target = \"5ms\"\ncodel_interval = \"50ms\""
            ),
        ));
        let proxy = Proxy::start(&["--config", &file.path_str()]).await;
        let held = hold_the_slot(&proxy, &upstream).await;
        let queued = queue_in_order(&proxy, &paths).await;
        // Every waiter has now waited past the 5 ms target (the wait is the scenario, not a synchronisation).
        tokio::time::sleep(Duration::from_millis(30)).await;
        upstream.release_stalled();
        assert_eq!(held.await.unwrap().status, StatusCode::OK);
        // The first waiter is served (the episode above target has just begun); 80 ms later every other one has
        // waited well past 2 x 5 ms, 50 ms into the episode.
        let mut answers = Vec::new();
        for request in queued {
            answers.push(request.await.unwrap());
        }
        let ok = answers.iter().filter(|r| r.status == StatusCode::OK).count();
        assert_eq!(ok, served, "{discipline}");
        let overload: Vec<_> = answers.iter().filter(|r| r.status != StatusCode::OK).collect();
        assert_eq!(overload.len(), shed, "{discipline}");
        for resp in overload {
            assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(resp.header("x-floodgate-shed-reason"), Some("overload"));
            assert!(resp.header("retry-after").is_some());
        }
        assert_eq!(
            proxy.outcome_count("a", "shed_overload").await,
            shed as f64,
            "{discipline}"
        );
    }
}

#[tokio::test]
async fn a_request_whose_client_deadline_passes_in_the_queue_is_shed_then_with_504() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(&upstream.url(), "max_connections = 1"));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let held = hold_the_slot(&proxy, &upstream).await;

    for header in [("x-request-timeout", "100"), ("grpc-timeout", "100m")] {
        let started = Instant::now();
        let resp = get_with(proxy.listen, "/late", &[header]).await;
        let waited = started.elapsed();
        assert_eq!(resp.status, StatusCode::GATEWAY_TIMEOUT, "{header:?}: {}", resp.text());
        assert_eq!(resp.header("x-floodgate-shed-reason"), Some("deadline"));
        assert_eq!(
            resp.header("retry-after"),
            None,
            "the client has given up: no retry advice"
        );
        assert!(
            waited >= Duration::from_millis(100),
            "{header:?}: shed after {waited:?}"
        );
        assert!(
            waited < Duration::from_secs(20),
            "{header:?}: not the 30 s queue timeout"
        );
    }
    // Already past: shed without waiting at all.
    let resp = get_with(proxy.listen, "/late", &[("x-request-timeout", "0")]).await;
    assert_eq!(resp.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(proxy.outcome_count("a", "shed_deadline").await, 3.0);
    assert!(
        upstream.recorded_with_prefix("/late").is_empty(),
        "none reached the upstream"
    );

    // An unreadable value is no deadline; the request waits its turn.
    let waiting = {
        let addr = proxy.listen;
        tokio::spawn(async move { get_with(addr, "/patient", &[("x-request-timeout", "soon")]).await })
    };
    proxy.wait_queue_depth("a", 1, WAIT).await;
    upstream.release_stalled();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
}

#[tokio::test]
async fn a_deadline_header_can_be_renamed_or_ignored() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &upstream.url(),
        "max_connections = 1\ndeadline_header = \"x-deadline-ms\"\ngrpc_timeout = false",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let resp = get_with(proxy.listen, "/", &[("x-deadline-ms", "0")]).await;
    assert_eq!(resp.status, StatusCode::GATEWAY_TIMEOUT);
    for ignored in [("x-request-timeout", "0"), ("grpc-timeout", "0m")] {
        let resp = get_with(proxy.listen, "/", &[ignored]).await;
        assert_eq!(resp.status, StatusCode::OK, "{ignored:?} is not read here");
    }
}

#[tokio::test]
async fn a_shed_answer_has_the_configured_status_its_reason_and_a_retry_after_from_the_recent_pace() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &upstream.url(),
        "max_connections = 1\nmax_queue = 2\nshed_status = 429",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // The pace: requests hold the only slot for about 1.2 s each.
    assert_eq!(get(proxy.listen, "/delay/1200").await.status, StatusCode::OK);
    let busy: Vec<_> = (0..3)
        .map(|_| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, "/delay/1200").await })
        })
        .collect();
    proxy.wait_queue_depth("a", 2, WAIT).await;

    let resp = get(proxy.listen, "/").await;
    assert_eq!(resp.status, StatusCode::TOO_MANY_REQUESTS, "{}", resp.text());
    assert_eq!(resp.header("x-floodgate-shed-reason"), Some("queue_full"));
    // Two queued ahead plus itself, one at a time, 1.2 s each: about 3.6 s, so 4.
    let retry_after: u64 = resp.header("retry-after").unwrap().parse().unwrap();
    assert!((4..=5).contains(&retry_after), "Retry-After {retry_after}");
    for request in busy {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(proxy.outcome_count("a", "shed_queue_full").await, 1.0);
}

#[test]
fn bad_overload_settings_stop_start_up_naming_the_key() {
    for (line, key) in [
        ("queue_discipline = \"random\"", "upstreams.a.queue_discipline"),
        ("codel_target = \"0ms\"", "upstreams.a.codel_target"),
        ("shed_status = 200", "upstreams.a.shed_status"),
        ("deadline_header = \"bad header\"", "upstreams.a.deadline_header"),
    ] {
        pki::assert_refused(&config("http://127.0.0.1:9", line), key);
    }
}
