//! The raw TCP client: bytes on a socket, for malformed requests and exact framing.

use super::*;

/// A response read off a raw socket.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    /// Minor version of `HTTP/1.x`.
    pub minor_version: u8,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How reading a socket ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadEnd {
    Eof,
    Reset,
    Timeout,
}

/// A TCP connection speaking bytes.
pub struct RawConn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl RawConn {
    pub async fn connect(addr: SocketAddr) -> RawConn {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects with a small receive buffer (limits kernel buffering).
    pub async fn connect_with_recv_buffer(addr: SocketAddr, size: u32) -> RawConn {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(size).unwrap();
        let stream = socket.connect(addr).await.expect("connect");
        stream.set_nodelay(true).unwrap();
        RawConn {
            stream,
            buf: Vec::new(),
        }
    }

    pub async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(data).await
    }

    /// Reads more bytes into the buffer; Ok(0) at EOF.
    pub(super) async fn fill(&mut self, deadline: Instant) -> std::io::Result<usize> {
        let mut chunk = vec![0u8; 64 * 1024];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "raw read timed out")),
        }
    }

    /// Reads one response head.
    pub async fn read_head(&mut self, timeout: Duration) -> std::io::Result<RawResponse> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 128];
            let mut parsed = httparse::Response::new(&mut headers);
            match parsed.parse(&self.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let resp = RawResponse {
                        status: parsed.code.unwrap_or(0),
                        minor_version: parsed.version.unwrap_or(0),
                        headers: parsed
                            .headers
                            .iter()
                            .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                            .collect(),
                        body: Vec::new(),
                    };
                    self.buf.drain(..len);
                    return Ok(resp);
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("bad response head {e}: {:?}", String::from_utf8_lossy(&self.buf)),
                    ))
                }
            }
            if self.fill(deadline).await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "EOF before a complete response head; got {:?}",
                        String::from_utf8_lossy(&self.buf)
                    ),
                ));
            }
        }
    }

    pub(super) async fn read_exact_buf(&mut self, n: usize, deadline: Instant) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill(deadline).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    pub(super) async fn read_line(&mut self, deadline: Instant) -> std::io::Result<String> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line: Vec<u8> = self.buf.drain(..pos + 2).collect();
                return Ok(String::from_utf8_lossy(&line[..pos]).into_owned());
            }
            if self.fill(deadline).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads one complete response (framing per RFC 9112). `head_request`
    /// says the request was HEAD (no body whatever the headers say).
    pub async fn read_response(&mut self, head_request: bool, timeout: Duration) -> std::io::Result<RawResponse> {
        let deadline = Instant::now() + timeout;
        let mut resp = self.read_head(timeout).await?;
        if head_request || resp.status < 200 || resp.status == 204 || resp.status == 304 {
            return Ok(resp);
        }
        let chunked = resp
            .header("transfer-encoding")
            .map(|v| v.to_ascii_lowercase().contains("chunked"))
            .unwrap_or(false);
        if chunked {
            loop {
                let line = self.read_line(deadline).await?;
                let size_str = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_str, 16).map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad chunk size line {line:?}"))
                })?;
                if size == 0 {
                    // trailers
                    while !self.read_line(deadline).await?.is_empty() {}
                    break;
                }
                let data = self.read_exact_buf(size, deadline).await?;
                resp.body.extend_from_slice(&data);
                let crlf = self.read_exact_buf(2, deadline).await?;
                if crlf != b"\r\n" {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "chunk not followed by CRLF",
                    ));
                }
            }
        } else if let Some(len) = resp.header("content-length") {
            let len: usize = len
                .trim()
                .parse()
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad content-length"))?;
            resp.body = self.read_exact_buf(len, deadline).await?;
        } else {
            // close-delimited
            let (rest, end) = self.read_until_close(timeout).await;
            if end == ReadEnd::Timeout {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "close-delimited body did not end",
                ));
            }
            resp.body = rest;
        }
        Ok(resp)
    }

    /// Reads until EOF, reset or timeout; returns everything not yet consumed.
    pub async fn read_until_close(&mut self, timeout: Duration) -> (Vec<u8>, ReadEnd) {
        let deadline = Instant::now() + timeout;
        let end = loop {
            match self.fill(deadline).await {
                Ok(0) => break ReadEnd::Eof,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break ReadEnd::Timeout,
                Err(_) => break ReadEnd::Reset,
            }
        };
        (std::mem::take(&mut self.buf), end)
    }

    /// Bytes buffered but not consumed by a parse.
    pub fn leftover(&self) -> &[u8] {
        &self.buf
    }

    /// Reads raw bytes (at most `max`) into the caller's hands.
    pub async fn read_some(&mut self, max: usize, timeout: Duration) -> std::io::Result<Vec<u8>> {
        if self.buf.is_empty() {
            let deadline = Instant::now() + timeout;
            if self.fill(deadline).await? == 0 {
                return Ok(Vec::new());
            }
        }
        let n = self.buf.len().min(max);
        Ok(self.buf.drain(..n).collect())
    }

    /// Closes with RST instead of FIN.
    pub fn abort_with_reset(self) {
        let _ = self.stream.set_zero_linger();
        drop(self.stream);
    }
}

/// Writes `request` on a fresh connection and reads until the proxy closes
/// it (or `timeout`). The write may fail half way (proxy gave up early);
/// whatever was answered is returned.
pub async fn raw_exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> (Vec<u8>, ReadEnd) {
    let mut conn = RawConn::connect(addr).await;
    let _ = conn.write(request).await;
    conn.read_until_close(timeout).await
}

/// Trickles the body of the request whose head `conn` has sent: one byte, then up to 200 ms of listening for the
/// answer, until answered (10 s at most, else the task panics); the task returns the answer.
pub fn spawn_trickler(mut conn: RawConn) -> JoinHandle<RawResponse> {
    tokio::spawn(async move {
        for _ in 0..50 {
            let _ = conn.write(b"x").await;
            match conn.read_response(false, Duration::from_millis(200)).await {
                Ok(resp) => return resp,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(e) => panic!("the trickler was not answered: {e}"),
            }
        }
        panic!("the trickler was not answered within 10 s");
    })
}

/// Status code of the first response in `data`.
pub fn first_status(data: &[u8]) -> Option<u16> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(data) {
        Ok(_) => resp.code,
        Err(_) => None,
    }
}
