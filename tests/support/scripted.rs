//! A hostile upstream that answers every request with bytes a test wrote by hand, framing errors included, which
//! no well-behaved HTTP server library would send.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What the upstream does with a connection once it has written its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    /// Closes it (FIN).
    Close,
    /// Keeps it open and answers the next request the same way.
    KeepOpen,
}

/// Answers each request (a head read up to its blank line; bodies are not expected) with `answer`.
pub struct ScriptedUpstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl ScriptedUpstream {
    pub async fn start(answer: impl Into<Vec<u8>>, then: Then) -> ScriptedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind scripted upstream");
        let addr = listener.local_addr().expect("scripted upstream address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let answer: Arc<[u8]> = answer.into().into();
        let counted = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, answer.clone(), then));
            }
        });
        ScriptedUpstream { addr, accepted, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, answer: Arc<[u8]>, then: Then) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        let end = seen.windows(4).position(|w| w == b"\r\n\r\n").map_or(0, |at| at + 4);
        seen.drain(..end);
        if stream.write_all(&answer).await.is_err() {
            return;
        }
        if then == Then::Close {
            let _ = stream.shutdown().await;
            // Read until floodgate closes too, so the close is a FIN, not a reset.
            while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            return;
        }
    }
}
