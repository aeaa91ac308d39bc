//! Shared helpers for floodgate's integration tests.
//!
//! * [`Upstream`]: a hyper HTTP/1.1 origin server that counts its TCP
//!   connections and requests exactly and whose behaviour is chosen by path.
//! * [`Proxy`]: launches the `floodgate` binary on ephemeral ports and talks to
//!   its admin listener.
//! * Clients: [`H1Conn`] / [`H2Conn`] (hyper client connections) and
//!   [`RawConn`] (bytes on a TCP socket, for malformed requests), and [`h2_raw`]'s HTTP/2 frames.
//! * [`wait_until`]: poll a condition with a deadline (tests never sleep to
//!   synchronise).
//! * [`pki`]: a CA and certificates made at test time, TLS clients, and the
//!   check that a configuration is refused naming its key.
//!
//! Every test binary uses a different subset of this module (hence the allowances below).
#![allow(dead_code, unused_imports)]

pub mod chaos;
pub mod dns;
pub mod early;
pub mod flood;
pub mod h2_raw;
pub mod h2_scripted;
pub mod h2_upstream;
pub mod pki;
pub mod scripted;
pub mod websocket;

mod clients;
mod load;
mod pattern;
mod prometheus;
mod proxy;
mod raw;
mod upstream;
mod wait;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

pub use clients::*;
pub use load::*;
pub use pattern::*;
pub use prometheus::*;
pub use proxy::*;
pub use raw::*;
pub use upstream::*;
pub use wait::*;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Request body type used by the test clients.
pub type TestBody = BoxBody<Bytes, BoxError>;
/// Response body type used by the test upstream.
type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// Default deadline for a single client exchange; a hang fails the test
/// instead of hanging the suite.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;
