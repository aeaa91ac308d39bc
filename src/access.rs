//! The access log: one line per request, written where the request's outcome is counted.
//!
//! An [`Entry`] exists only while the access log is on, so with it off a request pays for one `None` and no
//! clock read, allocation or lock. Lines are `tracing` events with the target [`TARGET`], which `main` sends to
//! their own non-blocking writer in the configured log format.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};

use crate::error::Outcome;

/// The header that carries a request's ID (set by `edge`), read here for the access log's `request_id`.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// The target of access-log events; the ordinary log leaves it out.
pub const TARGET: &str = "floodgate::access";

/// What is known about a request when it arrives, kept until its answer is done with.
#[derive(Debug)]
pub struct Entry {
    client: SocketAddr,
    /// `X-Request-Id` as it went upstream (see `edge`); `-` without one.
    request_id: String,
    method: Method,
    path: String,
    arrived: Instant,
    upstream: Option<String>,
    admitted: Option<Instant>,
    relayed: u64,
}

impl Entry {
    /// `None` when the access log is off: the request's path carries nothing for it.
    pub fn start<B>(enabled: bool, client: SocketAddr, request: &http::Request<B>) -> Option<Box<Entry>> {
        enabled.then(|| {
            let request_id = request
                .headers()
                .get(X_REQUEST_ID)
                .and_then(|id| id.to_str().ok())
                .unwrap_or("-");
            Box::new(Entry {
                client,
                request_id: request_id.to_string(),
                method: request.method().clone(),
                path: request.uri().path().to_string(),
                arrived: Instant::now(),
                upstream: None,
                admitted: None,
                relayed: 0,
            })
        })
    }

    pub fn routed(&mut self, upstream: &str) {
        self.upstream = Some(upstream.to_string());
    }

    pub fn admitted(&mut self) {
        self.admitted = Some(Instant::now());
    }

    /// Counts response body bytes read from the upstream and handed on to the client.
    pub fn relayed(&mut self, bytes: usize) {
        self.relayed += bytes as u64;
    }

    pub fn relayed_bytes(&self) -> u64 {
        self.relayed
    }

    /// Writes the line. `bytes` is the response body handed on to the client.
    pub fn write(&self, outcome: Outcome, status: Option<StatusCode>, bytes: u64) {
        self.line(outcome.as_str(), status.map_or(0, |s| s.as_u16()), bytes, None);
    }

    /// Writes a tunnel's line when it ends (its `101` was counted when sent): the bytes each way, and which side
    /// closed it (`closed_by`). Its `upstream_us` is how long it held its socket.
    pub fn write_tunnel(&self, to_client: u64, to_upstream: u64, closed_by: &str) {
        self.line("tunnel", 101, to_client, Some((to_upstream, closed_by)));
    }

    fn line(&self, outcome: &str, status: u16, bytes: u64, tunnel: Option<(u64, &str)>) {
        let now = Instant::now();
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let queue_us = self.admitted.map_or(0, |at| micros(at.duration_since(self.arrived)));
        let upstream_us = self.admitted.map_or(0, |at| micros(now.duration_since(at)));
        tracing::info!(
            target: TARGET,
            client = %self.client,
            request_id = %self.request_id,
            method = %self.method,
            path = %self.path,
            status,
            upstream = self.upstream.as_deref().unwrap_or("-"),
            queue_us,
            upstream_us,
            total_us = micros(now.duration_since(self.arrived)),
            bytes,
            bytes_to_upstream = tunnel.map(|(to_upstream, _)| to_upstream),
            closed_by = tunnel.map(|(_, closed_by)| closed_by),
            outcome,
        );
    }
}
