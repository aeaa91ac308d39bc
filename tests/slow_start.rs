//! Slow start that measures (`slow_start`): an endpoint begins with a small cap in force when floodgate starts, a
//! reload adds it or it comes back from an ejection, and earns its own cap by answers that stay near its baseline;
//! an upstream that slows as more reach it is held below its cap until `max_duration` ends the ramp. The cap in
//! force and the ramp are read from `/status`, what reached the upstream from the upstream's own counts.

mod support;

use std::time::Duration;

use support::*;

const WAIT: Duration = Duration::from_secs(15);

/// Upstream `a` over `endpoints` (url, own cap; one without a cap is the upstream's `url`), with `ramp` as its
/// slow start and a queue patient enough that nothing is shed while it ramps.
fn config(endpoints: &[(String, Option<usize>)], max_connections: usize, ramp: &str, extra: &str) -> String {
    let place = match endpoints {
        [(url, None)] => format!("url = \"{url}\""),
        _ => {
            let list: Vec<String> = endpoints
                .iter()
                .map(|(url, cap)| format!(r#"{{ url = "{url}", max_connections = {} }}"#, cap.unwrap_or(1)))
                .collect();
            format!("endpoints = [{}]", list.join(", "))
        }
    };
    format!(
        r#"
[upstreams.a]
{place}
max_connections = {max_connections}
max_queue = 1000
queue_timeout = "30s"
slow_start = {{ {ramp} }}
{extra}

[[routes]]
upstream = "a"
"#
    )
}

async fn endpoint(proxy: &Proxy, index: usize) -> serde_json::Value {
    proxy.upstream_status("a").await["endpoints"][index].clone()
}

async fn slow_starts(proxy: &Proxy, address: &str) -> f64 {
    let samples = parse_metrics(&proxy.metrics().await);
    metric_sum(
        &samples,
        "floodgate_endpoint_slow_starts_total",
        &[("upstream", "a"), ("endpoint", address)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_starts_at_its_initial_cap_and_earns_its_own_by_steady_answers() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &[(upstream.url(), None)],
        8,
        r#"initial = 1, window = "100ms", min_samples = 3"#,
        "",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let first = endpoint(&proxy, 0).await;
    assert_eq!(first["slow_start"]["connections"], 1, "{first}");
    assert_eq!(first["max_connections_in_force"], 1, "{first}");
    assert_eq!(slow_starts(&proxy, &upstream.addr().to_string()).await, 1.0);

    // Sixteen clients: one request reaches the upstream, the rest wait in the queue. No window closes before its
    // third answer (600 ms), so one is all the upstream has until then.
    let load = Load::start(proxy.listen, 16, "/delay/200");
    proxy.wait_queue_depth("a", 15, WAIT).await;
    assert_eq!(upstream.peak_inflight(), 1, "the ramp's one connection at first");
    assert_eq!(upstream.accepted(), 1);
    // Answers near their baseline double the cap window by window until the endpoint's own is in force.
    wait_until("the ramp over and the cap of 8 in force", WAIT, || async {
        let endpoint = endpoint(&proxy, 0).await;
        endpoint.get("slow_start").is_none() && endpoint["max_connections_in_force"] == 8
    })
    .await;
    upstream.reset_peak_inflight();
    wait_until_sync("8 at work at the upstream", WAIT, || upstream.peak_inflight() == 8).await;
    load.finish_without_failures().await;
    assert!(upstream.peak_inflight() <= 8 && upstream.peak_connections() <= 8);
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_slower_as_more_reach_it_is_held_below_its_cap_until_max_duration_ends_the_ramp() {
    // Answers take 20 ms while at most 2 requests are at work, 10 ms per request beyond: at 4, twice the
    // baseline, which is past the tolerance (held) and short of twice it (not halved).
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &[(upstream.url(), None)],
        8,
        r#"initial = 1, window = "100ms", min_samples = 3, tolerance = 1.3, max_duration = "3s""#,
        "",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let load = Load::start(proxy.listen, 16, "/knee/2/20");
    wait_until("a second and a half of ramp judged", WAIT, || async {
        let ramp = &endpoint(&proxy, 0).await["slow_start"];
        ramp["seconds"].as_f64().is_some_and(|seconds| seconds >= 1.5) && ramp["last_window_seconds"] != 0.0
    })
    .await;
    let ramp = endpoint(&proxy, 0).await["slow_start"].clone();
    assert!(ramp["connections"].as_u64().is_some_and(|cap| cap <= 4), "{ramp}");
    assert!(
        upstream.peak_inflight() <= 4,
        "{} at work at an upstream that slows past 2",
        upstream.peak_inflight()
    );
    // max_duration ends the ramp whatever the times say: the upstream's own cap is then in force.
    wait_until("the ramp ended by max_duration", WAIT, || async {
        endpoint(&proxy, 0).await.get("slow_start").is_none()
    })
    .await;
    upstream.reset_peak_inflight();
    wait_until_sync("8 at work at the upstream", WAIT, || upstream.peak_inflight() == 8).await;
    load.finish_without_failures().await;
    assert!(upstream.peak_connections() <= 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_back_from_ejection_ramps_again_and_a_reload_ramps_only_the_endpoint_it_adds() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let ramp = r#"initial = 2, window = "50ms", min_samples = 1"#;
    let eject = "eject_after = 1\neject_backoff = \"200ms\"\neject_backoff_max = \"200ms\"";
    // a's own cap is the ramp's start: it has nothing to ramp. b ramps from 2 to 4.
    let file = TempConfig::new(&config(&[(a.url(), Some(2)), (b.url(), Some(4))], 8, ramp, eject));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    assert!(endpoint(&proxy, 0).await.get("slow_start").is_none());
    assert_eq!(endpoint(&proxy, 1).await["slow_start"]["connections"], 2);
    let b_address = b.addr().to_string();
    assert_eq!(slow_starts(&proxy, &b_address).await, 1.0);

    let load = Load::start(proxy.listen, 8, "/delay/5");
    wait_until("b's ramp over", WAIT, || async {
        endpoint(&proxy, 1).await.get("slow_start").is_none()
    })
    .await;
    load.finish_without_failures().await;
    proxy.wait_in_use_zero("a", WAIT).await;
    // b goes away and is ejected; back after its backoff, it starts from 2 again.
    b.stop().await;
    let load = Load::start(proxy.listen, 8, "/delay/5");
    wait_until("b ejected", WAIT, || async {
        endpoint(&proxy, 1).await["ejected"] == true
    })
    .await;
    b.restart().await;
    wait_until("b back in, ramping again", WAIT, || async {
        slow_starts(&proxy, &b_address).await == 2.0
    })
    .await;
    load.serve_more(100).await;
    load.finish_without_failures().await;

    // A reload that adds c: c ramps, a and b go on as they were (b's ramp, had it ended, would not start again).
    let c = Upstream::start().await;
    let before = endpoint(&proxy, 1).await.get("slow_start").is_some();
    std::fs::write(
        file.path(),
        config(
            &[(a.url(), Some(2)), (b.url(), Some(4)), (c.url(), Some(4))],
            10,
            ramp,
            eject,
        ),
    )
    .unwrap();
    proxy.sighup();
    wait_until("the reload in force", WAIT, || async {
        proxy.upstream_status("a").await["endpoints"]
            .as_array()
            .is_some_and(|list| list.len() == 3)
    })
    .await;
    assert_eq!(endpoint(&proxy, 2).await["slow_start"]["connections"], 2);
    assert_eq!(slow_starts(&proxy, &c.addr().to_string()).await, 1.0);
    assert!(endpoint(&proxy, 0).await.get("slow_start").is_none());
    if !before {
        assert!(endpoint(&proxy, 1).await.get("slow_start").is_none());
    }
    assert_eq!(slow_starts(&proxy, &b_address).await, 2.0, "b did not start again");
    assert!(a.peak_connections() <= 2 && b.peak_connections() <= 4 && c.peak_connections() <= 4);
}

#[test]
fn slow_start_errors_name_their_key() {
    for (ramp, key) in [
        ("initial = 0", "slow_start.initial"),
        ("tolerance = 0.5", "slow_start.tolerance"),
        ("min_samples = 0", "slow_start.min_samples"),
        (r#"window = "0s""#, "slow_start.window"),
        (r#"window = "2s", max_duration = "1s""#, "slow_start.max_duration"),
    ] {
        let file = TempConfig::new(&config(&[("http://127.0.0.1:1".into(), None)], 4, ramp, ""));
        let (status, _, stderr) = run_to_exit(&["--config", &file.path_str()], Duration::from_secs(10));
        assert!(!status.success(), "{ramp} was taken");
        assert!(stderr.contains(&format!("upstreams.a.{key}")), "{ramp}: {stderr}");
    }
}
