//! An admitted request's exchange with the upstream, run in the upstream lane: the request sent (retried when
//! that is safe), the response head turned into the client's answer, and an exchange the client gave up on
//! finished so its connection is reused or its slot held until the upstream is done. It never routes or admits.

use std::sync::Arc;
use std::time::Instant;

use std::future::Future;
use std::pin::Pin;

use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::sync::oneshot;

use crate::admission::{Patience, Shed};
use crate::body::UploadProgress;
use crate::buffer::BufferBudget;
use crate::error::{ProxyError, UpstreamError};
use crate::forward::{self, RequestBody, ResponseBody, UpstreamIncoming, UpstreamRequest};
use crate::net;
use crate::pool::{Admitted, Lease, LeaseTaker, Refused, UpstreamPool};
use crate::route::RouteSettings;
use crate::upstream_lane::UpstreamLane;

/// The client's answer, or why there is none (made into one by the proxy, which counts it).
pub(crate) type Answer = Result<Response<ResponseBody>, ProxyError>;

/// What the upstream side sends back to the client's task.
pub(super) struct Exchanged {
    /// `None`: the client left while its request was queued (noticed here, on its socket); nothing was sent.
    pub(super) answer: Option<Answer>,
    /// When the request left the queue, if it did: the access log splits the request's time there.
    pub(super) admitted: Option<Instant>,
}

/// An admitted request on its way to the upstream side: the rest of its path runs there, in a task of its own.
pub(super) struct AdmittedExchange {
    pub(super) admitted: Admitted,
    pub(super) patience: Patience,
    /// A queued HTTP/1 client's socket while its body is unread: watched while the request waits (hyper notices
    /// a vanished client by itself otherwise).
    pub(super) watched_socket: Option<Arc<tokio::net::TcpStream>>,
    pub(super) rest: Rest,
}

impl AdmittedExchange {
    /// The lane an exchange granted at once must run in when it is not this thread's ([`Lease::lane_elsewhere`]).
    pub(super) fn lane_elsewhere(&self) -> Option<Arc<UpstreamLane>> {
        match &self.admitted {
            Admitted::Now(lease) => lease.lane_elsewhere(),
            Admitted::Queued(_) => None,
        }
    }

    /// Granted at once with most of the cap free: the exchange may run in its client's task (see
    /// [`UpstreamLane::inline`]). Near the cap, or queued, it runs in the lane, whose turn comes before the client
    /// tasks': on a busy thread a client task's turn can be many milliseconds away, and a connection held that long
    /// is one the next request waits for.
    pub(super) fn may_run_inline(&self) -> bool {
        matches!(&self.admitted, Admitted::Now(lease) if lease.granted_with_room())
    }

    /// Waits for a grant if queued, then runs the exchange and sends its answer to the client's task. A client
    /// that leaves while the request is queued takes it out of the queue; one that leaves later does not cancel
    /// the exchange (cancelling would close the upstream connection while the upstream still works on the
    /// request): the answer nobody takes is dropped, so a response body drains and keeps its connection. A queued
    /// request's exchange runs on the thread that grants it its lease ([`Handover`]), not necessarily this one.
    /// Boxed here, and only the future the request needs: an exchange granted at once carries no wait.
    pub(super) fn start(self) -> Running {
        let AdmittedExchange {
            admitted,
            patience,
            watched_socket,
            rest,
        } = self;
        match admitted {
            Admitted::Now(lease) => boxed!(rest.run(lease)),
            Admitted::Queued(queued) => boxed!(rest.wait_then_run(queued, patience, watched_socket)),
        }
    }
}

/// Hands `answer` to the client's task. Nobody may wait for it any more: the client's record, dropped with its
/// task, counted the abort, and an answer with a body drains it as it is dropped.
fn give(to: oneshot::Sender<Exchanged>, answer: Option<Answer>, admitted: Option<Instant>) {
    let _ = to.send(Exchanged { answer, admitted });
}

/// What an admitted request needs once it holds a lease: run where the lease was granted.
pub(super) struct Rest {
    pub(super) arrived: tokio::time::Instant,
    /// The most a request may be held while its upstream is down (`hold_while_down`): its queue's patience, and
    /// never past its client's own deadline.
    pub(super) hold_until: tokio::time::Instant,
    pub(super) class: u8,
    /// A queued HTTP/1 client's socket, looked at once more when the request's turn comes.
    pub(super) recheck_client: Option<Arc<tokio::net::TcpStream>>,
    /// A queued HTTP/2 upload's stream window, counted in the buffer budget until the request leaves the queue.
    pub(super) window_held: Option<crate::buffer::Reservation>,
    pub(super) request: UpstreamRequest,
    pub(super) answer: oneshot::Sender<Exchanged>,
    pub(super) watch_body: bool,
    pub(super) buffers: Arc<BufferBudget>,
    /// What the request's route sets (its timeouts, the answer's fields).
    pub(super) route: Arc<RouteSettings>,
    /// The request's exported span, with `otlp_endpoint`: marked when the request leaves the queue and when the
    /// upstream answers.
    pub(super) marks: Option<crate::trace::Marks>,
}

/// An exchange on its way, boxed ([`AdmittedExchange::start`]).
pub(super) type Running = crate::upstream_lane::Task;

impl Rest {
    async fn wait_then_run(
        self,
        queued: crate::pool::Queued,
        patience: Patience,
        watched_socket: Option<Arc<tokio::net::TcpStream>>,
    ) {
        let handover = Arc::new(Handover {
            rest: std::sync::Mutex::new(Some(self)),
        });
        queued.hand_over_to(handover.clone());
        let client_gone = async {
            let socket_closed = async {
                match &watched_socket {
                    Some(stream) => net::peer_closed(stream).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = handover.answer_closed() => {}
                () = socket_closed => {}
            }
        };
        let waited = queued.wait(patience, client_gone).await;
        // Taken by the grant's thread: its exchange runs there, and this wait is over.
        let Some(rest) = handover.take_back() else { return };
        match waited {
            Ok(lease) => rest.run(lease).await,
            Err(Refused::Shed(shed)) => give(rest.answer, Some(Err(ProxyError::Shed(shed))), None),
            Err(Refused::ClientGone) => give(rest.answer, None, None),
        }
    }

    /// Sends the request and turns the answer into the client's, the rest's fields used in place.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice in its state"
    )]
    fn run(self, mut lease: Lease) -> impl Future<Output = ()> {
        async move {
            // In a storm the client's task may not have run since its client left (clients that give up close): a
            // request nobody waits for any more is not sent. Its lease goes to the next waiter.
            if self.recheck_client.as_deref().is_some_and(net::peer_has_closed) {
                drop(lease);
                give(self.answer, None, None);
                return;
            }
            // Out of the queue: the body now streams upstream, at the upstream's pace.
            drop(self.window_held);
            let left_queue = tokio::time::Instant::now();
            let waited = left_queue - self.arrived;
            lease.pool().metrics.queue_waited_in(self.class, waited);
            if let Some(marks) = &self.marks {
                marks.admitted(waited);
            }
            // The request sent and the response head turned into the client's, in this future itself: a future of
            // its own would be moved, kilobytes of it, into this one's state.
            let pool = lease.pool().clone();
            lease.warn_if_held_past(self.request.headers());
            let answer = self.answer;
            let client_left = || answer.is_closed();
            let route = &self.route;
            // Taken apart in the statement that awaits it, so that no part of it stays in this future's state during
            // the next wait (a binding matched on is kept whole while any of it is).
            let (parts, body, lease) = match send(
                &pool,
                lease,
                self.request,
                route.request_timeout,
                &self.buffers,
                self.hold_until,
                &client_left,
            )
            .await
            {
                Ok((response, lease)) => {
                    let (parts, body) = response.into_parts();
                    (parts, body, lease)
                }
                Err(err) => {
                    give(answer, Some(Err(err)), Some(left_queue.into_std()));
                    return;
                }
            };
            let edits = forward::RouteEdits {
                edit_response: &|headers| route.edit_response(headers),
                body_idle_timeout: route.body_idle_timeout,
            };
            let answered = forward::to_client(parts, body, lease, self.watch_body, &self.buffers, edits).await;
            if let (Some(marks), Ok(_)) = (&self.marks, &answered) {
                marks.answered();
            }
            give(answer, Some(answered), Some(left_queue.into_std()));
        }
    }
}

/// A queued request's [`Rest`], held for whichever comes first: the grant's thread, which takes it and spawns the
/// exchange in the lane of the thread that watches the granted connection, usually its own (so a lease freed on one
/// worker thread goes back to work at once, without waiting for the waiter's thread to be scheduled), or the wait's
/// end without a grant, which takes it back to answer the client.
struct Handover {
    rest: std::sync::Mutex<Option<Rest>>,
}

impl Handover {
    fn take_back(&self) -> Option<Rest> {
        self.rest.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take()
    }

    /// Resolves when the client's task stops waiting for the answer (the client left), while the rest is here.
    async fn answer_closed(&self) {
        std::future::poll_fn(|cx| {
            let mut rest = self.rest.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match rest.as_mut() {
                Some(rest) => rest.answer.poll_closed(cx),
                // Taken by the grant's thread: the wait ends by its answer's sender being dropped.
                None => std::task::Poll::Pending,
            }
        })
        .await
    }
}

impl LeaseTaker for Handover {
    fn take(&self, lease: Lease) -> Result<(), Lease> {
        let Some(rest) = self.take_back() else {
            return Err(lease);
        };
        // Into this thread's lane, unless the lease's connection is watched by another thread or a new one should be
        // opened on a less busy thread.
        let pool = lease.pool().clone();
        let elsewhere = lease.lane_elsewhere();
        let exchange = boxed!(rest.run(lease));
        match elsewhere {
            Some(lane) => lane.spawn_on(exchange),
            None => pool.spawn_boxed(exchange),
        }
        Ok(())
    }
}

/// The sending loop, with the retry rules: a request the upstream never received is retried on another
/// connection; one that may have reached it is retried once, on a fresh connection, only if it is a GET or HEAD
/// without a body and the connection was a reused one (the upstream closed it while idle). A failed lease is
/// given up before the retry is admitted, so its slot can serve the retry. A fresh dial that fails is retried too
/// when the upstream has other endpoints: nothing was sent, and the failed endpoint now ranks below the others
/// (or, after `eject_after` failures, is ejected and the retry waits for a slot the others can take). Enough such
/// retries for every endpoint to be ejected, at most; then the dial's error is the answer.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice in its state"
)]
pub(super) fn send<'a>(
    pool: &'a Arc<UpstreamPool>,
    mut lease: Lease,
    request: UpstreamRequest,
    request_timeout: Option<std::time::Duration>,
    buffers: &'a Arc<BufferBudget>,
    hold_until: tokio::time::Instant,
    client_left: &'a (dyn Fn() -> bool + Sync),
) -> impl Future<Output = Result<(Response<UpstreamIncoming>, Lease), ProxyError>> + 'a {
    async move {
        let mut outgoing = Outgoing::Request(request);
        // One replay at most: of a GET or HEAD, once, on a fresh connection.
        let mut replayed = false;
        // Every unsent attempt uses up a stale idle connection or a fresh dial, so this bound is never the limit in
        // practice; it only guarantees termination.
        let (max_connections, eject_after, limit) = {
            let limits = pool.limits();
            let timeout = request_timeout.unwrap_or(limits.request_timeout);
            (limits.max_connections, limits.eject_after, timeout)
        };
        let mut attempts_left = max_connections.saturating_add(2);
        // Pauses taken while no endpoint answered (`hold_while_down`).
        let mut held: u32 = 0;
        // A failed dial is retried only with other endpoints to go to, and a dead endpoint is chosen at most until
        // `eject_after` failures eject it: so many retries reach a live endpoint if there is one.
        let mut dial_retries = match pool.endpoint_count() {
            0 | 1 => 0,
            endpoints => endpoints.saturating_mul(eject_after.max(1) as usize),
        };
        loop {
            attempts_left = attempts_left.saturating_sub(1);
            let reused = lease.reused();
            let conn = match lease.connection().await {
                Ok(conn) => conn,
                Err(err) => {
                    lease.forbid_reuse();
                    drop(lease);
                    if matches!(err, ProxyError::NoEndpointRoom) {
                        // Another generation of the pool took the room this slot was issued for: nothing was sent,
                        // and the slot is back. The request waits for room again, at the front, within its patience.
                        attempts_left = attempts_left.saturating_add(1);
                        lease = Box::pin(readmit(pool, false)).await?;
                        continue;
                    }
                    if reused && attempts_left > 0 {
                        // A stale idle connection: nothing was sent on it.
                        pool.metrics.retried_unsent.inc();
                        lease = Box::pin(readmit(pool, false)).await?;
                        continue;
                    }
                    if !reused && dial_retries > 0 {
                        // A failed dial: nothing was sent, and another endpoint may take it.
                        dial_retries -= 1;
                        pool.metrics.retried_unsent.inc();
                        lease = Box::pin(readmit(pool, false)).await?;
                        continue;
                    }
                    // `hold_while_down`: no endpoint answers (a restart); nothing was sent, so the request waits, its
                    // slot given back, and dials again, until its own patience runs out.
                    // A client that has left is not held for: its request goes nowhere.
                    let down = matches!(err, ProxyError::Connect(_) | ProxyError::ConnectTimeout(_));
                    if !reused && down && pool.limits().hold_while_down && !client_left() {
                        let pause = std::time::Duration::from_millis(50u64 << held.min(5))
                            .min(std::time::Duration::from_secs(1));
                        held = held.saturating_add(1);
                        if tokio::time::Instant::now() + pause < hold_until {
                            if held == 1 {
                                pool.metrics.held_while_down.inc();
                            }
                            tokio::time::sleep(pause).await;
                            // A pause is not an attempt: the retries once the upstream is back keep their bound.
                            attempts_left = attempts_left.saturating_add(1);
                            lease = Box::pin(readmit_until(pool, hold_until)).await?;
                            continue;
                        }
                    }
                    return Err(err);
                }
            };
            let dispatched = Instant::now();
            let in_flight = pool.in_flight_for_limit();
            let upload = match &outgoing {
                Outgoing::Request(request) => request.body().upload(),
                Outgoing::Replay(_) => None,
            };
            let wire = conn.wire().cloned();
            let on = wire.clone();
            let stream = conn.open_stream();
            // An HTTP/2 stream the upstream may refuse unprocessed (REFUSED_STREAM, a GOAWAY): its head is kept to be
            // sent again then, whatever its method, with its body as it went out while that stays small.
            let (mut again, kept) = match (&stream, &outgoing) {
                (Some(_), Outgoing::Request(request)) => {
                    let bodiless = http_body::Body::is_end_stream(request.body());
                    (
                        Some(copy_head(request)),
                        (!bodiless).then(|| Arc::new(forward::Kept::default())),
                    )
                }
                _ => (None, None),
            };
            let copied = kept.clone();
            let scheme = pool.origin.scheme.as_str();
            // A request that finds its HTTP/2 connection going away before its stream opens comes back here, whole.
            let unsent: Option<Arc<forward::Unsent>> = stream.as_ref().map(|_| Arc::default());
            let handed_back = unsent.clone();
            let mut responded = boxed!(async move {
                match (outgoing, stream, on) {
                    (Outgoing::Request(request), Some((session, live)), _) => {
                        forward::send_h2(&session, live, scheme, request, handed_back.as_deref(), copied).await
                    }
                    (Outgoing::Request(request), None, Some(on)) => forward::send(&on, request).await,
                    (Outgoing::Replay(head), None, Some(on)) => forward::resend(&on, head).await,
                    _ => Err(ProxyError::Connect("no connection to send on".into())),
                }
            });
            // The connection's timer when it has one: set for an earlier exchange, it fires early at most once and is
            // moved on then (a later deadline) or at once (an earlier one, a route's shorter `request_timeout`).
            let deadline = tokio::time::Instant::from_std(dispatched) + limit;
            let mut timer = wire
                .as_ref()
                .and_then(|wire| wire.take_answer_timer())
                .unwrap_or_else(|| Box::pin(tokio::time::sleep_until(deadline)));
            // In order, no random pick: an answer there by the deadline is taken.
            let answered = tokio::select! {
                biased;
                answered = &mut responded => Ok(answered),
                () = crate::kept_timer::until(timer.as_mut(), deadline) => Err(()),
            };
            if let (Ok(_), Some(wire)) = (&answered, &wire) {
                wire.keep_answer_timer(timer);
            }
            match answered {
                Err(()) => {
                    // The upstream was ready for more body and the client had not sent it: the client is the slow one.
                    if upload.as_ref().is_some_and(UploadProgress::awaiting_client) {
                        lease.abandon();
                        return Err(ProxyError::ClientTooSlow(limit));
                    }
                    // The upstream may still be working on it: its late answer is waited for, and read, elsewhere.
                    pool.spawn(finish_abandoned(responded, lease));
                    return Err(ProxyError::UpstreamTimeout(limit));
                }
                Ok(Ok((response, rest))) => {
                    pool.responded(in_flight, dispatched.elapsed(), lease.endpoint());
                    // The rest of a request body the upstream answered early goes on being sent beside the answer.
                    if let Some(rest) = rest {
                        pool.spawn(finish_upload(pool.clone(), rest));
                    }
                    if let Some(upload) = upload {
                        lease.reuse_once_sent(upload);
                    }
                    return Ok((response, lease));
                }
                Ok(Err(failed)) => {
                    lease.forbid_reuse();
                    drop(lease);
                    if let (ProxyError::Upstream(UpstreamError::NotProcessed(_)), true) = (&failed, attempts_left > 0) {
                        // Nothing of it reached the upstream: the request itself if it never opened a stream (or its
                        // untouched body, for the head's copy), else a bodiless one's copy.
                        let whole = unsent
                            .as_deref()
                            .and_then(|unsent| unsent.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take())
                            .and_then(|unopened| match unopened {
                                forward::Unopened::Request(request) => Some(request),
                                forward::Unopened::Body(body) => again.take().map(|mut head| {
                                    *head.body_mut() = body;
                                    head
                                }),
                            });
                        // A body sent whole and kept goes again as it went; one that was not kept cannot.
                        let resent = match (&kept, again.take()) {
                            (None, head) => head,
                            (Some(kept), head) => {
                                let body = kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).whole();
                                head.zip(body).map(|(mut head, (data, trailers))| {
                                    *head.body_mut() = RequestBody::resent(data, trailers, buffers);
                                    head
                                })
                            }
                        };
                        if let Some(request) = whole.or(resent) {
                            pool.metrics.retried_unsent.inc();
                            outgoing = Outgoing::Request(request);
                            lease = Box::pin(readmit(pool, false)).await?;
                            continue;
                        }
                    }
                    // A reused connection the upstream closed just as the request went out: a GET or HEAD without a
                    // body is sent again on a fresh one, its head as it went out the first time.
                    if reused && !replayed && matches!(failed, ProxyError::Upstream(_)) {
                        if let Some(head) = wire.as_ref().and_then(|wire| wire.take_sent_head()) {
                            tracing::debug!(upstream = %pool.name, "retrying an idempotent request on a fresh connection");
                            pool.metrics.replayed.inc();
                            replayed = true;
                            outgoing = Outgoing::Replay(head);
                            lease = Box::pin(readmit(pool, true)).await?;
                            continue;
                        }
                    }
                    return Err(failed);
                }
            }
        }
    }
}

/// An exchange whose client was answered `504`: the upstream is still working on it, and a thread-per-connection
/// upstream runs it on a thread of its own until it is done. The lease (and its slot) is kept until then: the late
/// answer is read and discarded within `abort_drain_timeout` and `abort_drain_bytes`, and the connection reused if
/// it is whole; otherwise it is closed once the upstream has closed its side. So the upstream never works on more
/// requests than the cap, and no new connection is dialled beside one still busy.
pub(super) async fn finish_abandoned<F>(response: Pin<Box<F>>, mut lease: Lease)
where
    F: Future<Output = Result<(Response<UpstreamIncoming>, Option<forward::Upload>), ProxyError>>,
{
    let pool = lease.pool().clone();
    let (max_bytes, limit) = {
        let limits = pool.limits();
        (limits.abort_drain_bytes, limits.abort_drain_timeout)
    };
    let read_whole = tokio::time::timeout(limit, async {
        let (response, rest) = response.await.ok()?;
        if let Some(rest) = rest {
            pool.spawn(finish_upload(pool.clone(), rest));
        }
        // An HTTP/2 stream read to its end leaves its connection as it was.
        let reusable =
            response.version() == http::Version::HTTP_2 || forward::keeps_alive(response.version(), response.headers());
        let mut body = response.into_body();
        let mut read: u64 = 0;
        while let Some(frame) = body.frame().await {
            read += frame.ok()?.data_ref().map_or(0, |data| data.len() as u64);
            if read > max_bytes {
                return None;
            }
        }
        Some(reusable)
    })
    .await;
    match read_whole {
        Ok(Some(true)) => {}
        Ok(Some(false)) => lease.forbid_reuse(),
        Ok(None) | Err(_) => lease.abandon(),
    }
}

/// Sends the rest of a request body the upstream answered before it had it whole. One that cannot be sent in full
/// (the client's connection dropped it once answered, or the upstream stopped reading) went without its end, and
/// its connection is closed: it is counted, and said at most once a second.
async fn finish_upload(pool: Arc<UpstreamPool>, rest: forward::Upload) {
    static LAST_SAID: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let Err(err) = rest.await else { return };
    pool.metrics.request_body_cut.inc();
    let mut said = LAST_SAID.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if said.is_some_and(|at| at.elapsed() < std::time::Duration::from_secs(1)) {
        tracing::debug!(upstream = %pool.name, error = %err, "a request body answered early went without its end");
    } else {
        *said = Some(Instant::now());
        tracing::warn!(upstream = %pool.name, error = %err, "a request body answered early went without its end; its connection is closed");
    }
}

/// A bodiless request's head, to send again if an HTTP/2 upstream refuses its stream unprocessed.
fn copy_head(request: &Request<RequestBody>) -> UpstreamRequest {
    let mut copy = Box::new(Request::new(RequestBody::empty()));
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}

/// [`readmit`] for a request held while its upstream is down, waiting no longer than `deadline`.
async fn readmit_until(pool: &Arc<UpstreamPool>, deadline: tokio::time::Instant) -> Result<Lease, ProxyError> {
    pool.admit(true, deadline, std::future::pending())
        .await
        .map_err(|refused| match refused {
            Refused::Shed(shed) => ProxyError::Shed(shed),
            Refused::ClientGone => ProxyError::Shed(Shed::QueueTimeout),
        })
}

/// A retry goes to the front of the queue: it was admitted once already. `fresh` keeps it off long-idle
/// connections, which may have been closed by the upstream like the one that just failed.
pub(super) async fn readmit(pool: &Arc<UpstreamPool>, fresh: bool) -> Result<Lease, ProxyError> {
    let deadline = tokio::time::Instant::now() + pool.limits().queue_timeout;
    let admitted = if fresh {
        pool.admit_fresh(deadline).await
    } else {
        pool.admit(true, deadline, std::future::pending()).await
    };
    admitted.map_err(|refused| match refused {
        Refused::Shed(shed) => ProxyError::Shed(shed),
        Refused::ClientGone => ProxyError::Shed(Shed::QueueTimeout),
    })
}

/// What an attempt sends: the request, or the head of a bodiless GET or HEAD as it went out on a connection the
/// upstream closed under it.
enum Outgoing {
    Request(UpstreamRequest),
    Replay(forward::SentHead),
}
