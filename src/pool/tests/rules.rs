//! The slot and queue rules without a network: no lease here ever dials, so every grant is a slot.

use std::future::{pending, Future};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{advance, Instant as TokioInstant};

use crate::admission::Shed;
use crate::config::Scheme;
use crate::config::{Origin, UpstreamConfig};
use crate::metrics::Metrics;
use crate::pool::*;

fn pool(max_connections: usize, max_queue: usize) -> Arc<UpstreamPool> {
    let limits = UpstreamConfig {
        url: "127.0.0.1:9".into(),
        max_connections,
        max_queue,
        queue_timeout: Duration::from_secs(5),
        ..UpstreamConfig::default()
    };
    let origin = Origin {
        scheme: Scheme::Http,
        host: "127.0.0.1".into(),
        port: 9,
    };
    UpstreamPool::new("test", origin, limits, None, Metrics::new().upstream("test"))
}

fn far() -> TokioInstant {
    TokioInstant::now() + Duration::from_secs(3600)
}

/// Lets spawned waiters run until they are parked in the queue.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn slots_past_the_cap_wait_and_are_handed_over_oldest_first() {
    let pool = pool(2, 10);
    let first = pool.admit(false, far(), pending()).await.unwrap();
    let second = pool.admit(false, far(), pending()).await.unwrap();
    let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
    for waiter in 0..3 {
        let (pool, order_tx) = (pool.clone(), order_tx.clone());
        tokio::spawn(async move {
            let lease = pool.admit(false, far(), pending()).await;
            let _ = order_tx.send((waiter, lease));
        });
        settle().await;
    }
    assert_eq!(pool.snapshot().queue_depth, 3);
    assert_eq!(pool.snapshot().connections_open, 2);

    drop(first);
    let (who, lease) = order.recv().await.unwrap();
    assert_eq!(who, 0);
    assert_eq!(
        pool.snapshot().connections_open,
        2,
        "a freed slot is handed on, not freed"
    );
    drop(lease);
    let (who, third) = order.recv().await.unwrap();
    assert_eq!(who, 1);
    drop(second);
    let (who, fourth) = order.recv().await.unwrap();
    assert_eq!(who, 2);
    drop((third, fourth));
    let snapshot = pool.snapshot();
    assert_eq!(
        (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
        (0, 0, 0)
    );
    assert_eq!(snapshot.connections_peak, 2);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_sheds_at_once_and_a_long_wait_sheds_at_the_deadline() {
    let pool = pool(1, 1);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let deadline = TokioInstant::now() + Duration::from_millis(250);
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.admit(false, deadline, pending()).await.map(|_| ()) })
    };
    settle().await;
    let full = pool.admit(false, far(), pending()).await.map(|_| ());
    assert_eq!(full, Err(Refused::Shed(Shed::QueueFull)));
    advance(Duration::from_millis(300)).await;
    assert_eq!(waiter.await.unwrap(), Err(Refused::Shed(Shed::QueueTimeout)));
    assert_eq!(pool.snapshot().queue_depth, 0);
    drop(held);
    assert_eq!(pool.snapshot().connections_open, 0);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_leaves_is_gone_from_the_queue_at_once() {
    let pool = pool(1, 10);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let (gone_tx, gone_rx) = oneshot::channel::<()>();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let gone = async {
                let _ = gone_rx.await;
            };
            pool.admit(false, far(), gone).await.map(|_| ())
        })
    };
    settle().await;
    assert_eq!(pool.snapshot().queue_depth, 1);
    drop(gone_tx);
    assert_eq!(waiter.await.unwrap(), Err(Refused::ClientGone));
    assert_eq!(pool.snapshot().queue_depth, 0);
    drop(held);
    assert_eq!(
        pool.snapshot().connections_open,
        0,
        "the slot was not handed to the departed waiter"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_gives_back_a_grant_that_raced_with_its_departure() {
    let pool = pool(1, 10);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let mut waiting = Box::pin(pool.admit(false, far(), pending()));
    assert!(futures_poll_once(waiting.as_mut()).await.is_none());
    // The slot is handed to the waiter's channel, but the waiter is dropped before it looks.
    drop(held);
    drop(waiting);
    assert_eq!(pool.snapshot().connections_open, 0);
    assert_eq!(pool.snapshot().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn a_retry_goes_before_earlier_waiters() {
    let pool = pool(1, 10);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
    for (who, priority) in [("plain", false), ("retry", true)] {
        let (pool, order_tx) = (pool.clone(), order_tx.clone());
        tokio::spawn(async move {
            let lease = pool.admit(priority, far(), pending()).await;
            let _ = order_tx.send((who, lease));
        });
        settle().await;
    }
    drop(held);
    assert_eq!(order.recv().await.map(|(who, _)| who), Some("retry"));
    assert_eq!(order.recv().await.map(|(who, _)| who), Some("plain"));
}

#[tokio::test(start_paused = true)]
async fn random_interleavings_never_exceed_the_cap_or_lose_a_waiter() {
    // A small deterministic generator, so a failure replays the same interleaving.
    let mut seed: u64 = 0x5eed_f100_d6a7;
    let mut next = move |bound: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % bound
    };
    let pool = pool(3, 1000);
    // Counted independently of the pool's own bookkeeping.
    let held = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let hold = Duration::from_millis(next(20));
        let patience = Duration::from_millis(next(200));
        let leave_after = Duration::from_millis(next(400));
        let start_after = Duration::from_millis(next(300));
        let (pool, held) = (pool.clone(), held.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(start_after).await;
            let gone = tokio::time::sleep(leave_after);
            let deadline = TokioInstant::now() + patience;
            match pool.admit(false, deadline, gone).await {
                Ok(lease) => {
                    let now = held.0.fetch_add(1, Ordering::SeqCst) + 1;
                    held.1.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(hold).await;
                    held.0.fetch_sub(1, Ordering::SeqCst);
                    drop(lease);
                    "served"
                }
                Err(Refused::Shed(_)) => "shed",
                Err(Refused::ClientGone) => "gone",
            }
        }));
    }
    let mut outcomes = std::collections::BTreeMap::new();
    for task in tasks {
        *outcomes.entry(task.await.unwrap()).or_insert(0) += 1;
    }
    let snapshot = pool.snapshot();
    let peak_held = held.1.load(Ordering::SeqCst);
    assert!(peak_held <= 3, "{peak_held} leases at once; outcomes {outcomes:?}");
    assert!(
        snapshot.connections_peak <= 3,
        "peak {} with outcomes {outcomes:?}",
        snapshot.connections_peak
    );
    assert_eq!(
        (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
        (0, 0, 0)
    );
    assert_eq!(outcomes.values().sum::<i32>(), 200);
    assert!(outcomes.get("served").copied().unwrap_or(0) > 0, "{outcomes:?}");
}

/// Queues `waiters` requests in order, each reporting its number and outcome on the returned channel.
async fn queue_waiters(
    pool: &Arc<UpstreamPool>,
    waiters: usize,
) -> tokio::sync::mpsc::UnboundedReceiver<(usize, Result<Lease, Refused>)> {
    let (order_tx, order) = tokio::sync::mpsc::unbounded_channel();
    for waiter in 0..waiters {
        let (pool, order_tx) = (pool.clone(), order_tx.clone());
        tokio::spawn(async move {
            let lease = pool.admit(false, far(), pending()).await;
            let _ = order_tx.send((waiter, lease));
        });
        settle().await;
    }
    order
}

#[tokio::test(start_paused = true)]
async fn a_raised_cap_hands_its_new_slots_to_the_oldest_waiters_at_once() {
    let pool = pool(1, 10);
    let _held = pool.admit(false, far(), pending()).await.unwrap();
    let mut order = queue_waiters(&pool, 3).await;
    assert_eq!(pool.snapshot().queue_depth, 3);

    pool.set_max_connections(3);
    // Before any waiter has run: the slots were handed over by the change itself.
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.connections_open, snapshot.queue_depth), (3, 1));
    settle().await;
    let (first, _first_lease) = order.try_recv().unwrap();
    let (second, _second_lease) = order.try_recv().unwrap();
    assert_eq!((first, second), (0, 1));
    assert!(order.try_recv().is_err(), "the youngest waiter got a slot past the cap");
    assert_eq!(pool.snapshot().max_connections, 3);
}

#[tokio::test(start_paused = true)]
async fn below_a_lowered_cap_freed_slots_go_to_nobody_until_the_count_is_within_it() {
    let pool = pool(3, 10);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pool.admit(false, far(), pending()).await.unwrap());
    }
    let mut order = queue_waiters(&pool, 2).await;

    pool.set_max_connections(1);
    for open in [2, 1] {
        drop(held.remove(0));
        settle().await;
        assert!(order.try_recv().is_err(), "a slot was handed on above the cap");
        let snapshot = pool.snapshot();
        assert_eq!((snapshot.connections_open, snapshot.queue_depth), (open, 2));
    }
    // One slot left, and it is within the cap: from here on it goes to the waiters in turn.
    drop(held.remove(0));
    let (who, lease) = order.recv().await.unwrap();
    assert_eq!(who, 0);
    assert_eq!(pool.snapshot().connections_open, 1);
    drop(lease);
    let (who, lease) = order.recv().await.unwrap();
    assert_eq!(who, 1);
    drop(lease);
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.connections_open, snapshot.queue_depth), (0, 0));
    assert_eq!(snapshot.connections_peak, 3);
}

#[tokio::test(start_paused = true)]
async fn a_lowered_max_queue_keeps_the_queued_waiters_and_sheds_new_arrivals() {
    let pool = pool(1, 3);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let mut order = queue_waiters(&pool, 3).await;

    let mut limits = UpstreamConfig::clone(&pool.limits());
    limits.max_queue = 1;
    pool.set_limits(limits);
    assert_eq!(pool.snapshot().queue_depth, 3);
    assert_eq!(pool.snapshot().max_queue, 1);
    let late = pool.admit(false, far(), pending()).await.map(|_| ());
    assert_eq!(late, Err(Refused::Shed(Shed::QueueFull)));

    drop(held);
    for expected in 0..3 {
        let (who, lease) = order.recv().await.unwrap();
        assert_eq!(who, expected);
        assert!(lease.is_ok(), "queued waiter {who} was refused");
    }
    assert_eq!(pool.snapshot().queue_depth, 0);
}

#[tokio::test(start_paused = true)]
async fn a_retired_pool_serves_what_it_queued_and_is_drained_once_all_is_released() {
    let pool = pool(1, 10);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let mut order = queue_waiters(&pool, 1).await;

    pool.retire();
    assert!(pool.snapshot().draining);
    assert!(!pool.drained(), "drained with a slot held and a waiter queued");
    drop(held);
    let (_, lease) = order.recv().await.unwrap();
    let lease = lease.unwrap();
    assert!(!pool.drained(), "drained while a lease is held");
    drop(lease);
    assert!(pool.drained());
    assert_eq!(pool.snapshot().connections_open, 0);
}

/// Polls a future once; `Some` if it finished.
async fn futures_poll_once<F: Future + Unpin>(future: F) -> Option<F::Output> {
    let mut future = future;
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut future).poll(cx) {
        std::task::Poll::Ready(out) => std::task::Poll::Ready(Some(out)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

#[tokio::test(start_paused = true)]
async fn tunnel_slots_are_counted_beside_the_cap_never_inside_it() {
    let pool = pool(1, 10);
    pool.set_limits(UpstreamConfig {
        max_tunnels: 2,
        ..(**pool.limits()).clone()
    });
    let tunnels: Vec<_> = std::iter::from_fn(|| pool.tunnel_slot()).take(5).collect();
    assert_eq!(tunnels.len(), 2, "no tunnel past max_tunnels");
    // The pooled connections' cap is whole beside them.
    let lease = pool.admit(false, far(), pending()).await.unwrap();
    let snapshot = pool.snapshot();
    assert_eq!(
        (snapshot.connections_open, snapshot.tunnels_open, snapshot.max_tunnels),
        (1, 2, 2)
    );
    // A lowered bound closes nothing, and refuses until fewer are open.
    pool.set_limits(UpstreamConfig {
        max_tunnels: 1,
        ..(**pool.limits()).clone()
    });
    let mut tunnels = tunnels.into_iter();
    drop(tunnels.next());
    assert!(pool.tunnel_slot().is_none(), "one is open, the bound is one");
    drop(tunnels.next());
    let again = pool.tunnel_slot().expect("room once none is open");
    // A retired pool opens no tunnel, and is drained only once its last tunnel's slot is back.
    drop(lease);
    pool.retire();
    assert!(pool.tunnel_slot().is_none());
    assert!(!pool.drained());
    drop(again);
    assert!(pool.drained());
}

/// Keeps the lease it is handed, or (declining) says its request has gone.
struct KeepsLease {
    kept: std::sync::Mutex<Option<(Lease, std::thread::ThreadId)>>,
    declines: bool,
}

impl LeaseTaker for KeepsLease {
    fn take(&self, lease: Lease) -> Result<(), Lease> {
        if self.declines {
            return Err(lease);
        }
        *self.kept.lock().unwrap() = Some((lease, std::thread::current().id()));
        Ok(())
    }
}

fn queued(pool: &Arc<UpstreamPool>) -> Queued {
    let patience = crate::admission::Patience::queue(far());
    match pool.try_admit(false, patience, &crate::admission::Place::default()) {
        Ok(Admitted::Queued(queued)) => queued,
        Ok(Admitted::Now(_)) => panic!("admitted at once; the test wants it queued"),
        Err(refused) => panic!("refused: {refused:?}"),
    }
}

#[test]
fn a_queued_request_with_a_taker_gets_its_lease_on_the_thread_that_frees_it() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let pool = pool(1, 10);
        let held = pool.admit(false, far(), pending()).await.unwrap();
        let waiting = queued(&pool);
        let taker = Arc::new(KeepsLease {
            kept: Default::default(),
            declines: false,
        });
        waiting.hand_over_to(taker.clone());
        let waited = tokio::spawn(waiting.wait(crate::admission::Patience::queue(far()), pending()));
        settle().await;
        // Freed on another thread: the taker has the lease before the drop returns, on that thread.
        let freeing = std::thread::spawn(move || {
            drop(held);
            std::thread::current().id()
        });
        let freed_on = freeing.join().unwrap();
        let taken_on = taker.kept.lock().unwrap().as_ref().map(|(_, on)| *on);
        assert_eq!(taken_on, Some(freed_on));
        let snapshot = pool.snapshot();
        assert_eq!(
            (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
            (1, 1, 0)
        );
        // The wait itself ends with nothing: what it was for went with the taker.
        assert!(matches!(waited.await.unwrap(), Err(Refused::Shed(Shed::QueueTimeout))));
        drop(taker.kept.lock().unwrap().take());
        let snapshot = pool.snapshot();
        assert_eq!((snapshot.connections_open, snapshot.in_use), (0, 0));
    });
}

#[tokio::test(start_paused = true)]
async fn a_taker_whose_request_has_gone_passes_the_grant_to_the_next_waiter() {
    let pool = pool(1, 10);
    let held = pool.admit(false, far(), pending()).await.unwrap();
    let gone = queued(&pool);
    gone.hand_over_to(Arc::new(KeepsLease {
        kept: Default::default(),
        declines: true,
    }));
    let next = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.admit(false, far(), pending()).await })
    };
    settle().await;
    assert_eq!(pool.snapshot().queue_depth, 2);
    drop(held);
    let lease = next.await.unwrap().expect("the next waiter is granted the slot");
    let snapshot = pool.snapshot();
    assert_eq!(
        (snapshot.connections_open, snapshot.in_use, snapshot.queue_depth),
        (1, 1, 0)
    );
    drop((lease, gone));
    let snapshot = pool.snapshot();
    assert_eq!((snapshot.connections_open, snapshot.in_use), (0, 0));
}
