//! One upstream connection: dialling it, the task that drives it, and closing it completely.
//!
//! The connection's task owns its [`Slot`]: hyper's `Connection` future outlives every request on it, and only
//! when that future has ended and the upstream has closed its side too (or `close_timeout` has passed and the
//! socket was reset) is the slot dropped. So a replacement is never dialled while its predecessor still exists as
//! the upstream counts them.

use std::sync::Arc;
use std::time::Instant;

use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{Slot, UpstreamPool};
use crate::config::{Origin, UpstreamConfig};
use crate::error::ProxyError;
use crate::forward::RequestBody;
use crate::net::{self, SharedStream};

pub type UpstreamSender = http1::SendRequest<RequestBody>;

/// A live HTTP/1.1 connection to the upstream, as a request sees it.
pub struct Conn {
    pub sender: UpstreamSender,
    pub id: u64,
    born: Instant,
    pub(super) served: u64,
}

impl Conn {
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// Whether the connection may carry another request under the configured limits.
    pub(super) fn is_usable(&self, limits: &UpstreamConfig) -> bool {
        let too_old =
            !limits.max_connection_lifetime.is_zero() && self.born.elapsed() >= limits.max_connection_lifetime;
        let worn_out = limits.max_requests_per_connection > 0 && self.served >= limits.max_requests_per_connection;
        !(self.is_closed() || too_old || worn_out)
    }
}

impl UpstreamPool {
    /// Dials a new connection with the right `slot` gives; the slot moves into the connection's task.
    pub(crate) async fn dial(self: &Arc<Self>, slot: Slot) -> Result<Conn, ProxyError> {
        let limit = self.limits.connect_timeout;
        let stream = match tokio::time::timeout(limit, connect(&self.origin)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => return Err(ProxyError::Connect(err.to_string())),
            Err(_) => return Err(ProxyError::ConnectTimeout(limit)),
        };
        // Requests are small and latency-bound; Nagle would add a round trip to every exchange.
        let _ = stream.set_nodelay(true);
        let stream = Arc::new(stream);
        let io = TokioIo::new(SharedStream::new(stream.clone(), None));
        let (sender, connection) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|err| ProxyError::Connect(err.to_string()))?;
        self.connection_opened();
        let close_timeout = self.limits.close_timeout;
        let name = self.name.clone();
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(upstream = %name, error = %err, "upstream connection ended with an error");
            }
            net::close_and_wait_for_peer(&stream, close_timeout).await;
            // Field order matters: the socket is closed before the slot is given back.
            drop(stream);
            drop(slot);
        });
        Ok(Conn {
            sender,
            id: self.next_conn_id(),
            born: Instant::now(),
            served: 0,
        })
    }
}

/// Resolves the host at every dial and tries each address in turn.
async fn connect(origin: &Origin) -> std::io::Result<TcpStream> {
    let mut last_error = None;
    for address in tokio::net::lookup_host((origin.host.as_str(), origin.port)).await? {
        match TcpStream::connect(address).await {
            Ok(stream) => return Ok(stream),
            Err(err) => last_error = Some(err),
        }
    }
    Err(last_error.unwrap_or_else(|| std::io::Error::other(format!("{} resolved to no address", origin.host))))
}
