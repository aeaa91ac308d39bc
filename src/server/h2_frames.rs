//! Where an HTTP/2 client is in its header blocks, read off the frame headers as the bytes go by (after TLS), so
//! that `header_read_timeout` bounds an HTTP/2 request head as it bounds an HTTP/1 one.
//!
//! A HEADERS frame without END_HEADERS opens a header block that only CONTINUATION frames may follow until one
//! carries END_HEADERS (RFC 9113 §6.2, §6.10): while it is open the connection can do nothing else, and hyper
//! hands nothing over, so a client that stops there would otherwise hold its connection until it chose to go on.
//! Only the 9-byte frame headers are read here; hyper's HTTP/2 layer still parses and judges everything.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::activity::ClientActivity;

const PREFACE_BYTES: usize = 24;
const FRAME_HEADER_BYTES: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

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

    /// Reads `bytes` and reports the last change of block state among them, if any.
    fn feed(&mut self, mut bytes: &[u8]) -> Option<Block> {
        let mut change = None;
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
                    change = Some(Block::Opened);
                }
                CONTINUATION if ends_block && self.in_block => {
                    self.in_block = false;
                    change = Some(Block::Closed);
                }
                _ => {}
            }
        }
        change
    }
}

/// An HTTP/2 connection's stream (plain or TLS), read through a [`FrameHeaders`] that tells the connection's
/// [`ClientActivity`] when a header block opens and closes.
pub struct FrameWatch<I> {
    inner: I,
    frames: FrameHeaders,
    activity: Arc<ClientActivity>,
}

impl<I> FrameWatch<I> {
    pub fn new(inner: I, activity: Arc<ClientActivity>) -> Self {
        FrameWatch {
            inner,
            frames: FrameHeaders::new(),
            activity,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for FrameWatch<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(read) = buf.filled().get(before..) {
            match this.frames.feed(read) {
                Some(Block::Opened) => this.activity.header_block_started(),
                Some(Block::Closed) => this.activity.header_block_ended(),
                None => {}
            }
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
            seen.extend(frames.feed(chunk));
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
        assert_eq!(frames.feed(&bytes), None);
        assert!(!frames.in_block);
    }
}
