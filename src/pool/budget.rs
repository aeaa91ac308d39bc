//! The clients' retry budget (`retry_budget`): retries admitted only while first attempts have earned them, so a
//! storm of clients retrying every shed answer cannot multiply the load on an upstream already at its cap. A
//! bucket of retry tokens: each first attempt adds `ratio`, time adds `min_per_second`, and it holds ten seconds
//! of the latter (1,000 tokens at least); while the queue is at least half full, retries are shed first. It never
//! admits or sheds itself: admission asks it.

use std::sync::Mutex;

use tokio::time::Instant;

use super::UpstreamPool;
use crate::config::RetryBudget;

/// The bucket's balance and when time last added to it.
pub(super) struct RetryTokens(Mutex<Option<(f64, Instant)>>);

impl RetryTokens {
    pub(super) fn new() -> RetryTokens {
        RetryTokens(Mutex::new(None))
    }
}

impl UpstreamPool {
    /// Whether a request that `budget` takes for a retry may go on (and spends a token; never while the queue is
    /// at least half full), or a first attempt (which earns one's `ratio`). Without a budget, every request may.
    pub fn retry_budget_allows(&self, headers: &http::HeaderMap) -> bool {
        let limits = self.limits();
        let Some(budget) = limits.retry_budget.as_ref() else {
            return true;
        };
        let retry = budget.headers.iter().any(|name| headers.contains_key(name.as_str()));
        // Under pressure (the queue at least half full) a retry is shed before any first attempt is: the other
        // half stays for first attempts, and a token is not spent on a wait likely to end in a timeout.
        let pressed = retry && limits.max_queue > 0 && self.lock().queue.len().saturating_mul(2) >= limits.max_queue;
        let allowed = !pressed && self.retry_tokens.spend(budget, retry);
        if !allowed {
            self.metrics.retries_over_budget.inc();
        }
        allowed
    }
}

impl RetryTokens {
    /// The balance now, as time has filled it (without spending or earning).
    pub(super) fn balance(&self, budget: &RetryBudget) -> f64 {
        let per_second = f64::from(budget.min_per_second);
        let most = (10.0 * per_second).max(1000.0);
        let bucket = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match *bucket {
            None => per_second,
            Some((balance, since)) => {
                (balance + Instant::now().saturating_duration_since(since).as_secs_f64() * per_second).min(most)
            }
        }
    }

    fn spend(&self, budget: &RetryBudget, retry: bool) -> bool {
        let now = Instant::now();
        let per_second = f64::from(budget.min_per_second);
        let most = (10.0 * per_second).max(1000.0);
        let mut bucket = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // A new budget starts with a second's worth.
        let (balance, since) = bucket.get_or_insert((per_second, now));
        *balance = (*balance + now.saturating_duration_since(*since).as_secs_f64() * per_second).min(most);
        *since = now;
        if !retry {
            *balance = (*balance + budget.ratio).min(most);
            return true;
        }
        if *balance >= 1.0 {
            *balance -= 1.0;
            true
        } else {
            false
        }
    }
}
