//! The `h1_request_head` target, differential: the same client bytes go to floodgate's own request-head reader
//! (`h1::request_head`) and to hyper's HTTP/1 server as floodgate's listener builds it. The first request must be
//! accepted by both or by neither, and when accepted read as the same message: method, target, version, header
//! lines (names, values, order within a name) and body framing, so the upstream would be sent the same request;
//! then the same body: its bytes and trailers, or a failure (cut short, bad chunked framing) for both. Where
//! floodgate is stricter on purpose (`h1::chunked`'s two refusals hyper does not make), that is the only
//! difference allowed.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use http_body::Body as _;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::h1::chunked::{self, Chunk, ChunkedDecoder, ChunkedError};
use crate::h1::request_head::{self, BodyFraming};

/// floodgate's default `max_header_bytes`, for both readers.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// A connection that has not finished with all of its input by then is stuck.
const STUCK_AFTER: Duration = Duration::from_secs(10);

/// A request head as either reader took it.
#[derive(Debug, PartialEq)]
struct Read {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: BodyFraming,
}

/// A request body as either reader took it: its bytes and trailers, or a failure.
type BodyRead = Result<(Bytes, Option<HeaderMap>), ()>;

/// Runs `bytes` through both readers and panics on any difference.
pub fn h1_request_head(bytes: &[u8]) {
    let ours = request_head::parse(bytes, MAX_HEAD_BYTES);
    let ours_read = match &ours {
        Ok(Some((head, len))) => Some((
            Read {
                method: head.parts.method.clone(),
                uri: head.parts.uri.clone(),
                version: head.parts.version,
                headers: head.parts.headers.clone(),
                body: head.body,
            },
            body_after(head.body, bytes.get(*len..).unwrap_or_default()),
        )),
        _ => None,
    };
    let theirs = runtime().block_on(async { tokio::time::timeout(STUCK_AFTER, hyper_reads(bytes)).await });
    let Ok(theirs) = theirs else {
        panic!("hyper's connection is stuck after {STUCK_AFTER:?}");
    };
    match (ours_read, theirs) {
        (None, None) => {}
        (Some(ours), None) => panic!("floodgate accepts a head hyper refuses: {:?}", ours.0),
        (None, Some(theirs)) => panic!("floodgate refuses ({ours:?}) a head hyper accepts: {:?}", theirs.0),
        (Some((ours, ours_body)), Some((theirs, theirs_body))) => {
            assert_eq!(
                ours, theirs,
                "floodgate (left) and hyper (right) read the head differently"
            );
            match (ours_body, theirs_body) {
                (Err(stricter), Ok(_))
                    if stricter == chunked::TOO_MANY_DIGITS || stricter == chunked::BARE_LF_IN_TRAILERS => {}
                (ours, theirs) => assert_eq!(
                    ours.map_err(|_| ()),
                    theirs,
                    "floodgate (left) and hyper (right) read the body differently"
                ),
            }
        }
    }
}

/// The body framed by `framing` at the start of `rest`, as floodgate's decoder reads it.
fn body_after(framing: BodyFraming, rest: &[u8]) -> Result<(Bytes, Option<HeaderMap>), ChunkedError> {
    let incomplete = ChunkedError("cut short");
    match framing {
        BodyFraming::Length(length) => {
            let length = usize::try_from(length).map_err(|_| incomplete)?;
            let body = rest.get(..length).ok_or(incomplete)?;
            Ok((Bytes::copy_from_slice(body), None))
        }
        BodyFraming::Chunked => {
            let mut decoder = ChunkedDecoder::new(MAX_HEAD_BYTES);
            let mut received = BytesMut::from(rest);
            let (mut data, mut trailers) = (BytesMut::new(), None);
            loop {
                match decoder.decode(&mut received)? {
                    Some(Chunk::Data(bytes)) => data.extend_from_slice(&bytes),
                    Some(Chunk::Trailers(fields)) => trailers = Some(fields),
                    Some(Chunk::End) => return Ok((data.freeze(), trailers)),
                    None => return Err(incomplete),
                }
            }
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(super::runtime)
}

/// The first request hyper's server hands to its service, if any, and its body as read to the end, from a client
/// that sends `bytes` and closes.
async fn hyper_reads(bytes: &[u8]) -> Option<(Read, BodyRead)> {
    let (mut socket, server_side) = tokio::io::duplex(64 * 1024);
    let first: Arc<Mutex<Option<(Read, BodyRead)>>> = Arc::default();
    let recorder = first.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let recorder = recorder.clone();
        async move {
            let hint = request.body().size_hint();
            let (parts, body) = request.into_parts();
            let read = Read {
                method: parts.method,
                uri: parts.uri,
                version: parts.version,
                headers: parts.headers,
                body: hint.exact().map_or(BodyFraming::Chunked, BodyFraming::Length),
            };
            let body = body
                .collect()
                .await
                .map(|collected| {
                    let trailers = collected.trailers().cloned();
                    (collected.to_bytes(), trailers)
                })
                .map_err(|_| ());
            let mut first = recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if first.is_none() {
                *first = Some((read, body));
            }
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        }
    });
    // As `server::connection` builds it, but one request is all that is compared.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_header_size(MAX_HEAD_BYTES)
        .keep_alive(false)
        .half_close(true);
    let connection = builder.serve_connection(TokioIo::new(server_side), service);
    let client_side = async {
        if socket.write_all(bytes).await.is_ok() {
            let _ = socket.shutdown().await;
        }
        let mut answers = Vec::new();
        let _ = socket.read_to_end(&mut answers).await;
    };
    let (_, ()) = tokio::join!(connection, client_side);
    let read = first.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    read
}
