//! The worker threads beside the one [`super::Floodgate::run`] is awaited on: each a current-thread runtime
//! whose `block_on` polls an upstream lane of its own ahead of its client connections, as `--threads 1` does,
//! so that no one thread carries every admitted exchange. The accept loop hands new connections to the workers
//! in turn; a connection, its exchanges and the upstream connections they dial then stay on that thread.
//!
//! It owns only the threads and what is sent to them; what runs there is the server's and the proxy's.

use tokio::sync::mpsc;

use crate::upstream_lane::UpstreamLane;

/// A worker's lane is polled before each batch of this many client tasks' polls, each of which answers one request
/// at most (a pipelined one waits for its next turn): the most a hand-off waits. Each batch ends in a look at the
/// I/O driver (an `epoll_wait`), so a smaller batch costs CPU under load: 8 cost 8-12 % more per response than
/// tokio's 61 at saturation (docs/storm.md).
pub(super) const LANE_EVERY_TASKS: u32 = 61;

/// Something to start on a worker's runtime (a connection's task); it runs inside that runtime, so what it spawns
/// and the sockets it registers are that worker's.
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// The other workers, and whose turn the next connection is. Dropping it ends their threads once they have taken
/// in what was sent; the connections they serve are waited for by the server before that.
pub struct Workers {
    inboxes: Vec<mpsc::UnboundedSender<Job>>,
    /// 0 is the caller's own thread.
    next: usize,
}

impl Workers {
    /// No other workers: everything runs on the caller's runtime.
    pub fn none() -> Workers {
        Workers {
            inboxes: Vec::new(),
            next: 0,
        }
    }

    /// Starts `count` worker threads, each once its runtime is built. A thread or runtime the OS refuses is the
    /// error, and the workers started before it end with the returned error's drop of their inboxes.
    pub fn start(count: usize) -> std::io::Result<Workers> {
        let mut inboxes = Vec::with_capacity(count);
        for index in 1..=count {
            let (inbox, jobs) = mpsc::unbounded_channel::<Job>();
            // Built on its own thread: a runtime dropped inside the caller's (on a failure here) would panic.
            let (built, started) = std::sync::mpsc::sync_channel(1);
            std::thread::Builder::new()
                .name(format!("floodgate-worker-{index}"))
                .spawn(move || match serving_runtime() {
                    Ok(runtime) => {
                        let _ = built.send(Ok(()));
                        work(runtime, jobs);
                    }
                    Err(err) => {
                        let _ = built.send(Err(err));
                    }
                })?;
            started
                .recv()
                .unwrap_or_else(|_| Err(std::io::Error::other("a worker thread ended while starting")))?;
            inboxes.push(inbox);
        }
        Ok(Workers { inboxes, next: 0 })
    }

    /// How many threads serve clients, the caller's included.
    pub fn count(&self) -> usize {
        self.inboxes.len() + 1
    }

    /// Whose turn the next connection is: another worker's inbox, or `None` for the caller's own thread.
    pub(super) fn next_turn(&mut self) -> Option<&mpsc::UnboundedSender<Job>> {
        let turn = self.next;
        self.next = (self.next + 1) % self.count();
        turn.checked_sub(1).and_then(|index| self.inboxes.get(index))
    }
}

/// The runtime of one thread that serves clients (`main`'s and each worker's): a current-thread scheduler, which
/// hands a woken task over without the work-stealing machinery, whose `block_on` future (the thread's upstream
/// lane) is polled before each batch of `LANE_EVERY_TASKS` client tasks.
pub fn serving_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .event_interval(LANE_EVERY_TASKS)
        .build()
}

/// One worker thread: its lane first, then the jobs sent to it and the tasks they spawn, until the server drops
/// [`Workers`].
fn work(runtime: tokio::runtime::Runtime, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let lane = UpstreamLane::new();
    UpstreamLane::make_here(lane.clone());
    runtime.block_on(async move {
        let taking_jobs = async {
            while let Some(job) = jobs.recv().await {
                job();
            }
        };
        tokio::select! {
            biased;
            () = lane.run() => {}
            () = taking_jobs => {}
        }
    });
    // A DNS lookup left in the blocking pool must not hold the process's exit.
    runtime.shutdown_background();
}
