//! The PROXY protocol (HAProxy's v1 text and v2 binary header) on the client listener, with `proxy_protocol = true`:
//! an L4 load balancer (AWS NLB, HAProxy in TCP mode) puts the address of the client it accepted before the
//! connection's first byte. `ppp` parses it; this reads it off the socket (exactly its bytes, the rest left for
//! HTTP or TLS), and decides whom to believe: a header is taken only from a peer in `trusted_proxies`. One from
//! any other peer, or a malformed one, closes the connection. A connection without a header is served as it is.
//! It never reads past the header.

use std::net::SocketAddr;
use std::time::Duration;

use ppp::{v1, v2, HeaderResult, PartialResult};
use tokio::net::TcpStream;

/// Signatures that start a header: v1's text and v2's binary one.
const V1_SIGNATURE: &[u8] = b"PROXY ";
const V2_SIGNATURE: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";

/// The most a header may take: v1's 107 bytes, and v2's 16 and its addresses and TLVs within this.
const MAX_HEADER_BYTES: usize = 1024;

/// Why a connection was closed at its header.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error("PROXY header from {0}, which is not in trusted_proxies")]
    Untrusted(SocketAddr),
    #[error("malformed PROXY header: {0}")]
    Malformed(String),
    #[error("reading the PROXY header: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads a PROXY header at the start of `stream`, if one is there: the client's address it carries, or `None` when
/// there is no header or it names none (a v2 `LOCAL`, a load balancer's own health check; v1 `UNKNOWN`). The caller
/// bounds the wait (`first_byte_timeout`).
pub(super) async fn read(stream: &TcpStream, peer: SocketAddr, trusted: bool) -> Result<Option<SocketAddr>, Refused> {
    let mut buf = vec![0u8; MAX_HEADER_BYTES];
    let mut pause = Duration::from_millis(1);
    let length = loop {
        let n = stream.peek(&mut buf).await?;
        let seen = buf.get(..n).unwrap_or_default();
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        let starts = |signature: &[u8]| {
            let common = seen.len().min(signature.len());
            seen.get(..common) == signature.get(..common)
        };
        if !starts(V1_SIGNATURE) && !starts(V2_SIGNATURE) {
            return Ok(None);
        }
        if trusted {
            let parsed = HeaderResult::parse(seen);
            if parsed.is_complete() {
                break match parsed {
                    HeaderResult::V1(Ok(header)) => (header.header.len(), v1_address(&header)),
                    HeaderResult::V2(Ok(header)) => (header.len(), v2_address(&header)),
                    HeaderResult::V1(Err(err)) => return Err(Refused::Malformed(err.to_string())),
                    HeaderResult::V2(Err(err)) => return Err(Refused::Malformed(err.to_string())),
                };
            }
            // A v1 line that has ended cannot become whole with more bytes.
            let v1_line_over = seen.starts_with(V1_SIGNATURE) && seen.windows(2).any(|pair| pair == b"\r\n");
            if v1_line_over {
                return Err(Refused::Malformed("an incomplete v1 line".to_string()));
            }
        } else if seen.starts_with(V1_SIGNATURE) || seen.starts_with(V2_SIGNATURE) {
            // Only a whole signature: a request's first bytes (`P` of `POST`, a leading empty line) may begin one.
            return Err(Refused::Untrusted(peer));
        }
        if n == buf.len() {
            return Err(Refused::Malformed(format!("longer than {MAX_HEADER_BYTES} bytes")));
        }
        // A header split across packets is rare: peek returns at once while bytes are pending, so back off rather
        // than spin until the rest comes.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    };
    let (len, address) = length;
    consume(stream, buf.get_mut(..len).unwrap_or_default()).await?;
    Ok(address)
}

fn v1_address(header: &v1::Header<'_>) -> Option<SocketAddr> {
    match &header.addresses {
        v1::Addresses::Tcp4(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        v1::Addresses::Tcp6(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        v1::Addresses::Unknown => None,
    }
}

fn v2_address(header: &v2::Header<'_>) -> Option<SocketAddr> {
    if header.command == v2::Command::Local {
        return None;
    }
    match &header.addresses {
        v2::Addresses::IPv4(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        v2::Addresses::IPv6(ip) => Some(SocketAddr::from((ip.source_address, ip.source_port))),
        v2::Addresses::Unspecified | v2::Addresses::Unix(_) => None,
    }
}

/// Takes exactly `into.len()` bytes off `stream` (they were peeked, so they are there).
async fn consume(stream: &TcpStream, into: &mut [u8]) -> std::io::Result<()> {
    let mut taken = 0;
    while taken < into.len() {
        stream.readable().await?;
        match stream.try_read(into.get_mut(taken..).unwrap_or_default()) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => taken += n,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}
