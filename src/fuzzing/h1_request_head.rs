//! The `h1_request_head` target, differential: the same client bytes go to floodgate's own request-head reader
//! (`h1::request_head`) and to hyper's HTTP/1 server as floodgate's listener builds it. The first request must be
//! accepted by both or by neither, and when accepted read as the same message: method, target, version, header
//! lines (names, values, order within a name) and body framing, so the upstream would be sent the same request.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use http_body::Body as _;
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Runs `bytes` through both readers and panics on any difference.
pub fn h1_request_head(bytes: &[u8]) {
    let ours = request_head::parse(bytes, MAX_HEAD_BYTES);
    let ours_read = match &ours {
        Ok(Some((head, _))) => Some(Read {
            method: head.parts.method.clone(),
            uri: head.parts.uri.clone(),
            version: head.parts.version,
            headers: head.parts.headers.clone(),
            body: head.body,
        }),
        _ => None,
    };
    let theirs = runtime().block_on(async { tokio::time::timeout(STUCK_AFTER, hyper_reads(bytes)).await });
    let Ok(theirs) = theirs else {
        panic!("hyper's connection is stuck after {STUCK_AFTER:?}");
    };
    match (ours_read, theirs) {
        (None, None) => {}
        (Some(ours), None) => panic!("floodgate accepts a head hyper refuses: {ours:?}"),
        (None, Some(theirs)) => panic!("floodgate refuses ({ours:?}) a head hyper accepts: {theirs:?}"),
        (Some(ours), Some(theirs)) => {
            assert_eq!(
                ours, theirs,
                "floodgate (left) and hyper (right) read the head differently"
            );
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(super::runtime)
}

/// The first request hyper's server hands to its service, if any, from a client that sends `bytes` and closes.
async fn hyper_reads(bytes: &[u8]) -> Option<Read> {
    let (mut socket, server_side) = tokio::io::duplex(64 * 1024);
    let first: Arc<Mutex<Option<Read>>> = Arc::default();
    let recorder = first.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let mut first = recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if first.is_none() {
            let hint = request.body().size_hint();
            let (parts, _) = request.into_parts();
            *first = Some(Read {
                method: parts.method,
                uri: parts.uri,
                version: parts.version,
                headers: parts.headers,
                body: hint.exact().map_or(BodyFraming::Chunked, BodyFraming::Length),
            });
        }
        async { Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new())) }
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
