//! The request's path through floodgate, built in one place: tunnel check → route → rewrite → small body read
//! → admission → exchange → answer.
//!
//! Owns the order of the steps and the one place where a [`ProxyError`] becomes a response and is counted. A
//! client that leaves while its request is at the upstream does not cancel the exchange: its remainder is
//! spawned, the response is still read to its end and the connection reused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::{ArcSwap, Guard};
use std::future::Future;
use std::pin::Pin;

use http::{header, Method, Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Incoming};
use tokio::sync::oneshot;

use crate::access::Entry;
use crate::admission::{self, Patience, Place, Shed};
use crate::body::UploadProgress;
use crate::buffer::BufferBudget;
use crate::config::{Config, FairKey, UpstreamConfig, MAX_PRIORITY};
use crate::error::{Outcome, ProxyError, ShedAdvice};
use crate::forward::{self, ClientInfo, RequestBody, ResponseBody};
use crate::metrics::{Metrics, OutcomeCounters};
use crate::net;
use crate::pool::{Admitted, Lease, Refused, UpstreamPool};
use crate::route::{Picked, Router};
use crate::upstream_lane::UpstreamLane;

/// Everything a request needs, shared by all connections. The router and the trusted proxies are replaced whole
/// by a reload; a request reads each once.
pub struct Proxy {
    router: ArcSwap<Router>,
    pub metrics: Arc<Metrics>,
    trusted_proxies: ArcSwap<Vec<ipnet::IpNet>>,
    /// Pools a reload retired, kept for `/status` and shutdown until they have drained.
    draining: Mutex<Vec<Arc<UpstreamPool>>>,
    /// Whether requests write an access-log line.
    access_log: bool,
    /// The bound on body bytes held in memory, shared by every request.
    buffers: Arc<BufferBudget>,
    shed_warned_at: AtomicU64,
    started: Instant,
    /// Where admitted exchanges run, ahead of the client connections (see [`crate::upstream_lane`]).
    lane: Arc<UpstreamLane>,
}

impl Proxy {
    /// `lane` must be the one `router`'s pools were built with ([`crate::reload::Plan`]).
    pub fn new(
        router: Router,
        metrics: Arc<Metrics>,
        trusted_proxies: Vec<ipnet::IpNet>,
        lane: Arc<UpstreamLane>,
    ) -> Self {
        let buffers = BufferBudget::new(
            Config::default().max_buffered_bytes,
            metrics.buffered_bytes.clone(),
            metrics.buffer_fallbacks.clone(),
        );
        Proxy {
            buffers,
            router: ArcSwap::from_pointee(router),
            metrics,
            trusted_proxies: ArcSwap::from_pointee(trusted_proxies),
            draining: Mutex::default(),
            access_log: false,
            shed_warned_at: AtomicU64::new(0),
            started: Instant::now(),
            lane,
        }
    }

    /// Where pools run their connections and admitted exchanges run.
    pub fn lane(&self) -> &Arc<UpstreamLane> {
        &self.lane
    }

    /// The routes and pools in force.
    pub fn router(&self) -> Guard<Arc<Router>> {
        self.router.load()
    }

    /// Puts a new router in force and retires `retired`: requests already routed to them finish there.
    pub(crate) fn replace_router(
        &self,
        router: Router,
        trusted_proxies: Vec<ipnet::IpNet>,
        retired: Vec<Arc<UpstreamPool>>,
    ) {
        self.router.store(Arc::new(router));
        self.trusted_proxies.store(Arc::new(trusted_proxies));
        drop(self.draining());
        let mut draining = self.draining.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for pool in retired {
            pool.retire();
            draining.push(pool);
        }
    }

    /// Retired pools still finishing requests; the drained ones are forgotten here.
    pub fn draining(&self) -> Vec<Arc<UpstreamPool>> {
        let mut draining = self.draining.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        draining.retain(|pool| {
            let drained = pool.drained();
            if drained {
                // Its gauges show what it left (nothing open, nothing waiting), not its last busy moment.
                pool.metrics.refresh(&pool.snapshot());
            }
            !drained
        });
        draining.clone()
    }

    /// Every pool with connections to care for: those in force, then the draining ones.
    pub fn all_pools(&self) -> Vec<Arc<UpstreamPool>> {
        let mut pools: Vec<_> = self.router().pools().values().cloned().collect();
        pools.extend(self.draining());
        pools
    }

    pub fn with_access_log(mut self, on: bool) -> Self {
        self.access_log = on;
        self
    }

    /// The bound on body bytes held in memory (`max_buffered_bytes`); a reload changes it in place.
    pub fn buffers(&self) -> &BufferBudget {
        &self.buffers
    }

    pub fn is_trusted(&self, peer: std::net::IpAddr) -> bool {
        self.trusted_proxies.load().iter().any(|net| net.contains(&peer))
    }

    /// Serves one request from `client`'s connection.
    pub async fn serve(self: Arc<Self>, request: Request<Incoming>, client: Arc<ClientInfo>) -> Response<ResponseBody> {
        // A client's own deadline runs from when its request arrived, body reading included.
        let received = tokio::time::Instant::now();
        let mut body_unread = !request.body().is_end_stream();
        let is_http1 = request.version() <= Version::HTTP_11;
        // The client asked to hear from us before it sends the body: that answer waits for admission.
        let awaits_continue = request.headers().contains_key(header::EXPECT);
        let mut access = Entry::start(self.access_log, client.peer, request.method(), request.uri().path());
        let (pool, picked, mut upstream_request) = match self.prepare(request, &client) {
            Ok(prepared) => prepared,
            Err(err) => return self.refuse(err, access),
        };
        if let Some(entry) = access.as_mut() {
            entry.routed(&pool.name);
        }
        // Everything this request takes from its upstream's settings, read once; the head is all it needs.
        let (buffer_limit, request_timeout, queue_timeout, client_deadline, place) = {
            let limits = pool.limits();
            let headers = upstream_request.headers();
            let client_deadline = admission::client_timeout(headers, &limits.deadline_header, limits.grpc_timeout)
                .map(|timeout| received + timeout);
            let place = place(&limits, &picked, headers, &client, &self.trusted_proxies.load());
            (
                limits.buffer_request_bytes,
                limits.request_timeout,
                limits.queue_timeout,
                client_deadline,
                place,
            )
        };

        if body_unread && !awaits_continue {
            // Read before admission, so a client that uploads slowly waits without holding a slot. Over HTTP/2 a
            // body without a length may be a stream the client feeds as answers arrive: it is not waited for.
            // hyper drops this future when the client leaves; while its body is read, that is counted here.
            let reading = AbortWatch::new(&pool.metrics.requests, access);
            let body = upstream_request.body_mut();
            let buffered = body
                .buffer(buffer_limit, is_http1, request_timeout, &self.buffers)
                .await;
            access = reading.disarm();
            match buffered {
                Ok(all_read) => body_unread = !all_read,
                Err(err) => return self.answer_error(&pool, err, access),
            }
        }
        // The queue's clock starts once the body is in: queue_timeout bounds the wait for a slot.
        let arrived = tokio::time::Instant::now();
        let patience = Patience {
            queue_timeout_at: arrived + queue_timeout,
            client_deadline,
        };
        // Admission decides here and at once; a shed costs the client side nothing more.
        let admitted = match pool.try_admit(false, patience, &place) {
            Ok(admitted) => admitted,
            Err(Refused::Shed(shed)) => {
                self.warn_shed(&pool, shed);
                return self.answer_error(&pool, ProxyError::Shed(shed), access);
            }
            Err(Refused::ClientGone) => return self.answer_error(&pool, ProxyError::ClientGone, access),
        };
        // A queued HTTP/2 upload's stream window may fill while it waits: floodgate holds those bytes, so they count.
        let window_held = match &admitted {
            Admitted::Queued(_) if body_unread && !is_http1 => {
                let window = u64::from(crate::buffer::HTTP2_STREAM_WINDOW);
                let hint = upstream_request.body().size_hint();
                Some(self.buffers.hold(hint.upper().map_or(window, |left| left.min(window))))
            }
            _ => None,
        };
        // Everything from the wait in the queue to the response (its body too, when it is buffered) runs on the
        // upstream side: a freed connection reaches the next queued request, and that request the upstream,
        // without waiting for any client connection's task to be scheduled.
        let admitted = AdmittedExchange {
            admitted,
            patience,
            arrived,
            class: place.class,
            http1_socket: client.http1_stream.clone(),
            body_unread,
            window_held,
            request: upstream_request,
            access,
            // An HTTP/2 client can stop a stream without blocking its socket; its body gets a watchdog.
            watch_body: !is_http1,
            buffers: self.buffers.clone(),
        };
        let (answer, answered) = oneshot::channel();
        self.lane.spawn(admitted.run(answer));
        match answered.await {
            Ok(Ok(response)) => response,
            Ok(Err((err, access))) => {
                if let ProxyError::Shed(shed) = err {
                    self.warn_shed(&pool, shed);
                }
                self.answer_error(&pool, err, access)
            }
            // The upstream side stopped (floodgate is exiting) with the exchange on it.
            Err(_) => self.answer_error(&pool, ProxyError::Abandoned, None),
        }
    }

    /// The steps before admission: tunnels refused, the upstream picked, the head rewritten for it.
    pub(crate) fn prepare(
        &self,
        request: Request<Incoming>,
        client: &ClientInfo,
    ) -> Result<(Arc<UpstreamPool>, Picked, Request<RequestBody>), ProxyError> {
        if request.method() == Method::CONNECT || request.headers().contains_key(header::UPGRADE) {
            return Err(ProxyError::TunnelNotSupported);
        }
        // Before routing: an authority-form target must not pick a route by its authority.
        forward::check_target(request.method(), request.uri())?;
        forward::check_host(request.uri(), request.headers())?;
        forward::check_transfer_coding(request.headers())?;
        let host = forward::target_host(request.uri(), request.headers());
        let router = self.router();
        let (pool, picked) = router
            .pick_route(host, request.uri().path())
            .ok_or(ProxyError::NoRoute)?;
        let (pool, picked) = (pool.clone(), picked.clone());
        drop(router);
        let upstream_request = forward::to_upstream(request, client, &pool)?;
        Ok((pool, picked, upstream_request))
    }

    fn refuse(&self, err: ProxyError, access: Option<Box<Entry>>) -> Response<ResponseBody> {
        answer_locally(self.metrics.client_side_counters(), err, None, access)
    }

    fn answer_error(&self, pool: &UpstreamPool, err: ProxyError, access: Option<Box<Entry>>) -> Response<ResponseBody> {
        let advice = match err {
            ProxyError::Shed(_) => Some(pool.shed_advice()),
            _ => {
                tracing::debug!(upstream = %pool.name, error = %err, "request failed");
                None
            }
        };
        answer_locally(&pool.metrics.requests, err, advice.as_ref(), access)
    }

    /// At most one shedding warning a second, so overload does not also flood the logs.
    fn warn_shed(&self, pool: &UpstreamPool, shed: Shed) {
        let now = self.started.elapsed().as_secs() + 1;
        let last = self.shed_warned_at.load(Ordering::Relaxed);
        if now > last
            && self
                .shed_warned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let snapshot = pool.snapshot();
            tracing::warn!(
                upstream = %pool.name,
                reason = %shed,
                queue_depth = snapshot.queue_depth,
                max_queue = snapshot.max_queue,
                "shedding requests"
            );
        }
    }
}

/// Where a request waits in its upstream's queue: its priority class (the upstream's `priority_header` when
/// it holds 0-9, else its route's) and, with fair sharing, its client's key.
fn place(
    limits: &UpstreamConfig,
    picked: &Picked,
    headers: &http::HeaderMap,
    client: &ClientInfo,
    trusted: &[ipnet::IpNet],
) -> Place {
    let from_header = (!limits.priority_header.is_empty())
        .then(|| headers.get(limits.priority_header.as_str()))
        .flatten()
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.trim().parse::<u8>().ok())
        .filter(|class| *class <= MAX_PRIORITY);
    let key = match &limits.fair_key {
        None => None,
        Some(FairKey::Route) => Some(picked.label.clone()),
        Some(FairKey::ClientIp) => Some(Arc::from(client_address(headers, client, trusted).as_str())),
        // An empty value is no key: it would otherwise share a lane with, and count against, nobody in particular.
        Some(FairKey::Header(name)) => headers
            .get(name)
            .filter(|value| !value.is_empty())
            .map(|value| Arc::from(String::from_utf8_lossy(value.as_bytes()).as_ref())),
    };
    Place {
        class: from_header.unwrap_or(picked.priority),
        key,
    }
}

/// The client's address: from a trusted proxy, the last `X-Forwarded-For` entry that is not itself a trusted
/// proxy — the address the first trusted hop saw. Entries to the left of it are whatever the client wrote, so
/// taking the leftmost would let a client pick a fresh key, and a fresh lane, for every request.
fn client_address(headers: &http::HeaderMap, client: &ClientInfo, trusted: &[ipnet::IpNet]) -> String {
    if client.trusted {
        let untrusted = headers
            .get_all("x-forwarded-for")
            .iter()
            .rev()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|list| list.rsplit(','))
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .find(|entry| {
                entry
                    .parse::<std::net::IpAddr>()
                    .map_or(true, |ip| !trusted.iter().any(|net| net.contains(&ip)))
            });
        if let Some(address) = untrusted {
            return address.to_string();
        }
    }
    client.peer.ip().to_string()
}

/// A failure carries the access-log entry back, so that its answer's line is written where it is counted.
type Answer = Result<Response<ResponseBody>, (ProxyError, Option<Box<Entry>>)>;

/// Sends the request upstream and turns the response head into the client's.
async fn exchange(
    lease: Lease,
    request: Request<RequestBody>,
    access: Option<Box<Entry>>,
    watch_body: bool,
    buffers: Arc<BufferBudget>,
) -> Answer {
    let pool = lease.pool().clone();
    let (response, lease) = match send(&pool, lease, request).await {
        Ok(sent) => sent,
        Err(err) => return Err((err, access)),
    };
    let counters = pool.metrics.requests.clone();
    forward::to_client(response, lease, counters, access, watch_body, &buffers).await
}

/// An admitted request on its way to the upstream side: the rest of its path runs there, in a task of its own.
struct AdmittedExchange {
    admitted: Admitted,
    patience: Patience,
    arrived: tokio::time::Instant,
    class: u8,
    /// An HTTP/1 client's socket: watched while the request waits with its body still unread (hyper notices a
    /// vanished client by itself otherwise), and looked at once more when the request's turn comes.
    http1_socket: Option<Arc<tokio::net::TcpStream>>,
    body_unread: bool,
    /// A queued HTTP/2 upload's stream window, counted in the buffer budget until the request leaves the queue.
    window_held: Option<crate::buffer::Reservation>,
    request: Request<RequestBody>,
    access: Option<Box<Entry>>,
    watch_body: bool,
    buffers: Arc<BufferBudget>,
}

impl AdmittedExchange {
    /// Waits for a grant if queued, then runs the exchange and hands its answer to the client's task. A client
    /// that leaves while the request is queued takes it out of the queue; one that leaves later does not cancel
    /// the exchange (cancelling would close the upstream connection while the upstream still works on the
    /// request): the answer nobody takes is dropped, so a response body drains and keeps its connection.
    async fn run(self, mut answer: oneshot::Sender<Answer>) {
        let AdmittedExchange {
            admitted,
            patience,
            arrived,
            class,
            http1_socket,
            body_unread,
            window_held,
            request,
            mut access,
            watch_body,
            buffers,
        } = self;
        let lease = match admitted {
            Admitted::Now(lease) => lease,
            Admitted::Queued(queued) => {
                let counters = queued.pool().metrics.requests.clone();
                let client_gone = async {
                    let socket_closed = async {
                        match &http1_socket {
                            Some(stream) if body_unread => net::peer_closed(stream).await,
                            _ => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        () = answer.closed() => {}
                        () = socket_closed => {}
                    }
                };
                match queued.wait(patience, client_gone).await {
                    // In a storm the client's task may not have run since its client left (clients that give up
                    // close): a request nobody waits for any more is not sent. Its lease goes to the next waiter.
                    Ok(lease) if http1_socket.as_deref().is_some_and(net::peer_has_closed) => {
                        drop(lease);
                        client_left(&counters, access, answer);
                        return;
                    }
                    Ok(lease) => lease,
                    Err(Refused::Shed(shed)) => {
                        if let Err(Err((_, access))) = answer.send(Err((ProxyError::Shed(shed), access))) {
                            forward::complete(&counters, None, access, Outcome::ClientAbort, 0);
                        }
                        return;
                    }
                    Err(Refused::ClientGone) => {
                        client_left(&counters, access, answer);
                        return;
                    }
                }
            }
        };
        // Out of the queue: the body now streams upstream, at the upstream's pace.
        drop(window_held);
        let pool = lease.pool().clone();
        pool.metrics.queue_waited_in(class, arrived.elapsed());
        if let Some(entry) = access.as_mut() {
            entry.admitted();
        }
        let answered = exchange(lease, request, access, watch_body, buffers).await;
        if let Err(Err((_, access))) = answer.send(answered) {
            forward::complete(&pool.metrics.requests, None, access, Outcome::ClientAbort, 0);
        }
    }
}

/// A queued request's client left: counted as its abort, and answered (if its task still waits) with an answer
/// nobody will read.
fn client_left(counters: &OutcomeCounters, access: Option<Box<Entry>>, answer: oneshot::Sender<Answer>) {
    forward::complete(counters, None, access, Outcome::ClientAbort, 0);
    let _ = answer.send(Ok(forward::local_response(&ProxyError::Shed(Shed::QueueTimeout), None)));
}

/// The sending loop, with the retry rules: a request the upstream never received is retried on another
/// connection; one that may have reached it is retried once, on a fresh connection, only if it is a GET or HEAD
/// without a body and the connection was a reused one (the upstream closed it while idle). A failed lease is
/// given up before the retry is admitted, so its slot can serve the retry. A fresh dial that fails is retried too
/// when the upstream has other endpoints: nothing was sent, and the failed endpoint now ranks below the others
/// (or, after `eject_after` failures, is ejected and the retry waits for a slot the others can take). Enough such
/// retries for every endpoint to be ejected, at most; then the dial's error is the answer.
async fn send(
    pool: &Arc<UpstreamPool>,
    mut lease: Lease,
    mut request: Request<RequestBody>,
) -> Result<(Response<Incoming>, Lease), ProxyError> {
    // The head is kept (an allocation) only where a replay can happen: on a reused connection.
    let mut replay = if lease.reused() { replayable(&request) } else { None };
    // Every unsent attempt uses up a stale idle connection or a fresh dial, so this bound is never the limit in
    // practice; it only guarantees termination.
    let (max_connections, eject_after, limit) = {
        let limits = pool.limits();
        (limits.max_connections, limits.eject_after, limits.request_timeout)
    };
    let mut attempts_left = max_connections.saturating_add(2);
    // A failed dial is retried only with other endpoints to go to, and a dead endpoint is chosen at most until
    // `eject_after` failures eject it: so many retries reach a live endpoint if there is one.
    let mut dial_retries = match pool.endpoints().len() {
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
                if reused && attempts_left > 0 {
                    // A stale idle connection: nothing was sent on it.
                    pool.metrics.retried_unsent.inc();
                    lease = readmit(pool, false).await?;
                    continue;
                }
                if !reused && dial_retries > 0 {
                    // A failed dial: nothing was sent, and another endpoint may take it.
                    dial_retries -= 1;
                    pool.metrics.retried_unsent.inc();
                    lease = readmit(pool, false).await?;
                    continue;
                }
                return Err(err);
            }
        };
        let dispatched = Instant::now();
        let in_flight = pool.in_flight();
        let upload = request.body().upload();
        let mut responded = Box::pin(conn.sender.try_send_request(request));
        let answered = tokio::select! {
            answered = &mut responded => Ok(answered),
            () = tokio::time::sleep(limit) => Err(()),
        };
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
            Ok(Ok(response)) => {
                pool.responded(in_flight, dispatched.elapsed());
                if let Some(upload) = upload {
                    lease.reuse_once_sent(upload);
                }
                return Ok((response, lease));
            }
            Ok(Err(mut failed)) => {
                lease.forbid_reuse();
                drop(lease);
                if let Some(unsent) = failed.take_message() {
                    if reused && attempts_left > 0 {
                        pool.metrics.retried_unsent.inc();
                        request = unsent;
                        lease = readmit(pool, false).await?;
                        continue;
                    }
                } else if reused {
                    if let Some(again) = replay.take().map(ReplayHead::rebuild) {
                        tracing::debug!(upstream = %pool.name, "retrying an idempotent request on a fresh connection");
                        pool.metrics.replayed.inc();
                        request = again;
                        lease = readmit(pool, true).await?;
                        continue;
                    }
                }
                let err = failed.into_error();
                return Err(forward::client_body_failure(&err).unwrap_or(ProxyError::Upstream(err)));
            }
        }
    }
}

/// An exchange whose client was answered `504`: the upstream is still working on it, and a thread-per-connection
/// upstream runs it on a thread of its own until it is done. The lease (and its slot) is kept until then: the late
/// answer is read and discarded within `abort_drain_timeout` and `abort_drain_bytes`, and the connection reused if
/// it is whole; otherwise it is closed once the upstream has closed its side. So the upstream never works on more
/// requests than the cap, and no new connection is dialled beside one still busy.
async fn finish_abandoned<F>(response: Pin<Box<F>>, mut lease: Lease)
where
    F: Future<Output = Result<Response<Incoming>, hyper::client::conn::TrySendError<Request<RequestBody>>>>,
{
    let (max_bytes, limit) = {
        let limits = lease.pool().limits();
        (limits.abort_drain_bytes, limits.abort_drain_timeout)
    };
    let read_whole = tokio::time::timeout(limit, async {
        let response = response.await.ok()?;
        let reusable = forward::keeps_alive(response.version(), response.headers());
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

/// A retry goes to the front of the queue: it was admitted once already. `fresh` keeps it off long-idle
/// connections, which may have been closed by the upstream like the one that just failed.
async fn readmit(pool: &Arc<UpstreamPool>, fresh: bool) -> Result<Lease, ProxyError> {
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

/// The head of a GET/HEAD without a body, kept to resend it if a reused connection fails after sending.
struct ReplayHead {
    method: Method,
    uri: http::Uri,
    headers: http::HeaderMap,
}

impl ReplayHead {
    fn rebuild(self) -> Request<RequestBody> {
        let mut request = Request::new(RequestBody::empty());
        *request.method_mut() = self.method;
        *request.uri_mut() = self.uri;
        *request.headers_mut() = self.headers;
        request
    }
}

fn replayable(request: &Request<RequestBody>) -> Option<ReplayHead> {
    let idempotent = request.method() == Method::GET || request.method() == Method::HEAD;
    (idempotent && request.body().is_end_stream()).then(|| ReplayHead {
        method: request.method().clone(),
        uri: request.uri().clone(),
        headers: request.headers().clone(),
    })
}

/// Counts a client abort (and writes its access line) if dropped before [`AbortWatch::disarm`], which hands the
/// access-log entry back.
struct AbortWatch<'a> {
    counters: Option<&'a OutcomeCounters>,
    access: Option<Box<Entry>>,
}

impl<'a> AbortWatch<'a> {
    fn new(counters: &'a OutcomeCounters, access: Option<Box<Entry>>) -> Self {
        AbortWatch {
            counters: Some(counters),
            access,
        }
    }

    fn disarm(mut self) -> Option<Box<Entry>> {
        self.counters = None;
        self.access.take()
    }
}

impl Drop for AbortWatch<'_> {
    fn drop(&mut self) {
        if let Some(counters) = self.counters {
            forward::complete(counters, None, self.access.take(), Outcome::ClientAbort, 0);
        }
    }
}

/// The proxy's own answer to an error, counted under `counters` and logged like any other request.
fn answer_locally(
    counters: &OutcomeCounters,
    err: ProxyError,
    advice: Option<&ShedAdvice>,
    access: Option<Box<Entry>>,
) -> Response<ResponseBody> {
    let response = forward::local_response(&err, advice);
    // The body of a local answer is the reason's text.
    let bytes = err.reason().len() as u64;
    forward::complete(counters, Some(response.status()), access, err.outcome(), bytes);
    response
}
