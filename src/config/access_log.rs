//! The names the access log's keys are checked against (`access_log_fields`, `access_log_unredacted`); the log
//! itself (`crate::access`) reads them from here, so the configuration never depends on the log.

/// Every field a `json` or `human` line may have, in the order it has them (`access_log_fields` chooses among
/// them; the captured headers come after).
pub const FIELDS: [&str; 24] = [
    "client.address",
    "client.port",
    "http.request.header.x-request-id",
    "http.request.method",
    "url.path",
    "url.query",
    "server.address",
    "server.port",
    "url.scheme",
    "http.route",
    "user_agent.original",
    "network.protocol.version",
    "http.response.status_code",
    "http.request.body.size",
    "http.response.body.size",
    "floodgate.upstream",
    "floodgate.outcome",
    "floodgate.queue.duration_us",
    "floodgate.upstream.duration_us",
    "floodgate.request.duration_us",
    "trace_id",
    "span_id",
    "floodgate.tunnel.bytes_to_upstream",
    "floodgate.tunnel.closed_by",
];

/// Header fields whose values are credentials: a captured one is written `<redacted>` unless
/// `access_log_unredacted` names it.
pub const SECRET_HEADERS: [&str; 4] = ["authorization", "proxy-authorization", "cookie", "set-cookie"];
