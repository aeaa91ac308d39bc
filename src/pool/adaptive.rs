//! The adaptive concurrency limit of one upstream: how many requests may be in flight at it, moved between
//! `min_connections` and `max_connections` by a gradient of response times (after Netflix's concurrency-limits;
//! the formula and the baseline probe are in `docs/concepts.md`).
//!
//! Owns the estimate and its inputs (the window's samples, taken with atomics; the short and baseline response
//! times; the probe). It never grants or refuses: it hands the number in force to the pool, and never takes its
//! own lock while the pool holds the pool's.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{AdaptiveLimit, UpstreamConfig};
use crate::status::AdaptiveSnapshot;

/// The gradient never cuts the limit by more than half in one window.
const MIN_GRADIENT: f64 = 0.5;
/// A probe that has not seen a clean window after this many gives up and takes the lowest mean it saw.
const MAX_PROBE_WINDOWS: u32 = 20;

/// The estimate's settings, read from the upstream's configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Params {
    pub on: bool,
    pub min: usize,
    pub max: usize,
    pub window: Duration,
    pub tolerance: f64,
    pub smoothing: f64,
    pub probe_interval: Duration,
}

impl Params {
    pub(super) fn of(limits: &UpstreamConfig) -> Params {
        let max = limits.max_connections.max(1);
        Params {
            on: limits.adaptive_limit == AdaptiveLimit::Gradient,
            // A cap lowered below min_connections (the admin API) wins: the cap is the hard bound.
            min: limits.min_connections.clamp(1, max),
            max,
            window: limits.adaptive_window,
            tolerance: limits.adaptive_tolerance,
            smoothing: limits.adaptive_smoothing,
            probe_interval: limits.adaptive_probe_interval,
        }
    }
}

struct Probe {
    limit: usize,
    windows: u32,
    lowest: Option<f64>,
}

struct Estimate {
    params: Params,
    limit: f64,
    short: Option<f64>,
    baseline: Option<f64>,
    gradient: f64,
    probe: Option<Probe>,
    next_probe: Instant,
}

impl Estimate {
    fn new(params: Params, now: Instant) -> Estimate {
        Estimate {
            params,
            // From the bottom, as a slow start: the first windows measure the baseline at low concurrency.
            limit: params.min as f64,
            short: None,
            baseline: None,
            gradient: 1.0,
            probe: None,
            next_probe: now + params.probe_interval,
        }
    }

    /// The number in force: the estimate rounded down, or the probe's while probing.
    fn in_force(&self) -> usize {
        if !self.params.on {
            return usize::MAX;
        }
        match &self.probe {
            Some(probe) => probe.limit,
            None => (self.limit.floor() as usize).clamp(self.params.min, self.params.max),
        }
    }

    /// One window closed with `count` responses averaging `mean` seconds, at most `most_in_flight` in flight at a
    /// dispatch.
    fn window(&mut self, mean: f64, most_in_flight: usize, now: Instant) {
        self.short = Some(mean);
        if let Some(probe) = &mut self.probe {
            probe.windows += 1;
            probe.lowest = Some(probe.lowest.map_or(mean, |lowest| lowest.min(mean)));
            let clean = most_in_flight <= probe.limit;
            if clean || probe.windows >= MAX_PROBE_WINDOWS {
                self.baseline = if clean { Some(mean) } else { probe.lowest };
                self.probe = None;
                self.next_probe = now + self.params.probe_interval;
            }
            return;
        }
        let baseline = self.baseline.map_or(mean, |baseline| baseline.min(mean));
        self.baseline = Some(baseline);
        let p = self.params;
        let gradient = (p.tolerance * baseline / mean.max(f64::MIN_POSITIVE)).clamp(MIN_GRADIENT, 1.0);
        self.gradient = gradient;
        let target = self.limit * gradient + self.limit.sqrt();
        let app_limited = (most_in_flight as f64) < self.limit / 2.0;
        if !(app_limited && target > self.limit) {
            let smoothed = (1.0 - p.smoothing) * self.limit + p.smoothing * target;
            self.limit = smoothed.clamp(p.min as f64, p.max as f64);
        }
        if now >= self.next_probe {
            let limit = ((self.limit / (2.0 * p.tolerance)).floor() as usize).clamp(p.min, p.max);
            self.probe = Some(Probe {
                limit,
                windows: 0,
                lowest: None,
            });
        }
    }

    fn reconfigure(&mut self, params: Params, now: Instant) {
        if params.on && !self.params.on {
            *self = Estimate::new(params, now);
            return;
        }
        if params.probe_interval != self.params.probe_interval {
            self.next_probe = now + params.probe_interval;
        }
        self.params = params;
        self.limit = self.limit.clamp(params.min as f64, params.max as f64);
        if let Some(probe) = &mut self.probe {
            probe.limit = probe.limit.clamp(params.min, params.max);
        }
    }

    fn snapshot(&self) -> AdaptiveSnapshot {
        AdaptiveSnapshot {
            limit: self.in_force(),
            estimate: self.limit,
            rtt_short_seconds: self.short.unwrap_or(0.0),
            rtt_baseline_seconds: self.baseline.unwrap_or(0.0),
            gradient: self.gradient,
            probing: self.probe.is_some(),
        }
    }
}

/// One upstream's adaptive limit: samples in atomics, the estimate under its own small lock.
pub(super) struct Adaptive {
    on: AtomicBool,
    epoch: Instant,
    sum_us: AtomicU64,
    count: AtomicU64,
    most_in_flight: AtomicUsize,
    /// Microseconds since `epoch` at which the window in progress closes (at its first response after that).
    window_end_us: AtomicU64,
    estimate: Mutex<Estimate>,
}

impl Adaptive {
    pub(super) fn new(params: Params) -> Adaptive {
        let epoch = Instant::now();
        Adaptive {
            on: AtomicBool::new(params.on),
            epoch,
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
            most_in_flight: AtomicUsize::new(0),
            window_end_us: AtomicU64::new(micros(params.window)),
            estimate: Mutex::new(Estimate::new(params, epoch)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Estimate> {
        // Every update of the estimate is a few assignments of plain numbers; a panic cannot leave it unusable.
        self.estimate.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The number in force now (`usize::MAX` when off).
    pub(super) fn in_force(&self) -> usize {
        self.lock().in_force()
    }

    /// Whether the limit adapts now; read without a lock.
    pub(super) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(super) fn snapshot(&self) -> Option<AdaptiveSnapshot> {
        let estimate = self.lock();
        estimate.params.on.then(|| estimate.snapshot())
    }

    /// A response head arrived `took` after dispatch, with `in_flight` requests in flight at the dispatch. When it
    /// closes a window, `apply` is called with the number now in force, still under the estimate's lock so that
    /// two windows closing in turn cannot put their numbers in force in the other order.
    pub(super) fn observe(&self, in_flight: usize, took: Duration, apply: impl FnOnce(usize)) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        self.sum_us.fetch_add(micros(took), Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.most_in_flight.fetch_max(in_flight, Ordering::Relaxed);
        let now = Instant::now();
        let now_us = micros(now.saturating_duration_since(self.epoch));
        if now_us < self.window_end_us.load(Ordering::Relaxed) {
            return;
        }
        // Whoever holds the lock is closing this window already.
        let Ok(mut estimate) = self.estimate.try_lock() else {
            return;
        };
        if now_us < self.window_end_us.load(Ordering::Relaxed) || !estimate.params.on {
            return;
        }
        self.window_end_us
            .store(now_us.saturating_add(micros(estimate.params.window)), Ordering::Relaxed);
        let count = self.count.swap(0, Ordering::Relaxed);
        let sum_us = self.sum_us.swap(0, Ordering::Relaxed);
        let most_in_flight = self.most_in_flight.swap(0, Ordering::Relaxed);
        if count == 0 {
            return;
        }
        let mean = sum_us as f64 / count as f64 / 1e6;
        estimate.window(mean, most_in_flight, now);
        apply(estimate.in_force());
    }

    /// New settings from a reload or the admin API; `apply` gets the number in force, when it changed, under the
    /// estimate's lock. Turned on, the estimate starts again from `min_connections`; turned off, the number is
    /// `usize::MAX`.
    pub(super) fn reconfigure(&self, params: Params, apply: impl FnOnce(usize)) {
        let mut estimate = self.lock();
        let before = estimate.in_force();
        let now = Instant::now();
        let turned_on = params.on && !estimate.params.on;
        estimate.reconfigure(params, now);
        if turned_on {
            self.count.store(0, Ordering::Relaxed);
            self.sum_us.store(0, Ordering::Relaxed);
            self.most_in_flight.store(0, Ordering::Relaxed);
            let end = now.saturating_duration_since(self.epoch) + params.window;
            self.window_end_us.store(micros(end), Ordering::Relaxed);
        }
        self.on.store(params.on, Ordering::Relaxed);
        let after = estimate.in_force();
        if turned_on || after != before {
            apply(after);
        }
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    //! The estimate fed synthetic windows: what it does with a flat latency, with a knee, and within its bounds.

    use super::*;

    fn params(min: usize, max: usize) -> Params {
        Params {
            on: true,
            min,
            max,
            window: Duration::from_millis(100),
            tolerance: 1.5,
            smoothing: 0.2,
            probe_interval: Duration::from_secs(30),
        }
    }

    /// Response time of an upstream that serves `knee` requests at once in `base` seconds and slows in
    /// proportion above that.
    fn knee_rtt(in_flight: usize, knee: usize, base: f64) -> f64 {
        base * (in_flight.max(knee) as f64 / knee as f64)
    }

    /// Runs `windows` windows with the queue always full: as many in flight as the number in force.
    fn run(estimate: &mut Estimate, now: &mut Instant, windows: usize, rtt: impl Fn(usize) -> f64) -> Vec<usize> {
        let mut seen = Vec::new();
        for _ in 0..windows {
            *now += Duration::from_millis(100);
            let in_flight = estimate.in_force();
            estimate.window(rtt(in_flight), in_flight, *now);
            seen.push(estimate.in_force());
        }
        seen
    }

    #[test]
    fn a_flat_response_time_lets_the_limit_grow_to_the_cap() {
        let now = &mut Instant::now();
        let mut estimate = Estimate::new(params(1, 64), *now);
        let seen = run(&mut estimate, now, 200, |_| 0.020);
        assert_eq!(seen.last(), Some(&64), "{seen:?}");
        assert!(
            seen.windows(2).all(|w| w[1] >= w[0]),
            "fell with nothing slowing: {seen:?}"
        );
    }

    #[test]
    fn a_response_time_rising_past_a_knee_holds_the_limit_near_the_knee() {
        for knee in [4, 8, 16] {
            let now = &mut Instant::now();
            let mut estimate = Estimate::new(params(1, 64), *now);
            // 250 windows: 25 s, before the first probe.
            let seen = run(&mut estimate, now, 250, |in_flight| knee_rtt(in_flight, knee, 0.020));
            let settled = &seen[100..];
            let (low, high) = (*settled.iter().min().unwrap_or(&0), *settled.iter().max().unwrap_or(&0));
            // Fixed point of limit = 1.5 × knee + √limit, within rounding.
            assert!(low >= knee, "knee {knee}: fell to {low}: {settled:?}");
            assert!(high <= 2 * knee + 4, "knee {knee}: rose to {high}: {settled:?}");
        }
    }

    #[test]
    fn a_limit_that_started_above_the_knee_comes_down_to_it() {
        let now = &mut Instant::now();
        let mut estimate = Estimate::new(params(1, 64), *now);
        // The baseline learnt at low concurrency, then the estimate pushed to the cap by a flat latency.
        run(&mut estimate, now, 200, |_| 0.020);
        assert_eq!(estimate.in_force(), 64);
        let seen = run(&mut estimate, now, 80, |in_flight| knee_rtt(in_flight, 4, 0.020));
        let last = seen.last().copied().unwrap_or(0);
        assert!((4..=12).contains(&last), "ended at {last}: {seen:?}");
    }

    #[test]
    fn the_limit_stays_within_min_and_max_whatever_the_samples() {
        let now = &mut Instant::now();
        let mut estimate = Estimate::new(params(3, 10), *now);
        let mut rng: u64 = 0x5eed;
        for _ in 0..2000 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let rtt = 0.0001 + (rng >> 40) as f64 / (1u64 << 24) as f64;
            let in_flight = (rng >> 20) as usize % 20;
            *now += Duration::from_millis(100);
            estimate.window(rtt, in_flight, *now);
            let limit = estimate.in_force();
            assert!((3..=10).contains(&limit), "{limit}");
            assert!((3.0..=10.0).contains(&estimate.limit), "{}", estimate.limit);
        }
    }

    #[test]
    fn a_window_with_few_in_flight_does_not_raise_the_limit() {
        let now = &mut Instant::now();
        let mut estimate = Estimate::new(params(1, 64), *now);
        run(&mut estimate, now, 50, |_| 0.020);
        let before = estimate.limit;
        for _ in 0..50 {
            *now += Duration::from_millis(100);
            estimate.window(0.020, 1, *now);
        }
        assert_eq!(estimate.limit, before);
    }

    #[test]
    fn a_probe_drops_the_limit_until_a_clean_window_and_learns_a_slower_baseline() {
        let mut p = params(1, 64);
        p.probe_interval = Duration::from_secs(5);
        let now = &mut Instant::now();
        let mut estimate = Estimate::new(p, *now);
        run(&mut estimate, now, 45, |in_flight| knee_rtt(in_flight, 8, 0.010));
        let before = estimate.in_force();
        // The upstream becomes twice as slow at every concurrency: without a new baseline the limit would sink.
        let slower = |in_flight| knee_rtt(in_flight, 8, 0.020);
        let seen = run(&mut estimate, now, 20, slower);
        assert!(
            seen.iter().any(|&limit| limit <= before / 2),
            "no probe below {before}: {seen:?}"
        );
        assert_eq!(estimate.baseline, Some(0.020));
        let seen = run(&mut estimate, now, 100, slower);
        let last = seen.last().copied().unwrap_or(0);
        assert!((8..=20).contains(&last), "ended at {last}: {seen:?}");
    }

    #[test]
    fn turned_off_nothing_is_limited_and_turned_on_again_it_starts_from_the_minimum() {
        let adaptive = Adaptive::new(params(2, 16));
        assert_eq!(adaptive.in_force(), 2);
        let mut applied = Vec::new();
        adaptive.reconfigure(
            Params {
                on: false,
                ..params(2, 16)
            },
            |n| applied.push(n),
        );
        adaptive.reconfigure(
            Params {
                on: false,
                ..params(2, 8)
            },
            |n| applied.push(n),
        );
        adaptive.reconfigure(params(3, 16), |n| applied.push(n));
        assert_eq!(
            applied,
            vec![usize::MAX, 3],
            "a change that leaves the number alone applies nothing"
        );
        assert!(adaptive.snapshot().is_some());
    }
}
