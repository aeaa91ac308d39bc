//! Chaos clients: each plays one part picked by a seeded generator (patient, or vanishing in the queue,
//! mid-upload or mid-download, with FIN or RST), so that a failing run can be replayed from its seed.

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;

use super::{next_random, try_get, RawConn};

/// What one chaos client does; its seed picks the kind and the point where it gives up.
#[derive(Debug, Clone, Copy)]
pub enum Chaos {
    /// A plain GET that must be answered 200.
    Patient,
    /// Sends a GET that takes a while, then vanishes after `after_ms` (in the queue or mid-request).
    Vanish { after_ms: u64, reset: bool },
    /// Promises a 1 MB upload, sends `sent` bytes of it, then vanishes.
    AbortUpload { sent: usize, reset: bool },
    /// Asks for 4 MB, reads `read` bytes, then vanishes.
    AbortDownload { read: usize, reset: bool },
}

impl Chaos {
    /// `patient_percent` of the clients are patient; the rest vanish at a random point, in equal shares.
    pub fn pick(rng: &mut u64, patient_percent: u64) -> Chaos {
        let reset = next_random(rng).is_multiple_of(2);
        if next_random(rng) % 100 < patient_percent {
            return Chaos::Patient;
        }
        match next_random(rng) % 3 {
            0 => Chaos::Vanish {
                after_ms: next_random(rng) % 60,
                reset,
            },
            1 => Chaos::AbortUpload {
                sent: (next_random(rng) % 1_000_000) as usize,
                reset,
            },
            _ => Chaos::AbortDownload {
                read: (next_random(rng) % 4_000_000) as usize,
                reset,
            },
        }
    }

    /// Plays the part against the proxy at `addr`: the status a patient client was answered, `None` for a
    /// client that vanished, an error for a patient client that got no answer at all.
    pub async fn play(self, addr: SocketAddr, client: usize) -> Result<Option<StatusCode>, String> {
        let t = Duration::from_secs(30);
        match self {
            Chaos::Patient => {
                let resp = try_get(addr, &format!("/delay/5?c={client}"))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Some(resp.status))
            }
            Chaos::Vanish { after_ms, reset } => {
                let mut conn = RawConn::connect(addr).await;
                let head = format!("GET /delay/50?c={client} HTTP/1.1\r\nHost: chaos\r\n\r\n");
                conn.write(head.as_bytes()).await.map_err(|e| e.to_string())?;
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                vanish(conn, reset);
                Ok(None)
            }
            Chaos::AbortUpload { sent, reset } => {
                let mut conn = RawConn::connect(addr).await;
                let head = format!("POST /echo?c={client} HTTP/1.1\r\nHost: chaos\r\nContent-Length: 1000000\r\n\r\n");
                conn.write(head.as_bytes()).await.map_err(|e| e.to_string())?;
                let chunk = vec![b'u'; 16 * 1024];
                let mut left = sent;
                while left > 0 {
                    let n = left.min(chunk.len());
                    // The proxy may stop reading (queued, or shed): an upload that cannot proceed is abandoned.
                    match tokio::time::timeout(Duration::from_millis(200), conn.write(&chunk[..n])).await {
                        Ok(Ok(())) => left -= n,
                        _ => break,
                    }
                }
                vanish(conn, reset);
                Ok(None)
            }
            Chaos::AbortDownload { read, reset } => {
                let mut conn = RawConn::connect(addr).await;
                let head = format!("GET /bytes/4000000?c={client} HTTP/1.1\r\nHost: chaos\r\n\r\n");
                conn.write(head.as_bytes()).await.map_err(|e| e.to_string())?;
                let mut got = 0;
                while got < read {
                    match conn.read_some((read - got).min(64 * 1024), t).await {
                        Ok(data) if !data.is_empty() => got += data.len(),
                        _ => break,
                    }
                }
                vanish(conn, reset);
                Ok(None)
            }
        }
    }
}

fn vanish(conn: RawConn, reset: bool) {
    if reset {
        conn.abort_with_reset();
    } else {
        drop(conn);
    }
}
