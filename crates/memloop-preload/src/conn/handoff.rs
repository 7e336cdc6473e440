//! A switched connection handed to another process with `SCM_RIGHTS`, and brought back to its
//! ring there when that process runs the library too.
//!
//! The sender demotes the connection before the message goes (the receiver may run anything),
//! then takes one more hold on its side for the fd in flight (`SideWords::handoffs`): a sender
//! that closes its copy at once must not release the side before the receiver looks. A
//! preloaded receiver finds the channel by the socket's 4-tuple, takes that hold over, makes
//! the side its member's (the sender's exit must not read as the side's death), and asks for
//! a promotion once it is the side's only holder. Its TCP phase is counted from the kernel's
//! own stream positions, recorded at the switch: exact whatever the sender (or anyone) did
//! with the socket in between. A hold nobody claims is given back after [`CLAIM_TIME`], and
//! the connection is pinned to TCP for good: a program we cannot see may hold the socket.
//!
//! An exec works the same way within one process: a switched connection's hold passes to the
//! next image if it loads the library (its constructor adopts the socket), else the
//! connection is pinned and the hold released.

use super::{Conn, ConnParts, Path};
use crate::agree::canonical;
use crate::forklock::ForkMutex;
use crate::plain::PlainTcp;
use crate::real;
use crate::table::{self, Entry};
use libc::c_int;
use memloop::registry::{ChannelId, ChannelState, ConnTuple, Side, SideWords, SwitchReason};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an fd sent with `SCM_RIGHTS` may stay unclaimed before its hold is given back.
const CLAIM_TIME: Duration = Duration::from_secs(10);

/// Holds this process took for fds it sent, not yet known to be claimed.
static IN_FLIGHT: ForkMutex<Vec<(Arc<Conn>, Instant)>> = ForkMutex::new(Vec::new());

/// Holds this image hands to the next one at exec (taken back if the exec fails).
static EXEC_HOLDS: ForkMutex<Vec<Arc<Conn>>> = ForkMutex::new(Vec::new());

/// Before `SCM_RIGHTS` carries `c` (already on TCP after its switch): its re-send finished,
/// and one hold for the fd in flight.
pub fn hand_off(c: &Arc<Conn>) {
    let Some(w) = &c.share.side_words else { return };
    if c.path() != Path::Tcp || !c.switched() {
        return;
    }
    if let Some(p) = c.plain() {
        p.before_send(); // the receiver's positions must include every re-sent byte
    }
    c.mark_shared();
    w.holders.fetch_add(1, AcqRel);
    add_one(&w.handoffs, c.ch);
    IN_FLIGHT.lock().push((c.clone(), Instant::now()));
    tracing::debug!(ch = ?c.ch, side = ?c.side, "fd in flight: side held for its receiver");
}

/// Before an exec into an image that loads the library: this image's hold on a switched
/// connection becomes the new image's, which adopts it from its constructor
/// ([`adopt_after_exec`]) and brings it back to its ring once it holds it alone. (Released
/// instead, the side would look unheld while the new image uses the socket.)
pub fn hand_to_next_image(c: &Arc<Conn>) {
    let Some(w) = &c.share.side_words else { return };
    if c.path() != Path::Tcp || !c.switched() {
        return;
    }
    c.mark_shared();
    add_one(&w.handoffs, c.ch);
    EXEC_HOLDS.lock().push(c.clone());
    tracing::debug!(ch = ?c.ch, side = ?c.side, "switched connection handed to the next image");
}

/// The exec failed: the holds handed to the next image are this image's again.
pub fn take_back_exec_holds() {
    for c in EXEC_HOLDS.lock().drain(..) {
        if let Some(w) = &c.share.side_words {
            take_one(&w.handoffs, c.ch);
        }
    }
}

/// A hold of ours claimed by this process itself: nothing left to give back for it.
fn claimed_here(c: &Arc<Conn>) {
    let mut v = IN_FLIGHT.lock();
    if let Some(i) = v.iter().position(|(x, _)| Arc::ptr_eq(x, c)) {
        v.remove(i);
    }
}

/// Gives back the holds of fds nobody claimed in time (heartbeat).
pub fn expire_handoffs() {
    let now = Instant::now();
    let expired: Vec<Arc<Conn>> = {
        let mut v = IN_FLIGHT.lock();
        let (old, young) = v.drain(..).partition(|(_, t)| now - *t >= CLAIM_TIME);
        *v = young;
        old.into_iter().map(|(c, _)| c).collect()
    };
    for c in expired {
        c.give_back_handoff();
    }
}

/// In a fork child: the parent's fds in flight are the parent's to account for.
pub fn forget_in_child() {
    IN_FLIGHT.lock().clear();
    EXEC_HOLDS.lock().clear();
}

pub fn lock_for_fork() {
    fn busy<T>(v: &[T]) {
        if !v.is_empty() {
            crate::dispatch::child_needs_engine();
        }
    }
    IN_FLIGHT.acquire_for_fork(|v| busy(v));
    EXEC_HOLDS.acquire_for_fork(|v| busy(v));
}

pub fn release_after_fork() {
    EXEC_HOLDS.release_after_fork();
    IN_FLIGHT.release_after_fork();
}

/// The in-flight holds word (`SideWords::handoffs`): their count in the low 16 bits, tagged
/// with the low 16 bits of the channel's generation in the high ones. The slot's words are
/// zeroed for each new channel, and a take by a process that still knows a former channel of
/// the slot (its record outlived that channel) finds another tag and takes nothing.
const COUNT_MASK: u32 = 0xffff;

fn tag_of(ch: ChannelId) -> u32 {
    ch.gen << 16
}

/// One more hold in flight for channel `ch`.
fn add_one(n: &memloop::registry::ShmU32, ch: ChannelId) {
    let tag = tag_of(ch);
    let _ = n.fetch_update(AcqRel, Acquire, |v| {
        let count = if v & !COUNT_MASK == tag {
            v & COUNT_MASK
        } else {
            0
        };
        Some(tag | (count + 1).min(COUNT_MASK))
    });
}

/// One hold in flight for channel `ch` less, if it has one; whether it took one.
fn take_one(n: &memloop::registry::ShmU32, ch: ChannelId) -> bool {
    let tag = tag_of(ch);
    n.fetch_update(AcqRel, Acquire, |v| {
        (v & !COUNT_MASK == tag && v & COUNT_MASK > 0).then(|| v - 1)
    })
    .is_ok()
}

impl Conn {
    /// An unclaimed in-flight hold goes; with it the side, if it was the last.
    fn give_back_handoff(&self) {
        let Some(w) = &self.share.side_words else {
            return;
        };
        // Claimed elsewhere and closed since, the channel may be freed and its slot reused:
        // its words are another connection's then (a take here pinned that connection and
        // took one of its holders). The tagged take fails there; once it succeeded, our own
        // holder count keeps the side (and the slot) ours.
        if !take_one(&w.handoffs, self.ch) {
            return; // claimed
        }
        // Nobody preloaded took it: a program we cannot see may hold the socket now.
        self.pin_for_good("fd sent with SCM_RIGHTS never claimed");
        tracing::debug!(ch = ?self.ch, "fd sent with SCM_RIGHTS never claimed: hold given back");
        if w.holders.fetch_sub(1, AcqRel) == 1 {
            self.close_side("switched side closed (fd never claimed)");
        }
    }

    /// After adoption, once this process holds the side alone: ask for the promotion.
    pub(super) fn promote_when_alone(&self) {
        if !self.switching.auto_promote.load(Acquire) || self.path() != Path::Tcp {
            return;
        }
        if self.still_shared() || !self.region_open() || !self.engine.cfg.promote {
            return;
        }
        if self.words().is_some_and(|(w, _)| w.switch.pinned()) {
            self.switching.auto_promote.store(false, Release);
            return;
        }
        if real::queued(self.kfd()) != Some(0) && !self.reading_since_last_look() {
            // Unread bytes: a program that holds the connection without reading it (a
            // dispatcher passing it on) would leave the promotion half-way (our reads on TCP
            // up to the peer's stop), where a handoff must carry those bytes through the
            // ring — and fails (EBUSY) when they do not fit. Not worth it for a promotion
            // nobody asked for: asked once it reads (a busy reader may never find its
            // socket empty at a heartbeat, so reading since the last look is enough).
            return;
        }
        let Some(w) = &self.share.side_words else {
            return;
        };
        if w.switch.request_promote() {
            self.switching.auto_promote.store(false, Release);
            tracing::debug!(ch = ?self.ch, "adopted connection: promotion asked");
            self.tell_peer();
        } else if w.switch.promote_requested() {
            self.switching.auto_promote.store(false, Release); // someone asked already
        }
        // Otherwise the peer's side is not on TCP yet (its own switch for the handoff is
        // still under way: a kicked sweep can come that soon): asked at a later sweep.
    }

    /// Whether this process received on the connection since the sweep last found unread
    /// bytes on it.
    fn reading_since_last_look(&self) -> bool {
        let now = self.tcp.received.load(Acquire);
        let before = self.switching.auto_promote_seen.swap(now, AcqRel);
        before != u64::MAX && before != now
    }

    /// The TCP phase of an adopted connection, from the kernel's positions (under both TCP
    /// gates: no send or read of ours in between); false to try again later. A position the
    /// kernel cannot tell pins the connection to TCP.
    pub(super) fn sync_tcp_counts(&self) -> bool {
        if !self.tcp.from_kernel.load(Acquire) {
            return true;
        }
        let Some(w) = &self.share.side_words else {
            return false;
        };
        let Some(_g) = self.tcp.gate.try_lock() else {
            return false; // a send of ours is under way (maybe blocked): later
        };
        let _r = self.tcp.read_gate.lock();
        let base = (
            w.tcp_base_written.load(Acquire),
            w.tcp_base_read.load(Acquire),
        );
        let counts = real::tcp_positions(self.kfd())
            .and_then(|(wr, rd)| Some((wr.checked_sub(base.0)?, rd.checked_sub(base.1)?)));
        let Some((sent, received)) = counts.filter(|_| base.0 != u64::MAX) else {
            self.pin_to_tcp("stream positions unknown");
            return false;
        };
        self.tcp.sent.store(sent, Release);
        self.tcp.received.store(received, Release);
        self.tcp.from_kernel.store(false, Release);
        tracing::debug!(ch = ?self.ch, sent, received, "TCP phase counted from the kernel");
        true
    }
}

/// After `recvmsg` delivered `fds` with `SCM_RIGHTS`: any of them that is the switched
/// connection of a channel with a hold in flight becomes ours.
pub fn adopt_received(fds: &[c_int]) {
    for &fd in fds {
        if table::kind(fd) == table::K_NONE || table::kind(fd) == table::K_TCP {
            adopt(fd, SwitchReason::FdPassed);
        }
    }
}

/// From the constructor of an image started by exec: an inherited socket that is the
/// switched connection of a channel whose previous image handed its hold on
/// ([`hand_to_next_image`]) becomes ours.
pub fn adopt_after_exec(fd: c_int) {
    adopt(fd, SwitchReason::Exec);
}

fn adopt(fd: c_int, how: SwitchReason) {
    let (Some(local), Some(peer)) = (real::local_addr(fd), real::peer_addr(fd)) else {
        return;
    };
    let Some(engine) = crate::engine::get() else {
        return;
    };
    let (local, peer) = (canonical(local), canonical(peer));
    let reg = engine.registry();
    let Some((ch, side, tuple, owner)) = switched_channel(reg, local, peer) else {
        return;
    };
    let Ok(w) = reg.side_words(ch, side) else {
        return;
    };
    if let Some(c) = table::conns()
        .into_iter()
        .find(|c| c.ch == ch && c.side == side)
    {
        // Sent to ourselves (or back to us): one more fd for a connection we hold already.
        if c.kfd() >= 0 {
            table::duplicate(c.kfd(), fd);
            if take_one(&w.handoffs, ch) {
                w.holders.fetch_sub(1, AcqRel); // ours is still held by `c`
                claimed_here(&c);
            }
        }
        return;
    }
    if !take_one(&w.handoffs, ch) {
        return; // no fd of this side in flight: not ours to take
    }
    if let Err(e) = reg.transfer_side(ch, side, owner, engine.me()) {
        tracing::debug!(fd, ?ch, %e, "received connection stays on TCP (side not movable)");
        give_back(&engine, ch, side, &w);
        return;
    }
    match Conn::new(ConnParts::found(&engine, ch, side, tuple, fd)) {
        Ok(c) => {
            c.adopted_on_tcp(how);
            tracing::debug!(fd, ?ch, ?side, %how, "switched connection adopted");
            table::insert(fd, Entry::Conn(c));
        }
        Err(reason) => {
            tracing::debug!(fd, ?ch, %reason, "received connection stays on TCP");
            give_back(&engine, ch, side, &w);
        }
    }
}

/// The hold taken for an adoption that did not happen.
fn give_back(engine: &crate::engine::Engine, ch: ChannelId, side: Side, w: &SideWords) {
    if w.holders.fetch_sub(1, AcqRel) == 1 {
        memloop::channel::release(engine.registry(), ch, side);
    }
}

/// The accepted channel whose connection this socket is, with our side switched to TCP: its
/// id, our side, its tuple and the member that owns our side.
fn switched_channel(
    reg: &memloop::registry::Registry,
    local: std::net::SocketAddr,
    peer: std::net::SocketAddr,
) -> Option<(ChannelId, Side, ConnTuple, memloop::registry::MemberId)> {
    reg.channels().into_iter().find_map(|c| {
        if c.state != ChannelState::Accepted || c.marker {
            return None;
        }
        let side = super::side_of_socket(&c, local, peer)?;
        let owner = match side {
            Side::Client => c.client,
            Side::Server => c.server?,
        };
        let on_tcp = reg.switch_word(c.id).is_ok_and(|w| w.on_tcp(side));
        on_tcp.then_some((c.id, side, c.tuple?, owner))
    })
}

impl Conn {
    /// A connection that fell back to TCP at connect, now holding the late-ring channel `ch`
    /// (`crate::late`): switched to TCP (sticky ring mark), its TCP phase the whole stream so
    /// far, counted from the kernel's positions from `base_written` (the client's SYN counts
    /// one) and 0. The channel's word already asks for the promotion.
    pub fn late(
        engine: &Arc<crate::engine::Engine>,
        ch: ChannelId,
        side: Side,
        tuple: ConnTuple,
        fd: c_int,
        nodelay: c_int,
    ) -> Result<Arc<Conn>, memloop::registry::FallbackReason> {
        let c = Conn::new(ConnParts::found(engine, ch, side, tuple, fd))?;
        let Some(w) = &c.share.side_words else {
            return Err(memloop::registry::FallbackReason::Error);
        };
        let base_written = u64::from(side == Side::Client);
        w.tcp_base_written.store(base_written, Release);
        w.tcp_base_read.store(0, Release);
        c.decision.nodelay.store(nodelay, Relaxed);
        c.tcp.restart(0);
        c.on_tcp_counted_by_kernel(SwitchReason::Late);
        Ok(c)
    }

    /// Switched to TCP for `how`, its TCP phase counted from the kernel's positions: ours for
    /// good (sticky ring mark), the program's TCP_NODELAY on the socket, recorded for
    /// `memloop status`.
    fn on_tcp_counted_by_kernel(&self, how: SwitchReason) {
        real::set_sockopt_int(
            self.kfd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            self.decision.nodelay.load(Relaxed),
        );
        self.tcp.from_kernel.store(true, Release);
        let plain = PlainTcp::switched(&self.engine, &self.tuple, how, 0, None);
        *self.decision.plain.lock() = Some(plain);
        self.switching.handled.store(true, Release);
        self.decision.path.store(Path::Tcp, Release);
    }

    /// A connection adopted on TCP after its switch elsewhere: ours for good (sticky ring
    /// mark), switched, shared until the sender lets go, counted from the kernel.
    pub(super) fn adopted_on_tcp(&self, how: SwitchReason) {
        self.mark_shared();
        self.on_tcp_counted_by_kernel(how);
        self.switching.auto_promote.store(true, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_take_for_a_former_channel_of_the_slot_takes_nothing() {
        let mem = memloop_shm::ShmSlice::new_heap(8);
        let n = mem.u32_at(0).unwrap();
        let (old, new) = (ChannelId { idx: 3, gen: 5 }, ChannelId { idx: 3, gen: 6 });
        add_one(&n, old);
        assert!(take_one(&n, old));
        assert!(!take_one(&n, old), "none left");
        n.store(0, Relaxed); // the slot's words, zeroed for its next channel
        add_one(&n, new);
        assert!(
            !take_one(&n, old),
            "the former channel's record took the new one's hold"
        );
        assert!(take_one(&n, new));
        // A word left by a former channel does not count for the new one.
        add_one(&n, old);
        add_one(&n, new);
        assert!(take_one(&n, new));
        assert!(!take_one(&n, new));
    }
}
