//! TLS termination on the client listener, through the real binary: a certificate made at test time, HTTPS
//! clients that trust only its CA, ALPN choosing HTTP/1.1 or HTTP/2, the cap holding behind TLS, and bad
//! certificate or key files stopping start-up (and `floodgate check`) with one line naming the key. SNI with
//! `[[tls_certificates]]`: certificates a test CA signs, the one presented for each name (exact, one-label
//! wildcard, the default, or a refused handshake without one), and bad entries named by index and field.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::h2_raw;
use support::pki::{self, assert_refused, TestCa};
use support::*;
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

/// A certificate for `localhost` that a test CA of its own signed, and its key, as files removed on drop.
struct TestCert {
    ca: TestCa,
    leaf: pki::Leaf,
}

impl TestCert {
    fn new() -> TestCert {
        let ca = TestCa::new("floodgate tls test CA");
        let leaf = ca.issue(&["localhost"]);
        TestCert { ca, leaf }
    }

    fn cert_path(&self) -> String {
        self.leaf.cert_path.clone()
    }

    fn key_path(&self) -> String {
        self.leaf.key_path.clone()
    }

    /// A client that trusts this certificate's CA alone and offers `alpn`.
    fn connector(&self, alpn: &[&[u8]]) -> TlsConnector {
        self.ca.connector(alpn)
    }
}

fn config_text(upstream: &str, cert: &str, key: &str) -> String {
    format!(
        "tls_cert = {cert:?}\ntls_key = {key:?}\n\n[upstreams.app]\nurl = {upstream:?}\nmax_connections = 2\nmax_queue = 1000\nqueue_timeout = \"20s\"\n\n[[routes]]\nupstream = \"app\"\n"
    )
}

/// An upstream, and floodgate in front of it on a TLS listener with `config_text`'s settings and `extra` flags.
struct TlsProxy {
    upstream: Upstream,
    cert: TestCert,
    proxy: Proxy,
    _config: TempConfig,
}

impl TlsProxy {
    async fn start(extra: &[&str]) -> TlsProxy {
        let upstream = Upstream::start().await;
        let cert = TestCert::new();
        let config = TempConfig::new(&config_text(&upstream.url(), &cert.cert_path(), &cert.key_path()));
        let path = config.path_str();
        let mut args = vec!["--config", path.as_str()];
        args.extend_from_slice(extra);
        let proxy = Proxy::start(&args).await;
        TlsProxy {
            upstream,
            cert,
            proxy,
            _config: config,
        }
    }
}

/// Reads what the server sends on `tls` until it closes (a close without close_notify reads as an error: either way
/// the connection is over); `None` if it is still open after 10 s.
async fn read_to_close(tls: &mut tokio_rustls::client::TlsStream<TcpStream>) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n) = tls.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    read.ok().map(|()| got)
}

async fn tls_connect(connector: &TlsConnector, addr: SocketAddr) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(CLIENT_TIMEOUT, connector.connect(name, tcp))
        .await
        .expect("TLS handshake timed out")
        .expect("TLS handshake")
}

async fn h1_get(connector: TlsConnector, addr: SocketAddr, path: String) -> Resp {
    let tls = tls_connect(&connector, addr).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let response = h1_send(tls, path).await;
    collect(response).await.unwrap()
}

/// One GET over HTTP/1.1 on an established TLS stream; the body is left to the caller.
async fn h1_send(
    tls: tokio_rustls::client::TlsStream<TcpStream>,
    path: String,
) -> hyper::Response<hyper::body::Incoming> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let request = Request::get(path)
        .header("host", "localhost")
        .body(body_empty())
        .unwrap();
    tokio::time::timeout(CLIENT_TIMEOUT, sender.send_request(request))
        .await
        .expect("response timed out")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_flood_of_unsolicited_http2_ping_acks_is_counted_and_closed_too() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let TlsProxy {
        upstream: _upstream,
        cert,
        proxy,
        _config,
    } = TlsProxy::start(&["--client-idle-timeout", "60s"]).await;
    let mut tls = tls_connect(&cert.connector(&[b"h2"]), proxy.listen).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let mut flood = h2_raw::hello();
    flood.extend(h2_raw::unsolicited_ping_acks(10_000));
    // Writing may fail once floodgate closes.
    let _ = tls.write_all(&flood).await;
    let _ = tls.flush().await;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = tls.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "a TLS connection flooding PING ACKs was still open after 10 s"
    );
    h2_raw::assert_unsolicited_ping_acks_counted(&proxy).await;
    let output = proxy.output();
    let about_pings = output.lines().filter(|line| line.contains("PING")).count();
    assert_eq!(about_pings, 0, "{about_pings} lines about PINGs at the default level");
}

/// A bare LF ending a trailer line, over TLS as over a plain socket: the body is refused, and the request pipelined
/// behind it (which an LF-tolerant reader would take as trailers) never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_bare_lf_in_trailers_is_refused_and_the_request_behind_it_never_read() {
    use tokio::io::AsyncWriteExt;
    let TlsProxy {
        upstream,
        cert,
        proxy,
        _config,
    } = TlsProxy::start(&[]).await;
    let mut tls = tls_connect(&cert.connector(&[b"http/1.1"]), proxy.listen).await;
    tls.write_all(
        b"POST /echo/tls HTTP/1.1\r\nHost: client.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\n\r\n\
          GET /smuggled HTTP/1.1\r\nHost: client.test\r\n\r\n",
    )
    .await
    .unwrap();
    let got = read_to_close(&mut tls).await;
    assert!(got.is_some(), "the connection was left open");
    let text = String::from_utf8_lossy(got.as_deref().unwrap_or_default());
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{text}");
    let reached: Vec<_> = upstream
        .recorded()
        .into_iter()
        .filter(|r| r.uri.starts_with("/echo") || r.uri.starts_with("/smuggled"))
        .collect();
    assert!(reached.is_empty(), "{reached:?}");
}

/// floodgate's HTTP/1 server over a TLS session: a large upload with a request pipelined behind it in the same
/// records (bytes the session holds decrypted while the first is answered), a `100 Continue` that must leave the
/// session before the client sends its body, and a large answer, each on one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_pipelined_requests_an_expect_continue_and_large_bodies_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let TlsProxy {
        upstream,
        cert,
        proxy,
        _config,
    } = TlsProxy::start(&[]).await;
    let connector = cert.connector(&[b"http/1.1"]);

    let upload = 1024 * 1024;
    let mut tls = tls_connect(&connector, proxy.listen).await;
    let mut pipelined =
        format!("POST /echo HTTP/1.1\r\nHost: client.test\r\nContent-Length: {upload}\r\n\r\n").into_bytes();
    pipelined.extend(std::iter::repeat_n(b'u', upload));
    pipelined.extend_from_slice(b"GET /second HTTP/1.1\r\nHost: client.test\r\nConnection: close\r\n\r\n");
    tls.write_all(&pipelined).await.unwrap();
    let answers = read_to_close(&mut tls).await.expect("the connection was left open");
    let text = String::from_utf8_lossy(&answers);
    assert_eq!(text.matches("HTTP/1.1 200 ").count(), 2, "{text}");
    assert!(
        text.contains(&format!("\r\n\r\n{upload}")),
        "the upload arrived whole: {text}"
    );
    assert_eq!(upstream.recorded_with_prefix("/second").len(), 1);

    let mut tls = tls_connect(&connector, proxy.listen).await;
    tls.write_all(b"POST /echo HTTP/1.1\r\nHost: client.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    let mut got = vec![0u8; interim.len()];
    tokio::time::timeout(Duration::from_secs(10), tls.read_exact(&mut got))
        .await
        .expect("no 100 Continue: the body would never be sent")
        .unwrap();
    assert_eq!(&got[..], interim, "{:?}", String::from_utf8_lossy(&got));
    tls.write_all(b"hello").await.unwrap();
    let answer = read_to_close(&mut tls).await.expect("the connection was left open");
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        text.starts_with("HTTP/1.1 200 ") && text.ends_with("\r\n\r\n5"),
        "{text}"
    );

    let download = 8 * MIB;
    let served = h1_get(connector, proxy.listen, format!("/bytes/{download}")).await;
    assert_eq!((served.status, served.body.len()), (StatusCode::OK, download as usize));
}

/// A TLS client that leaves while its request waits in the queue takes it out of the queue (whether it says
/// close_notify first or just closes), and nothing of it reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_clients_leaving_while_queued_leave_the_queue_and_never_reach_the_upstream() {
    use tokio::io::AsyncWriteExt;
    let TlsProxy {
        upstream,
        cert,
        proxy,
        _config,
    } = TlsProxy::start(&[]).await;
    let connector = cert.connector(&[b"http/1.1"]);
    // Both slots held (max_connections = 2) by requests the upstream stalls.
    let occupants: Vec<_> = (0..2)
        .map(|i| {
            let connector = connector.clone();
            let addr = proxy.listen;
            tokio::spawn(async move { h1_get(connector, addr, format!("/stall?occupant={i}")).await.status })
        })
        .collect();
    wait_until_sync("both slots held", Duration::from_secs(5), || upstream.inflight() == 2).await;
    let mut queued = Vec::new();
    for i in 0..6 {
        let mut tls = tls_connect(&connector, proxy.listen).await;
        tls.write_all(format!("GET /abandoned/{i} HTTP/1.1\r\nHost: client.test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        queued.push(tls);
    }
    proxy.wait_queue_depth("app", 6, Duration::from_secs(5)).await;
    for (i, mut tls) in queued.into_iter().enumerate() {
        if i % 2 == 0 {
            let _ = tls.shutdown().await;
        }
        drop(tls);
    }
    proxy.wait_queue_depth("app", 0, Duration::from_secs(5)).await;
    upstream.release_stalled();
    for occupant in occupants {
        assert_eq!(occupant.await.unwrap(), StatusCode::OK);
    }
    proxy.wait_in_use_zero("app", Duration::from_secs(5)).await;
    assert!(
        upstream.recorded_with_prefix("/abandoned").is_empty(),
        "{:?}",
        upstream.recorded()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_over_http1_and_h2_reaches_the_upstream_within_the_cap() {
    let TlsProxy {
        upstream,
        cert,
        proxy,
        _config,
    } = TlsProxy::start(&[]).await;

    // HTTP/1.1, one TLS connection per client, all at once: more clients than the cap of 2.
    let connector = cert.connector(&[b"http/1.1"]);
    let tasks: Vec<_> = (0..20)
        .map(|i| tokio::spawn(h1_get(connector.clone(), proxy.listen, format!("/delay/20?h1={i}"))))
        .collect();
    for task in tasks {
        let response = task.await.unwrap();
        assert_eq!(response.status, StatusCode::OK);
        assert_eq!(response.version, Version::HTTP_11);
    }

    // HTTP/2 negotiated by ALPN (the client offers both, the listener prefers h2), many streams on one connection.
    let tls = tls_connect(&cert.connector(&[b"h2", b"http/1.1"]), proxy.listen).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let mut sender = sender.clone();
            tokio::spawn(async move {
                let request = Request::get(format!("https://localhost/delay/20?h2={i}"))
                    .body(body_empty())
                    .unwrap();
                let response = tokio::time::timeout(CLIENT_TIMEOUT, sender.send_request(request))
                    .await
                    .expect("response timed out")
                    .unwrap();
                collect(response).await.unwrap()
            })
        })
        .collect();
    for task in tasks {
        let response = task.await.unwrap();
        assert_eq!(response.status, StatusCode::OK);
        assert_eq!(response.version, Version::HTTP_2);
    }

    assert_eq!(upstream.requests(), 50, "the upstream saw every request once");
    let recorded = upstream.recorded();
    assert_eq!(recorded.iter().filter(|r| r.uri.contains("h2=")).count(), 30);
    assert!(
        recorded.iter().all(|r| r.header("x-forwarded-proto") == Some("https")),
        "{recorded:?}"
    );
    assert!(upstream.peak_connections() <= 2, "peak {}", upstream.peak_connections());
}

#[tokio::test]
async fn the_tls_listener_refuses_plain_http() {
    let TlsProxy {
        upstream,
        cert: _cert,
        proxy,
        _config,
    } = TlsProxy::start(&[]).await;
    let (data, _) = raw_exchange(
        proxy.listen,
        b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(
        first_status(&data),
        None,
        "plain HTTP was answered over the TLS listener"
    );
    assert_eq!(upstream.requests(), 0);
}

#[test]
fn a_missing_certificate_file_stops_start_up_naming_tls_cert() {
    let cert = TestCert::new();
    let missing = cert.ca.dir.0.join("nope.pem").display().to_string();
    let line = assert_refused(
        &config_text("http://127.0.0.1:9", &missing, &cert.key_path()),
        "tls_cert",
    );
    assert!(line.contains("nope.pem"), "{line}");
}

#[test]
fn a_key_of_another_certificate_stops_start_up_naming_tls_key_without_showing_it() {
    let cert = TestCert::new();
    let other = TestCert::new();
    let line = assert_refused(
        &config_text("http://127.0.0.1:9", &cert.cert_path(), &other.key_path()),
        "tls_key",
    );
    assert!(line.contains("not the private key"), "{line}");
    let secret = other.leaf.key_pem.lines().nth(1).unwrap();
    assert!(!line.contains(secret) && !line.contains("PRIVATE KEY-----"), "{line}");
}

#[test]
fn a_key_file_that_is_not_pem_stops_start_up_naming_tls_key() {
    let cert = TestCert::new();
    let garbage = cert.ca.dir.0.join("garbage.pem");
    std::fs::write(
        &garbage,
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0!!not base64\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let line = assert_refused(
        &config_text("http://127.0.0.1:9", &cert.cert_path(), &garbage.display().to_string()),
        "tls_key",
    );
    assert!(!line.contains("c2VjcmV0"), "the key file's content was shown: {line}");
}

#[test]
fn only_one_of_the_pair_is_refused() {
    let cert = TestCert::new();
    let text = format!(
        "tls_cert = {:?}\n\n[upstreams.app]\nurl = \"http://127.0.0.1:9\"\n\n[[routes]]\nupstream = \"app\"\n",
        cert.cert_path()
    );
    assert_refused(&text, "tls_key");
}

#[test]
fn check_shows_the_paths_and_never_the_key() {
    let cert = TestCert::new();
    let config = TempConfig::new(&config_text("http://127.0.0.1:9", &cert.cert_path(), &cert.key_path()));
    let (status, stdout, stderr) = run_to_exit(&["check", "--config", &config.path_str()], Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains(&cert.key_path()) && stdout.contains(&cert.cert_path()),
        "{stdout}"
    );
    assert!(!stdout.contains("PRIVATE KEY"), "{stdout}");
}

/// A TLS client that completes the handshake, then trickles a request head one byte (one TLS record) at a time.
async fn trickle_head_over_tls(connector: TlsConnector, addr: SocketAddr) -> Duration {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tls = tls_connect(&connector, addr).await;
    let (mut read, mut write) = tokio::io::split(tls);
    let started = std::time::Instant::now();
    let writer = async move {
        for byte in b"GET /slowloris HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
            .iter()
            .chain(std::iter::repeat(&b'a'))
        {
            if write.write_all(&[*byte]).await.is_err() || write.flush().await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        std::future::pending::<()>().await
    };
    let reader = async move {
        let mut received = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(15), read.read_to_end(&mut received)).await;
    };
    tokio::select! {
        _ = reader => started.elapsed(),
        _ = writer => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_deadlines_hold_under_tls() {
    let upstream = Upstream::start().await;
    let cert = TestCert::new();
    let config = TempConfig::new(&config_text(&upstream.url(), &cert.cert_path(), &cert.key_path()));
    let proxy = Proxy::start(&[
        "--config",
        &config.path_str(),
        "--header-read-timeout",
        "1s",
        "--first-byte-timeout",
        "1s",
    ])
    .await;

    // A connection that never starts its handshake is closed at first_byte_timeout.
    let started = std::time::Instant::now();
    let (_, end) = raw_exchange(proxy.listen, b"", Duration::from_secs(10)).await;
    let silent = started.elapsed();
    assert!(
        silent >= Duration::from_millis(900) && silent < Duration::from_secs(5),
        "silent client closed after {silent:?} ({end:?})"
    );

    // A head trickled inside TLS is cut off at header_read_timeout and never reaches the upstream.
    let closed_after = trickle_head_over_tls(cert.connector(&[b"http/1.1"]), proxy.listen).await;
    assert!(
        closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(5),
        "trickled head closed {closed_after:?} after the handshake, header_read_timeout 1s"
    );
    assert!(upstream.recorded_with_prefix("/slowloris").is_empty());
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_that_stops_reading_gives_its_slot_back() {
    let upstream = Upstream::start().await;
    let cert = TestCert::new();
    let mut text = config_text(&upstream.url(), &cert.cert_path(), &cert.key_path());
    text = text.replace("max_connections = 2", "max_connections = 1");
    let config = TempConfig::new(&text);
    let proxy = Proxy::start(&["--config", &config.path_str(), "--body-idle-timeout", "1s"]).await;

    let connector = cert.connector(&[b"http/1.1"]);
    let tls = tls_connect(&connector, proxy.listen).await;
    let response = h1_send(tls, format!("/bytes/{}", 256 * MIB)).await;
    assert_eq!(response.status(), StatusCode::OK);
    // The body is never read: the proxy's writes stall, and the write-stall limit (the largest
    // body_idle_timeout) must end the exchange and give the only slot back.
    let stalled = std::time::Instant::now();
    proxy.wait_in_use_zero("app", Duration::from_secs(15)).await;
    assert!(
        stalled.elapsed() >= Duration::from_millis(900),
        "freed after {:?}",
        stalled.elapsed()
    );
    let served = h1_get(connector, proxy.listen, "/after".to_string()).await;
    assert_eq!(served.status, StatusCode::OK);
    assert!(
        upstream.bytes_streamed() < 64 * MIB,
        "streamed {}",
        upstream.bytes_streamed()
    );
    drop(response);
}

// ---------------------------------------------------------------------------
// SNI: several certificates on the listener
// ---------------------------------------------------------------------------

/// A config whose listener has `default` as tls_cert/tls_key (if any) and one `[[tls_certificates]]` entry per
/// `(names, leaf)`.
fn sni_config(upstream: &str, default: Option<&pki::Leaf>, entries: &[(&[&str], &pki::Leaf)]) -> String {
    let mut text = String::new();
    if let Some(default) = default {
        text += &format!("tls_cert = {:?}\ntls_key = {:?}\n", default.cert_path, default.key_path);
    }
    text += &format!("\n[upstreams.app]\nurl = {upstream:?}\n\n[[routes]]\nupstream = \"app\"\n");
    for (names, leaf) in entries {
        text += &format!(
            "\n[[tls_certificates]]\nnames = {names:?}\ncert = {:?}\nkey = {:?}\n",
            leaf.cert_path, leaf.key_path
        );
    }
    text
}

/// The leaf certificate the listener presents to a client sending `sni` (`None`: no SNI, as a client that dialled
/// an address sends), or the handshake's error.
async fn presented(
    addr: SocketAddr,
    sni: Option<&str>,
) -> std::io::Result<tokio_rustls::rustls::pki_types::CertificateDer<'static>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = match sni {
        Some(name) => ServerName::try_from(name.to_string()).unwrap(),
        None => ServerName::IpAddress(addr.ip().into()),
    };
    let tls = tokio::time::timeout(CLIENT_TIMEOUT, pki::accept_any_connector().connect(name, tcp))
        .await
        .expect("TLS handshake timed out")?;
    Ok(tls.get_ref().1.peer_certificates().unwrap()[0].clone())
}

#[tokio::test]
async fn sni_picks_each_names_certificate_a_wildcard_covers_one_label_and_other_names_get_tls_cert() {
    let upstream = Upstream::start().await;
    let ca = TestCa::new("floodgate SNI test CA");
    let default = ca.issue(&["default.test"]);
    let api = ca.issue(&["api.example.com"]);
    let wild = ca.issue(&["*.example.org"]);
    let config = TempConfig::new(&sni_config(
        &upstream.url(),
        Some(&default),
        &[(&["api.example.com"], &api), (&["*.example.org"], &wild)],
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    for (sni, expected, what) in [
        (Some("api.example.com"), &api, "an exact name"),
        (Some("API.Example.COM"), &api, "an exact name in other case"),
        (Some("a.example.org"), &wild, "one label under the wildcard"),
        (Some("a.b.example.org"), &default, "two labels under the wildcard"),
        (Some("example.org"), &default, "the wildcard's parent itself"),
        (Some("unknown.test"), &default, "a name no entry gives"),
        (None, &default, "no SNI"),
    ] {
        let leaf = presented(proxy.listen, sni).await.unwrap();
        assert!(leaf == expected.der, "{what} ({sni:?}) got another certificate");
    }

    // The picked certificate verifies against the CA for its name, and the connection serves requests.
    let tls = tokio::time::timeout(
        CLIENT_TIMEOUT,
        ca.connector(&[b"http/1.1"]).connect(
            ServerName::try_from("a.example.org").unwrap(),
            TcpStream::connect(proxy.listen).await.unwrap(),
        ),
    )
    .await
    .unwrap()
    .expect("a.example.org verifies against the wildcard certificate");
    let response = collect(h1_send(tls, "/over-sni".to_string()).await).await.unwrap();
    assert_eq!(response.status, StatusCode::OK);
    assert_eq!(upstream.recorded_with_prefix("/over-sni").len(), 1);
}

#[tokio::test]
async fn without_tls_cert_a_name_no_entry_gives_is_refused_at_the_handshake() {
    let ca = TestCa::new("floodgate SNI test CA");
    let api = ca.issue(&["api.example.com"]);
    let config = TempConfig::new(&sni_config("http://127.0.0.1:9", None, &[(&["api.example.com"], &api)]));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    assert!(presented(proxy.listen, Some("api.example.com")).await.unwrap() == api.der);
    for sni in [Some("other.example.com"), None] {
        let err = presented(proxy.listen, sni).await.unwrap_err();
        assert!(err.to_string().contains("AccessDenied"), "{sni:?}: {err}");
    }
}

#[test]
fn a_bad_certificate_entry_stops_start_up_naming_its_index_and_field() {
    let ca = TestCa::new("floodgate SNI test CA");
    let default = ca.issue(&["default.test"]);
    let api = ca.issue(&["api.example.com"]);
    let web = ca.issue(&["web.example.com"]);
    let upstream = "http://127.0.0.1:9";

    let missing = pki::Leaf {
        cert_path: ca.dir.0.join("nope.pem").display().to_string(),
        ..ca.issue(&["web.example.com"])
    };
    let line = assert_refused(
        &sni_config(
            upstream,
            Some(&default),
            &[(&["api.example.com"], &api), (&["web.example.com"], &missing)],
        ),
        "tls_certificates[1].cert",
    );
    assert!(line.contains("nope.pem"), "{line}");

    let crossed = pki::Leaf {
        key_path: web.key_path.clone(),
        ..ca.issue(&["api.example.com"])
    };
    let line = assert_refused(
        &sni_config(upstream, Some(&default), &[(&["api.example.com"], &crossed)]),
        "tls_certificates[0].key",
    );
    assert!(line.contains("not the private key"), "{line}");
    let secret = web.key_pem.lines().nth(1).unwrap();
    assert!(!line.contains(secret) && !line.contains("PRIVATE KEY-----"), "{line}");

    let line = assert_refused(
        &sni_config(
            upstream,
            Some(&default),
            &[(&["api.example.com", "www.example.com"], &api)],
        ),
        "tls_certificates[0].cert",
    );
    assert!(line.contains("not valid for www.example.com"), "{line}");

    let line = assert_refused(
        &sni_config(
            upstream,
            None,
            &[(&["api.example.com"], &api), (&["API.example.com"], &web)],
        ),
        "tls_certificates[1].names",
    );
    assert!(line.contains("already given by tls_certificates[0]"), "{line}");
}

#[tokio::test]
async fn a_reload_reads_renewed_certificates_and_refuses_a_broken_one() {
    let upstream = Upstream::start().await;
    let ca = TestCa::new("floodgate reload test CA");
    let first = ca.issue(&["default.test"]);
    let api = ca.issue(&["api.example.com"]);
    let config = TempConfig::new(&sni_config(
        &upstream.url(),
        Some(&first),
        &[(&["api.example.com"], &api)],
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    assert!(presented(proxy.listen, None).await.unwrap() == first.der);

    // Renewal: new certificates written over the same files, then a reload.
    let renewed = ca.issue(&["default.test"]);
    let renewed_api = ca.issue(&["api.example.com"]);
    std::fs::copy(&renewed.cert_path, &first.cert_path).unwrap();
    std::fs::copy(&renewed.key_path, &first.key_path).unwrap();
    std::fs::copy(&renewed_api.cert_path, &api.cert_path).unwrap();
    std::fs::copy(&renewed_api.key_path, &api.key_path).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    assert!(
        presented(proxy.listen, None).await.unwrap() == renewed.der,
        "the default was read again"
    );
    assert!(
        presented(proxy.listen, Some("api.example.com")).await.unwrap() == renewed_api.der,
        "the SNI entry was read again"
    );

    // A key that is not the certificate's refuses the reload; the renewed pair keeps being served.
    let other = ca.issue(&["default.test"]);
    std::fs::copy(&other.key_path, &first.key_path).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", resp.text());
    assert!(resp.text().contains("tls_key"), "{}", resp.text());
    assert!(presented(proxy.listen, None).await.unwrap() == renewed.der);
}
