//! Many idle WebSockets, for the tunnels benchmark (`benches/tunnels.sh`).
//!
//! `websockets upstream` serves WebSockets that echo what they are sent and prints `upstream ready listen=ADDR`.
//! `websockets clients --addr ADDR --connections N` opens N WebSockets to `ADDR` (at most `--parallel` being set up
//! at once), has one message echoed on each, and then keeps them all open and quiet; once each is up or has failed
//! it prints one JSON line with `"ready":true` and the counts, then waits for SIGTERM or SIGINT and prints a last line
//! with `"final":true` and how many the server closed meanwhile.
//!
//! ```sh
//! cargo run --release --example websockets -- upstream
//! cargo run --release --example websockets -- clients --addr 127.0.0.1:8080 --connections 1000
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message;

#[derive(Parser, Debug)]
#[command(about = "Many idle WebSockets (benches/tunnels.sh)")]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// An echoing WebSocket server.
    Upstream {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
    /// WebSockets that each echo one message, then stay open and quiet.
    Clients {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long, default_value_t = 1000)]
        connections: usize,
        #[arg(long, default_value_t = 64)]
        parallel: usize,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    match Args::parse().role {
        Role::Upstream { listen } => upstream(listen).await,
        Role::Clients {
            addr,
            connections,
            parallel,
        } => clients(addr, connections, parallel).await,
    }
}

async fn upstream(listen: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    println!("upstream ready listen={}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let Ok(mut socket) = tokio_tungstenite::accept_async(stream).await else {
                return;
            };
            while let Some(Ok(message)) = socket.next().await {
                if (message.is_text() || message.is_binary()) && socket.send(message).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn clients(addr: SocketAddr, connections: usize, parallel: usize) -> std::io::Result<()> {
    let setting_up = Arc::new(Semaphore::new(parallel.max(1)));
    let closed = Arc::new(AtomicU64::new(0));
    let mut opening = Vec::with_capacity(connections);
    for n in 0..connections {
        let setting_up = setting_up.clone();
        let closed = closed.clone();
        opening.push(tokio::spawn(async move {
            let permit = setting_up.acquire_owned().await.ok()?;
            let stream = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
                .await
                .ok()?
                .ok()?;
            let (mut socket, _) = tokio_tungstenite::client_async(format!("ws://{addr}/ws/{n}"), stream)
                .await
                .ok()?;
            socket.send(Message::text("hello")).await.ok()?;
            let echoed = tokio::time::timeout(Duration::from_secs(10), socket.next())
                .await
                .ok()??
                .ok()?;
            drop(permit);
            (echoed == Message::text("hello")).then_some(())?;
            // Quiet from here; the task keeps the socket, and notices the server closing it.
            tokio::spawn(async move {
                while let Some(Ok(_)) = socket.next().await {}
                closed.fetch_add(1, Ordering::Relaxed);
            });
            Some(())
        }));
    }
    let mut open = 0usize;
    for task in opening {
        if matches!(task.await, Ok(Some(()))) {
            open += 1;
        }
    }
    println!(
        "{{\"ready\":true,\"connections\":{connections},\"open\":{open},\"failed\":{}}}",
        connections - open
    );
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    println!(
        "{{\"final\":true,\"closed_by_server\":{}}}",
        closed.load(Ordering::Relaxed)
    );
    Ok(())
}
