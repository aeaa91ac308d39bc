//! The soak: minutes at the cap with client aborts and upstream resets mixed in, sampling the proxy's RSS and
//! open file descriptors. Too long for CI: `scripts/soak.sh` runs it (`#[ignore]`d here).
//!
//! `FLOODGATE_SOAK_SECS` sets the length (default 600), `FLOODGATE_SOAK_SEED` the chaos seed.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::chaos::Chaos;
use support::*;

const UP: &str = "default";
const CAP: usize = 8;
const CLIENTS: usize = 64;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count())
}

struct Sample {
    at: Duration,
    rss_kib: u64,
    fds: usize,
    plays: usize,
    client_connections: f64,
    upstream_connections: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes long: run by scripts/soak.sh"]
async fn soak_at_the_cap_with_aborts_and_resets_keeps_memory_and_descriptors_flat() {
    let length = Duration::from_secs(env_u64("FLOODGATE_SOAK_SECS", 600));
    let seed = env_u64("FLOODGATE_SOAK_SEED", 0x50A6);
    let upstream = Upstream::start_with(UpstreamOptions {
        reset_per_mille: 5,
        seed,
        ..Default::default()
    })
    .await;
    let cap = CAP.to_string();
    let proxy = Proxy::start(&[
        "--upstream",
        &upstream.url(),
        "--max-connections",
        &cap,
        "--max-queue",
        "1000",
        "--queue-timeout",
        "10s",
    ])
    .await;
    let baseline_fds = open_fds(proxy.pid());

    let stop = Arc::new(AtomicBool::new(false));
    let plays = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..CLIENTS as u64)
        .map(|worker| {
            let (stop, plays, failures, addr) = (stop.clone(), plays.clone(), failures.clone(), proxy.listen);
            tokio::spawn(async move {
                let mut rng = seed ^ (worker << 32);
                while !stop.load(Ordering::SeqCst) {
                    let chaos = Chaos::pick(&mut rng, 80);
                    let n = plays.fetch_add(1, Ordering::SeqCst);
                    // A 502 is an expected answer here: a reset on a fresh connection, or on a replay, is not
                    // retried again.
                    match chaos.play(addr, n).await {
                        Ok(None) | Ok(Some(StatusCode::OK | StatusCode::BAD_GATEWAY)) => {}
                        Ok(Some(status)) => failures.lock().unwrap().push(format!("{chaos:?}: answered {status}")),
                        Err(e) => failures.lock().unwrap().push(format!("{chaos:?}: {e}")),
                    }
                }
            })
        })
        .collect();

    let started = Instant::now();
    let mut samples = Vec::new();
    let every = Duration::from_secs(10).min(length / 4);
    loop {
        let client_connections = proxy.client_connections().await;
        samples.push(Sample {
            at: started.elapsed(),
            rss_kib: proxy.rss_kib(),
            fds: open_fds(proxy.pid()),
            plays: plays.load(Ordering::SeqCst),
            client_connections,
            upstream_connections: upstream.connections(),
        });
        if started.elapsed() >= length {
            break;
        }
        tokio::time::sleep(every).await;
    }
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }

    upstream.set_reset_per_mille(0);
    proxy.wait_in_use_zero(UP, Duration::from_secs(30)).await;
    wait_until("client connections closed", Duration::from_secs(30), || async {
        proxy.client_connections().await == 0.0
    })
    .await;
    let settled_fds = open_fds(proxy.pid());
    let settled_rss = proxy.rss_kib();

    println!("soak: {length:?}, seed {seed}, cap {CAP}, {CLIENTS} looping chaos clients (80% patient)");
    println!(
        "{:>6} {:>9} {:>5} {:>9} {:>8} {:>8}",
        "t_s", "rss_kib", "fds", "plays", "clients", "up_conns"
    );
    for s in &samples {
        println!(
            "{:>6} {:>9} {:>5} {:>9} {:>8} {:>8}",
            s.at.as_secs(),
            s.rss_kib,
            s.fds,
            s.plays,
            s.client_connections,
            s.upstream_connections
        );
    }
    // Growth is measured from the first sample a quarter into the run (after warm-up) to the last one.
    let warm = &samples[samples.len() / 4];
    let last = samples.last().unwrap();
    let status = proxy.upstream_status(UP).await;
    println!(
        "after warm-up ({}s) to end ({}s): RSS {} -> {} KiB ({:+.1}%), fds {} -> {}; peak RSS {} KiB",
        warm.at.as_secs(),
        last.at.as_secs(),
        warm.rss_kib,
        last.rss_kib,
        (last.rss_kib as f64 - warm.rss_kib as f64) * 100.0 / warm.rss_kib as f64,
        warm.fds,
        last.fds,
        proxy.peak_rss_kib()
    );
    println!(
        "settled: RSS {settled_rss} KiB, fds {settled_fds} (baseline {baseline_fds}); upstream peak {} connections, {} \
         accepted, {} resets; {} requests; /status {status}",
        upstream.peak_connections(),
        upstream.accepted(),
        upstream.resets(),
        upstream.requests(),
    );
    println!(
        "{}",
        proxy
            .metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("floodgate_requests_total") || l.starts_with("floodgate_upstream_retries_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} patient clients not served, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        upstream.peak_connections() <= CAP,
        "upstream peak {}",
        upstream.peak_connections()
    );
    // Once idle: the warm pool's connections and the admin connection this test scrapes over.
    assert!(
        settled_fds <= baseline_fds + CAP + 1,
        "descriptors leak: {settled_fds} open once idle, {baseline_fds} at start"
    );
}
