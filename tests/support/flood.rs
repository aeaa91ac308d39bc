//! A retry storm: client connections that send again the moment they are answered, each with a batch of
//! pipelined requests in flight, so that refusing them keeps floodgate busy while the test itself does little (one
//! write and a few reads per batch). The flood runs on a thread and runtime of its own: the test's upstream, on the
//! test's runtime, never waits behind it, so what a test measures is floodgate's scheduling, not the test's.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

/// Requests written per batch on each connection.
const BATCH: usize = 16;

#[derive(Default)]
struct Counts {
    answers: AtomicU64,
    ok: AtomicU64,
    shed: AtomicU64,
    /// `retry-after` header lines seen; every shed answer must carry one.
    retry_after: AtomicU64,
    /// `x-floodgate-shed-reason` header lines seen.
    reasons: AtomicU64,
}

/// What a flood received, counted once every batch it sent was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub answers: u64,
    pub ok: u64,
    pub shed: u64,
    pub retry_after: u64,
    pub reasons: u64,
}

/// A running flood; stopped (every connection closed) on drop, or by [`Flood::finish`].
pub struct Flood {
    counts: Arc<Counts>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    /// `connections` clients of `addr`, each sending `GET path` in batches of pipelined requests and the next
    /// batch once the last is answered.
    pub fn start(addr: SocketAddr, connections: usize, path: &str) -> Flood {
        let counts = Arc::new(Counts::default());
        let (stop, stopped) = watch::channel(false);
        let batch: Arc<[u8]> = format!("GET {path} HTTP/1.1\r\nHost: flood\r\n\r\n")
            .repeat(BATCH)
            .into_bytes()
            .into();
        let shared = counts.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the flood's runtime");
            runtime.block_on(async move {
                let mut clients = tokio::task::JoinSet::new();
                for _ in 0..connections {
                    clients.spawn(client(addr, batch.clone(), shared.clone(), stopped.clone()));
                }
                // Each client ends once its last batch is answered; one that floodgate left hanging is dropped.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(30), clients.join_all()).await;
            });
        });
        Flood {
            counts,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sending, waits for every batch sent to be answered, and says what came back.
    pub fn finish(mut self) -> Tally {
        self.stop_and_join();
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Tally {
            answers: load(&self.counts.answers),
            ok: load(&self.counts.ok),
            shed: load(&self.counts.shed),
            retry_after: load(&self.counts.retry_after),
            reasons: load(&self.counts.reasons),
        }
    }

    fn stop_and_join(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Answers received, of any status.
    pub fn answers(&self) -> u64 {
        self.counts.answers.load(Ordering::Relaxed)
    }
    /// `503` answers received.
    pub fn shed(&self) -> u64 {
        self.counts.shed.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// One connection: a batch out, its answers in, again, until told to stop; reconnects when floodgate closes it.
async fn client(addr: SocketAddr, batch: Arc<[u8]>, counts: Arc<Counts>, stop: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    while !*stop.borrow() {
        let Ok(mut stream) = TcpStream::connect(addr).await else {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let mut scanner = Scanner::default();
        'batches: while !*stop.borrow() {
            if stream.write_all(&batch).await.is_err() {
                break;
            }
            let mut answered = 0;
            while answered < BATCH {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break 'batches,
                    Ok(n) => answered += scanner.scan(&buf[..n], &counts),
                }
            }
        }
    }
}

/// Finds status lines and the header lines that matter in a byte stream split at arbitrary points. Good enough
/// for floodgate's short plain-text answers, whose bodies never contain these strings.
#[derive(Default)]
struct Scanner {
    /// The end of the previous chunk, so that a match split between two reads is still found.
    carry: Vec<u8>,
}

impl Scanner {
    const KEEP: usize = 32;

    fn scan(&mut self, chunk: &[u8], counts: &Counts) -> usize {
        let mut text = std::mem::take(&mut self.carry);
        let skip = text.len();
        text.extend_from_slice(chunk);
        let lower = text.to_ascii_lowercase();
        let mut answers = 0;
        let mut at = 0;
        while let Some(found) = find(&lower[at..], b"http/1.1 ") {
            let start = at + found;
            let Some(code) = lower.get(start + 9..start + 12) else {
                break;
            };
            // Matches wholly inside the carried bytes were counted with the previous chunk.
            if start + 12 > skip {
                answers += 1;
                counts.answers.fetch_add(1, Ordering::Relaxed);
                match code {
                    b"200" => counts.ok.fetch_add(1, Ordering::Relaxed),
                    b"503" => counts.shed.fetch_add(1, Ordering::Relaxed),
                    _ => 0,
                };
            }
            at = start + 12;
        }
        for (needle, counter) in [
            (&b"\r\nretry-after:"[..], &counts.retry_after),
            (&b"\r\nx-floodgate-shed-reason:"[..], &counts.reasons),
        ] {
            let mut at = 0;
            while let Some(found) = find(&lower[at..], needle) {
                let end = at + found + needle.len();
                if end > skip {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                at = end;
            }
        }
        let keep = text.len().min(Self::KEEP);
        self.carry = text[text.len() - keep..].to_vec();
        answers
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}
