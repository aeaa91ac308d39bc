//! The endpoint level of the pool's properties: random interleavings of admissions, dials (the endpoint chosen
//! for a slot), releases, failed and successful dials, ejections ending with time, and changes of the cap, each
//! step checked against what must hold: no endpoint ever has more connections than its own cap, the endpoints'
//! counts never add up to more than the pool's, the pool's count never more than the endpoints' caps together,
//! every counted slot finds an endpoint with room, and the cap in force is the configured one bounded by the
//! endpoints not ejected. Health checks take part: each uses a slot within the same caps, only with nobody
//! queued, one per endpoint at a time. No sockets: a chosen endpoint stands for a dial in progress.

use std::future::{pending, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use crate::config::{Origin, Scheme, UpstreamConfig};
use crate::metrics::Metrics;
use crate::pool::{Grant, Lease, Refused, UpstreamPool};

fn origin(port: u16) -> Origin {
    Origin {
        scheme: Scheme::Http,
        host: "127.0.0.1".into(),
        port,
    }
}

fn pool(caps: &[usize], max_connections: usize) -> Arc<UpstreamPool> {
    let limits = UpstreamConfig {
        max_connections,
        max_queue: 100,
        queue_timeout: Duration::from_secs(3600),
        eject_after: 2,
        eject_backoff: Duration::from_millis(100),
        eject_backoff_max: Duration::from_millis(400),
        ..UpstreamConfig::default()
    };
    let endpoints = caps
        .iter()
        .zip(9001u16..)
        .map(|(cap, port)| (origin(port), *cap))
        .collect();
    UpstreamPool::with_endpoints(
        "endpoints",
        endpoints,
        limits,
        None,
        Metrics::new().upstream("endpoints"),
    )
}

/// Lets spawned tasks (waiters, ends of ejections) run.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// What must hold between any two steps.
fn check(pool: &UpstreamPool) -> Result<(), TestCaseError> {
    let state = pool.lock();
    let mut sum_open = 0usize;
    let mut sum_caps = 0usize;
    for (at, (cap, open)) in state.slots.per_endpoint().enumerate() {
        let cap = cap.unwrap_or(usize::MAX);
        prop_assert!(open <= cap, "endpoint {at}: {open} connections, cap {cap}");
        sum_open += open;
        sum_caps = sum_caps.saturating_add(cap);
    }
    let open = state.slots.open();
    prop_assert!(sum_open <= open, "endpoints count {sum_open}, the pool {open}");
    prop_assert!(open <= sum_caps, "{open} slots for endpoints taking {sum_caps}");
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    Admit,
    /// A lease's slot chooses its endpoint (the start of its dial).
    Dial(usize),
    Release(usize),
    DialFailed(usize),
    DialSucceeded(usize),
    AdvanceMs(u64),
    SetCap(usize),
    /// A health check of an endpoint starts, if it may (see [`UpstreamPool::check_grant`]).
    Check(usize),
    /// A health check under way ends, healthy or not, giving back what it used.
    EndCheck(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Admit),
        4 => (0..16usize).prop_map(Op::Dial),
        3 => (0..16usize).prop_map(Op::Release),
        2 => (0..4usize).prop_map(Op::DialFailed),
        1 => (0..4usize).prop_map(Op::DialSucceeded),
        1 => (1..300u64).prop_map(Op::AdvanceMs),
        1 => (1..8usize).prop_map(Op::SetCap),
        2 => (0..4usize).prop_map(Op::Check),
        2 => (0..16usize, any::<bool>()).prop_map(|(which, healthy)| Op::EndCheck(which, healthy)),
    ]
}

type Waiter = Pin<Box<dyn Future<Output = Result<Lease, Refused>>>>;

async fn run(caps: Vec<usize>, max_connections: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let pool = pool(&caps, max_connections);
    let far = tokio::time::Instant::now() + Duration::from_secs(36_000);
    let mut leases: Vec<Lease> = Vec::new();
    let mut checks: Vec<(usize, Grant)> = Vec::new();
    let mut waiters: Vec<tokio::task::JoinHandle<Result<Lease, Refused>>> = Vec::new();
    for op in ops {
        match op {
            Op::Admit => {
                let pool = pool.clone();
                let waiter: Waiter = Box::pin(async move { pool.admit(false, far, pending()).await });
                waiters.push(tokio::task::spawn_local(waiter));
            }
            Op::Dial(which) if !leases.is_empty() => {
                let at = which % leases.len();
                if let Some(lease) = leases.get_mut(at) {
                    // A slot that already chose keeps its endpoint; every counted slot finds one with room.
                    let counted =
                        |pool: &UpstreamPool| pool.lock().slots.per_endpoint().map(|(_, open)| open).sum::<usize>();
                    let before = counted(&pool);
                    let chosen = lease.choose_endpoint();
                    prop_assert!(chosen.is_some(), "a counted slot found no endpoint with room");
                    // An ejected endpoint is newly dialled only when none that is not ejected has room.
                    let fresh = counted(&pool) > before;
                    let state = pool.lock();
                    if fresh && chosen.is_some_and(|at| state.slots.is_ejected(at)) {
                        let slots = &state.slots;
                        prop_assert!(
                            (0..state.endpoints.len()).all(|at| slots.is_ejected(at) || !slots.endpoint_has_room(at)),
                            "an ejected endpoint was dialled while another had room"
                        );
                    }
                }
            }
            Op::Release(which) if !leases.is_empty() => {
                let at = which % leases.len();
                drop(leases.swap_remove(at));
            }
            Op::DialFailed(endpoint) => pool.dialled(endpoint % caps.len(), false),
            Op::DialSucceeded(endpoint) => pool.dialled(endpoint % caps.len(), true),
            Op::AdvanceMs(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
            Op::SetCap(cap) => pool.set_max_connections(cap),
            Op::Check(endpoint) => {
                let endpoint = endpoint % caps.len();
                let queued = pool.snapshot().queue_depth;
                if let Some(grant) = pool.check_grant(endpoint) {
                    prop_assert_eq!(queued, 0, "a check took a slot with requests queued");
                    prop_assert!(
                        !checks.iter().any(|(checked, _)| *checked == endpoint),
                        "two checks of one endpoint at once"
                    );
                    if let Grant::Dial(slot) = &grant {
                        prop_assert_eq!(slot.endpoint, Some(endpoint));
                    }
                    checks.push((endpoint, grant));
                }
            }
            Op::EndCheck(which, healthy) if !checks.is_empty() => {
                let (endpoint, grant) = checks.swap_remove(which % checks.len());
                drop(grant);
                pool.health_checked(endpoint, Some(healthy));
            }
            Op::EndCheck(..) => {}
            Op::Dial(_) | Op::Release(_) => {}
        }
        settle().await;
        let mut still = Vec::new();
        for waiter in waiters {
            if waiter.is_finished() {
                match waiter.await {
                    Ok(Ok(lease)) => leases.push(lease),
                    Ok(Err(refused)) => prop_assert!(false, "a patient waiter was refused: {refused:?}"),
                    Err(err) => prop_assert!(false, "a waiter panicked: {err}"),
                }
            } else {
                still.push(waiter);
            }
        }
        waiters = still;
        check(&pool)?;
    }
    // Every lease ends; the waiters left are served in turn, and then nothing is held anywhere.
    drop(leases);
    for (endpoint, grant) in checks {
        drop(grant);
        pool.health_checked(endpoint, Some(true));
    }
    for waiter in waiters {
        settle().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        match waiter.await {
            Ok(Ok(lease)) => drop(lease),
            Ok(Err(refused)) => prop_assert!(false, "a patient waiter was refused: {refused:?}"),
            Err(err) => prop_assert!(false, "a waiter panicked: {err}"),
        }
        check(&pool)?;
    }
    let state = pool.lock();
    prop_assert_eq!(state.slots.open(), 0);
    prop_assert!(state.slots.per_endpoint().all(|(_, open)| open == 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn endpoints_stay_within_their_own_caps_and_the_pool_within_theirs_and_the_upstream_cap(
        caps in prop::collection::vec(1..4usize, 1..4),
        max_connections in 1..8usize,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime");
        tokio::task::LocalSet::new().block_on(&runtime, run(caps, max_connections, ops))?;
    }
}

#[tokio::test(start_paused = true)]
async fn an_ejection_shrinks_the_cap_in_force_and_its_end_serves_a_waiter_at_once() {
    let pool = pool(&[1, 2], 10);
    assert_eq!(
        pool.snapshot().max_connections,
        3,
        "the endpoints' sum bounds a higher cap"
    );
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut lease = pool
            .admit(false, tokio::time::Instant::now() + Duration::from_secs(60), pending())
            .await
            .unwrap();
        lease.choose_endpoint().unwrap();
        held.push(lease);
    }
    // Two failed dials in a row to endpoint 0 eject it: its cap no longer counts.
    pool.dialled(0, false);
    assert_eq!(pool.snapshot().max_connections, 3, "one failure is not an ejection");
    pool.dialled(0, false);
    let snapshot = pool.snapshot();
    assert_eq!(snapshot.max_connections, 2);
    assert!(snapshot.endpoints[0].ejected);
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move {
            pool.admit(false, tokio::time::Instant::now() + Duration::from_secs(60), pending())
                .await
                .map(|_| ())
        })
    };
    settle().await;
    assert_eq!(pool.snapshot().queue_depth, 1, "admitted above the shrunk cap");
    // The backoff passes: the endpoint is back, the cap with it, and the waiter gets the slot at once.
    tokio::time::advance(Duration::from_millis(100)).await;
    settle().await;
    assert_eq!(pool.snapshot().max_connections, 3);
    assert!(!pool.snapshot().endpoints[0].ejected);
    assert_eq!(waiter.await.unwrap(), Ok(()));
    // On probation: one more failure ejects it again, for twice as long.
    pool.dialled(0, false);
    assert!(pool.snapshot().endpoints[0].ejected);
    tokio::time::advance(Duration::from_millis(150)).await;
    settle().await;
    assert!(pool.snapshot().endpoints[0].ejected, "the second ejection lasts 200ms");
    tokio::time::advance(Duration::from_millis(60)).await;
    settle().await;
    assert!(!pool.snapshot().endpoints[0].ejected);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_slot_dials_the_endpoint_with_room_and_fewest_failures_then_fewest_in_flight() {
    let pool = pool(&[1, 3], 10);
    let far = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut chosen = Vec::new();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut lease = pool.admit(false, far, pending()).await.unwrap();
        chosen.push(lease.choose_endpoint().unwrap());
        held.push(lease);
    }
    // Fewest in flight first (ties to the first listed), each within its own cap.
    assert_eq!(chosen, vec![0, 1, 1, 1]);
    drop(held);
    pool.dialled(0, false);
    let mut lease = pool.admit(false, far, pending()).await.unwrap();
    assert_eq!(lease.choose_endpoint(), Some(1), "a failed dial ranks an endpoint last");
}

#[tokio::test(start_paused = true)]
async fn when_every_endpoint_is_ejected_all_count_again() {
    let pool = pool(&[1, 2], 10);
    for endpoint in [0, 1] {
        pool.dialled(endpoint, false);
        pool.dialled(endpoint, false);
    }
    let snapshot = pool.snapshot();
    assert!(snapshot.endpoints.iter().all(|endpoint| endpoint.ejected));
    assert_eq!(
        snapshot.max_connections, 3,
        "shedding everything would be worse than trying"
    );
}
