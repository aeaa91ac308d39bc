//! An upstream that answers a request as soon as its head is in, before its body, and then reads the chunked body
//! to its end (or the connection's), reporting what it received: how many body bytes, and whether the body ended
//! with its last chunk. A body that came short but whole-framed is what it exists to catch.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One request body as the upstream received it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub bytes: usize,
    /// The last chunk came: the body was framed as complete.
    pub ended: bool,
}

pub struct EarlyAnswerUpstream {
    addr: SocketAddr,
    received: mpsc::UnboundedReceiver<Received>,
    task: JoinHandle<()>,
}

impl EarlyAnswerUpstream {
    /// Answers every request with `answer` the moment its head has arrived.
    pub async fn start(answer: &'static [u8]) -> EarlyAnswerUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind early-answer upstream");
        let addr = listener.local_addr().expect("its address");
        let (sender, received) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, answer, sender.clone()));
            }
        });
        EarlyAnswerUpstream { addr, received, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next request body that ended, one way or the other.
    pub async fn next(&mut self, timeout: std::time::Duration) -> Received {
        tokio::time::timeout(timeout, self.received.recv())
            .await
            .expect("a request body's end at the upstream")
            .expect("the upstream runs")
    }
}

impl Drop for EarlyAnswerUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, answer: &'static [u8], report: mpsc::UnboundedSender<Received>) {
    let mut seen: Vec<u8> = Vec::new();
    loop {
        // The head, then the answer at once.
        let head_end = loop {
            if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            if !read_more(&mut stream, &mut seen).await {
                return;
            }
        };
        seen.drain(..head_end);
        if stream.write_all(answer).await.is_err() {
            return;
        }
        // The chunked body, decoded as it comes.
        let mut body = Received { bytes: 0, ended: false };
        loop {
            let Some(line_end) = seen.windows(2).position(|w| w == b"\r\n") else {
                if !read_more(&mut stream, &mut seen).await {
                    let _ = report.send(body);
                    return;
                }
                continue;
            };
            let size = std::str::from_utf8(&seen[..line_end])
                .ok()
                .and_then(|line| usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).ok());
            let Some(size) = size else {
                let _ = report.send(body);
                return;
            };
            let needed = line_end + 2 + size + 2;
            while seen.len() < needed {
                if !read_more(&mut stream, &mut seen).await {
                    let _ = report.send(body);
                    return;
                }
            }
            seen.drain(..needed);
            if size == 0 {
                body.ended = true;
                break;
            }
            body.bytes += size;
        }
        let _ = report.send(body);
    }
}

async fn read_more(stream: &mut TcpStream, seen: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 4096];
    match stream.read(&mut buf).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            seen.extend_from_slice(&buf[..n]);
            true
        }
    }
}
