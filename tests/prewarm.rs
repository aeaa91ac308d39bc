//! Prewarmed connections (`min_idle`): idle connections kept ready before any request needs them, within the cap,
//! never closed for their idleness below the floor, and dialled again when the upstream closes them.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

const WAIT: Duration = Duration::from_secs(5);

async fn prewarmed(upstream: &Upstream, cap: usize, min_idle: &str, extra: &[&str]) -> Proxy {
    Proxy::for_upstream_with_env(
        upstream,
        cap,
        extra,
        &[("FLOODGATE__UPSTREAMS__DEFAULT__MIN_IDLE", min_idle)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_idle_connections_are_open_before_the_first_request_and_the_idle_timeout_keeps_them() {
    let upstream = Upstream::start().await;
    let proxy = prewarmed(&upstream, 4, "2", &["--idle-timeout", "200ms"]).await;
    wait_until_sync("two connections ready", WAIT, || upstream.connections() == 2).await;
    assert_eq!(upstream.requests(), 0, "opened for no request");
    let status = proxy.upstream_status("default").await;
    assert_eq!(
        (status["min_idle"].as_u64(), status["prewarmed_total"].as_u64()),
        (Some(2), Some(2)),
        "{status}"
    );
    // A burst needs four: two more are dialled, and go again after their idle timeout, down to the floor.
    let burst: Vec<_> = (0..4)
        .map(|_| {
            let listen = proxy.listen;
            tokio::spawn(async move { get(listen, "/delay/100").await.status })
        })
        .collect();
    for client in burst {
        assert_eq!(client.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(upstream.accepted(), 4);
    wait_until_sync("back down to the floor", WAIT, || upstream.connections() == 2).await;
    // Several idle timeouts later, the floor's two are still the ones open: nothing closed and dialled again.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(upstream.connections(), 2);
    assert_eq!(upstream.accepted(), 4, "no churn at the floor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_idle_above_the_cap_opens_only_as_many_as_the_cap() {
    let upstream = Upstream::start().await;
    let proxy = prewarmed(&upstream, 2, "5", &[]).await;
    wait_until_sync("the cap's two connections ready", WAIT, || upstream.connections() == 2).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(upstream.accepted(), 2);
    assert_eq!(upstream.peak_connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_upstream_closes_while_idle_are_dialled_again_up_to_min_idle() {
    // The upstream closes keep-alive connections 300 ms after their last request, as Ktor CIO does after 45 s.
    let upstream = Upstream::start_with(UpstreamOptions {
        idle_close: Some(Duration::from_millis(300)),
        ..UpstreamOptions::default()
    })
    .await;
    let proxy = prewarmed(&upstream, 4, "2", &[]).await;
    wait_until_sync(
        "two connections made again after the upstream closed the first two",
        WAIT,
        || upstream.accepted() >= 4,
    )
    .await;
    assert!(upstream.peak_connections() <= 4);
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

/// The CPU time (user + system, in clock ticks) process `pid` has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the proxy's stat");
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_held_at_the_floor_past_their_idle_timeout_cost_no_busy_loop() {
    // Two idle connections kept by the floor past their idle timeout: the idle sweep waits for its next tick
    // instead of waking at once for connections it may not close (a spin would use about a core).
    let upstream = Upstream::start().await;
    let proxy = prewarmed(&upstream, 4, "2", &["--idle-timeout", "100ms"]).await;
    wait_until_sync("two connections ready", WAIT, || upstream.connections() == 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = cpu_ticks(proxy.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_ticks(proxy.pid()) - before;
    assert!(used < 30, "{used} ticks of CPU in a second of idling");
    assert_eq!(upstream.connections(), 2);
}
