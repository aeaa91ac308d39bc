//! Forwarding: the request as the upstream sees it, and the bodies relayed both ways.
//!
//! Owns the request target's path as it is routed and forwarded (dot segments resolved: `path`), header rewriting
//! (hop-by-hop headers removed, `X-Forwarded-*` set and the names that alias them with `_` dropped, Host kept less a
//! trailing dot, an HTTP/2 cookie joined into one line, `Content-Length` in its canonical form), the request body that
//! times out when the client stops sending (sent from memory when it was read before admission), and the response body
//! that holds the lease until its last byte read from the upstream: it returns the connection when the body ends, and
//! when the client leaves early it reads the rest of the response (bounded) so the connection can still be reused. A
//! response small enough to buffer is read in full first and relayed from memory without a lease. It never decides
//! admission or counts connections.

mod head;
mod path;
mod relay;
mod response;
#[cfg(test)]
mod tests;

pub use crate::admission::is_grpc;
use crate::body::IdleTimer;
pub use crate::body::{BodyStalled, BoxError, CutOff, RequestBody, UpstreamRequest};
pub(crate) use crate::h1::connection_options;
pub use crate::h1::keeps_alive;
pub use crate::h1::UpstreamError;
pub use crate::pool::client::{client_body_error, Upload, UpstreamIncoming};
pub(crate) use crate::pool::client::{resend, send, SentHead};
pub(crate) use crate::pool::client_h2::{send as send_h2, Kept, Unopened, Unsent};
pub use head::{
    check_host, check_target, check_transfer_coding, drop_underscore_aliases, strip_hop_by_hop, target_host,
    to_upstream, upstream_head, ClientInfo,
};
pub use path::resolve_dot_segments;
pub use relay::UpstreamBody;
pub use response::{grpc_shed_response, local_response, ResponseBody, SHED_REASON};
pub(crate) use response::{to_client, RouteEdits};
