//! Graceful shutdown on SIGTERM.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_and_queued_requests_then_exits_zero() {
    let upstream = Upstream::start().await;
    // On the single-thread runtime (`--threads 1`): the signal, the drain and the exit all run on the one thread.
    let mut proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--max-queue", "10", "--shutdown-timeout", "10s", "--threads", "1"],
    )
    .await;
    let listen = proxy.listen;

    // Held at the upstream until released below, so it is certainly still in flight while /readyz turns.
    let in_flight = tokio::spawn(async move { try_get(listen, "/stall").await });
    wait_until_sync("request in flight", Duration::from_secs(5), || upstream.inflight() == 1).await;
    let queued = tokio::spawn(async move { try_get(listen, "/delay/10?queued=1").await });
    proxy.wait_queue_depth("default", 1, Duration::from_secs(5)).await;

    proxy.sigterm();
    // /readyz turns 503 at once (before the drain ends: the in-flight request is still held), while the admin
    // listener still answers. The 5 s budget covers forking kill(1) on a loaded machine.
    proxy.wait_not_ready(Duration::from_secs(5)).await;

    // No new requests are taken.
    let late = tokio::time::timeout(Duration::from_secs(2), try_get(listen, "/late")).await;
    assert!(
        !matches!(late, Ok(Ok(ref r)) if r.status == StatusCode::OK),
        "a request made after SIGTERM was served: {late:?}"
    );
    assert!(
        !in_flight.is_finished(),
        "the in-flight request ended before it was released"
    );
    upstream.release_stalled();

    let resp = in_flight.await.unwrap().expect("in-flight request completes");
    assert_eq!(resp.status, StatusCode::OK);
    let resp = queued.await.unwrap().expect("queued request completes");
    assert_eq!(resp.status, StatusCode::OK);

    let exit = proxy.wait_exit(Duration::from_secs(10)).await;
    let exit = exit.expect("floodgate did not exit within 10 s of SIGTERM");
    assert!(exit.success(), "exit status {exit}");
    assert!(upstream.recorded_with_prefix("/late").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_stuck_request_exits_after_the_shutdown_timeout() {
    let upstream = Upstream::start().await;
    let mut proxy = Proxy::for_upstream(&upstream, 1, &["--shutdown-timeout", "500ms"]).await;
    let listen = proxy.listen;
    let stuck = tokio::spawn(async move { try_get(listen, "/stall").await });
    wait_until_sync("request stuck upstream", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;

    let sent = Instant::now();
    proxy.sigterm();
    let exit = proxy.wait_exit(Duration::from_secs(10)).await;
    assert!(
        exit.is_some(),
        "floodgate still running 10 s after SIGTERM with a 500ms shutdown timeout"
    );
    assert!(
        sent.elapsed() >= Duration::from_millis(400),
        "exited after {:?}, before the shutdown timeout",
        sent.elapsed()
    );
    let _ = stuck.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_upstream_to_finish_an_exchange_that_timed_out_before_exiting() {
    let upstream = Upstream::start().await;
    let mut proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--request-timeout", "200ms", "--shutdown-timeout", "30s"],
    )
    .await;
    // The client is answered 504; the upstream is still working on the request, which still counts.
    let timed_out = get(proxy.listen, "/stall").await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(upstream.inflight(), 1);

    proxy.sigterm();
    // No client connection is left, but the exit waits for the upstream rather than cutting it off mid-response.
    wait_until_sync("the wait for the upstream is logged", Duration::from_secs(5), || {
        proxy.output().contains("waiting for the upstreams to finish")
    })
    .await;
    assert_eq!(
        proxy.wait_exit(Duration::ZERO).await,
        None,
        "exited with the upstream at work"
    );
    assert_eq!(upstream.inflight(), 1);

    upstream.release_stalled();
    let exit = proxy.wait_exit(Duration::from_secs(10)).await;
    let exit = exit.expect("floodgate did not exit within 10 s of the upstream finishing");
    assert!(exit.success(), "exit status {exit}");
    assert_eq!(upstream.inflight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_drain_time_readyz_fails_at_once_while_new_clients_are_still_served_until_it_ends() {
    const DRAIN: Duration = Duration::from_secs(3);
    let upstream = Upstream::start().await;
    let mut proxy = Proxy::for_upstream(
        &upstream,
        1,
        &["--drain-time", "3s", "--shutdown-timeout", "10s", "--threads", "1"],
    )
    .await;
    let listen = proxy.listen;

    let signalled = Instant::now();
    proxy.sigterm();
    proxy.wait_not_ready(Duration::from_secs(5)).await;
    // /readyz fails, and a client that has not moved away yet is still taken and served, on a new connection.
    let late = try_get(listen, "/late")
        .await
        .expect("a new connection during the drain time");
    assert_eq!(late.status, StatusCode::OK, "{}", late.text());
    assert_eq!(upstream.recorded_with_prefix("/late").len(), 1);

    let exit = proxy.wait_exit(Duration::from_secs(15)).await;
    let exit = exit.expect("floodgate did not exit after its drain time");
    assert!(exit.success(), "exit status {exit}");
    assert!(
        signalled.elapsed() >= DRAIN,
        "exited {:?} after SIGTERM, before its drain time",
        signalled.elapsed()
    );
    assert!(
        try_get(listen, "/after").await.is_err(),
        "the listener still answers after the exit"
    );
}
