//! An HTTP/2 upstream written frame by frame, for what no server library lets a test do on a live connection:
//! lower `SETTINGS_MAX_CONCURRENT_STREAMS` mid-connection, and send GOAWAY with a chosen last stream id. It counts
//! the streams open on each connection and answers each request (`:status 200`, no body) after `delay` (and
//! after the GOAWAY, while one is planned), by stream id order of arrival; a stream above a GOAWAY's last id is
//! never answered (it was not processed).

use super::h2_raw::{frame, PREFACE};
use super::*;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::mpsc;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const MAX_CONCURRENT_STREAMS: u16 = 0x3;

#[derive(Default)]
struct State {
    conns_now: usize,
    conns_peak: usize,
    accepted: usize,
    /// Streams open now, over all connections, and the most at once.
    open: usize,
    open_peak: usize,
    /// Streams that arrived while the connection already had its lowered limit's worth open, after that limit's
    /// SETTINGS was acknowledged.
    over_limit: usize,
    answered: usize,
    /// Streams above a GOAWAY's last id: received, never processed.
    unprocessed: usize,
    /// What the test asked for next: on the next connection's next stream past `after` streams.
    lower_after: Option<(usize, u32)>,
    goaway_after: Option<usize>,
    /// The GOAWAY names the connection's n-th stream (from 1), not the one that set it off: those after it were
    /// received and are left unprocessed.
    goaway_names: Option<usize>,
    /// Each connection answers this many PINGs, then no more (`None`: every one).
    pings_answered: Option<usize>,
    /// A PING sent right after the GOAWAY came back: the client has read the GOAWAY.
    goaway_read: bool,
    /// Request body bytes received on the streams answered.
    body_bytes: usize,
}

pub struct H2Scripted {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for H2Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl H2Scripted {
    /// Each connection starts allowing `max_streams`; every answer waits `delay`.
    pub async fn start(max_streams: u32, delay: Duration) -> H2Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                {
                    let mut state = shared.lock().unwrap();
                    state.accepted += 1;
                    state.conns_now += 1;
                    state.conns_peak = state.conns_peak.max(state.conns_now);
                }
                let state = shared.clone();
                tokio::spawn(async move {
                    let counted = Arc::new(AtomicBool::new(true));
                    let _ = serve(stream, state.clone(), max_streams, delay, counted.clone()).await;
                    count_closed(&state, &counted);
                });
            }
        });
        H2Scripted { addr, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Once a connection has had `after` streams, it lowers its limit to `to`.
    pub fn lower_limit_after(&self, after: usize, to: u32) {
        self.state.lock().unwrap().lower_after = Some((after, to));
    }

    /// Once a connection has had `after` streams, it sends GOAWAY naming the last of them (one connection only).
    pub fn goaway_after(&self, after: usize) {
        self.state.lock().unwrap().goaway_after = Some(after);
    }

    /// Once a connection has had `after` streams, it sends GOAWAY naming its `nth` (from 1): the others it received
    /// after that one are left unprocessed, never answered (one connection only).
    pub fn goaway_naming_after(&self, nth: usize, after: usize) {
        let mut state = self.state.lock().unwrap();
        state.goaway_after = Some(after);
        state.goaway_names = Some(nth);
    }

    /// Each connection answers `n` PINGs, and falls silent to the rest, as a peer whose host has gone would.
    pub fn answer_pings_up_to(&self, n: usize) {
        self.state.lock().unwrap().pings_answered = Some(n);
    }

    /// Request body bytes received on the streams it answered (none above a GOAWAY's last id).
    pub fn body_bytes(&self) -> usize {
        self.state.lock().unwrap().body_bytes
    }

    /// Whether the client has read the GOAWAY (it answered a PING sent just after it).
    pub fn goaway_read(&self) -> bool {
        self.state.lock().unwrap().goaway_read
    }

    pub fn connections(&self) -> usize {
        self.state.lock().unwrap().conns_now
    }

    pub fn peak_connections(&self) -> usize {
        self.state.lock().unwrap().conns_peak
    }

    pub fn accepted(&self) -> usize {
        self.state.lock().unwrap().accepted
    }

    pub fn peak_open(&self) -> usize {
        self.state.lock().unwrap().open_peak
    }

    pub fn over_limit(&self) -> usize {
        self.state.lock().unwrap().over_limit
    }

    pub fn answered(&self) -> usize {
        self.state.lock().unwrap().answered
    }

    pub fn unprocessed(&self) -> usize {
        self.state.lock().unwrap().unprocessed
    }
}

/// The payload of the PING that follows a GOAWAY.
const GOAWAY_PING: [u8; 8] = *b"goaway!!";

/// `:status: 200` as one HPACK byte (static table index 8).
const STATUS_200: &[u8] = &[0x88];

/// The connection stops counting once (as the counting HTTP/1 upstream does, from our FIN on: all a proxy can see
/// before it may dial a replacement).
fn count_closed(state: &Mutex<State>, counted: &AtomicBool) {
    if counted.swap(false, Ordering::SeqCst) {
        state.lock().unwrap().conns_now -= 1;
    }
}

async fn serve(
    stream: TcpStream,
    state: Arc<Mutex<State>>,
    max_streams: u32,
    delay: Duration,
    counted: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let (mut read, mut write) = stream.into_split();
    let (out, mut outgoing) = mpsc::unbounded_channel::<Vec<u8>>();
    let closing = (state.clone(), counted);
    let writer = tokio::spawn(async move {
        // An empty message closes our side: the goodbye after a GOAWAY.
        while let Some(bytes) = outgoing.recv().await {
            if bytes.is_empty() || write.write_all(&bytes).await.is_err() {
                break;
            }
        }
        count_closed(&closing.0, &closing.1);
        let _ = write.shutdown().await;
    });
    let mut preface = [0u8; 24];
    read.read_exact(&mut preface).await?;
    assert_eq!(&preface[..], PREFACE, "an HTTP/2 client preface");
    let settings = |limit: u32| {
        let mut payload = MAX_CONCURRENT_STREAMS.to_be_bytes().to_vec();
        payload.extend(limit.to_be_bytes());
        frame(SETTINGS, 0, 0, &payload)
    };
    let _ = out.send(settings(max_streams));
    // This connection's own view: streams open on it, the limit in force once acknowledged, and the SETTINGS
    // frames sent and not yet acknowledged (the first is the preface's).
    let open_here = Arc::new(Mutex::new(std::collections::HashSet::<u32>::new()));
    let mut seen = 0usize;
    // The ids of the streams processed or not, in their order of arrival.
    let mut ids: Vec<u32> = Vec::new();
    // Each stream's request body bytes, counted as the stream's own once it is answered.
    let received = Arc::new(Mutex::new(std::collections::HashMap::<u32, usize>::new()));
    let mut sent_settings: std::collections::VecDeque<Option<u32>> = [Some(max_streams)].into();
    let mut limit_in_force: Option<u32> = None;
    let mut last_processed: Option<u32> = None;
    let going_away = Arc::new(AtomicBool::new(false));
    // While a GOAWAY is planned, no stream is answered before it has gone: which streams it leaves unprocessed is
    // the test's choice, not the scheduler's.
    let (gone_away, told) = tokio::sync::watch::channel(false);
    let mut pings = 0usize;
    loop {
        let mut head = [0u8; 9];
        if read.read_exact(&mut head).await.is_err() {
            break;
        }
        let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; length];
        read.read_exact(&mut payload).await?;
        match kind {
            SETTINGS if flags & ACK == 0 => {
                let _ = out.send(frame(SETTINGS, ACK, 0, &[]));
            }
            SETTINGS => {
                if let Some(Some(limit)) = sent_settings.pop_front() {
                    limit_in_force = Some(limit);
                }
            }
            PING if flags & ACK != 0 && payload == GOAWAY_PING => {
                state.lock().unwrap().goaway_read = true;
            }
            PING if flags & ACK == 0 => {
                pings += 1;
                if state.lock().unwrap().pings_answered.is_none_or(|n| pings <= n) {
                    let _ = out.send(frame(PING, ACK, 0, &payload));
                }
            }
            HEADERS => {
                assert!(flags & END_HEADERS != 0, "floodgate's small heads fit one frame");
                if last_processed.is_some_and(|last| id > last) {
                    state.lock().unwrap().unprocessed += 1;
                    continue;
                }
                seen += 1;
                ids.push(id);
                let open_now = {
                    let mut here = open_here.lock().unwrap();
                    here.insert(id);
                    here.len()
                };
                let (lower, goaway) = {
                    let mut state = state.lock().unwrap();
                    if limit_in_force.is_some_and(|limit| open_now > limit as usize) {
                        state.over_limit += 1;
                    }
                    state.open += 1;
                    state.open_peak = state.open_peak.max(state.open);
                    let lower = state.lower_after.filter(|(after, _)| seen == *after);
                    // Once, on the first connection to reach it.
                    let goaway = state.goaway_after.filter(|after| seen == *after).map(|_| {
                        state
                            .goaway_names
                            .and_then(|nth| ids.get(nth - 1).copied())
                            .unwrap_or(id)
                    });
                    if goaway.is_some() {
                        state.goaway_after = None;
                    }
                    (lower, goaway)
                };
                if let Some((_, to)) = lower {
                    sent_settings.push_back(Some(to));
                    let _ = out.send(settings(to));
                }
                if let Some(last) = goaway {
                    last_processed = Some(last);
                    going_away.store(true, Ordering::SeqCst);
                    // The streams above the last one named were received, and are dropped unprocessed.
                    let dropped: Vec<u32> = open_here
                        .lock()
                        .unwrap()
                        .iter()
                        .copied()
                        .filter(|s| *s > last)
                        .collect();
                    for stream in dropped {
                        open_here.lock().unwrap().remove(&stream);
                        let mut state = state.lock().unwrap();
                        state.open -= 1;
                        state.unprocessed += 1;
                    }
                    let mut payload = last.to_be_bytes().to_vec();
                    payload.extend(0u32.to_be_bytes());
                    let _ = out.send(frame(GOAWAY, 0, 0, &payload));
                    let _ = out.send(frame(PING, 0, 0, &GOAWAY_PING));
                    let _ = gone_away.send(true);
                }
                let planned = state.lock().unwrap().goaway_after.is_some();
                let mut told = told.clone();
                // A request's body (if any) is not read: the answer goes once `delay` has passed.
                let _ = flags & END_STREAM;
                let (out, state, open_here) = (out.clone(), state.clone(), open_here.clone());
                let (going_away, received) = (going_away.clone(), received.clone());
                tokio::spawn(async move {
                    if planned {
                        let _ = told.wait_for(|gone| *gone).await;
                    }
                    tokio::time::sleep(delay).await;
                    let mut here = open_here.lock().unwrap();
                    if here.remove(&id) {
                        let mut state = state.lock().unwrap();
                        state.open -= 1;
                        state.answered += 1;
                        state.body_bytes += received.lock().unwrap().get(&id).copied().unwrap_or(0);
                        let _ = out.send(frame(HEADERS, END_STREAM | END_HEADERS, id, STATUS_200));
                    }
                    // After a GOAWAY, the connection closes once the streams it processed are answered.
                    if going_away.load(Ordering::SeqCst) && here.is_empty() {
                        let _ = out.send(Vec::new());
                    }
                });
            }
            DATA => {
                *received.lock().unwrap().entry(id).or_default() += payload.len();
            }
            RST_STREAM if open_here.lock().unwrap().remove(&id) => {
                state.lock().unwrap().open -= 1;
            }
            _ => {}
        }
    }
    // Answers still due are dropped with the connection.
    for _ in open_here.lock().unwrap().drain() {
        state.lock().unwrap().open -= 1;
    }
    drop(out);
    let _ = writer.await;
    Ok(())
}
