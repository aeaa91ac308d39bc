//! The lease: what an admitted request holds until its response body has ended.
//!
//! A lease starts as a granted idle connection or a slot to dial with. Dropping it is the end of the exchange: a
//! connection that may be reused goes back to the pool (to the oldest waiter first), any other is dropped, which
//! makes its task close it and free its slot. The request's place among the upstream's in-flight requests ends
//! only after that.

use std::sync::Arc;

use super::{Conn, Grant, UpstreamPool};
use crate::error::ProxyError;

enum Held {
    Conn(Conn),
    Dial(super::Slot),
    Nothing,
}

/// An admitted request's hold on the upstream.
pub struct Lease {
    // Declared first so that it is dropped first: the connection goes back before the lease stops counting.
    held: Held,
    reused: bool,
    reusable: bool,
    pool: Arc<UpstreamPool>,
}

impl Lease {
    pub(super) fn new(pool: Arc<UpstreamPool>, grant: Grant) -> Lease {
        pool.lease_started();
        let (held, reused) = match grant {
            Grant::Idle(conn) => (Held::Conn(conn), true),
            Grant::Dial(slot) => (Held::Dial(slot), false),
        };
        Lease {
            held,
            reused,
            reusable: true,
            pool,
        }
    }

    /// Whether the connection served an earlier request (so it may have been closed by the upstream meanwhile).
    pub fn reused(&self) -> bool {
        self.reused
    }

    pub fn pool(&self) -> &Arc<UpstreamPool> {
        &self.pool
    }

    /// The connection, dialled first if this lease holds a slot; waits until it can take a request.
    pub async fn connection(&mut self) -> Result<&mut Conn, ProxyError> {
        if let Held::Dial(_) = self.held {
            if let Held::Dial(slot) = std::mem::replace(&mut self.held, Held::Nothing) {
                self.held = Held::Conn(self.pool.dial(slot).await?);
            }
        }
        match &mut self.held {
            Held::Conn(conn) => {
                // A pooled connection is normally ready at once; one that is not within request_timeout (its
                // last request body still trickling, say) is treated like a stale one.
                let limit = self.pool.limits.request_timeout;
                match tokio::time::timeout(limit, conn.sender.ready()).await {
                    Ok(Ok(())) => Ok(conn),
                    Ok(Err(err)) => Err(ProxyError::Upstream(err)),
                    Err(_) => Err(ProxyError::UpstreamTimeout(limit)),
                }
            }
            _ => Err(ProxyError::Connect("no connection".into())),
        }
    }

    /// The exchange left the connection in an unknown state: close it instead of reusing it.
    pub fn forbid_reuse(&mut self) {
        self.reusable = false;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Held::Conn(mut conn) = std::mem::replace(&mut self.held, Held::Nothing) {
            conn.served += 1;
            if self.reusable && conn.is_usable(&self.pool.limits) {
                self.pool.put_idle(conn);
            } else {
                self.pool.closing_started(&conn);
            }
        }
        self.pool.lease_ended();
    }
}
