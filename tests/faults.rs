//! The worst day: upstreams that restart, reset, close keep-alive connections early, hang or refuse, and clients
//! that vanish at random points. Every test ends the same way: the upstream never saw more than the cap, every
//! client got an answer of an expected status, no slot is left held, and the proxy still serves.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, StatusCode};
use support::chaos::Chaos;
use support::*;
use tokio::sync::watch;

const UP: &str = "default";
const SETTLE: Duration = Duration::from_secs(10);

/// After the storm: nothing held, nothing queued, the cap kept on both sides, and a plain request still served.
async fn assert_settled(proxy: &Proxy, upstream: &Upstream, cap: usize) {
    proxy.wait_in_use_zero(UP, SETTLE).await;
    proxy.wait_queue_depth(UP, 0, SETTLE).await;
    let status = proxy.upstream_status(UP).await;
    assert!(
        upstream.peak_connections() <= cap,
        "upstream saw {} concurrent connections, cap {cap}",
        upstream.peak_connections()
    );
    assert!(
        status["connections_peak"].as_u64().unwrap_or(u64::MAX) <= cap as u64,
        "/status: {status}"
    );
    let resp = get(proxy.listen, "/after").await;
    assert_eq!(resp.status, StatusCode::OK, "the proxy still serves: {}", resp.text());
}

/// `floodgate_upstream_retries_total` by reason: (unsent, replayed).
async fn retries(proxy: &Proxy) -> (f64, f64) {
    let samples = parse_metrics(&proxy.metrics().await);
    let by = |reason| {
        metric_sum(
            &samples,
            "floodgate_upstream_retries_total",
            &[("upstream", UP), ("reason", reason)],
        )
    };
    (by("unsent"), by("replayed"))
}

/// Answers seen by a set of looping clients, by status; transport errors (a request with no answer) are kept
/// apart, since they are what must never happen.
#[derive(Default)]
struct Tally {
    by_status: Mutex<BTreeMap<u16, usize>>,
    lost: Mutex<Vec<String>>,
}

impl Tally {
    fn record(&self, result: Result<StatusCode, String>) {
        match result {
            Ok(status) => {
                *self.by_status.lock().unwrap().entry(status.as_u16()).or_default() += 1;
            }
            Err(e) => self.lost.lock().unwrap().push(e),
        }
    }

    /// Records what a client got; a client whose connection failed without an answer connects again.
    async fn answer_or_reconnect(&self, result: Result<Resp, BoxError>, conn: &mut H1Conn, addr: SocketAddr) {
        match result {
            Ok(resp) => self.record(Ok(resp.status)),
            Err(e) => {
                self.record(Err(e.to_string()));
                *conn = H1Conn::connect(addr).await;
            }
        }
    }

    fn count(&self, status: u16) -> usize {
        self.by_status.lock().unwrap().get(&status).copied().unwrap_or(0)
    }

    /// Every request was answered, and only with one of `allowed`.
    fn assert_all_answered_with(&self, allowed: &[u16]) {
        let lost = self.lost.lock().unwrap();
        assert!(
            lost.is_empty(),
            "{} requests got no answer, e.g. {:?}",
            lost.len(),
            &lost[..lost.len().min(3)]
        );
        let by_status = self.by_status.lock().unwrap();
        for status in by_status.keys() {
            assert!(
                allowed.contains(status),
                "unexpected status {status}; all answers: {by_status:?}"
            );
        }
    }
}

/// `clients` keep-alive clients sending GETs back to back until stopped.
struct Load {
    tally: Arc<Tally>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(addr: SocketAddr, clients: usize, path: &'static str) -> Load {
        let tally = Arc::new(Tally::default());
        let (stop, _) = watch::channel(false);
        let tasks = (0..clients)
            .map(|_| {
                let tally = tally.clone();
                let stop = stop.subscribe();
                tokio::spawn(async move {
                    let mut conn = H1Conn::connect(addr).await;
                    while !*stop.borrow() {
                        tally
                            .answer_or_reconnect(conn.try_get(path).await, &mut conn, addr)
                            .await;
                    }
                })
            })
            .collect();
        Load { tally, stop, tasks }
    }

    async fn wait_for(&self, what: &str, cond: impl Fn(&Tally) -> bool) {
        wait_until_sync(what, Duration::from_secs(20), || cond(&self.tally)).await;
    }

    async fn finish(self) -> Arc<Tally> {
        self.stop.send_replace(true);
        for task in self.tasks {
            task.await.unwrap();
        }
        self.tally
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_restarting_under_load_never_sees_more_than_the_cap_and_every_request_is_answered() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(
        &upstream,
        4,
        &[
            "--max-queue",
            "1000",
            "--queue-timeout",
            "10s",
            "--connect-timeout",
            "1s",
        ],
    )
    .await;
    let load = Load::start(proxy.listen, 32, "/delay/2");
    load.wait_for("traffic flows", |t| t.count(200) >= 200).await;

    upstream.stop().await;
    load.wait_for("requests fail fast while the upstream is down", |t| t.count(502) >= 50)
        .await;
    let ok_while_down = load.tally.count(200);

    upstream.restart().await;
    load.wait_for("traffic flows again", |t| t.count(200) >= ok_while_down + 200)
        .await;
    let tally = load.finish().await;

    tally.assert_all_answered_with(&[200, 502]);
    assert_settled(&proxy, &upstream, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_upstream_resets_are_answered_502_at_worst_and_non_idempotent_requests_are_never_replayed() {
    let upstream = Upstream::start_with(UpstreamOptions {
        reset_per_mille: 100,
        seed: 0x5eed,
        ..Default::default()
    })
    .await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "1000"]).await;

    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for client in 0..16 {
        let (tally, addr) = (tally.clone(), proxy.listen);
        tasks.push(tokio::spawn(async move {
            let mut conn = H1Conn::connect(addr).await;
            for n in 0..30 {
                let result = if n % 2 == 0 {
                    conn.try_get(&format!("/get?c={client}&n={n}")).await
                } else {
                    let path = format!("/echo?c={client}&n={n}");
                    conn.try_request(Method::POST, &path, body_pattern(1000)).await
                };
                tally.answer_or_reconnect(result, &mut conn, addr).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }

    tally.assert_all_answered_with(&[200, 502]);
    let retries = retries(&proxy).await;
    eprintln!(
        "resets: {}, answers: {:?}, retries: {retries:?}",
        upstream.resets(),
        tally.by_status.lock().unwrap()
    );
    assert!(
        upstream.resets() >= 10,
        "the upstream reset {} connections",
        upstream.resets()
    );
    // A GET is replayed once, so only two resets in a row make a 502; a POST is never replayed.
    assert!(
        tally.count(200) >= 400,
        "answers: {:?}",
        tally.by_status.lock().unwrap()
    );

    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for request in upstream.recorded_with_prefix("/echo") {
        *seen.entry(request.uri).or_default() += 1;
    }
    let replayed: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        replayed.is_empty(),
        "POSTs the upstream received more than once: {replayed:?}"
    );
    assert_eq!(seen.len(), 16 * 15, "every POST reached the upstream once");

    upstream.set_reset_per_mille(0);
    assert_settled(&proxy, &upstream, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_closing_idle_keep_alive_connections_early_is_invisible_to_idempotent_requests() {
    // Ktor CIO closes a keep-alive connection idle for 45 s; here 40 ms, with clients pausing 0-80 ms, so that
    // many requests meet a connection just as the upstream closes it.
    let upstream = Upstream::start_with(UpstreamOptions {
        idle_close: Some(Duration::from_millis(40)),
        ..Default::default()
    })
    .await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "1000"]).await;

    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for client in 0..8u64 {
        let (tally, addr) = (tally.clone(), proxy.listen);
        tasks.push(tokio::spawn(async move {
            let mut rng = 0xC105E ^ client;
            let mut conn = H1Conn::connect(addr).await;
            for n in 0..30 {
                tokio::time::sleep(Duration::from_millis(next_random(&mut rng) % 80)).await;
                let method = if n % 3 == 0 { Method::HEAD } else { Method::GET };
                let result = conn
                    .try_request(method, &format!("/?c={client}&n={n}"), body_empty())
                    .await;
                tally.answer_or_reconnect(result, &mut conn, addr).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }

    tally.assert_all_answered_with(&[200]);
    assert_eq!(tally.count(200), 240);
    let retries = retries(&proxy).await;
    eprintln!(
        "idle closes by the upstream: {}, retries by the proxy: {retries:?}",
        upstream.idle_closes()
    );
    assert!(
        upstream.idle_closes() >= 10,
        "the upstream closed {} idle connections",
        upstream.idle_closes()
    );
    // The proxy met those closes: a request sent on a connection as it closed was sent again, or, far more often
    // now, the connection's idle watch saw the close first and a fresh one was dialled; either way no client saw it.
    let opened = metric_sum(
        &parse_metrics(&proxy.metrics().await),
        "floodgate_upstream_connections_opened_total",
        &[("upstream", UP)],
    );
    assert!(
        retries.0 + retries.1 >= 1.0 || opened >= 4.0 + 10.0,
        "the proxy met no closing connection: retries {retries:?}, connections opened {opened}"
    );
    assert_settled(&proxy, &upstream, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_upstream_answers_every_queued_request_504_within_request_timeout_and_frees_each_slot() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream_with_env(
        &upstream,
        2,
        &[
            "--max-queue",
            "100",
            "--queue-timeout",
            "30s",
            "--request-timeout",
            "300ms",
        ],
        // A timed-out exchange keeps its slot while its late answer may still come (abort_drain_timeout), then
        // until the upstream has closed the connection; this upstream closes as soon as floodgate does.
        &[("FLOODGATE__UPSTREAMS__DEFAULT__ABORT_DRAIN_TIMEOUT", "100ms")],
    )
    .await;

    // Four rounds of two: each round's slots come back only because the previous round timed out and the
    // upstream let go of it. A 503 would mean a request waited out the 30 s queue timeout instead.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move { try_get(addr, &format!("/stall?i={i}")).await.map(|r| r.status) })
        })
        .collect();
    for task in tasks {
        let status = task.await.unwrap().map_err(|e| e.to_string());
        assert_eq!(status, Ok(StatusCode::GATEWAY_TIMEOUT));
    }
    assert_eq!(upstream.requests(), 8);
    wait_until_sync("the hung connections are closed", SETTLE, || {
        upstream.connections() == 0
    })
    .await;
    assert!(proxy.outcome_count(UP, "upstream_timeout").await >= 8.0);
    assert_settled(&proxy, &upstream, 2).await;
}

/// An upstream connection keeps one answer timer for its exchanges, set for the first and moved on when it fires
/// early: each exchange still has its whole `request_timeout` from its own dispatch, however long the one before
/// it took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_runs_from_each_exchanges_own_dispatch_on_a_reused_connection() {
    let upstream = Upstream::start().await;
    // One serving thread: a connection's timer is reused only on the thread that made it, and each request here
    // comes on a connection of its own, which more threads would deal out in turn.
    let proxy = Proxy::for_upstream(&upstream, 1, &["--request-timeout", "2s", "--threads", "1"]).await;
    // The first exchange's deadline passes while the second, dispatched 1.2 s later, is still within its own.
    assert_eq!(get(proxy.listen, "/delay/1200?first").await.status, StatusCode::OK);
    assert_eq!(get(proxy.listen, "/delay/1500?second").await.status, StatusCode::OK);
    // And one over its own deadline is cut at it, not sooner.
    let started = std::time::Instant::now();
    assert_eq!(
        get(proxy.listen, "/delay/4000?third").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2),
        "cut {took:?} after dispatch, request_timeout 2s"
    );
    // One connection carried the first two: the timer was the connection's.
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connects_answer_502_at_once_and_service_resumes_when_the_upstream_listens_again() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "100", "--queue-timeout", "30s"]).await;
    assert_eq!(get(proxy.listen, "/warm").await.status, StatusCode::OK);

    upstream.stop().await;
    let burst = |n: usize| {
        let addr = proxy.listen;
        (0..n)
            .map(move |i| tokio::spawn(async move { try_get(addr, &format!("/burst?i={i}")).await.map(|r| r.status) }))
            .collect::<Vec<_>>()
    };
    for task in burst(20) {
        assert_eq!(
            task.await.unwrap().map_err(|e| e.to_string()),
            Ok(StatusCode::BAD_GATEWAY)
        );
    }
    proxy.wait_in_use_zero(UP, SETTLE).await;

    upstream.restart().await;
    for task in burst(20) {
        assert_eq!(task.await.unwrap().map_err(|e| e.to_string()), Ok(StatusCode::OK));
    }
    assert_settled(&proxy, &upstream, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_chaos_of_clients_vanishing_in_the_queue_mid_upload_and_mid_download_leaks_nothing() {
    let seed: u64 = std::env::var("FLOODGATE_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xF100D);
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 4, &["--max-queue", "1000", "--queue-timeout", "30s"]).await;

    let mut rng = seed;
    let plan: Vec<Chaos> = (0..200).map(|_| Chaos::pick(&mut rng, 25)).collect();
    let patient = plan.iter().filter(|c| matches!(c, Chaos::Patient)).count();
    let tasks: Vec<_> = plan
        .iter()
        .enumerate()
        .map(|(client, chaos)| tokio::spawn(chaos.play(proxy.listen, client)))
        .collect();
    let mut failures = Vec::new();
    for (task, chaos) in tasks.into_iter().zip(&plan) {
        match task.await.unwrap() {
            Ok(None) | Ok(Some(StatusCode::OK)) => {}
            Ok(Some(status)) => failures.push(format!("{chaos:?}: answered {status}")),
            Err(e) => failures.push(format!("{chaos:?}: {e}")),
        }
    }
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
    // Clients that leave mid-upload are aborts, not malformed requests.
    assert_eq!(proxy.outcome_count(UP, "bad_request").await, 0.0, "seed {seed}");
    assert!(proxy.outcome_count(UP, "client_abort").await > 0.0);
    assert!(patient >= 20, "the plan mixes in enough patient clients ({patient})");
    assert_settled(&proxy, &upstream, 4).await;
    wait_until_sync("upstream connections within the cap", SETTLE, || {
        upstream.connections() <= 4
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_cut_off_or_reset_mid_body_reaches_the_client_as_an_error_and_the_connection_is_never_pooled() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    for path in ["/cut/50000", "/reset-body/50000"] {
        let mut client = H1Conn::connect(proxy.listen).await;
        let request = http::Request::get(path).body(body_empty()).unwrap();
        let resp = client.send(request).await.unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::OK,
            "{path}: the head had already been forwarded"
        );
        let body = http_body_util::BodyExt::collect(resp.into_body()).await;
        assert!(
            body.is_err(),
            "{path}: a truncated body must not look complete to the client"
        );
        proxy.wait_in_use_zero(UP, SETTLE).await;
        assert_eq!(get(proxy.listen, "/next").await.status, StatusCode::OK);
        let conn_of = |prefix: &str| upstream.recorded_with_prefix(prefix).last().map(|r| r.conn_id);
        assert_ne!(
            conn_of(path),
            conn_of("/next"),
            "{path}: the broken connection was not reused"
        );
    }
    assert_settled(&proxy, &upstream, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_response_that_keeps_making_progress_is_relayed_whole_past_body_idle_timeout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &["--body-idle-timeout", "300ms"]).await;
    // 20 chunks 100 ms apart: twice the idle timeout in all, never more than a third of it between chunks.
    let resp = get(proxy.listen, "/trickle/20/100").await;
    assert_eq!(resp.status, StatusCode::OK);
    assert_eq!(resp.body.len(), 20 * 16);
    assert_settled(&proxy, &upstream, 1).await;
}

/// An upstream that answers each connection's first request as soon as its head arrives, without reading the
/// body, then keeps reading (and discarding) until the proxy closes the connection: a server that turns an upload
/// down early may do that. Returns its address and how many connections it accepted.
async fn early_answering_upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 16 * 1024];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nearly";
                if stream.write_all(answer).await.is_err() {
                    return;
                }
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    (addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_answering_before_the_upload_ends_gets_its_connection_closed_not_pooled() {
    let (addr, accepted) = early_answering_upstream().await;
    let proxy = Proxy::start(&["--upstream", &format!("http://{addr}"), "--max-connections", "1"]).await;

    // The upload stops a thousand bytes into a million, so it is still unfinished when the answer has ended.
    let mut uploader = RawConn::connect(proxy.listen).await;
    uploader
        .write(b"POST /upload HTTP/1.1\r\nHost: early.test\r\nContent-Length: 1000000\r\n\r\n")
        .await
        .unwrap();
    uploader.write(&[b'u'; 1000]).await.unwrap();
    let answer = uploader.read_response(false, SETTLE).await.unwrap();
    assert_eq!(answer.status, 200);
    proxy.wait_in_use_zero(UP, SETTLE).await;
    // Pooled, the connection would make the next request wait behind an upload that may never end.
    assert_eq!(
        proxy.upstream_field(UP, "connections_idle").await,
        0,
        "the connection was pooled"
    );

    let next = get(proxy.listen, "/next").await;
    assert_eq!(next.status, StatusCode::OK);
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the next request had a fresh connection"
    );
    drop(uploader);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_sent_in_full_keep_their_upstream_connection_for_the_next_request() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let mut client = H1Conn::connect(proxy.listen).await;
    let sized = body_pattern(100_000);
    let chunked = http_body_util::BodyExt::boxed(PatternBody::chunked(100_000));
    for (path, body) in [("/echo/sized", sized), ("/echo/chunked", chunked)] {
        let resp = client.try_request(Method::POST, path, body).await.unwrap();
        assert_eq!(resp.text(), "100000", "{path}");
    }
    assert_eq!(client.get("/after").await.status, StatusCode::OK);
    assert_eq!(
        upstream.accepted(),
        1,
        "every request went over the one warm connection"
    );
    assert_settled(&proxy, &upstream, 1).await;
}
