use std::time::Duration;

use super::*;

#[test]
fn counts_appear_with_upstream_outcome_and_code_labels_on_every_series() {
    let metrics = Metrics::new();
    let api = metrics.upstream("api");
    api.requests.record(Outcome::Ok, Some(StatusCode::OK));
    api.requests.record(Outcome::Ok, Some(StatusCode::OK));
    metrics.client_side(Outcome::NoRoute, Some(StatusCode::NOT_FOUND));
    let text = metrics.encode();
    assert!(
        text.contains(r#"floodgate_requests_total{upstream="api",outcome="ok",code="2xx"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"floodgate_requests_total{upstream="-",outcome="no_route",code="4xx"} 1"#),
        "{text}"
    );
}

#[test]
fn outcome_totals_sum_status_classes_and_leave_out_what_never_happened() {
    let metrics = Metrics::new();
    let api = metrics.upstream("api");
    api.requests.record(Outcome::Ok, Some(StatusCode::OK));
    api.requests
        .record(Outcome::Ok, Some(StatusCode::INTERNAL_SERVER_ERROR));
    api.requests
        .record(Outcome::ShedQueueFull, Some(StatusCode::SERVICE_UNAVAILABLE));
    let totals: Vec<_> = api.requests.totals().collect();
    assert_eq!(totals, vec![(Outcome::Ok, 2), (Outcome::ShedQueueFull, 1)]);
}

#[test]
fn queue_wait_buckets_agree_with_the_exported_histogram() {
    let metrics = Metrics::new();
    let api = metrics.upstream("api");
    for waited in [0, 100, 101, 3_000, 60_000_000] {
        api.queue_waited(Duration::from_micros(waited));
    }
    let wait = api.queue_wait();
    assert_eq!(wait.count, 5);
    assert_eq!(wait.le.len(), wait.cumulative.len());
    // 0 and exactly 100 µs are in the first bucket; 101 µs in the second; 3 ms in the sixth (≤ 3.2 ms); a
    // minute is above every bound.
    assert_eq!(wait.cumulative.first(), Some(&2));
    assert_eq!(wait.cumulative.get(1), Some(&3));
    assert_eq!(wait.cumulative.get(4), Some(&3));
    assert_eq!(wait.cumulative.get(5), Some(&4));
    assert_eq!(wait.cumulative.last(), Some(&4));
    let text = metrics.encode();
    for (le, cumulative) in wait.le.iter().zip(&wait.cumulative) {
        let line = format!(r#"floodgate_queue_wait_seconds_bucket{{le="{le}",upstream="api"}} {cumulative}"#);
        assert!(text.contains(&line), "{line} not in\n{text}");
    }
}

#[test]
fn one_upstream_asked_for_twice_shares_its_queue_wait_counts() {
    let metrics = Metrics::new();
    metrics.upstream("api").queue_waited(Duration::from_millis(1));
    assert_eq!(metrics.upstream("api").queue_wait().count, 1);
    assert_eq!(metrics.upstream("other").queue_wait().count, 0);
}

#[test]
fn openmetrics_becomes_prometheus_text_with_counters_and_infos_named_by_their_samples() {
    let openmetrics = "# HELP floodgate_reloads Reloads.\n# TYPE floodgate_reloads counter\n\
        floodgate_reloads_total{result=\"applied\"} 0\n\
        # HELP process_cpu_seconds CPU.\n# TYPE process_cpu_seconds counter\n# UNIT process_cpu_seconds seconds\n\
        process_cpu_seconds_total 0.5\n\
        # HELP floodgate_build Build.\n# TYPE floodgate_build info\nfloodgate_build_info{version=\"1\"} 1\n\
        # HELP floodgate_requests_in_flight In flight.\n# TYPE floodgate_requests_in_flight gauge\nfloodgate_requests_in_flight 2\n# EOF\n";
    assert_eq!(
        prometheus_text(openmetrics),
        "# HELP floodgate_reloads_total Reloads.\n# TYPE floodgate_reloads_total counter\n\
         floodgate_reloads_total{result=\"applied\"} 0\n\
         # HELP process_cpu_seconds_total CPU.\n# TYPE process_cpu_seconds_total counter\n\
         process_cpu_seconds_total 0.5\n\
         # HELP floodgate_build_info Build.\n# TYPE floodgate_build_info gauge\nfloodgate_build_info{version=\"1\"} 1\n\
         # HELP floodgate_requests_in_flight In flight.\n# TYPE floodgate_requests_in_flight gauge\nfloodgate_requests_in_flight 2\n"
    );
}
