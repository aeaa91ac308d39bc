//! Live reload and the admin API's cap change, through the real binary: limits and routes change under load
//! without a failed request, and the upstream never holds more connections than the cap in force.

mod support;

use std::time::Duration;

use http::{Method, StatusCode};
use support::*;

const WAIT: Duration = Duration::from_secs(10);

/// One upstream `a` taking every request, with a patient queue.
fn one_upstream(url: &str, max_connections: usize) -> String {
    format!(
        r#"
[upstreams.a]
url = "{url}"
max_connections = {max_connections}
max_queue = 1000
queue_timeout = "30s"

[[routes]]
upstream = "a"
"#
    )
}

/// A counting upstream `a` capped at `cap`, and floodgate started on a config file the test may rewrite.
async fn reloadable(cap: usize) -> (Upstream, TempConfig, Proxy) {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&one_upstream(&upstream.url(), cap));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    (upstream, config, proxy)
}

/// `n` GETs of `path` at once, each on its own connection; their statuses when awaited.
fn spawn_gets(addr: std::net::SocketAddr, n: usize, path: &'static str) -> Vec<tokio::task::JoinHandle<StatusCode>> {
    (0..n)
        .map(|_| tokio::spawn(async move { get(addr, path).await.status }))
        .collect()
}

async fn put_cap(proxy: &Proxy, upstream: &str, cap: usize) -> Resp {
    proxy
        .admin_request(
            Method::PUT,
            &format!("/upstreams/{upstream}/max_connections"),
            &cap.to_string(),
            None,
        )
        .await
}

/// After a lowered cap: busy connections finish and close until no more than `cap` are open, and from then on
/// the upstream never sees more than `cap` while the load goes on.
async fn holds_lowered_cap(upstream: &Upstream, load: &Load, cap: usize) {
    wait_until_sync(&format!("upstream down to {cap} connections"), WAIT, || {
        upstream.connections() <= cap
    })
    .await;
    upstream.reset_peak_connections();
    load.serve_more(200).await;
    assert!(
        upstream.peak_connections() <= cap,
        "{} connections at once after the cap went down to {cap}",
        upstream.peak_connections()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_moves_the_cap_both_ways_under_load_without_a_failed_request() {
    let (upstream, _config, proxy) = reloadable(2).await;
    let load = Load::start(proxy.listen, 16, "/delay/10");
    proxy.wait_queue_depth("a", 14, WAIT).await;
    // The two admitted requests' connections are dialled as their exchanges start, which may be just after the
    // others have queued.
    wait_until_sync("the upstream has the cap's 2 connections", WAIT, || {
        upstream.connections() == 2
    })
    .await;
    assert_eq!(upstream.peak_connections(), 2);

    // Raised: the queued requests get the new slots at once, without waiting for a connection to come free.
    let resp = put_cap(&proxy, "a", 6).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(resp.text().contains("2 -> 6"), "{}", resp.text());
    wait_until_sync("six upstream connections", WAIT, || upstream.connections() == 6).await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 6);
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_upstream_max_connections", &[("upstream", "a")]),
        6.0
    );

    // Lowered: busy connections finish, the surplus closes, and no dial happens above the new cap.
    let accepted = upstream.accepted();
    let resp = put_cap(&proxy, "a", 3).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    wait_until_sync("the upstream down to 3 connections", WAIT, || {
        assert_eq!(
            upstream.accepted(),
            accepted,
            "a connection was dialled while above the new cap"
        );
        upstream.connections() <= 3
    })
    .await;
    holds_lowered_cap(&upstream, &load, 3).await;
    assert!(upstream.peak_connections() <= 3);

    load.finish_without_failures().await;
    assert!(upstream.peak_connections() <= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_post_reload_change_caps_and_routes_under_load_without_a_failed_request() {
    let upstream_a = Upstream::start().await;
    let upstream_b = Upstream::start().await;
    let config = TempConfig::new(&one_upstream(&upstream_a.url(), 4));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let load = Load::start(proxy.listen, 12, "/delay/5");
    load.serve_more(100).await;
    assert!(upstream_a.peak_connections() <= 4);

    // Lower a's cap and add b behind /b, by SIGHUP.
    let lowered = format!(
        r#"
[upstreams.a]
url = "{a}"
max_connections = 2
max_queue = 1000
queue_timeout = "30s"

[upstreams.b]
url = "{b}"
max_connections = 1

[[routes]]
upstream = "a"

[[routes]]
path_prefix = "/b"
upstream = "b"
"#,
        a = upstream_a.url(),
        b = upstream_b.url()
    );
    std::fs::write(config.path(), lowered).unwrap();
    proxy.sighup();
    wait_until("b appears in /status", WAIT, || async {
        proxy.status().await["upstreams"]["b"].is_object()
    })
    .await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 2);
    holds_lowered_cap(&upstream_a, &load, 2).await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    let resp = conn.get("/b/hello").await;
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(upstream_b.recorded_with_prefix("/b/hello").len(), 1, "/b went to b");
    assert!(
        proxy.output().contains("upstreams.a.max_connections: 4 -> 2"),
        "{}",
        proxy.output()
    );

    // Back to the first file through the admin API: b is gone, a's cap is 4 again.
    std::fs::write(config.path(), one_upstream(&upstream_a.url(), 4)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(resp.text().contains("upstreams.b: removed"), "{}", resp.text());
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 4);
    upstream_a.reset_peak_connections();
    load.serve_more(200).await;
    assert!(upstream_a.peak_connections() <= 4);
    assert_eq!(conn.get("/b/again").await.status, StatusCode::OK, "/b now goes to a");
    assert_eq!(upstream_a.recorded_with_prefix("/b/again").len(), 1);

    load.finish_without_failures().await;
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_reloads_total", &[("result", "applied")]),
        2.0
    );
}

#[tokio::test]
async fn lowering_the_cap_closes_idle_connections_at_once() {
    let (upstream, _config, proxy) = reloadable(8).await;
    let requests = spawn_gets(proxy.listen, 8, "/delay/100");
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(upstream.connections(), 8);
    assert_eq!(proxy.upstream_field("a", "connections_idle").await, 8);

    let resp = put_cap(&proxy, "a", 3).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    wait_until_sync("the upstream down to 3 connections", WAIT, || {
        upstream.connections() == 3
    })
    .await;
    wait_until("/status down to 3 open, 3 idle", WAIT, || async {
        let a = proxy.upstream_status("a").await;
        a["connections_open"] == 3 && a["connections_idle"] == 3
    })
    .await;
    let accepted = upstream.accepted();
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), accepted, "an idle connection was reused");
}

#[tokio::test]
async fn busy_connections_finish_under_a_lowered_cap_and_none_is_dialled_above_it() {
    let (upstream, _config, proxy) = reloadable(4).await;
    // Four requests hold all four connections at the upstream; four more wait in the queue.
    let requests = spawn_gets(proxy.listen, 8, "/stall");
    proxy.wait_queue_depth("a", 4, WAIT).await;
    wait_until_sync("four requests at the upstream", WAIT, || upstream.inflight() == 4).await;

    let resp = put_cap(&proxy, "a", 2).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(upstream.connections(), 4, "busy connections are not cut");
    upstream.release_stalled();
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(
        upstream.accepted(),
        4,
        "no connection was dialled while above the new cap"
    );
    wait_until_sync("the upstream down to 2 connections", WAIT, || {
        upstream.connections() == 2
    })
    .await;
    // The upstream counts a socket gone when it closes it; floodgate gives the slot back once it has read that
    // close, a moment later.
    wait_until("/status down to 2 open", WAIT, || async {
        proxy.upstream_field("a", "connections_open").await == 2
    })
    .await;
}

#[tokio::test]
async fn an_invalid_configuration_is_refused_and_the_running_one_keeps_serving() {
    let (upstream, config, proxy) = reloadable(2).await;
    let broken = one_upstream(&upstream.url(), 0).replace("queue_timeout = \"30s\"", "queue_timeout = \"soon\"");
    std::fs::write(config.path(), broken).unwrap();

    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", resp.text());
    let text = resp.text();
    assert!(text.contains("running configuration stays"), "{text}");
    assert!(text.contains("upstreams.a.queue_timeout"), "{text}");
    proxy.sighup();
    wait_until_sync("the refusal logged", WAIT, || {
        proxy.output().matches("reload refused").count() >= 2
    })
    .await;
    assert!(
        proxy.output().contains("upstreams.a.queue_timeout"),
        "{}",
        proxy.output()
    );

    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 2);
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_reloads_total", &[("result", "refused")]),
        2.0
    );
    assert_eq!(
        metric_sum(&samples, "floodgate_reloads_total", &[("result", "applied")]),
        0.0
    );

    // A cap of 0 through the admin API is refused the same way.
    let resp = put_cap(&proxy, "a", 0).await;
    assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{}", resp.text());
    let resp = put_cap(&proxy, "nope", 3).await;
    assert_eq!(resp.status, StatusCode::NOT_FOUND, "{}", resp.text());
}

#[tokio::test]
async fn a_removed_upstream_finishes_its_requests_then_closes_its_connections() {
    let upstream_a = Upstream::start().await;
    let upstream_b = Upstream::start().await;
    let both = format!(
        "{}\n[upstreams.b]\nurl = \"{}\"\nmax_connections = 2\n\n[[routes]]\npath_prefix = \"/b\"\nupstream = \"b\"\n",
        one_upstream(&upstream_a.url(), 2),
        upstream_b.url()
    );
    let config = TempConfig::new(&both);
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let in_flight = {
        let addr = proxy.listen;
        tokio::spawn(async move { get(addr, "/b/stall").await })
    };
    wait_until_sync("the request at b", WAIT, || upstream_b.inflight() == 1).await;

    std::fs::write(config.path(), one_upstream(&upstream_a.url(), 2)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let status = proxy.status().await;
    assert!(status["upstreams"]["b"].is_null(), "{status}");
    assert_eq!(status["draining"][0]["name"], "b", "{status}");
    assert_eq!(status["draining"][0]["in_use"], 1, "{status}");
    assert_eq!(status["draining"][0]["draining"], true, "{status}");

    upstream_b.release_stalled();
    let resp = in_flight.await.unwrap();
    assert_eq!(
        resp.status,
        StatusCode::OK,
        "the request admitted before the reload is served"
    );
    wait_until_sync("b's connection closed", WAIT, || upstream_b.connections() == 0).await;
    wait_until("b gone from /status", WAIT, || async {
        proxy.status().await["draining"].is_null()
    })
    .await;
    assert_eq!(get(proxy.listen, "/b/x").await.status, StatusCode::OK);
    assert_eq!(upstream_a.recorded_with_prefix("/b/x").len(), 1, "/b now goes to a");
}

#[tokio::test]
async fn queue_bounds_and_timeouts_change_in_place() {
    let (upstream, config, proxy) = reloadable(1).await;
    let holder = {
        let addr = proxy.listen;
        tokio::spawn(async move { get(addr, "/stall").await.status })
    };
    wait_until_sync("the slot taken", WAIT, || upstream.inflight() == 1).await;

    let no_queue = one_upstream(&upstream.url(), 1).replace("max_queue = 1000", "max_queue = 0");
    std::fs::write(config.path(), no_queue).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(
        resp.text().contains("upstreams.a.max_queue: 1000 -> 0"),
        "{}",
        resp.text()
    );
    let shed = get(proxy.listen, "/").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE, "{}", shed.text());
    assert!(shed.text().contains("queue full"), "{}", shed.text());

    let short_wait = one_upstream(&upstream.url(), 1).replace("queue_timeout = \"30s\"", "queue_timeout = \"50ms\"");
    std::fs::write(config.path(), short_wait).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let shed = get(proxy.listen, "/").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE, "{}", shed.text());
    assert!(shed.text().contains("queue timeout"), "{}", shed.text());

    upstream.release_stalled();
    assert_eq!(holder.await.unwrap(), StatusCode::OK);
}

#[tokio::test]
async fn restart_only_keys_are_reported_and_keep_their_running_value() {
    let (upstream, config, proxy) = reloadable(2).await;
    // `listen` is given as a flag here, and flags win over every reloaded file: it does not count as changed.
    let moved = format!(
        "listen = \"127.0.0.1:1\"\nthreads = 3\nlog_format = \"json\"\n{}",
        one_upstream(&upstream.url(), 3)
    );
    std::fs::write(config.path(), moved).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let text = resp.text();
    assert!(text.contains("needs restart threads"), "{text}");
    assert!(!text.contains("listen"), "{text}");
    assert!(text.contains("needs restart log_format"), "{text}");
    assert!(text.contains("upstreams.a.max_connections: 2 -> 3"), "{text}");
    assert_eq!(
        get(proxy.listen, "/").await.status,
        StatusCode::OK,
        "still listening where it was"
    );
}

#[tokio::test]
async fn write_endpoints_off_loopback_need_the_bearer_token() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&one_upstream(&upstream.url(), 2));
    let path = config.path_str();
    let args = ["--config", path.as_str(), "--admin", "0.0.0.0:0"];

    let open = Proxy::start(&args).await;
    assert_eq!(
        open.admin_get("/metrics").await.status,
        StatusCode::OK,
        "reads need nothing"
    );
    let resp = put_cap(&open, "a", 5).await;
    assert_eq!(resp.status, StatusCode::FORBIDDEN, "{}", resp.text());
    assert!(resp.text().contains("no admin_token"), "{}", resp.text());
    let resp = open.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::FORBIDDEN, "{}", resp.text());
    assert_eq!(open.upstream_field("a", "max_connections").await, 2);
    drop(open);

    let token = "s3cret-token-of-some-length";
    let guarded = Proxy::start_with_env(&args, &[("FLOODGATE__ADMIN_TOKEN", token)]).await;
    let cap = "/upstreams/a/max_connections";
    let resp = guarded.admin_request(Method::PUT, cap, "5", None).await;
    assert_eq!(resp.status, StatusCode::UNAUTHORIZED, "{}", resp.text());
    assert_eq!(resp.header("www-authenticate"), Some("Bearer"));
    let resp = guarded
        .admin_request(Method::PUT, cap, "5", Some("s3cret-token-of-some-lengthX"))
        .await;
    assert_eq!(resp.status, StatusCode::UNAUTHORIZED, "{}", resp.text());
    let resp = guarded.admin_request(Method::PUT, cap, "5", Some(token)).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(guarded.upstream_field("a", "max_connections").await, 5);
    let resp = guarded.admin_request(Method::POST, "/reload", "", Some(token)).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert_eq!(
        guarded.upstream_field("a", "max_connections").await,
        2,
        "a reload puts the configured cap back"
    );
    assert!(!guarded.output().contains(token), "the token never reaches the log");
}

#[tokio::test]
async fn the_configuration_in_force_is_at_config_after_each_reload_secrets_redacted_and_only_for_the_trusted() {
    let upstream = Upstream::start().await;
    // Plain configuration that holds credentials all the same: a header the route sets upstream, a client's key.
    let with_credentials = |cap: usize| {
        one_upstream(&upstream.url(), cap)
            .replace(
                "queue_timeout = \"30s\"\n",
                "queue_timeout = \"30s\"\nfair_key = \"header:x-api-key\"\nfair_weights = { \"key-of-a-client\" = 3 }\n",
            )
            .replace(
                "upstream = \"a\"\n",
                "upstream = \"a\"\nset_request_headers = { authorization = \"Bearer upstream-credential\" }\n",
            )
    };
    let config = TempConfig::new(&with_credentials(2));
    let path = config.path_str();
    let token = "s3cret-token-of-some-length";

    // On loopback, as the write endpoints: no token needed, and the token itself is never shown.
    let local = Proxy::start_with_env(&["--config", path.as_str()], &[("FLOODGATE__ADMIN_TOKEN", token)]).await;
    let shown = local.admin_get("/config").await;
    assert_eq!(shown.status, StatusCode::OK, "{}", shown.text());
    assert_eq!(shown.header("content-type"), Some("application/toml"));
    let text = shown.text();
    assert!(text.contains("max_connections = 2"), "{text}");
    assert!(text.contains("admin_token = \"<redacted>\""), "{text}");
    assert!(!text.contains(token), "{text}");
    for credential in ["upstream-credential", "key-of-a-client"] {
        assert!(!text.contains(credential), "{credential} shown: {text}");
    }
    assert!(
        text.contains("authorization = \"<redacted>\""),
        "the header's name stays: {text}"
    );
    assert!(
        text.contains("\"<redacted> 1\" = 3"),
        "the weight stays, its key numbered: {text}"
    );
    std::fs::write(config.path(), with_credentials(3)).unwrap();
    let resp = local.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let text = local.admin_get("/config").await.text();
    assert!(
        text.contains("max_connections = 3"),
        "what the reload put in force: {text}"
    );
    drop(local);

    // Off loopback: only with the bearer token.
    let args = ["--config", path.as_str(), "--admin", "0.0.0.0:0"];
    let guarded = Proxy::start_with_env(&args, &[("FLOODGATE__ADMIN_TOKEN", token)]).await;
    let resp = guarded.admin_request(Method::GET, "/config", "", None).await;
    assert_eq!(resp.status, StatusCode::UNAUTHORIZED, "{}", resp.text());
    let resp = guarded.admin_request(Method::GET, "/config", "", Some(token)).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(resp.text().contains("max_connections = 3"), "{}", resp.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgate_reload_puts_a_changed_file_in_force_sends_the_token_and_never_sends_a_broken_file() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&one_upstream(&upstream.url(), 2));
    let path = config.path_str();
    let token = "s3cret-token-of-some-length";
    // Off loopback, so the reload is refused without the configuration's token.
    let env = [("FLOODGATE__ADMIN_TOKEN", token)];
    let proxy = Proxy::start_with_env(&["--config", path.as_str(), "--admin", "0.0.0.0:0"], &env).await;
    let admin = format!("127.0.0.1:{}", proxy.admin.port());
    let reload = |env: Vec<(&'static str, &'static str)>| {
        let (path, admin) = (path.clone(), admin.clone());
        tokio::task::spawn_blocking(move || {
            run_to_exit_with_env(
                &["reload", "--config", &path, "--admin", &admin],
                &env,
                Duration::from_secs(30),
            )
        })
    };

    std::fs::write(config.path(), one_upstream(&upstream.url(), 3)).unwrap();
    let (status, stdout, stderr) = reload(vec![("FLOODGATE__ADMIN_TOKEN", token)]).await.unwrap();
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.starts_with("reloaded"), "{stdout}");
    assert!(stdout.contains("max_connections"), "the change is printed: {stdout}");
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 3);

    // Without the token the running floodgate refuses it, and the command says so.
    std::fs::write(config.path(), one_upstream(&upstream.url(), 4)).unwrap();
    let (status, _, stderr) = reload(Vec::new()).await.unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("401"), "{stderr}");
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 3);

    // A file with a problem is reported as check reports it, and never sent.
    std::fs::write(config.path(), one_upstream(&upstream.url(), 0)).unwrap();
    let (status, _, stderr) = reload(vec![("FLOODGATE__ADMIN_TOKEN", token)]).await.unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("upstreams.a.max_connections"), "{stderr}");
    assert!(
        !proxy.output().contains("reload refused"),
        "the running floodgate was never asked"
    );
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 3);
}

#[tokio::test]
async fn the_last_reloads_result_and_the_time_of_the_last_good_one_are_gauges_from_start_up() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&one_upstream(&upstream.url(), 2));
    let path = config.path_str();
    let proxy = Proxy::start(&["--config", path.as_str()]).await;
    let gauges = || async {
        let samples = parse_metrics(&proxy.metrics().await);
        (
            metric_sum(&samples, "floodgate_config_last_reload_successful", &[]),
            metric_sum(&samples, "floodgate_config_last_reload_success_timestamp_seconds", &[]),
        )
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let (ok, started) = gauges().await;
    assert_eq!(ok, 1.0, "start-up's configuration is in force");
    assert!(started > 0.0 && started <= now(), "{started}");

    std::fs::write(config.path(), one_upstream(&upstream.url(), 0)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", resp.text());
    assert_eq!(
        gauges().await,
        (0.0, started),
        "refused: the last good one's time stays"
    );

    std::fs::write(config.path(), one_upstream(&upstream.url(), 3)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let (ok, applied) = gauges().await;
    assert_eq!(ok, 1.0);
    assert!(applied >= started && applied <= now(), "{applied} against {started}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_cap_changes_and_reloads_under_load_loses_no_request_and_settles_at_the_last_cap() {
    let (upstream, config, proxy) = reloadable(3).await;
    let load = Load::start(proxy.listen, 24, "/delay/3");
    load.serve_more(50).await;

    // Caps from 1 to 6, through the admin API and through reloads of the file, interleaved with the traffic.
    let mut seed = 0x5eed_u64;
    for round in 0..40 {
        let cap = 1 + (next_random(&mut seed) % 6) as usize;
        if round % 3 == 0 {
            std::fs::write(config.path(), one_upstream(&upstream.url(), cap)).unwrap();
            let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
            assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
        } else {
            assert_eq!(put_cap(&proxy, "a", cap).await.status, StatusCode::OK);
        }
        load.serve_more(5).await;
        assert!(
            upstream.peak_connections() <= 6,
            "{} connections",
            upstream.peak_connections()
        );
    }
    assert_eq!(put_cap(&proxy, "a", 2).await.status, StatusCode::OK);
    holds_lowered_cap(&upstream, &load, 2).await;

    load.finish_without_failures().await;
    let a = proxy.upstream_status("a").await;
    assert_eq!(a["max_connections"], 2);
    assert_eq!(a["in_use"], 0);
    assert_eq!(a["queue_depth"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_configuration_file_is_reloaded_when_it_changes_as_a_configmap_swap_changes_it() {
    let upstream = Upstream::start().await;
    let watched = |cap: usize| {
        format!(
            "config_watch_interval = \"100ms\"\n{}",
            one_upstream(&upstream.url(), cap)
        )
    };
    // A ConfigMap volume: the file is a symbolic link into a directory the kubelet replaces by swapping a link.
    let dir = std::env::temp_dir().join(format!("floodgate-watch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("v1")).unwrap();
    std::fs::write(dir.join("v1/floodgate.toml"), watched(2)).unwrap();
    std::os::unix::fs::symlink("v1", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/floodgate.toml", dir.join("floodgate.toml")).unwrap();
    let path = dir.join("floodgate.toml").display().to_string();
    let proxy = Proxy::start(&["--config", &path]).await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 2);

    // An edit in place.
    std::fs::write(dir.join("v1/floodgate.toml"), watched(5)).unwrap();
    proxy.wait_until_field("a", "max_connections", 5, WAIT).await;

    // The kubelet's way: a new directory, and one rename of the link that points at it.
    std::fs::create_dir_all(dir.join("v2")).unwrap();
    std::fs::write(dir.join("v2/floodgate.toml"), watched(7)).unwrap();
    std::os::unix::fs::symlink("v2", dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    proxy.wait_until_field("a", "max_connections", 7, WAIT).await;

    // An invalid file is refused, and the running configuration stays.
    std::fs::write(dir.join("v2/floodgate.toml"), "max_client_connections = \"many\"\n").unwrap();
    wait_until("the refusal", WAIT, || async {
        proxy.output().contains("reload refused")
    })
    .await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 7);
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_reloads_total", &[("result", "applied")]),
        2.0
    );
    drop(proxy);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh directory for a test's replica count, and the count file's path in it.
fn replicas_dir(test: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("floodgate-replicas-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let count_file = dir.join("replicas");
    (dir, count_file)
}

/// Upstream `a` with a total of 6 connections shared by the replicas `count_file` counts every 100 ms.
fn replicas_config(upstream: &Upstream, count_file: &std::path::Path) -> TempConfig {
    TempConfig::new(&replicas_text(&upstream.url(), 6, count_file, "100ms"))
}

/// Upstream `a` at `url` with a total of `total` connections shared by the replicas `count_file` counts every
/// `interval`.
fn replicas_text(url: &str, total: usize, count_file: &std::path::Path, interval: &str) -> String {
    format!(
        r#"
[upstreams.a]
url = "{url}"
max_connections = {total}
max_queue = 1000
queue_timeout = "30s"
replicas = {{ file = {:?}, interval = "{interval}" }}

[[routes]]
upstream = "a"
"#,
        count_file.display().to_string()
    )
}

/// Puts `content` in the count file's place in one step (a rename), as a tool that keeps the file would, so that
/// no read sees it half-written.
fn put_count(count_file: &std::path::Path, content: &[u8]) {
    let next = count_file.with_extension("next");
    std::fs::write(&next, content).unwrap();
    std::fs::rename(&next, count_file).unwrap();
}

/// Puts a symbolic link to `target` in the count file's place in one step.
fn put_count_link(count_file: &std::path::Path, target: &std::path::Path) {
    let next = count_file.with_extension("link");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(target, &next).unwrap();
    std::fs::rename(&next, count_file).unwrap();
}

/// `floodgate_replica_counts_refused_total` of upstream `a` for `reason`.
async fn refused_counts(proxy: &Proxy, reason: &str) -> f64 {
    metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_replica_counts_refused_total",
        &[("upstream", "a"), ("reason", reason)],
    )
}

/// The log lines that say a replica count was not taken.
fn count_refusals_logged(proxy: &Proxy) -> usize {
    proxy
        .output()
        .lines()
        .filter(|line| line.contains("cannot take the replica count"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_upstreams_total_cap_and_follow_a_changing_count() {
    let upstream = Upstream::start().await;
    let (dir, count_file) = replicas_dir("count");
    // Two replicas listed, one line each (as a headless Service's addresses would be).
    std::fs::write(&count_file, "10.0.0.1\n10.0.0.2\n").unwrap();
    let config = replicas_config(&upstream, &count_file);
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    // Counted before the first request: this replica's share of 6 over 2.
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 3);
    assert_eq!(proxy.upstream_field("a", "replicas").await, 2);
    // Under load, the upstream sees this replica's share and no more.
    let load = Load::start(proxy.listen, 12, "/delay/20");
    load.serve_more(40).await;
    assert!(
        upstream.peak_connections() <= 3,
        "{} connections",
        upstream.peak_connections()
    );

    // A scale-up: a lowered share closes nothing busy and opens nothing above it.
    std::fs::write(&count_file, "3\n").unwrap();
    proxy.wait_until_field("a", "max_connections", 2, WAIT).await;
    let settled = upstream.peak_connections();
    // The surplus connection closes once its exchange is done.
    wait_until_sync("down to the new share", WAIT, || upstream.connections() <= 2).await;
    upstream.reset_peak_connections();
    load.serve_more(40).await;
    assert!(
        upstream.peak_connections() <= 2,
        "{} connections after the share fell (before: {settled})",
        upstream.peak_connections()
    );

    // A scale-down raises it, and a count that cannot be read keeps the last.
    std::fs::write(&count_file, "1\n").unwrap();
    proxy.wait_until_field("a", "max_connections", 6, WAIT).await;
    std::fs::remove_file(&count_file).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 6);
    load.finish_without_failures().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_count_that_hangs_at_start_up_gives_the_least_share_until_a_later_count_comes() {
    let upstream = Upstream::start().await;
    let (dir, count_file) = replicas_dir("hang");
    // A named pipe nobody writes to: reading it blocks, as a count from a stuck source would.
    let made = std::process::Command::new("mkfifo").arg(&count_file).status().unwrap();
    assert!(made.success());
    let config = replicas_config(&upstream, &count_file);
    // Start-up gives up on the count after a while and serves: with one connection, not the whole total.
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 1);
    // The readers stuck on the pipe get its end, and the file that takes its place is counted in time.
    let mut pipe = std::fs::OpenOptions::new().write(true).open(&count_file).unwrap();
    // A reader that was given up on (start-up's, at its timeout) closes the pipe the moment its open returns: with no
    // other reader left, the write finds the pipe broken, and the stuck opens have ended all the same.
    match std::io::Write::write_all(&mut pipe, b"2\n") {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => panic!("writing the pipe: {err}"),
        _ => {}
    }
    drop(pipe);
    let counted = dir.join("replicas.new");
    std::fs::write(&counted, "2\n").unwrap();
    std::fs::rename(&counted, &count_file).unwrap();
    proxy.wait_until_field("a", "max_connections", 3, WAIT).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_count_that_is_no_count_keeps_the_last_share_is_counted_and_logged_once_per_change() {
    let upstream = Upstream::start().await;
    let (dir, count_file) = replicas_dir("no-count");
    std::fs::write(&count_file, "3\n").unwrap();
    let config = TempConfig::new(&replicas_text(&upstream.url(), 12, &count_file, "100ms"));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    // 12 over 3 replicas.
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 4);
    let load = Load::start(proxy.listen, 16, "/delay/10");
    load.serve_more(20).await;
    upstream.reset_peak_connections();

    let past_usize = format!("{}0\n", usize::MAX);
    let not_a_directory = dir.join("a-directory");
    std::fs::create_dir_all(&not_a_directory).unwrap();
    // Each is put in place in turn, with the reason floodgate refuses it for.
    let no_counts: [(&str, &[u8], &str); 10] = [
        ("abc", b"abc\n", "not_a_count"),
        ("-1", b"-1\n", "not_a_count"),
        ("4.0", b"4.0\n", "not_a_count"),
        ("1e3", b"1e3\n", "not_a_count"),
        ("4 replicas", b"4 replicas\n", "not_a_count"),
        ("a NUL", b"\0", "not_a_count"),
        ("a number past usize", past_usize.as_bytes(), "out_of_range"),
        ("0", b"0\n", "out_of_range"),
        ("nothing", b"", "not_a_count"),
        ("32 MiB of one number", &vec![b'1'; 32 << 20], "too_long"),
    ];
    let peak_before = proxy.peak_rss_kib();
    let mut reasons_in_turn = Vec::new();
    for (what, content, reason) in no_counts {
        let before = refused_counts(&proxy, reason).await;
        put_count(&count_file, content);
        // Read and refused, or (wrongly) taken: either shows in the metrics or in /status.
        wait_until(&format!("a count of {what} read"), WAIT, || async {
            refused_counts(&proxy, reason).await > before || proxy.upstream_field("a", "max_connections").await != 4
        })
        .await;
        assert_eq!(
            proxy.upstream_field("a", "max_connections").await,
            4,
            "a count of {what} changed the share"
        );
        assert_eq!(proxy.upstream_field("a", "replicas").await, 3, "after {what}");
        reasons_in_turn.push(reason);
    }
    assert!(
        proxy.peak_rss_kib() < peak_before + 16 * 1024,
        "reading a 32 MiB count file took the peak RSS from {peak_before} to {} KiB",
        proxy.peak_rss_kib()
    );
    // A directory and a device in the file's place are not read at all.
    for (what, target) in [
        ("a directory", not_a_directory.as_path()),
        ("/dev/zero", std::path::Path::new("/dev/zero")),
    ] {
        let before = refused_counts(&proxy, "not_a_file").await;
        put_count_link(&count_file, target);
        wait_until(&format!("{what} refused"), WAIT, || async {
            refused_counts(&proxy, "not_a_file").await > before
        })
        .await;
        assert_eq!(proxy.upstream_field("a", "max_connections").await, 4, "after {what}");
        reasons_in_turn.push("not_a_file");
    }
    // Refused again and again, it is logged once per change of reason, not once a read.
    let before = refused_counts(&proxy, "not_a_file").await;
    wait_until("five more reads refused", WAIT, || async {
        refused_counts(&proxy, "not_a_file").await >= before + 5.0
    })
    .await;
    reasons_in_turn.dedup();
    assert_eq!(
        count_refusals_logged(&proxy),
        reasons_in_turn.len(),
        "{reasons_in_turn:?}"
    );
    // Meanwhile the upstream saw this replica's share and no more.
    load.serve_more(40).await;
    assert!(
        upstream.peak_connections() <= 4,
        "{} connections",
        upstream.peak_connections()
    );

    // A count again: put in force, and said once.
    put_count(&count_file, b"2\n");
    proxy.wait_until_field("a", "max_connections", 6, WAIT).await;
    assert!(proxy.output().contains("replica count can be read again"));
    load.finish_without_failures().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_refuses_a_replica_count_file_that_is_a_directory_or_a_device_and_an_interval_below_100ms() {
    let (dir, count_file) = replicas_dir("check");
    std::fs::write(&count_file, "2\n").unwrap();
    let text = |file: &std::path::Path, interval: &str| replicas_text("http://127.0.0.1:9", 6, file, interval);
    for file in [dir.as_path(), std::path::Path::new("/dev/zero")] {
        let line = support::pki::assert_refused(&text(file, "1s"), "upstreams.a.replicas.file");
        assert!(line.contains("regular file"), "{line}");
    }
    for interval in ["1ns", "99ms"] {
        let line = support::pki::assert_refused(&text(&count_file, interval), "upstreams.a.replicas.interval");
        assert!(line.contains("at least 100ms"), "{line}");
    }
    // A file that does not exist yet is taken, as before: it gives the least share until it can be read.
    for file in [count_file.clone(), dir.join("not-yet")] {
        let config = TempConfig::new(&text(&file, "100ms"));
        let (status, _, stderr) = run_to_exit(&["check", "--config", &config.path_str()], WAIT);
        assert!(status.success(), "{}: {stderr}", file.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The keys docs/configuration.md says a reload cannot apply: the backticked names of its "**Needs a restart**" item,
/// before the TLS case it words out.
fn documented_restart_only_keys() -> std::collections::BTreeSet<String> {
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md")).unwrap();
    let item = docs
        .split("**Needs a restart**:")
        .nth(1)
        .and_then(|rest| rest.split("and turning TLS on or off").next())
        .expect("docs/configuration.md has a Needs a restart item");
    item.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

#[tokio::test]
async fn a_reload_reports_exactly_the_restart_only_keys_the_docs_name() {
    let (upstream, config, proxy) = reloadable(2).await;
    let access_log = config.path().with_extension("access.log");
    let changed = format!(
        "threads = 3\nlog_format = \"json\"\nlog_level = \"debug\"\naccess_log = \"{}\"\n\
         access_log_format = \"combined\"\naccess_log_fields = [\"url.path\"]\n\
         access_log_request_headers = [\"x-a\"]\naccess_log_response_headers = [\"x-b\"]\n\
         access_log_header_bytes = 64\naccess_log_unredacted = [\"cookie\"]\n\
         proxy_protocol = true\nconfig_watch_interval = \"1h\"\n\
         otlp_endpoint = \"http://127.0.0.1:9/v1/traces\"\notlp_service_name = \"renamed\"\n{}",
        access_log.display(),
        one_upstream(&upstream.url(), 2)
    );
    std::fs::write(config.path(), changed).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let reported: std::collections::BTreeSet<String> = resp
        .text()
        .lines()
        .filter_map(|line| line.strip_prefix("needs restart "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let mut documented = documented_restart_only_keys();
    // The harness gives both listeners as flags, which no reloaded file overrides (see the test above); that they
    // need a restart is the docs' word alone here.
    for flag in ["listen", "admin"] {
        assert!(
            documented.remove(flag),
            "{flag} is not among the documented restart-only keys"
        );
    }
    assert_eq!(reported, documented, "{}", resp.text());
    let _ = std::fs::remove_file(access_log);
}

/// `[upstreams.a]` over two endpoints, each with its own cap, listed in the given order.
fn two_endpoints(first: &str, second: &str, each: usize) -> String {
    format!(
        "[upstreams.a]\nmax_connections = {}\nmax_queue = 1000\nqueue_timeout = \"30s\"\nendpoints = [\n\
         {{ url = \"{first}\", max_connections = {each} }},\n{{ url = \"{second}\", max_connections = {each} }},\n]\n\n\
         [[routes]]\nupstream = \"a\"\n",
        2 * each
    )
}

/// One counting upstream answering at 127.0.0.1 and 127.0.0.2 (a reload that names the other address is a new pool),
/// `at(ip)` its URL there, and floodgate on a config file that names it at 127.0.0.1 with cap `cap`.
async fn at_two_addresses(cap: usize) -> (Upstream, impl Fn(&str) -> String, TempConfig, Proxy) {
    let upstream = Upstream::start_with(UpstreamOptions {
        any_address: true,
        ..UpstreamOptions::default()
    })
    .await;
    let port = upstream.addr().port();
    let at = move |ip: &str| format!("http://{ip}:{port}");
    let config = TempConfig::new(&one_upstream(&at("127.0.0.1"), cap));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    (upstream, at, config, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_that_move_an_upstream_never_let_its_old_and_new_connections_past_the_cap() {
    // A reload that names the other address is a new pool, while the one it replaces still has busy connections.
    let (upstream, at, config, proxy) = at_two_addresses(4).await;
    let load = Load::start(proxy.listen, 24, "/delay/20");
    load.serve_more(20).await;
    for round in 0..40 {
        let ip = if round % 2 == 0 { "127.0.0.2" } else { "127.0.0.1" };
        std::fs::write(config.path(), one_upstream(&at(ip), 4)).unwrap();
        let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
        assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
        load.serve_more(3).await;
        assert!(
            upstream.peak_connections() <= 4,
            "round {round}: {} connections at cap 4",
            upstream.peak_connections()
        );
    }
    load.serve_more(20).await;
    assert!(
        upstream.peak_connections() <= 4,
        "{} connections",
        upstream.peak_connections()
    );

    // The same endpoints in another order are no change: the pool stays, nothing drains, nothing is dialled anew.
    std::fs::write(config.path(), two_endpoints(&at("127.0.0.1"), &at("127.0.0.2"), 2)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    load.serve_more(20).await;
    proxy.wait_until_field("a", "connections_open", 4, WAIT).await;
    let opened = proxy.upstream_field("a", "connections_opened_total").await;
    for round in 0..20 {
        let (first, second) = if round % 2 == 0 {
            ("127.0.0.2", "127.0.0.1")
        } else {
            ("127.0.0.1", "127.0.0.2")
        };
        std::fs::write(config.path(), two_endpoints(&at(first), &at(second), 2)).unwrap();
        let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
        assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
        load.serve_more(3).await;
    }
    let status = proxy.status().await;
    assert!(
        status.get("draining").is_none(),
        "a reordering replaced the pool: {status}"
    );
    assert_eq!(proxy.upstream_field("a", "connections_opened_total").await, opened);
    assert!(
        upstream.peak_connections() <= 4,
        "{} connections",
        upstream.peak_connections()
    );
    load.finish_without_failures().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_in_a_replaced_pool_wait_for_room_at_an_address_the_new_pool_caps() {
    // The first pool dials 127.0.0.1 only; the reload gives that address a cap of 2 of its own. The old pool's
    // waiters must wait until its connections there are down to that cap, not be granted a dial no endpoint may
    // take (each was a `502`).
    let (upstream, at, config, proxy) = at_two_addresses(4).await;
    let requests = spawn_gets(proxy.listen, 6, "/stall");
    proxy.wait_queue_depth("a", 2, WAIT).await;
    wait_until_sync("four requests at the upstream", WAIT, || upstream.inflight() == 4).await;

    std::fs::write(config.path(), two_endpoints(&at("127.0.0.1"), &at("127.0.0.2"), 2)).unwrap();
    let resp = proxy.admin_request(Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    // Each answer closes its connection: the old pool's slots come back one by one rather than being handed on.
    upstream.set_close_every(true);
    upstream.release_stalled();
    for request in requests {
        assert_eq!(request.await.unwrap(), StatusCode::OK);
    }
    assert!(
        upstream.peak_connections() <= 4,
        "{} connections",
        upstream.peak_connections()
    );
}
