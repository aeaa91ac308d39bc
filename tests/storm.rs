//! A retry storm beside admitted work: refusing a flood of requests must not starve the requests floodgate has
//! already admitted. The upstream's own count of requests served is the measure: with a freed connection handed
//! to the next queued request at once, it works close to `cap / service time` however busy the refusing is.

mod support;

use std::time::{Duration, Instant};

use support::flood::Flood;
use support::*;

const SERVICE: Duration = Duration::from_millis(50);
const CAP: usize = 2;
/// Long enough for a few hundred exchanges at cap / service time.
const WINDOW: Duration = Duration::from_secs(4);

/// One flood at a time: the tests of this file would otherwise flood the same two cores at once, and each measure
/// the others' load as much as its own proxy's.
static ONE_FLOOD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn goodput_under_flood(threads: &str) {
    let _alone = ONE_FLOOD.lock().await;
    let upstream = Upstream::start().await;
    // A short queue, so that almost all of the flood is refused at once (queue_full), and a long queue timeout,
    // so that what is queued is served rather than timed out.
    let proxy = Proxy::for_upstream(
        &upstream,
        CAP,
        &["--max-queue", "4", "--queue-timeout", "30s", "--threads", threads],
    )
    .await;
    let path = format!("/delay/{}", SERVICE.as_millis());
    let flood = Flood::start(proxy.listen, 300, &path);
    wait_until("floodgate is refusing the flood", Duration::from_secs(20), || async {
        flood.shed() >= 5_000
    })
    .await;

    let served_before = upstream.requests();
    upstream.reset_peak_inflight();
    let started = Instant::now();
    // A measurement window, not a wait for an event: the upstream's rate over it is what is asserted.
    tokio::time::sleep(WINDOW).await;
    let served = upstream.requests() - served_before;
    let elapsed = started.elapsed();
    let refused = flood.shed();
    let capacity = CAP as f64 * elapsed.as_secs_f64() / SERVICE.as_secs_f64();
    let share = served as f64 / capacity;
    eprintln!(
        "threads {threads}: upstream served {served} in {elapsed:?} ({:.0} % of {capacity:.0}); {refused} refused, {} answered in all",
        share * 100.0,
        flood.answers()
    );
    assert!(
        share >= 0.5,
        "the upstream served {served} requests in {elapsed:?}, {:.0} % of its capacity ({capacity:.0}) while \
         floodgate refused a flood ({refused} refusals so far)",
        share * 100.0
    );
    assert!(
        upstream.peak_inflight() <= CAP,
        "the upstream ran {} requests at once",
        upstream.peak_inflight()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusing_a_flood_on_one_thread_does_not_starve_the_admitted_requests() {
    goodput_under_flood("1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusing_a_flood_on_two_threads_does_not_starve_the_admitted_requests() {
    goodput_under_flood("2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_in_a_flood_is_a_503_with_retry_after_and_its_reason() {
    let _alone = ONE_FLOOD.lock().await;
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--max-queue", "1", "--queue-timeout", "30s"]).await;
    let flood = Flood::start(proxy.listen, 50, "/delay/20");
    wait_until(
        "floodgate has refused 2,000 requests",
        Duration::from_secs(20),
        || async { flood.shed() >= 2_000 },
    )
    .await;
    let tally = flood.finish();
    assert_eq!(tally.answers, tally.ok + tally.shed, "{tally:?}: only 200s and 503s");
    assert!(tally.ok > 0, "{tally:?}: some of the flood was served");
    assert_eq!(tally.retry_after, tally.shed, "{tally:?}: every 503 has a Retry-After");
    assert_eq!(tally.reasons, tally.shed, "{tally:?}: every 503 names its reason");
    assert_eq!(
        proxy.outcome_count("default", "shed_queue_full").await as u64,
        tally.shed
    );
}
