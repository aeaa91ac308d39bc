//! The request's edges: the proxy as a `tower::Service` for one client connection, and the request ID every
//! request gets around it. An `X-Request-Id` (a trusted peer's kept, any other's replaced by one made here) is set
//! on the request, so it goes upstream and into the access log and the request's span, and returned on the
//! answer. The steps themselves, the request's span and its record are the proxy's ([`crate::proxy`]); the
//! span is entered here, around the whole of the request's future, and stays open until the response's last
//! byte; a panic in that future is caught here and answered by the proxy. It never routes, admits or answers
//! anything itself.
//!
//! Request IDs are set and returned here rather than by tower-http's `SetRequestId` and `PropagateRequestId`: their
//! two layers, a future each and an extension map per request cost more than the header read, made and copied that
//! they do (docs/data-path.md has the count).

use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use tower::Service;
use tracing::Instrument;

use crate::activity::ClientActivity;
use crate::body::ClientBody;
use crate::forward::{ClientInfo, ResponseBody};
use crate::proxy::{Arrival, Proxy};

use crate::access::X_REQUEST_ID;

/// The stack one client connection's requests go through; `activity`, when the connection's deadlines need it
/// (hyper's HTTP/2 server), counts them in flight on that connection.
pub(crate) fn stack(
    proxy: Arc<Proxy>,
    client: Arc<ClientInfo>,
    activity: Option<Arc<ClientActivity>>,
) -> impl Service<Request<ClientBody>, Response = Response<ResponseBody>, Error = Infallible, Future: Send> + Clone {
    ProxyService {
        proxy,
        client,
        activity,
    }
}

static PREFIX: LazyLock<String> = LazyLock::new(|| {
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    format!("{random:016x}-")
});
static NEXT: AtomicU64 = AtomicU64::new(1);

/// A request ID: this process's random prefix and a counter, in hex (`3f9c0e7a1b2d4c5e-1a`): unique across
/// restarts and replicas without a clock or a random number per request. Written by hand: `format!` cost 600
/// instructions a request. The bytes are one shared allocation: the ID goes on the request and back on the answer,
/// and a value copied from a slice would be copied again into a shared one at its first clone.
fn make_id() -> Option<HeaderValue> {
    let mut id = IdBytes {
        bytes: [0u8; ID_ROOM],
        len: 0,
    };
    let prefix = PREFIX.as_bytes();
    let counter = NEXT.fetch_add(1, Ordering::Relaxed);
    let digits = (u64::BITS - counter.leading_zeros()).div_ceil(4).max(1) as usize;
    let len = prefix.len() + digits;
    let (head, tail) = id.bytes.get_mut(..len)?.split_at_mut(prefix.len());
    head.copy_from_slice(prefix);
    for (place, digit) in tail.iter_mut().rev().enumerate() {
        let nibble = ((counter >> (4 * place)) & 0xf) as u32;
        *digit = char::from_digit(nibble, 16)
            .and_then(|c| u8::try_from(c).ok())
            .unwrap_or(b'0');
    }
    id.len = len;
    HeaderValue::from_maybe_shared(Bytes::from_owner(id)).ok()
}

/// Room for an ID: the prefix's 17 bytes and a counter's 16 hex digits at most.
const ID_ROOM: usize = 40;

/// An ID's bytes, owned by the one allocation its `Bytes` and their clones share.
struct IdBytes {
    bytes: [u8; ID_ROOM],
    len: usize,
}

impl AsRef<[u8]> for IdBytes {
    fn as_ref(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }
}

/// The request's ID, set on it: a trusted peer's own, else one made here (an ID from a peer that is not trusted
/// could be chosen to collide with another request's).
fn set_request_id(request: &mut Request<ClientBody>, trusted: bool) -> Option<HeaderValue> {
    let headers = request.headers_mut();
    if trusted {
        if let Some(id) = headers.get(X_REQUEST_ID) {
            return Some(id.clone());
        }
    }
    // An untrusted peer's ID is replaced: `insert` drops every value the name had.
    let Some(id) = make_id() else {
        headers.remove(X_REQUEST_ID);
        return None;
    };
    headers.insert(X_REQUEST_ID, id.clone());
    Some(id)
}

/// The proxy as a service, for one client connection.
#[derive(Clone)]
struct ProxyService {
    proxy: Arc<Proxy>,
    client: Arc<ClientInfo>,
    activity: Option<Arc<ClientActivity>>,
}

impl Service<Request<ClientBody>> for ProxyService {
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<ClientBody>) -> Self::Future {
        let id = set_request_id(&mut request, self.client.trusted);
        let in_flight = self.activity.as_ref().map(ClientActivity::request_started);
        let Arrival {
            routed,
            upgrade,
            mut record,
            span,
        } = self.proxy.arrive(&mut request, &self.client, in_flight, id.as_ref());
        let (proxy, client) = (self.proxy.clone(), self.client.clone());
        // The serving future is made inside the box: an async future held across an await is stored twice, and
        // moving kilobytes of it into the box costs more than the request's own work. The record stays outside
        // it, so a panic in it leaves the record to be finished by the `500` that answers it.
        boxed!(async move {
            // Polled where it was made: wrapped in `catch_unwind`'s future, its kilobytes moved twice more.
            let served = {
                let mut serving = std::pin::pin!(proxy.serve_routed(request, &client, routed, upgrade, &mut record));
                std::future::poll_fn(|cx| {
                    match std::panic::catch_unwind(AssertUnwindSafe(|| serving.as_mut().poll(cx))) {
                        Ok(Poll::Pending) => Poll::Pending,
                        Ok(Poll::Ready(answer)) => Poll::Ready(Ok(answer)),
                        Err(panic) => Poll::Ready(Err(panic)),
                    }
                })
                .await
            };
            let mut answered = proxy.answer(served.map_err(drop), record);
            // The answer carries the request's ID back, unless the upstream set its own.
            if let Some(id) = id {
                if let http::header::Entry::Vacant(place) = answered.headers_mut().entry(X_REQUEST_ID) {
                    place.insert(id);
                }
            }
            Ok(answered)
        }
        .instrument(span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_unique_and_valid_header_values() {
        let ids: std::collections::HashSet<_> = (0..1000).filter_map(|_| make_id()).collect();
        assert_eq!(ids.len(), 1000);
    }

    #[test]
    fn a_request_id_is_the_process_prefix_and_the_counter_in_hex() {
        let ids: Vec<String> = (0..20)
            .filter_map(|_| make_id())
            .filter_map(|id| id.to_str().ok().map(str::to_owned))
            .collect();
        assert_eq!(ids.len(), 20);
        for id in &ids {
            let (prefix, counter) = id.split_once('-').expect("a dash between prefix and counter");
            assert_eq!(prefix.len(), 16, "{id}");
            assert!(u64::from_str_radix(prefix, 16).is_ok(), "{id}");
            let value = u64::from_str_radix(counter, 16).expect("the counter in hex");
            assert_eq!(format!("{value:x}"), counter, "no leading zero, every digit");
        }
    }
}
