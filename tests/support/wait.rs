//! Polling helpers: wait for a condition with a deadline (tests never sleep to synchronise).

use super::*;

/// Polls `cond` every 10 ms until it returns true; panics naming `what` when
/// `timeout` passes first.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`wait_until`] with a synchronous condition.
pub async fn wait_until_sync(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    wait_until(what, timeout, || std::future::ready(cond())).await
}

/// Polls `value` until it has not changed for `settle`; returns the settled
/// value. Panics when it keeps changing past `timeout`.
pub async fn wait_until_stable(what: &str, timeout: Duration, settle: Duration, mut value: impl FnMut() -> u64) -> u64 {
    let deadline = Instant::now() + timeout;
    let mut last = value();
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = value();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= settle {
            return now;
        }
        if Instant::now() >= deadline {
            panic!("{what} kept changing for {timeout:?} (last value {now})");
        }
    }
}
