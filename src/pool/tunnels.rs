//! The tunnels' sockets: a WebSocket (or any HTTP/1.1 upgrade) gets an upstream socket of its own, never pooled or
//! reused, counted by a second [`super::slots::Slots`] under `max_tunnels`, beside the connections' count: the
//! upstream never has more than `max_connections + max_tunnels` sockets from floodgate, and tunnels never take
//! from the pooled connections' cap. A tunnel's slot is given back the way a connection's is (the socket closed on
//! both sides first). Nobody waits for one: a tunnel may last hours, so one beyond the bound is refused at once.
//! It never relays bytes (`tunnel` does).

use std::sync::Arc;

use super::{Conn, Slot, UpstreamPool};
use crate::error::ProxyError;

impl UpstreamPool {
    /// The right to dial one tunnel's socket, if fewer than `max_tunnels` are open; never waits. A retired pool
    /// opens none (its routes are gone; requests routed to it before finish).
    pub fn tunnel_slot(self: &Arc<Self>) -> Option<Slot> {
        let mut state = self.lock();
        if state.retired {
            return None;
        }
        let issued = state.tunnels.issue()?;
        Some(Slot::issued(self.clone(), issued).for_tunnel())
    }

    /// Dials a tunnel's socket with `slot` (from [`Self::tunnel_slot`]): the endpoint chosen as for a connection,
    /// TLS for `https://`, within `connect_timeout`. The socket is closed completely before the slot goes back.
    pub async fn dial_tunnel(self: &Arc<Self>, slot: Slot) -> Result<Conn, ProxyError> {
        debug_assert!(slot.tunnel, "a tunnel dialled with a connection's slot");
        self.dial(slot).await
    }

    /// Tunnels open now, and the bound.
    pub fn tunnels(&self) -> (usize, usize) {
        let state = self.lock();
        (state.tunnels.open(), state.tunnels.cap())
    }
}
