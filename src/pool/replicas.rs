//! A cap shared by floodgate's replicas: with `replicas` set, `max_connections` (and `max_tunnels`) is the
//! upstream's total across every floodgate in front of it, and this one takes its share, ⌊total / replicas⌋ and at
//! least 1, from a live count of replicas read from an existing source every `interval`: the addresses a DNS name
//! resolves to (a Kubernetes headless Service of floodgate's own pods) or a file. A changed count is put in force as
//! a changed cap is (`limits`): a lowered share closes nothing busy and opens nothing above it. A count that cannot
//! be read keeps the last one; before the first, the share is one connection. It never counts connections itself.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::UpstreamPool;
use crate::config::ReplicaSource;

/// This replica's share of a `total` over `replicas`; 0 replicas: not counted yet, and the least share is taken.
pub(super) fn share(total: usize, replicas: usize) -> usize {
    if total == 0 {
        return 0;
    }
    if replicas == 0 {
        return 1;
    }
    (total / replicas).max(1)
}

/// How many replicas `source` counts now; `None` when it cannot be read (or counts none).
pub async fn count(source: &ReplicaSource) -> Option<usize> {
    let counted = if let Some(name) = &source.dns {
        let addresses = tokio::net::lookup_host((name.as_str(), 0)).await.ok()?;
        addresses.map(|address| address.ip()).collect::<BTreeSet<_>>().len()
    } else {
        let text = tokio::fs::read_to_string(source.file.as_ref()?).await.ok()?;
        let text = text.trim();
        // A number, or one line per replica.
        match text.parse::<usize>() {
            Ok(number) => number,
            Err(_) => text.lines().filter(|line| !line.trim().is_empty()).count(),
        }
    };
    (counted > 0).then_some(counted)
}

impl UpstreamPool {
    /// The replicas this pool's share is taken over (1 without `replicas`).
    pub fn replicas(&self) -> usize {
        self.replicas.load(Ordering::Relaxed)
    }

    /// A new count of replicas (0: not known yet): the share changes in place, as a changed cap.
    pub fn set_replicas(self: &Arc<Self>, replicas: usize) {
        if self.replicas.swap(replicas, Ordering::AcqRel) != replicas {
            tracing::info!(upstream = %self.name, replicas, "replica count changed; this replica's share follows");
            self.change_limits(|limits| limits.clone());
        }
    }

    /// Reads the count once now (start-up waits for it, so that a replica never serves with the whole total), then
    /// keeps reading it every `interval` while the pool exists and `replicas` stays set.
    pub async fn count_replicas(self: &Arc<Self>) {
        let Some(source) = self.limits().replicas.clone() else {
            return;
        };
        // The watch first: a count given up on (start-up waits for it only so long) is taken again in time.
        let first = !self.replica_watch.swap(true, Ordering::AcqRel);
        if first {
            self.spawn(watch(Arc::downgrade(self)));
        }
        match count(&source).await {
            Some(replicas) => self.set_replicas(replicas),
            // Until a count comes the pool keeps the count it started from: the one before a reload, or none
            // (the least share, one connection), never the whole total.
            None if first => {
                tracing::warn!(upstream = %self.name, ?source, "cannot count the replicas; keeping the last count (one connection before any)");
            }
            None => {}
        }
    }
}

async fn watch(pool: Weak<UpstreamPool>) {
    loop {
        let Some(source) = pool.upgrade().and_then(|pool| pool.limits().replicas.clone()) else {
            if let Some(pool) = pool.upgrade() {
                // `replicas` was taken out by a reload: the total is this replica's alone again.
                pool.replica_watch.store(false, Ordering::Release);
                pool.set_replicas(1);
            }
            return;
        };
        tokio::time::sleep(source.interval).await;
        let counted = count(&source).await;
        let Some(pool) = pool.upgrade() else { return };
        if pool.is_retired() {
            return;
        }
        if let Some(replicas) = counted {
            pool.set_replicas(replicas);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{count, share};
    use crate::config::ReplicaSource;

    #[tokio::test]
    async fn a_dns_name_counts_its_distinct_addresses_and_a_name_that_does_not_resolve_counts_nothing() {
        let source = |name: &str| ReplicaSource {
            dns: Some(name.to_string()),
            file: None,
            interval: std::time::Duration::from_secs(1),
        };
        assert!(count(&source("localhost")).await.is_some_and(|n| (1..=2).contains(&n)));
        assert_eq!(count(&source("no-such-replicas.invalid")).await, None);
    }

    #[test]
    fn each_replica_takes_its_share_of_the_total_and_never_none() {
        assert_eq!(share(64, 1), 64);
        assert_eq!(share(64, 3), 21);
        assert_eq!(share(64, 64), 1);
        assert_eq!(share(8, 20), 1, "more replicas than the total: each still takes one");
        assert_eq!(share(8, 0), 1, "not counted yet: the least share");
        assert!(
            (1..=64).all(|n| share(64, n) * n <= 64),
            "the shares never add up past the total"
        );
    }
}
