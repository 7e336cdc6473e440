//! Which path a connection takes. A client's connection is `Pending` until the server takes
//! its offer (ring) or declines it, or until the decision wait runs out (TCP, with the reason
//! recorded); the CAS on the offer decides a race between the server's accept and our cancel.

use super::Conn;
use crate::forklock::ForkMutex;
use crate::plain::PlainTcp;
use crate::real;
use libc::c_int;
use memloop::registry::{ChannelState, FallbackReason};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The path a connection's bytes take.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    /// Offer published, the server has not decided: no byte may move yet.
    Pending,
    Ring,
    Tcp,
    /// Switching to TCP: this side left its rings, the peer's side has not yet (only while
    /// a switch is under way, see `switch.rs`).
    Leaving,
    /// Coming back from TCP (`promote.rs`): writes go to the ring, reads still take the
    /// peer's last TCP bytes.
    Joining,
}

/// A [`Path`] readable without a lock on every data call, with a sticky mark once it was
/// `Ring`: such a connection is ours for good (its socket may hold doorbells), whatever
/// path a look at it happens to see.
pub(super) struct AtomicPath(AtomicU8);

const WAS_RING: u8 = 0x80;

impl AtomicPath {
    fn new(p: Path) -> Self {
        let a = AtomicPath(AtomicU8::new(0));
        a.store(p, Relaxed);
        a
    }
    pub(super) fn was_ring(&self) -> bool {
        self.0.load(Acquire) & WAS_RING != 0
    }
    pub(super) fn store(&self, p: Path, o: Ordering) {
        let mark = if p == Path::Ring { WAS_RING } else { 0 };
        // The closure always returns Some: this update cannot fail.
        let _ = self
            .0
            .fetch_update(o, Relaxed, |v| Some(v & WAS_RING | mark | p as u8));
    }
    pub(super) fn load(&self, o: Ordering) -> Path {
        match self.0.load(o) & !WAS_RING {
            0 => Path::Pending,
            1 => Path::Ring,
            3 => Path::Leaving,
            4 => Path::Joining,
            _ => Path::Tcp,
        }
    }
}

/// The decision's state.
pub(super) struct Decision {
    pub(super) path: AtomicPath,
    pub(super) resolving: ForkMutex<()>,
    pub(super) plain: ForkMutex<Option<Arc<PlainTcp>>>,
    pub(super) created: Instant,
    pub(super) decide_wait: Duration,
    /// The program's TCP_NODELAY, restored if the connection stays on TCP.
    pub(super) nodelay: AtomicI32,
    /// Watched by poll/select/epoll (or shared): never armed for a late ring.
    pub(super) no_late: AtomicBool,
}

impl Decision {
    pub(super) fn new(path: Path, decide_wait: Duration, nodelay: i32) -> Self {
        Decision {
            path: AtomicPath::new(path),
            resolving: ForkMutex::new(()),
            plain: ForkMutex::new(None),
            created: Instant::now(),
            decide_wait,
            nodelay: AtomicI32::new(nodelay),
            no_late: AtomicBool::new(false),
        }
    }
}

impl Conn {
    pub fn path(&self) -> Path {
        self.decision.path.load(Acquire)
    }

    /// The connection was on its ring at some point: every data call on it is ours to make
    /// (the kernel's would take doorbells for data), whatever its path is now.
    pub fn was_ring(&self) -> bool {
        self.decision.path.was_ring()
    }

    pub fn plain(&self) -> Option<Arc<PlainTcp>> {
        self.decision.plain.lock().clone()
    }

    /// Settles a pending client connection: `Ring` once the server accepted, `Tcp` if it
    /// declined or did not answer within `decide_wait`. With `wait == false` it only looks.
    pub fn resolve(&self, wait: bool) -> Path {
        let p = self.path();
        if p != Path::Pending {
            return p;
        }
        let _g = self.decision.resolving.lock();
        let deadline = self.decision.created + self.decision.decide_wait;
        let mut polls = 0u32;
        loop {
            let p = self.path();
            if p != Path::Pending {
                return p;
            }
            let reg = self.engine.registry();
            match reg.channel_state(self.ch) {
                Ok(ChannelState::Accepted) => {
                    // The server rang a doorbell if a sleeper in the kernel asked: ours to read.
                    if self.decide_word().map_or(true, |d| d.rang()) {
                        self.sleepers.owed.fetch_add(1, Relaxed);
                    }
                    self.decision.path.store(Path::Ring, Release);
                    tracing::debug!(ch = ?self.ch, "server accepted: ring");
                }
                Ok(ChannelState::Declined) => {
                    // Frees the declined slot; failing only means someone freed it already.
                    if let Err(e) = reg.cancel(self.ch, self.engine.me()) {
                        tracing::debug!(ch = ?self.ch, "freeing a declined offer: {e}");
                    }
                    self.to_tcp(FallbackReason::Declined);
                }
                Ok(ChannelState::Offered) if Instant::now() >= deadline => {
                    // The CAS decides: either our cancel wins or the server's accept did.
                    self.cancel_to_tcp();
                }
                Ok(ChannelState::Offered) if !wait => return Path::Pending,
                Ok(ChannelState::Offered) => {
                    polls += 1;
                    if polls < 200 {
                        std::thread::yield_now();
                    } else if self.sleep_for_decision() {
                        // Reset before any accept (listener closed, backlog dropped): TCP,
                        // where the program meets the kernel's error.
                        self.cancel_to_tcp();
                    }
                }
                Ok(state) => {
                    // Freed or reused under us (reclaimed as dead, or a buggy peer).
                    tracing::debug!(ch = ?self.ch, ?state, "offer in an unexpected state");
                    self.to_tcp(FallbackReason::Stale);
                }
                Err(e) => {
                    tracing::debug!(ch = ?self.ch, "offer unreadable: {e}");
                    self.to_tcp(FallbackReason::from_registry(&e));
                }
            }
        }
    }

    /// Sleeps up to 200 µs for the server's decision (its accept wakes it); true if the
    /// connection failed meanwhile. In our kernel on the decision word (a futex: the server
    /// sends no doorbell for it), else on the kernel socket, for the accept's doorbell.
    fn sleep_for_decision(&self) -> bool {
        let slice = Duration::from_micros(200);
        let decide = self.decide_word();
        if let Some(d) = decide.as_ref().filter(|_| self.peer.same_kernel) {
            let Some(v) = d.arm_futex() else {
                return false; // decided: look again
            };
            if memloop_shm::futex::try_wait(&d.0, v, slice) {
                return self.connection_failed(Duration::ZERO);
            }
        }
        if decide.is_some_and(|d| !d.expect_doorbell()) {
            return false;
        }
        self.connection_failed(slice)
    }

    /// Whether the connection failed before any accept (a reset: the listener closed, the
    /// backlog dropped it), waiting up to `wait` on the kernel socket (a doorbell ends it).
    fn connection_failed(&self, wait: Duration) -> bool {
        let r = real::wait_fd(self.kfd(), libc::POLLIN, Some(wait));
        matches!(r, Ok(ev) if ev & (libc::POLLERR | libc::POLLHUP) != 0)
    }

    /// Server, having accepted: wakes the client's sleepers for the decision — a doorbell
    /// byte if one sleeps in the kernel (always for a late ring's client, which sleeps on
    /// its TCP connection), a futex wake if one sleeps on the decision word.
    pub fn wake_after_accept(&self, late: bool) {
        let d = self.decide_word();
        if late || d.map_or(true, |d| d.rang()) {
            self.ring_doorbell();
        }
        if let Some(d) = d.filter(|d| d.futex_sleepers()) {
            memloop_shm::futex::wake(&d.0, u32::MAX);
        }
    }

    /// The channel's decision word (none for a connection without side words).
    pub(super) fn decide_word(&self) -> Option<&memloop::registry::DecideWord> {
        self.share.side_words.as_ref().map(|w| &w.decide)
    }

    /// Before a wait of the program's in the kernel (poll, select, epoll) on a connection
    /// still waiting for the decision: asks the server for a doorbell byte when it accepts.
    /// False if it decided already — no byte comes: resolve now instead of sleeping.
    pub fn expect_accept_bell(&self) -> bool {
        self.path() != Path::Pending || self.decide_word().map_or(true, |d| d.expect_doorbell())
    }

    /// Withdraws our offer — the CAS decides against the server's accept — and, if it went,
    /// stays on TCP (`Cancelled`), counted as a client that may look for a decline marker
    /// from before the withdrawal: a server that accepts right after it finds neither our
    /// offer nor our announced connect (withdrawn at the connect), and must still publish one.
    fn cancel_to_tcp(&self) {
        let looking = self
            .late_ring_possible()
            .then(|| crate::late::LookToken::take(&self.engine));
        if self
            .engine
            .registry()
            .cancel(self.ch, self.engine.me())
            .is_ok()
        {
            self.to_tcp_looking(FallbackReason::Cancelled, looking);
        }
    }

    pub(super) fn to_tcp(&self, reason: FallbackReason) {
        self.to_tcp_looking(reason, None);
    }

    fn to_tcp_looking(&self, reason: FallbackReason, looking: Option<crate::late::LookToken>) {
        real::set_sockopt_int(
            self.kfd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            self.decision.nodelay.load(Relaxed),
        );
        let late = self
            .late_ring_possible()
            .then(|| crate::late::Late::client(&self.engine, self.tuple, reason, looking))
            .flatten();
        let plain = PlainTcp::record(&self.engine, &self.tuple, reason, None, late);
        *self.decision.plain.lock() = Some(plain);
        self.decision.path.store(Path::Tcp, Release);
        tracing::debug!(ch = ?self.ch, %reason, "connection stays on TCP");
    }

    /// Something watches the socket where a late ring could not follow (poll, select, epoll).
    pub fn no_late_ring(&self) {
        // (Every poll passes here: a write only the first time.)
        if !self.decision.no_late.load(Relaxed) {
            self.decision.no_late.store(true, Relaxed);
        }
    }

    /// Only this process holds the connection, by one fd, and nothing watches it.
    fn late_ring_possible(&self) -> bool {
        !self.decision.no_late.load(Relaxed)
            && !self.share.shared.load(Acquire)
            && self.fds.lock().len() == 1
    }

    /// A pending client connection closed before the decision: withdraw the offer.
    pub fn abandon(&self) {
        if self.path() == Path::Pending && self.still_shared() {
            // A forked copy (e.g. a child about to exec) closes its inherited fd: the offer is
            // the other holder's to settle; this process only stops holding its side.
            if let Some(w) = &self.share.side_words {
                w.holders.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
            tracing::debug!(ch = ?self.ch, "pending connection closed in a forked copy");
            return;
        }
        if self.path() == Path::Pending {
            let reg = self.engine.registry();
            if reg.cancel(self.ch, self.engine.me()).is_err() {
                // The server accepted meanwhile: close our side like a ring connection.
                self.decision.path.store(Path::Ring, Release);
                self.release();
            }
        }
    }

    /// TCP_NODELAY as the program set it (the kernel socket keeps it on for the doorbells).
    pub fn app_nodelay(&self) -> c_int {
        self.decision.nodelay.load(Relaxed)
    }

    pub fn set_app_nodelay(&self, v: c_int) {
        self.decision.nodelay.store(v, Relaxed);
    }
}
