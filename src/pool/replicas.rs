//! A cap shared by floodgate's replicas: with `replicas` set, `max_connections` (and `max_tunnels`) is the
//! upstream's total across every floodgate in front of it, and this one takes its share, ⌊total / replicas⌋ and at
//! least 1, from a live count of replicas read from an existing source every `interval`: the addresses a DNS name
//! resolves to (a Kubernetes headless Service of floodgate's own pods) or a file. A changed count is put in force as
//! a changed cap is (`limits`): a lowered share closes nothing busy and opens nothing above it. A count file is read
//! strictly and no further than [`MAX_COUNT_BYTES`]: one number from 1 to [`MAX_REPLICAS`], or one IP address per
//! line. A count that cannot be read or is no count keeps the last one (before the first, the share is one
//! connection), never the whole total; each such read is counted by its reason, and logged once per change of
//! what is wrong. It never counts connections itself.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tokio::io::AsyncReadExt;

use super::UpstreamPool;
use crate::config::ReplicaSource;

/// The most replicas a count may say: a larger number is a typo or garbage, not a tier of floodgates (and past the
/// total every replica takes one connection anyway).
pub(super) const MAX_REPLICAS: usize = 10_000;

/// The most bytes of a count file read: a number takes a few, a list of addresses a line each. A longer file is
/// refused rather than cut short, since a list cut short would count fewer replicas and widen the share.
pub(super) const MAX_COUNT_BYTES: u64 = 64 * 1024;

/// Why a count was not taken; the count in force stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Uncounted {
    /// The file is missing or cannot be opened or read, or the DNS name does not resolve.
    #[error("the source cannot be read ({0})")]
    Unreadable(std::io::ErrorKind),
    #[error("the file is a directory, a device or a socket, not a file a count can be read from")]
    NotAFile,
    #[error("the file is longer than {MAX_COUNT_BYTES} bytes")]
    TooLong,
    #[error("the file holds neither one number nor one IP address per line")]
    NotACount,
    #[error("the count is not from 1 to {MAX_REPLICAS}")]
    OutOfRange,
}

impl Uncounted {
    /// Every reason's word, as the metrics label them.
    pub(super) const REASONS: [&'static str; 5] =
        ["unreadable", "not_a_file", "too_long", "not_a_count", "out_of_range"];

    /// This reason's word in `floodgate_replica_counts_refused_total`.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Uncounted::Unreadable(_) => "unreadable",
            Uncounted::NotAFile => "not_a_file",
            Uncounted::TooLong => "too_long",
            Uncounted::NotACount => "not_a_count",
            Uncounted::OutOfRange => "out_of_range",
        }
    }
}

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

/// How many replicas `source` counts now, or why no count can be taken from it.
pub(super) async fn count(source: &ReplicaSource) -> Result<usize, Uncounted> {
    if let Some(name) = &source.dns {
        let addresses = tokio::net::lookup_host((name.as_str(), 0))
            .await
            .map_err(|err| Uncounted::Unreadable(err.kind()))?;
        let counted = addresses.map(|address| address.ip()).collect::<BTreeSet<_>>().len();
        return in_range(counted);
    }
    match &source.file {
        Some(file) => read_count(file).await,
        None => Err(Uncounted::Unreadable(std::io::ErrorKind::NotFound)),
    }
}

/// Reads a count file: its type first (opening a device may block or never end), then at most one byte past
/// [`MAX_COUNT_BYTES`], so a file of any size costs no more than that.
async fn read_count(file: &Path) -> Result<usize, Uncounted> {
    let unreadable = |err: std::io::Error| Uncounted::Unreadable(err.kind());
    let metadata = tokio::fs::metadata(file).await.map_err(unreadable)?;
    if !ReplicaSource::can_hold_count(metadata.file_type()) {
        return Err(Uncounted::NotAFile);
    }
    let mut bytes = Vec::new();
    tokio::fs::File::open(file)
        .await
        .map_err(unreadable)?
        .take(MAX_COUNT_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(unreadable)?;
    if bytes.len() as u64 > MAX_COUNT_BYTES {
        return Err(Uncounted::TooLong);
    }
    parse_count(&bytes)
}

/// The replicas a count file's `bytes` say: one number in ASCII digits, or one IP address per line (each replica's,
/// the distinct ones counted, as the DNS source counts them), with whitespace around them and nothing else.
pub(super) fn parse_count(bytes: &[u8]) -> Result<usize, Uncounted> {
    let text = std::str::from_utf8(bytes).map_err(|_| Uncounted::NotACount)?;
    let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // Digits alone: a number, or one past usize, which is out of range as much as 10001 is.
        return text.parse::<usize>().map_or(Err(Uncounted::OutOfRange), in_range);
    }
    let mut addresses = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim_matches(|c: char| c.is_ascii_whitespace());
        if line.is_empty() {
            continue;
        }
        addresses.insert(line.parse::<IpAddr>().map_err(|_| Uncounted::NotACount)?);
    }
    match addresses.len() {
        0 => Err(Uncounted::NotACount),
        counted => in_range(counted),
    }
}

fn in_range(counted: usize) -> Result<usize, Uncounted> {
    if (1..=MAX_REPLICAS).contains(&counted) {
        Ok(counted)
    } else {
        Err(Uncounted::OutOfRange)
    }
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
        if !self.replica_watch.swap(true, Ordering::AcqRel) {
            self.metrics.replica_counts_known(Uncounted::REASONS);
            self.spawn(watch(Arc::downgrade(self)));
        }
        self.counted(&source, count(&source).await);
    }

    /// Puts a count read from `source` in force, or keeps the one in force (until a count comes: the one before a
    /// reload, or none, the least share) and says why: in the metrics each time, in the log once per change of
    /// what is wrong, so a source that stays broken writes one line, not one an `interval`.
    fn counted(self: &Arc<Self>, source: &ReplicaSource, counted: Result<usize, Uncounted>) {
        let mut refused = self
            .replica_count_refused
            .lock()
            // Only ever replaced whole; a panic elsewhere cannot leave it half-changed.
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match counted {
            Ok(replicas) => {
                if refused.take().is_some() {
                    tracing::info!(upstream = %self.name, ?source, replicas, "replica count can be read again");
                }
                drop(refused);
                self.set_replicas(replicas);
            }
            Err(why) => {
                self.metrics.replica_count_refused(why.reason());
                if refused.replace(why) != Some(why) {
                    tracing::warn!(
                        upstream = %self.name,
                        ?source,
                        reason = why.reason(),
                        replicas = self.replicas(),
                        "cannot take the replica count: {why}; keeping the count in force until one can be read \
                         (replicas=0: none yet, a share of one connection)"
                    );
                }
            }
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
        pool.counted(&source, counted);
    }
}

#[cfg(test)]
mod tests {
    use super::{count, parse_count, share, Uncounted, MAX_REPLICAS};
    use crate::config::ReplicaSource;

    #[tokio::test]
    async fn a_dns_name_counts_its_distinct_addresses_and_a_name_that_does_not_resolve_counts_nothing() {
        let source = |name: &str| ReplicaSource {
            dns: Some(name.to_string()),
            file: None,
            interval: std::time::Duration::from_secs(1),
        };
        assert!(count(&source("localhost")).await.is_ok_and(|n| (1..=2).contains(&n)));
        assert!(matches!(
            count(&source("no-such-replicas.invalid")).await,
            Err(Uncounted::Unreadable(_))
        ));
    }

    #[test]
    fn a_count_is_one_number_or_one_address_per_line_and_anything_else_is_refused() {
        assert_eq!(parse_count(b"4"), Ok(4));
        assert_eq!(parse_count(b" 4\r\n"), Ok(4), "whitespace around the number");
        assert_eq!(parse_count(b"10.0.0.1\n10.0.0.2\n\n::1\n"), Ok(3));
        assert_eq!(
            parse_count(b"10.0.0.1\n10.0.0.1\n"),
            Ok(1),
            "an address listed twice is one replica"
        );
        for not_a_count in [
            &b"abc"[..],
            b"-1",
            b"+4",
            b"4.0",
            b"1e3",
            b"4 replicas",
            b"0x10",
            b"\0",
            b"4\0",
            b"",
            b" \n",
            b"10.0.0.1\nabc\n",
            b"\xff",
        ] {
            assert_eq!(parse_count(not_a_count), Err(Uncounted::NotACount), "{not_a_count:?}");
        }
        let past_usize = format!("{}0", usize::MAX);
        let past_bound = (MAX_REPLICAS + 1).to_string();
        for out_of_range in ["0", "000", &past_usize, &past_bound] {
            assert_eq!(
                parse_count(out_of_range.as_bytes()),
                Err(Uncounted::OutOfRange),
                "{out_of_range}"
            );
        }
        assert_eq!(parse_count(MAX_REPLICAS.to_string().as_bytes()), Ok(MAX_REPLICAS));
    }

    #[tokio::test]
    async fn a_count_file_is_read_no_further_than_its_bound_and_never_from_a_directory_or_a_device() {
        let source = |file: &std::path::Path| ReplicaSource {
            dns: None,
            file: Some(file.to_path_buf()),
            interval: std::time::Duration::from_secs(1),
        };
        let dir = std::env::temp_dir().join(format!("floodgate-replicas-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let long = dir.join("long");
        std::fs::write(&long, vec![b'1'; super::MAX_COUNT_BYTES as usize + 1]).unwrap();
        assert_eq!(count(&source(&long)).await, Err(Uncounted::TooLong));
        let padded = dir.join("padded");
        let mut text = b"3".to_vec();
        text.resize(super::MAX_COUNT_BYTES as usize, b'\n');
        std::fs::write(&padded, text).unwrap();
        assert_eq!(count(&source(&padded)).await, Ok(3), "exactly the bound is read");
        assert_eq!(count(&source(&dir)).await, Err(Uncounted::NotAFile));
        assert_eq!(
            count(&source(std::path::Path::new("/dev/zero"))).await,
            Err(Uncounted::NotAFile)
        );
        assert_eq!(
            count(&source(&dir.join("missing"))).await,
            Err(Uncounted::Unreadable(std::io::ErrorKind::NotFound))
        );
        let _ = std::fs::remove_dir_all(&dir);
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
