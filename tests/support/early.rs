//! An upstream that reads chunked request bodies itself and reports what it received: how many body bytes in how
//! many chunks, and whether the body ended with its last chunk. It can answer as soon as a head is in, before the
//! body, and then wait before reading it, as a server that answers early and reads slowly does. A body that came
//! short but framed whole, or in as many chunks as the client sent, is what it exists to catch.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One request body as the upstream received it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub bytes: usize,
    pub chunks: usize,
    /// The last chunk came: the body was framed as complete.
    pub ended: bool,
}

/// When the upstream answers.
#[derive(Clone, Copy, Debug)]
pub enum AnswerAt {
    /// Once the head is in, then it waits this long before it reads the body.
    Head { then_wait: Duration },
    /// Once the body has ended.
    BodyEnd,
}

pub struct BodyUpstream {
    addr: SocketAddr,
    received: mpsc::UnboundedReceiver<Received>,
    task: JoinHandle<()>,
}

impl BodyUpstream {
    /// Answers every request with `answer`, at `at`.
    pub async fn start(answer: &'static [u8], at: AnswerAt) -> BodyUpstream {
        Self::start_with(answer, at, None).await
    }

    /// As [`Self::start`], its sockets' receive buffer this small (SO_RCVBUF): a sender fills it, and waits,
    /// after a few KiB.
    pub async fn start_with(answer: &'static [u8], at: AnswerAt, receive_buffer: Option<u32>) -> BodyUpstream {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        if let Some(size) = receive_buffer {
            socket.set_recv_buffer_size(size).expect("SO_RCVBUF");
        }
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind body upstream");
        let listener = socket.listen(64).expect("listen");
        let addr = listener.local_addr().expect("its address");
        let (sender, received) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, answer, at, sender.clone()));
            }
        });
        BodyUpstream { addr, received, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next request body that ended, one way or the other.
    pub async fn next(&mut self, timeout: Duration) -> Received {
        tokio::time::timeout(timeout, self.received.recv())
            .await
            .expect("a request body's end at the upstream")
            .expect("the upstream runs")
    }
}

impl Drop for BodyUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, answer: &'static [u8], at: AnswerAt, report: mpsc::UnboundedSender<Received>) {
    let mut seen: Vec<u8> = Vec::new();
    loop {
        let head_end = loop {
            if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            if !read_more(&mut stream, &mut seen).await {
                return;
            }
        };
        seen.drain(..head_end);
        if let AnswerAt::Head { then_wait } = at {
            if stream.write_all(answer).await.is_err() {
                return;
            }
            tokio::time::sleep(then_wait).await;
        }
        let body = read_body(&mut stream, &mut seen).await;
        let _ = report.send(body);
        if !body.ended {
            return;
        }
        if matches!(at, AnswerAt::BodyEnd) && stream.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// A chunked body, decoded as it comes, to its last chunk or the connection's end.
async fn read_body(stream: &mut TcpStream, seen: &mut Vec<u8>) -> Received {
    let mut body = Received {
        bytes: 0,
        chunks: 0,
        ended: false,
    };
    loop {
        let Some(line_end) = seen.windows(2).position(|w| w == b"\r\n") else {
            if !read_more(stream, seen).await {
                return body;
            }
            continue;
        };
        let size = std::str::from_utf8(&seen[..line_end])
            .ok()
            .and_then(|line| usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).ok());
        let Some(size) = size else { return body };
        let needed = line_end + 2 + size + 2;
        while seen.len() < needed {
            if !read_more(stream, seen).await {
                return body;
            }
        }
        seen.drain(..needed);
        if size == 0 {
            body.ended = true;
            return body;
        }
        body.bytes += size;
        body.chunks += 1;
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
