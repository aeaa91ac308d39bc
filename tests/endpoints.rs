//! Several endpoints per upstream, through the real binary on loopback: each endpoint stays within its own cap and
//! the upstream within the lower of its cap and their sum; load spreads over them; an endpoint that refuses
//! connections is ejected (the cap in force shrinks) without a failed request, and serves again once it is back
//! and its backoff has passed; configuration errors name their key.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use support::*;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);

/// Upstream `a` over `endpoints` (url, own cap), with `extra` keys, taking every request with a patient queue.
fn config(endpoints: &[(String, usize)], max_connections: usize, extra: &str) -> String {
    let list: Vec<String> = endpoints
        .iter()
        .map(|(url, cap)| format!(r#"{{ url = "{url}", max_connections = {cap} }}"#))
        .collect();
    format!(
        r#"
[upstreams.a]
endpoints = [{list}]
max_connections = {max_connections}
max_queue = 1000
queue_timeout = "30s"
{extra}

[[routes]]
upstream = "a"
"#,
        list = list.join(", ")
    )
}

/// Samples the connections both upstreams hold at once until stopped; returns the highest sum seen.
fn sample_total(a: Arc<Upstream>, b: Arc<Upstream>, stop: Arc<AtomicBool>) -> JoinHandle<usize> {
    tokio::spawn(async move {
        let mut peak = 0;
        while !stop.load(Ordering::SeqCst) {
            peak = peak.max(a.connections() + b.connections());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        peak
    })
}

/// The addresses of an upstream's endpoints, as `/status` lists them.
fn addresses(upstream: &serde_json::Value) -> Vec<String> {
    upstream["endpoints"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|endpoint| endpoint["address"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn endpoint_status(upstream: &serde_json::Value, index: usize) -> serde_json::Value {
    upstream["endpoints"][index].clone()
}

async fn both_within_caps_under_30_clients(max_connections: usize, expected_cap: u64) {
    let a = Arc::new(Upstream::start().await);
    let b = Arc::new(Upstream::start().await);
    let file = TempConfig::new(&config(&[(a.url(), 2), (b.url(), 3)], max_connections, ""));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, expected_cap);

    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = sample_total(a.clone(), b.clone(), stop_sampling.clone());
    let load = Load::start(proxy.listen, 30, "/delay/5");
    load.serve_more(600).await;
    let status = proxy.upstream_status("a").await;
    load.finish_without_failures().await;
    stop_sampling.store(true, Ordering::SeqCst);
    let total_peak = sampler.await.unwrap();

    assert!(
        a.peak_connections() <= 2,
        "endpoint a (cap 2) saw {}",
        a.peak_connections()
    );
    assert!(
        b.peak_connections() <= 3,
        "endpoint b (cap 3) saw {}",
        b.peak_connections()
    );
    assert!(
        total_peak as u64 <= expected_cap,
        "{total_peak} connections at once over both endpoints, cap {expected_cap}"
    );
    assert!(status["connections_peak"].as_u64().unwrap() <= expected_cap, "{status}");
    assert!(
        a.requests() > 0 && b.requests() > 0,
        "a served {}, b {}",
        a.requests(),
        b.requests()
    );
    for (index, (upstream, cap)) in [(&a, 2), (&b, 3)].into_iter().enumerate() {
        let endpoint = endpoint_status(&status, index);
        assert_eq!(endpoint["ejected"], false, "{endpoint}");
        assert_eq!(endpoint["address"], upstream.addr().to_string(), "{endpoint}");
        assert_eq!(endpoint["max_connections"], cap, "{endpoint}");
    }
    let samples = parse_metrics(&proxy.metrics().await);
    let address = a.addr().to_string();
    let labels = [("upstream", "a"), ("endpoint", address.as_str())];
    assert!(metric_sum(&samples, "floodgate_endpoint_connections", &labels) <= 2.0);
    assert!(
        samples
            .iter()
            .any(|sample| sample.name == "floodgate_endpoint_connections"),
        "no per-endpoint gauge"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_endpoint_holds_its_own_cap_and_the_upstream_its_lower_cap_under_30_clients() {
    // max_connections 4 is below the endpoints' sum of 5: it holds as well.
    both_within_caps_under_30_clients(4, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_cap_is_the_sum_of_the_endpoints_caps_when_max_connections_is_higher() {
    both_within_caps_under_30_clients(100, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_endpoint_is_ejected_without_a_failed_request_and_serves_again_after_its_backoff() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let file = TempConfig::new(&config(
        &[(a.url(), 2), (b.url(), 2)],
        4,
        "eject_after = 2\neject_backoff = \"300ms\"\neject_backoff_max = \"1s\"",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // Both endpoints get connections first, so the ones to a are pooled when it goes away.
    let load = Load::start(proxy.listen, 8, "/delay/5");
    load.serve_more(200).await;
    load.finish_without_failures().await;
    assert!(a.requests() > 0 && b.requests() > 0);
    proxy.wait_in_use_zero("a", WAIT).await;

    a.stop().await;
    let load = Load::start(proxy.listen, 8, "/delay/5");
    wait_until("a ejected and the cap down to b's", WAIT, || async {
        let status = proxy.upstream_status("a").await;
        endpoint_status(&status, 0)["ejected"] == true && status["max_connections"] == 2
    })
    .await;
    let samples = parse_metrics(&proxy.metrics().await);
    let a_address = a.addr().to_string();
    let a_labels = [("upstream", "a"), ("endpoint", a_address.as_str())];
    assert_eq!(metric_sum(&samples, "floodgate_endpoint_ejected", &a_labels), 1.0);
    assert!(metric_sum(&samples, "floodgate_endpoint_ejections_total", &a_labels) >= 1.0);
    let served_by_b = b.requests();
    load.serve_more(200).await;
    // Up to 8 of those answers were for requests b had already counted.
    assert!(b.requests() >= served_by_b + 200 - 8, "the load did not go to b");
    assert!(b.peak_connections() <= 2);

    let before = a.requests();
    a.restart().await;
    wait_until_sync("a serving again", WAIT, || a.requests() > before).await;
    wait_until("a back in and the cap up again", WAIT, || async {
        let status = proxy.upstream_status("a").await;
        endpoint_status(&status, 0)["ejected"] == false && status["max_connections"] == 4
    })
    .await;
    load.serve_more(200).await;
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(metric_sum(&samples, "floodgate_endpoint_ejected", &a_labels), 0.0);
    load.finish_without_failures().await;
    assert!(a.peak_connections() <= 2 && b.peak_connections() <= 2);
}

#[test]
fn endpoint_configuration_errors_name_their_key() {
    let both = r#"
[upstreams.a]
url = "http://127.0.0.1:9"
endpoints = [{ url = "http://127.0.0.1:10", max_connections = 1 }]

[[routes]]
upstream = "a"
"#;
    pki::assert_refused(both, "upstreams.a.endpoints");
    let zero_cap = config(
        &[("http://127.0.0.1:9".into(), 1), ("http://127.0.0.1:10".into(), 0)],
        8,
        "",
    );
    pki::assert_refused(&zero_cap, "upstreams.a.endpoints[1].max_connections");
    let bad_url = config(&[("ftp://127.0.0.1:9".into(), 1)], 8, "");
    pki::assert_refused(&bad_url, "upstreams.a.endpoints[0].url");
    let mixed = config(
        &[("http://127.0.0.1:9".into(), 1), ("https://127.0.0.1:10".into(), 1)],
        8,
        "",
    );
    pki::assert_refused(&mixed, "upstreams.a.endpoints[1].url");
    let twice = config(&[("http://127.0.0.1:9".into(), 1), ("127.0.0.1:9".into(), 1)], 8, "");
    pki::assert_refused(&twice, "upstreams.a.endpoints[1].url");
    let zero_backoff = config(&[("http://127.0.0.1:9".into(), 1)], 8, "eject_backoff = \"0s\"");
    pki::assert_refused(&zero_backoff, "upstreams.a.eject_backoff");
    let bad_path = config(&[("http://127.0.0.1:9".into(), 1)], 8, "health_check_path = \"health\"");
    pki::assert_refused(&bad_path, "upstreams.a.health_check_path");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_pool_for_the_same_endpoints_and_changes_it_in_place_when_they_change() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let c = Upstream::start().await;
    let file = TempConfig::new(&config(&[(a.url(), 2), (b.url(), 2)], 4, ""));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // Nothing in flight at either endpoint: the first listed is chosen.
    let stalled = {
        let addr = proxy.listen;
        tokio::spawn(async move { get(addr, "/stall").await })
    };
    wait_until_sync("the request at a", WAIT, || a.inflight() == 1).await;

    // The same endpoints, a lower upstream cap: the pool stays and takes the cap in place.
    std::fs::write(file.path(), config(&[(a.url(), 2), (b.url(), 2)], 3, "")).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let status = proxy.status().await;
    assert!(status["draining"].is_null(), "{status}");
    assert_eq!(status["upstreams"]["a"]["max_connections"], 3, "{status}");
    assert_eq!(status["upstreams"]["a"]["in_use"], 1, "{status}");

    // b replaced by c: changed in place. The pool stays with a's request at work, b (idle) leaves, c joins.
    std::fs::write(file.path(), config(&[(c.url(), 1), (a.url(), 2)], 3, "")).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let status = proxy.status().await;
    assert!(status["draining"].is_null(), "{status}");
    let kept = &status["upstreams"]["a"];
    assert_eq!(kept["max_connections"], 3, "{status}");
    assert_eq!(kept["in_use"], 1, "{status}");
    assert_eq!(
        addresses(kept),
        [a.addr().to_string(), c.addr().to_string()],
        "{status}"
    );
    assert_eq!(get(proxy.listen, "/x").await.status, StatusCode::OK);
    assert_eq!(c.requests(), 1, "the endpoint with nothing in flight is chosen");
    assert_eq!(b.requests(), 0);

    a.release_stalled();
    assert_eq!(stalled.await.unwrap().status, StatusCode::OK);
    assert_eq!(a.accepted(), 1, "a's connection was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_eject_a_refusing_endpoint_without_traffic_and_a_good_answer_brings_it_back_at_once() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    // A backoff far longer than the test: only a health check can end the ejection in time.
    let extra = "eject_after = 2\neject_backoff = \"60s\"\neject_backoff_max = \"60s\"\n\
                 health_check_path = \"/health\"\nhealth_check_interval = \"50ms\"";
    let file = TempConfig::new(&config(&[(a.url(), 2), (b.url(), 2)], 4, extra));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    wait_until_sync("both endpoints checked", WAIT, || {
        !a.recorded_with_prefix("/health").is_empty() && !b.recorded_with_prefix("/health").is_empty()
    })
    .await;
    let check = &b.recorded_with_prefix("/health")[0];
    assert_eq!(check.header("host"), Some(b.addr().to_string().as_str()));

    a.stop().await;
    wait_until("a ejected by its checks alone", WAIT, || async {
        let status = proxy.upstream_status("a").await;
        endpoint_status(&status, 0)["ejected"] == true && status["max_connections"] == 2
    })
    .await;
    assert_eq!(
        proxy.upstream_field("a", "requests_total").await,
        0,
        "no request was sent"
    );

    a.restart().await;
    wait_until("a back in after a good check", WAIT, || async {
        let status = proxy.upstream_status("a").await;
        endpoint_status(&status, 0)["ejected"] == false && status["max_connections"] == 4
    })
    .await;
    assert_eq!(get(proxy.listen, "/x").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_check_uses_an_idle_connection_or_a_free_slot_and_is_skipped_while_every_slot_is_busy() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let extra = "health_check_path = \"/health\"\nhealth_check_interval = \"20ms\"";
    let file = TempConfig::new(&config(&[(a.url(), 1), (b.url(), 1)], 2, extra));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // Two requests that hold both slots, one at each endpoint (each endpoint's cap is 1).
    let stalled: Vec<_> = (0..2)
        .map(|_| {
            let addr = proxy.listen;
            tokio::spawn(async move { get(addr, "/stall").await })
        })
        .collect();
    wait_until_sync("a request at each endpoint", WAIT, || {
        a.inflight() == 1 && b.inflight() == 1
    })
    .await;
    let checks = |upstream: &Upstream| upstream.recorded_with_prefix("/health").len();
    let (at_a, at_b) = (checks(&a), checks(&b));
    // Absence over time can only be watched for: ten check intervals with every slot taken.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!((checks(&a), checks(&b)), (at_a, at_b), "a check ran with no slot free");
    assert!(a.peak_connections() <= 1 && b.peak_connections() <= 1);

    a.release_stalled();
    b.release_stalled();
    for request in stalled {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    // The two connections are idle now: the checks use them.
    wait_until_sync("checks again once the connections are free", WAIT, || {
        checks(&a) > at_a && checks(&b) > at_b
    })
    .await;
    assert!(a.peak_connections() <= 1 && b.peak_connections() <= 1);
    assert!(proxy.upstream_field("a", "connections_peak").await <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_endpoint_refusing_a_request_gets_502_after_trying_them_and_all_count_again() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let extra = "eject_after = 2\neject_backoff = \"60s\"\neject_backoff_max = \"60s\"";
    let file = TempConfig::new(&config(&[(a.url(), 2), (b.url(), 2)], 4, extra));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    a.stop().await;
    b.stop().await;

    let resp = get(proxy.listen, "/x").await;
    assert_eq!(resp.status, StatusCode::BAD_GATEWAY, "{}", resp.text());
    let status = proxy.upstream_status("a").await;
    for index in [0, 1] {
        assert_eq!(endpoint_status(&status, index)["ejected"], true, "{status}");
    }
    // Every endpoint ejected: all count again rather than shedding everything.
    assert_eq!(status["max_connections"], 4, "{status}");
    assert_eq!(status["in_use"], 0, "{status}");

    // Still ejected (a 60 s backoff), yet tried: back up, they serve at once.
    a.restart().await;
    b.restart().await;
    assert_eq!(get(proxy.listen, "/x").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_endpoint_finishes_its_exchanges_takes_no_new_one_and_closes_its_connections_until_ready() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let endpoints = [(a.url(), 2), (b.url(), 2)];
    let file = TempConfig::new(&config(&endpoints, 4, ""));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // Both endpoints have served, and hold idle connections.
    let warm: Vec<_> = (0..4)
        .map(|_| {
            let listen = proxy.listen;
            tokio::spawn(async move { get(listen, "/delay/50").await.status })
        })
        .collect();
    for client in warm {
        assert_eq!(client.await.unwrap(), StatusCode::OK);
    }
    assert!(
        a.requests() >= 1 && b.requests() >= 1,
        "a {} b {}",
        a.requests(),
        b.requests()
    );
    // b drains while one of its exchanges is at work: that one finishes.
    let b_address = b.url().trim_start_matches("http://").to_owned();
    let listen = proxy.listen;
    let slow: Vec<_> = (0..4)
        .map(|_| tokio::spawn(async move { get(listen, "/delay/300").await.status }))
        .collect();
    wait_until_sync("b at work", WAIT, || b.inflight() >= 1).await;
    let path = format!("/upstreams/a/endpoints/{b_address}/state");
    let drained = proxy.admin_request(http::Method::PUT, &path, "drain", None).await;
    assert_eq!(drained.status, StatusCode::OK, "{}", drained.text());
    assert!(drained.text().contains("ready -> drain"), "{}", drained.text());
    for client in slow {
        assert_eq!(client.await.unwrap(), StatusCode::OK, "exchanges at work finish");
    }
    wait_until_sync("b's connections closed", WAIT, || b.connections() == 0).await;
    let served_by_b = b.requests();
    for _ in 0..10 {
        assert_eq!(get(proxy.listen, "/after").await.status, StatusCode::OK);
    }
    assert_eq!(b.requests(), served_by_b, "nothing new reached the drained endpoint");
    let status = proxy.upstream_status("a").await;
    assert_eq!(endpoint_status(&status, 1)["state"], "drain", "{status}");
    // Unknown endpoints and states are refused, naming what is wrong.
    let unknown = proxy
        .admin_request(
            http::Method::PUT,
            "/upstreams/a/endpoints/127.0.0.1:1/state",
            "drain",
            None,
        )
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    let bad = proxy.admin_request(http::Method::PUT, &path, "sleep", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    // Ready again: b takes its share once more.
    let ready = proxy.admin_request(http::Method::PUT, &path, "ready", None).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text());
    let load: Vec<_> = (0..4)
        .map(|_| tokio::spawn(async move { get(listen, "/delay/50").await.status }))
        .collect();
    for client in load {
        assert_eq!(client.await.unwrap(), StatusCode::OK);
    }
    assert!(b.requests() > served_by_b, "b serves again");
    assert!(a.peak_connections() <= 2 && b.peak_connections() <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_the_list_keeps_the_kept_endpoints_connections_and_drains_the_gone_one() {
    let a = Arc::new(Upstream::start().await);
    let b = Arc::new(Upstream::start().await);
    let c = Arc::new(Upstream::start().await);
    let file = TempConfig::new(&config(&[(a.url(), 2), (b.url(), 2)], 8, ""));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (a, b, c, stop) = (a.clone(), b.clone(), c.clone(), stop_sampling.clone());
        async move {
            let mut peak = 0;
            while !stop.load(Ordering::SeqCst) {
                peak = peak.max(a.connections() + b.connections() + c.connections());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            peak
        }
    });
    let load = Load::start(proxy.listen, 8, "/delay/10");
    load.serve_more(100).await;
    wait_until_sync("a's two connections", WAIT, || a.connections() == 2).await;
    let a_dialled = a.accepted();

    // b out, c in: a keeps its connections, b's close as they come back, c takes b's share.
    std::fs::write(file.path(), config(&[(a.url(), 2), (c.url(), 2)], 8, "")).unwrap();
    proxy.sighup();
    wait_until_sync("b's connections closed", WAIT, || b.connections() == 0).await;
    let served_by_b = b.requests();
    load.serve_more(200).await;
    assert_eq!(b.requests(), served_by_b, "a gone endpoint took new requests");
    assert!(c.requests() > 0, "the new endpoint took none");
    assert_eq!(
        a.accepted(),
        a_dialled,
        "a kept endpoint's connections were dialled again"
    );
    let status = proxy.status().await;
    assert!(status.get("draining").is_none(), "the pool was replaced: {status}");
    assert_eq!(
        addresses(&status["upstreams"]["a"]),
        [a.addr().to_string(), c.addr().to_string()],
        "{status}"
    );
    assert_eq!(status["upstreams"]["a"]["max_connections"], 4);

    // c's own cap raised, and b back: the cap in force follows, b is dialled in the place it left.
    std::fs::write(file.path(), config(&[(a.url(), 2), (c.url(), 3), (b.url(), 1)], 8, "")).unwrap();
    proxy.sighup();
    proxy.wait_until_field("a", "max_connections", 6, WAIT).await;
    wait_until_sync("b serving again", WAIT, || b.requests() > served_by_b).await;
    load.serve_more(200).await;
    // a's own cap lowered under its connections: one closes as it comes back, and none is dialled again there.
    std::fs::write(file.path(), config(&[(a.url(), 1), (c.url(), 3), (b.url(), 1)], 8, "")).unwrap();
    proxy.sighup();
    proxy.wait_until_field("a", "max_connections", 5, WAIT).await;
    wait_until_sync("a down to one connection", WAIT, || a.connections() <= 1).await;
    load.serve_more(200).await;
    assert!(a.connections() <= 1);
    load.finish_without_failures().await;
    stop_sampling.store(true, Ordering::SeqCst);
    let total_peak = sampler.await.unwrap();
    assert_eq!(
        a.accepted(),
        a_dialled,
        "a kept endpoint's connections were dialled again"
    );
    assert!(total_peak <= 6, "{total_peak} connections at once");
    assert!(a.peak_connections() <= 2 && c.peak_connections() <= 3);
    assert!(b.peak_connections() <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_endpoints_room_leaves_the_cap_in_force_so_more_clients_than_the_rest_can_take_wait_not_fail() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let endpoints = [(a.url(), 2), (b.url(), 2)];
    let file = TempConfig::new(&config(&endpoints, 4, ""));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let b_address = b.url().trim_start_matches("http://").to_owned();
    let path = format!("/upstreams/a/endpoints/{b_address}/state");
    let drained = proxy.admin_request(http::Method::PUT, &path, "drain", None).await;
    assert_eq!(drained.status, StatusCode::OK, "{}", drained.text());
    let status = proxy.upstream_status("a").await;
    assert_eq!(status["max_connections"], 2, "only a's room is in force: {status}");
    // Four times what a can take at once: they queue for a's two connections; none is sent to dial nowhere.
    let listen = proxy.listen;
    let clients: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { get(listen, "/delay/50").await.status }))
        .collect();
    for client in clients {
        assert_eq!(client.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(b.requests(), 0, "nothing reached the drained endpoint");
    assert!(a.peak_connections() <= 2, "a's peak {}", a.peak_connections());
    assert_eq!(proxy.outcome_count("a", "upstream_error").await, 0.0);
}
