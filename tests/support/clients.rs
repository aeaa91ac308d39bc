//! HTTP clients: hyper client connections over HTTP/1.1 and HTTP/2.

use super::*;

/// A fully read response.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub async fn collect(resp: Response<Incoming>) -> Result<Resp, BoxError> {
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(CLIENT_TIMEOUT, body.collect())
        .await
        .map_err(|_| "timed out reading the response body")??
        .to_bytes();
    Ok(Resp {
        status: parts.status,
        version: parts.version,
        headers: parts.headers,
        body,
    })
}

/// One HTTP/1.1 client connection (keep-alive) made with hyper's
/// `client::conn::http1`. Dropping it closes the TCP connection.
pub struct H1Conn {
    sender: hyper::client::conn::http1::SendRequest<TestBody>,
    task: JoinHandle<()>,
    addr: SocketAddr,
}

impl H1Conn {
    pub async fn connect(addr: SocketAddr) -> H1Conn {
        Self::try_connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"))
    }

    pub async fn try_connect(addr: SocketAddr) -> Result<H1Conn, BoxError> {
        let stream = tokio::time::timeout(CLIENT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| "connect timed out")??;
        stream.set_nodelay(true)?;
        Self::over(stream, addr).await
    }

    pub async fn over(stream: TcpStream, addr: SocketAddr) -> Result<H1Conn, BoxError> {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H1Conn { sender, task, addr })
    }

    /// Sends `req` (adding `Host` when missing) and returns the response head.
    pub async fn send(&mut self, mut req: Request<TestBody>) -> Result<Response<Incoming>, BoxError> {
        if !req.headers().contains_key(HOST) {
            req.headers_mut()
                .insert(HOST, HeaderValue::from_str(&self.addr.to_string()).unwrap());
        }
        tokio::time::timeout(CLIENT_TIMEOUT, async {
            self.sender.ready().await?;
            self.sender.send_request(req).await
        })
        .await
        .map_err(|_| -> BoxError { "timed out waiting for the response head".into() })?
        .map_err(Into::into)
    }

    pub async fn try_request(&mut self, method: Method, path: &str, body: TestBody) -> Result<Resp, BoxError> {
        let req = Request::builder().method(method).uri(path).body(body).unwrap();
        let resp = self.send(req).await?;
        collect(resp).await
    }

    pub async fn try_get(&mut self, path: &str) -> Result<Resp, BoxError> {
        self.try_request(Method::GET, path, body_empty()).await
    }

    pub async fn get(&mut self, path: &str) -> Resp {
        self.try_get(path)
            .await
            .unwrap_or_else(|e| panic!("GET {path} via {}: {e}", self.addr))
    }

    /// True while hyper considers the connection usable.
    pub fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }
}

impl Drop for H1Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// GET on a fresh connection.
pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    H1Conn::connect(addr).await.get(path).await
}

/// GET on a fresh connection, errors returned.
pub async fn try_get(addr: SocketAddr, path: &str) -> Result<Resp, BoxError> {
    H1Conn::try_connect(addr).await?.try_get(path).await
}

/// An HTTP/2 prior-knowledge client connection.
#[derive(Clone)]
pub struct H2Conn {
    sender: hyper::client::conn::http2::SendRequest<TestBody>,
    addr: SocketAddr,
    _task: Arc<H2Task>,
    /// Turns true when the connection has ended (the peer closed it, or it failed).
    ended: watch::Receiver<bool>,
}

pub(super) struct H2Task(JoinHandle<()>);

impl Drop for H2Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Settings of an [`H2Conn`] beyond hyper's defaults.
#[derive(Clone, Copy, Debug, Default)]
pub struct H2Options {
    /// The client's initial per-stream receive window (SETTINGS_INITIAL_WINDOW_SIZE). hyper only hands window
    /// back as the caller reads a body, so a small window and an unread body make a reader that stalls the
    /// sender.
    pub initial_stream_window_size: Option<u32>,
}

impl H2Conn {
    pub async fn connect(addr: SocketAddr) -> H2Conn {
        Self::connect_with(addr, H2Options::default()).await
    }

    pub async fn connect_with(addr: SocketAddr, opts: H2Options) -> H2Conn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        if let Some(window) = opts.initial_stream_window_size {
            builder.initial_stream_window_size(window);
        }
        let (sender, conn) = builder.handshake(TokioIo::new(stream)).await.expect("h2 handshake");
        let (ended_tx, ended) = watch::channel(false);
        let task = tokio::spawn(async move {
            let _ = conn.await;
            ended_tx.send_replace(true);
        });
        H2Conn {
            sender,
            addr,
            _task: Arc::new(H2Task(task)),
            ended,
        }
    }

    /// Sends `req` and returns the response head; the body is left unread for the caller.
    pub async fn send(&mut self, req: Request<TestBody>) -> Result<Response<Incoming>, BoxError> {
        tokio::time::timeout(CLIENT_TIMEOUT, async {
            self.sender.ready().await?;
            self.sender.send_request(req).await
        })
        .await
        .map_err(|_| -> BoxError { "timed out waiting for the response head".into() })?
        .map_err(Into::into)
    }

    /// GET of an absolute `uri`, whose authority becomes the `:authority` pseudo-header.
    pub async fn try_get_uri(&mut self, uri: &str) -> Result<Resp, BoxError> {
        let req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(body_empty())
            .unwrap();
        let resp = self.send(req).await?;
        collect(resp).await
    }

    pub async fn try_get(&mut self, path: &str) -> Result<Resp, BoxError> {
        let uri = format!("http://{}{}", self.addr, path);
        self.try_get_uri(&uri).await
    }

    /// True once the connection has ended (closed by the peer or failed).
    pub fn has_ended(&self) -> bool {
        *self.ended.borrow()
    }
}
