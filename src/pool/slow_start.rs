//! Slow start (`slow_start`): an endpoint new to the pool (every one when floodgate starts, the ones a reload adds)
//! or back from an ejection begins with a small cap in force and earns its own by its response times: the cap
//! doubles after each window whose mean stays within `tolerance` of the lowest window mean its ramp has seen, holds
//! past that and halves past twice that. Time alone never raises it (a window needs its `min_samples` answers), but
//! `max_duration` ends a ramp whatever the times say, so an upstream slower at any concurrency than alone is not
//! held below its cap for ever. It owns each ramp's measure and step; [`super::slots::Slots`] bounds the endpoint by
//! the ramp's cap. It never counts connections.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{PoolState, UpstreamPool};
use crate::config::SlowStart;
use crate::status::RampSnapshot;

/// One endpoint's ramp; only under the pool's lock.
#[derive(Debug, Clone)]
pub(super) struct Ramp {
    /// The connections the endpoint may have now.
    cap: usize,
    began: Instant,
    window_began: Instant,
    total: Duration,
    samples: u32,
    /// The lowest window mean since the ramp began.
    baseline: Option<Duration>,
    /// The last window's mean.
    last: Option<Duration>,
}

/// What one answer did to a ramp.
#[derive(Debug, PartialEq, Eq)]
enum Judged {
    /// No window closed, or the cap stays.
    Same,
    Moved(usize),
    /// The cap reached the endpoint's own, or `max_duration` passed.
    Over,
}

impl Ramp {
    fn new(settings: &SlowStart, now: Instant) -> Ramp {
        Ramp {
            cap: settings.initial.max(1),
            began: now,
            window_began: now,
            total: Duration::ZERO,
            samples: 0,
            baseline: None,
            last: None,
        }
    }

    /// An answer after `took`, at `now`; `full`: the endpoint's own cap.
    fn observe(&mut self, took: Duration, now: Instant, settings: &SlowStart, full: usize) -> Judged {
        if now.saturating_duration_since(self.began) >= settings.max_duration {
            return Judged::Over;
        }
        self.total = self.total.saturating_add(took);
        self.samples = self.samples.saturating_add(1);
        if now.saturating_duration_since(self.window_began) < settings.window || self.samples < settings.min_samples {
            return Judged::Same;
        }
        let mean = self.total / self.samples.max(1);
        self.window_began = now;
        self.total = Duration::ZERO;
        self.samples = 0;
        self.last = Some(mean);
        let baseline = self.baseline.map_or(mean, |baseline| baseline.min(mean));
        self.baseline = Some(baseline);
        let slower = mean.as_secs_f64() / baseline.as_secs_f64().max(f64::MIN_POSITIVE);
        let cap = if slower <= settings.tolerance {
            self.cap.saturating_mul(2)
        } else if slower > 2.0 * settings.tolerance {
            (self.cap / 2).max(settings.initial.max(1))
        } else {
            self.cap
        };
        if cap >= full {
            return Judged::Over;
        }
        if cap == self.cap {
            return Judged::Same;
        }
        self.cap = cap;
        Judged::Moved(cap)
    }

    pub(super) fn snapshot(&self, now: Instant) -> RampSnapshot {
        RampSnapshot {
            connections: self.cap,
            seconds: now.saturating_duration_since(self.began).as_secs_f64(),
            last_window_seconds: self.last.map_or(0.0, |last| last.as_secs_f64()),
            baseline_seconds: self.baseline.map_or(0.0, |baseline| baseline.as_secs_f64()),
        }
    }
}

impl UpstreamPool {
    /// Starts `endpoint`'s ramp from `initial` (again, if one was under way), if slow start is on; the caller puts
    /// the lowered cap in force.
    pub(super) fn start_ramp(&self, state: &mut PoolState, endpoint: usize) {
        let limits = self.limits();
        let Some(settings) = limits.slow_start.as_ref() else {
            return;
        };
        self.put_ramp(state, endpoint, Some(Ramp::new(settings, Instant::now())));
    }

    /// Gives `endpoint` `ramp` (or none), in [`PoolState`] and in the slots; whether the cap in force rose.
    pub(super) fn put_ramp(&self, state: &mut PoolState, endpoint: usize, ramp: Option<Ramp>) -> bool {
        if ramp
            .as_ref()
            .is_some_and(|ramp| ramp.cap >= state.slots.endpoint_full(endpoint))
        {
            // Its own cap is no more than the ramp's start: nothing to ramp.
            return self.put_ramp(state, endpoint, None);
        }
        let Some(health) = state.endpoints.get_mut(endpoint) else {
            return false;
        };
        let cap = ramp.as_ref().map(|ramp| ramp.cap);
        match (health.ramp.is_some(), cap.is_some()) {
            (false, true) => {
                self.ramps.fetch_add(1, Ordering::AcqRel);
                self.metrics.endpoint_slow_started(&self.endpoint_address(endpoint));
            }
            (true, false) => {
                self.ramps.fetch_sub(1, Ordering::AcqRel);
            }
            _ => {}
        }
        health.ramp = ramp;
        state.slots.set_ramp(endpoint, cap)
    }

    /// The endpoints of a new pool start their ramps: each one the pool it `replaces` had keeps the ramp it had
    /// there (or none), and every other begins one.
    pub(super) fn start_ramps(self: &Arc<Self>, replaces: Option<&UpstreamPool>) {
        if self.limits().slow_start.is_none() {
            return;
        }
        let known: Vec<Option<Option<Ramp>>> = self
            .endpoints
            .load()
            .iter()
            .map(|(origin, _)| replaces.and_then(|old| old.ramp_of(&origin.authority())))
            .collect();
        let mut state = self.lock();
        for (endpoint, known) in known.into_iter().enumerate() {
            match known {
                Some(ramp) => {
                    self.put_ramp(&mut state, endpoint, ramp);
                }
                None => self.start_ramp(&mut state, endpoint),
            }
        }
        self.apply_cap(state, false);
    }

    /// The ramp of the endpoint at `address`, if it is one of this pool's (`Some(None)`: it is, and ramps no more).
    fn ramp_of(&self, address: &str) -> Option<Option<Ramp>> {
        let state = self.lock();
        let at = self.place_of(&state, address)?;
        Some(state.endpoints.get(at)?.ramp.clone())
    }

    /// An answer from `endpoint` after `took`: the ramp's measure, and its step when a window closes. Nothing is
    /// looked at while no endpoint ramps.
    pub(super) fn ramp_answered(self: &Arc<Self>, endpoint: usize, took: Duration) {
        if self.ramps.load(Ordering::Acquire) == 0 {
            return;
        }
        let limits = self.limits();
        let Some(settings) = limits.slow_start.as_ref() else {
            return;
        };
        let mut guard = self.lock();
        let state = &mut *guard;
        let full = state.slots.endpoint_full(endpoint);
        let Some(ramp) = state
            .endpoints
            .get_mut(endpoint)
            .and_then(|health| health.ramp.as_mut())
        else {
            return;
        };
        let raised = match ramp.observe(took, Instant::now(), settings, full) {
            Judged::Same => return,
            Judged::Moved(cap) => {
                tracing::debug!(upstream = %self.name, endpoint = %self.endpoint_address(endpoint), cap,
                    "slow start moved the endpoint's cap in force");
                state.slots.set_ramp(endpoint, Some(cap))
            }
            Judged::Over => {
                tracing::info!(upstream = %self.name, endpoint = %self.endpoint_address(endpoint), full,
                    "slow start over: the endpoint's own cap is in force");
                self.put_ramp(state, endpoint, None)
            }
        };
        self.apply_cap(guard, raised);
    }

    /// Slow start was turned off by a reload: every ramp ends, and the caps they held down rise.
    pub(super) fn end_ramps(self: &Arc<Self>) {
        if self.ramps.load(Ordering::Acquire) == 0 || self.limits().slow_start.is_some() {
            return;
        }
        let mut state = self.lock();
        let mut raised = false;
        for endpoint in 0..state.endpoints.len() {
            raised |= self.put_ramp(&mut state, endpoint, None);
        }
        self.apply_cap(state, raised);
    }

    pub(super) fn endpoint_address(&self, endpoint: usize) -> String {
        self.endpoints
            .load()
            .get(endpoint)
            .map(|(origin, _)| origin.authority())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> SlowStart {
        SlowStart {
            initial: 1,
            window: Duration::from_millis(100),
            tolerance: 1.5,
            min_samples: 2,
            max_duration: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_window_near_the_baseline_doubles_the_cap_and_a_slow_one_holds_or_halves_it() {
        let settings = settings();
        let start = Instant::now();
        let mut ramp = Ramp::new(&settings, start);
        let ms = Duration::from_millis;
        let at = |n: u64| start + ms(n);
        assert_eq!(
            ramp.observe(ms(10), at(50), &settings, 16),
            Judged::Same,
            "the window is open"
        );
        assert_eq!(ramp.observe(ms(10), at(100), &settings, 16), Judged::Moved(2));
        assert_eq!(
            ramp.observe(ms(10), at(300), &settings, 16),
            Judged::Same,
            "one answer is too few"
        );
        assert_eq!(
            ramp.observe(ms(14), at(301), &settings, 16),
            Judged::Moved(4),
            "12 ms: within 1.5x"
        );
        ramp.observe(ms(20), at(400), &settings, 16);
        assert_eq!(ramp.observe(ms(20), at(401), &settings, 16), Judged::Same, "2x: held");
        ramp.observe(ms(40), at(600), &settings, 16);
        assert_eq!(
            ramp.observe(ms(40), at(601), &settings, 16),
            Judged::Moved(2),
            "4x: halved"
        );
        ramp.observe(ms(40), at(800), &settings, 16);
        assert_eq!(ramp.observe(ms(40), at(801), &settings, 16), Judged::Moved(1));
        ramp.observe(ms(40), at(1000), &settings, 16);
        assert_eq!(
            ramp.observe(ms(40), at(1001), &settings, 16),
            Judged::Same,
            "never below initial"
        );
        ramp.observe(ms(10), at(1200), &settings, 2);
        assert_eq!(
            ramp.observe(ms(10), at(1201), &settings, 2),
            Judged::Over,
            "its own cap reached"
        );
    }

    #[test]
    fn a_ramp_ends_at_max_duration_whatever_the_times_say_and_time_alone_moves_nothing() {
        let settings = settings();
        let start = Instant::now();
        let mut ramp = Ramp::new(&settings, start);
        assert_eq!(
            ramp.observe(
                Duration::from_millis(10),
                start + Duration::from_secs(30),
                &settings,
                16
            ),
            Judged::Same,
            "a window of one answer, however long, is not judged"
        );
        assert_eq!(
            ramp.observe(Duration::from_secs(1), start + Duration::from_secs(60), &settings, 16),
            Judged::Over
        );
    }
}
