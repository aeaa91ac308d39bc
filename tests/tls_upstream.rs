//! `https://` upstreams, through the real binary: a TLS upstream (tokio-rustls and hyper, with certificates a test
//! CA signs) that counts the TCP connections it accepts and holds at once. Connections are TLS and reused, the cap
//! holds, SNI and the verified name follow the URL or `tls_server_name`, client certificates are presented when
//! configured; a wrong CA, a missing client certificate and a stalled handshake are 502s that give their slot
//! back; bad TLS settings stop start-up (and `floodgate check`) with one line naming the key.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::pki::{self, assert_refused, assert_refused_with_env, Leaf, TempDir, TestCa};
use support::*;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

const UP: &str = "app";

/// What a TLS upstream counts.
#[derive(Default)]
struct Counts {
    accepted: AtomicUsize,
    open: AtomicUsize,
    peak: AtomicUsize,
    requests: AtomicUsize,
    failed_handshakes: AtomicUsize,
}

impl Counts {
    fn opened(&self) {
        self.accepted.fetch_add(1, Ordering::SeqCst);
        let now = self.open.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }
}

/// The upstream's end of a TCP connection. It stops counting just before its FIN leaves (or as it drops): from
/// then on the upstream has closed its side, which is all a proxy can see before it dials a replacement.
struct Counted {
    inner: TcpStream,
    counts: Arc<Counts>,
    counted: AtomicBool,
}

impl Counted {
    fn closed(&self) {
        if self.counted.swap(false, Ordering::SeqCst) {
            self.counts.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.closed();
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.closed();
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// An HTTPS/1.1 origin on 127.0.0.1 presenting `leaf`, asking for a client certificate the CA `client_ca` signed
/// when given. It offers ALPN h2 before http/1.1, so a proxy that offered h2 would get it. `/delay/{ms}` answers
/// after `ms`; every answer's body says what the connection and the request carried:
/// `sni=… alpn=… client_cert=… host=… proto=…`.
struct TlsUpstream {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl TlsUpstream {
    async fn start(leaf: &Leaf, client_ca: Option<&TestCa>) -> TlsUpstream {
        let builder = ServerConfig::builder_with_provider(pki::provider())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(Arc::new(ca.roots()), pki::provider())
                    .build()
                    .unwrap(),
            ),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(leaf.chain(), leaf.key()).unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let task = tokio::spawn(accept_loop(listener, acceptor, counts.clone()));
        TlsUpstream { addr, counts, task }
    }

    fn accepted(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    fn open(&self) -> usize {
        self.counts.open.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.counts.peak.load(Ordering::SeqCst)
    }

    fn requests(&self) -> usize {
        self.counts.requests.load(Ordering::SeqCst)
    }

    fn failed_handshakes(&self) -> usize {
        self.counts.failed_handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, counts: Arc<Counts>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        counts.opened();
        let stream = Counted {
            inner: tcp,
            counts: counts.clone(),
            counted: AtomicBool::new(true),
        };
        let acceptor = acceptor.clone();
        let counts = counts.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(_) => {
                    counts.failed_handshakes.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            };
            let session = tls.get_ref().1;
            let described = format!(
                "sni={:?} alpn={:?} client_cert={}",
                session.server_name(),
                session.alpn_protocol().map(String::from_utf8_lossy),
                session.peer_certificates().is_some()
            );
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let counts = counts.clone();
                let described = described.clone();
                async move {
                    counts.requests.fetch_add(1, Ordering::SeqCst);
                    let path = request.uri().path().to_string();
                    if let Some(ms) = path.strip_prefix("/delay/").and_then(|ms| ms.parse().ok()) {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    let header = |name: &str| {
                        request
                            .headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("-")
                            .to_string()
                    };
                    let body = format!(
                        "{described} host={} proto={}",
                        header("host"),
                        header("x-forwarded-proto")
                    );
                    Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(body))))
                }
            });
            // HTTP/2 when the client chose it by ALPN.
            if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            } else {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            }
        });
    }
}

/// One upstream `app` at `url` behind a catch-all route, with `extra` lines in its table.
fn upstream_config(url: &str, extra: &str) -> String {
    format!(
        "[upstreams.app]\nurl = {url:?}\nmax_queue = 1000\nqueue_timeout = \"20s\"\n{extra}\n\n[[routes]]\nupstream = \"app\"\n"
    )
}

async fn wait_until_released(proxy: &Proxy, name: &str) {
    proxy.wait_in_use_zero(name, Duration::from_secs(10)).await;
    wait_until(
        &format!("upstreams.{name}.connections_open == 0"),
        Duration::from_secs(10),
        || async { proxy.upstream_field(name, "connections_open").await == 0 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_reached_over_tls_with_reused_connections_and_never_more_than_the_cap() {
    let ca = TestCa::new("floodgate upstream test CA");
    let upstream = TlsUpstream::start(&ca.issue(&["localhost"]), None).await;
    let url = format!("https://localhost:{}", upstream.addr.port());
    let extra = format!("max_connections = 3\ntls_ca = {:?}", ca.cert_path);
    let config = TempConfig::new(&upstream_config(&url, &extra));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    // 50 clients at once, two requests each on a keep-alive connection, against a cap of 3.
    let clients: Vec<_> = (0..50)
        .map(|i| {
            let addr = proxy.listen;
            tokio::spawn(async move {
                let mut client = H1Conn::connect(addr).await;
                let mut bodies = Vec::new();
                for j in 0..2 {
                    let response = client.get(&format!("/delay/10?c={i}&r={j}")).await;
                    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
                    bodies.push(response.text());
                }
                bodies
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for client in clients {
        bodies.extend(client.await.unwrap());
    }
    assert_eq!(upstream.requests(), 100);
    let expected = format!(
        "sni=Some(\"localhost\") alpn=Some(\"http/1.1\") client_cert=false host={} proto=http",
        proxy.listen
    );
    assert!(bodies.iter().all(|body| *body == expected), "{:?}", bodies.first());
    assert!(
        upstream.peak() == 3,
        "the upstream saw {} connections at once, the cap is 3 and 50 clients want more",
        upstream.peak()
    );
    assert!(
        upstream.accepted() < upstream.requests(),
        "{} connections for {} requests: none reused",
        upstream.accepted(),
        upstream.requests()
    );
    assert_eq!(upstream.failed_handshakes(), 0);
    assert!(proxy.upstream_field(UP, "connections_peak").await <= 3);
}

#[tokio::test]
async fn sni_is_the_url_host_or_tls_server_name_and_an_ip_host_is_verified_by_address_without_sni() {
    let ca = TestCa::new("floodgate upstream test CA");
    let by_address = TlsUpstream::start(&ca.issue(&["127.0.0.1"]), None).await;
    let by_name = TlsUpstream::start(&ca.issue(&["upstream.internal"]), None).await;
    let config = TempConfig::new(&format!(
        "[upstreams.ip]\nurl = \"https://127.0.0.1:{}\"\ntls_ca = {ca:?}\n\n\
         [upstreams.named]\nurl = \"https://127.0.0.1:{}\"\ntls_ca = {ca:?}\ntls_server_name = \"upstream.internal\"\n\n\
         [[routes]]\npath_prefix = \"/ip\"\nupstream = \"ip\"\n\n[[routes]]\npath_prefix = \"/named\"\nupstream = \"named\"\n",
        by_address.addr.port(),
        by_name.addr.port(),
        ca = ca.cert_path
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    let response = get(proxy.listen, "/ip").await;
    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
    assert!(response.text().starts_with("sni=None "), "{}", response.text());
    let response = get(proxy.listen, "/named").await;
    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
    assert!(
        response.text().starts_with("sni=Some(\"upstream.internal\") "),
        "{}",
        response.text()
    );
}

#[tokio::test]
async fn an_upstream_certificate_from_another_ca_is_a_502_naming_the_tls_problem_and_every_slot_comes_back() {
    let ca = TestCa::new("floodgate upstream test CA");
    let other = TestCa::new("some other CA");
    let upstream = TlsUpstream::start(&ca.issue(&["localhost"]), None).await;
    let url = format!("https://localhost:{}", upstream.addr.port());
    let extra = format!("max_connections = 2\ntls_ca = {:?}", other.cert_path);
    let config = TempConfig::new(&upstream_config(&url, &extra));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    let requests: Vec<_> = (0..6).map(|_| tokio::spawn(get(proxy.listen, "/"))).collect();
    for request in requests {
        let response = request.await.unwrap();
        assert_eq!(response.status, StatusCode::BAD_GATEWAY);
        assert_eq!(response.text(), "upstream TLS handshake failed\n");
    }
    wait_until_released(&proxy, UP).await;
    wait_until_sync("the upstream's sockets are closed", Duration::from_secs(10), || {
        upstream.open() == 0
    })
    .await;
    assert_eq!(upstream.requests(), 0);
    assert!(upstream.peak() <= 2, "peak {}", upstream.peak());
    assert_eq!(proxy.outcome_count(UP, "upstream_error").await, 6.0);
    // The reason is in the log (a warning, at most one a second), not in the answer to the client.
    let log = proxy.output();
    assert!(
        log.contains("TLS handshake with the upstream failed") && log.contains("UnknownIssuer"),
        "{log}"
    );
}

#[tokio::test]
async fn an_upstream_that_requires_a_client_certificate_gets_tls_client_cert_and_refuses_a_proxy_without() {
    let ca = TestCa::new("floodgate upstream test CA");
    let upstream = TlsUpstream::start(&ca.issue(&["localhost"]), Some(&ca)).await;
    let client = ca.issue(&["floodgate.client"]);
    let port = upstream.addr.port();
    let config = TempConfig::new(&format!(
        "[upstreams.with]\nurl = \"https://localhost:{port}\"\ntls_ca = {ca:?}\n\
         tls_client_cert = {cert:?}\ntls_client_key = {key:?}\n\n\
         [upstreams.without]\nurl = \"https://localhost:{port}\"\ntls_ca = {ca:?}\n\n\
         [[routes]]\npath_prefix = \"/with\"\nupstream = \"with\"\n\n[[routes]]\npath_prefix = \"/without\"\nupstream = \"without\"\n",
        ca = ca.cert_path,
        cert = client.cert_path,
        key = client.key_path,
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    let response = get(proxy.listen, "/with").await;
    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
    assert!(response.text().contains("client_cert=true"), "{}", response.text());

    // Under TLS 1.3 the upstream refuses a missing certificate after the client's side of the handshake is
    // done, so this shows as the first exchange failing rather than as the handshake: a 502 either way.
    let response = get(proxy.listen, "/without").await;
    assert_eq!(response.status, StatusCode::BAD_GATEWAY, "{}", response.text());
    assert_eq!(upstream.requests(), 1);
    wait_until_released(&proxy, "without").await;
}

#[tokio::test]
async fn a_tls_handshake_that_stalls_is_a_502_at_connect_timeout_and_its_socket_is_closed_before_its_slot_is_freed() {
    // Accepts TCP and never answers the ClientHello; counts the connections it holds until it has closed them.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let stall = {
        let counts = counts.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    continue;
                };
                counts.opened();
                let counts = counts.clone();
                tokio::spawn(async move {
                    let mut sink = [0u8; 4096];
                    while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
                    // Slow to close its own side once the proxy has closed: a proxy that freed the slot before
                    // waiting for this would have dialled the next connection meanwhile.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    counts.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        })
    };
    let ca = TestCa::new("floodgate upstream test CA");
    let extra = format!(
        "max_connections = 1\nconnect_timeout = \"300ms\"\nclose_timeout = \"200ms\"\ntls_ca = {:?}",
        ca.cert_path
    );
    let config = TempConfig::new(&upstream_config(&format!("https://localhost:{}", addr.port()), &extra));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    // Two at once: the second waits in the queue for the first one's slot, and dials as soon as it is freed.
    let started = Instant::now();
    let requests: Vec<_> = (0..2).map(|_| tokio::spawn(get(proxy.listen, "/"))).collect();
    for request in requests {
        let response = request.await.unwrap();
        assert_eq!(response.status, StatusCode::BAD_GATEWAY);
        assert_eq!(response.text(), "upstream connect timeout\n");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
    }
    wait_until_released(&proxy, UP).await;
    wait_until_sync("the stalled sockets are closed", Duration::from_secs(10), || {
        counts.open.load(Ordering::SeqCst) == 0
    })
    .await;
    // With a cap of 1, the second dial came only once the first socket was closed.
    assert_eq!(counts.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(counts.peak.load(Ordering::SeqCst), 1);
    stall.abort();
}

#[tokio::test]
async fn without_tls_ca_the_system_roots_are_used_as_ssl_cert_file_names_them() {
    let ca = TestCa::new("floodgate upstream test CA");
    let upstream = TlsUpstream::start(&ca.issue(&["localhost"]), None).await;
    let config = TempConfig::new(&upstream_config(
        &format!("https://localhost:{}", upstream.addr.port()),
        "",
    ));
    let empty = TempDir::new();
    let proxy = Proxy::start_with_env(
        &["--config", &config.path_str()],
        &[
            ("SSL_CERT_FILE", ca.cert_path.as_str()),
            ("SSL_CERT_DIR", &empty.0.display().to_string()),
        ],
    )
    .await;
    let response = get(proxy.listen, "/").await;
    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
}

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

#[test]
fn a_missing_tls_ca_file_stops_start_up_naming_upstreams_app_tls_ca() {
    let dir = TempDir::new();
    let missing = dir.0.join("no-ca.pem").display().to_string();
    let line = assert_refused(
        &upstream_config("https://localhost:9", &format!("tls_ca = {missing:?}")),
        "upstreams.app.tls_ca",
    );
    assert!(line.contains("no-ca.pem"), "{line}");
}

#[test]
fn no_tls_ca_and_no_system_roots_stops_start_up_naming_upstreams_app_tls_ca() {
    let dir = TempDir::new();
    let empty = dir.write("empty.pem", "");
    let line = assert_refused_with_env(
        &upstream_config("https://localhost:9", ""),
        "upstreams.app.tls_ca",
        &[
            ("SSL_CERT_FILE", &empty),
            ("SSL_CERT_DIR", &dir.0.display().to_string()),
        ],
    );
    assert!(line.contains("no root certificates"), "{line}");
}

#[test]
fn half_a_client_certificate_stops_start_up_naming_the_missing_key() {
    let ca = TestCa::new("floodgate upstream test CA");
    let client = ca.issue(&["floodgate.client"]);
    let tls_ca = format!("tls_ca = {:?}\n", ca.cert_path);
    assert_refused(
        &upstream_config(
            "https://localhost:9",
            &format!("{tls_ca}tls_client_cert = {:?}", client.cert_path),
        ),
        "upstreams.app.tls_client_key",
    );
    assert_refused(
        &upstream_config(
            "https://localhost:9",
            &format!("{tls_ca}tls_client_key = {:?}", client.key_path),
        ),
        "upstreams.app.tls_client_cert",
    );
    let other = ca.issue(&["other.client"]);
    let line = assert_refused(
        &upstream_config(
            "https://localhost:9",
            &format!(
                "{tls_ca}tls_client_cert = {:?}\ntls_client_key = {:?}",
                client.cert_path, other.key_path
            ),
        ),
        "upstreams.app.tls_client_key",
    );
    assert!(line.contains("not the private key"), "{line}");
    assert!(!line.contains(other.key_pem.lines().nth(1).unwrap()), "{line}");
}

#[test]
fn tls_settings_on_an_http_upstream_stop_start_up_rather_than_being_ignored() {
    let ca = TestCa::new("floodgate upstream test CA");
    let line = assert_refused(
        &upstream_config("http://localhost:9", &format!("tls_ca = {:?}", ca.cert_path)),
        "upstreams.app.tls_ca",
    );
    assert!(line.contains("only for https://"), "{line}");
}

#[test]
fn check_shows_the_upstream_tls_paths_and_never_a_key() {
    let ca = TestCa::new("floodgate upstream test CA");
    let client = ca.issue(&["floodgate.client"]);
    let config = TempConfig::new(&upstream_config(
        "https://localhost:9",
        &format!(
            "tls_ca = {:?}\ntls_client_cert = {:?}\ntls_client_key = {:?}\ntls_server_name = \"upstream.internal\"",
            ca.cert_path, client.cert_path, client.key_path
        ),
    ));
    let (status, stdout, stderr) = run_to_exit(&["check", "--config", &config.path_str()], Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    for shown in [
        &ca.cert_path,
        &client.cert_path,
        &client.key_path,
        "upstream.internal",
        "https://localhost:9",
    ] {
        assert!(stdout.contains(shown), "{shown} missing from {stdout}");
    }
    assert!(!stdout.contains("PRIVATE KEY"), "{stdout}");
}

#[tokio::test]
async fn a_reload_reads_the_upstream_ca_bundle_again_and_keeps_the_pool() {
    let ca = TestCa::new("floodgate upstream test CA");
    let other = TestCa::new("some other CA");
    let upstream = TlsUpstream::start(&ca.issue(&["localhost"]), None).await;
    let url = format!("https://localhost:{}", upstream.addr.port());
    // The bundle file trusts the wrong CA at first.
    let bundle = ca
        .dir
        .write("bundle.pem", &std::fs::read_to_string(&other.cert_path).unwrap());
    let config = TempConfig::new(&upstream_config(
        &url,
        &format!("max_connections = 2\ntls_ca = {bundle:?}"),
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::BAD_GATEWAY);

    // Fixed in place, same path: a reload reads it again.
    std::fs::write(&bundle, std::fs::read_to_string(&ca.cert_path).unwrap()).unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.text());
    let response = get(proxy.listen, "/").await;
    assert_eq!(response.status, StatusCode::OK, "{}", response.text());
    assert!(
        proxy.status().await["draining"].is_null(),
        "the pool was kept, not replaced"
    );

    // A bundle that is no longer PEM refuses the reload; the pool keeps the one it has.
    std::fs::write(&bundle, "not a certificate").unwrap();
    let resp = proxy.admin_request(http::Method::POST, "/reload", "", None).await;
    assert_eq!(resp.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", resp.text());
    assert!(
        resp.text().contains(&format!("upstreams.{UP}.tls_ca")),
        "{}",
        resp.text()
    );
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}
