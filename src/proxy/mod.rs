//! The request's path through floodgate, built in one place: tunnel check → target (its dot segments resolved) →
//! route → rewrite → small body read → admission → exchange → answer.
//!
//! Owns the order of the steps and the one place where a [`ProxyError`] becomes a response and is counted. A
//! client that leaves while its request is at the upstream does not cancel the exchange: its remainder is
//! spawned, the response is still read to its end and the connection reused.

mod exchange;
mod tunnel;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::{ArcSwap, Guard};

use http::{header, Method, Request, Response, Version};
use hyper::body::Body;
use tokio::sync::oneshot;

use crate::access::Entry;
use crate::admission::{self, Patience, Place, Shed};
use crate::body::ClientBody;
use crate::buffer::BufferBudget;
use crate::config::{Config, FairKey, UpstreamConfig, MAX_PRIORITY};
use crate::error::ProxyError;
use crate::forward::{self, ClientInfo, ResponseBody};
use crate::metrics::Metrics;
use crate::pool::{Admitted, Refused, UpstreamPool};
use crate::route::{Picked, Router};
use crate::upstream_lane::UpstreamLane;

use exchange::{answer_locally, AbortWatch, AdmittedExchange, Rest};

/// Everything a request needs, shared by all connections. The router and the trusted proxies are replaced whole
/// by a reload; a request reads each once.
pub struct Proxy {
    router: ArcSwap<Router>,
    pub metrics: Arc<Metrics>,
    trusted_proxies: ArcSwap<Vec<ipnet::IpNet>>,
    /// Pools a reload retired, kept for `/status` and shutdown until they have drained.
    draining: Mutex<Vec<Arc<UpstreamPool>>>,
    /// Whether requests write an access-log line, and in which style.
    access_log: Option<crate::access::Style>,
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

    pub fn with_access_log(mut self, style: Option<crate::access::Style>) -> Self {
        self.access_log = style;
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
    pub async fn serve(
        self: Arc<Self>,
        mut request: Request<ClientBody>,
        client: Arc<ClientInfo>,
    ) -> Response<ResponseBody> {
        let routed = self.route(&mut request);
        let upgrade = crate::tunnel::asked(&request);
        self.serve_routed(request, client, routed, upgrade).await
    }

    /// Serves one request already routed (or refused) by [`Proxy::route`], with what it asks to switch to
    /// ([`crate::tunnel::asked`], read once by the caller).
    pub async fn serve_routed(
        self: Arc<Self>,
        request: Request<ClientBody>,
        client: Arc<ClientInfo>,
        routed: Result<(Arc<UpstreamPool>, Picked), ProxyError>,
        upgrade: Option<http::HeaderValue>,
    ) -> Response<ResponseBody> {
        if let Some(upgrade) = upgrade {
            // Boxed: an upgrade is rare, and its steps would add their size to every request's future.
            return Box::pin(self.serve_tunnel(request, client, routed, upgrade)).await;
        }
        // A client's own deadline runs from when its request arrived, body reading included.
        let received = tokio::time::Instant::now();
        let marks = request.extensions().get::<crate::trace::Marks>().cloned();
        let mut body_unread = !request.body().is_end_stream();
        let is_http1 = request.version() <= Version::HTTP_11;
        // The client asked to hear from us before it sends the body: that answer waits for admission.
        let awaits_continue = request.headers().contains_key(header::EXPECT);
        let mut access = Entry::start(self.access_log, client.peer, &request);
        let prepared = routed.and_then(|(pool, picked)| {
            let upstream_request = forward::to_upstream(request, &client, &pool)?;
            Ok((pool, picked, upstream_request))
        });
        let (pool, picked, mut upstream_request) = match prepared {
            Ok(prepared) => prepared,
            Err(err) => return self.refuse(err, access),
        };
        if let Some(entry) = access.as_mut() {
            entry.routed(&pool.name);
        }
        if body_unread {
            upstream_request
                .body_mut()
                .counted_in(picked.metrics.request_bytes.clone());
        }
        let route = picked.settings.clone();
        if !route.edits_nothing() {
            let (mut parts, body) = upstream_request.into_parts();
            forward::drop_underscore_aliases(&mut parts.headers, &route.guarded_request);
            route.edit_request(&mut parts.uri, &mut parts.headers);
            upstream_request = Request::from_parts(parts, body);
        }
        if let Some(idle) = route.body_idle_timeout {
            upstream_request.body_mut().set_idle_timeout(idle);
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
                route.request_timeout.unwrap_or(limits.request_timeout),
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
        let (answer, answered) = oneshot::channel();
        let queued = matches!(admitted, Admitted::Queued(_));
        let admitted = AdmittedExchange {
            admitted,
            patience,
            watched_socket: client.http1_stream.clone().filter(|_| queued && body_unread),
            rest: Rest {
                arrived,
                class: place.class,
                // Looked at once more when a queued request's turn comes; one granted at once has just been read.
                recheck_client: client.http1_stream.clone().filter(|_| queued),
                window_held,
                request: upstream_request,
                access,
                answer,
                // An HTTP/2 client can stop a stream without blocking its socket; its body gets a watchdog.
                watch_body: !is_http1,
                buffers: self.buffers.clone(),
                route,
                span: tracing::Span::current(),
                marks,
            },
        };
        self.lane.spawn(admitted.start());
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

    /// The steps before admission: a forward-proxy CONNECT refused, the upstream picked, the head rewritten for it.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn prepare(
        &self,
        mut request: Request<ClientBody>,
        client: &ClientInfo,
    ) -> Result<(Arc<UpstreamPool>, Picked, Request<forward::RequestBody>), ProxyError> {
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
        forward::check_host(request.uri(), request.headers())?;
        forward::check_transfer_coding(request.headers())?;
        let host = forward::target_host(request.uri(), request.headers());
        let router = self.router();
        let (pool, picked) = router
            .pick_route(host, request.uri().path())
            .ok_or(ProxyError::NoRoute)?;
        Ok((pool.clone(), picked.clone()))
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
