//! The error type of a proxied exchange and its single mapping to an HTTP answer.
//!
//! Every failure a client can see is one [`ProxyError`] variant; [`ProxyError::status`] and
//! [`ProxyError::reason`] are the only place that decides the status code and the short body, and [`ShedAdvice`]
//! is what an upstream's settings and recent pace add to a shed answer (its status, `Retry-After`). Nothing here
//! logs or counts: the caller does that once, with the outcome this module names.

use std::time::Duration;

use http::StatusCode;

use crate::admission::Shed;
pub use crate::h1::UpstreamError;

/// Why an exchange did not produce the upstream's own answer.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{0}")]
    Shed(Shed),
    #[error("no route for this request")]
    NoRoute,
    /// `CONNECT`: floodgate is a reverse proxy, not a forward one.
    #[error("CONNECT (forward-proxy tunnelling) is not supported")]
    ConnectRefused,
    /// An upgrade (a WebSocket) to an upstream whose `max_tunnels` is 0.
    #[error("tunnels are off for this upstream (max_tunnels = 0)")]
    TunnelsOff,
    /// An upgrade to an upstream that has `max_tunnels` open already.
    #[error("the upstream's tunnels are all in use (max_tunnels)")]
    TunnelLimit,
    /// An upgrade request with a body: what is a request's and what is the tunnel's could not be told apart.
    #[error("an upgrade request with a body")]
    UpgradeWithBody,
    #[error("request has no Host")]
    MissingHost,
    #[error("request has more than one Host or an invalid one")]
    InvalidHost,
    #[error("request target `*` is only for OPTIONS")]
    AsteriskTarget,
    #[error("request target in authority form is only for CONNECT")]
    AuthorityFormTarget,
    #[error("request target has a scheme other than http or https")]
    UnsupportedScheme,
    /// A target that cannot be routed as every upstream would read it: its path climbs above the root or hides a
    /// dot segment where another reader would find one, or it holds a byte that is not ASCII (see
    /// `forward::resolve_dot_segments`).
    #[error("invalid request target: {0}")]
    InvalidTarget(&'static str),
    #[error("request body uses a transfer coding other than chunked")]
    UnsupportedTransferCoding,
    /// `chunked` applied more than once (RFC 9112 §6.1 forbids it): decoded once, the inner framing would be taken
    /// for the content.
    #[error("request body is chunked more than once")]
    ChunkedTwice,
    #[error("the client's request body failed: {0}")]
    ClientBody(String),
    #[error("the client's request body made no progress for {0:?}")]
    ClientBodyTimeout(Duration),
    #[error("the client was still sending its request body when request_timeout ({0:?}) ran out")]
    ClientTooSlow(Duration),
    #[error("the client closed its connection before the end of its request body")]
    ClientGone,
    #[error("could not connect to upstream: {0}")]
    Connect(String),
    /// A slot was issued, but by the time it dialled another generation of the pool (a reload replaced it) had
    /// taken the last room at every endpoint it could go to: nothing was sent, and the request waits again.
    #[error("no endpoint has room for another connection")]
    NoEndpointRoom,
    #[error("connect to upstream timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// The TLS handshake with an `https://` upstream failed (its certificate, the name, a protocol alert).
    #[error("TLS handshake with upstream failed: {0}")]
    UpstreamTls(String),
    #[error("upstream failed: {0}")]
    Upstream(#[source] UpstreamError),
    #[error("upstream did not answer within {0:?}")]
    UpstreamTimeout(Duration),
    #[error("upstream response body went on past its Content-Length")]
    UpstreamBodyTooLong,
    /// A response whose framing cannot be trusted (both Content-Length and Transfer-Encoding, a Content-Length that
    /// is not one number), whose content is in a transfer coding other than chunked, or one no request asked for
    /// (101 without an upgrade).
    #[error("upstream response is malformed: {0}")]
    UpstreamMalformed(&'static str),
    /// The upstream side stopped with the exchange on it: floodgate is exiting.
    #[error("the exchange was abandoned: floodgate is shutting down")]
    Abandoned,
    /// floodgate's own code panicked while handling the request.
    #[error("internal error")]
    Internal,
}

/// What the metrics call an outcome; one per way a request can end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    ShedQueueFull,
    ShedQueueTimeout,
    ShedOverload,
    ShedDeadline,
    ShedQuota,
    ShedTunnelLimit,
    ShedStalled,
    ShedRetryBudget,
    UpstreamError,
    UpstreamTimeout,
    ClientAbort,
    BadRequest,
    HeaderTooLarge,
    ClientTimeout,
    NotImplemented,
    NoRoute,
    Internal,
}

impl Outcome {
    pub const ALL: [Outcome; 18] = [
        Outcome::Ok,
        Outcome::ShedQueueFull,
        Outcome::ShedQueueTimeout,
        Outcome::ShedOverload,
        Outcome::ShedDeadline,
        Outcome::ShedQuota,
        Outcome::ShedTunnelLimit,
        Outcome::ShedStalled,
        Outcome::ShedRetryBudget,
        Outcome::UpstreamError,
        Outcome::UpstreamTimeout,
        Outcome::ClientAbort,
        Outcome::BadRequest,
        Outcome::HeaderTooLarge,
        Outcome::ClientTimeout,
        Outcome::NotImplemented,
        Outcome::NoRoute,
        Outcome::Internal,
    ];

    /// Whether a request refused before routing (or a panic) can end so: the counters under `upstream="-"` that
    /// `/metrics` shows at 0 from the start.
    pub fn of_client_side(self) -> bool {
        matches!(
            self,
            Outcome::BadRequest
                | Outcome::HeaderTooLarge
                | Outcome::ClientTimeout
                | Outcome::NotImplemented
                | Outcome::NoRoute
                | Outcome::Internal
        )
    }

    /// Whether a request routed to an upstream can end so: every outcome but those only refusals before routing
    /// (and a panic) have; the counters `/metrics` shows at 0 for each upstream.
    pub fn of_upstreams(self) -> bool {
        !matches!(
            self,
            Outcome::BadRequest | Outcome::HeaderTooLarge | Outcome::NoRoute | Outcome::Internal
        )
    }

    /// The status floodgate answers with for this outcome (a success, for `ok`): one grouping for both.
    pub fn status(self) -> StatusCode {
        match self {
            // The client has given up by now; 504 is what a gateway says when time ran out.
            Outcome::ShedDeadline | Outcome::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Outcome::ShedQuota => StatusCode::TOO_MANY_REQUESTS,
            Outcome::ShedQueueFull
            | Outcome::ShedQueueTimeout
            | Outcome::ShedOverload
            | Outcome::ShedTunnelLimit
            | Outcome::ShedStalled
            | Outcome::ShedRetryBudget => StatusCode::SERVICE_UNAVAILABLE,
            Outcome::NoRoute => StatusCode::NOT_FOUND,
            Outcome::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            // A client that left reads nothing; a status is still needed for the log line.
            Outcome::BadRequest | Outcome::ClientAbort => StatusCode::BAD_REQUEST,
            Outcome::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            Outcome::UpstreamError => StatusCode::BAD_GATEWAY,
            Outcome::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Outcome::HeaderTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Outcome::Ok => StatusCode::OK,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ShedQueueFull => "shed_queue_full",
            Outcome::ShedQueueTimeout => "shed_queue_timeout",
            Outcome::ShedOverload => "shed_overload",
            Outcome::ShedDeadline => "shed_deadline",
            Outcome::ShedQuota => "shed_quota",
            Outcome::ShedTunnelLimit => "shed_tunnel_limit",
            Outcome::ShedStalled => "shed_upstream_stalled",
            Outcome::ShedRetryBudget => "shed_retry_budget",
            Outcome::UpstreamError => "upstream_error",
            Outcome::UpstreamTimeout => "upstream_timeout",
            Outcome::ClientAbort => "client_abort",
            Outcome::BadRequest => "bad_request",
            Outcome::HeaderTooLarge => "header_too_large",
            Outcome::ClientTimeout => "client_timeout",
            Outcome::NotImplemented => "not_implemented",
            Outcome::NoRoute => "no_route",
            Outcome::Internal => "internal_error",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl ProxyError {
    /// The status floodgate answers with, by the outcome it is counted as (see [`Outcome::status`]).
    pub fn status(&self) -> StatusCode {
        self.outcome().status()
    }

    /// The short plain-text body; names the reason without leaking upstream internals.
    /// [`ProxyError::reason`] as one line, for gRPC's `grpc-message`.
    pub fn reason_for_grpc(&self) -> &'static str {
        self.reason().trim_end()
    }

    pub fn reason(&self) -> &'static str {
        match self {
            ProxyError::Shed(Shed::QueueFull) => "queue full\n",
            ProxyError::Shed(Shed::QueueTimeout) => "queue timeout\n",
            ProxyError::Shed(Shed::Overload) => "overloaded: queue wait above target\n",
            ProxyError::Shed(Shed::Deadline) => "request deadline passed before it could start\n",
            ProxyError::Shed(Shed::Quota) => "too many requests from this client waiting\n",
            ProxyError::Shed(Shed::Stalled) => "upstream stalled: no exchange finished within stall_timeout\n",
            ProxyError::Shed(Shed::RetryBudget) => "retries over their budget\n",
            ProxyError::NoRoute => "no route\n",
            ProxyError::ConnectRefused => "CONNECT (forward-proxy tunnelling) is not supported\n",
            ProxyError::TunnelsOff => "tunnels (WebSocket, Upgrade) are off for this upstream: max_tunnels = 0\n",
            ProxyError::TunnelLimit => "tunnel limit: the upstream has max_tunnels open\n",
            ProxyError::UpgradeWithBody => "an upgrade request must not have a body\n",
            ProxyError::MissingHost => "missing Host header\n",
            ProxyError::InvalidHost => "invalid Host header\n",
            ProxyError::AsteriskTarget => "request target * is only for OPTIONS\n",
            ProxyError::AuthorityFormTarget => "request target in authority form is only for CONNECT\n",
            ProxyError::UnsupportedScheme => "request target scheme is not http or https\n",
            ProxyError::InvalidTarget(_) => "invalid request target\n",
            ProxyError::UnsupportedTransferCoding => "transfer coding not supported\n",
            ProxyError::ChunkedTwice => "transfer coding chunked applied more than once\n",
            ProxyError::ClientBody(_) => "bad request body\n",
            ProxyError::ClientBodyTimeout(_) | ProxyError::ClientTooSlow(_) => "request body timeout\n",
            ProxyError::ClientGone => "request body incomplete\n",
            ProxyError::Connect(_) | ProxyError::NoEndpointRoom => "upstream connect failed\n",
            ProxyError::ConnectTimeout(_) => "upstream connect timeout\n",
            ProxyError::UpstreamTls(_) => "upstream TLS handshake failed\n",
            ProxyError::Upstream(_)
            | ProxyError::UpstreamBodyTooLong
            | ProxyError::UpstreamMalformed(_)
            | ProxyError::Abandoned => "upstream error\n",
            ProxyError::UpstreamTimeout(_) => "upstream timeout\n",
            ProxyError::Internal => "internal error\n",
        }
    }

    pub fn outcome(&self) -> Outcome {
        match self {
            ProxyError::Shed(Shed::QueueFull) => Outcome::ShedQueueFull,
            ProxyError::Shed(Shed::QueueTimeout) => Outcome::ShedQueueTimeout,
            ProxyError::Shed(Shed::Overload) => Outcome::ShedOverload,
            ProxyError::Shed(Shed::Deadline) => Outcome::ShedDeadline,
            ProxyError::Shed(Shed::Quota) => Outcome::ShedQuota,
            ProxyError::Shed(Shed::Stalled) => Outcome::ShedStalled,
            ProxyError::Shed(Shed::RetryBudget) => Outcome::ShedRetryBudget,
            ProxyError::NoRoute => Outcome::NoRoute,
            ProxyError::ConnectRefused | ProxyError::TunnelsOff => Outcome::NotImplemented,
            ProxyError::TunnelLimit => Outcome::ShedTunnelLimit,
            ProxyError::UpgradeWithBody => Outcome::BadRequest,
            ProxyError::MissingHost
            | ProxyError::InvalidHost
            | ProxyError::AsteriskTarget
            | ProxyError::AuthorityFormTarget
            | ProxyError::UnsupportedScheme
            | ProxyError::InvalidTarget(_)
            | ProxyError::ChunkedTwice
            | ProxyError::ClientBody(_) => Outcome::BadRequest,
            ProxyError::UnsupportedTransferCoding => Outcome::NotImplemented,
            ProxyError::ClientBodyTimeout(_) | ProxyError::ClientTooSlow(_) => Outcome::ClientTimeout,
            ProxyError::ClientGone => Outcome::ClientAbort,
            ProxyError::Connect(_)
            | ProxyError::NoEndpointRoom
            | ProxyError::ConnectTimeout(_)
            | ProxyError::UpstreamTls(_)
            | ProxyError::Upstream(_)
            | ProxyError::UpstreamBodyTooLong
            | ProxyError::UpstreamMalformed(_)
            | ProxyError::Abandoned => Outcome::UpstreamError,
            ProxyError::UpstreamTimeout(_) => Outcome::UpstreamTimeout,
            ProxyError::Internal => Outcome::Internal,
        }
    }

    /// The status with the upstream's advice applied: a capacity shed takes the configured status.
    pub fn status_with(&self, advice: Option<&ShedAdvice>) -> StatusCode {
        match (self, advice) {
            (ProxyError::Shed(Shed::Quota), Some(advice)) => advice.quota_status,
            (ProxyError::Shed(shed), Some(advice)) if *shed != Shed::Deadline => advice.status,
            _ => self.status(),
        }
    }

    /// Whether the answer tells the client when to come back: sheds for capacity do; one for the client's own
    /// deadline does not (that client has given up).
    pub fn asks_for_retry(&self) -> bool {
        matches!(self, ProxyError::Shed(shed) if *shed != Shed::Deadline) || matches!(self, ProxyError::TunnelLimit)
    }

    /// The shed reason, for the `X-Floodgate-Shed-Reason` header.
    pub fn shed(&self) -> Option<Shed> {
        match self {
            ProxyError::Shed(shed) => Some(*shed),
            _ => None,
        }
    }

    /// The `X-Floodgate-Shed-Reason` value: a queue's shed, or the tunnels' bound.
    pub fn shed_reason(&self) -> Option<&'static str> {
        match self {
            ProxyError::Shed(shed) => Some(shed.as_str()),
            ProxyError::TunnelLimit => Some("tunnel_limit"),
            _ => None,
        }
    }
}

/// What an upstream adds to a shed answer: the status it is configured to shed with, and how many seconds the
/// client should wait before trying again, from how fast the queue has been draining.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShedAdvice {
    pub status: StatusCode,
    pub quota_status: StatusCode,
    pub retry_after_secs: u64,
    /// The same wait in milliseconds, for gRPC's `grpc-retry-pushback-ms`.
    pub retry_after_ms: u64,
}
