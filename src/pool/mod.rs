//! The bounded pool of one upstream: its slots, its idle connections and the queue that waits for either.
//!
//! Owns the one invariant: at most `max_connections` TCP connections to the upstream exist at any instant, counting
//! ones being dialled, busy, idle and still closing (and beside them at most `max_tunnels` tunnels' sockets, counted
//! apart: `tunnels`). `slots::Slots` holds the counts and is the only code that changes them; a [`Slot`] stands for
//! one count and gives it back when dropped; whatever comes back to the pool
//! enters through one door (`handoff`). It never builds requests or answers: that is `forward`'s job. The rules
//! for endpoints, changed caps and the adaptive limit are in `docs/architecture.md`.

mod adaptive;
mod admit;
mod budget;
pub(crate) mod client;
pub(crate) mod client_h2;
mod connection;
mod discovery;
mod endpoints;
mod handoff;
mod health;
mod idle;
mod lease;
mod limits;
mod lineage;
mod membership;
mod prewarm;
mod replicas;
mod session;
mod slot;
mod slots;
mod slow_start;
mod snapshot;
mod stall;
#[cfg(test)]
mod tests;
mod tunnels;
pub(crate) mod wire;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::{ArcSwap, ArcSwapOption, Guard};
use http::HeaderValue;

pub use crate::status::{AdaptiveSnapshot, EndpointSnapshot, PoolSnapshot};
pub use admit::{Admitted, LeaseTaker, Queued};
pub use connection::Conn;
pub(crate) use connection::StreamLive;
pub use endpoints::EndpointAdmin;
pub use lease::Lease;
pub use slot::Slot;

use endpoints::EndpointState;
use handoff::Back;
use idle::{expire_idle, IdleConn};
use slots::Slots;

use crate::admission::{QueuePolicy, Shed, WaitQueue};
use crate::config::{Origin, UpstreamConfig};
use crate::metrics::UpstreamMetrics;
use crate::tls::UpstreamTls;
use crate::upstream_lane::Spawner;

/// What an admitted request is handed: a connection ready for reuse, or the right to dial a new one.
pub enum Grant {
    Idle(Conn),
    Dial(Slot),
}

/// Why a request left the queue without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Shed(Shed),
    ClientGone,
}

struct PoolState {
    /// The cap's counts: the only place they change.
    slots: Slots,
    /// This pool's tunnels open now (their bound is the shared [`tunnels::TunnelCount`]'s).
    tunnels_open: usize,
    /// Per endpoint, in the order of [`UpstreamPool::endpoints`]: its health.
    endpoints: Vec<EndpointState>,
    /// The upstream was removed or replaced: no connection is kept once it comes free.
    retired: bool,
    /// Leases granted and not yet ended, grants on their way to a waiter included: the requests in flight, and
    /// what the adaptive limit bounds.
    leased: usize,
    /// The adaptive limit in force; `usize::MAX` without one.
    limit: usize,
    /// Most recently used at the back; the front is the first to expire.
    idle: VecDeque<IdleConn>,
    queue: WaitQueue<Grant>,
}

/// One upstream's pool, admission queue and counters.
pub struct UpstreamPool {
    pub name: Arc<str>,
    /// The first endpoint's origin: the scheme every endpoint shares, and the default Host header.
    pub origin: Origin,
    /// Every endpoint with its own cap, by its place (the one [`Slots`] and [`PoolState`] know it by): changed in
    /// place (`membership`), a gone one's place kept until it is reused.
    endpoints: ArcSwap<Vec<(Origin, usize)>>,
    /// Endpoints of the upstream now (not gone).
    live_endpoints: AtomicUsize,
    /// The active health checks' task runs.
    health_running: std::sync::atomic::AtomicBool,
    /// Host header for requests that arrived without one (HTTP/1.0).
    pub authority: HeaderValue,
    /// Everything but the cap is read from here at the moment it applies; the cap lives under the lock.
    limits: ArcSwap<UpstreamConfig>,
    pub metrics: UpstreamMetrics,
    /// The TLS client of an `https://` upstream: every dial runs its handshake before the connection is used.
    /// Replaced by a reload, which reads the certificates again; connections made before keep their session.
    tls: ArcSwapOption<UpstreamTls>,
    state: Mutex<PoolState>,
    queue_peak: AtomicUsize,
    requests_total: AtomicU64,
    /// Moving average of how long an admitted request holds its slot, in microseconds (0: none seen yet).
    hold_us: AtomicU64,
    adaptive: adaptive::Adaptive,
    /// When an exchange last finished, for the stall guard.
    progress: stall::Progress,
    /// Prewarm dials under way (`min_idle`).
    prewarming: prewarm::Prewarming,
    /// The clients' retries' budget (`retry_budget`).
    retry_tokens: budget::RetryTokens,
    /// Endpoints under slow start now: while 0, an answer looks at no ramp.
    ramps: AtomicUsize,
    /// Told when a retired pool's last connection has closed.
    emptied: tokio::sync::Notify,
    /// Where the pool's tasks run (its connections, their closing, its timers): the upstream lane when floodgate
    /// builds it, else the runtime it was built in.
    spawner: Spawner,
    /// Connections let go of, to the task that closes them ([`connection::close_connections`]).
    closer: tokio::sync::mpsc::UnboundedSender<connection::Closing>,
    /// Where idle connections' watches tell of a stir (to the same task); the wires hold weak handles of it.
    stirs: tokio::sync::mpsc::UnboundedSender<std::sync::Weak<wire::Wire>>,
    /// The tunnels' count under `max_tunnels`, shared with the pool this one replaced (see [`tunnels`]).
    tunnel_count: Arc<tunnels::TunnelCount>,
    /// floodgate's replicas this one shares the upstream's caps with (1 without `replicas`; see [`replicas`]).
    replicas: AtomicUsize,
    /// A task reads the replica count.
    replica_watch: std::sync::atomic::AtomicBool,
    /// Why the last count read was not taken (`None` while counts are): what the log last said about the source.
    replica_count_refused: Mutex<Option<replicas::Uncounted>>,
    /// A task resolves the endpoints (`endpoints = { dns = ... }`).
    discovering: std::sync::atomic::AtomicBool,
    /// Why the last resolution was not taken (`None` while they are).
    discovery_refused: Mutex<Option<discovery::Unresolved>>,
}

impl UpstreamPool {
    /// `tls` is [`crate::tls::upstream_client`]'s, built for this origin (`None` for `http://`).
    pub fn new(
        name: &str,
        origin: Origin,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        Self::with_endpoints(name, vec![(origin, usize::MAX)], limits, tls, metrics)
    }

    /// A pool over several endpoints, each with its own cap (see [`UpstreamConfig::endpoint_list`]); they share
    /// `tls` and the first one's origin is the pool's. An empty list is one endpoint nobody can dial.
    pub fn with_endpoints(
        name: &str,
        endpoints: Vec<(Origin, usize)>,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        Self::with_endpoints_on(name, endpoints, limits, tls, metrics, Spawner::current(), None)
    }

    /// [`Self::with_endpoints`], its tasks run by `spawner` (floodgate's upstream lane); `replaces`: the pool of
    /// the same name a reload retires for this one, whose open tunnels count against this one's bound.
    pub fn with_endpoints_on(
        name: &str,
        endpoints: Vec<(Origin, usize)>,
        limits: UpstreamConfig,
        tls: Option<UpstreamTls>,
        metrics: UpstreamMetrics,
        spawner: Spawner,
        replaces: Option<&UpstreamPool>,
    ) -> Arc<Self> {
        // Discovered endpoints: the name and port are the upstream's origin, whatever addresses they have now.
        let origin = match (limits.endpoints.dns(), endpoints.first()) {
            (Some(dns), _) => dns.origin(),
            (None, Some((origin, _))) => origin.clone(),
            (None, None) => Origin {
                scheme: crate::config::Scheme::Http,
                host: "0.0.0.0".into(),
                port: 9,
            },
        };
        let endpoint_states = endpoints.iter().map(|_| EndpointState::default()).collect();
        for (origin, _) in &endpoints {
            metrics.endpoint_known(&origin.authority());
        }
        // A pool that replaces one of the same name starts from its replica count; one never counted takes the
        // least share (0 replicas) until its first count, never the whole total.
        let replicas = match replaces {
            Some(old) if old.limits().replicas.is_some() => old.replicas(),
            _ if limits.replicas.is_some() => 0,
            _ => 1,
        };
        // A pool that replaces one of the same name is its upstream's next generation: the old one's sockets,
        // until they close, count against this one's cap (see [`lineage`]).
        let addresses: Vec<(String, usize)> = endpoints
            .iter()
            .map(|(origin, cap)| (origin.authority(), *cap))
            .collect();
        let slots = Slots::for_endpoints(
            replicas::share(limits.max_connections, replicas),
            &addresses,
            replaces.map(|old| old.lock().slots.lineage().clone()),
        );
        let authority =
            HeaderValue::from_str(&origin.authority()).unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        let adaptive = adaptive::Adaptive::new(adaptive::Params::of(&limits));
        let max_tunnels = replicas::share(limits.max_tunnels, replicas);
        let tunnel_count = match replaces {
            Some(old) => {
                old.tunnel_count.set_bound(max_tunnels);
                old.tunnel_count.clone()
            }
            None => Arc::new(tunnels::TunnelCount::new(max_tunnels)),
        };
        let (closer, closings) = tokio::sync::mpsc::unbounded_channel();
        let (stirs, stirred) = tokio::sync::mpsc::unbounded_channel();
        let pool = Arc::new(UpstreamPool {
            name: Arc::from(name),
            authority,
            state: Mutex::new(PoolState {
                slots,
                tunnels_open: 0,
                endpoints: endpoint_states,
                retired: false,
                leased: 0,
                limit: adaptive.in_force(),
                idle: VecDeque::new(),
                queue: WaitQueue::new(QueuePolicy::of(&limits)),
            }),
            origin,
            live_endpoints: AtomicUsize::new(endpoints.len()),
            health_running: std::sync::atomic::AtomicBool::new(false),
            endpoints: ArcSwap::from_pointee(endpoints),
            limits: ArcSwap::from_pointee(limits),
            metrics,
            tls: ArcSwapOption::new(tls.map(Arc::new)),
            queue_peak: AtomicUsize::new(0),
            requests_total: AtomicU64::new(0),
            hold_us: AtomicU64::new(0),
            adaptive,
            progress: stall::Progress::new(),
            prewarming: prewarm::Prewarming::new(0),
            retry_tokens: budget::RetryTokens::new(),
            ramps: AtomicUsize::new(0),
            emptied: tokio::sync::Notify::new(),
            spawner,
            closer,
            stirs,
            tunnel_count,
            replicas: AtomicUsize::new(replicas),
            replica_watch: std::sync::atomic::AtomicBool::new(false),
            replica_count_refused: Mutex::new(None),
            discovering: std::sync::atomic::AtomicBool::new(false),
            discovery_refused: Mutex::new(None),
        });
        {
            let state = pool.lock();
            state
                .slots
                .lineage()
                .joined(state.slots.generation(), Arc::downgrade(&pool));
        }
        pool.spawn(connection::close_connections(closings, stirred, Arc::downgrade(&pool)));
        pool.spawn(expire_idle(Arc::downgrade(&pool)));
        pool.spawn(stall::watch_stalls(Arc::downgrade(&pool)));
        // Before the prewarm, which dials within the ramps' caps.
        pool.start_ramps(replaces);
        pool.prewarm();
        pool.check_health_if_several();
        pool
    }

    /// Runs `task` where the pool's connections run, whichever task the caller is on.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.spawner.spawn(task);
    }

    /// [`UpstreamPool::spawn`] for work already boxed.
    pub(crate) fn spawn_boxed(&self, task: crate::upstream_lane::Task) {
        self.spawner.spawn_boxed(task);
    }

    /// Closes a connection let go of, in the closing task; never gives its slot back on the spot (the caller may
    /// hold the pool's lock).
    fn close_later(&self, closing: connection::Closing) {
        if let Err(refused) = self.closer.send(closing) {
            // The closing task is gone only when nothing runs the pool's tasks any more (floodgate is exiting):
            // giving the slot back here could take the lock its caller holds. The process's end closes the socket.
            std::mem::forget(refused.0);
        }
    }

    /// Every endpoint's place with its origin and own cap, gone ones included (see [`Self::live_endpoints`]).
    pub fn endpoints(&self) -> Arc<Vec<(Origin, usize)>> {
        self.endpoints.load_full()
    }

    /// The upstream's endpoints now, with their own caps.
    pub fn live_endpoints(&self) -> Vec<(Origin, usize)> {
        let list = self.endpoints();
        let state = self.lock();
        list.iter()
            .enumerate()
            .filter(|(at, _)| !state.slots.is_gone(*at))
            .map(|(_, endpoint)| endpoint.clone())
            .collect()
    }

    /// How many endpoints the upstream has now; cheap enough for every request.
    pub fn endpoint_count(&self) -> usize {
        self.live_endpoints.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts the active health checks once the upstream has more than one endpoint (they eject only then).
    fn check_health_if_several(self: &Arc<Self>) {
        if self.endpoint_count() > 1 && !self.health_running.swap(true, std::sync::atomic::Ordering::AcqRel) {
            self.spawn(health::run(Arc::downgrade(self)));
        }
    }

    /// The limits in force (timeouts, queue bounds, connection lifetime); cheap enough for every request.
    pub fn limits(&self) -> Guard<Arc<UpstreamConfig>> {
        self.limits.load()
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the counts half-updated (each update is one statement),
        // so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Whether two endpoint lists hold the same endpoints, whatever their order.
pub(crate) fn same_set<T: PartialEq>(running: &[T], new: &[T]) -> bool {
    let count = |list: &[T], endpoint: &T| list.iter().filter(|other| *other == endpoint).count();
    running.len() == new.len()
        && running
            .iter()
            .all(|endpoint| count(running, endpoint) == count(new, endpoint))
}

impl PoolState {
    /// Retired, with no socket left: no connection and no tunnel.
    fn is_empty(&self) -> bool {
        self.retired && self.slots.open() == 0 && self.tunnels_open == 0
    }

    /// Counts `conn` as closing until its slot is back (see [`Slots::start_closing`]). Uncounted, a connection on
    /// its way out would pass for a live one, and a lowered cap would close connections it should keep.
    fn start_closing(&mut self, conn: &Conn) {
        self.slots.start_closing(&conn.closing, conn.endpoint);
        // An HTTP/2 session goes as a whole: no new stream on it, and its idle permits leave the list (dropped
        // here; a permit's drop never calls back into the pool), so it closes once its streams at work are over.
        if let Some(session) = conn.session() {
            session.give_up();
            self.idle.retain(|idle| !idle.conn.same_session(conn));
        }
    }
}
