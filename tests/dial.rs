//! Dialling the upstream: a connect that never completes is a 502 within `connect_timeout`, and the slot it
//! held comes back.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const UP: &str = "default";

/// A listener whose accept queue is full: the kernel drops further SYNs, so connects to it hang (the loopback
/// stand-in for a black-holed upstream).
fn black_hole() -> (socket2::Socket, std::net::TcpStream) {
    let listener = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    listener
        .bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into())
        .unwrap();
    listener.listen(0).unwrap();
    let address = listener.local_addr().unwrap().as_socket().unwrap();
    // With a backlog of 0 the queue holds one connection; this one fills it and is never accepted.
    let filler = std::net::TcpStream::connect(address).unwrap();
    (listener, filler)
}

#[tokio::test]
async fn a_connect_that_never_completes_is_a_502_within_connect_timeout_and_frees_the_slot() {
    let (listener, _filler) = black_hole();
    let address = listener.local_addr().unwrap().as_socket().unwrap();
    let proxy = Proxy::start(&[
        "--upstream",
        &format!("http://{address}"),
        "--max-connections",
        "1",
        "--connect-timeout",
        "300ms",
    ])
    .await;

    for _ in 0..2 {
        let started = Instant::now();
        let resp = get(proxy.listen, "/").await;
        assert_eq!(resp.status, StatusCode::BAD_GATEWAY);
        assert!(resp.text().contains("connect timeout"), "{}", resp.text());
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "answered before the connect timeout"
        );
    }
    proxy.wait_in_use_zero(UP, Duration::from_secs(5)).await;
    wait_until("the timed-out attempt is gone", Duration::from_secs(5), || async {
        proxy.upstream_field(UP, "connections_open").await == 0
    })
    .await;
    assert_eq!(proxy.outcome_count(UP, "upstream_error").await, 2.0);
}
