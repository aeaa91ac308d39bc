//! What the fuzz targets in `fuzz/` run, kept in the library so that `tests/fuzz_corpus.rs` can replay their
//! corpus on the stable toolchain. It exists for those two only and must never be used by the proxy.
//!
//! Each entry point takes the raw bytes of one input, runs them through the proxy's own code (the config
//! loader; hyper's HTTP/1 server parser, routing and the upstream rewrite; the header rewriting functions; a whole
//! proxy relaying an upstream's answer) and panics when something that must hold of the result does not: a panic
//! is how a fuzzer reports a finding.
//! - [`config_file`]: a TOML file as `--config` would load it.
//! - [`request_head`]: bytes from a client socket, as an HTTP/1 connection would serve them.
//! - [`header_rewrite`]: a request head in a small line format (see its docs), rewritten for the upstream and
//!   read as a response head.
//! - [`upstream_response`]: bytes from an upstream socket, relayed to an HTTP/1 client buffered, streamed and for
//!   a HEAD.
//! - [`h1_request_head`]: bytes from a client socket, read by floodgate's own HTTP/1 head reader and by hyper's
//!   server: both must accept or refuse them alike, and read the same message.
//! - [`h1_response_head`]: bytes from an upstream socket, read by floodgate's own HTTP/1 head reader and by
//!   hyper's client, alike.

// Panicking on a broken invariant is the point of this module: the fuzzer and the corpus replay catch it.
#![allow(clippy::panic)]

mod config_file;
mod h1_answer;
mod h1_diff;
mod h1_request_head;
mod h1_response_head;
mod h1_sent;
mod header_rewrite;
mod request_head;
mod upstream_head;
mod upstream_oracle;
mod upstream_response;

pub use config_file::config_file;
pub use h1_request_head::h1_request_head;
pub use h1_response_head::h1_response_head;
pub use header_rewrite::header_rewrite;
pub use request_head::request_head;
pub use upstream_response::upstream_response;

/// hyper's HTTP/1 server with floodgate's settings (the oracle the differential targets hold floodgate's own
/// server to); half-closing only lets every request of an input finish.
fn listener_http1(max_header_bytes: usize) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None)
        .max_header_size(max_header_bytes)
        .keep_alive(true)
        .half_close(true);
    builder
}

/// A client that sends `bytes`, closes its sending side and reads every answer until the server closes. The
/// server may stop reading early (a bad request): what is left is never sent.
async fn client_sends(mut socket: tokio::io::DuplexStream, bytes: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if socket.write_all(bytes).await.is_ok() {
        let _ = socket.shutdown().await;
    }
    let mut answers = Vec::new();
    let _ = socket.read_to_end(&mut answers).await;
}

/// The single-threaded runtime each target's fixture runs in, built once per process.
fn runtime() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => panic!("cannot build a runtime: {err}"),
    }
}
