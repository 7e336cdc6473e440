//! Promotion: a connection that switched to TCP comes back to its rings mid-stream, both
//! directions, at an exact stream position (`docs/design/path-switching.md`).
//!
//! A switched connection keeps its channel, so its rings are still there. Either side (or
//! `memloop promote`) sets `PROMOTE` in the switch word; then each side:
//! 1. *ready*: drops the stale bytes of its rx ring (the peer re-sent them over TCP at the
//!    switch; the peer writes nothing new there until we are ready), resets its doorbell arms
//!    and its leave record;
//! 2. *stopped*, once both are ready: under the TCP send gate it publishes how many bytes it
//!    sent on TCP since the switch (`tcp_stop`) and writes to its ring from then on (path
//!    `Joining`); one counted doorbell wakes a peer asleep on the socket;
//! 3. reads TCP up to the peer's stop position, then its ring (path `Ring` again).
//!
//! Reads on a switched connection never block inside a consuming kernel receive: they sleep
//! in a peek, then take at most what is known to be data. Bytes beyond the peer's stop are its
//! doorbells (it rings them only after stopping): they are counted as read and never
//! delivered. So no program thread can swallow a doorbell, whatever it was doing when the
//! promotion began.

use super::switch::{other, SWITCHED};
use super::{Conn, Path};
use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use memloop::registry::{SideWords, SwitchReason};
use memloop_ring::leave::LeaveCell;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::Duration;

/// Longest sleep waiting for the peer's next promotion step (its bell cuts it short).
const PEER_STEP: Duration = Duration::from_micros(50);

/// The TCP phase's accounting (reset at each switch to TCP).
#[derive(Default)]
pub(super) struct TcpPhase {
    /// Held around every TCP send of ours: the stop position is read under it.
    pub(super) gate: ForkMutex<()>,
    /// Held around each TCP receive of ours (with its count) and by every path change of
    /// the reads: a reader never takes a doorbell for data.
    pub(super) read_gate: ForkMutex<()>,
    /// Data bytes sent / received on TCP since the switch (re-sent bytes included).
    pub(super) sent: AtomicU64,
    pub(super) received: AtomicU64,
    /// Something the count cannot follow happened (urgent data, splice, a shutdown, fd
    /// shared with another process): the connection stays on TCP.
    pub(super) unpromotable: AtomicBool,
    /// `sent`/`received` are still to be taken from the kernel's stream positions (a
    /// connection adopted from another process, see `handoff.rs`).
    pub(super) from_kernel: AtomicBool,
    /// TCP phases begun (one per switch to TCP, counted once the takeover has read the
    /// peer's doorbells off the socket).
    pub(super) epoch: AtomicU64,
}

impl TcpPhase {
    pub(super) fn restart(&self, resent: u64) {
        self.sent.store(resent, Release);
        self.received.store(0, Release);
        self.epoch.fetch_add(1, AcqRel);
    }
}

impl Conn {
    pub(super) fn words(&self) -> Option<(&SideWords, &SideWords)> {
        Some((
            self.share.side_words.as_ref()?,
            self.switching.peer.as_ref()?,
        ))
    }

    /// The connection is on TCP after a switch of its own (not a fallback at connect).
    pub fn switched(&self) -> bool {
        match self.path() {
            Path::Tcp => self.switching.handled.load(Acquire),
            Path::Joining => true,
            _ => false,
        }
    }

    /// Never promote this connection again — unless a promotion is already past the point of
    /// no return (a side stopped writing TCP): then false, and the caller completes it first
    /// ([`Conn::complete_promotion`]) and goes the ring's way.
    pub fn pin_to_tcp(&self, why: &str) -> bool {
        if let Some((w, _)) = self.words() {
            if !w.switch.cancel_promotion() {
                return false;
            }
        }
        if !self.tcp.unpromotable.swap(true, AcqRel) {
            tracing::debug!(ch = ?self.ch, "switched connection pinned to TCP: {why}");
        }
        true
    }

    /// Never promote this connection again, in any process: its socket goes to a program that
    /// does not run the library (an exec, a spawn, an fd nobody claimed), which may write on
    /// it at any time. Called while this process still holds the side, so no promotion can
    /// have got past its stop (we would have had to be its only holder).
    pub fn pin_for_good(&self, why: &str) {
        if let Some((w, _)) = self.words() {
            w.switch.pin();
        }
        self.pin_to_tcp(why);
    }

    /// Waits until a promotion under way has moved our writes to the ring.
    pub fn complete_promotion(&self) {
        while self.path() == Path::Tcp && self.switched() {
            let seen = self.bell_seen();
            self.promote_step();
            if self.path() == Path::Tcp {
                self.wait_step(seen); // the peer's next step
            }
        }
    }

    /// The switch bell now, before a look at what the caller then waits for.
    fn bell_seen(&self) -> Option<u32> {
        let (w, _) = self.words()?;
        Some(memloop::channel::switch_bell_value(&w.bell))
    }

    /// Sleeps until the next step of the promotion on either side (the bell moved off `seen`),
    /// at most [`PEER_STEP`].
    fn wait_step(&self, seen: Option<u32>) {
        match (self.words(), seen) {
            (Some((w, _)), Some(v)) => memloop::channel::wait_switch_bell(&w.bell, v, PEER_STEP),
            _ => std::thread::sleep(PEER_STEP),
        }
    }

    /// How many more bytes TCP carries from the peer: `None` while the peer still writes TCP.
    pub(super) fn tcp_left(&self) -> Option<u64> {
        let (w, pw) = self.words()?;
        let other = super::switch::other(self.side);
        let stopped = match self.path() {
            // After we stopped the word may already be quiet again: then the peer stopped too.
            Path::Joining => w.switch.stopped(other) || !w.switch.promote_requested(),
            // Back on the ring (another thread moved the reads while this one was reading):
            // the peer stopped long ago, and whatever TCP still holds are its doorbells.
            Path::Ring => true,
            // Our mark gone from the word while we are on TCP: the promotion finished (the
            // peer read to our stop and cleared the word), so the peer stopped long before.
            // (Our own stop may have gone through an instant before our path says so.)
            _ => w.switch.stopped(other) || !w.switch.on_tcp(self.side),
        };
        stopped.then(|| {
            pw.tcp_stop
                .load(Acquire)
                .saturating_sub(self.tcp.received.load(Acquire))
        })
    }

    /// `recv` on a switched connection (see the module docs). `SWITCHED`: the reads are on
    /// the ring again.
    pub(super) fn tcp_recv(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        flags: c_int,
    ) -> Result<usize, c_int> {
        let fd = self.kfd();
        if flags & libc::MSG_OOB != 0 {
            return real::recv_vectored(fd, bufs, flags); // urgent data is outside the count
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        let peek = flags & libc::MSG_PEEK != 0;
        let waitall = flags & libc::MSG_WAITALL != 0 && !peek;
        let dontwait = flags & libc::MSG_DONTWAIT != 0 || self.nonblocking();
        let mut got = 0usize;
        loop {
            if got == want {
                return Ok(got);
            }
            let r = {
                // Paths change only between two of these reads (the read gate): what the
                // socket holds is data up to the peer's stop, its doorbells after.
                let _g = self.tcp.read_gate.lock();
                // Another thread may have moved the reads to the ring meanwhile (this one
                // slept in a peek): nothing on the socket is data then.
                if !self.switched() {
                    return if got > 0 { Ok(got) } else { Err(SWITCHED) };
                }
                let left = self.tcp_left();
                if left != Some(0) {
                    let max = (want - got).min(left.map_or(usize::MAX, |l| l as usize));
                    let mut part = window(bufs, got, max);
                    let f = (flags & !libc::MSG_WAITALL) | libc::MSG_DONTWAIT;
                    // (0 from the kernel is its EOF; 0 kept means all were doorbells.)
                    Some(real::recv_vectored(fd, &mut part, f).map(|n| match n {
                        0 => 0,
                        n => {
                            let k = self.keep_data(n, left, peek);
                            if k < n {
                                check_doorbells(&part, k, n);
                            }
                            tracing::trace!(ch = ?self.ch, n, k, ?left, path = ?self.path(),
                                received = self.tcp.received.load(Acquire), "tcp read");
                            k
                        }
                    }))
                } else {
                    None
                }
            };
            let Some(r) = r else {
                if got > 0 {
                    return Ok(got);
                }
                let seen = self.bell_seen();
                self.promote_step();
                if self.path() == Path::Ring {
                    return Err(SWITCHED);
                }
                // The peer is on its ring, our writes not yet (our send gate is busy): until
                // our writer stops (it rings the bell).
                self.wait_step(seen);
                continue;
            };
            match r {
                Ok(0) if self.tcp_left() != Some(0) => return Ok(got),
                Ok(0) => {} // all doorbells: the loop moves to the ring
                Ok(n) => {
                    got += n;
                    if peek || (!waitall && got > 0) {
                        return Ok(got);
                    }
                }
                Err(libc::EINTR) => {}
                Err(libc::EAGAIN) if dontwait => {
                    return if got > 0 { Ok(got) } else { Err(libc::EAGAIN) }
                }
                Err(libc::EAGAIN) => {
                    if let (Some(l), Some((w, pw))) = (self.tcp_left(), self.words()) {
                        tracing::trace!(ch = ?self.ch, side = ?self.side, left = l,
                            received = self.tcp.received.load(Acquire),
                            stop = pw.tcp_stop.load(Acquire), word = w.switch.0.load(Acquire),
                            path = ?self.path(), "waiting for the peer's last TCP bytes");
                    }
                    if let Err(e) = self.tcp_sleep(fd) {
                        return if got > 0 { Ok(got) } else { Err(e) };
                    }
                }
                Err(e) => return if got > 0 { Ok(got) } else { Err(e) },
            }
        }
    }

    /// Of `n` bytes just received (at most `left` were known to be data), how many are data:
    /// if the peer stopped meanwhile, what lies beyond its stop are its doorbells.
    fn keep_data(&self, n: usize, left: Option<u64>, peek: bool) -> usize {
        let n = match (left, self.tcp_left()) {
            (None, Some(room)) if n as u64 > room => {
                tracing::debug!(ch = ?self.ch, side = ?self.side, n, room, path = ?self.path(),
                    received = self.tcp.received.load(Acquire), "bytes past the peer's TCP stop");
                if !peek {
                    if let Some(w) = &self.share.side_words {
                        w.doorbells_read.fetch_add(n as u64 - room, AcqRel);
                    }
                }
                room as usize
            }
            _ => n,
        };
        if !peek {
            self.tcp.received.fetch_add(n as u64, AcqRel);
            // For `memloop status`: the switched connection's bytes on TCP.
            if let Some(p) = self.plain() {
                p.count_received(n as isize);
            }
        }
        n
    }

    /// Sleeps until the socket is readable, in a peek the kernel restarts after `SA_RESTART`
    /// signals and ends at `SO_RCVTIMEO`, as the program's own receive would.
    fn tcp_sleep(&self, fd: c_int) -> Result<(), c_int> {
        let mut b = [0u8; 1];
        match real::peek_blocking(fd, &mut b) {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `send` on a switched connection: TCP under the send gate while our writes are there;
    /// `SWITCHED` once they are on the ring again.
    pub(super) fn tcp_send(&self, bufs: &[IoSlice<'_>], flags: c_int) -> Result<usize, c_int> {
        let fd = self.kfd();
        if flags & libc::MSG_OOB != 0 && !self.pin_to_tcp("urgent data") {
            self.complete_promotion();
            return Err(SWITCHED); // the ring's way: it moves to TCP again for the urgent byte
        }
        let r = {
            let _g = self.tcp.gate.lock();
            if self.path() != Path::Tcp {
                return Err(SWITCHED);
            }
            let plain = self.plain();
            if let Some(p) = &plain {
                p.before_send();
            }
            let r = real::send_vectored(fd, bufs, flags);
            if let Ok(n) = r {
                let total = self.tcp.sent.fetch_add(n as u64, AcqRel) + n as u64;
                if let Some(p) = &plain {
                    p.count_sent(n as isize);
                }
                tracing::trace!(ch = ?self.ch, n, total, "tcp send");
            }
            r
        };
        if r.is_ok() && !self.switch_quiet() {
            self.promote_step();
        }
        r
    }

    /// One step of a promotion, as far as it can go now without waiting.
    pub(super) fn promote_step(&self) {
        self.promote_step_with(true);
    }

    /// [`Conn::promote_step`]; without `block`, skipped if another thread of ours is switching
    /// the connection (the heartbeat must not stall).
    pub(super) fn promote_step_with(&self, block: bool) {
        let Some((w, _)) = self.words() else { return };
        if !w.switch.promote_requested() && self.path() != Path::Joining {
            return;
        }
        let joined = {
            let _g = if block {
                self.switching.lock.lock()
            } else {
                match self.switching.lock.try_lock() {
                    Some(g) => g,
                    None => return,
                }
            };
            self.promote_locked(w, !block)
        };
        if joined {
            self.back_on_ring();
        }
    }

    /// The promotion steps under the switching lock; true once the reads moved to the ring.
    /// `spin`: wait a moment for the peer's next step (the heartbeat's sweep, where no call
    /// of the program drives the promotion; a data call goes back to its data instead).
    fn promote_locked(&self, w: &SideWords, spin: bool) -> bool {
        if self.let_go() {
            return false;
        }
        let other = super::switch::other(self.side);
        if self.path() == Path::Tcp {
            if !self.switching.handled.load(Acquire) {
                return false;
            }
            if !self.engine.cfg.promote {
                // Not following promotions here (see `Config::promote`): called off, which
                // always works before we are ready.
                if w.switch.cancel_promotion() {
                    tracing::debug!(ch = ?self.ch, "promotion called off (MEMLOOP_PROMOTE=0)");
                }
                return false;
            }
            if !self.region_open() && w.switch.cancel_promotion() {
                // The operator paused the region: no ring now (past a stop the call-off fails
                // and the promotion completes; the pause demotes it again).
                tracing::debug!(ch = ?self.ch, "promotion called off: the region is paused");
                return false;
            }
            if self.tcp.unpromotable.load(Acquire) || w.switch.pinned() {
                // Pinned (here, or for good in the channel: an unseen program holds the
                // socket): we never get ready, so the peer never stops, and this always works.
                w.switch.cancel_promotion();
                return false;
            }
            if self.still_shared() {
                return false; // another process writes here too: its counts are not ours
            }
            // Held by a process this one was not told of (`pidfd_getfd`, `grab.rs`): it may
            // write after our stop. While it takes the socket its grab is counted in the
            // word (nobody stops: called off); its hold stays in `holders` after. (The word
            // first: a grab seen dropped comes with the holds its process left.)
            if self.grab_blocks_promotion(w) || w.holders.load(Acquire) > 1 {
                return false;
            }
            if !w.switch.ready(self.side)
                && (self.shut_wr.load(Acquire) || self.shut_rd.load(Acquire))
            {
                // Half-closed: the FIN went (or goes) on TCP, where it stays. (Not ready yet,
                // so the peer cannot have stopped: the call-off works.)
                self.pin_to_tcp("shut down");
                return false;
            }
            if !w.switch.ready(self.side) && !self.sync_tcp_counts() {
                return false;
            }
            if !w.switch.ready(self.side) {
                if let Err(e) = self.get_ready() {
                    tracing::debug!(ch = ?self.ch, errno = e, "promotion: not ready");
                    self.pin_to_tcp("could not drop stale ring bytes"); // not ready: works
                    return false;
                }
                if !w.switch.set_ready(self.side) {
                    return false; // called off meanwhile
                }
                tracing::debug!(ch = ?self.ch, side = ?self.side, "promotion: ready");
                // (A peer not ready yet was woken by the request; one ready first sees us
                // ready, or we see it, and stop: that step wakes it.)
                self.ring_bell();
            }
            // Both ends were woken by the request: the peer's step is most likely a moment
            // away, and waiting here for it saves a wake-up of ours per step (the last to
            // stop finishes at once, and the first would otherwise finish only once the
            // peer's doorbell or a later call woke it).
            let peer_ready = || w.switch.ready(other);
            if peer_ready() || (spin && self.spin_for_peer_step(peer_ready)) {
                self.try_stop(w);
                if spin && self.path() == Path::Joining {
                    self.spin_for_peer_step(|| {
                        w.switch.stopped(other) || !w.switch.promote_requested()
                    });
                }
            }
        }
        let _r = self.tcp.read_gate.lock();
        if self.path() == Path::Joining && self.tcp_left() == Some(0) {
            // (An ioctl only when someone reads the debug log: bytes still queued are doorbells.)
            let queued = tracing::enabled!(tracing::Level::DEBUG).then(|| real::queued(self.kfd()));
            tracing::debug!(ch = ?self.ch, side = ?self.side, received = self.tcp.received.load(Acquire),
                stop = self.switching.peer.as_ref().map(|p| p.tcp_stop.load(Acquire)), ?queued,
                "promotion: all TCP data read");
            self.decision.path.store(Path::Ring, Release);
            self.switching.handled.store(false, Release);
            // (Read before the finish clears it: a late ring counts as `late`.)
            let late = w.switch.reason() == Some(SwitchReason::Late);
            if w.switch.finish_promotion() {
                // Counted once per connection: by the side that closes the promotion.
                let reason = if late {
                    SwitchReason::Late
                } else {
                    SwitchReason::Promoted
                };
                self.engine.registry().count_switch(reason);
            }
            tracing::debug!(target: super::PROMOTE_EVENTS, ch = ?self.ch, side = ?self.side, "promoted: back on the ring");
            return true;
        }
        false
    }

    /// Step 1: drop the stale bytes of our rx ring (the peer re-sent them over TCP) and reset
    /// the doorbell arms.
    fn get_ready(&self) -> Result<(), c_int> {
        let mut cons = self.rings.cons.lock();
        let mut prod = self.rings.prod.lock();
        cons.resync().map_err(|_| libc::EIO)?;
        prod.resync().map_err(|_| libc::EIO)?;
        // (Nothing new comes until we are ready: one look empties it, without a copy.)
        if let Err(e) = cons.skip_all() {
            tracing::debug!(ch = ?self.ch, "dropping stale ring bytes: {e}");
            return Err(libc::EIO);
        }
        for (i, cell) in [(0usize, cons.wait_cell()), (1, prod.wait_cell())] {
            let s = &self.sleepers;
            let armed = s.arms[i].swap(0, AcqRel)
                + s.futex_arms[i].swap(0, AcqRel)
                + s.target_arms[i].swap(0, AcqRel);
            if armed > 0 {
                cell.set_flag(0);
            }
        }
        self.sleepers.owed.store(0, Release);
        Ok(())
    }

    /// Step 2: publish our TCP stop position and write to the ring from now on — only if no
    /// TCP send of ours is under way (it may be blocked until the peer reads).
    fn try_stop(&self, w: &SideWords) {
        let Some(_g) = self.tcp.gate.try_lock() else {
            return;
        };
        if self.plain().is_some_and(|p| !p.resent()) {
            return; // re-sent bytes still going out: they come before the stop
        }
        // Our leave record goes only now: the peer is ready, so it has taken over and read
        // it. (Reset when we got ready, a peer still leaving — let into the promotion by
        // marks it had not set yet — would wait for it for good.)
        if let Ok(cell) = LeaveCell::new(&w.leave, 0) {
            cell.reset();
        }
        let stop = self.tcp.sent.load(Acquire);
        w.tcp_stop.store(stop, Release);
        if !w.switch.set_stopped(self.side) {
            return; // called off meanwhile
        }
        tracing::debug!(ch = ?self.ch, side = ?self.side, stop, "promotion: TCP writes stop");
        // (A demote while we come back carries our tail, unless it is found not to fit.)
        self.switching.carry_refused.store(false, Release);
        self.decision.path.store(Path::Joining, Release);
        // A peer asleep on the socket for our data wakes (counted: it comes after the stop).
        self.ring_doorbell_locked(false);
        if w.switch.stopped(other(self.side)) {
            self.ring_bell();
        } else {
            self.tell_peer(); // it stops next, even in none of our calls
        }
    }

    /// Reads and writes on the ring again: drop the TCP record; the epoll sets holding the
    /// connection answer it from the ring again.
    fn back_on_ring(&self) {
        *self.decision.plain.lock() = None;
        real::set_sockopt_int(self.kfd(), libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
        self.epoll_follow_path();
    }
}

/// Bytes `from..to` of `bufs` were taken for the peer's doorbells: they must be.
fn check_doorbells(bufs: &[IoSliceMut<'_>], from: usize, to: usize) {
    let mut taken = bufs
        .iter()
        .flat_map(|b| b.iter())
        .skip(from)
        .take(to - from);
    if let Some(at) = taken.position(|&b| b != 1) {
        tracing::error!(at, of = to - from, "data received past the peer's TCP stop");
    }
}

/// `bufs` from byte `skip` on, at most `max` bytes.
fn window<'a>(
    bufs: &'a mut [IoSliceMut<'_>],
    mut skip: usize,
    mut max: usize,
) -> Vec<IoSliceMut<'a>> {
    let mut out = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        if max == 0 {
            break;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let end = b.len().min(skip + max);
        max -= end - skip;
        out.push(IoSliceMut::new(&mut b[skip..end]));
        skip = 0;
    }
    out
}
