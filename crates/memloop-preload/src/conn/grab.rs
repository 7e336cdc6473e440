//! `pidfd_getfd`: another process's fd duplicated into this one. It is a pure dup into the
//! caller: the process that holds the fd hears nothing of it. For a ring connection's socket
//! that is data loss — the caller's reads see doorbells or nothing (the data is in the ring),
//! its writes go on TCP where the peer takes them for doorbells — so before the fd reaches
//! the program the connection leaves its ring, and this process adopts it on TCP like an fd
//! received with `SCM_RIGHTS` (`handoff.rs`): switched, its side shared and moved to our
//! member (a takeover: the holder may exit), its TCP phase counted from the kernel's stream
//! positions, brought back to its ring once we hold it alone.
//!
//! The holder (A) was not told: it believes it holds the side alone, counts its TCP phase
//! itself (missing our bytes) and would follow a promotion. So:
//! - our *hold* is counted in the side's `holders` as any holder's, and a holder that is not
//!   shared (A) looks at that count too: its close leaves the side to us, and it gets ready
//!   for a promotion only while nobody else holds the side;
//! - a *grab* is counted in the switch word while we take the socket and for as long as we
//!   hold it (until we close, or hold it alone): no side stops writing TCP meanwhile, so any
//!   promotion can be called off — A may have looked at the holders just before our hold;
//! - the side is marked *kernel counts*: a holder left alone later (A, or us) takes its
//!   counts from the kernel's positions before it gets ready (A's own miss our bytes);
//! - when we let go first, the side goes back to A's member.
//!
//! Steps, all within `MEMLOOP_PIDFD_WAIT_US` (2 s):
//! 1. the connection, by the socket's 4-tuple: none, the fd passes through (one getsockopt
//!    for anything that is not a connected inet stream socket); a client's offer the server
//!    has not decided is waited for; a late ring under way (`late.rs`, never on its ring yet)
//!    is pinned to TCP for good, and a connection that fell back at connect gets the server's
//!    decline marker pinned (no late ring for it): both pass through then;
//! 2. the grab counted (if a side stopped already, that promotion completes first), a
//!    promotion under way called off;
//! 3. the demote asked (switch reason `pidfd`, counted once), both holders' heartbeats
//!    kicked (again, less and less often, while we wait);
//! 4. our side on TCP: our hold taken, and its re-send of what the peer never consumed out —
//!    the kernel's count of bytes written since the switch reaches it — before anything of
//!    ours can follow it on the socket.
//!
//! If that cannot complete in time (the holder stuck, a peer gone before it left its ring)
//! the call fails and the fd is closed: the caller gets `EAGAIN` (the demote stays asked: a
//! later call may succeed), `EBUSY` (the connection can only end on its ring) or `EBADF`
//! (its holder closed it on its ring meanwhile). Never a socket whose bytes are in a ring.
//! Refusals are counted (`pidfd_failed` in `memloop status`).

use super::{Conn, ConnParts};
use crate::agree::canonical;
use crate::engine::Engine;
use crate::real;
use crate::table::{self, Entry};
use libc::c_int;
use memloop::registry::{
    ChannelId, ChannelState, ConnTuple, MemberId, Registry, Side, SideWords, SwitchReason,
};
use memloop_ring::leave::LeaveCell;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest sleep between two looks at the channel (the switch bell cuts it short).
const LOOK_EVERY: Duration = Duration::from_millis(1);

/// Longest pause between two kicks of the holders' heartbeats.
const KICK_EVERY_MAX: Duration = Duration::from_millis(50);

/// Why a grab was refused (the errno the caller gets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refused {
    /// Not on TCP in time; the demote stays asked.
    Timeout,
    /// The connection can only end on its ring (its peer left the region without leaving
    /// the ring), or its switch state cannot be read.
    Stuck,
    /// Its holder closed it on its ring meanwhile.
    Closed,
}

impl Refused {
    fn errno(self) -> c_int {
        match self {
            Refused::Timeout => libc::EAGAIN,
            Refused::Stuck => libc::EBUSY,
            Refused::Closed => libc::EBADF,
        }
    }
}

/// After `pidfd_getfd` gave this process `fd`: `Err(errno)` if the program must not get it
/// (the caller closes it). Anything that is not a connected inet stream socket costs one
/// `getsockopt`.
pub fn after_getfd(fd: c_int) -> Result<(), c_int> {
    if table::kind(fd) != table::K_NONE {
        // A number we still knew: its close escaped us, and the kernel gave it out again.
        table::remove(fd);
    }
    if crate::engine::disabled() || !connected_tcp(fd) {
        return Ok(());
    }
    let (Some(local), Some(peer)) = (real::local_addr(fd), real::peer_addr(fd)) else {
        return Ok(());
    };
    let Some(engine) = crate::engine::get() else {
        return Ok(());
    };
    let (local, peer) = (canonical(local), canonical(peer));
    let reg = engine.registry();
    let deadline = Instant::now() + engine.cfg.pidfd_wait;
    let r = loop {
        match lookup(reg, local, peer) {
            Lookup::Channel(f) => break take(&engine, &f, fd, deadline),
            Lookup::Plain => {
                // Not a connection the region carries: a plain socket — unless its holders
                // could still bring it to a late ring.
                crate::late::taken_elsewhere(reg, local, peer);
                break Ok(());
            }
            Lookup::LateRing(ch) if pin_late_ring(reg, ch) => {
                crate::late::taken_elsewhere(reg, local, peer);
                break Ok(());
            }
            // A client's offer the server has not decided yet, or a late ring's promotion
            // past its stop (then a ring connection): look again.
            Lookup::Deciding | Lookup::LateRing(_) if Instant::now() < deadline => {
                std::thread::sleep(LOOK_EVERY);
            }
            Lookup::Deciding | Lookup::LateRing(_) => break Err(Refused::Timeout),
        }
    };
    if let Err(why) = r {
        reg.count_pidfd_failed();
        tracing::warn!(
            fd,
            ?why,
            "pidfd_getfd refused: the connection could not leave its ring"
        );
    }
    r.map_err(Refused::errno)
}

/// An inet stream socket that is not listening (the kernel's own answer).
fn connected_tcp(fd: c_int) -> bool {
    let domain = real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN);
    if !matches!(domain, Some(libc::AF_INET) | Some(libc::AF_INET6)) {
        return false;
    }
    real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN) != Some(1)
}

/// The channel a socket is a connection of, and which side.
struct Found {
    ch: ChannelId,
    side: Side,
    tuple: ConnTuple,
    /// The member our side belongs to.
    owner: MemberId,
}

/// What the region knows of a socket's 4-tuple.
enum Lookup {
    /// An accepted channel: a ring connection, or one switched to TCP.
    Channel(Found),
    /// A connection that fell back at connect and is coming to a late ring: its channel
    /// (both sides still on TCP, the promotion asked).
    LateRing(ChannelId),
    /// A client's offer its server has not decided yet.
    Deciding,
    /// Nothing: a plain socket.
    Plain,
}

/// What the region knows of the socket with these (canonical) addresses. Our side of an
/// accepted channel may be closed already (its holder closed it after the dup): an open one
/// is preferred. A late-ring offer not taken yet is declined (no late ring for a socket taken
/// elsewhere).
fn lookup(reg: &Registry, local: SocketAddr, peer: SocketAddr) -> Lookup {
    let mut found = Lookup::Plain;
    for c in reg.channels().iter().filter(|c| !c.marker) {
        let Some(t) = c.tuple else { continue };
        let Some(side) = side_of(&t, local, peer) else {
            continue;
        };
        let late = reg
            .switch_word(c.id)
            .is_ok_and(|w| w.reason() == Some(SwitchReason::Late) && w.promote_requested());
        match c.state {
            ChannelState::Offered if late => {
                let _ = reg.decline(c.id);
            }
            ChannelState::Offered => {
                if matches!(found, Lookup::Plain) {
                    found = Lookup::Deciding;
                }
            }
            ChannelState::Accepted if late => return Lookup::LateRing(c.id),
            ChannelState::Accepted => {
                let owner = match side {
                    Side::Client => Some(c.client),
                    Side::Server => c.server,
                };
                let Some(owner) = owner else { continue };
                let f = Found {
                    ch: c.id,
                    side,
                    tuple: t,
                    owner,
                };
                let gone = match side {
                    Side::Client => c.client_closed || c.client_dead,
                    Side::Server => c.server_closed || c.server_dead,
                };
                if !gone {
                    return Lookup::Channel(f);
                }
                found = Lookup::Channel(f);
            }
            _ => {}
        }
    }
    found
}

/// A late ring under way for a socket taken elsewhere: pinned to TCP for good (it has never
/// been on its ring: its socket carries data only, and after the pin no promotion can stop
/// it). False if a side has stopped already: the promotion completes first (then a ring
/// connection).
fn pin_late_ring(reg: &Registry, ch: ChannelId) -> bool {
    let Ok(w) = reg.switch_word(ch) else {
        return true; // gone
    };
    // Counted as a grab, no side can stop: the call-off works, and the pin is set before
    // any stop.
    if !w.grab() {
        return false;
    }
    w.cancel_promotion();
    w.pin();
    w.ungrab();
    tracing::debug!(
        ?ch,
        "late ring pinned to TCP: its socket was taken with pidfd_getfd"
    );
    true
}

/// Which side of the connection `t` a socket with these (canonical) addresses is.
fn side_of(t: &ConnTuple, local: SocketAddr, peer: SocketAddr) -> Option<Side> {
    if t.client == local && t.server == peer {
        Some(Side::Client)
    } else if t.client == peer && t.server == local {
        Some(Side::Server)
    } else {
        None
    }
}

/// What the wait for the demote ended in.
enum Ready {
    /// On TCP, our hold and grab taken: adopt.
    Adopt,
    /// On TCP, its holder closed it meanwhile: nobody else holds it, a plain socket now.
    Plain,
}

/// Makes the connection of `fd` (found as `f`) safe for this process, and ours.
fn take(engine: &Arc<Engine>, f: &Found, fd: c_int, deadline: Instant) -> Result<(), Refused> {
    if let Some(c) = table::conns()
        .into_iter()
        .find(|c| c.ch == f.ch && c.side == f.side)
    {
        // Taken from ourselves: one more fd of a connection this process holds (its bytes
        // take our path, whatever it is), as `dup` gives.
        if c.kfd() >= 0 {
            table::duplicate(c.kfd(), fd);
        }
        return Ok(());
    }
    let reg = engine.registry();
    let (Ok(w), Ok(pw)) = (
        reg.side_words(f.ch, f.side),
        reg.side_words(f.ch, super::switch::other(f.side)),
    ) else {
        return Err(Refused::Stuck);
    };
    let mut g = Grab {
        reg,
        f,
        w: &w,
        pw: &pw,
        grabbed: false,
        held: false,
    };
    match g.wait(fd, deadline) {
        Ok(Ready::Adopt) => {
            g.adopt(engine, fd);
            Ok(())
        }
        Ok(Ready::Plain) => {
            g.undo();
            tracing::debug!(fd, ch = ?f.ch, "taken connection closed by its holder on TCP: plain");
            Ok(())
        }
        Err(why) => {
            g.undo();
            Err(why)
        }
    }
}

struct Grab<'a> {
    reg: &'a Registry,
    f: &'a Found,
    /// Our side's words, and the peer's.
    w: &'a SideWords,
    pw: &'a SideWords,
    /// Our grab is counted in the switch word.
    grabbed: bool,
    /// We hold the side (`holders`).
    held: bool,
}

impl Grab<'_> {
    /// Waits until the connection is on TCP on our side, its re-send out, with our grab and
    /// our hold taken.
    fn wait(&mut self, fd: c_int, deadline: Instant) -> Result<Ready, Refused> {
        let (w, side) = (&self.w.switch, self.f.side);
        let mut kick_at = Instant::now();
        let mut kick_every = Duration::from_micros(500);
        let mut seen_on_tcp = false;
        loop {
            let seen = memloop::channel::switch_bell_value(&self.w.bell);
            let Ok(info) = self.reg.channel(self.f.ch) else {
                // Freed: both sides closed (the slot is not ours to write any more). Closed
                // on TCP, the kernel tells the rest; closed on its ring, its bytes were there.
                self.grabbed = false;
                self.held = false;
                return if seen_on_tcp {
                    Ok(Ready::Plain)
                } else {
                    Err(Refused::Closed)
                };
            };
            let (ours_gone, peer_gone) = match side {
                Side::Client => (
                    info.client_closed || info.client_dead,
                    info.server_closed || info.server_dead,
                ),
                Side::Server => (
                    info.server_closed || info.server_dead,
                    info.client_closed || info.client_dead,
                ),
            };
            if !self.grabbed {
                if w.grab() {
                    self.grabbed = true;
                } else if Instant::now() >= deadline {
                    return Err(Refused::Timeout);
                } else {
                    // A side stopped writing TCP: that promotion completes first (it counted
                    // exactly: we have not touched the socket); then we ask again.
                    self.sleep(seen, deadline);
                    continue;
                }
            }
            // No side can stop now: a promotion is always called off.
            w.cancel_promotion();
            if w.on_tcp(side) {
                seen_on_tcp = true;
                if ours_gone {
                    // Its holder closed it on TCP: nobody else holds it. Its re-send first.
                    return match self.resent(fd) {
                        Some(true) => Ok(Ready::Plain),
                        None => Err(Refused::Stuck),
                        Some(false) if Instant::now() >= deadline => Err(Refused::Timeout),
                        Some(false) => {
                            self.sleep(seen, deadline);
                            continue;
                        }
                    };
                }
                if !self.held {
                    // Refused once the last holder let go (0): closed meanwhile, seen at a
                    // next look.
                    self.held = self
                        .w
                        .holders
                        .fetch_update(AcqRel, Acquire, |n| (n > 0).then_some(n + 1))
                        .is_ok();
                    if !self.held {
                        self.sleep(seen, deadline);
                    }
                    continue;
                }
                match self.resent(fd) {
                    Some(true) => return Ok(Ready::Adopt),
                    Some(false) => {}
                    None => return Err(Refused::Stuck),
                }
            } else {
                if self.held {
                    // Back on its ring before our hold (a promotion completed): ask again.
                    self.give_back();
                }
                if ours_gone {
                    return Err(Refused::Closed);
                }
                if peer_gone && self.peer_left().is_none() {
                    // Its peer went without leaving the ring: what it sent is only there,
                    // for the holder to read.
                    return Err(Refused::Stuck);
                }
                if !w.requested() {
                    match self.reg.request_switch(self.f.ch, SwitchReason::Pidfd) {
                        Ok(true) => {
                            tracing::debug!(ch = ?self.f.ch, side = ?side,
                                "pidfd_getfd: the connection is asked to leave its ring");
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!(ch = ?self.f.ch, %e, "demote not asked (yet)"),
                    }
                }
                if Instant::now() >= kick_at {
                    // Holders in none of our calls act at their heartbeat: now, not in 200 ms.
                    memloop::channel::kick_sides(self.reg, self.f.ch);
                    kick_at = Instant::now() + kick_every;
                    kick_every = (kick_every * 2).min(KICK_EVERY_MAX);
                }
            }
            if Instant::now() >= deadline {
                return Err(Refused::Timeout);
            }
            self.sleep(seen, deadline);
        }
    }

    fn sleep(&self, seen: u32, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        memloop::channel::wait_switch_bell(&self.w.bell, seen, left.min(LOOK_EVERY));
    }

    fn peer_left(&self) -> Option<memloop_ring::leave::Left> {
        LeaveCell::new(&self.pw.leave, 0).ok()?.read().ok()?
    }

    /// Whether our side's re-send after the switch (the bytes of our tx ring the peer never
    /// consumed, `[peer's head, our tail)`) is all in the kernel: the socket's written
    /// position has moved that far past the one recorded at the switch. Only our side's
    /// holder writes before its re-send is out (its program's sends wait for it). `None`:
    /// the kernel cannot tell.
    fn resent(&self, fd: c_int) -> Option<bool> {
        let ours = LeaveCell::new(&self.w.leave, 0).ok()?.read().ok()?;
        let (Some(ours), Some(theirs)) = (ours, self.peer_left()) else {
            // A leave record goes only at a promotion's stop, after the re-send.
            return Some(true);
        };
        let resend = ours.tail.wrapping_sub(theirs.head);
        let base = self.w.tcp_base_written.load(Acquire);
        if base == u64::MAX {
            return None;
        }
        let (written, _) = real::tcp_positions(fd)?;
        Some(written.checked_sub(base)? >= resend)
    }

    fn give_back(&mut self) {
        if std::mem::take(&mut self.held)
            && self
                .w
                .holders
                .fetch_update(AcqRel, Acquire, |n| Some(n.saturating_sub(1)))
                == Ok(1)
        {
            // Its holder closed meanwhile: ours was the last hold.
            memloop::channel::release(self.reg, self.f.ch, self.f.side);
        }
    }

    /// Nothing taken: our grab and our hold go.
    fn undo(&mut self) {
        if std::mem::take(&mut self.grabbed) {
            self.w.switch.ungrab();
        }
        self.give_back();
    }

    /// On TCP with our hold and grab: the fd becomes a switched connection of ours.
    fn adopt(&mut self, engine: &Arc<Engine>, fd: c_int) {
        let (f, reg) = (self.f, self.reg);
        // The holder's own counts miss whatever we do on the socket from now on.
        self.w.switch.set_kernel_counts(f.side);
        // This process answers for the side's liveness from now on, as a receiver of the fd
        // would (the holder may exit without closing it: a takeover); back to the holder if
        // we let go first.
        let moved = match reg.transfer_side(f.ch, f.side, f.owner, engine.me()) {
            Ok(()) => Some(f.owner),
            Err(e) => {
                tracing::debug!(fd, ch = ?f.ch, %e, "taken connection: side not moved to us");
                None
            }
        };
        match Conn::new(ConnParts::found(engine, f.ch, f.side, f.tuple, fd)) {
            Ok(c) => {
                c.grabbed_on_tcp(moved);
                self.grabbed = false; // the connection's now: dropped when it closes
                self.held = false;
                tracing::debug!(fd, ch = ?f.ch, side = ?f.side, "connection taken with \
                    pidfd_getfd: adopted on TCP");
                table::insert(fd, Entry::Conn(c));
            }
            Err(reason) => {
                // Cannot follow it: a plain socket for us, never promoted again (we may write
                // on it at any time).
                tracing::debug!(fd, ch = ?f.ch, %reason, "taken connection pinned to TCP");
                self.w.switch.pin();
                if let Some(from) = moved {
                    give_side_to(reg, engine, f.ch, f.side, from);
                }
                self.undo();
            }
        }
    }
}

/// Moves our side of `ch` back to member `to` (if it is still alive).
fn give_side_to(reg: &Registry, engine: &Engine, ch: ChannelId, side: Side, to: MemberId) {
    if !engine.node.peer_alive(to) {
        return;
    }
    match reg.transfer_side(ch, side, engine.me(), to) {
        Ok(()) => tracing::debug!(?ch, ?side, ?to, "side given back to its holder"),
        Err(e) => tracing::debug!(?ch, ?side, %e, "side not given back"),
    }
}

impl Conn {
    /// Adopted on TCP after `pidfd_getfd` took it from a holder who was not told: as a
    /// received fd, plus our grab in the switch word, dropped when we close or hold the side
    /// alone.
    fn grabbed_on_tcp(&self, taken_from: Option<MemberId>) {
        self.adopted_on_tcp(SwitchReason::Pidfd);
        *self.switching.taken_from.lock() = taken_from;
        self.switching.grabbed.store(true, Release);
    }

    /// We let go of a side we took while its holder still holds it: the side goes back to
    /// that holder's member (its exit, not ours, is the side's death from now on).
    pub(super) fn give_side_back(&self) {
        if let Some(from) = self.switching.taken_from.lock().take() {
            give_side_to(
                self.engine.registry(),
                &self.engine,
                self.ch,
                self.side,
                from,
            );
        }
    }

    /// We hold the side alone now (the holder we took it from let go): our grab goes, and
    /// the side stays ours.
    pub(super) fn alone_now(&self) {
        self.drop_grab();
        self.switching.taken_from.lock().take();
    }

    /// Our grab goes (we close, or we hold the side alone): promotions may stop again.
    pub(super) fn drop_grab(&self) {
        if self.switching.grabbed.swap(false, AcqRel) {
            if let Some(w) = &self.share.side_words {
                w.switch.ungrab();
                tracing::debug!(ch = ?self.ch, side = ?self.side, "pidfd_getfd grab dropped");
            }
        }
    }

    /// Before getting ready for a promotion: a process holds the side unseen (no side may
    /// stop: the promotion is called off), or its counts must come from the kernel.
    pub(super) fn grab_blocks_promotion(&self, w: &SideWords) -> bool {
        if w.switch.grabbed() {
            // Nobody can have stopped: called off.
            if w.switch.promote_requested() && w.switch.cancel_promotion() {
                tracing::debug!(ch = ?self.ch, side = ?self.side, "promotion called off: a \
                    process that took the socket with pidfd_getfd holds it too");
            }
            return true;
        }
        if w.switch.kernel_counts(self.side) && !w.switch.ready(self.side) {
            // Another process used the socket where our counts could not see it: they are
            // taken from the kernel as we get ready.
            self.tcp.from_kernel.store(true, Release);
        }
        false
    }
}
