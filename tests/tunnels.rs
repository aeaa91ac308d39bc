//! Tunnels: WebSockets through floodgate to an upstream that counts its sockets exactly. Each tunnel has a socket
//! of its own, counted under `max_tunnels` beside `max_connections`, and given back once closed on both sides.

mod support;

use std::time::Duration;

use bytes::Bytes;
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

/// The upstream's tunnel socket closed and the proxy's count back to 0, a new tunnel to `path` opens and echoes.
async fn the_slot_comes_back(proxy: &Proxy, upstream: &WsUpstream, path: &str, text: &str) {
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let mut socket = ws_connect(proxy.listen, path).await;
    ws_echo(&mut socket, text).await;
}

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
/// slot back.
async fn echo_and_close() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 2, 4, &[]).await;
    let mut socket = ws_connect(proxy.listen, "/chat").await;
    ws_echo(&mut socket, "hello through floodgate").await;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    socket.send(Message::binary(big.clone())).await.unwrap();
    let echoed = tokio::time::timeout(T, socket.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(echoed, Message::binary(big), "a large message comes back whole");
    assert_eq!(proxy.upstream_field(UP, "tunnels_open").await, 1);
    assert_eq!(
        proxy.client_connections().await,
        1.0,
        "the tunnel's client connection still counts"
    );
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
async fn a_websocket_echoes_both_ways_and_closes_cleanly() {
    echo_and_close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_beyond_max_tunnels_is_answered_503_with_retry_after_and_the_next_fits_once_one_closes() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 2, &[]).await;
    let mut first = ws_connect(proxy.listen, "/a").await;
    let mut second = ws_connect(proxy.listen, "/b").await;
    let response = ws_refused(proxy.listen, "/c").await;
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
    the_slot_comes_back(&proxy, &upstream, "/next", "the slot came back").await;
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
    assert_eq!(line["http.response.status_code"], 101, "{line}");
    assert_eq!(line["url.path"], "/quiet", "{line}");
    assert_eq!(line["floodgate.outcome"], "tunnel", "{line}");
    assert_eq!(line["floodgate.tunnel.closed_by"], "idle_timeout", "{line}");
    assert!(
        line["http.response.body.size"].as_u64().is_some_and(|bytes| bytes > 0),
        "{line}"
    );
    assert!(
        line["floodgate.tunnel.bytes_to_upstream"]
            .as_u64()
            .is_some_and(|bytes| bytes > 0),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_the_upstream_refuses_is_answered_with_its_refusal_and_the_socket_closed() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 1, &[]).await;
    let response = ws_refused(proxy.listen, "/refuse").await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(response.body().as_deref(), Some(&b"no websockets here\n"[..]));
    the_slot_comes_back(&proxy, &upstream, "/fine", "the bound is free again").await;
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

/// Messages both ways and the close handshake over a WebSocket opened by `open`; the upstream saw an HTTP/1.1
/// upgrade with a key of floodgate's making.
async fn echo_over_h2<S>(socket: &mut WsClient<S>, upstream: &WsUpstream, proxy: &Proxy)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    ws_echo(socket, "over an HTTP/2 stream").await;
    ws_echo(socket, &"x".repeat(100_000)).await;
    let (key, upgrade) = upstream.counts.last_upgrade.lock().unwrap().clone().unwrap();
    assert_eq!(upgrade, "websocket");
    assert_eq!(key.len(), 24, "a Sec-WebSocket-Key of 16 bytes: {key:?}");
    ws_close(socket).await;
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_over_http2_prior_knowledge_reaches_the_upstream_as_an_http11_upgrade() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 2, &[]).await;
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let (mut socket, _conn) = ws_open_h2(stream, "http", "/h2").await.unwrap();
    assert_eq!(proxy.upstream_field(UP, "tunnels_open").await, 1);
    echo_over_h2(&mut socket, &upstream, &proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_over_tls_with_http11_and_with_h2_by_alpn() {
    let upstream = WsUpstream::start().await;
    let ca = pki::TestCa::new("floodgate tunnel test CA");
    let leaf = ca.issue(&["localhost"]);
    let config = TempConfig::new(&format!(
        "tls_cert = {:?}\ntls_key = {:?}\n\n[upstreams.{UP}]\nurl = {:?}\nmax_connections = 1\nmax_tunnels = 2\n\n\
         [[routes]]\nupstream = \"{UP}\"\n",
        leaf.cert_path,
        leaf.key_path,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let connect = |alpn: &'static [u8]| {
        let connector = ca.connector(&[alpn]);
        async move {
            let tcp = TcpStream::connect(proxy.listen).await.unwrap();
            let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
            connector.connect(name, tcp).await.unwrap()
        }
    };
    let tls = connect(b"http/1.1").await;
    let mut socket = ws_open(tls, "/tls-h1").await.unwrap();
    ws_echo(&mut socket, "over TLS, HTTP/1.1").await;
    assert_eq!(
        proxy.client_connections().await,
        1.0,
        "the tunnel's client connection still counts"
    );
    ws_close(&mut socket).await;
    drop(socket);
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let tls = connect(b"h2").await;
    let (mut socket, _conn) = ws_open_h2(tls, "https", "/tls-h2").await.unwrap();
    assert_eq!(proxy.upstream_field(UP, "tunnels_open").await, 1);
    echo_over_h2(&mut socket, &upstream, &proxy).await;
}

fn ws_config(url: &str, max_tunnels: usize) -> String {
    format!("[upstreams.{UP}]\nurl = {url:?}\nmax_connections = 1\nmax_tunnels = {max_tunnels}\n\n[[routes]]\nupstream = \"{UP}\"\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_replaces_the_upstream_lets_its_tunnels_run_until_they_end_within_one_bound() {
    let (old, new) = (WsUpstream::start().await, WsUpstream::start().await);
    let config = TempConfig::new(&ws_config(&old.url(), 2));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let mut before = ws_connect(proxy.listen, "/before").await;
    std::fs::write(config.path(), ws_config(&new.url(), 2)).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let status = proxy.status().await;
    assert_eq!(status["draining"][0]["tunnels_open"], 1, "{status}");
    // The retired upstream's tunnel goes on; a new one goes to the new upstream, under the same bound.
    ws_echo(&mut before, "after the reload").await;
    let mut after = ws_connect(proxy.listen, "/after").await;
    ws_echo(&mut after, "to the new upstream").await;
    assert_eq!((old.websockets(), new.websockets()), (1, 1));
    let response = ws_refused(proxy.listen, "/third").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    ws_close(&mut before).await;
    drop(before);
    wait_until_sync("the old upstream's socket closed", T, || old.sockets() == 0).await;
    wait_until("the retired upstream gone from /status", T, || async {
        proxy.status().await["draining"].is_null()
    })
    .await;
    let mut third = ws_connect(proxy.listen, "/third").await;
    ws_echo(&mut third, "room once the old one ended").await;
    ws_echo(&mut after, "still there").await;
}

/// A tunnel opened by `open` runs on through a drain until `shutdown_timeout` (2 s), then is ended by floodgate,
/// which writes its access-log line and exits 0.
async fn tunnel_through_shutdown<S, F>(extra: &[&str], open: impl FnOnce(std::net::SocketAddr) -> F)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    F: std::future::Future<Output = WsClient<S>>,
{
    let upstream = WsUpstream::start().await;
    let url = upstream.url();
    let mut args = vec![
        "--upstream",
        &url,
        "--max-tunnels",
        "1",
        "--shutdown-timeout",
        "2s",
        "--log-format",
        "json",
    ];
    args.extend_from_slice(extra);
    let mut proxy = Proxy::start_with_env(&args, &[("FLOODGATE__ACCESS_LOG", "stdout")]).await;
    let mut socket = open(proxy.listen).await;
    let signalled = std::time::Instant::now();
    proxy.sigterm();
    // Draining: no new client is accepted, and the tunnel goes on working.
    wait_until("the listener closed", T, || async {
        TcpStream::connect(proxy.listen).await.is_err()
    })
    .await;
    let mut echoes = 0;
    while signalled.elapsed() < Duration::from_millis(1500) {
        ws_echo(&mut socket, &format!("while draining {echoes}")).await;
        echoes += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(echoes >= 5, "{echoes} echoes");
    let ended = tokio::time::timeout(T, async { while let Some(Ok(_)) = socket.next().await {} }).await;
    assert!(ended.is_ok(), "the tunnel was not closed at shutdown_timeout");
    assert!(signalled.elapsed() >= Duration::from_millis(1500));
    let exit = proxy.wait_exit(T).await.expect("floodgate exited");
    assert!(exit.success(), "{exit:?}");
    let lines = proxy.access_lines(1).await;
    assert_eq!(lines[0]["floodgate.tunnel.closed_by"], "shutdown", "{}", lines[0]);
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_shutdown_a_tunnel_runs_on_until_shutdown_timeout_then_is_closed() {
    tunnel_through_shutdown(&[], |listen| ws_connect(listen, "/long")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_shutdown_an_http2_tunnel_runs_on_until_shutdown_timeout_then_is_closed() {
    tunnel_through_shutdown(&[], |listen| async move {
        let stream = TcpStream::connect(listen).await.unwrap();
        let (socket, conn) = ws_open_h2(stream, "http", "/long").await.unwrap();
        // The connection's task lives as long as the test: dropping its handle does not stop it.
        drop(conn);
        socket
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_tunnel_outlives_its_connections_client_idle_timeout() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 1, &["--client-idle-timeout", "300ms"]).await;
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let (mut socket, _conn) = ws_open_h2(stream, "http", "/busy").await.unwrap();
    // Well past the connection's idle timeout and its goodbye's 2 s grace, with the tunnel in use.
    for n in 0..12 {
        ws_echo(&mut socket, &format!("tick {n}")).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_only_websockets_are_tunnelled_and_an_upstream_that_does_not_switch_is_a_502() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 2, &[]).await;
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let refused = ws_open_h2_as(stream, "http", "/h2c", "h2c")
        .await
        .expect_err("h2c is refused");
    assert!(refused.contains("501"), "{refused}");
    assert!(
        upstream.counts.last_upgrade.lock().unwrap().is_none(),
        "nothing went upstream"
    );
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let refused = ws_open_h2(stream, "http", "/ignore")
        .await
        .expect_err("no tunnel without a switch");
    assert!(refused.contains("502"), "{refused}");
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let metrics = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "floodgate_tunnels_refused_total",
            &[("upstream", UP), ("reason", "upstream")]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(&metrics, "floodgate_tunnels_opened_total", &[("upstream", UP)]),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_sent_events_reach_the_client_one_by_one_for_longer_than_body_idle_timeout() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 0, &["--body-idle-timeout", "400ms"]).await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/events").body(body_empty()).unwrap();
    let response = conn.send(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let events = upstream.take_events();
    // Lockstep: each event is sent only once the one before reached the client, so a proxy that held any back
    // (to fill a buffer, or to batch) would stall here. The gaps add up to well past body_idle_timeout.
    for n in 0..6 {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let event = format!("id: {n}\ndata: tick {n}\n\n");
        events.send(Bytes::from(event.clone())).unwrap();
        let frame = tokio::time::timeout(T, http_body_util::BodyExt::frame(&mut body))
            .await
            .expect("the event did not reach the client")
            .expect("the stream ended early")
            .unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from(event));
    }
    drop(events);
    assert!(
        http_body_util::BodyExt::frame(&mut body).await.is_none(),
        "the stream ends with the upstream's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_vanishes_ends_its_tunnel_and_gives_the_slot_back() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 1, &[]).await;
    let mut socket = ws_connect(proxy.listen, "/vanish").await;
    socket.send(Message::text("anyone there?")).await.unwrap();
    let ended = tokio::time::timeout(T, async { while let Some(Ok(_)) = socket.next().await {} }).await;
    assert!(ended.is_ok(), "the client's side of the tunnel did not end");
    wait_until_sync("the upstream's socket gone", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let mut next = ws_connect(proxy.listen, "/next").await;
    ws_echo(&mut next, "the slot came back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_upgrades_and_requests_never_takes_the_upstream_past_the_sum() {
    let upstream = WsUpstream::start().await;
    let (max_connections, max_tunnels) = (2, 3);
    let proxy = proxy_for(&upstream, max_connections, max_tunnels, &[]).await;
    let listen = proxy.listen;
    let upgrades: Vec<_> = (0..12)
        .map(|i| {
            tokio::spawn(async move {
                let stream = TcpStream::connect(listen).await.unwrap();
                match tokio_tungstenite::client_async(format!("ws://client.test/burst/{i}"), stream).await {
                    Ok((socket, _)) => Ok(socket),
                    Err(tokio_tungstenite::tungstenite::Error::Http(response)) => Err(response.status()),
                    Err(other) => panic!("upgrade {i}: {other}"),
                }
            })
        })
        .collect();
    let requests: Vec<_> = (0..12).map(|_| tokio::spawn(get(listen, "/plain"))).collect();
    let mut open = Vec::new();
    for upgrade in upgrades {
        match upgrade.await.unwrap() {
            Ok(socket) => open.push(socket),
            Err(status) => assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE),
        }
    }
    for request in requests {
        assert_eq!(request.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(
        open.len(),
        max_tunnels,
        "as many tunnels as the bound, the rest refused"
    );
    for (i, socket) in open.iter_mut().enumerate() {
        ws_echo(socket, &format!("burst {i}")).await;
    }
    assert!(
        upstream.sockets_peak() <= max_connections + max_tunnels,
        "the upstream saw {} sockets",
        upstream.sockets_peak()
    );
    assert!(upstream.in_flight_peak() <= max_connections);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_with_its_own_body_idle_timeout_carries_events_its_upstreams_would_cut() {
    let upstream = WsUpstream::start().await;
    let config = TempConfig::new(&format!(
        "[upstreams.{UP}]\nurl = \"{}\"\nbody_idle_timeout = \"200ms\"\n\n\
         [[routes]]\npath_prefix = \"/events\"\nupstream = \"{UP}\"\nbody_idle_timeout = \"5s\"\n",
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    let response = conn
        .send(http::Request::get("/events").body(body_empty()).unwrap())
        .await
        .unwrap();
    let mut body = response.into_body();
    let events = upstream.take_events();
    for n in 0..3 {
        // Each gap well past the upstream's 200 ms, within the route's 5 s.
        tokio::time::sleep(Duration::from_millis(500)).await;
        events.send(Bytes::from(format!("data: {n}\n\n"))).unwrap();
        let frame = tokio::time::timeout(T, http_body_util::BodyExt::frame(&mut body))
            .await
            .expect("the event did not come")
            .expect("the stream was cut")
            .unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from(format!("data: {n}\n\n")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_response_edits_apply_to_the_switch_and_to_a_refusal() {
    let upstream = WsUpstream::start().await;
    let config = TempConfig::new(&format!(
        "{}[routes.set_response_headers]\nx-served-by = \"edge\"\n",
        ws_config(&upstream.url(), 2)
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let (mut socket, switched) = tokio_tungstenite::client_async("ws://client.test/edited", stream)
        .await
        .unwrap();
    assert_eq!(switched.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(switched.headers()["x-served-by"], "edge");
    ws_echo(&mut socket, "through the edited switch").await;
    ws_close(&mut socket).await;
    let refused = ws_refused(proxy.listen, "/refuse").await;
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    assert_eq!(refused.headers()["x-served-by"], "edge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_protocol_the_client_did_not_offer_is_a_502_and_its_socket_closed() {
    let upstream = WsUpstream::start().await;
    let proxy = proxy_for(&upstream, 1, 2, &[]).await;
    // The upstream switches to IRC/6.9 when asked for a WebSocket (RFC 9110 §7.8: a server must not).
    let refused = ws_refused(proxy.listen, "/elsewhere").await;
    assert_eq!(refused.status(), StatusCode::BAD_GATEWAY);
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    let stream = TcpStream::connect(proxy.listen).await.unwrap();
    let refused = ws_open_h2(stream, "http", "/elsewhere")
        .await
        .expect_err("no tunnel to another protocol");
    assert!(refused.contains("502"), "{refused}");
    wait_until_sync("the upstream's socket closed", T, || upstream.sockets() == 0).await;
    proxy.wait_until_field(UP, "tunnels_open", 0, T).await;
    let metrics = parse_metrics(&proxy.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "floodgate_tunnels_opened_total", &[("upstream", UP)]),
        0.0
    );
    // Protocol names compare case-insensitively: `WebSocket` asked, `websocket` switched to, is a switch.
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(
        b"GET /chat HTTP/1.1\r\nHost: client.test\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await
    .unwrap();
    let switched = conn.read_head(T).await.unwrap();
    assert_eq!(switched.status, 101, "{switched:?}");
    assert_eq!(switched.header("upgrade"), Some("websocket"));
    drop(conn);
    the_slot_comes_back(&proxy, &upstream, "/fine", "the bound is free again").await;
}
