//! What an HTTP/2 client's frame headers say as the bytes go by (after TLS): where it is in its header blocks, so
//! that `header_read_timeout` bounds an HTTP/2 request head as it bounds an HTTP/1 one, and how many PINGs it
//! acknowledged, so that acknowledgements floodgate never asked for are counted and bounded.
//!
//! A HEADERS frame without END_HEADERS opens a header block that only CONTINUATION frames may follow until one
//! carries END_HEADERS (RFC 9113 §6.2, §6.10): while it is open the connection can do nothing else, and hyper
//! hands nothing over, so a client that stops there would otherwise hold its connection until it chose to go on.
//!
//! floodgate sends at most one PING on a client connection, its goodbye's (hyper's keep-alive and BDP pings are
//! not turned on), so a well-behaved client acknowledges one at most. The protocol asks nothing of a receiver of
//! any other, and h2 ignores them but for a warning each (which `config::log_level` keeps out of the log): each is
//! counted here instead (`floodgate_http2_unsolicited_ping_acks_total`), and a client that sends more than
//! [`UNSOLICITED_PING_ACKS_TOLERATED`] of them is closed.
//!
//! Only the 9-byte frame headers are read here; hyper's HTTP/2 layer still parses and judges everything.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::activity::ClientActivity;

const PREFACE_BYTES: usize = 24;
const FRAME_HEADER_BYTES: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PING: u8 = 0x6;
const ACK: u8 = 0x1;

/// PING acknowledgements floodgate may have asked for on one connection: its goodbye's PING.
const SOLICITED_PING_ACKS: u32 = 1;

/// PING acknowledgements beyond the solicited one a connection may send before it is closed: a few for a confused
/// client's sake, far too few to matter as work or as log lines.
pub(super) const UNSOLICITED_PING_ACKS_TOLERATED: u32 = 10;

/// Follows the frame boundaries of a client's byte stream.
#[derive(Debug)]
struct FrameHeaders {
    preface_left: usize,
    header: [u8; FRAME_HEADER_BYTES],
    header_len: usize,
    payload_left: u64,
    in_block: bool,
}

/// A header block opened or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Opened,
    Closed,
}

/// What one read's frame headers said.
#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    /// The last change of header-block state, if any.
    block: Option<Block>,
    /// PING frames with the ACK flag.
    ping_acks: u32,
}

impl FrameHeaders {
    fn new() -> Self {
        FrameHeaders {
            preface_left: PREFACE_BYTES,
            header: [0; FRAME_HEADER_BYTES],
            header_len: 0,
            payload_left: 0,
            in_block: false,
        }
    }

    /// Reads `bytes` and reports what their frame headers said.
    fn feed(&mut self, mut bytes: &[u8]) -> Seen {
        let mut seen = Seen::default();
        while !bytes.is_empty() {
            if self.preface_left > 0 {
                let skipped = self.preface_left.min(bytes.len());
                self.preface_left -= skipped;
                bytes = bytes.get(skipped..).unwrap_or_default();
                continue;
            }
            if self.payload_left > 0 {
                let skipped = usize::try_from(self.payload_left)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                self.payload_left -= skipped as u64;
                bytes = bytes.get(skipped..).unwrap_or_default();
                continue;
            }
            let wanted = FRAME_HEADER_BYTES - self.header_len;
            let taken = wanted.min(bytes.len());
            if let (Some(into), Some(from)) = (
                self.header.get_mut(self.header_len..self.header_len + taken),
                bytes.get(..taken),
            ) {
                into.copy_from_slice(from);
            }
            self.header_len += taken;
            bytes = bytes.get(taken..).unwrap_or_default();
            if self.header_len < FRAME_HEADER_BYTES {
                break;
            }
            self.header_len = 0;
            let [l0, l1, l2, kind, flags, ..] = self.header;
            self.payload_left = u64::from(u32::from_be_bytes([0, l0, l1, l2]));
            let ends_block = flags & END_HEADERS != 0;
            match kind {
                HEADERS if !ends_block && !self.in_block => {
                    self.in_block = true;
                    seen.block = Some(Block::Opened);
                }
                CONTINUATION if ends_block && self.in_block => {
                    self.in_block = false;
                    seen.block = Some(Block::Closed);
                }
                PING if flags & ACK != 0 => seen.ping_acks = seen.ping_acks.saturating_add(1),
                _ => {}
            }
        }
        seen
    }
}

/// Why a client connection was closed under hyper: it kept acknowledging PINGs floodgate never sent.
#[derive(Debug, thiserror::Error)]
#[error("the client acknowledged more than {UNSOLICITED_PING_ACKS_TOLERATED} PINGs floodgate never sent")]
pub(super) struct PingAckFlood;

/// One connection's PING acknowledgements, against what floodgate asked for.
pub(super) struct PingAcks {
    seen: u32,
    /// `floodgate_http2_unsolicited_ping_acks_total`, resolved once for every connection.
    unsolicited: Counter,
    peer: SocketAddr,
}

impl PingAcks {
    pub(super) fn new(unsolicited: Counter, peer: SocketAddr) -> Self {
        PingAcks {
            seen: 0,
            unsolicited,
            peer,
        }
    }

    /// Counts `acks` more; past the tolerated number the connection is to close (said once, at `debug`: the
    /// client's doing, counted in the metric).
    fn acknowledged(&mut self, acks: u32) -> Result<(), PingAckFlood> {
        let flooded = |seen: u32| seen > SOLICITED_PING_ACKS + UNSOLICITED_PING_ACKS_TOLERATED;
        if acks == 0 {
            return if flooded(self.seen) { Err(PingAckFlood) } else { Ok(()) };
        }
        // Counted up to the one that closes the connection: the rest of the read is never handed on.
        let unsolicited = |seen: u32| {
            seen.saturating_sub(SOLICITED_PING_ACKS)
                .min(UNSOLICITED_PING_ACKS_TOLERATED + 1)
        };
        let before = self.seen;
        self.seen = self.seen.saturating_add(acks);
        self.unsolicited
            .inc_by(u64::from(unsolicited(self.seen) - unsolicited(before)));
        if flooded(self.seen) {
            if !flooded(before) {
                tracing::debug!(peer = %self.peer, "{PingAckFlood}; closing");
            }
            return Err(PingAckFlood);
        }
        Ok(())
    }
}

/// An HTTP/2 connection's stream (plain or TLS), read through a [`FrameHeaders`] that tells the connection's
/// [`ClientActivity`] when a header block opens and closes, and counts its PING acknowledgements: a read that takes
/// them past the bound fails, which ends hyper's connection and closes the socket.
pub(super) struct FrameWatch<I> {
    inner: I,
    frames: FrameHeaders,
    activity: Arc<ClientActivity>,
    ping_acks: PingAcks,
}

impl<I> FrameWatch<I> {
    pub(super) fn new(inner: I, activity: Arc<ClientActivity>, ping_acks: PingAcks) -> Self {
        FrameWatch {
            inner,
            frames: FrameHeaders::new(),
            activity,
            ping_acks,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for FrameWatch<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let seen = buf
            .filled()
            .get(before..)
            .map(|read| this.frames.feed(read))
            .unwrap_or_default();
        match seen.block {
            Some(Block::Opened) => this.activity.header_block_started(),
            Some(Block::Closed) => this.activity.header_block_ended(),
            None => {}
        }
        if let Err(flood) = this.ping_acks.acknowledged(seen.ping_acks) {
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::InvalidData, flood)));
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for FrameWatch<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = len.to_be_bytes()[1..].to_vec();
        out.extend([kind, flags, 0, 0, 0, 1]);
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn a_header_block_is_open_from_headers_without_end_headers_to_the_continuation_that_ends_it() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, &[0; 6])); // SETTINGS
        let opened = frame(HEADERS, 0, &[0x82; 40]);
        let more = frame(CONTINUATION, 0, &[0x86; 10]);
        let closed = frame(CONTINUATION, END_HEADERS, &[0x84; 3]);
        // Fed a byte at a time, as the slowest client would send it.
        let mut frames = FrameHeaders::new();
        let mut seen = Vec::new();
        for chunk in [bytes, opened, more, closed].concat().chunks(1) {
            seen.extend(frames.feed(chunk).block);
        }
        assert_eq!(seen, [Block::Opened, Block::Closed]);
    }

    #[test]
    fn headers_with_end_headers_and_other_frames_open_no_block() {
        let mut frames = FrameHeaders::new();
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(HEADERS, END_HEADERS, &[0x82; 20]));
        bytes.extend(frame(0x6, 0, &[0; 8])); // PING
        bytes.extend(frame(0x0, 0, &[7; 100])); // DATA
        assert_eq!(frames.feed(&bytes), Seen::default());
        assert!(!frames.in_block);
    }

    #[test]
    fn ping_acks_are_counted_whole_or_split_and_pings_asking_for_one_are_not() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(PING, 0, &[1; 8]));
        bytes.extend(frame(PING, ACK, &[2; 8]));
        bytes.extend(frame(0x4, ACK, &[])); // a SETTINGS ACK
        bytes.extend(frame(PING, ACK, &[3; 8]));
        let mut frames = FrameHeaders::new();
        assert_eq!(frames.feed(&bytes).ping_acks, 2);
        let mut frames = FrameHeaders::new();
        let split: u32 = bytes.chunks(5).map(|chunk| frames.feed(chunk).ping_acks).sum();
        assert_eq!(split, 2);
    }

    #[test]
    fn the_solicited_ack_is_free_and_the_one_past_the_tolerated_closes_once_counted() {
        let counter = Counter::default();
        let mut acks = PingAcks::new(counter.clone(), "127.0.0.1:1".parse().unwrap());
        assert!(acks.acknowledged(SOLICITED_PING_ACKS).is_ok());
        assert_eq!(counter.get(), 0, "the goodbye's own ACK is not counted");
        assert!(acks.acknowledged(UNSOLICITED_PING_ACKS_TOLERATED).is_ok());
        assert_eq!(counter.get(), u64::from(UNSOLICITED_PING_ACKS_TOLERATED));
        // Many in one read: the one past the bound is counted, the rest never reach hyper.
        assert!(acks.acknowledged(500).is_err());
        assert_eq!(counter.get(), u64::from(UNSOLICITED_PING_ACKS_TOLERATED) + 1);
        assert!(
            acks.acknowledged(0).is_err(),
            "a connection past the bound stays refused"
        );
        assert_eq!(counter.get(), u64::from(UNSOLICITED_PING_ACKS_TOLERATED) + 1);
    }
}
