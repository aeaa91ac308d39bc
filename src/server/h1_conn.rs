//! floodgate's HTTP/1 server, for plain and TLS clients alike: reads each request head off the connection (a
//! [`ClientWire`]) with `h1::request_head`, hands the request to the edge stack, and writes the answer with
//! `h1::write`. A connection with no request in progress holds no buffer: one is allocated when a request's first
//! bytes are readable and dropped once its answer is written, unless the client already sent more (pipelining).
//!
//! Owns the connection's HTTP/1 framing and its deadlines (request head, idle keep-alive, a stalled write). It never
//! admits, routes or counts a request beyond a head it refuses (`400`, `414`, `431`).

use std::io::{self, ErrorKind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceExt};

use crate::body::{discard_received, ClientBody, Http1Body, Reading};
use crate::config::Config;
use crate::error::Outcome;
use crate::forward::ResponseBody;
use crate::h1::body::Delimited;
use crate::h1::chunked::ChunkedDecoder;
use crate::h1::request_head::{self, BodyFraming};
use crate::h1::write::{self, BodySize, LAST_CHUNK};
use crate::h1::Framing;
use crate::h1::HeadError;
use crate::kept_timer;
use crate::metrics::Metrics;
use crate::net::ClientWire;
use crate::tunnel::{Handoff, Tunnel};

/// The first read of a request asks for this much room; a head that needs more grows it up to max_header_bytes.
const HEAD_ROOM: usize = 4 * 1024;

/// Body bytes up to this size are copied beside the head or chunk framing into one write; larger ones are written
/// as they are.
const COALESCE: usize = 8 * 1024;

/// Why the connection ended, for the caller's log and counts.
pub(super) enum Ended {
    Closed,
    HeaderTimeout,
    /// A head that could not be read was answered and the connection closed.
    Refused(HeadError),
    Error(io::Error),
}

/// Serves requests on `wire` until the client leaves, a deadline passes or `shutdown` has let the request in
/// progress finish. The first request's bytes are already there (they were sniffed). Everything is borrowed: an
/// idle connection's task holds this future, and what it stores while idle (the wait for bytes, the idle deadline
/// and the shutdown signal) is all a connection costs between requests.
pub(super) async fn serve<F, S>(
    wire: &Arc<ClientWire>,
    service: &F,
    config: &Config,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Ended
where
    F: Fn() -> S,
    S: Service<Request<ClientBody>, Response = Response<ResponseBody>, Error = std::convert::Infallible>,
{
    let conn = Conn {
        wire,
        config,
        metrics,
        shutdown,
    };
    let mut received = BytesMut::with_capacity(HEAD_ROOM);
    // One idle timer for the connection's life, moved on only when it fires early (the connection was busy since
    // it was set): re-set at each idle spell, a timer costs a registration and a removal per request.
    let idle_timer = tokio::time::sleep_until(Instant::now() + config.client_idle_timeout);
    tokio::pin!(idle_timer);
    loop {
        // The head's deadline runs from its first byte.
        let head_until = Instant::now() + config.header_read_timeout;
        // Boxed: what a request needs (its head, its answer's writer, the edge stack, made for it from a few
        // handles) is held only while it is served, not by every idle connection's task.
        match boxed!(conn.one_request(service(), received, head_until)).await {
            // Bytes of the next request already read (pipelined behind the last one).
            // It waits for its turn: the thread's upstream lane is polled only between batches of client tasks'
            // polls, so a poll that answered a whole pipelined batch (a flood's refusals) would hold it back.
            Ok(After::Pipelined(next)) => {
                received = next;
                tokio::task::yield_now().await;
                continue;
            }
            Ok(After::Idle) => {}
            // The connection is a tunnel's from here; the request's future is gone, so the tunnel holds only its own.
            Ok(After::Tunnel(switched)) => {
                let (tunnel, early) = *switched;
                Box::pin(tunnel.run_on_wire(wire.clone(), early)).await;
                return Ended::Closed;
            }
            // The caller shuts the socket down, however the connection ended.
            Err(ended) => return ended,
        }
        // Idle: no buffer is held until the client sends again.
        let idle_until = Instant::now() + config.client_idle_timeout;
        received = tokio::select! {
            biased;
            waited = std::future::poll_fn(|cx| wire.poll_next_bytes(cx, HEAD_ROOM)) => match waited {
                Ok(Some(received)) => received,
                Ok(None) => return Ended::Closed,
                Err(err) => return Ended::Error(err),
            },
            // HTTP/1 has no goodbye to send: an idle connection past its time is closed.
            () = kept_timer::until(idle_timer.as_mut(), idle_until) => return Ended::Closed,
            () = shutdown.cancelled() => return Ended::Closed,
        };
    }
}

/// What follows a request served on the connection.
enum After {
    /// The next request, some of whose bytes are here already.
    Pipelined(BytesMut),
    /// Nothing yet: the connection idles.
    Idle,
    /// The upstream switched protocols: the connection is the tunnel's, with what the client sent behind its request.
    /// Boxed: what is held across an idle wait is every connection's cost.
    Tunnel(Box<(Tunnel, Bytes)>),
}

/// What serving one request on the connection reads.
#[derive(Clone, Copy)]
struct Conn<'a> {
    wire: &'a Arc<ClientWire>,
    config: &'a Config,
    metrics: &'a Metrics,
    shutdown: &'a CancellationToken,
}

impl Conn<'_> {
    /// Reads a request's head from `received` (and the socket), has `service` answer it and writes the answer;
    /// what comes after: the next request (with its bytes already read, if any), or the tunnel the answer switched to.
    async fn one_request<S>(self, mut service: S, mut received: BytesMut, head_until: Instant) -> Result<After, Ended>
    where
        S: Service<Request<ClientBody>, Response = Response<ResponseBody>, Error = std::convert::Infallible>,
    {
        let Conn {
            wire,
            config,
            metrics,
            shutdown,
        } = self;
        let write_stall_limit = config.client_write_stall_limit();
        // Made only when the head must wait for bytes: most heads are whole when their first bytes come.
        let mut head_timer = None;
        let head = loop {
            match request_head::take(&mut received, config.max_header_bytes) {
                Ok(Some(head)) => break head,
                Ok(None) => {}
                Err(refused) => {
                    count_refused(metrics, refused);
                    let _ = answer_bare(wire, refused.status(), Version::HTTP_11, write_stall_limit).await;
                    return Err(Ended::Refused(refused));
                }
            }
            tokio::select! {
                biased;
                read = read_more(wire, &mut received, config.max_header_bytes) => match read {
                    Ok(0) => return Err(Ended::Closed),
                    Ok(_) => {}
                    Err(err) => return Err(Ended::Error(err)),
                },
                () = head_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(head_until))).as_mut() => {
                    return Err(Ended::HeaderTimeout)
                }
            }
        };
        let method = head.parts.method.clone();
        let version = head.parts.version;
        // A client that says it takes trailers (gRPC's status travels in them) is sent an answer's trailers.
        let trailers = head.takes_trailers && version == Version::HTTP_11;
        let framing = match head.body {
            BodyFraming::Length(length) => Delimited::Length(length),
            BodyFraming::Chunked => Delimited::Chunked(ChunkedDecoder::for_request(config.max_header_bytes)),
        };
        let reading = Reading::new(
            wire.clone(),
            received,
            framing,
            head.expects_continue && version == Version::HTTP_11,
        );
        let body_over = reading.body_over();
        let reading = Arc::new(Mutex::new(reading));
        let request = Request::from_parts(head.parts, ClientBody::Http1(Http1Body::new(reading.clone())));
        let answering = match service.ready().await {
            Ok(ready) => ready.call(request),
            Err(never) => match never {},
        };
        // A client that leaves while its answer is awaited abandons the request (its exchange runs on, see
        // `proxy`); while its body is still being read, the body's reader sees it go instead.
        let watch = async {
            if let Some(body_over) = &body_over {
                body_over.notified().await;
            }
            if wire.is_tls() {
                tls_client_left(wire, &reading).await;
            } else {
                wire.left().await;
            }
        };
        let response = tokio::select! {
            biased;
            answered = answering => match answered {
                Ok(response) => response,
                Err(never) => match never {},
            },
            () = watch => return Err(Ended::Closed),
        };
        let mut response = response;
        if let Some(tunnel) = response
            .extensions_mut()
            .remove::<Handoff>()
            .and_then(|handoff| handoff.take())
        {
            // The 101 says the connection switches: no `connection: close` with it.
            if let Err(err) = write_answer(wire, response, (&method, version, false), true, write_stall_limit).await {
                tunnel.not_switched();
                return Err(Ended::Error(err));
            }
            // What the client sent behind its request is the tunnel's first bytes.
            let early = std::mem::take(&mut Reading::lock(&reading).received).freeze();
            return Ok(After::Tunnel(Box::new((tunnel, early))));
        }
        let keep_alive = head.keep_alive && !head.wants_upgrade && !shutdown.is_cancelled();
        let closes = write_answer(
            wire,
            response,
            (&method, version, trailers),
            keep_alive,
            write_stall_limit,
        )
        .await
        .map_err(Ended::Error)?;
        // The body's remainder, if the answer came before all of it: a remainder already here is dropped; one
        // still on its way closes the connection (reading it could take as long as the client likes).
        let next = {
            let mut reading = Reading::lock(&reading);
            // A body not read to its end is left to fail (the socket closes under it), never to end early.
            let whole = discard_received(&mut reading);
            whole.then(|| std::mem::take(&mut reading.received))
        };
        match next {
            // No buffer is kept across an idle wait; one with a pipelined request's bytes in it is.
            Some(next) if !closes && !shutdown.is_cancelled() => Ok(if next.is_empty() {
                After::Idle
            } else {
                After::Pipelined(next)
            }),
            _ => Err(Ended::Closed),
        }
    }
}

/// Reads more of a head into `received`; 0 when the client closed before finishing it.
async fn read_more(wire: &ClientWire, received: &mut BytesMut, max_header_bytes: usize) -> io::Result<usize> {
    let room = HEAD_ROOM
        .min(max_header_bytes.saturating_add(1).saturating_sub(received.len()))
        .max(1);
    std::future::poll_fn(|cx| wire.poll_fill(cx, received, room)).await
}

/// Resolves once a TLS client has closed its side (`close_notify`, or the connection's end) while its answer is
/// awaited. What waits on the socket is ciphertext only the session can read, so it is read, into the connection's
/// buffer where the next request's bytes go anyway; once the client has sent anything (a pipelined request), it is
/// still there, and the watch ends without resolving, as the plain socket's does.
async fn tls_client_left(wire: &ClientWire, reading: &Mutex<Reading>) {
    let left = std::future::poll_fn(|cx| {
        let mut reading = Reading::lock(reading);
        wire.poll_fill(cx, &mut reading.received, HEAD_ROOM)
            .map(|read| matches!(read, Ok(0) | Err(_)))
    })
    .await;
    if !left {
        std::future::pending::<()>().await;
    }
}

fn count_refused(metrics: &Metrics, refused: HeadError) {
    let outcome = match refused {
        HeadError::TooLarge => Outcome::HeaderTooLarge,
        HeadError::TargetTooLong | HeadError::Malformed(_) => Outcome::BadRequest,
    };
    metrics.client_side(outcome, Some(refused.status()));
}

/// An answer of floodgate's own with `status` and no body, after which the connection closes.
async fn answer_bare(wire: &ClientWire, status: StatusCode, version: Version, stall: Duration) -> io::Result<()> {
    let mut out = BytesMut::new();
    let client = write::Client {
        method: &Method::GET,
        version,
        keep_alive: false,
    };
    let _ = write::response_head(&mut out, status, None, &HeaderMap::new(), BodySize::Known(0), client);
    wire.write_all(&out, stall).await
}

/// Writes the answer, head and body; `Ok(true)` when the connection must close after it.
/// `asked`: the request's method, version and whether it takes trailers.
///
/// The head is written into the buffer when this is called, and the future holds only what sending takes: an
/// `async fn` would keep the whole answer in its state, twice (as an argument and as the locals it is taken
/// apart into), for as long as the body streams.
fn write_answer<'a>(
    wire: &'a ClientWire,
    response: Response<ResponseBody>,
    asked: (&Method, Version, bool),
    keep_alive: bool,
    stall: Duration,
) -> impl std::future::Future<Output = io::Result<bool>> + 'a {
    let (method, version, takes_trailers) = asked;
    let (parts, mut body) = response.into_parts();
    let size = if body.is_end_stream() {
        BodySize::Empty
    } else {
        match body.size_hint().exact() {
            Some(length) => BodySize::Known(length),
            None => BodySize::Unknown,
        }
    };
    let reason = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()
        .map(|reason| reason.as_bytes());
    let client = write::Client {
        method,
        version,
        keep_alive,
    };
    let mut out = BytesMut::new();
    let head = write::response_head(&mut out, parts.status, reason, &parts.headers, size, client);
    drop(parts);
    async move {
        let written = match head {
            Ok(written) => written,
            // The relay refuses such an answer before it gets here; should one come, the client gets a 502.
            Err(_) => {
                Box::pin(answer_bare(wire, StatusCode::BAD_GATEWAY, version, stall)).await?;
                return Ok(true);
            }
        };
        let sends_body = !matches!(written.encoding, Framing::Length(0));
        let mut sent: u64 = 0;
        let mut trailers = None;
        // A body that is here already goes out with the head in one write.
        let mut first = if sends_body { body.frame().now_or_never() } else { None };
        loop {
            let frame = match first.take() {
                Some(frame) => frame,
                None => {
                    if !out.is_empty() {
                        wire.write_all(&out, stall).await?;
                        out.clear();
                    }
                    if !sends_body {
                        break;
                    }
                    body.frame().await
                }
            };
            match frame {
                None => break,
                Some(Ok(frame)) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        // Trailers go out in the last chunk to a client that takes them, and nowhere else (see
                        // `h1::write`).
                        Err(frame) => {
                            if takes_trailers && written.encoding == Framing::Chunked {
                                trailers = frame.into_trailers().ok();
                            }
                            continue;
                        }
                    };
                    sent = sent.saturating_add(data.len() as u64);
                    put_data(wire, &mut out, data, written.encoding, stall).await?;
                }
                // The body failed after its head went out: all the client can be told is a cut connection.
                Some(Err(_)) => return Err(ErrorKind::UnexpectedEof.into()),
            }
        }
        if written.encoding == Framing::Chunked {
            match &trailers {
                Some(trailers) => write::put_last_chunk_with(&mut out, trailers),
                None => out.extend_from_slice(LAST_CHUNK),
            }
        }
        if !out.is_empty() {
            wire.write_all(&out, stall).await?;
        }
        // A body that did not come to the length its head stated leaves the client unable to find the next answer.
        let short = matches!(written.encoding, Framing::Length(stated) if stated != sent);
        Ok(written.closes || written.encoding == Framing::UntilClose || short)
    }
}

/// Puts one piece of the body after what `out` holds, framed by `encoding`; a large piece is written at once,
/// without a copy.
async fn put_data(
    wire: &ClientWire,
    out: &mut BytesMut,
    data: Bytes,
    encoding: Framing,
    stall: Duration,
) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    if encoding == Framing::Chunked {
        if data.len() <= COALESCE {
            write::put_chunk(out, &data);
            return Ok(());
        }
        write::put_chunk_size(out, data.len());
        wire.write_all(out, stall).await?;
        out.clear();
        wire.write_all(&data, stall).await?;
        out.extend_from_slice(b"\r\n");
        return Ok(());
    }
    if data.len() <= COALESCE {
        out.extend_from_slice(&data);
        return Ok(());
    }
    if !out.is_empty() {
        wire.write_all(out, stall).await?;
        out.clear();
    }
    wire.write_all(&data, stall).await
}
