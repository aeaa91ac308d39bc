//! The upstream lane: one future that runs every upstream connection and the admitted exchanges, scheduled ahead
//! of the client connections' tasks, so that refusing a flood of new requests never delays the work already
//! admitted (`docs/storm.md` has the mechanism and the figures). An exchange the proxy lets its client's task run
//! itself ([`UpstreamLane::inline`], most of its upstream's cap free) comes here only if that task is dropped first.
//!
//! On a current-thread runtime the lane is part of the `block_on` future ([`crate::server::Floodgate::run`]),
//! which tokio polls before each batch of `event_interval` tasks: at light load nothing changes threads. With
//! `--threads` above one, each worker thread is such a runtime with a lane of its own ([`UpstreamLane::make_here`]),
//! and work is spawned into the lane of the thread that spawns it, so an exchange runs where its client is; a
//! client's task takes its exchange's first steps itself, inside its thread's lane ([`UpstreamLane::start_here`]),
//! so starting one costs no wake of the lane. On a multi-thread runtime (a library user's) the lane gets a thread
//! and an I/O driver of its own ([`UpstreamLane::start_thread`]). It owns no policy: what runs here is decided by the proxy and the pool.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::sync::mpsc;

/// A unit of upstream work, boxed.
pub type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

thread_local! {
    /// The lane of the worker thread this is, on floodgate's worker threads (`server::workers`).
    static HERE: RefCell<Option<Arc<UpstreamLane>>> = const { RefCell::new(None) };
}

/// Every lane that is running (on a worker thread, or a lane thread of its own), for choosing where a new upstream
/// connection is opened; a lane joins it when its `run` starts and leaves it when that stops. Process-wide: one
/// server per process runs worker threads (the binary's `main`).
static WORKER_LANES: Mutex<Vec<std::sync::Weak<UpstreamLane>>> = Mutex::new(Vec::new());

/// How much busier (in tasks) this thread's lane must be than the least busy one before a new connection is opened
/// there instead: a quarter more, and at least this many more, so that a balanced set never trades work (each move
/// wakes another thread).
const BALANCE_SLACK: usize = 2;

/// Whether a lane with `mine` tasks is much busier than one with `theirs`.
fn much_busier(mine: usize, theirs: usize) -> bool {
    mine > theirs + BALANCE_SLACK.max(theirs / 4)
}

/// How many times one poll of the lane takes in what its tasks spawned meanwhile (an upload's rest, an abandoned
/// exchange's drain) and runs it, rather than leaving it for the next turn after a batch of client tasks.
const ROUNDS_PER_POLL: usize = 2;

/// Where upstream work is spawned: the lane a running floodgate drives, or, for a pool used on its own (tests,
/// benches), the tokio runtime it was built in.
#[derive(Clone)]
pub enum Spawner {
    Lane(Arc<UpstreamLane>),
    Runtime(tokio::runtime::Handle),
}

impl Spawner {
    /// The runtime of the caller.
    pub fn current() -> Spawner {
        Spawner::Runtime(tokio::runtime::Handle::current())
    }

    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        match self {
            Spawner::Lane(lane) => lane.spawn(task),
            Spawner::Runtime(runtime) => {
                runtime.spawn(task);
            }
        }
    }

    /// [`Spawner::spawn`] for work already boxed: into a lane as it is, not boxed again.
    pub fn spawn_boxed(&self, task: Task) {
        match self {
            Spawner::Lane(lane) => lane.spawn_boxed(task),
            Spawner::Runtime(runtime) => {
                runtime.spawn(task);
            }
        }
    }
}

/// A lane's task as it runs: a panic ends it alone.
type Guarded = futures_util::future::CatchUnwind<std::panic::AssertUnwindSafe<Task>>;

/// The lane's inbox; [`UpstreamLane::run`] is the future that runs what arrives in it.
pub struct UpstreamLane {
    inbox: mpsc::UnboundedSender<Task>,
    /// Taken by the one [`UpstreamLane::run`].
    tasks: Mutex<Option<mpsc::UnboundedReceiver<Task>>>,
    /// What runs, shared with [`UpstreamLane::start_here`], which its own thread's client tasks call.
    running: Mutex<Running>,
    /// Tasks sent here or started here and not yet ended: how busy the lane is, read without its lock by whoever
    /// chooses between lanes ([`UpstreamLane::load`]).
    load: AtomicUsize,
}

/// Held by a running [`UpstreamLane::run`]: once it ends or is dropped, nothing more starts in the lane directly
/// and what was running is dropped, as it was when the set lived in that future (a lease goes back, a client
/// waiting for an answer hears that the upstream side stopped).
struct Stopped(Arc<UpstreamLane>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let tasks = {
            let mut running = self.0.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            running.waker = None;
            std::mem::take(&mut running.tasks)
        };
        drop(tasks);
        self.0.load.store(0, Ordering::Relaxed);
        // A stopped lane runs nothing sent to it: no new connection may be sent there.
        WORKER_LANES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|known| !std::ptr::eq(known.as_ptr(), Arc::as_ptr(&self.0)));
    }
}

/// The lane's running tasks and the waker of the future that polls them.
struct Running {
    tasks: FuturesUnordered<Guarded>,
    /// The lane's `run` future's, once it has been polled; `None` again once it has ended.
    waker: Option<std::task::Waker>,
}

impl Running {
    /// Polls every task that is ready, counting those that end off `load`; `true` when none is left.
    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>, load: &AtomicUsize) -> bool {
        loop {
            let polled = self.tasks.poll_next_unpin(cx);
            if matches!(polled, Poll::Ready(Some(_))) {
                load.fetch_sub(1, Ordering::Relaxed);
            }
            match polled {
                Poll::Ready(Some(Ok(()))) => {}
                Poll::Ready(Some(Err(_))) => {
                    tracing::error!("a task in the upstream lane panicked; its exchange is abandoned")
                }
                Poll::Ready(None) => return true,
                Poll::Pending => return false,
            }
        }
    }
}

impl UpstreamLane {
    pub fn new() -> Arc<UpstreamLane> {
        let (inbox, tasks) = mpsc::unbounded_channel();
        Arc::new(UpstreamLane {
            inbox,
            tasks: Mutex::new(Some(tasks)),
            running: Mutex::new(Running {
                tasks: FuturesUnordered::new(),
                waker: None,
            }),
            load: AtomicUsize::new(0),
        })
    }

    /// The lane of the worker thread the caller is on, if it is one (`server::workers`).
    pub fn here() -> Option<Arc<UpstreamLane>> {
        HERE.with_borrow(Option::clone)
    }

    /// Whether this is the lane of the worker thread the caller is on.
    pub fn is_here(&self) -> bool {
        HERE.with_borrow(|here| here.as_deref().is_some_and(|here| std::ptr::eq(here, self)))
    }

    /// How many tasks this lane has been given and not yet ended: a measure of how busy its thread is with upstream
    /// work, for choosing between lanes.
    pub fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }

    /// Runs `task` in this lane, whichever thread the caller is on: its thread is woken to take it.
    pub fn spawn_on(&self, task: Task) {
        self.load.fetch_add(1, Ordering::Relaxed);
        if let Err(refused) = self.inbox.send(task) {
            // The lane has stopped: the task is dropped unrun, and never counted as running.
            drop(refused);
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Runs `task` in the lane of the worker thread the caller is on, else in this lane: an exchange stays on its
    /// client's thread, and so does the connection it dials. Once the lane has stopped (floodgate is exiting), the
    /// task is dropped unrun. A task that panics ends alone (what it held is dropped, so its lease and slot go
    /// back): one exchange's bug must not stop every upstream connection.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        // Boxed as it is: an exchange's future is kilobytes, and each wrapper around it before the box is a copy.
        self.spawn_boxed(Box::pin(task));
    }

    /// [`UpstreamLane::spawn`] for work already boxed (made in its box: see `boxed!` in the crate's root).
    pub fn spawn_boxed(&self, task: Task) {
        HERE.with_borrow(|here| here.as_deref().unwrap_or(self).spawn_on(task));
    }

    /// [`UpstreamLane::spawn_boxed`], with the task's first steps taken now when the caller is on the thread that
    /// runs the lane it goes to (a client connection's task starting an exchange): the task joins the lane's
    /// running set and that set's ready tasks are polled here, with the lane's waker, so whatever wakes the task
    /// later wakes the lane. Nothing crosses a channel and the lane is not woken to start it, which at light load
    /// saves a wake and an `epoll_wait` that finds nothing; the lane's tasks ready before it still run first.
    pub fn start_here(&self, task: Task) {
        // Borrowed, not cloned: no reference count moves per request. A lane task polled here that spawns borrows
        // it too, which a RefCell allows.
        HERE.with_borrow(|here| {
            let lane = here.as_deref().unwrap_or(self);
            let task = if here.is_some() { lane.run_now(task) } else { Err(task) };
            if let Err(task) = task {
                lane.spawn_on(task);
            }
        });
    }

    /// `task` to be run by the caller's own task, which awaits it, when the caller is on a thread whose lane is
    /// running (a worker thread's); else `task` back, for [`UpstreamLane::start_here`]. For an exchange granted at
    /// once with most of its upstream's cap free: no task is added to the lane and nothing wakes it, and the answer's
    /// wake-up is the client task's own. If the caller drops it before it ends (its client left), what is left of it
    /// runs on in the thread's lane: an exchange is never cut off while the upstream may work on it.
    pub fn inline(task: Task) -> Result<Inline, Task> {
        let running = HERE.with_borrow(|here| {
            here.as_deref()
                .is_some_and(|lane| lane.running.try_lock().is_ok_and(|running| running.waker.is_some()))
        });
        if running {
            Ok(Inline { task: Some(task) })
        } else {
            Err(task)
        }
    }

    /// Pushes `task` into the running set and polls the set's ready tasks, unless the set is being polled (a lane
    /// task calling this) or is not running (not started, or ended).
    fn run_now(&self, task: Task) -> Result<(), Task> {
        let Ok(mut running) = self.running.try_lock() else {
            return Err(task);
        };
        let Some(waker) = running.waker.clone() else {
            return Err(task);
        };
        self.load.fetch_add(1, Ordering::Relaxed);
        running.tasks.push(std::panic::AssertUnwindSafe(task).catch_unwind());
        running.poll_ready(&mut std::task::Context::from_waker(&waker), &self.load);
        Ok(())
    }

    /// Makes `lane` the one work spawned from this thread runs in; for a worker thread whose runtime's `block_on`
    /// polls `lane.run()`.
    pub fn make_here(lane: Arc<UpstreamLane>) {
        HERE.set(Some(lane));
    }

    /// Where a new upstream connection should be opened instead of this thread's lane: the least busy worker lane,
    /// when this one is much busier (a quarter more tasks and at least 2 more). A connection's exchanges run where it
    /// was opened, so the threads' shares of the work follow where the connections were born.
    pub fn least_busy_elsewhere() -> Option<Arc<UpstreamLane>> {
        let here = Self::here()?;
        let lanes = WORKER_LANES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let least = lanes
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|lane| !Arc::ptr_eq(lane, &here))
            .min_by_key(|lane| lane.load())?;
        much_busier(here.load(), least.load()).then_some(least)
    }

    /// Runs the lane's tasks until the returned future is dropped, or the lane is and its last task has ended; to
    /// be polled as (part of) a current-thread runtime's `block_on` future. Once the lane runs (here or on its own
    /// thread), the returned future runs nothing and never ends.
    pub fn run(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let tasks = self
            .tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        let lane = self.clone();
        async move {
            let Some(mut inbox) = tasks else {
                return std::future::pending().await;
            };
            // The thread that polls this is the one whose client tasks may start work here directly.
            UpstreamLane::make_here(lane.clone());
            // Running from here until `Stopped` takes it out again: new connections may be sent here.
            WORKER_LANES
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(Arc::downgrade(&lane));
            let _stop = Stopped(lane.clone());
            let mut open = true;
            std::future::poll_fn(move |cx| {
                let mut running = lane.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if !running.waker.as_ref().is_some_and(|waker| waker.will_wake(cx.waker())) {
                    running.waker = Some(cx.waker().clone());
                }
                for round in 0..ROUNDS_PER_POLL {
                    let mut took = false;
                    while open {
                        match inbox.poll_recv(cx) {
                            Poll::Ready(Some(task)) => {
                                running.tasks.push(std::panic::AssertUnwindSafe(task).catch_unwind());
                                took = true;
                            }
                            Poll::Ready(None) => open = false,
                            Poll::Pending => break,
                        }
                    }
                    if round > 0 && !took {
                        break;
                    }
                    // Every task that is ready runs now; FuturesUnordered yields by itself after a pass over all
                    // of them, and tokio's cooperative budget bounds the rest.
                    if running.poll_ready(cx, &lane.load) && !open {
                        return Poll::Ready(());
                    }
                }
                // What the last round's tasks spawned waits for the next poll: the inbox, read until it had
                // nothing, holds this poll's waker.
                Poll::Pending
            })
            .await
        }
    }

    /// Runs the lane on a thread of its own, with its own current-thread runtime (and so its own I/O driver for
    /// the upstream sockets, which its tasks open). The thread ends once the lane is dropped and its tasks are done.
    pub fn start_thread(self: &Arc<Self>) -> std::io::Result<()> {
        let lane = self.run();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new()
            .name("floodgate-upstream".into())
            .spawn(move || {
                runtime.block_on(lane);
                // A DNS lookup left in the blocking pool must not hold the process's exit.
                runtime.shutdown_background();
            })?;
        Ok(())
    }
}

/// Upstream work the client's task runs itself ([`UpstreamLane::inline`]); dropped before it ends, it goes on in the
/// lane of the thread it was dropped on.
pub struct Inline {
    task: Option<Task>,
}

impl Future for Inline {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        let Some(task) = self.task.as_mut() else {
            return Poll::Ready(());
        };
        // A task that panicked is not handed on to be polled again: it is dropped, and the panic goes on to the
        // client's task, which answers for it.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) => {
                self.task = None;
                Poll::Ready(())
            }
            Err(panicked) => {
                self.task = None;
                std::panic::resume_unwind(panicked)
            }
        }
    }
}

impl Drop for Inline {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // On the thread whose lane made it (client tasks do not move between floodgate's worker threads). A
            // thread already past its lane (exiting) drops the task, as a stopped lane does.
            let _ = HERE.try_with(|here| {
                if let Some(lane) = here.borrow().as_deref() {
                    lane.spawn_on(task);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::{much_busier, UpstreamLane};

    #[test]
    fn a_new_connection_goes_to_another_lane_only_when_this_one_is_much_busier() {
        // At least BALANCE_SLACK more...
        assert!(!much_busier(4, 2));
        assert!(much_busier(5, 2));
        // ...and a quarter more than a busy lane.
        assert!(!much_busier(20, 16));
        assert!(much_busier(21, 16));
        // Never towards the busier lane.
        assert!(!much_busier(2, 5));
    }

    #[test]
    fn a_lane_is_here_only_on_the_thread_that_runs_it() {
        let lane = UpstreamLane::new();
        let other = UpstreamLane::new();
        let seen = std::thread::spawn({
            let (lane, other) = (lane.clone(), other.clone());
            move || {
                UpstreamLane::make_here(lane.clone());
                (lane.is_here(), other.is_here())
            }
        })
        .join()
        .expect("the thread ran");
        assert_eq!(seen, (true, false));
        // Not on this thread, which runs no lane.
        assert!(!lane.is_here());
    }

    /// A current-thread runtime whose `block_on` polls `lane` beside `body`, as a serving thread's does.
    fn on_serving_thread(lane: &Arc<UpstreamLane>, body: impl std::future::Future<Output = ()>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a test runtime");
        let running = lane.run();
        runtime.block_on(async move {
            tokio::select! {
                biased;
                () = running => panic!("the lane ended while it was still wanted"),
                () = body => {}
            }
        });
    }

    #[test]
    fn a_task_started_from_the_lanes_thread_takes_its_first_steps_at_once_and_the_lane_finishes_it() {
        let lane = UpstreamLane::new();
        let steps = Arc::new(AtomicUsize::new(0));
        let (go_on, told) = tokio::sync::oneshot::channel::<()>();
        let (finished, done) = tokio::sync::oneshot::channel::<()>();
        let task_steps = steps.clone();
        on_serving_thread(&lane, async {
            // The lane has been polled once (it knows its waker) before a client's task starts anything.
            tokio::task::yield_now().await;
            let starting = lane.clone();
            let seen = task_steps.clone();
            tokio::spawn(async move {
                starting.start_here(Box::pin(async move {
                    task_steps.fetch_add(1, Ordering::SeqCst);
                    let _ = told.await;
                    task_steps.fetch_add(1, Ordering::SeqCst);
                    let _ = finished.send(());
                }));
                // Taken here and now, not at the lane's next turn.
                assert_eq!(seen.load(Ordering::SeqCst), 1);
            })
            .await
            .expect("the starting task");
            // The rest is woken and run by the lane: nobody polls it from here.
            let _ = go_on.send(());
            done.await.expect("the lane ran the rest");
        });
        assert_eq!(steps.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn once_the_lane_has_stopped_a_task_started_there_is_dropped_unrun() {
        let lane = UpstreamLane::new();
        let ran = Arc::new(AtomicUsize::new(0));
        let (dropped_tx, mut dropped) = tokio::sync::oneshot::channel::<()>();
        on_serving_thread(&lane, async {
            tokio::task::yield_now().await;
        });
        // The lane's future was dropped with its runtime's block_on: what starts now goes nowhere.
        let task_ran = ran.clone();
        lane.start_here(Box::pin(async move {
            let _held = dropped_tx;
            task_ran.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        assert!(matches!(
            dropped.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed)
        ));
    }

    #[test]
    fn a_lanes_load_counts_the_tasks_it_was_given_until_each_ends() {
        let lane = UpstreamLane::new();
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let (ended_tx, ended) = tokio::sync::oneshot::channel::<()>();
        // Sent from a thread that is not the lane's: counted at once, before the lane has even run.
        lane.spawn_on(Box::pin(async move {
            let _ = finished.await;
            let _ = ended_tx.send(());
        }));
        assert_eq!(lane.load(), 1);
        let counted = lane.clone();
        on_serving_thread(&lane, async move {
            tokio::task::yield_now().await;
            assert_eq!(counted.load(), 1, "taken in and still running");
            let _ = finish.send(());
            ended.await.expect("the lane ran the task to its end");
            // The lane counts the end when it next polls its set, right after the task's last step.
            tokio::task::yield_now().await;
            assert_eq!(counted.load(), 0);
        });
    }
}
