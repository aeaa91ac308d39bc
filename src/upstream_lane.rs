//! The upstream lane: one future that runs every upstream connection and every admitted exchange, scheduled
//! ahead of the client connections' tasks, so that refusing a flood of new requests never delays the work
//! already admitted (`docs/storm.md` has the mechanism and the figures).
//!
//! On a current-thread runtime the lane is part of the `block_on` future ([`crate::server::Floodgate::run`]),
//! which tokio polls before each batch of `event_interval` tasks: at light load nothing changes threads. With
//! `--threads` above one, each worker thread is such a runtime with a lane of its own ([`UpstreamLane::make_here`]),
//! and work is spawned into the lane of the thread that spawns it, so an exchange runs where its client is. On a
//! multi-thread runtime (a library user's) the lane gets a thread and an I/O driver of its own
//! ([`UpstreamLane::start_thread`]). It owns no policy: what runs here is decided by the proxy and the pool.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
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

/// The lane's inbox; [`UpstreamLane::run`] is the future that runs what arrives in it.
pub struct UpstreamLane {
    inbox: mpsc::UnboundedSender<Task>,
    /// Taken by the one [`UpstreamLane::run`].
    tasks: Mutex<Option<mpsc::UnboundedReceiver<Task>>>,
}

impl UpstreamLane {
    pub fn new() -> Arc<UpstreamLane> {
        let (inbox, tasks) = mpsc::unbounded_channel();
        Arc::new(UpstreamLane {
            inbox,
            tasks: Mutex::new(Some(tasks)),
        })
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
        HERE.with_borrow(|here| {
            let _ = here.as_deref().unwrap_or(self).inbox.send(task);
        });
    }

    /// Makes `lane` the one work spawned from this thread runs in; for a worker thread whose runtime's `block_on`
    /// polls `lane.run()`.
    pub fn make_here(lane: Arc<UpstreamLane>) {
        HERE.set(Some(lane));
    }

    /// Runs the lane's tasks until the returned future is dropped, or the lane is and its last task has ended; to
    /// be polled as (part of) a current-thread runtime's `block_on` future. Once the lane runs (here or on its own
    /// thread), the returned future runs nothing and never ends.
    pub fn run(&self) -> impl Future<Output = ()> + Send + 'static {
        let tasks = self
            .tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        async move {
            let Some(mut inbox) = tasks else {
                return std::future::pending().await;
            };
            let mut running = FuturesUnordered::new();
            let mut open = true;
            std::future::poll_fn(move |cx| {
                for round in 0..ROUNDS_PER_POLL {
                    let mut took = false;
                    while open {
                        match inbox.poll_recv(cx) {
                            Poll::Ready(Some(task)) => {
                                running.push(std::panic::AssertUnwindSafe(task).catch_unwind());
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
                    loop {
                        match running.poll_next_unpin(cx) {
                            Poll::Ready(Some(Ok(()))) => {}
                            Poll::Ready(Some(Err(_))) => {
                                tracing::error!("a task in the upstream lane panicked; its exchange is abandoned")
                            }
                            Poll::Ready(None) if !open => return Poll::Ready(()),
                            Poll::Ready(None) | Poll::Pending => break,
                        }
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
    pub fn start_thread(&self) -> std::io::Result<()> {
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
