//! The tunnels' sockets: a WebSocket (or any HTTP/1.1 upgrade) gets an upstream socket of its own, never pooled or
//! reused, counted by a second [`Slots`] under `max_tunnels`, beside the connections' count: the upstream never has
//! more than `max_connections + max_tunnels` sockets from floodgate, and tunnels never take from the pooled
//! connections' cap. A tunnel's slot is given back the way a connection's is (the socket closed on both sides
//! first). The count is shared with the pool a reload replaces under the same name, whose tunnels run on until they
//! end: they count against the new pool's bound. Nobody waits for a tunnel: it may last hours, so one beyond the
//! bound is refused at once. It never relays bytes (`tunnel` does).

use std::sync::{Arc, Mutex, MutexGuard};

use super::slots::{ClosingMark, Slots};
use super::{Slot, UpstreamPool};

/// The tunnels open to an upstream, and its bound, across the pools a reload replaces.
pub(crate) struct TunnelCount {
    /// Not counted at endpoints: an endpoint's own cap bounds its pooled connections only.
    slots: Mutex<Slots>,
}

impl TunnelCount {
    pub(super) fn new(bound: usize) -> TunnelCount {
        TunnelCount {
            slots: Mutex::new(Slots::new(bound, [usize::MAX])),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // Each move is one statement on the counts: a poisoned lock is still consistent.
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn set_bound(&self, bound: usize) {
        self.lock().set_configured(bound);
    }

    pub(super) fn bound(&self) -> usize {
        self.lock().cap()
    }

    pub(super) fn take_back(&self, closing: Option<&ClosingMark>) {
        self.lock().take_back(None, closing);
    }
}

impl UpstreamPool {
    /// The right to dial one tunnel's socket, if fewer than `max_tunnels` are open; never waits. A retired pool
    /// opens none (its routes are gone; requests routed to it before finish).
    pub fn tunnel_slot(self: &Arc<Self>) -> Option<Slot> {
        let mut state = self.lock();
        if state.retired {
            return None;
        }
        let issued = self.tunnel_count.lock().issue()?;
        state.tunnels_open += 1;
        drop(state);
        Some(Slot::issued(self.clone(), issued).for_tunnel())
    }
}
