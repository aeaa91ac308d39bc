//! Tunnels: WebSockets through floodgate to an upstream that counts its sockets exactly. Each tunnel has a socket
//! of its own, counted under `max_tunnels` beside `max_connections`, and given back once closed on both sides.

mod support;

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use http::StatusCode;
use support::websocket::*;
use support::*;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

const UP: &str = "default";
const T: Duration = Duration::from_secs(10);

async fn proxy_for(upstream: &WsUpstream, max_connections: usize, max_tunnels: usize, extra: &[&str]) -> Proxy {
    let mut args = vec![
        "--upstream".to_string(),
        upstream.url(),
        "--max-connections".to_string(),
        max_connections.to_string(),
        "--max-tunnels".to_string(),
        max_tunnels.to_string(),
    ];
    args.extend(extra.iter().map(|arg| arg.to_string()));
    Proxy::start(&args).await
}

/// Messages both ways, then the close handshake; the tunnel's socket is closed on both sides afterwards and its
/// slot back, on the server `http1_server` names.
async fn echo_and_close(http1_server: &str) {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 2, 4, &["--http1-server", http1_server]).await;
    let mut socket = ws_connect(proxy.listen, "/chat").await;
    ws_echo(&mut socket, "hello through floodgate").await;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    socket.send(Message::binary(big.clone())).await.unwrap();
    let echoed = tokio::time::timeout(T, socket.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(echoed, Message::binary(big), "a large message comes back whole");
    assert_eq!(proxy.upstream_field(UP, "tunnels_open").await, 1);
    socket
        .close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "bye".into(),
        }))
        .await
        .unwrap();
    // The upstream answers the close, and the stream ends.
    let mut closed = false;
    while let Some(message) = tokio::time::timeout(T, socket.next()).await.unwrap() {
        if let Ok(Message::Close(frame)) = message {
            assert_eq!(frame.map(|frame| frame.code), Some(CloseCode::Normal));
            closed = true;
        }
    }
    assert!(closed, "the close handshake reached the client");
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    assert_eq!(
        upstream.sockets_peak(),
        1,
        "one socket for the tunnel, none pooled beside it"
    );
    let metrics = proxy.metrics().await;
    let samples = parse_metrics(&metrics);
    assert_eq!(
        metric_sum(&samples, "floodgate_tunnels_opened_total", &[("upstream", UP)]),
        1.0
    );
    assert!(
        metric_sum(
            &samples,
            "floodgate_tunnel_bytes_total",
            &[("upstream", UP), ("direction", "to_client")]
        ) > 200_000.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_echoes_both_ways_and_closes_cleanly_on_floodgates_own_server() {
    echo_and_close("floodgate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_echoes_both_ways_and_closes_cleanly_on_hypers_server() {
    echo_and_close("hyper").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_beyond_max_tunnels_is_answered_503_with_retry_after_and_the_next_fits_once_one_closes() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 2, &[]).await;
    let mut first = ws_connect(proxy.listen, "/a").await;
    let mut second = ws_connect(proxy.listen, "/b").await;
    let refused =
        tokio_tungstenite::client_async("ws://client.test/c", TcpStream::connect(proxy.listen).await.unwrap())
            .await
            .expect_err("a third tunnel is refused");
    let tokio_tungstenite::tungstenite::Error::Http(response) = refused else {
        panic!("refused with {refused:?}");
    };
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"), "{response:?}");
    assert_eq!(response.headers()["x-floodgate-shed-reason"], "tunnel_limit");
    assert_eq!(upstream.sockets_peak(), 2, "the refused one never reached the upstream");
    ws_echo(&mut first, "still open").await;
    second.close(None).await.unwrap();
    while tokio::time::timeout(T, second.next()).await.unwrap().is_some() {}
    proxy.wait_until_field(UP, "tunnels_open", 1, T).await;
    let mut third = ws_connect(proxy.listen, "/c").await;
    ws_echo(&mut third, "room again").await;
    let metrics = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "floodgate_tunnels_refused_total",
            &[("upstream", UP), ("reason", "limit")]
        ),
        1.0
    );
    assert_eq!(proxy.outcome_count(UP, "shed_tunnel_limit").await, 1.0);
    assert!(upstream.sockets_peak() <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_requests_keep_their_full_cap_while_tunnels_are_open_and_the_upstream_sees_no_more_than_the_sum() {
    let upstream = WsUpstream::start().await;
    let (max_connections, max_tunnels) = (2, 3);
    let proxy = proxy_for(&upstream, max_connections, max_tunnels, &[]).await;
    let mut tunnels = Vec::new();
    for i in 0..max_tunnels {
        tunnels.push(ws_connect(proxy.listen, &format!("/ws/{i}")).await);
    }
    // Twice the cap of held requests: the cap's worth at the upstream at once, the rest queued.
    let held: Vec<_> = (0..2 * max_connections)
        .map(|_| tokio::spawn(get(proxy.listen, "/hold")))
        .collect();
    wait_until_sync("the cap's worth of requests at the upstream", T, || {
        upstream.in_flight() == max_connections
    })
    .await;
    proxy.wait_queue_depth(UP, max_connections as u64, T).await;
    for (i, socket) in tunnels.iter_mut().enumerate() {
        ws_echo(socket, &format!("tunnel {i} beside a full pool")).await;
    }
    upstream.release_held();
    for request in held {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(upstream.in_flight_peak(), max_connections);
    assert_eq!(upstream.sockets_peak(), max_connections + max_tunnels);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_client_gives_its_tunnel_slot_back_once_the_socket_is_closed_both_ways() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 1, &[]).await;
    let mut socket = ws_connect(proxy.listen, "/gone").await;
    ws_echo(&mut socket, "here").await;
    // The client's host vanishes: its socket is reset, not closed politely.
    let stream = socket.into_inner();
    socket2::SockRef::from(&stream)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(stream);
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let mut next = ws_connect(proxy.listen, "/next").await;
    ws_echo(&mut next, "the slot came back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_is_closed_after_tunnel_idle_timeout_and_says_so_in_the_access_log() {
    let upstream = WsUpstream::start().await;
    let url = upstream.url();
    let proxy = Proxy::start_with_env(
        &[
            "--upstream",
            &url,
            "--max-tunnels",
            "1",
            "--tunnel-idle-timeout",
            "300ms",
            "--log-format",
            "json",
        ],
        &[("FLOODGATE__ACCESS_LOG", "stdout")],
    )
    .await;
    let mut socket = ws_connect(proxy.listen, "/quiet").await;
    ws_echo(&mut socket, "once").await;
    let ended = tokio::time::timeout(T, async { while let Some(Ok(_)) = socket.next().await {} }).await;
    assert!(ended.is_ok(), "the idle tunnel was not closed");
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    let lines = proxy.access_lines(1).await;
    let line = &lines[0];
    assert_eq!(line["status"], 101, "{line}");
    assert_eq!(line["path"], "/quiet", "{line}");
    assert_eq!(line["closed_by"], "idle_timeout", "{line}");
    assert!(line["bytes"].as_u64().is_some_and(|bytes| bytes > 0), "{line}");
    assert!(
        line["bytes_to_upstream"].as_u64().is_some_and(|bytes| bytes > 0),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_the_upstream_refuses_is_answered_with_its_refusal_and_the_socket_closed() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 1, &[]).await;
    let refused = tokio_tungstenite::client_async(
        "ws://client.test/refuse",
        TcpStream::connect(proxy.listen).await.unwrap(),
    )
    .await
    .expect_err("the upstream refuses");
    let tokio_tungstenite::tungstenite::Error::Http(response) = refused else {
        panic!("refused with {refused:?}");
    };
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(response.body().as_deref(), Some(&b"no websockets here\n"[..]));
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let mut socket = ws_connect(proxy.listen, "/fine").await;
    ws_echo(&mut socket, "the bound is free again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_are_refused_with_501_while_max_tunnels_is_0_h2c_is_served_over_http11_and_connect_is_refused() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 0, &[]).await;
    let websocket = b"GET /chat HTTP/1.1\r\nHost: client.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
        Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(websocket).await.unwrap();
    let resp = conn.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 501, "{}", resp.text());
    assert!(resp.text().contains("max_tunnels"), "{}", resp.text());

    let h2c = b"GET /h2c HTTP/1.1\r\nHost: client.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n\
        HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(h2c).await.unwrap();
    let resp = conn.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 200, "h2c is ignored, the request served: {}", resp.text());
    assert!(
        upstream.counts.last_upgrade.lock().unwrap().is_none(),
        "no Upgrade went upstream"
    );

    let connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(connect).await.unwrap();
    let resp = conn.read_response(false, T).await.unwrap();
    assert_eq!(resp.status, 501, "CONNECT: {}", resp.text());
    assert!(resp.text().contains("CONNECT"), "{}", resp.text());
    assert_eq!(upstream.websockets(), 0);
    let metrics = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "floodgate_tunnels_refused_total",
            &[("upstream", UP), ("reason", "off")]
        ),
        1.0
    );
}
