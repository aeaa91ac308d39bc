//! Which idle connection a worker thread is given: one it opened itself before a newer one another thread opened,
//! since a connection's exchanges run on the thread whose I/O driver watches it. A thread's lane is what
//! `UpstreamLane::make_here` says it is, so one test thread stands in for several worker threads in turn.

use std::future::pending;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::config::Scheme;
use crate::config::{Origin, UpstreamConfig};
use crate::metrics::Metrics;
use crate::pool::*;
use crate::upstream_lane::UpstreamLane;

/// A pool of cap 4 in front of a loopback listener that accepts and holds every connection, silent.
async fn pool_with_silent_upstream() -> Arc<UpstreamPool> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a loopback listener");
    let port = listener.local_addr().expect("its address").port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let limits = UpstreamConfig {
        url: format!("127.0.0.1:{port}"),
        max_connections: 4,
        ..UpstreamConfig::default()
    };
    let origin = Origin {
        scheme: Scheme::Http,
        host: "127.0.0.1".into(),
        port,
    };
    UpstreamPool::new("homes", origin, limits, None, Metrics::new().upstream("homes"))
}

fn far() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(3600)
}

/// A lease holding a connection opened while `lane` was this thread's.
async fn opened_on(pool: &Arc<UpstreamPool>, lane: &Arc<UpstreamLane>) -> Lease {
    UpstreamLane::make_here(lane.clone());
    let mut lease = pool.admit(false, far(), pending()).await.expect("admitted");
    lease.connection().await.expect("dialled");
    lease
}

#[tokio::test]
async fn a_thread_is_given_the_idle_connection_it_opened_before_a_newer_one_from_another_thread() {
    let pool = pool_with_silent_upstream().await;
    let (mine, theirs, third) = (UpstreamLane::new(), UpstreamLane::new(), UpstreamLane::new());
    let older = opened_on(&pool, &mine).await;
    let newer = opened_on(&pool, &theirs).await;
    // Back in the idle list in this order: `theirs` is the newest.
    drop(older);
    drop(newer);
    assert_eq!(pool.snapshot().connections_open, 2);

    UpstreamLane::make_here(mine.clone());
    let lease = pool.admit(false, far(), pending()).await.expect("admitted");
    assert!(lease.reused(), "an idle connection, not a dial");
    assert!(
        lease.lane_elsewhere().is_none(),
        "the connection this thread opened, though another is newer"
    );
    drop(lease);

    // A thread that opened neither takes the newest (the one just given back), and its exchange goes to the thread
    // that opened it.
    UpstreamLane::make_here(third.clone());
    let lease = pool.admit(false, far(), pending()).await.expect("admitted");
    assert!(lease.reused());
    let home = lease.lane_elsewhere().expect("another thread's connection");
    assert!(Arc::ptr_eq(&home, &mine), "the newest idle connection");
}
