//! A WebSocket upstream that serves ordinary HTTP/1.1 on the same port, counting its sockets exactly: every
//! WebSocket echoes what it is sent, `/hold` answers only when released (so requests can be held in flight), and
//! `/refuse` answers an upgrade `403`, `/ignore` answers it an ordinary `200`, `/elsewhere` switches to another
//! protocol than the one asked for (`IRC/6.9`) and holds its socket until the proxy closes it, and a WebSocket to
//! `/vanish` is reset (as if its host went away) when its first bytes come. And a WebSocket client over a plain or
//! TLS stream to the proxy.

use super::*;

use futures_util::{SinkExt, StreamExt};
use http::header;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// The upstream's counts, by its own clock: sockets open now and at most, WebSockets open now, requests in flight
/// now and at most.
#[derive(Default)]
pub struct WsCounts {
    pub sockets: AtomicUsize,
    pub sockets_peak: AtomicUsize,
    pub websockets: AtomicUsize,
    pub websockets_opened: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub in_flight_peak: AtomicUsize,
    /// The `Sec-WebSocket-Key` and `Upgrade` of the last upgrade, as received.
    pub last_upgrade: Mutex<Option<(String, String)>>,
    /// Where the events of the last `/events` stream are sent from (each message one chunk); dropping it ends
    /// the stream.
    pub events: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Bytes>>>,
}

/// An event stream's body: each message from the test one chunk, sent when it comes.
struct Events(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

impl Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|event| event.map(|event| Ok(Frame::data(event))))
    }
}

pub struct WsUpstream {
    pub addr: SocketAddr,
    pub counts: Arc<WsCounts>,
    release: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A socket counted open until it is dropped, wherever it went (hyper's connection, or an upgraded WebSocket).
struct Counted {
    stream: TcpStream,
    counts: Arc<WsCounts>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.counts.sockets.fetch_sub(1, Ordering::SeqCst);
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

fn raise_peak(now: usize, peak: &AtomicUsize) {
    peak.fetch_max(now, Ordering::SeqCst);
}

impl WsUpstream {
    pub async fn start() -> WsUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(WsCounts::default());
        let (release, released) = watch::channel(false);
        let task = {
            let counts = counts.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let now = counts.sockets.fetch_add(1, Ordering::SeqCst) + 1;
                    raise_peak(now, &counts.sockets_peak);
                    let io = Counted {
                        stream,
                        counts: counts.clone(),
                    };
                    let counts = counts.clone();
                    let released = released.clone();
                    tokio::spawn(async move {
                        let service =
                            hyper::service::service_fn(move |request| serve(request, counts.clone(), released.clone()));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(io), service)
                            .with_upgrades()
                            .await;
                    });
                }
            })
        };
        WsUpstream {
            addr,
            counts,
            release,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers every request held at `/hold`, now and until the upstream is dropped.
    pub fn release_held(&self) {
        self.release.send_replace(true);
    }

    /// Where the events of the `/events` stream now open are sent from; dropping it ends the stream.
    pub fn take_events(&self) -> tokio::sync::mpsc::UnboundedSender<Bytes> {
        self.counts.events.lock().unwrap().take().expect("the stream started")
    }

    pub fn sockets(&self) -> usize {
        self.counts.sockets.load(Ordering::SeqCst)
    }

    pub fn sockets_peak(&self) -> usize {
        self.counts.sockets_peak.load(Ordering::SeqCst)
    }

    pub fn websockets(&self) -> usize {
        self.counts.websockets.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.counts.in_flight.load(Ordering::SeqCst)
    }

    pub fn in_flight_peak(&self) -> usize {
        self.counts.in_flight_peak.load(Ordering::SeqCst)
    }
}

type WsBody = BoxBody<Bytes, Infallible>;

fn full(bytes: &'static [u8]) -> WsBody {
    Full::new(Bytes::from_static(bytes)).boxed()
}

async fn serve(
    mut request: Request<Incoming>,
    counts: Arc<WsCounts>,
    mut released: watch::Receiver<bool>,
) -> Result<Response<WsBody>, Infallible> {
    let upgrade = request.headers().get(header::UPGRADE).cloned();
    if let Some(upgrade) = upgrade {
        let key = request
            .headers()
            .get("sec-websocket-key")
            .map(|key| key.as_bytes().to_vec())
            .unwrap_or_default();
        *counts.last_upgrade.lock().unwrap() = Some((
            String::from_utf8_lossy(&key).into_owned(),
            upgrade.to_str().unwrap_or("").to_string(),
        ));
        if request.uri().path() == "/ignore" {
            // An upstream route that knows nothing of WebSockets.
            return Ok(Response::new(full(b"hello\n")));
        }
        if request.uri().path() == "/refuse" {
            let mut response = Response::new(full(b"no websockets here\n"));
            *response.status_mut() = StatusCode::FORBIDDEN;
            return Ok(response);
        }
        let on_upgrade = hyper::upgrade::on(&mut request);
        let vanish = request.uri().path() == "/vanish";
        let elsewhere = request.uri().path() == "/elsewhere";
        tokio::spawn(async move {
            let Ok(upgraded) = on_upgrade.await else { return };
            if elsewhere {
                // Speaks no WebSocket: it only waits for the proxy's end of the socket.
                let mut io = TokioIo::new(upgraded);
                let mut buf = [0u8; 1024];
                while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
                return;
            }
            if vanish {
                let Ok(parts) = upgraded.downcast::<TokioIo<Counted>>() else {
                    return;
                };
                let mut io = parts.io.into_inner();
                let mut first = [0u8; 1];
                let _ = io.stream.read(&mut first).await;
                socket2::SockRef::from(&io.stream)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
                return;
            }
            counts.websockets.fetch_add(1, Ordering::SeqCst);
            counts.websockets_opened.fetch_add(1, Ordering::SeqCst);
            let mut socket = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
            // Echo; a close is answered by tungstenite itself, and the stream then ends.
            while let Some(Ok(message)) = socket.next().await {
                if (message.is_text() || message.is_binary()) && socket.send(message).await.is_err() {
                    break;
                }
            }
            counts.websockets.fetch_sub(1, Ordering::SeqCst);
        });
        let mut response = Response::new(full(b""));
        *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let headers = response.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        let protocol = if elsewhere { "IRC/6.9" } else { "websocket" };
        headers.insert(header::UPGRADE, HeaderValue::from_static(protocol));
        headers.insert(
            "sec-websocket-accept",
            HeaderValue::from_str(&derive_accept_key(&key)).unwrap(),
        );
        return Ok(response);
    }
    if request.uri().path() == "/events" {
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        *counts.events.lock().unwrap() = Some(events);
        let mut response = Response::new(Events(stream).boxed());
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        return Ok(response);
    }
    let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    raise_peak(now, &counts.in_flight_peak);
    if request.uri().path() == "/hold" {
        let _ = released.wait_for(|released| *released).await;
    }
    counts.in_flight.fetch_sub(1, Ordering::SeqCst);
    Ok(Response::new(full(b"plain\n")))
}

/// A WebSocket client's connection through the proxy.
pub type WsClient<S> = WebSocketStream<S>;

/// Opens a WebSocket to `path` over `stream` (a TCP or TLS stream to the proxy).
pub async fn ws_open<S>(stream: S, path: &str) -> Result<WsClient<S>, tokio_tungstenite::tungstenite::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let url = format!("ws://client.test{path}");
    let (socket, response) = tokio_tungstenite::client_async(url, stream).await?;
    assert_eq!(response.status(), StatusCode::SWITCHING_PROTOCOLS);
    Ok(socket)
}

/// An upgrade to `path` through the proxy at `addr` that is refused: the answer it got instead of a `101`.
pub async fn ws_refused(addr: SocketAddr, path: &str) -> Response<Option<Vec<u8>>> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let url = format!("ws://client.test{path}");
    match tokio_tungstenite::client_async(url, stream).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => *response,
        Err(other) => panic!("the upgrade to {path} failed otherwise: {other}"),
        Ok(_) => panic!("the upgrade to {path} was not refused"),
    }
}

/// Closes `socket` with the close handshake and reads it to its end.
pub async fn ws_close<S>(socket: &mut WsClient<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    socket.close(None).await.unwrap();
    while let Some(Ok(_)) = tokio::time::timeout(Duration::from_secs(10), socket.next())
        .await
        .expect("the close was not answered within 10 s")
    {}
}

/// Opens a WebSocket to `path` through the proxy at `addr`.
pub async fn ws_connect(addr: SocketAddr, path: &str) -> WsClient<TcpStream> {
    let stream = TcpStream::connect(addr).await.unwrap();
    ws_open(stream, path).await.unwrap()
}

/// Sends `text` and reads the echo, within 10 s.
pub async fn ws_echo<S>(socket: &mut WsClient<S>, text: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    socket.send(Message::text(text)).await.unwrap();
    let echoed = tokio::time::timeout(Duration::from_secs(10), socket.next())
        .await
        .expect("no echo within 10 s")
        .expect("the tunnel ended")
        .unwrap();
    assert_eq!(echoed, Message::text(text));
}

/// Opens a WebSocket to `path` over HTTP/2 (RFC 8441's extended CONNECT) on `stream`, which speaks HTTP/2 already
/// (prior knowledge, or TLS with ALPN `h2`); `authority` is the `:authority`. The connection's task is returned
/// with the socket: dropping it ends the connection.
pub async fn ws_open_h2<S>(
    stream: S,
    scheme: &str,
    path: &str,
) -> Result<(WsClient<TokioIo<hyper::upgrade::Upgraded>>, JoinHandle<()>), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    ws_open_h2_as(stream, scheme, path, "websocket").await
}

/// [`ws_open_h2`] naming `protocol` as the `:protocol`.
pub async fn ws_open_h2_as<S>(
    stream: S,
    scheme: &str,
    path: &str,
    protocol: &'static str,
) -> Result<(WsClient<TokioIo<hyper::upgrade::Upgraded>>, JoinHandle<()>), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|err| format!("h2 handshake: {err}"))?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut request = Request::builder()
        .method(Method::CONNECT)
        .uri(format!("{scheme}://localhost{path}"))
        .header("sec-websocket-version", "13")
        .body(Empty::new())
        .unwrap();
    request
        .extensions_mut()
        .insert(hyper::ext::Protocol::from_static(protocol));
    sender.ready().await.map_err(|err| format!("h2 ready: {err}"))?;
    let mut response = tokio::time::timeout(CLIENT_TIMEOUT, sender.send_request(request))
        .await
        .map_err(|_| "no answer to the extended CONNECT".to_string())?
        .map_err(|err| format!("extended CONNECT: {err}"))?;
    if response.status() != StatusCode::OK {
        return Err(format!("extended CONNECT answered {}", response.status()));
    }
    let upgraded = hyper::upgrade::on(&mut response)
        .await
        .map_err(|err| format!("upgrade: {err}"))?;
    let socket = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await;
    Ok((socket, task))
}
