//! gRPC through floodgate: a real gRPC server and client (tonic, raw-bytes messages, no protobuf) with floodgate
//! between them speaking HTTP/2 to the server. The server counts its own TCP connections and the RPCs at work in
//! it exactly, with peaks (`tests/grpc_support/`): the cap holds in gRPC terms, a shed call reaches the client as
//! the gRPC status floodgate means, streaming calls are relayed message by message, each holding its one stream
//! for its whole life, and a handler's status reaches the client whether it travels in the head or in trailers.

mod support;

#[path = "grpc_support/mod.rs"]
mod grpc_support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream;
use grpc_support::*;
use support::*;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::client::{Grpc, GrpcService};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

/// floodgate in front of `server` over HTTP/2, with `connections` connections of `streams` streams each.
async fn proxy_for(server: &ProbeServer, connections: usize, streams: usize, extra: &[&str]) -> Proxy {
    Proxy::for_h2_upstream(&server.url(), connections, streams, extra).await
}

/// One unary call of `method` with `message`, and `deadline` as its `grpc-timeout` when given; within
/// [`CLIENT_TIMEOUT`], so that a hang fails the test.
async fn unary<T>(
    grpc: &mut Grpc<T>,
    method: &'static str,
    message: &str,
    deadline: Option<Duration>,
) -> Result<Bytes, Status>
where
    T: GrpcService<tonic::body::Body>,
    T::Error: Into<BoxError>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<BoxError>,
{
    let call = async {
        grpc.ready()
            .await
            .map_err(|error| Status::unknown(format!("client not ready: {}", error.into())))?;
        let mut request = Request::new(Bytes::from(message.to_owned()));
        if let Some(deadline) = deadline {
            request.set_timeout(deadline);
        }
        grpc.unary(request, path(method), RawCodec)
            .await
            .map(|response| response.into_inner())
    };
    tokio::time::timeout(CLIENT_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| panic!("a {method} call was not answered within {CLIENT_TIMEOUT:?}"))
}

/// A unary call on its own task, through its own clone of `grpc`.
fn spawn_unary(grpc: &Grpc<Channel>, method: &'static str, message: &'static str) -> JoinHandle<Result<Bytes, Status>> {
    let mut grpc = grpc.clone();
    tokio::spawn(async move { unary(&mut grpc, method, message, None).await })
}

/// `calls` unary `Sleep` calls of `ms` milliseconds at once, spread over 8 client connections (tonic Channels);
/// every call's outcome.
async fn sleep_calls_at_once(proxy: &Proxy, calls: usize, ms: &'static str) -> Vec<Result<Bytes, Status>> {
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(Grpc::new(channel(proxy.listen).await));
    }
    let tasks: Vec<_> = (0..calls)
        .map(|call| spawn_unary(&clients[call % clients.len()], SLEEP, ms))
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("a call's task"));
    }
    outcomes
}

/// Waits until floodgate has a call in its queue.
async fn wait_queued(proxy: &Proxy) {
    wait_until(
        "a call waiting in floodgate's queue",
        Duration::from_secs(5),
        || async { metric_sum(&parse_metrics(&proxy.metrics().await), "floodgate_queue_depth", &[]) >= 1.0 },
    )
    .await
}

/// With the one stream of a 1 × 1 cap held by a streaming call (its handler at work in the server), a unary call
/// waits in floodgate's queue, unseen by the server, and does not end; its task is handed back to be awaited once
/// the streaming call is over.
async fn unary_waits_behind(
    proxy: &Proxy,
    server: &ProbeServer,
    grpc: &Grpc<Channel>,
) -> JoinHandle<Result<Bytes, Status>> {
    assert_eq!(server.rpcs(), 1, "the streaming call is at work in the server");
    let waiting = spawn_unary(grpc, SLEEP, "0");
    wait_queued(proxy).await;
    assert_eq!(server.started(), 1, "the unary call has not reached the server");
    assert!(!waiting.is_finished(), "the unary call waits while the stream is held");
    waiting
}

/// The streaming call ended: the unary call behind it is served, and the server never had two at once.
async fn served_after(server: &ProbeServer, waiting: JoinHandle<Result<Bytes, Status>>) {
    let answer = waiting.await.expect("the unary call's task");
    assert_eq!(
        answer.expect("the waiting unary call is served"),
        Bytes::from_static(b"0")
    );
    assert_eq!(server.started(), 2);
    assert_eq!(server.peak_rpcs(), 1, "the two calls were never at work at once");
    assert_eq!(server.peak_connections(), 1);
}

/// A message of `text`'s characters.
fn msg(text: impl ToString) -> Bytes {
    Bytes::from(text.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_unary_calls_are_all_served_over_two_connections_of_four_multiplexed_streams() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 2, 4, &[]).await;
    let outcomes = sleep_calls_at_once(&proxy, 200, "20").await;
    for outcome in &outcomes {
        assert_eq!(
            outcome.as_ref().expect("every call is served"),
            &Bytes::from_static(b"20")
        );
    }
    assert_eq!(server.started(), 200);
    assert!(
        server.peak_connections() <= 2,
        "connections: {}",
        server.peak_connections()
    );
    assert!(server.peak_rpcs() <= 8, "RPCs at once: {}", server.peak_rpcs());
    assert!(
        server.peak_rpcs() > 2,
        "streams were multiplexed on the connections: at most {} RPCs at once",
        server.peak_rpcs()
    );
    eprintln!(
        "peak connections {} (accepted {}), peak RPCs {}",
        server.peak_connections(),
        server.accepted(),
        server.peak_rpcs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_the_cap_and_a_short_queue_end_unavailable_with_a_pushback_and_the_cap_holds() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 2, 4, &["--max-queue", "8", "--queue-timeout", "100ms"]).await;
    let outcomes = sleep_calls_at_once(&proxy, 200, "200").await;
    let mut served = 0;
    let mut shed = 0;
    for outcome in &outcomes {
        match outcome {
            Ok(message) => {
                assert_eq!(message, &Bytes::from_static(b"200"));
                served += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "only UNAVAILABLE sheds: {status:?}");
                assert!(
                    ["queue full", "queue timeout"].contains(&status.message()),
                    "the reason is named: {status:?}"
                );
                let pushback: u64 = status
                    .metadata()
                    .get("grpc-retry-pushback-ms")
                    .and_then(|value| value.to_str().ok())
                    .and_then(|value| value.parse().ok())
                    .unwrap_or_else(|| panic!("a pushback in milliseconds: {status:?}"));
                assert!(pushback >= 1, "pushback {pushback} ms");
                shed += 1;
            }
        }
    }
    assert!(served >= 1 && shed >= 1, "{served} served, {shed} shed");
    assert_eq!(server.started(), served, "every call the server began was answered OK");
    assert!(
        server.peak_connections() <= 2,
        "connections: {}",
        server.peak_connections()
    );
    assert!(server.peak_rpcs() <= 8, "RPCs at once: {}", server.peak_rpcs());
    let samples = parse_metrics(&proxy.metrics().await);
    let counted = metric_sum(&samples, "floodgate_requests_total", &[("outcome", "shed_queue_full")])
        + metric_sum(
            &samples,
            "floodgate_requests_total",
            &[("outcome", "shed_queue_timeout")],
        );
    assert_eq!(counted, shed as f64, "floodgate counted each UNAVAILABLE as a shed");
    eprintln!(
        "{served} served, {shed} shed; peak connections {}, peak RPCs {}",
        server.peak_connections(),
        server.peak_rpcs()
    );
}

/// Two calls hold the two streams of a 1 × 2 cap until released.
async fn two_held_calls(server: &ProbeServer, grpc: &Grpc<Channel>) -> [JoinHandle<Result<Bytes, Status>>; 2] {
    let held = [spawn_unary(grpc, HOLD, "a"), spawn_unary(grpc, HOLD, "b")];
    wait_until_sync("both held calls at work", Duration::from_secs(5), || server.rpcs() == 2).await;
    held
}

async fn release(server: &ProbeServer, held: [JoinHandle<Result<Bytes, Status>>; 2]) {
    server.release();
    for call in held {
        call.await
            .expect("a held call's task")
            .expect("a held call is served once released");
    }
    assert_eq!(server.started(), 2, "nothing but the held calls reached the server");
    assert!(server.peak_rpcs() <= 2, "RPCs at once: {}", server.peak_rpcs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_grpc_timeout_passes_while_it_waits_behind_held_calls_ends_deadline_exceeded() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 2, &["--queue-timeout", "5s"]).await;
    let held = two_held_calls(&server, &Grpc::new(channel(proxy.listen).await)).await;
    // tonic's client codec over a plain HTTP/2 connection: it sends `grpc-timeout` and runs no timer of its own,
    // so the deadline is floodgate's to enforce.
    let mut client = bare_client(proxy.listen).await;
    let began = Instant::now();
    let status = unary(&mut client, SLEEP, "0", Some(Duration::from_millis(300)))
        .await
        .expect_err("the call cannot start before its deadline");
    let waited = began.elapsed();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(status.message(), "request deadline passed before it could start");
    assert!(
        status.metadata().get("grpc-retry-pushback-ms").is_none(),
        "no pushback for a call's own deadline: {status:?}"
    );
    assert!(
        waited < Duration::from_secs(4),
        "shed at its deadline, not at the queue timeout: {waited:?}"
    );
    let samples = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&samples, "floodgate_requests_total", &[("outcome", "shed_deadline")]),
        1.0
    );
    release(&server, held).await;
    eprintln!("DEADLINE_EXCEEDED after {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_call_given_up_at_a_tonic_channels_own_deadline_leaves_the_queue_and_never_reaches_the_server() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 2, &["--queue-timeout", "5s"]).await;
    let mut grpc = Grpc::new(channel(proxy.listen).await);
    let held = two_held_calls(&server, &grpc).await;
    // Channel enforces the deadline it sends: it gives up at 300 ms (CANCELLED, "Timeout expired") unless
    // floodgate's DEADLINE_EXCEEDED for the same deadline arrives first.
    let status = unary(&mut grpc, SLEEP, "0", Some(Duration::from_millis(300)))
        .await
        .expect_err("the call cannot start before its deadline");
    assert!(
        matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{status:?}"
    );
    wait_until("floodgate's queue empty again", Duration::from_secs(5), || async {
        metric_sum(&parse_metrics(&proxy.metrics().await), "floodgate_queue_depth", &[]) == 0.0
    })
    .await;
    release(&server, held).await;
    eprintln!("the Channel's call ended {:?}: {}", status.code(), status.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bidirectional_call_is_relayed_message_by_message_and_holds_its_one_stream_until_it_ends() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 1, &[]).await;
    let mut grpc = Grpc::new(channel(proxy.listen).await);
    let (sender, receiver) = mpsc::channel::<Bytes>(1);
    let requests = stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|message| (message, receiver))
    });
    sender.send(msg(0)).await.expect("the first message queued");
    grpc.ready().await.expect("the client ready");
    let response = tokio::time::timeout(
        CLIENT_TIMEOUT,
        grpc.streaming(Request::new(requests), path(ECHO), RawCodec),
    )
    .await
    .expect("the call's head within the timeout")
    .expect("the call accepted");
    let mut replies = response.into_inner();
    let mut waiting = None;
    // Message k goes only once reply k-1 is back: were either direction held back by floodgate, this would wait
    // for ever (and fail at the timeout).
    for k in 0..10 {
        let reply = tokio::time::timeout(CLIENT_TIMEOUT, replies.message())
            .await
            .unwrap_or_else(|_| panic!("reply {k} did not come: a direction is buffered"))
            .expect("a reply")
            .expect("the stream still open");
        assert_eq!(reply, msg(k));
        if k == 4 {
            waiting = Some(unary_waits_behind(&proxy, &server, &grpc).await);
        }
        if k < 9 {
            sender.send(msg(k + 1)).await.expect("the next message queued");
        }
    }
    drop(sender);
    let end = tokio::time::timeout(CLIENT_TIMEOUT, replies.message())
        .await
        .expect("the call's end within the timeout");
    assert!(
        matches!(end, Ok(None)),
        "the call ends OK once the client is done: {end:?}"
    );
    served_after(&server, waiting.expect("a unary call waited")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_streaming_calls_messages_arrive_one_by_one_in_order_and_hold_its_one_stream_until_it_ends() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 1, &[]).await;
    let mut grpc = Grpc::new(channel(proxy.listen).await);
    grpc.ready().await.expect("the client ready");
    let response = tokio::time::timeout(
        CLIENT_TIMEOUT,
        grpc.server_streaming(Request::new(msg(6)), path(TICKS), RawCodec),
    )
    .await
    .expect("the call's head within the timeout")
    .expect("the call accepted");
    let mut ticks = response.into_inner();
    let mut waiting = None;
    let began = Instant::now();
    // The server sends tick k only once the client has tick k-1, then pauses: each was relayed as it came.
    for k in 0..6 {
        let tick = tokio::time::timeout(CLIENT_TIMEOUT, ticks.message())
            .await
            .unwrap_or_else(|_| panic!("tick {k} did not come: the answer is buffered"))
            .expect("a tick")
            .expect("the stream still open");
        assert_eq!(tick, msg(k), "the ticks come in order");
        if k == 2 {
            waiting = Some(unary_waits_behind(&proxy, &server, &grpc).await);
        }
        server.ack(k + 1);
    }
    let end = tokio::time::timeout(CLIENT_TIMEOUT, ticks.message())
        .await
        .expect("the call's end within the timeout");
    assert!(matches!(end, Ok(None)), "the stream ends OK: {end:?}");
    assert!(began.elapsed() >= TICK_PAUSE * 5, "five pauses: {:?}", began.elapsed());
    served_after(&server, waiting.expect("a unary call waited")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_streaming_call_is_summed_whole_and_holds_its_one_stream_until_it_ends() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 1, &[]).await;
    let grpc = Grpc::new(channel(proxy.listen).await);
    let (sender, receiver) = mpsc::channel::<Bytes>(8);
    let numbers = stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|message| (message, receiver))
    });
    let call = {
        let mut grpc = grpc.clone();
        tokio::spawn(async move {
            grpc.ready().await.expect("the client ready");
            grpc.client_streaming(Request::new(numbers), path(SUM), RawCodec)
                .await
                .map(|response| response.into_inner())
        })
    };
    for n in 1..=50 {
        sender.send(msg(n)).await.expect("a number queued");
    }
    wait_until_sync("the sum's handler at work", Duration::from_secs(5), || {
        server.rpcs() == 1
    })
    .await;
    let waiting = unary_waits_behind(&proxy, &server, &grpc).await;
    for n in 51..=100 {
        sender.send(msg(n)).await.expect("a number queued");
    }
    drop(sender);
    let total = tokio::time::timeout(CLIENT_TIMEOUT, call)
        .await
        .expect("the sum within the timeout")
        .expect("the call's task")
        .expect("the sum");
    assert_eq!(total, msg(5050));
    served_after(&server, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_error_status_reaches_the_client_with_its_code_and_message() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 4, &[]).await;
    let mut grpc = Grpc::new(channel(proxy.listen).await);
    let status = unary(&mut grpc, FAIL, "alice", None)
        .await
        .expect_err("the handler failed the call");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(status.message(), "no record named alice");
    assert_eq!(server.started(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_sent_in_trailers_after_a_message_reaches_the_client_after_that_message() {
    let server = ProbeServer::start().await;
    let proxy = proxy_for(&server, 1, 4, &[]).await;
    let mut grpc = Grpc::new(channel(proxy.listen).await);
    grpc.ready().await.expect("the client ready");
    let response = tokio::time::timeout(
        CLIENT_TIMEOUT,
        grpc.server_streaming(Request::new(msg("bob")), path(FAIL_AFTER), RawCodec),
    )
    .await
    .expect("the call's head within the timeout")
    .expect("an answer that starts OK: no status in its head");
    let mut messages = response.into_inner();
    let first = tokio::time::timeout(CLIENT_TIMEOUT, messages.message())
        .await
        .expect("the message within the timeout");
    assert_eq!(first.expect("a message before the status"), Some(msg("bob")));
    let status = tokio::time::timeout(CLIENT_TIMEOUT, messages.message())
        .await
        .expect("the status within the timeout")
        .expect_err("the call ends with the handler's status, from the trailers");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(status.message(), "no more records after bob");
}
