//! The demo's embedded upstream: one OS thread per accepted connection, the way a stock JVM server behaves, with
//! exact counts of its connections and threads.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What the upstream measured over its lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct UpstreamStats {
    pub(super) peak_connections: usize,
    pub(super) peak_threads: usize,
    pub(super) connections_accepted: usize,
    pub(super) requests_served: usize,
    pub(super) live_threads: usize,
}

/// A live count with its high-water mark.
#[derive(Debug, Default)]
pub(super) struct Gauge {
    pub(super) live: AtomicUsize,
    pub(super) peak: AtomicUsize,
}

impl Gauge {
    pub(super) fn inc(&self) {
        let now = self.live.fetch_add(1, Ordering::SeqCst).saturating_add(1);
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    pub(super) fn dec(&self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
pub(super) struct Shared {
    pub(super) stopping: AtomicBool,
    pub(super) connections: Gauge,
    pub(super) threads: Gauge,
    pub(super) accepted: AtomicUsize,
    pub(super) served: AtomicUsize,
    pub(super) next_id: AtomicU64,
    /// Clones of open sockets, so shutdown can unblock handler threads that
    /// sit in `read` on a peer that never hangs up.
    pub(super) open: Mutex<HashMap<u64, TcpStream>>,
}

impl Shared {
    pub(super) fn stats(&self) -> UpstreamStats {
        UpstreamStats {
            peak_connections: self.connections.peak.load(Ordering::SeqCst),
            peak_threads: self.threads.peak.load(Ordering::SeqCst),
            connections_accepted: self.accepted.load(Ordering::SeqCst),
            requests_served: self.served.load(Ordering::SeqCst),
            live_threads: self.threads.live.load(Ordering::SeqCst),
        }
    }

    pub(super) fn open_sockets(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        // A poisoned map only means a handler died mid-update; the sockets
        // in it are still the ones to close.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Undoes a handler's bookkeeping however the handler thread ends.
pub(super) struct HandlerGuard {
    pub(super) shared: Arc<Shared>,
    pub(super) id: u64,
}

impl Drop for HandlerGuard {
    fn drop(&mut self) {
        self.shared.open_sockets().remove(&self.id);
        self.shared.connections.dec();
        self.shared.threads.dec();
    }
}

/// A blocking HTTP/1.1 server spending one OS thread per connection, like a
/// JVM thread-per-connection server: the cost floodgate exists to bound.
pub(super) struct Upstream {
    pub(super) addr: SocketAddr,
    pub(super) shared: Arc<Shared>,
    pub(super) accept: Option<JoinHandle<()>>,
}

impl Upstream {
    pub(super) fn start(service_time: Duration) -> io::Result<Self> {
        let listener = bind_listener()?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let accept_shared = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("demo-upstream-accept".to_owned())
            .spawn(move || accept_loop(&listener, &accept_shared, service_time))?;
        Ok(Self {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    #[cfg(test)]
    pub(super) fn stats(&self) -> UpstreamStats {
        self.shared.stats()
    }

    /// Stops accepting, closes every open connection and waits up to `grace`
    /// for the handler threads to exit.
    pub(super) fn shutdown(mut self, grace: Duration) -> UpstreamStats {
        self.stop();
        let deadline = Instant::now() + grace;
        while self.shared.threads.live.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        self.shared.stats()
    }

    pub(super) fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // `accept` has no timeout; a throwaway connection wakes it up to
        // notice the flag.
        match TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)) {
            Ok(_) => {
                if accept.join().is_err() {
                    tracing::warn!("demo upstream accept thread panicked");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not wake the demo upstream accept thread; leaving it behind");
            }
        }
        for socket in self.shared.open_sockets().values() {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop();
    }
}

pub(super) fn bind_listener() -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    // std's backlog of 128 would drop SYNs when hundreds of clients connect
    // at once, and the 1s SYN retry would then pollute the direct numbers.
    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    socket.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

pub(super) fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>, service_time: Duration) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Typically EMFILE under a very large --clients; back off
                // instead of spinning, the pending connection stays queued.
                tracing::debug!(error = %e, "demo upstream accept failed");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.connections.inc();
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        match stream.try_clone() {
            Ok(clone) => {
                shared.open_sockets().insert(id, clone);
            }
            Err(e) => {
                tracing::debug!(error = %e, "demo upstream could not track a connection");
            }
        }
        let handler_shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name(format!("demo-upstream-conn-{id}"))
            .spawn(move || {
                handler_shared.threads.inc();
                let guard = HandlerGuard {
                    shared: handler_shared,
                    id,
                };
                if let Err(e) = serve_connection(stream, service_time, &guard.shared.served) {
                    tracing::debug!(error = %e, "demo upstream connection ended with an error");
                }
            });
        if let Err(e) = spawned {
            // The closure (and the socket) is gone; undo what it would have.
            tracing::warn!(error = %e, "demo upstream could not spawn a connection thread");
            shared.open_sockets().remove(&id);
            shared.connections.dec();
        }
    }
}

pub(super) const MAX_HEAD_BYTES: u64 = 64 * 1024;
pub(super) const BODY: &[u8] = b"hello from a thread-per-connection upstream\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RequestHead {
    pub(super) is_head: bool,
    pub(super) content_length: u64,
    pub(super) keep_alive: bool,
}

#[derive(Debug)]
pub(super) enum HeadError {
    Io(io::Error),
    Malformed(&'static str),
    TooLarge,
    Unsupported(&'static str),
}

impl From<io::Error> for HeadError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

pub(super) fn serve_connection(stream: TcpStream, service_time: Duration, served: &AtomicUsize) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream);
    loop {
        let head = match read_request_head(&mut reader) {
            Ok(Some(head)) => head,
            Ok(None) => return Ok(()),
            Err(HeadError::Io(e)) => return Err(e),
            Err(HeadError::Malformed(why)) => {
                return write_response(reader.get_mut(), "400 Bad Request", why.as_bytes(), false, false);
            }
            Err(HeadError::TooLarge) => {
                return write_response(
                    reader.get_mut(),
                    "431 Request Header Fields Too Large",
                    b"request head too large\n",
                    false,
                    false,
                );
            }
            Err(HeadError::Unsupported(why)) => {
                return write_response(reader.get_mut(), "501 Not Implemented", why.as_bytes(), false, false);
            }
        };

        let discarded = io::copy(&mut reader.by_ref().take(head.content_length), &mut io::sink())?;
        if discarded != head.content_length {
            return Ok(());
        }

        // The work a real handler would do, holding its thread the whole time.
        thread::sleep(service_time);
        served.fetch_add(1, Ordering::SeqCst);

        write_response(reader.get_mut(), "200 OK", BODY, head.keep_alive, head.is_head)?;
        if !head.keep_alive {
            return Ok(());
        }
    }
}

pub(super) fn write_response(
    stream: &mut TcpStream,
    status: &str,
    body: &[u8],
    keep_alive: bool,
    head_only: bool,
) -> io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n{}\r\n",
        body.len(),
        if keep_alive { "" } else { "connection: close\r\n" },
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    // One write per response, so Nagle never holds half of it back.
    stream.write_all(&out)?;
    stream.flush()
}

/// Reads one request head. `Ok(None)` is a clean close between requests.
pub(super) fn read_request_head<R: BufRead>(reader: &mut R) -> Result<Option<RequestHead>, HeadError> {
    let mut budget = MAX_HEAD_BYTES;
    let mut line = Vec::new();

    // RFC 9112 §2.2: ignore empty lines before the request line.
    let request_line = loop {
        line.clear();
        if read_line(reader, &mut line, &mut budget)? == 0 {
            return Ok(None);
        }
        let trimmed = trim_line_end(&line);
        if !trimmed.is_empty() {
            break std::str::from_utf8(trimmed)
                .map_err(|_| HeadError::Malformed("request line is not UTF-8\n"))?
                .to_owned();
        }
    };

    let mut parts = request_line.split(' ');
    let (Some(method), Some(_target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed("malformed request line\n"));
    };
    let mut keep_alive = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        _ => return Err(HeadError::Malformed("unsupported HTTP version\n")),
    };
    if method.is_empty() {
        return Err(HeadError::Malformed("malformed request line\n"));
    }

    let mut content_length: Option<u64> = None;
    loop {
        line.clear();
        if read_line(reader, &mut line, &mut budget)? == 0 {
            return Err(HeadError::Malformed("connection closed inside the request head\n"));
        }
        let trimmed = trim_line_end(&line);
        if trimmed.is_empty() {
            break;
        }
        let text = std::str::from_utf8(trimmed).map_err(|_| HeadError::Malformed("header is not UTF-8\n"))?;
        if text.starts_with([' ', '\t']) {
            return Err(HeadError::Malformed("obsolete header folding\n"));
        }
        let Some((name, value)) = text.split_once(':') else {
            return Err(HeadError::Malformed("header without a colon\n"));
        };
        if name.is_empty() || name.ends_with([' ', '\t']) {
            return Err(HeadError::Malformed("malformed header name\n"));
        }
        let value = value.trim_matches([' ', '\t']);
        if name.eq_ignore_ascii_case("content-length") {
            let parsed = value
                .parse::<u64>()
                .map_err(|_| HeadError::Malformed("invalid content-length\n"))?;
            if content_length.is_some_and(|seen| seen != parsed) {
                return Err(HeadError::Malformed("conflicting content-length\n"));
            }
            content_length = Some(parsed);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Only bodiless GETs are expected; refusing beats misframing.
            return Err(HeadError::Unsupported("transfer-encoding is not supported\n"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        }
    }

    Ok(Some(RequestHead {
        is_head: method == "HEAD",
        content_length: content_length.unwrap_or(0),
        keep_alive,
    }))
}

/// Reads through the next `\n`, charging the head budget.
pub(super) fn read_line<R: BufRead>(reader: &mut R, line: &mut Vec<u8>, budget: &mut u64) -> Result<usize, HeadError> {
    let n = reader.by_ref().take(*budget).read_until(b'\n', line)?;
    *budget = budget.saturating_sub(u64::try_from(n).unwrap_or(u64::MAX));
    if n > 0 && !line.ends_with(b"\n") {
        return Err(if *budget == 0 {
            HeadError::TooLarge
        } else {
            HeadError::Malformed("connection closed inside the request head\n")
        });
    }
    Ok(n)
}

pub(super) fn trim_line_end(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}
