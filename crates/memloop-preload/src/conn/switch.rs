//! Live path switching: a ring connection moves to its kernel socket mid-stream, in both
//! directions at once, without losing, duplicating or reordering a byte
//! (`docs/design/path-switching.md`; the protocol's core is `memloop_ring::leave`).
//!
//! Either side (or `memloop demote`) sets the channel's switch word; each side then *leaves*
//! both rings — a last counted doorbell if the peer sleeps on its socket, then its
//! `Left {tail, head, doorbells sent}` — and
//! waits for the peer's. Once both have left, each side throws away the peer's doorbells it
//! never read, re-sends over TCP what the peer never consumed of its tx ring, and from then on
//! the connection is a plain TCP one. A side notices a request in its data calls, in its
//! waits (poll, epoll, blocking calls), or at the latest on its next heartbeat.
//!
//! Nothing of ours reads the socket between the leave and the takeover: drains stop at the
//! leave (this process: the `DRAINING` bit; other processes holding the side: the side lock),
//! so the doorbell count read at the takeover is final.
//!
//! A side coming back from TCP (`Joining`: writes on the ring, the peer's last TCP bytes —
//! its *tail* — still unread in the socket, in front of the peer's doorbells) *carries* the
//! tail instead of leaving as above (`memloop_ring::leave`, "Carrying a tail"): it announces
//! the carry and goes on as before until the peer has left; then, if the tail fits the rx
//! ring's free space, it reads the tail out of the socket, writes it into the ring in front
//! of its head and leaves with that head, so the peer's re-send brings tail and ring bytes
//! back in order. Without room it stays as it is, and the program must read the tail first
//! (a demote of ours waits for that a while, then fails with `EBUSY`).

use super::{Conn, Path, DEMOTE_EVENTS};
use crate::forklock::ForkMutex;
use crate::plain::{PlainTcp, Resend};
use crate::real;
use libc::c_int;
use memloop::channel;
use memloop::registry::{Side, SideWords, SwitchReason};
use memloop_ring::leave::{begin_carry, doorbells_to_discard, CarryStep, LeaveCell, Left};
use memloop_ring::wait::merge_wakes;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::Duration;

/// What a ring operation returns (never the program) when the connection left its ring during
/// the call with nothing moved: the caller goes again, to the kernel socket.
pub const SWITCHED: c_int = 0x5357_4348;

/// How long a leave waits for the peer's before it wakes the peer's heartbeat: a peer in any
/// call of ours, or asleep in a ring wait (our last doorbell wakes it), follows sooner.
const PEER_KICK_AFTER: Duration = Duration::from_micros(100);

/// Longest pause between two looks at the peer's leave record.
const PEER_POLL_MAX: Duration = Duration::from_micros(200);

/// How long a demote waits for a connection coming back to its ring (`Joining`) to get
/// there: other threads of the program may read the peer's last TCP bytes meanwhile.
const JOINING_WAIT: Duration = Duration::from_secs(1);

pub(super) struct Switching {
    /// Serialises this process's switch of the connection.
    pub(super) lock: ForkMutex<()>,
    /// Taken around every doorbell and by the leave: no doorbell of this process can be sent
    /// after the leave read the count it publishes.
    pub(super) bell: ForkMutex<()>,
    /// The peer side's words (its leave record).
    pub(super) peer: Option<SideWords>,
    /// The request in the switch word was dealt with here: moved to TCP, or given up
    /// because the peer is gone (the ring then delivers what is left, then EOF).
    pub(super) handled: AtomicBool,
    /// Adopted from another process on TCP: ask for a promotion once we hold it alone.
    pub(super) auto_promote: AtomicBool,
    /// Bytes received on TCP when the sweep last found unread bytes (`u64::MAX`: never).
    pub(super) auto_promote_seen: AtomicU64,
    /// A demote asked while coming back to the ring (`Joining`) could not carry the tail (no
    /// room, or the side is shared): it waits for the program to read it, and nothing but
    /// our own demote tries to carry again until the next promotion's stop.
    pub(super) carry_refused: AtomicBool,
    /// Taken with `pidfd_getfd`: our grab is counted in the switch word (`grab.rs`).
    pub(super) grabbed: AtomicBool,
    /// Taken with `pidfd_getfd` from the process of this member, whose side was moved to us:
    /// it goes back there if we let go first (`grab.rs`).
    pub(super) taken_from: ForkMutex<Option<memloop::registry::MemberId>>,
}

impl Switching {
    pub(super) fn new(peer: Option<SideWords>) -> Self {
        Switching {
            lock: ForkMutex::new(()),
            bell: ForkMutex::new(()),
            peer,
            handled: AtomicBool::new(false),
            auto_promote: AtomicBool::new(false),
            auto_promote_seen: AtomicU64::new(u64::MAX),
            carry_refused: AtomicBool::new(false),
            grabbed: AtomicBool::new(false),
            taken_from: ForkMutex::new(None),
        }
    }
}

pub(super) fn other(side: Side) -> Side {
    match side {
        Side::Client => Side::Server,
        Side::Server => Side::Client,
    }
}

impl Conn {
    /// Nothing was asked of the switch word (one shared-memory load: every data call's check).
    #[inline]
    pub fn switch_quiet(&self) -> bool {
        self.share
            .side_words
            .as_ref()
            .map_or(true, |w| w.switch.quiet())
    }

    /// A switch was asked for and this process has not dealt with it yet.
    pub fn switch_pending(&self) -> bool {
        if self.switch_quiet() {
            return false;
        }
        match self.path() {
            Path::Ring | Path::Leaving => {
                !self.switching.handled.load(Acquire) && self.demote_asked()
            }
            Path::Joining => self.carry_pending(),
            _ => false,
        }
    }

    /// A demote was asked while this side comes back to its ring (`Joining`), after the peer
    /// finished the promotion, and the tail has not been found impossible to carry.
    fn carry_pending(&self) -> bool {
        self.path() == Path::Joining
            && !self.switching.carry_refused.load(Acquire)
            && self
                .words()
                .is_some_and(|(w, _)| !w.switch.promote_requested())
            && self.demote_asked()
    }

    /// The switch word asks for a move to TCP. While a promotion runs, the word still holds
    /// the request of the demote before it: that one is done, not a new one.
    fn demote_asked(&self) -> bool {
        let Some(w) = &self.share.side_words else {
            return false;
        };
        if !w.switch.requested() {
            return false;
        }
        // A promotion asked while this side has not finished leaving (the word's marks said
        // both were on TCP) can never get ready: the demote goes on, and `switch_to_tcp`
        // calls the promotion off.
        !w.switch.promote_requested() || self.path() == Path::Leaving
    }

    /// Deals with a switch the peer (or an operator) asked for. Blocks until the peer's side
    /// has left too — that takes a moment of the peer's, at most one heartbeat.
    pub fn settle_switch(&self) {
        if self.carry_pending() {
            if let Err(e) = self.carry_to_tcp(None, true) {
                tracing::debug!(ch = ?self.ch, errno = e, "switch to TCP (carrying) not done");
            }
            return;
        }
        if self.switched() {
            self.promote_step();
            return;
        }
        if self.switch_pending() {
            if let Err(e) = self.switch_to_tcp(None, true) {
                tracing::debug!(ch = ?self.ch, errno = e, "switch to TCP not done");
            }
        }
    }

    /// [`Conn::settle_switch`] without waiting for the peer: this side leaves, and the switch
    /// completes on a later call (the heartbeat, poll and epoll must not stall behind a busy
    /// peer — it may be waiting for something this very thread would do next).
    pub fn settle_switch_nowait(&self) {
        if self.carry_pending() {
            if let Err(e) = self.carry_to_tcp(None, false) {
                tracing::debug!(ch = ?self.ch, errno = e, "switch to TCP (carrying) not done");
            }
            return;
        }
        if self.switched() {
            self.promote_step_with(false);
            return;
        }
        if self.switch_pending() {
            if let Err(e) = self.switch_to_tcp(None, false) {
                tracing::debug!(ch = ?self.ch, errno = e, "switch to TCP not done");
            }
        }
    }

    /// Moves the connection to its kernel socket because of `reason` (ours), waiting for the
    /// peer's side. A pending connection is decided first.
    pub fn demote(&self, reason: SwitchReason) -> Result<(), c_int> {
        let deadline = std::time::Instant::now() + JOINING_WAIT;
        loop {
            match self.resolve(true) {
                Path::Ring => return self.switch_to_tcp(Some(reason), true),
                Path::Leaving => {
                    self.settle_switch();
                    std::thread::yield_now();
                }
                // On TCP after a switch: a promotion is called off — or, past its point of no
                // return, brought to the ring first.
                Path::Tcp if self.switched() => match &self.share.side_words {
                    Some(w) if !w.switch.cancel_promotion() => self.complete_promotion(),
                    _ => return Ok(()),
                },
                // Our writes are on the ring, the peer's last TCP bytes maybe still unread:
                // they are carried through the ring — or, without room for them (or while
                // the peer has not finished the promotion), they must reach the program
                // before the peer's doorbells behind them can go.
                Path::Joining => match self.carry_to_tcp(Some(reason), true)? {
                    true => {}
                    false if std::time::Instant::now() < deadline => {
                        self.promote_step();
                        std::thread::sleep(PEER_POLL_MAX);
                    }
                    false => {
                        tracing::warn!(ch = ?self.ch, %reason, "cannot leave the ring: the \
                            peer's last TCP bytes of a promotion are still unread, and do not \
                            fit the ring");
                        return Err(libc::EBUSY);
                    }
                },
                _ => return Ok(()), // already on TCP
            }
        }
    }

    /// The switching lock: waited for, or (`wait` false) only if it is free now.
    fn switching_guard(&self, wait: bool) -> Option<crate::forklock::ForkGuard<'_, ()>> {
        if wait {
            Some(self.switching.lock.lock())
        } else {
            self.switching.lock.try_lock()
        }
    }

    fn switch_to_tcp(&self, ask: Option<SwitchReason>, wait: bool) -> Result<(), c_int> {
        let before = self.path();
        let r = match self.switching_guard(wait) {
            Some(_g) => self.switch_to_tcp_locked(ask, wait),
            None => return Ok(()), // another thread of ours is at it
        };
        self.follow_if_moved(before);
        r
    }

    /// The epoll sets holding the connection follow its path, if it moved from `before` — or
    /// left its ring and came back to it (the peer was gone): a waiter may have moved its
    /// items off the ring meanwhile (`EpollSet::settle_conn`).
    fn follow_if_moved(&self, before: Path) {
        let now = self.path();
        if now != before || (now == Path::Ring && self.switching.handled.load(Acquire)) {
            self.epoll_follow_path();
        }
    }

    /// [`Conn::switch_to_tcp`] under the switching lock. The epoll sets follow the path only
    /// after it: a thread in `epoll_wait` holds its set's lock while it tries ours (without
    /// waiting), and a switch that waited for the set's lock while holding ours could keep
    /// that thread failing — and spinning — for as long as it keeps the set's lock busy.
    fn switch_to_tcp_locked(&self, ask: Option<SwitchReason>, wait: bool) -> Result<(), c_int> {
        let (Some(w), Some(pw)) = (&self.share.side_words, &self.switching.peer) else {
            return Err(libc::ENOTSUP);
        };
        if self.let_go() {
            return Ok(());
        }
        if !matches!(self.path(), Path::Ring | Path::Leaving) {
            return Ok(());
        }
        // What made the caller come here may be over by now (it waited for the lock): the end
        // of a promotion (the word then still held the old request), or a whole switch done
        // by another thread. Leaving on such a stale look would leave alone, for good.
        if ask.is_none() && (self.switching.handled.load(Acquire) || !self.demote_asked()) {
            return Ok(());
        }
        if self.path() == Path::Leaving && w.switch.promote_requested() {
            // Always works here: a side gets ready only on TCP, so neither can have stopped.
            w.switch.cancel_promotion();
        }
        if let Some(r) = ask {
            if w.switch.request(r) {
                self.engine.registry().count_switch(r);
            }
        }
        let left = self.leave(w)?;
        if wait {
            self.ring_bell(); // the peer's heartbeat only if it is slow to follow (below)
        } else {
            self.tell_peer(); // nobody here waits to nudge it later
        }
        if let Some(left) = left {
            // (After the wake-ups: a log line costs more than the peer's whole leave.)
            tracing::debug!(target: DEMOTE_EVENTS, ch = ?self.ch, side = ?self.side, ?left, "left the ring");
        }
        if !wait && self.peer_left(pw).is_none() && !self.peer_vanished() {
            return Ok(()); // left; the takeover comes with the next call or sweep
        }
        let Some(peer) = self.await_peer(pw)? else {
            // The peer is gone without leaving: its bytes are still in our rx ring and only
            // the ring can deliver them (then EOF), so this connection stays there.
            tracing::debug!(ch = ?self.ch, "peer gone during a switch: staying on the ring");
            self.switching.handled.store(true, Release);
            self.decision.path.store(Path::Ring, Release);
            return Err(libc::EPIPE);
        };
        let reason = w.switch.reason().unwrap_or(SwitchReason::Peer);
        let resend = self.take_over(w, peer, reason)?;
        let carried = self.own_left(w).map_or(0, |l| l.tail.wrapping_add(l.head));
        self.finish_on_tcp(reason, carried, resend);
        Ok(())
    }

    /// A demote of a connection coming back to its ring (`Joining`: our writes on the ring,
    /// the peer's last TCP bytes maybe still unread in the socket): carries those bytes — the
    /// tail — through the rx ring (see the module docs). `Ok(true)`: on TCP now; `Ok(false)`:
    /// not now — the peer has not finished the promotion (no demote can be asked before), it
    /// has not left yet (`wait` false), or the tail cannot be carried (no room, a shared
    /// side: `carry_refused`, the program must read it first).
    fn carry_to_tcp(&self, ask: Option<SwitchReason>, wait: bool) -> Result<bool, c_int> {
        let before = self.path();
        let r = match self.switching_guard(wait) {
            Some(_g) => self.carry_to_tcp_locked(ask, wait),
            None => return Ok(false), // another thread of ours is at it
        };
        self.follow_if_moved(before); // (after the lock: see `switch_to_tcp_locked`)
        r
    }

    fn carry_to_tcp_locked(&self, ask: Option<SwitchReason>, wait: bool) -> Result<bool, c_int> {
        let (Some(w), Some(pw)) = (&self.share.side_words, &self.switching.peer) else {
            return Err(libc::ENOTSUP);
        };
        if self.let_go() {
            return Ok(false);
        }
        if self.path() != Path::Joining || w.switch.promote_requested() {
            // Back on the ring meanwhile (the program read the tail: the caller looks again),
            // or the peer still reads our last TCP bytes: no demote can be asked yet.
            return Ok(false);
        }
        if let Some(r) = ask {
            if w.switch.request(r) {
                self.engine.registry().count_switch(r);
            }
        }
        if !self.demote_asked() {
            return Ok(false); // a stale look: the request is over
        }
        // (A carry found impossible once the peer has left stays announced: the peer waits
        // for our `Left` whatever our record says, and a retry rings no doorbell again.)
        let refuse = |why: &str| {
            if !self.switching.carry_refused.swap(true, AcqRel) {
                tracing::debug!(ch = ?self.ch, side = ?self.side, tail = ?self.tcp_left(),
                    "cannot carry the peer's last TCP bytes: {why}; they must be read first");
            }
            Ok(false)
        };
        if self.still_shared() {
            // Another process holding the side may read the tail too: its count is not ours.
            return refuse("the side is shared");
        }
        let me = LeaveCell::new(&w.leave, 0).map_err(|_| libc::EIO)?;
        let peer_cell = LeaveCell::new(&pw.leave, 0).map_err(|_| libc::EIO)?;
        let announced = matches!(me.state(), Ok(memloop_ring::leave::LeaveState::Carrying));
        let step = begin_carry(&me, &peer_cell).map_err(|e| {
            tracing::warn!(ch = ?self.ch, "cannot carry: {e}");
            libc::EIO
        })?;
        if !announced {
            // A peer asleep on its socket in a ring wait wakes and notices (counted: our
            // `Left` comes later); its heartbeat too, if it is in none of our calls.
            self.ring_doorbell();
            self.tell_peer();
            tracing::debug!(ch = ?self.ch, side = ?self.side, tail = ?self.tcp_left(),
                "demote while coming back to the ring: carrying the peer's last TCP bytes");
        }
        let peer = match step {
            CarryStep::Carry(l) => l,
            // (Cannot happen here: a demote is asked only once the peer finished the
            // promotion, so it has no tail of its own.)
            CarryStep::Withdrawn => return refuse("the peer carries a tail too"),
            CarryStep::Wait if !wait && !self.peer_vanished() => return Ok(false),
            CarryStep::Wait => match self.await_peer(pw)? {
                Some(l) => l,
                None => {
                    // Gone without leaving: its bytes are in our ring and the socket, where
                    // the program reads them (tail, then ring, then EOF) as it is.
                    me.withdraw_carry();
                    self.switching.carry_refused.store(true, Release);
                    tracing::debug!(ch = ?self.ch, "peer gone during a switch: coming back to the ring");
                    return Err(libc::EPIPE);
                }
            },
        };
        let Some(tail) = self.carry(w, &me, peer)? else {
            return refuse("no room in the ring (or the side became shared)");
        };
        let reason = w.switch.reason().unwrap_or(SwitchReason::Peer);
        let resend = self.take_over(w, peer, reason)?;
        // (Our head as the ring has it: the published one is `tail` bytes before.)
        let carried = self
            .own_left(w)
            .map_or(0, |l| l.tail.wrapping_add(l.head).wrapping_add(tail));
        self.finish_on_tcp(reason, carried, resend);
        Ok(true)
    }

    /// The peer has left (`peer`): if our tail fits the rx ring's free space, reads it out of
    /// the socket, writes it in front of our head and publishes our `Left` with that head
    /// (path `Leaving`); how many bytes it carried. `None`, with nothing changed, if it does
    /// not fit.
    fn carry(&self, w: &SideWords, me: &LeaveCell, peer: Left) -> Result<Option<u64>, c_int> {
        let _r = self.tcp.read_gate.lock(); // no TCP read of ours in flight, none starts
        let prod = self.rings.prod.lock();
        let mut cons = self.rings.cons.lock();
        if self.path() != Path::Joining {
            return Err(libc::EAGAIN); // (the switching lock keeps it there: cannot happen)
        }
        let Some(tail) = self.tcp_left() else {
            return Err(libc::EAGAIN); // (the peer stopped: the word asks no promotion)
        };
        if self.share.shared.load(Acquire) {
            return Ok(None); // forked while we waited: another holder may read the tail
        }
        // (Room made before the tail is read off the socket: once read it must fit.)
        let fits = cons.make_carry_room(tail, peer.tail).map_err(|e| {
            tracing::warn!(ch = ?self.ch, "cannot carry: {e}");
            libc::EIO
        })?;
        if !fits {
            return Ok(None);
        }
        // Everything from the peer up to its stop is data (it sent it before it stopped);
        // its doorbells follow, and stay for the takeover's discard.
        let mut bytes = vec![0u8; tail as usize];
        let (got, err) = real::recv_exact(self.kfd(), &mut bytes);
        if got < bytes.len() {
            // The socket broke (the peer is gone): what came goes first, the takeover meets
            // the error.
            tracing::debug!(ch = ?self.ch, got, of = tail, ?err, "reading the tail to carry");
        }
        bytes.truncate(got);
        self.tcp.received.fetch_add(got as u64, AcqRel);
        if let Some(p) = self.plain() {
            p.count_received(got as isize);
        }
        let head = cons.carry(&bytes, peer.tail).map_err(|e| {
            tracing::warn!(ch = ?self.ch, "cannot carry: {e}");
            libc::EIO
        })?;
        let _b = self.switching.bell.lock(); // no doorbell of ours after the count below
        let left = Left {
            tail: prod.position(),
            head,
            doorbells: w.doorbells_sent.load(Acquire),
        };
        if !me.publish(left) {
            tracing::warn!(ch = ?self.ch, "cannot carry: our leave record was published already");
            return Err(libc::EIO);
        }
        self.decision.path.store(Path::Leaving, Release);
        tracing::debug!(ch = ?self.ch, side = ?self.side, bytes = got, ?left, peer_tail = peer.tail,
            "carried the peer's last TCP bytes into the ring: left");
        Ok(Some(got as u64))
    }

    /// Leaves both rings: a last counted doorbell if the peer sleeps on its socket (it wakes
    /// and notices), then our `Left`. Another process holding this side may have left already: then only our
    /// path changes.
    fn leave(&self, w: &SideWords) -> Result<Option<Left>, c_int> {
        let cell = LeaveCell::new(&w.leave, 0).map_err(|_| libc::EIO)?;
        let _r = self.tcp.read_gate.lock(); // no TCP read of a promotion's tail in flight
        self.stop_drains();
        let r = (|| {
            let mut prod = self.rings.prod.lock();
            let mut cons = self.rings.cons.lock();
            let lock = self.side_lock();
            if lock.is_some() {
                prod.resync().map_err(|_| libc::EIO)?;
                cons.resync().map_err(|_| libc::EIO)?;
            }
            if cell.read().map_err(|_| libc::EIO)?.is_none() {
                // A peer asleep on its socket, armed for our data or for room in our rx
                // ring, wakes as for a publication (the doorbell is counted). A peer not
                // armed now sees the request, set before any leave, when it re-checks after
                // arming (`loom_leave_wake.rs`); one in none of our calls is kicked by
                // `await_peer`. (Before, every leave rang: the follower's doorbell cost the
                // initiator, asleep on the switch bell, a TCP send and a discard.)
                let wake = merge_wakes(prod.wake_reader(), cons.wake_writer());
                self.wake_peer_locked(wake, lock.is_some());
                let _b = self.switching.bell.lock();
                let left = Left {
                    tail: prod.position(),
                    head: cons.position(),
                    doorbells: w.doorbells_sent.load(Acquire),
                };
                cell.publish(left);
                self.decision.path.store(Path::Leaving, Release);
                Ok(Some(left))
            } else {
                self.decision.path.store(Path::Leaving, Release);
                Ok(None)
            }
        })();
        self.resume_drains();
        r
    }

    /// Where this side stopped (the record another holder of the side may have written).
    fn own_left(&self, w: &SideWords) -> Option<Left> {
        LeaveCell::new(&w.leave, 0).ok()?.read().ok()?
    }

    /// The peer's `Left`, if it has left.
    fn peer_left(&self, pw: &SideWords) -> Option<Left> {
        LeaveCell::new(&pw.leave, 0).ok()?.read().ok()?
    }

    /// Waits for the peer's `Left`; `None` if the peer is gone without leaving. Sleeps on the
    /// switch bell, which the peer rings once it has left (the sleep is bounded: a peer in
    /// another kernel cannot wake us). A peer slow to follow is in none of our calls (a call
    /// or a ring wait notices at once): its heartbeat is woken.
    fn await_peer(&self, pw: &SideWords) -> Result<Option<Left>, c_int> {
        let cell = LeaveCell::new(&pw.leave, 0).map_err(|_| libc::EIO)?;
        if let Some(l) = self.spin_for_peer(&cell) {
            return Ok(Some(l));
        }
        let mut pause = Duration::from_micros(1);
        let kick_at = std::time::Instant::now() + PEER_KICK_AFTER;
        let mut kicked = false;
        loop {
            if !kicked && std::time::Instant::now() >= kick_at {
                self.peer.watch.kick();
                kicked = true;
            }
            let seen = channel::switch_bell_value(&pw.bell);
            match cell.read() {
                Ok(Some(l)) => return Ok(Some(l)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(ch = ?self.ch, "peer's leave record: {e}");
                    return Err(libc::EIO);
                }
            }
            if self.peer_vanished() {
                // It may have left and finished (closing its side) since the look above.
                return cell.read().map_err(|_| libc::EIO);
            }
            channel::wait_switch_bell(&pw.bell, seen, pause);
            pause = (pause * 2).min(PEER_POLL_MAX);
        }
    }

    /// The peer's `Left`, if it comes while we spin for it ([`Conn::spin_for_peer_step`]).
    fn spin_for_peer(&self, cell: &LeaveCell) -> Option<Left> {
        let mut left = None;
        self.spin_for_peer_step(|| {
            left = cell.read().ok().flatten();
            left.is_some()
        });
        left
    }

    /// Spins until `done` (true) — the peer's next step of a switch — for at most a data
    /// wait's spin window, and only where spinning can pay (the load leaves the peer a CPU):
    /// a peer woken with us, or by our step, takes its own within about a wake-up, which a
    /// sleep of ours until it tells us would cost again.
    pub(super) fn spin_for_peer_step(&self, done: impl FnMut() -> bool) -> bool {
        let inputs = || memloop_ring::SpinInputs {
            our_cpu: memloop_shm::sched::current_cpu(),
            load: memloop_shm::sched::runnable_and_cpus(),
            ..memloop_ring::SpinInputs::UNKNOWN
        };
        let window = self.spin_window();
        memloop_ring::Spinner::new(window).spin_with(window, inputs, done)
    }

    /// We took a step of a switch the peer may be waiting for: its waits wake (the bell), and
    /// so does its heartbeat, for a peer in none of our calls (its sweep takes its next step).
    pub(super) fn tell_peer(&self) {
        self.ring_bell();
        self.peer.watch.kick();
    }

    /// [`Conn::tell_peer`] for a peer that notices by itself unless it waits in our code.
    pub(super) fn ring_bell(&self) {
        if let Some(w) = &self.share.side_words {
            channel::ring_switch_bell(&w.bell);
        }
    }

    /// The peer closed its side of the channel or died. (Not its socket's FIN: a ring
    /// connection's kernel socket is never shut down while on the ring, and after a switch
    /// the peer's FIN follows its `Left`.)
    fn peer_vanished(&self) -> bool {
        self.peer_closed() || self.peer.watch.gone() || self.peer.watch.dead()
    }

    /// Both sides have left: throw away the peer's unread doorbells, re-send what the peer
    /// never consumed, and release our side of the channel. Done once per side, under the
    /// side lock when the side is shared.
    fn take_over(
        &self,
        w: &SideWords,
        peer: Left,
        reason: SwitchReason,
    ) -> Result<Option<Arc<Resend>>, c_int> {
        let _l = self.side_lock();
        if self.share.shared.load(Acquire) && w.switch.on_tcp(self.side) {
            return Ok(None); // another process holding this side did it
        }
        let fd = self.kfd();
        let read = w.doorbells_read.load(Acquire);
        let discard = doorbells_to_discard(&peer, read).map_err(|e| {
            tracing::warn!(ch = ?self.ch, "cannot switch: {e}");
            libc::EIO
        })?;
        tracing::debug!(ch = ?self.ch, side = ?self.side, peer_sent = peer.doorbells, read, "discarding the peer's unread doorbells");
        let gone = real::discard_exact(fd, discard)?;
        self.record_tcp_base(w, fd);
        let mut unconsumed = Vec::new();
        self.rings
            .prod
            .lock()
            .unconsumed(peer.head, &mut unconsumed)
            .map_err(|e| {
                tracing::warn!(ch = ?self.ch, "cannot switch: {e}");
                libc::EIO
            })?;
        // Our shutdown so far lived in the ring: the FIN follows the re-sent bytes.
        let resent = unconsumed.len();
        let resend = match Resend::start(fd, unconsumed, self.shut_wr.load(Acquire)) {
            Ok(r) => r,
            // The peer died after it left: nothing reaches it any more, and the socket tells
            // the program so. (Failing here left the path `Leaving`, retried for good.)
            Err(e @ (libc::EPIPE | libc::ECONNRESET)) => {
                tracing::debug!(ch = ?self.ch, side = ?self.side, errno = e, "peer gone during the re-send");
                None
            }
            Err(e) => return Err(e),
        };
        if self.shut_rd.load(Acquire) {
            real::shutdown_now(fd, libc::SHUT_RD);
        }
        self.tcp.restart(resent as u64);
        // Everything the peer rang is read now: the counts stay exact for a later switch.
        w.doorbells_read.fetch_add(gone, AcqRel);
        w.switch.set_on_tcp(self.side);
        tracing::debug!(
            target: DEMOTE_EVENTS,
            ch = ?self.ch, side = ?self.side, %reason, discarded = gone, resent,
            in_background = resend.is_some(),
            "switched to TCP"
        );
        // Our side stays held (and the channel allocated) until the last process holding it
        // closes it: a forked copy still knows it by its slot.
        Ok(resend)
    }

    /// The socket's stream positions where the TCP phase starts (the peer's doorbells read,
    /// nothing re-sent yet): a process that adopts the socket later counts from them.
    fn record_tcp_base(&self, w: &SideWords, fd: c_int) {
        let (written, read) = real::tcp_positions(fd).unwrap_or((u64::MAX, u64::MAX));
        w.tcp_base_written.store(written, Release);
        w.tcp_base_read.store(read, Release);
    }

    /// From now on a plain TCP connection: the program's TCP_NODELAY back and a record for
    /// `memloop status` (the caller tells the epoll sets holding it, after the switching
    /// lock).
    fn finish_on_tcp(&self, reason: SwitchReason, carried: u64, resend: Option<Arc<Resend>>) {
        real::set_sockopt_int(
            self.kfd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            self.decision.nodelay.load(Relaxed),
        );
        let plain = PlainTcp::switched(&self.engine, &self.tuple, reason, carried, resend);
        *self.decision.plain.lock() = Some(plain);
        self.switching.handled.store(true, Release);
        self.decision.path.store(Path::Tcp, Release);
    }

    /// Every epoll set holding this connection follows its path: off its ring its socket
    /// is watched through a filter (doorbells are never readable), on it the ring again.
    pub(super) fn epoll_follow_path(&self) {
        for s in crate::table::epoll_sets() {
            s.conn_path_changed(self);
        }
    }

    /// About to fork: no doorbell may be half-sent by another thread (the child would inherit
    /// its lock held).
    pub fn hold_bell_for_fork(&self) {
        self.switching.bell.acquire_for_fork(|_| {});
    }

    pub fn release_bell_after_fork(&self) {
        self.switching.bell.release_after_fork();
    }

    /// Ring operations refuse to run once the connection left its ring (writes run again
    /// while it comes back: `Joining`).
    pub(super) fn on_ring(&self, writing: bool) -> Result<(), c_int> {
        match self.path() {
            Path::Ring => Ok(()),
            Path::Joining if writing => Ok(()),
            _ => Err(SWITCHED),
        }
    }

    /// This side left its rings (here, or in another process holding it): its rings are dead.
    pub(super) fn side_switched(&self) -> bool {
        match self.path() {
            // (A connection that fell back at connect never had a side to switch.)
            Path::Tcp => self.switching.handled.load(Acquire),
            Path::Leaving => true,
            Path::Ring | Path::Joining => self.side_left(),
            Path::Pending => false,
        }
    }

    /// Whether `fd`s of this connection survive an exec (one without close-on-exec).
    pub fn inheritable(&self) -> bool {
        self.fds
            .lock()
            .iter()
            .any(|&fd| real::fd_flags(fd) & libc::FD_CLOEXEC == 0)
    }
}

/// Wakes every thread of this process asleep on a ring's futex: they look again (a thread the
/// program asked to cancel then leaves its wait, `crate::cancel`).
pub fn wake_futex_sleepers() {
    for c in crate::table::conns() {
        if c.sleepers.futex_sleeping.load(Acquire) > 0 {
            c.rings
                .own_cells
                .iter()
                .for_each(|cell| cell.wake_sleepers());
        }
    }
}

/// The heartbeat's sweep: connections of this process asked to switch while it is in none
/// of our calls (computing, or blocked somewhere we do not see) switch here.
pub fn sweep() {
    super::expire_handoffs();
    let conns = crate::table::conns();
    if !conns.is_empty() {
        // (The program may close what was listed meanwhile: each step checks `let_go`.)
        crate::testpoint::pause(crate::testpoint::Point::SweepListed);
    }
    for c in conns {
        c.look_after_futex_sleepers();
        c.sweep_requests();
        c.settle_switch_nowait();
        c.look_after_window();
    }
}

impl Conn {
    /// This process let the connection go (its last fd closed, [`Conn::release`]): its side's
    /// words may belong to the slot's next occupant. Looked at under the switching lock,
    /// which the release holds.
    pub(super) fn let_go(&self) -> bool {
        self.share.released.load(Acquire)
    }

    /// The sweep's own requests (a promotion once we hold the side alone, a demote for a
    /// paused region), skipped while another thread switches it, and once it is let go (the
    /// sweep's list may be older than the program's close).
    fn sweep_requests(&self) {
        let Some(_g) = self.switching.lock.try_lock() else {
            return;
        };
        if self.let_go() {
            return;
        }
        self.promote_when_alone();
        if !self.region_open() {
            self.ask_to_leave(SwitchReason::Region);
        }
    }

    /// The region takes ring connections (its operator has not paused it or begun to destroy
    /// it): one shared load.
    pub fn region_open(&self) -> bool {
        self.engine.registry().state() == memloop::registry::RegionState::Open
    }

    /// Asks for a move of this ring connection to TCP, for `reason`, without doing it: the
    /// caller's settle (or any later call) does, as for a request of the peer's.
    fn ask_to_leave(&self, reason: SwitchReason) {
        if self.path() != Path::Ring || self.switching.handled.load(Acquire) {
            return;
        }
        if let Some(w) = &self.share.side_words {
            if w.switch.request(reason) {
                self.engine.registry().count_switch(reason);
                tracing::debug!(ch = ?self.ch, %reason, "asked to leave the ring");
            }
        }
    }
}
