//! The `h1_request_head` target, differential: the same client bytes go to floodgate's own request-head reader
//! (`h1::request_head`) and to hyper's HTTP/1 server with floodgate's settings. The first request must be
//! accepted by both or by neither, and when accepted read as the same message: method, target, version, header
//! lines (names, values, order within a name) and body framing, so the upstream would be sent the same request;
//! then the same body: its bytes and trailers, or a failure (cut short, bad chunked framing) for both. Where
//! floodgate is stricter on purpose (`h1::chunked`'s two refusals hyper does not make), that is the only
//! difference allowed. Then the request is sent upstream by floodgate's writer and by hyper's client, alike
//! ([`super::h1_sent`]).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use http_body::Body as _;
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::h1_diff::{self, BodyRead, Framed};
use super::h1_sent;
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
        Ok(Some((head, len))) => Some((
            Read {
                method: head.parts.method.clone(),
                uri: head.parts.uri.clone(),
                version: head.parts.version,
                headers: head.parts.headers.clone(),
                body: head.body,
            },
            h1_diff::ours(framed(head.body), bytes.get(*len..).unwrap_or_default()),
        )),
        _ => None,
    };
    let theirs = h1_diff::runtime().block_on(async { tokio::time::timeout(STUCK_AFTER, hyper_reads(bytes)).await });
    let Ok(theirs) = theirs else {
        panic!("hyper's connection is stuck after {STUCK_AFTER:?}");
    };
    let sent = match (&ours, &ours_read) {
        (Ok(Some((head, _))), Some((_, Ok((body, _))))) => Some(h1_sent::Outgoing {
            method: head.parts.method.clone(),
            uri: head.parts.uri.clone(),
            headers: head.parts.headers.clone(),
            body: body.clone(),
            length_known: matches!(head.body, BodyFraming::Length(_)),
        }),
        _ => None,
    };
    h1_diff::agree("request", ours_read, theirs, &ours);
    // The same request, on its way upstream.
    if let Some(request) = sent {
        h1_sent::sent_alike(request);
    }
}

fn framed(body: BodyFraming) -> Framed {
    match body {
        BodyFraming::Length(length) => Framed::Length(length),
        BodyFraming::Chunked => Framed::Chunked {
            max_trailer_bytes: MAX_HEAD_BYTES,
        },
    }
}

/// The first request hyper's server hands to its service, if any, and its body as read to the end, from a client
/// that sends `bytes` and closes.
async fn hyper_reads(bytes: &[u8]) -> Option<(Read, BodyRead)> {
    let (socket, server_side) = tokio::io::duplex(64 * 1024);
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
            let body = h1_diff::theirs(body).await;
            let mut first = recorder.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if first.is_none() {
                *first = Some((read, body));
            }
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        }
    });
    // One request is all that is compared.
    let mut builder = super::listener_http1(MAX_HEAD_BYTES);
    builder.keep_alive(false);
    let connection = builder.serve_connection(TokioIo::new(server_side), service);
    let (_, ()) = tokio::join!(connection, super::client_sends(socket, bytes));
    let read = first.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    read
}
