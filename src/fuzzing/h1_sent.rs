//! The sending half of `h1_request_head`: a client's request, as floodgate hands it upstream (origin form,
//! hop-by-hop lines removed, its body as read), written by floodgate's writer (`h1::write::request_head` and the
//! body's framing) and by hyper's client. What the upstream receives must be the same bytes.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Method, Request, Uri};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::h1_diff::{self, OneFrame};
use crate::forward::strip_hop_by_hop;
use crate::h1::chunked::{Chunk, ChunkedDecoder};
use crate::h1::request_head::{self, BodyFraming};
use crate::h1::write::{self, BodySize};

/// A connection that has not finished with all of its input by then is stuck.
const STUCK_AFTER: Duration = Duration::from_secs(10);

/// A request on its way upstream.
pub(super) struct Outgoing {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Whether its length is known before it is sent (it came with one).
    pub length_known: bool,
}

/// Panics unless floodgate's writer and hyper's client send `request` alike.
pub(super) fn sent_alike(mut request: Outgoing) {
    strip_hop_by_hop(&mut request.headers);
    request.uri = request
        .uri
        .path_and_query()
        .and_then(|target| Uri::try_from(target.as_str()).ok())
        .unwrap_or_else(|| Uri::from_static("/"));
    let body = match (request.length_known, request.body.len()) {
        (true, 0) => BodySize::Empty,
        (true, len) => BodySize::Known(len as u64),
        (false, _) => BodySize::Unknown,
    };
    let ours = ours(&request, body);
    // hyper's client never chunks a GET or HEAD, and sends a body of unknown length on one as none (dropped);
    // floodgate forwards it as any other body (issue 26, item 8), chunked.
    if body == BodySize::Unknown && matches!(request.method, http::Method::GET | http::Method::HEAD) {
        let text = String::from_utf8_lossy(&ours);
        assert!(
            text.contains("transfer-encoding: chunked\r\n"),
            "a GET's body of unknown length is not sent chunked: {text}"
        );
        return;
    }
    let theirs = h1_diff::runtime().block_on(async { tokio::time::timeout(STUCK_AFTER, theirs(&request)).await });
    let Ok(theirs) = theirs else {
        panic!("the upstream never got the whole request from hyper's client");
    };
    assert_eq!(
        String::from_utf8_lossy(&ours),
        String::from_utf8_lossy(&theirs),
        "floodgate (left) and hyper (right) send the request differently"
    );
}

fn ours(request: &Outgoing, body: BodySize) -> Vec<u8> {
    let mut dst = BytesMut::new();
    let mut headers = request.headers.clone();
    let encoding = write::request_head(&mut dst, &request.method, &request.uri, &mut headers, body);
    h1_diff::put_body(&mut dst, encoding, &request.body);
    dst.to_vec()
}

/// What an upstream receives from hyper's client for `request`, up to the end of its body.
async fn theirs(request: &Outgoing) -> Vec<u8> {
    let (client_side, mut upstream) = tokio::io::duplex(64 * 1024);
    let mut outgoing = Request::new(OneFrame {
        data: Some(request.body.clone()),
        known: request.length_known,
    });
    *outgoing.method_mut() = request.method.clone();
    *outgoing.uri_mut() = request.uri.clone();
    *outgoing.headers_mut() = request.headers.clone();
    let client = async move {
        let Ok((mut sender, connection)) = http1::Builder::new().handshake(TokioIo::new(client_side)).await else {
            return;
        };
        let driving = tokio::spawn(connection);
        let _ = sender.send_request(outgoing).await;
        driving.abort();
    };
    let upstream_side = async {
        let mut received = Vec::new();
        let mut chunk = [0u8; 4096];
        while !whole_request(&received) {
            match upstream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            }
        }
        let _ = upstream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await;
        let _ = upstream.shutdown().await;
        received
    };
    let ((), received) = tokio::join!(client, upstream_side);
    received
}

/// Whether `received` holds a whole request, body included (read with floodgate's own readers, which the other
/// half of the target checks against hyper's).
fn whole_request(received: &[u8]) -> bool {
    let Ok(Some((head, len))) = request_head::parse(received, usize::MAX) else {
        return false;
    };
    let rest = received.get(len..).unwrap_or_default();
    match head.body {
        BodyFraming::Length(length) => rest.len() as u64 >= length,
        BodyFraming::Chunked => {
            let mut decoder = ChunkedDecoder::new(usize::MAX);
            let mut rest = BytesMut::from(rest);
            loop {
                match decoder.decode(&mut rest) {
                    Ok(Some(Chunk::End)) | Err(_) => return true,
                    Ok(Some(_)) => {}
                    Ok(None) => return false,
                }
            }
        }
    }
}
