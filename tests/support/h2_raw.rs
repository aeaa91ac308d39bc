//! Raw HTTP/2 frames for clients that misbehave on purpose: the client preface, one frame by type, flags and
//! stream, and floods of frames no library would send.

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The type of a PING frame, and its ACK flag.
pub const PING: u8 = 0x6;
pub const ACK: u8 = 0x1;

/// One frame: its 9-byte header, then `payload`.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The preface and an empty SETTINGS frame: what a client sends before anything else.
pub fn hello() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out
}

/// `n` PING frames with the ACK flag set, each acknowledging a PING nobody sent (17 bytes each).
pub fn unsolicited_ping_acks(n: usize) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|i| frame(PING, ACK, 0, &i.to_be_bytes()))
        .collect()
}

/// Asserts that the proxy counted a flood of unsolicited PING ACKs: at least one, and no more than it tolerates
/// before closing the connection (the rest of that read is never handed on).
pub async fn assert_unsolicited_ping_acks_counted(proxy: &super::Proxy) {
    let counted = super::metric_sum(
        &super::parse_metrics(&proxy.metrics().await),
        "floodgate_http2_unsolicited_ping_acks_total",
        &[],
    );
    assert!(
        (1.0..=16.0).contains(&counted),
        "{counted} unsolicited PING ACKs counted"
    );
}
