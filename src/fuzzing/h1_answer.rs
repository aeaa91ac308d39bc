//! The writing half of `h1_response_head`: an upstream's answer, as floodgate's relay hands it on (hop-by-hop lines
//! removed), written to an HTTP/1 client by floodgate's own writer (`h1::write`) and by hyper's server, for clients
//! of every kind (GET and HEAD, HTTP/1.1 kept alive or closing, HTTP/1.0 kept alive or not). The bytes must be the
//! same, but for the date's value.

use std::convert::Infallible;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper::ext::ReasonPhrase;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::h1_diff::{self, OneFrame};
use crate::forward::strip_hop_by_hop;
use crate::h1::write::{self, BodySize, Client};
use crate::h1::Framing;

/// The clients: method, version, and the request's `Connection` line.
const CLIENTS: [(Method, Version, Option<&str>); 5] = [
    (Method::GET, Version::HTTP_11, None),
    (Method::GET, Version::HTTP_11, Some("close")),
    (Method::HEAD, Version::HTTP_11, None),
    (Method::GET, Version::HTTP_10, Some("keep-alive")),
    (Method::GET, Version::HTTP_10, None),
];

/// An answer as the relay hands it to the client's side.
pub(super) struct Answer {
    pub status: StatusCode,
    pub reason: Option<Bytes>,
    pub headers: HeaderMap,
    /// Its body, and whether its length is known before it is sent.
    pub body: Bytes,
    pub length_known: bool,
}

/// Panics unless floodgate's writer and hyper's server write `answer` alike to every kind of client.
pub(super) fn written_alike(mut answer: Answer) {
    strip_hop_by_hop(&mut answer.headers);
    for (method, version, connection) in CLIENTS {
        let keep_alive = match version {
            Version::HTTP_10 => connection == Some("keep-alive"),
            _ => connection != Some("close"),
        };
        let body = if answer.length_known {
            if answer.body.is_empty() || method == Method::HEAD {
                // What the relay's body says at the head: a HEAD's answer has ended.
                BodySize::Empty
            } else {
                BodySize::Known(answer.body.len() as u64)
            }
        } else {
            BodySize::Unknown
        };
        let client = Client {
            method: &method,
            version,
            keep_alive,
        };
        let Some(ours) = ours(&answer, body, client) else {
            // A stated length longer than the body: hyper gives up before it has sent anything, floodgate's
            // relay refuses the answer before that; nothing to compare.
            continue;
        };
        let theirs = h1_diff::runtime().block_on(theirs(&answer, &method, version, connection, body));
        assert_eq!(
            without_date(&ours),
            without_date(&theirs),
            "{method} {version:?} {connection:?}: floodgate (left) and hyper (right) write the answer differently"
        );
    }
}

fn ours(answer: &Answer, body: BodySize, client: Client<'_>) -> Option<Vec<u8>> {
    let mut dst = BytesMut::new();
    let Ok(written) = write::response_head(
        &mut dst,
        answer.status,
        answer.reason.as_deref(),
        &answer.headers,
        body,
        client,
    ) else {
        return Some(Vec::new());
    };
    // A stated length longer than the body: hyper gives up before it has sent anything (see `written_alike`).
    if let Framing::Length(length) = written.encoding {
        if usize::try_from(length).unwrap_or(usize::MAX) > answer.body.len() {
            return None;
        }
    }
    h1_diff::put_body(&mut dst, written.encoding, &answer.body);
    Some(dst.to_vec())
}

/// What hyper's server writes back to a client that sends one request and closes.
async fn theirs(
    answer: &Answer,
    method: &Method,
    version: Version,
    connection: Option<&str>,
    body: BodySize,
) -> Vec<u8> {
    let (mut socket, server_side) = tokio::io::duplex(64 * 1024);
    let service = service_fn(|_: http::Request<Incoming>| {
        let mut response = Response::new(OneFrame {
            data: (body != BodySize::Empty).then(|| answer.body.clone()),
            known: answer.length_known,
        });
        *response.status_mut() = answer.status;
        *response.headers_mut() = answer.headers.clone();
        if let Some(reason) = answer
            .reason
            .as_ref()
            .and_then(|reason| ReasonPhrase::try_from(reason.as_ref()).ok())
        {
            response.extensions_mut().insert(reason);
        }
        async move { Ok::<_, Infallible>(response) }
    });
    let connection_line = connection.map_or(String::new(), |value| format!("Connection: {value}\r\n"));
    let version_text = if version == Version::HTTP_10 { "1.0" } else { "1.1" };
    let request = format!("{method} / HTTP/{version_text}\r\nHost: x\r\n{connection_line}\r\n");
    let serving = super::listener_http1(64 * 1024).serve_connection(TokioIo::new(server_side), service);
    let client = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = socket.write_all(request.as_bytes()).await;
        let _ = socket.shutdown().await;
        let mut written = Vec::new();
        let _ = socket.read_to_end(&mut written).await;
        written
    };
    let (_, written) = tokio::join!(serving, client);
    written
}

/// `bytes` with the value of its `date` line taken out.
fn without_date(bytes: &[u8]) -> Vec<u8> {
    let Some(at) = bytes.windows(8).position(|window| window == b"\r\ndate: ") else {
        return bytes.to_vec();
    };
    let value_at = at + 8;
    let end = bytes
        .get(value_at..)
        .and_then(|rest| rest.windows(2).position(|pair| pair == b"\r\n"))
        .map_or(bytes.len(), |len| value_at + len);
    let mut out = bytes.get(..value_at).unwrap_or_default().to_vec();
    out.extend_from_slice(bytes.get(end..).unwrap_or_default());
    out
}
