//! The lease: what an admitted request holds until its response body has ended.
//!
//! A lease starts as a granted idle connection or a slot to dial with. Dropping it is the end of the exchange: a
//! connection that may be reused goes back to the pool (to the oldest waiter first), any other is dropped, which
//! sends it to the pool's closing task to be closed, and its slot freed. The request's place among the upstream's
//! in-flight requests ends only after that.

use std::sync::Arc;

use super::{Back, Conn, Grant, UpstreamPool};
use crate::body::UploadProgress;
use crate::error::ProxyError;
use crate::error::UpstreamError;
use crate::upstream_lane::UpstreamLane;

enum Held {
    Conn(Conn),
    Dial(super::Slot),
    Nothing,
    /// Handed back as the grant it was made from ([`Lease::into_grant`]): nothing to give back on drop.
    GrantBack,
}

/// An admitted request's hold on the upstream.
pub struct Lease {
    held: Held,
    reused: bool,
    reusable: bool,
    /// Given up mid-exchange: the upstream may still be working (see [`Lease::abandon`]).
    abandoned: bool,
    /// The request body, if it had one: the connection is reusable only once it is all sent.
    upload: Option<UploadProgress>,
    /// With `hold_warn_after`: dropped with the lease, which tells its alarm the hold is over.
    alarm: Option<tokio::sync::oneshot::Sender<()>>,
    /// Granted at once with at most half the cap in force leased, this one included.
    pub(super) roomy: bool,
    pool: Arc<UpstreamPool>,
}

impl Lease {
    pub(super) fn new(pool: Arc<UpstreamPool>, grant: Grant) -> Lease {
        let (held, reused) = match grant {
            Grant::Idle(conn) => (Held::Conn(conn), true),
            Grant::Dial(slot) => (Held::Dial(slot), false),
        };
        Lease {
            held,
            reused,
            reusable: true,
            abandoned: false,
            upload: None,
            alarm: None,
            roomy: false,
            pool,
        }
    }

    /// Whether the lease was granted at once while at most half the cap in force was leased: its connection is not
    /// one a waiter is likely to want soon, so the exchange may run at its client task's pace (see
    /// `UpstreamLane::inline`) without holding up anyone.
    pub fn granted_with_room(&self) -> bool {
        self.roomy
    }

    /// The grant a lease that has not been used yet was made from, to hand on to another waiter.
    pub(super) fn into_grant(mut self) -> Option<Grant> {
        match std::mem::replace(&mut self.held, Held::GrantBack) {
            Held::Conn(conn) => Some(Grant::Idle(conn)),
            Held::Dial(slot) => Some(Grant::Dial(slot)),
            Held::Nothing | Held::GrantBack => None,
        }
    }

    /// The lane this lease's exchange should run in when it is not the caller's thread's: a reused HTTP/1
    /// connection's home (the thread whose I/O driver watches its socket: run elsewhere, each answer would wait for
    /// both threads' turns, docs/storm.md), or for a slot to dial with, the least busy lane when this thread's is
    /// much busier (the connection is opened where the exchange runs, and stays there).
    pub fn lane_elsewhere(&self) -> Option<Arc<UpstreamLane>> {
        match &self.held {
            Held::Conn(conn) => conn.home_elsewhere().cloned(),
            Held::Dial(_) => UpstreamLane::least_busy_elsewhere(),
            Held::Nothing | Held::GrantBack => None,
        }
    }

    /// The endpoint its connection goes to, once it has one.
    pub fn endpoint(&self) -> Option<usize> {
        match &self.held {
            Held::Conn(conn) => Some(conn.endpoint),
            _ => None,
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
                // Boxed: the dial (DNS, TCP, TLS, handshake) is kilobytes of future, and rare beside reuse; inline,
                // every exchange's future would carry it and be copied with it.
                self.held = Held::Conn(Box::pin(self.pool.dial(slot)).await?);
            }
        }
        match &mut self.held {
            Held::Conn(conn) => {
                // A pooled connection is normally ready at once; one whose last request body is still going out
                // (the upstream answered before it had all of it) is waited for within request_timeout, and is
                // treated like a stale one past that.
                if let Some(wire) = conn.wire().filter(|wire| wire.lock().uploading) {
                    let limit = self.pool.limits().request_timeout;
                    if tokio::time::timeout(limit, wire.upload_done()).await.is_err() {
                        return Err(ProxyError::UpstreamTimeout(limit));
                    }
                }
                if conn.is_closed() {
                    return Err(ProxyError::Upstream(UpstreamError::Closed));
                }
                Ok(conn)
            }
            _ => Err(ProxyError::Connect("no connection".into())),
        }
    }

    /// Chooses the endpoint this lease's slot would dial, as [`Lease::connection`] does first, without dialling.
    #[cfg(test)]
    pub(super) fn choose_endpoint(&mut self) -> Option<usize> {
        match &mut self.held {
            Held::Dial(slot) => self.pool.choose_endpoint(slot),
            _ => None,
        }
    }

    /// The exchange left the connection in an unknown state: close it instead of reusing it.
    pub fn forbid_reuse(&mut self) {
        self.reusable = false;
    }

    /// The exchange was given up before the upstream was done with it (no answer in time, a stalled or unread
    /// body): the connection is closed, and its slot held until the upstream closes its side, so that the
    /// upstream never works on more requests at once than the cap, even when it finishes abandoned ones late.
    pub fn abandon(&mut self) {
        self.reusable = false;
        self.abandoned = true;
    }

    /// With `hold_warn_after` set: once this lease has held its slot that long, one warning names the request's ID and
    /// the hold is counted. Nothing runs without it.
    pub fn warn_if_held_past(&mut self, request: &http::HeaderMap) {
        let limit = self.pool.limits().hold_warn_after;
        if limit.is_zero() {
            return;
        }
        let request_id = request.get(crate::access::X_REQUEST_ID);
        let (over, held) = tokio::sync::oneshot::channel::<()>();
        self.alarm = Some(over);
        let pool = self.pool.clone();
        let id = request_id.and_then(|id| id.to_str().ok()).unwrap_or("-").to_owned();
        self.pool.spawn(async move {
            let mut held = held;
            tokio::select! {
                _ = &mut held => {}
                () = tokio::time::sleep(limit) => {
                    pool.metrics.long_holds.inc();
                    tracing::warn!(
                        upstream = %pool.name,
                        request_id = %id,
                        hold_warn_after = ?limit,
                        "an exchange has held its upstream slot longer than hold_warn_after"
                    );
                }
            }
        });
    }

    /// Reuse the connection only if this request body has been sent in full by the time the lease ends.
    pub fn reuse_once_sent(&mut self, upload: UploadProgress) {
        self.upload = Some(upload);
    }
}

impl UpstreamPool {
    /// An HTTP/2 stream's permit at its exchange's end: to the next waiter, or idle, while its session may carry
    /// more; else its session is closed once its other streams are over.
    fn stream_came_back(self: &Arc<Self>, conn: Conn) {
        let limits = self.limits();
        if conn.is_usable(&limits) {
            // A limit raised since the session's permits were made (a reload, the upstream's SETTINGS) makes more.
            let more = conn.more_permits(&limits);
            self.came_back(Back::Reusable(conn));
            for more in more {
                self.hand_on(Grant::Idle(more), false);
            }
        } else {
            self.came_back(Back::Released(Some((conn, false))));
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.held, Held::Nothing) {
            // An HTTP/2 stream: a failed exchange leaves its session whole (a failure that is the session's marks
            // it gone). Its permit comes back once every handle on the stream is gone, and, for one given up
            // mid-way, once the upstream has read its reset: until then it counts among the streams at work.
            Held::Conn(mut conn) if conn.session().is_some() => {
                conn.count_served();
                // Given up, or failed (the stream may have been reset, by floodgate or the upstream): held until the
                // upstream has read what ended it.
                // A request body that did not go out whole ended its stream with a reset too.
                let unclean = self.abandoned || !self.reusable;
                if unclean || conn.stream_still_live() {
                    let pool = self.pool.clone();
                    let upload = self.upload.take();
                    self.pool.spawn(async move {
                        conn.stream_over().await;
                        if unclean || upload.as_ref().is_some_and(|upload| !upload.is_sent()) {
                            if let Some(session) = conn.session() {
                                session.acknowledged().await;
                            }
                        }
                        pool.stream_came_back(conn);
                    });
                } else {
                    self.pool.stream_came_back(conn);
                }
            }
            Held::Conn(mut conn) => {
                conn.count_served();
                let sent = self.upload.as_ref().is_none_or(UploadProgress::is_sent);
                if self.reusable && sent && conn.is_usable(&self.pool.limits()) {
                    self.pool.came_back(Back::Reusable(conn));
                } else {
                    self.pool.came_back(Back::Released(Some((conn, self.abandoned))));
                }
            }
            // The lease leaves the count before its unused slot is freed, so the slot can go to a waiter the
            // adaptive limit held back.
            Held::Dial(slot) => {
                self.pool.came_back(Back::Released(None));
                drop(slot);
            }
            Held::Nothing => self.pool.came_back(Back::Released(None)),
            Held::GrantBack => {}
        }
    }
}
