//! What a connection knows of its peer: closed (its kernel socket is gone, or its side of the
//! channel), reset, alive. Liveness itself is `memloop::channel::PeerWatch`'s.

use super::{Conn, Path};
use memloop::channel::PeerWatch;
use std::sync::atomic::{AtomicBool, Ordering::*};

pub(super) struct PeerState {
    pub(super) watch: PeerWatch,
    /// The peer runs in our kernel: its death closes the kernel socket.
    pub(super) same_kernel: bool,
    pub(super) peer_closed: AtomicBool,
    /// The peer's socket was reset: after the ring drains, one ECONNRESET, then EOF (when
    /// the reset was not only about doorbells left unread, see `io::reset_of`).
    pub(super) peer_reset: AtomicBool,
    /// The peer in another kernel was judged dead (a powered-off VM): its stream ends with a
    /// reset unless it had shut its ring end cleanly.
    pub(super) peer_dead: AtomicBool,
    pub(super) reset_reported: AtomicBool,
}

impl PeerState {
    pub(super) fn new(watch: PeerWatch, same_kernel: bool) -> Self {
        PeerState {
            watch,
            same_kernel,
            peer_closed: AtomicBool::new(false),
            peer_reset: AtomicBool::new(false),
            peer_dead: AtomicBool::new(false),
            reset_reported: AtomicBool::new(false),
        }
    }
}

impl Conn {
    pub fn peer_closed(&self) -> bool {
        self.peer.peer_closed.load(Acquire)
    }

    /// The peer's kernel socket is gone: every process holding that end closed it or died,
    /// so its side of the channel can be released even if its holder count says otherwise.
    pub fn set_peer_closed(&self) {
        if !self.peer.peer_closed.swap(true, AcqRel) {
            tracing::debug!(ch = ?self.ch, "peer's socket closed");
            let reg = self.engine.registry();
            if let Err(e) = reg.peer_socket_closed(self.ch, self.side) {
                tracing::debug!(ch = ?self.ch, "marking the peer's side closed: {e}");
            }
        }
    }

    /// Whether the peer is in another kernel (a VM): only its heartbeat says it is gone.
    pub fn peer_elsewhere(&self) -> bool {
        !self.peer.same_kernel
    }

    /// For poll and epoll after an idle slice: a peer in another kernel may have vanished.
    pub fn watch_peer(&self) {
        if !self.peer.same_kernel && self.path() == Path::Ring {
            self.check_peer();
        }
    }

    /// Notes a peer that closed its end or died. In our kernel its death closes the kernel
    /// socket too; across kernels nothing tells a powered-off VM's peer but the VM's heartbeat,
    /// and the connection ends as TCP's would once it gave up: reset.
    pub(super) fn check_peer(&self) {
        let w = &self.peer.watch;
        if !self.peer.same_kernel && w.dead() {
            self.peer.peer_dead.store(true, Release);
            self.set_peer_closed();
        } else if w.gone() {
            self.set_peer_closed();
        }
    }
}
