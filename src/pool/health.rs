//! Active health checks of an upstream's endpoints: `GET health_check_path` at every `health_check_interval`.
//!
//! Owns when a check runs and what its answer means. A check uses what a request would: an idle connection to the
//! endpoint, or a slot to dial one, and only with nobody queued, and for a slot only when one is free and the
//! endpoint has room under its own cap. So a check never makes a connection the pool could not otherwise make and
//! never takes one from a request; without either, it is skipped that round (a busy endpoint is evidently
//! reachable). A connection that answered well goes back to the pool like a request's; any other is closed, its
//! slot freed once the socket is. It never answers requests and never moves the cap itself: the pool's ejection
//! rules do.

use std::sync::{Arc, Weak};
use std::time::Duration;

use http::{header, Request};

use super::{Back, Conn, Grant, UpstreamPool};
use crate::body::RequestBody;

/// Checks every endpoint once per interval while the pool lives and the checks are on (a reload may turn them on
/// or off); ends when the pool is retired or gone.
pub(super) async fn run(pool: Weak<UpstreamPool>) {
    loop {
        let interval = {
            let Some(pool) = pool.upgrade() else { return };
            if pool.is_retired() {
                return;
            }
            let limits = pool.limits();
            let interval = limits.health_check_interval.max(Duration::from_millis(10));
            if !limits.health_check_path.is_empty() {
                for endpoint in 0..pool.endpoints().len() {
                    if let Some(grant) = pool.check_grant(endpoint) {
                        let path = limits.health_check_path.clone();
                        pool.spawn(check(pool.clone(), grant, endpoint, path, interval));
                    }
                }
            }
            interval
        };
        tokio::time::sleep(interval).await;
    }
}

/// One check: a 2xx or 3xx answer within `within` is healthy; another answer, a failed dial (within
/// `connect_timeout`) or no answer on a new connection is not; a reused connection that fails says nothing.
async fn check(pool: Arc<UpstreamPool>, grant: Grant, endpoint: usize, path: String, within: Duration) {
    let healthy = exchange(&pool, grant, endpoint, &path, within).await;
    pool.health_checked(endpoint, healthy);
}

async fn exchange(
    pool: &Arc<UpstreamPool>,
    grant: Grant,
    endpoint: usize,
    path: &str,
    within: Duration,
) -> Option<bool> {
    let origin = pool.endpoints().get(endpoint).map(|(origin, _)| origin.clone());
    let (mut conn, reused): (Conn, bool) = match (grant, origin.as_ref()) {
        (Grant::Idle(conn), _) => (conn, true),
        // The dial is not cut short here: it has its own deadline and closes what it started before the slot goes.
        (Grant::Dial(slot), Some(origin)) => match pool.dial_endpoint(slot, origin, endpoint).await {
            Ok(conn) => (conn, false),
            Err(_) => return Some(false),
        },
        (Grant::Dial(_), None) => return None,
    };
    let host = origin.map(|origin| origin.authority()).unwrap_or_default();
    let request = Request::get(path)
        .header(header::HOST, host)
        .header(header::USER_AGENT, "floodgate-health-check")
        .body(RequestBody::empty());
    let answered = match request {
        Ok(request) => {
            let sent = async {
                let scheme = pool.origin.scheme.as_str();
                let (response, rest) = match (conn.open_stream(), conn.wire()) {
                    (Some((session, live)), _) => {
                        super::client_h2::send(&session, live, scheme, Box::new(request), None, None)
                            .await
                            .ok()?
                    }
                    (None, Some(wire)) => super::client::send(wire, Box::new(request)).await.ok()?,
                    (None, None) => return None,
                };
                // A GET without a body has nothing left to send.
                drop(rest);
                Some(response)
            };
            tokio::time::timeout(within, sent).await.ok().flatten()
        }
        Err(_) => None,
    };
    conn.count_served();
    let Some(response) = answered else {
        pool.came_back(Back::CheckFailed(conn));
        return (!reused).then_some(false);
    };
    let healthy = response.status().is_success() || response.status().is_redirection();
    // The body is not wanted: read to its end within the same bound, the connection can serve again.
    let drained = tokio::time::timeout(within, http_body_util::BodyExt::collect(response.into_body())).await;
    if healthy && matches!(drained, Ok(Ok(_))) && conn.is_usable(&pool.limits()) {
        pool.came_back(Back::Checked(conn));
    } else {
        pool.came_back(Back::CheckFailed(conn));
    }
    Some(healthy)
}
