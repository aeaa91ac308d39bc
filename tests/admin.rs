//! The admin listener: health, readiness, /status and /metrics agree with
//! what the test itself did.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_readyz_answer_ok_and_ready() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let health = proxy.admin_get("/healthz").await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.text().trim(), "ok");
    let ready = proxy.admin_get("/readyz").await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.text().trim(), "ready");
    assert_eq!(proxy.status().await["ready"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_configuration_and_counters_of_each_upstream() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 3, &["--max-queue", "77", "--queue-timeout", "5s"]).await;
    for _ in 0..4 {
        assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    }
    proxy.wait_in_use_zero("default", Duration::from_secs(5)).await;
    let status = proxy.status().await;
    let up = &status["upstreams"]["default"];
    assert_eq!(up["address"], upstream.addr().to_string(), "{status}");
    assert_eq!(up["max_connections"], 3, "{status}");
    assert_eq!(up["max_queue"], 77, "{status}");
    assert_eq!(up["in_use"], 0, "{status}");
    assert_eq!(up["queue_depth"], 0, "{status}");
    assert_eq!(up["requests_total"], 4, "{status}");
    assert_eq!(up["connections_opened_total"], upstream.accepted() as u64, "{status}");
    assert_eq!(up["connections_peak"], upstream.peak_connections() as u64, "{status}");
    assert_eq!(up["connections_open"], upstream.connections() as u64, "{status}");
    assert_eq!(up["connections_idle"], up["connections_open"], "{status}");
    assert!(status["client_connections"].is_u64(), "{status}");
    assert_eq!(status["ready"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_every_outcome_the_test_produced() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.api]
url = "{}"
max_connections = 1
max_queue = 0
queue_timeout = "5s"

[[routes]]
path_prefix = "/api"
upstream = "api"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let listen = proxy.listen;

    // 5 × 2xx, 2 × 5xx from the upstream (both outcome ok).
    for _ in 0..5 {
        assert_eq!(get(listen, "/api/").await.status, StatusCode::OK);
    }
    for _ in 0..2 {
        assert_eq!(
            get(listen, "/api/status/500").await.status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    // 3 × shed_queue_full while the only slot is stalled (held request counts as ok).
    let stalled = tokio::spawn(async move { get(listen, "/api/stall").await.status });
    wait_until_sync("slot taken", Duration::from_secs(5), || upstream.inflight() == 1).await;
    for _ in 0..3 {
        assert_eq!(get(listen, "/api/").await.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap(), StatusCode::OK);
    // 2 × no_route, 1 × not_implemented, 1 × bad_request.
    for _ in 0..2 {
        assert_eq!(get(listen, "/elsewhere").await.status, StatusCode::NOT_FOUND);
    }
    // The proxy may keep this connection open after the 501: read one response.
    let mut conn = RawConn::connect(listen).await;
    conn.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        .await
        .unwrap();
    let resp = conn.read_response(false, Duration::from_secs(10)).await.unwrap();
    assert_eq!(resp.status, 501);
    let (data, _) = raw_exchange(listen, b"THIS IS NOT HTTP\r\n\r\n", Duration::from_secs(10)).await;
    assert_eq!(first_status(&data), Some(400));

    proxy.wait_in_use_zero("api", Duration::from_secs(5)).await;
    let requests = "floodgate_requests_total";
    // The 400 is written and the connection closed by hyper; the proxy counts it when the connection task ends,
    // which may be just after the client has seen the close.
    wait_until("the malformed request is counted", Duration::from_secs(5), || async {
        let m = parse_metrics(&proxy.metrics().await);
        metric_sum(&m, requests, &[("outcome", "bad_request")]) >= 1.0
    })
    .await;
    let text = proxy.metrics().await;
    let m = parse_metrics(&text);
    let check = |labels: &[(&str, &str)], expected: f64| {
        let got = metric_sum(&m, requests, labels);
        assert_eq!(got, expected, "{requests}{labels:?}\n{text}");
    };
    check(&[("upstream", "api"), ("outcome", "ok"), ("code", "2xx")], 6.0);
    check(&[("upstream", "api"), ("outcome", "ok"), ("code", "5xx")], 2.0);
    check(&[("upstream", "api"), ("outcome", "ok")], 8.0);
    check(&[("upstream", "api"), ("outcome", "shed_queue_full")], 3.0);
    check(&[("upstream", "api"), ("outcome", "shed_queue_timeout")], 0.0);
    check(&[("upstream", "api"), ("outcome", "upstream_error")], 0.0);
    check(&[("outcome", "no_route")], 2.0);
    check(&[("outcome", "not_implemented")], 1.0);
    check(&[("outcome", "bad_request")], 1.0);

    let opened = metric_sum(
        &m,
        "floodgate_upstream_connections_opened_total",
        &[("upstream", "api")],
    );
    assert_eq!(opened, upstream.accepted() as f64, "{text}");
    let peak = metric_sum(&m, "floodgate_upstream_connections_peak", &[("upstream", "api")]);
    assert_eq!(peak, upstream.peak_connections() as f64, "{text}");
    assert_eq!(
        metric_sum(&m, "floodgate_requests_in_flight", &[("upstream", "api")]),
        0.0
    );
    assert_eq!(metric_sum(&m, "floodgate_queue_depth", &[("upstream", "api")]), 0.0);
    let active = metric_sum(
        &m,
        "floodgate_upstream_connections",
        &[("upstream", "api"), ("state", "active")],
    );
    assert_eq!(active, 0.0, "{text}");
    let idle = metric_sum(
        &m,
        "floodgate_upstream_connections",
        &[("upstream", "api"), ("state", "idle")],
    );
    assert_eq!(idle, upstream.connections() as f64, "{text}");
    let responses = metric_sum(&m, "floodgate_upstream_response_seconds_count", &[("upstream", "api")]);
    assert_eq!(responses, 8.0, "{text}");
    let waits = metric_sum(&m, "floodgate_queue_wait_seconds_count", &[("upstream", "api")]);
    assert!(waits >= 8.0, "queue wait histogram: {waits}\n{text}");
    assert!(metric_exists(&m, "floodgate_client_connections"), "{text}");
    assert!(
        m.iter()
            .any(|s| s.name == "floodgate_queue_wait_seconds_bucket" && s.labels.contains_key("le")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_outcomes_and_queue_waits_of_each_upstream() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.api]
url = "{}"
max_connections = 1
max_queue = 1
queue_timeout = "5s"

[upstreams.idle]
url = "{}"

[[routes]]
upstream = "api"
"#,
        upstream.url(),
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let listen = proxy.listen;
    let before = proxy.upstream_status("api").await;
    assert_eq!(before["outcomes"], serde_json::json!({}), "{before}");
    assert_eq!(before["queue_wait_seconds"]["count"], 0, "{before}");

    for _ in 0..3 {
        assert_eq!(get(listen, "/").await.status, StatusCode::OK);
    }
    // One request holds the only slot, one waits in the one queue place, one more is shed.
    let stalled = tokio::spawn(async move { get(listen, "/stall").await.status });
    wait_until_sync("slot taken", Duration::from_secs(5), || upstream.inflight() == 1).await;
    let queued = tokio::spawn(async move { get(listen, "/").await.status });
    proxy.wait_queue_depth("api", 1, Duration::from_secs(5)).await;
    assert_eq!(get(listen, "/").await.status, StatusCode::SERVICE_UNAVAILABLE);
    let queued_for = Duration::from_millis(300);
    tokio::time::sleep(queued_for).await;
    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap(), StatusCode::OK);
    assert_eq!(queued.await.unwrap(), StatusCode::OK);
    proxy.wait_in_use_zero("api", Duration::from_secs(5)).await;

    let status = proxy.status().await;
    let api = &status["upstreams"]["api"];
    // Only outcomes that happened appear, under the names /metrics uses.
    assert_eq!(
        api["outcomes"],
        serde_json::json!({"ok": 5, "shed_queue_full": 1}),
        "{status}"
    );
    assert_eq!(
        status["upstreams"]["idle"]["outcomes"],
        serde_json::json!({}),
        "{status}"
    );

    let wait = &api["queue_wait_seconds"];
    assert_eq!(
        wait["count"], 5,
        "admitted requests, the shed one not among them: {status}"
    );
    let le: Vec<f64> = serde_json::from_value(wait["le"].clone()).unwrap();
    let cumulative: Vec<u64> = serde_json::from_value(wait["cumulative"].clone()).unwrap();
    assert_eq!(le.len(), cumulative.len(), "{status}");
    assert!(le.windows(2).all(|w| w[0] < w[1]), "bounds ascend: {le:?}");
    assert!(
        cumulative.windows(2).all(|w| w[0] <= w[1]),
        "counts are cumulative: {cumulative:?}"
    );
    assert!(cumulative.last().is_some_and(|&n| n <= 5), "{cumulative:?}");
    // The queued request waited at least `queued_for`: at least one wait lies above every bound below it.
    let below = le.iter().rposition(|&bound| bound < queued_for.as_secs_f64()).unwrap();
    assert!(
        cumulative[below] <= 4,
        "the queued request's wait is missing: {le:?} {cumulative:?}"
    );

    // The same observations as the histogram /metrics exports.
    let m = parse_metrics(&proxy.metrics().await);
    let exported = metric_sum(&m, "floodgate_queue_wait_seconds_count", &[("upstream", "api")]);
    assert_eq!(exported, 5.0);
    for (bound, count) in le.iter().zip(&cumulative) {
        let bucket = metric_sum(
            &m,
            "floodgate_queue_wait_seconds_bucket",
            &[("upstream", "api"), ("le", &bound.to_string())],
        );
        assert_eq!(bucket, *count as f64, "bucket le={bound}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_page_is_served_self_contained_at_the_root() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let page = proxy.admin_get("/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.header("content-type"), Some("text/html; charset=utf-8"));
    let policy = page.header("content-security-policy").unwrap_or_default();
    assert!(
        policy.contains("default-src 'none'") && policy.contains("connect-src 'self'"),
        "{policy}"
    );
    let html = page.text();
    assert!(html.contains("fetch(\"status\""), "the page polls /status");
    for external in ["http://", "https://", "src=", "<link"] {
        assert!(!html.contains(external), "the page loads something else ({external})");
    }
    // Only the page lives at the root; other paths are still unknown.
    assert_eq!(proxy.admin_get("/index.html").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_process_the_build_and_every_counter_at_0_from_start_up() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let samples = parse_metrics(&proxy.metrics().await);
    let value = |name: &str| metric_sum(&samples, name, &[]);
    // Before any request or reload: the series an `increase()` alert needs are there, at 0.
    assert!(metric_exists(&samples, "floodgate_reloads_total"));
    assert_eq!(value("floodgate_reloads_total"), 0.0);
    for outcome in [
        "ok",
        "shed_queue_full",
        "shed_queue_timeout",
        "upstream_error",
        "upstream_timeout",
    ] {
        let series: Vec<_> = samples
            .iter()
            .filter(|s| {
                s.name == "floodgate_requests_total" && s.labels.get("outcome").map(String::as_str) == Some(outcome)
            })
            .collect();
        assert!(!series.is_empty(), "no floodgate_requests_total for {outcome}");
        assert!(series.iter().all(|s| s.value == 0.0));
    }
    let build: Vec<_> = samples.iter().filter(|s| s.name == "floodgate_build_info").collect();
    assert_eq!(build.len(), 1);
    assert_eq!(build[0].labels["version"], env!("CARGO_PKG_VERSION"));
    assert!(!build[0].labels["commit"].is_empty());
    let resident = value("process_resident_memory_bytes");
    let rss_bytes = proxy.rss_kib() as f64 * 1024.0;
    assert!(
        resident > 1e6 && resident < 4.0 * rss_bytes,
        "{resident} against {rss_bytes}"
    );
    let (open, max) = (value("process_open_fds"), value("process_max_fds"));
    assert!(open >= 3.0 && max >= open, "{open} of {max}");
    assert!(metric_exists(&samples, "process_cpu_seconds_total"));
    let started = value("process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(started <= now && started > now - 600.0, "{started}");
    assert!(value("process_virtual_memory_bytes") >= resident);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_come_as_openmetrics_to_a_scraper_that_asks_and_as_prometheus_text_otherwise() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let scrape = |accept: Option<&'static str>| {
        let admin = proxy.admin;
        async move {
            let mut request = http::Request::get("/metrics");
            if let Some(accept) = accept {
                request = request.header("accept", accept);
            }
            let mut conn = H1Conn::connect(admin).await;
            collect(conn.send(request.body(body_empty()).unwrap()).await.unwrap())
                .await
                .unwrap()
        }
    };
    // What Prometheus sends.
    let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
        text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let open = scrape(Some(prometheus)).await;
    assert_eq!(
        open.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let text = open.text();
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(text.contains("# TYPE floodgate_reloads counter\n"), "{text}");
    // Units where OpenMetrics has them: floodgate's families as well as process_*.
    for unit in [
        "# UNIT floodgate_queue_wait_seconds seconds\n",
        "# UNIT floodgate_request_duration_seconds seconds\n",
        "# UNIT floodgate_request_bytes bytes\n",
        "# UNIT floodgate_buffered_bytes bytes\n",
        "# UNIT floodgate_config_last_reload_success_timestamp_seconds seconds\n",
    ] {
        assert!(text.contains(unit), "no {unit:?} in {text}");
    }
    for accept in [
        None,
        Some("text/plain"),
        Some("*/*"),
        // Weights are read: OpenMetrics refused, or preferred less than the classic format.
        Some("application/openmetrics-text;q=0"),
        Some("application/openmetrics-text; q=0.0, text/plain"),
        Some("application/openmetrics-text;q=0.2,text/plain;q=0.9"),
    ] {
        let plain = scrape(accept).await;
        assert_eq!(
            plain.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        let text = plain.text();
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
        // The classic format's TYPE names the samples themselves.
        assert!(text.contains("# TYPE floodgate_reloads_total counter\n"), "{text}");
        assert!(text.contains("# TYPE floodgate_build_info gauge\n"), "{text}");
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"), "{text}");
        assert_eq!(parse_metrics(&text).len(), parse_metrics(&open.text()).len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_route_counts_its_requests_time_and_bytes_as_the_client_sees_them() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        "[upstreams.api]\nurl = \"{}\"\n\n[[routes]]\npath_prefix = \"/api\"\nupstream = \"api\"\n\n\
         [[routes]]\nupstream = \"api\"\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let mut sent_back = 0;
    for _ in 0..3 {
        let answer = get(proxy.listen, "/api/x").await;
        assert_eq!(answer.status, StatusCode::OK);
        sent_back += answer.body.len() as u64;
    }
    let mut conn = H1Conn::connect(proxy.listen).await;
    let posted = conn
        .try_request(http::Method::POST, "/api/upload", body_full(vec![7u8; 2048]))
        .await
        .unwrap();
    assert_eq!(posted.status, StatusCode::OK);
    sent_back += posted.body.len() as u64;
    assert_eq!(get(proxy.listen, "/other").await.status, StatusCode::OK);
    proxy.wait_in_use_zero("api", Duration::from_secs(5)).await;
    let api = [("upstream", "api"), ("route", "*/api")];
    wait_until("the answers counted", Duration::from_secs(5), || async {
        metric_sum(
            &parse_metrics(&proxy.metrics().await),
            "floodgate_request_duration_seconds_count",
            &api,
        ) == 4.0
    })
    .await;
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_response_bytes_total", &api),
        sent_back as f64
    );
    assert_eq!(metric_sum(&samples, "floodgate_request_bytes_total", &api), 2048.0);
    let other = [("upstream", "api"), ("route", "*")];
    assert_eq!(
        metric_sum(&samples, "floodgate_request_duration_seconds_count", &other),
        1.0
    );
    assert!(metric_sum(&samples, "floodgate_request_duration_seconds_sum", &api) > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_version_uptime_the_last_reload_and_upstream_response_times() {
    let upstream = Upstream::start().await;
    let config = |cap: &str| {
        format!(
            "[upstreams.api]\nurl = \"{}\"\nmax_connections = {cap}\nqueue_timeout = \"750ms\"\n[[routes]]\nupstream = \"api\"\n",
            upstream.url()
        )
    };
    let file = TempConfig::new(&config("2"));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let started = proxy.status().await;
    assert_eq!(started["version"], env!("CARGO_PKG_VERSION"), "{started}");
    assert!(started["last_reload"].is_null(), "no reload yet: {started}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let in_force = started["config_in_force_since"].as_f64().unwrap();
    assert!((now - 60.0..=now).contains(&in_force), "{in_force} against {now}");
    let api = &started["upstreams"]["api"];
    assert_eq!(api["queue_timeout_seconds"], 0.75, "{started}");
    assert_eq!(api["upstream_response_seconds"]["count"], 0, "{started}");

    for _ in 0..3 {
        assert_eq!(get(proxy.listen, "/delay/30").await.status, StatusCode::OK);
    }
    let served = proxy.status().await;
    let times = &served["upstreams"]["api"]["upstream_response_seconds"];
    assert_eq!(times["count"], 3, "{served}");
    let le: Vec<f64> = serde_json::from_value(times["le"].clone()).unwrap();
    let cumulative: Vec<u64> = serde_json::from_value(times["cumulative"].clone()).unwrap();
    // Each took the upstream's 30 ms at least: none lies at or below a bound under that.
    let under = le.iter().rposition(|&bound| bound < 0.03).unwrap();
    assert_eq!(cumulative[under], 0, "{le:?} {cumulative:?}");
    assert!(
        served["uptime_seconds"].as_f64().unwrap() > started["uptime_seconds"].as_f64().unwrap(),
        "{served}"
    );

    // A refused reload is shown as such, and the configuration in force stays the one from before.
    std::fs::write(file.path(), config("\"many\"")).unwrap();
    let refused = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_ne!(refused.status, StatusCode::OK, "{}", refused.text());
    let after_refusal = proxy.status().await;
    assert_eq!(after_refusal["last_reload"]["applied"], false, "{after_refusal}");
    assert_eq!(after_refusal["config_in_force_since"], started["config_in_force_since"]);

    std::fs::write(file.path(), config("3")).unwrap();
    let applied = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(applied.status, StatusCode::OK, "{}", applied.text());
    let after = proxy.status().await;
    assert_eq!(after["last_reload"]["applied"], true, "{after}");
    assert_eq!(after["last_reload"]["at"], after["config_in_force_since"], "{after}");
    assert!(after["config_in_force_since"].as_f64().unwrap() >= in_force, "{after}");
}
