//! An upgrade's path (a WebSocket): route → rewrite → a tunnel slot (never a wait) → its own socket dialled →
//! the upgrade sent → the `101` relayed to the client and the tunnel run, or the upstream's refusal answered. It
//! never touches the admission queue or a pooled connection: a tunnel's socket is counted under `max_tunnels`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Body;
use tokio::sync::oneshot;

use super::{Answer, Proxy};
use crate::body::ClientBody;
use crate::error::ProxyError;
use crate::forward::{self, ClientInfo, ResponseBody, UpstreamIncoming};
use crate::pool::{Conn, Slot, UpstreamPool};
use crate::record::Record;
use crate::route::{Picked, RouteSettings};
use crate::tunnel::{self, Handoff, Tunnel};

/// The most of an upstream's refusal of an upgrade (its `4xx` page) read and passed on; more is a `502`.
const MAX_REFUSAL_BYTES: usize = 64 * 1024;

/// Dials the tunnel's socket and sends the upgrade on it; the answer's head, or why there is none.
async fn open(
    pool: Arc<UpstreamPool>,
    slot: Slot,
    request: Request<forward::RequestBody>,
    limit: Duration,
    opened: oneshot::Sender<Result<(Conn, Response<UpstreamIncoming>), ProxyError>>,
) {
    let answered = async {
        let conn = pool.dial(slot).await?;
        let Some(wire) = conn.wire().cloned() else {
            return Err(ProxyError::TunnelsOff);
        };
        match tokio::time::timeout(limit, forward::send(&wire, Box::new(request))).await {
            // The socket (and its slot) goes to the closing task, which waits for the upstream's side.
            Err(_) => Err(ProxyError::UpstreamTimeout(limit)),
            Ok(Err(err)) => Err(err),
            // No body went with the upgrade, so nothing is left to upload.
            Ok(Ok((response, _))) => Ok((conn, response)),
        }
    };
    // Nobody waiting any more: what was opened is dropped, and closed.
    let _ = opened.send(answered.await);
}

impl Proxy {
    /// Serves a request that asks to switch to `upgrade` (see [`tunnel::asked`]).
    pub(super) async fn serve_tunnel(
        &self,
        mut request: Request<ClientBody>,
        client: &ClientInfo,
        pool: &Arc<UpstreamPool>,
        picked: &Picked,
        upgrade: HeaderValue,
        record: &mut Record,
    ) -> Answer {
        if pool.limits().max_tunnels == 0 {
            pool.metrics.tunnels_refused_off.inc();
            return Err(ProxyError::TunnelsOff);
        }
        // An extended CONNECT's stream is the tunnel itself, not a body.
        if !tunnel::extended_connect(&request) && !request.body().is_end_stream() {
            return Err(ProxyError::UpgradeWithBody);
        }
        let version = request.version();
        // hyper's HTTP/2 server hands the client's stream over through the request; floodgate's own HTTP/1 server
        // takes the tunnel from the answer instead (see `Handoff`).
        let on_upgrade = request.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
        let hold = request.extensions_mut().remove::<tunnel::Hold>();
        let upstream_request = forward::to_upstream(request, client, pool)?;
        let (mut parts, body) = (*upstream_request).into_parts();
        forward::drop_underscore_aliases(&mut parts.headers, &picked.settings.guarded_request);
        picked.settings.edit_request(&mut parts.uri, &mut parts.headers);
        let mut upstream_request = Request::from_parts(parts, body);
        tunnel::upstream_head(&mut upstream_request, upgrade.clone());
        // A tunnel may last hours: one beyond the bound is refused now rather than queued.
        let Some(slot) = pool.tunnel_slot() else {
            pool.metrics.tunnels_refused_limit.inc();
            return Err(ProxyError::TunnelLimit);
        };
        record.admitted(Some(std::time::Instant::now()));
        // Opened where the pool's connections run: a client that leaves meanwhile drops only the wait, and a
        // socket dialled for it is closed like any other (both sides) before its slot goes back.
        let (opened, opening) = oneshot::channel();
        let limit = picked.settings.request_timeout.unwrap_or(pool.limits().request_timeout);
        pool.spawn(open(pool.clone(), slot, upstream_request, limit, opened));
        let (conn, response) = opening.await.map_err(|_| ProxyError::Abandoned)??;
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            pool.metrics.tunnels_refused_upstream.inc();
            // Over HTTP/2 a success to CONNECT would itself open the tunnel, with nothing behind it.
            if version == http::Version::HTTP_2 && response.status().is_success() {
                let refused = ProxyError::UpstreamMalformed("a success without switching to a WebSocket");
                return Err(refused);
            }
            return refused_upgrade(pool, &picked.settings, response, conn).await;
        }
        // The socket (`conn`) is dropped with an error, and closed: it was switched to what nobody here speaks.
        let (status, mut headers) =
            tunnel::client_answer(response.headers(), &upgrade, version).map_err(ProxyError::UpstreamMalformed)?;
        picked.settings.edit_response(&mut headers);
        // The switch is the request's answer, counted now; its access-log line waits for the tunnel's end.
        let access = record.switched(status);
        pool.metrics.tunnels_opened.inc();
        let span = tracing::Span::current();
        let tunnel = Tunnel::new(conn, pool.clone(), access, self.tunnel_stop.clone(), span);
        let mut response = tunnel::switched_response(status, headers, ResponseBody::full(Bytes::new()));
        match on_upgrade {
            Some(on_upgrade) => {
                self.tunnels.spawn(async move {
                    match on_upgrade.await {
                        Ok(upgraded) => tunnel.run(hyper_util::rt::TokioIo::new(upgraded), Bytes::new()).await,
                        // The client's connection ended before the switch; the tunnel's socket closes.
                        Err(_) => tunnel.not_switched(),
                    }
                    drop(hold);
                });
            }
            None => {
                response.extensions_mut().insert(Handoff::new(tunnel));
            }
        }
        Ok(response)
    }
}

/// The upstream answered the upgrade without switching (a `400`, `403`, `426`…): its answer is passed on, read in
/// full first (it is a short page), and the socket closed: it was the tunnel's, not the pool's.
async fn refused_upgrade(
    pool: &UpstreamPool,
    route: &RouteSettings,
    response: Response<UpstreamIncoming>,
    conn: Conn,
) -> Answer {
    let (mut parts, body) = response.into_parts();
    let limits = pool.limits();
    let read = tokio::time::timeout(
        limits.body_idle_timeout,
        http_body_util::Limited::new(body, MAX_REFUSAL_BYTES).collect(),
    )
    .await;
    drop(conn);
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(_)) => {
            return Err(ProxyError::UpstreamMalformed(
                "an upgrade's refusal that could not be read whole",
            ))
        }
        Err(_) => return Err(ProxyError::UpstreamTimeout(limits.body_idle_timeout)),
    };
    forward::strip_hop_by_hop(&mut parts.headers);
    route.edit_response(&mut parts.headers);
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.version = Version::HTTP_11;
    // Counted with its bytes when its record is finished, as an answer in memory is.
    Ok(Response::from_parts(parts, ResponseBody::full(bytes)))
}
