//! The request's path through floodgate, in one place: [`Proxy::arrive`] (the tunnel check, the target's dot
//! segments resolved, the route, the request's record and span) → `rewrite` → the small body read → admission →
//! the exchange, in the upstream lane (`exchange`) → the answer; an upgrade's own steps in `tunnel`.
//!
//! Owns the order of the steps and the one place where a [`ProxyError`] becomes a response
//! ([`Proxy::answer`]); what a request's end counts is its [`Record`]'s. A client that leaves while its
//! request is at the upstream does not cancel the exchange: its remainder is spawned, the response is still read
//! to its end and the connection reused.

mod exchange;
mod tunnel;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::{ArcSwap, Guard};

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use http::{header, HeaderValue, Method, Request, Response, Version};
use hyper::body::Body;
use tokio::sync::oneshot;
use tracing::field::display;

use crate::access::Entry;
use crate::activity::InFlight;
use crate::admission::{self, Patience, Place, Shed};
use crate::body::ClientBody;
use crate::buffer::BufferBudget;
use crate::config::{Config, FairKey, UpstreamConfig, MAX_PRIORITY};
use crate::error::{Outcome, ProxyError};
use crate::forward::{self, ClientInfo, ResponseBody};
use crate::metrics::Metrics;
use crate::pool::{Admitted, Refused, UpstreamPool};
use crate::record::Record;
use crate::route::{Picked, RouteSettings, Router};
use crate::upstream_lane::UpstreamLane;

pub(crate) use exchange::Answer;
use exchange::{AdmittedExchange, Rest};

/// The request span's target. It is at `debug`: made at every request, it costs about a sixth of floodgate's own
/// work on a response (docs/testing.md), and at `info` almost no line is written while a request is handled.
/// `log_level = "info,floodgate::request=debug"` turns it on alone.
const SPAN_TARGET: &str = "floodgate::request";

/// A request as it arrived ([`Proxy::arrive`]): its route (or why it has none), the protocol it asks to switch
/// to, its record and its span, which the caller's future is made in.
pub(crate) struct Arrival {
    pub(crate) routed: Result<(Arc<UpstreamPool>, Picked), ProxyError>,
    pub(crate) upgrade: Option<HeaderValue>,
    pub(crate) record: Record,
    pub(crate) span: tracing::Span,
}

/// What a request takes from its upstream's settings and its route.
struct Bounds {
    buffer_limit: u64,
    request_timeout: Duration,
    queue_timeout: Duration,
    client_deadline: Option<tokio::time::Instant>,
    place: Place,
}

/// Everything a request needs, shared by all connections. The router and the trusted proxies are replaced whole
/// by a reload; a request reads each once.
pub struct Proxy {
    router: ArcSwap<Router>,
    pub metrics: Arc<Metrics>,
    trusted_proxies: ArcSwap<Vec<ipnet::IpNet>>,
    /// Pools a reload retired, kept for `/status` and shutdown until they have drained.
    draining: Mutex<Vec<Arc<UpstreamPool>>>,
    /// Whether requests write an access-log line, and in which style.
    access_log: Option<Arc<crate::access::Settings>>,
    /// The bound on body bytes held in memory, shared by every request.
    buffers: Arc<BufferBudget>,
    shed_warned_at: AtomicU64,
    started: Instant,
    /// Where admitted exchanges run, ahead of the client connections (see [`crate::upstream_lane`]).
    lane: Arc<UpstreamLane>,
    /// Tunnels whose client is on hyper's HTTP/2 server, each run in a task of its own; shutdown waits for them
    /// as for the client connections (floodgate's own HTTP/1 server runs a tunnel on its connection's task).
    tunnels: tokio_util::task::TaskTracker,
    /// Cancelled when `shutdown_timeout` has passed: every tunnel still open ends then, its line written.
    tunnel_stop: tokio_util::sync::CancellationToken,
    /// With `otlp_endpoint`: each request's span, exported.
    tracing: Option<Arc<crate::trace::Tracing>>,
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
            access_log: None,
            shed_warned_at: AtomicU64::new(0),
            started: Instant::now(),
            lane,
            tunnels: tokio_util::task::TaskTracker::new(),
            tunnel_stop: tokio_util::sync::CancellationToken::new(),
            tracing: None,
        }
    }

    /// Where pools run their connections and admitted exchanges run.
    pub fn lane(&self) -> &Arc<UpstreamLane> {
        &self.lane
    }

    /// The tasks of tunnels whose clients are on hyper's HTTP/2 server.
    pub fn tunnel_tasks(&self) -> &tokio_util::task::TaskTracker {
        &self.tunnels
    }

    /// Ends every tunnel still open (`shutdown_timeout` has passed).
    pub fn stop_tunnels(&self) {
        self.tunnel_stop.cancel();
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

    pub(crate) fn with_tracing(mut self, tracing: Option<Arc<crate::trace::Tracing>>) -> Self {
        self.tracing = tracing;
        self
    }

    /// The tracer, when traces are exported.
    pub(crate) fn tracing(&self) -> Option<&crate::trace::Tracing> {
        self.tracing.as_deref()
    }

    pub fn with_access_log(mut self, settings: Option<Arc<crate::access::Settings>>) -> Self {
        self.access_log = settings;
        self
    }

    /// The bound on body bytes held in memory (`max_buffered_bytes`); a reload changes it in place.
    pub fn buffers(&self) -> &BufferBudget {
        &self.buffers
    }

    pub fn is_trusted(&self, peer: std::net::IpAddr) -> bool {
        self.trusted_proxies.load().iter().any(|net| net.contains(&peer))
    }

    /// Serves one request from `client`'s connection: [`Proxy::arrive`], [`Proxy::serve_routed`], then
    /// [`Proxy::answer`] (the client's connections take the same steps through `edge`, which boxes them in the
    /// request's span).
    pub async fn serve(
        self: Arc<Self>,
        mut request: Request<ClientBody>,
        client: Arc<ClientInfo>,
    ) -> Response<ResponseBody> {
        let Arrival {
            routed,
            upgrade,
            mut record,
            span: _,
        } = self.arrive(&mut request, &client, None, None);
        let served = AssertUnwindSafe(self.serve_routed(request, &client, routed, upgrade, &mut record))
            .catch_unwind()
            .await;
        self.answer(served.map_err(drop), record)
    }

    /// The steps taken as a request arrives, before its future exists: what it asks to switch to (read once), its
    /// route, and its record and span, made with what the route says (each later record on a span costs about as
    /// much as making it; the fields are read only when the span is on). `id`: its `X-Request-Id`.
    pub(crate) fn arrive(
        &self,
        request: &mut Request<ClientBody>,
        client: &ClientInfo,
        in_flight: Option<InFlight>,
        id: Option<&HeaderValue>,
    ) -> Arrival {
        let mut record = Record::open(self.metrics.clone(), in_flight);
        if forward::is_grpc(request.headers()) {
            record.is_grpc_call();
        }
        let upgrade = crate::tunnel::asked(request);
        if upgrade.is_some() {
            // A tunnel's request is at work for as long as the tunnel: its task keeps the mark, not the answer.
            if let Some(mark) = record.take_in_flight() {
                crate::tunnel::Hold::put(request, mark);
            }
        }
        let routed = self.route(request);
        let exported = self.tracing().map(|tracing| {
            let route = routed.as_ref().ok().map(|(pool, picked)| (&*pool.name, &*picked.label));
            tracing.request(request, client.peer.ip(), route)
        });
        let (route, upstream) = match &routed {
            Ok((pool, picked)) => (Some(display(&picked.label)), Some(display(&pool.name))),
            Err(_) => (None, None),
        };
        let span = tracing::debug_span!(
            target: SPAN_TARGET,
            "request",
            id = %id.and_then(|id| id.to_str().ok()).unwrap_or("-"),
            route,
            upstream,
            outcome = tracing::field::Empty,
        );
        let mut access = Entry::start(self.access_log.as_ref(), client.peer, client.tls, request);
        if let (Some(entry), Some(exported)) = (access.as_mut(), &exported) {
            let (trace_id, span_id) = exported.ids();
            entry.traced(trace_id, span_id);
        }
        record.described(access, span.clone(), exported);
        if let Ok((pool, picked)) = &routed {
            record.routed(pool.clone(), picked.metrics.clone(), &picked.label);
        }
        Arrival {
            routed,
            upgrade,
            record,
            span,
        }
    }

    /// The client's answer to what [`Proxy::serve_routed`] came to (`Err(())`: it panicked), with `record`, which
    /// its end finishes. An error is answered here, the one place a [`ProxyError`] becomes a response. A panic in
    /// floodgate's own code is answered `500`: it ends this request alone, and what it held (a lease, a place in
    /// the queue) was given back as it unwound.
    pub(crate) fn answer(&self, served: Result<Answer, ()>, mut record: Record) -> Response<ResponseBody> {
        let answered = match served {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => self.answer_error(err, &mut record),
            Err(()) => {
                tracing::error!("handling a request panicked; it is answered 500");
                self.answer_error(ProxyError::Internal, &mut record)
            }
        };
        if !record.is_finished() {
            record.answered(answered.status());
            record.answered_with(answered.headers());
        }
        answered.map(|body| body.recorded(record))
    }

    /// A request's path once it has arrived: refused, a tunnel, or rewritten for its upstream, its small body
    /// read, admitted and exchanged. One future on purpose: each future nested in another is moved into it
    /// whole, and a request's future is kilobytes.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice in its state"
    )]
    pub(crate) fn serve_routed<'a>(
        &'a self,
        request: Request<ClientBody>,
        client: &'a Arc<ClientInfo>,
        routed: Result<(Arc<UpstreamPool>, Picked), ProxyError>,
        upgrade: Option<HeaderValue>,
        record: &'a mut Record,
    ) -> impl std::future::Future<Output = Answer> + Send + 'a {
        async move {
            let (pool, picked) = match routed {
                Ok(routed) => routed,
                Err(refused) => {
                    // As for a shed: an HTTP/2 body still coming is read to its end beside the answer.
                    if request.version() == Version::HTTP_2 && !request.body().is_end_stream() {
                        drain_refused(request.into_body());
                    }
                    return Err(refused);
                }
            };
            if let Some(upgrade) = upgrade {
                // Boxed: an upgrade is rare, and its steps would add their size to every request's future.
                return Box::pin(self.serve_tunnel(request, client, &pool, &picked, upgrade, record)).await;
            }
            // A client's own deadline runs from when its request arrived, body reading included.
            let received = tokio::time::Instant::now();
            let marks = request.extensions().get::<crate::trace::Marks>().cloned();
            let is_http1 = request.version() <= Version::HTTP_11;
            // The client asked to hear from us before it sends the body: that answer waits for admission.
            let awaits_continue = request.headers().contains_key(header::EXPECT);
            let mut upstream_request = forward::to_upstream(request, client, &pool)?;
            let route = picked.settings.clone();
            let mut body_unread = !upstream_request.body().is_end_stream();
            rewrite(&mut upstream_request, body_unread, &route, &picked, record);
            let bounds = self.bounds(&pool, &picked, &route, &upstream_request, client, received);
            if body_unread && !awaits_continue {
                // Read before admission, so a client that uploads slowly waits without holding a slot. Over HTTP/2 a
                // body without a length may be a stream the client feeds as answers arrive: it is not waited for.
                // A client that leaves meanwhile drops this future, and its record counts the abort.
                let body = upstream_request.body_mut();
                // Boxed: its state is larger than the rest of the request's, and most requests have no body.
                let all_read =
                    Box::pin(body.buffer(bounds.buffer_limit, is_http1, bounds.request_timeout, &self.buffers)).await?;
                body_unread = !all_read;
            }
            // The queue's clock starts once the body is in: queue_timeout bounds the wait for a slot.
            let arrived = tokio::time::Instant::now();
            let patience = Patience {
                queue_timeout_at: arrived + bounds.queue_timeout,
                client_deadline: bounds.client_deadline,
            };
            // A client's retry beyond its budget goes no further (`retry_budget`); without one, nothing is looked at.
            let admitted = if pool.retry_budget_allows(upstream_request.headers()) {
                Ok(())
            } else {
                Err(ProxyError::Shed(Shed::RetryBudget))
            };
            // Admission decides here and at once; a shed costs the client side nothing more.
            let admitted = admitted.and_then(|()| {
                pool.try_admit(false, patience, &bounds.place)
                    .map_err(|refused| match refused {
                        Refused::Shed(shed) => ProxyError::Shed(shed),
                        Refused::ClientGone => ProxyError::ClientGone,
                    })
            });
            let admitted = match admitted {
                Ok(admitted) => admitted,
                Err(refused) => {
                    if body_unread && !is_http1 {
                        drain_refused((*upstream_request).into_body());
                    }
                    return Err(refused);
                }
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
            let (answer, answered) = oneshot::channel();
            let queued = matches!(admitted, Admitted::Queued(_));
            let admitted = AdmittedExchange {
                admitted,
                patience,
                watched_socket: client.http1_stream.clone().filter(|_| queued && body_unread),
                rest: Rest {
                    arrived,
                    hold_until: patience.gives_up().0,
                    class: bounds.place.class,
                    // Looked at once more when a queued request's turn comes; one granted at once has just been read.
                    recheck_client: client.http1_stream.clone().filter(|_| queued),
                    window_held,
                    request: upstream_request,
                    answer,
                    // An HTTP/2 client can stop a stream without blocking its socket; its body gets a watchdog.
                    watch_body: !is_http1,
                    buffers: self.buffers.clone(),
                    route,
                    marks,
                },
            };
            // On a connection another thread watches, or to open one on a less busy thread: in that thread's lane.
            // Granted at once with most of the cap free: run by this task itself, which the answer then wakes
            // directly (handed to the lane if this task is dropped first). Else started on this task, without a hop,
            // in its thread's lane, which then runs the rest.
            let inline = match admitted.lane_elsewhere() {
                Some(lane) => {
                    lane.spawn_on(admitted.start());
                    None
                }
                None => {
                    let may_run_inline = admitted.may_run_inline();
                    let task = admitted.start();
                    match if may_run_inline {
                        UpstreamLane::inline(task)
                    } else {
                        Err(task)
                    } {
                        Ok(inline) => Some(inline),
                        Err(task) => {
                            self.lane.start_here(task);
                            None
                        }
                    }
                }
            };
            if let Some(inline) = inline {
                inline.await;
            }
            // The upstream side stopped (floodgate is exiting) with the exchange on it.
            let exchanged = answered.await.map_err(|_| ProxyError::Abandoned)?;
            record.admitted(exchanged.admitted);
            exchanged.answer.unwrap_or_else(|| {
                // Its client left while it was queued: it goes unanswered, counted as the client's abort.
                record.finish(Outcome::ClientAbort);
                Ok(forward::local_response(&ProxyError::Shed(Shed::QueueTimeout), None))
            })
        }
    }

    /// Everything a request takes from its upstream's settings and its route, read once; the head is all it needs.
    fn bounds(
        &self,
        pool: &UpstreamPool,
        picked: &Picked,
        route: &RouteSettings,
        request: &Request<forward::RequestBody>,
        client: &ClientInfo,
        received: tokio::time::Instant,
    ) -> Bounds {
        let limits = pool.limits();
        let headers = request.headers();
        Bounds {
            buffer_limit: limits.buffer_request_bytes,
            request_timeout: route.request_timeout.unwrap_or(limits.request_timeout),
            queue_timeout: limits.queue_timeout,
            client_deadline: admission::client_timeout(headers, limits.deadline_header.as_ref(), limits.grpc_timeout)
                .map(|timeout| received + timeout),
            place: place(&limits, picked, headers, client, &self.trusted_proxies.load()),
        }
    }

    /// The steps before admission: a forward-proxy CONNECT refused, the upstream picked, the head rewritten for it.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn prepare(
        &self,
        mut request: Request<ClientBody>,
        client: &ClientInfo,
    ) -> Result<(Arc<UpstreamPool>, Picked, forward::UpstreamRequest), ProxyError> {
        let (pool, picked) = self.route(&mut request)?;
        let upstream_request = forward::to_upstream(request, client, &pool)?;
        Ok((pool, picked, upstream_request))
    }

    /// Which upstream and route `request` goes to, once the checks that come before routing pass (a forward-proxy
    /// CONNECT refused, a sound target and Host). The target's dot segments are resolved in place first, so the
    /// path the route is picked by is the one that goes upstream. Decided before the request's span opens, so the
    /// span carries them.
    pub(crate) fn route<B>(&self, request: &mut Request<B>) -> Result<(Arc<UpstreamPool>, Picked), ProxyError> {
        if request.method() == Method::CONNECT && !crate::tunnel::extended_connect(request) {
            return Err(ProxyError::ConnectRefused);
        }
        // Before routing: an authority-form target must not pick a route by its authority.
        forward::check_target(request.method(), request.uri())?;
        forward::resolve_dot_segments(request.uri_mut())?;
        let host = forward::check_host(request.uri(), request.headers())?;
        forward::check_transfer_coding(request.headers())?;
        let router = self.router();
        let (pool, picked) = router
            .pick_route(host, request.uri().path())
            .ok_or(ProxyError::NoRoute)?;
        Ok((pool.clone(), picked.clone()))
    }

    /// A [`ProxyError`] as floodgate's own answer, counted on `record` (under its upstream when it has one), with
    /// the upstream's advice when the request was shed.
    fn answer_error(&self, err: ProxyError, record: &mut Record) -> Response<ResponseBody> {
        let pool = record.pool();
        let advice = match (&err, pool) {
            (ProxyError::Shed(shed), Some(pool)) => {
                self.warn_shed(pool, *shed);
                Some(pool.shed_advice())
            }
            (_, Some(pool)) => {
                tracing::debug!(upstream = %pool.name, error = %err, "request failed");
                None
            }
            (_, None) => None,
        };
        let response = match err.shed() {
            Some(_) if record.grpc() => forward::grpc_shed_response(&err, advice.as_ref()),
            _ => {
                // The body of a local answer is the reason's text.
                record.relayed(err.reason().len());
                forward::local_response(&err, advice.as_ref())
            }
        };
        record.answered(response.status());
        record.finish(err.outcome());
        response
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

/// An HTTP/2 request refused at arrival whose body is still coming (a gRPC call's end is often a DATA frame of its
/// own, just behind its head): read to its end, a little of it at most and for a moment, beside the answer. Dropped
/// unread, its stream would be reset with the client's last frame still on the way, and h2 ends a connection that
/// has reset past a bound of streams itself (`too_many_internal_resets`): a shed storm would cut every call on it.
fn drain_refused<B>(mut body: B)
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
{
    tokio::spawn(async move {
        let mut left: usize = 64 * 1024;
        let drained = async {
            while let Some(Ok(frame)) = http_body_util::BodyExt::frame(&mut body).await {
                let read = frame.data_ref().map_or(0, |data| data.len());
                match left.checked_sub(read) {
                    Some(rest) => left = rest,
                    None => return,
                }
            }
        };
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), drained).await;
    });
}

/// The route's own edits to the head (the names that alias `X-Forwarded-*` with `_` dropped first), and its
/// request body (`body_unread`: one is still to come) counted in its metrics (and for the request's access-log
/// line, when there is one) and bounded by its `body_idle_timeout`.
fn rewrite(
    request: &mut Request<forward::RequestBody>,
    body_unread: bool,
    route: &RouteSettings,
    picked: &Picked,
    record: &mut Record,
) {
    if body_unread {
        let route_bytes = picked.metrics.request_bytes.clone();
        request
            .body_mut()
            .counted_in(route_bytes, record.request_body_counter());
    }
    if !route.edits_nothing() {
        forward::drop_underscore_aliases(request.headers_mut(), &route.guarded_request);
        // The target is taken out for a moment (a default `Uri` costs nothing) so both halves can be edited.
        let mut target = std::mem::take(request.uri_mut());
        route.edit_request(&mut target, request.headers_mut());
        *request.uri_mut() = target;
    }
    if let Some(idle) = route.body_idle_timeout {
        request.body_mut().set_idle_timeout(idle);
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
    let from_header = limits
        .priority_header
        .as_ref()
        .and_then(|header| headers.get(header))
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
