//! The `h1_response_head` target, differential: what an upstream writes back goes to floodgate's own response-head
//! reader (`h1::response_head`) and to hyper's HTTP/1 client as floodgate's pool builds it, for a GET and for a
//! HEAD. Both must accept the final head or neither, and when accepted read the same status, version, reason,
//! header lines and body framing (a length, or a body without one); then the same body, its bytes and trailers or
//! a failure for both, but for `h1::chunked`'s two refusals hyper does not make. Then the answer to the GET is
//! written to clients by floodgate's writer and by hyper's server, alike ([`super::h1_answer`]).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Version};
use http_body::Body as _;
use http_body_util::Empty;
use hyper::client::conn::http1;
use hyper::ext::ReasonPhrase;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::h1_answer;
use super::h1_diff::{self, BodyRead, Framed};
use crate::h1::response_head;
use crate::h1::Framing;

/// hyper's bound on a response's trailer section (it sets none of its own for upstreams).
const TRAILER_BYTES: usize = 16 * 1024;

/// hyper's own bound on a head it reads without a `max_header_size` (its largest read buffer).
const HYPER_MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// A connection that has not finished with all of its input by then is stuck.
const STUCK_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, PartialEq)]
struct Read {
    status: StatusCode,
    version: Version,
    reason: Option<Bytes>,
    headers: HeaderMap,
    /// The body's exact length, when its framing gives one.
    length: Option<u64>,
}

/// Runs `bytes` through both readers, as the answer to a GET and to a HEAD, and panics on any difference.
pub fn h1_response_head(bytes: &[u8]) {
    for method in [Method::GET, Method::HEAD] {
        let ours = response_head::parse(bytes, &method, HYPER_MAX_HEAD_BYTES);
        let ours_read = match &ours {
            Ok(Some((head, len))) => Some((
                Read {
                    status: head.parts.status,
                    version: head.parts.version,
                    reason: head.reason.clone(),
                    headers: head.parts.headers.clone(),
                    length: match head.body {
                        Framing::Length(length) => Some(length),
                        Framing::Chunked | Framing::UntilClose => None,
                    },
                },
                h1_diff::ours(framed(head.body), bytes.get(*len..).unwrap_or_default()),
            )),
            _ => None,
        };
        let theirs = h1_diff::runtime()
            .block_on(async { tokio::time::timeout(STUCK_AFTER, hyper_reads(bytes, method.clone())).await });
        let Ok(theirs) = theirs else {
            panic!("hyper's connection is stuck after {STUCK_AFTER:?}");
        };
        let written = match (&ours, &ours_read) {
            (Ok(Some((head, _))), Some((_, Ok((body, _))))) if method == Method::GET && !head.upgrade => {
                Some(h1_answer::Answer {
                    status: head.parts.status,
                    reason: head.reason.clone(),
                    headers: head.parts.headers.clone(),
                    body: body.clone(),
                    length_known: matches!(head.body, Framing::Length(_)),
                })
            }
            _ => None,
        };
        h1_diff::agree(method.as_str(), ours_read, theirs, &ours);
        // The same answer, handed on to floodgate's clients.
        if let Some(answer) = written {
            h1_answer::written_alike(answer);
        }
    }
}

fn framed(body: Framing) -> Framed {
    match body {
        Framing::Length(length) => Framed::Length(length),
        Framing::Chunked => Framed::Chunked {
            max_trailer_bytes: TRAILER_BYTES,
        },
        Framing::UntilClose => Framed::UntilClose,
    }
}

/// The response hyper's client hands back for a `method` request to an upstream that answers `bytes` and closes.
async fn hyper_reads(bytes: &[u8], method: Method) -> Option<(Read, BodyRead)> {
    let (client_side, mut upstream) = tokio::io::duplex(64 * 1024);
    let upstream_side = async {
        // The request head first, as a real upstream would read it; then the answer, then the close.
        let mut request = Vec::new();
        let mut chunk = [0u8; 1024];
        while !request.windows(4).any(|window| window == b"\r\n\r\n") {
            match upstream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => request.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            }
        }
        if upstream.write_all(bytes).await.is_ok() {
            let _ = upstream.shutdown().await;
        }
        let mut rest = Vec::new();
        let _ = upstream.read_to_end(&mut rest).await;
    };
    let client = async move {
        let (mut sender, connection) = http1::Builder::new().handshake(TokioIo::new(client_side)).await.ok()?;
        let driving = tokio::spawn(connection);
        let request = Request::builder()
            .method(method)
            .uri("/")
            .header("host", "upstream")
            .body(Empty::<Bytes>::new())
            .ok()?;
        let response = sender.send_request(request).await.ok()?;
        let read = Read {
            status: response.status(),
            version: response.version(),
            reason: response
                .extensions()
                .get::<ReasonPhrase>()
                .map(|reason| Bytes::copy_from_slice(reason.as_bytes())),
            length: response.body().size_hint().exact(),
            headers: response.headers().clone(),
        };
        let body = h1_diff::theirs(response.into_body()).await;
        driving.abort();
        Some((read, body))
    };
    let (read, ()) = tokio::join!(client, upstream_side);
    read
}
