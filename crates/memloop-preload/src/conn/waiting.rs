//! Readiness and sleeping. A thread (or an epoll set) that must sleep on a ring connection
//! arms the ring end's doorbell flag and sleeps on the kernel socket; the peer, seeing the
//! flag, sends one byte over TCP. Arms are counted per direction and doorbells owed are
//! drained, so no byte is left to make the socket look readable after the data is consumed.

use super::io::reset_of;
use super::{Conn, Dir};
use crate::real::{self, Drain};
use libc::c_int;
use memloop_ring::presence::{self, End, Presence};
use memloop_ring::wait::{flag_target, target_bits, WAIT_DOORBELL, WAIT_FUTEX};
use memloop_ring::{park_until, spin_plan, Park, SpinInputs, SpinPlan, Spinner, WaitCell};
use memloop_shm::futex::Woken;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::*};
use std::time::{Duration, Instant};

/// `waiters` bit: a thread is draining doorbells; nobody may start sleeping meanwhile.
const DRAINING: u32 = 1 << 31;

pub(super) struct Sleepers {
    /// Threads (and sleeping epoll sets) asleep on the kernel socket, plus the DRAINING bit.
    pub(super) waiters: AtomicU32,
    /// Doorbell arms per direction (read, write): several waiters of this process may sleep
    /// on one ring end; its flag is cleared only when the last of them disarms.
    pub(super) arms: [AtomicU32; 2],
    /// Futex arms per direction: threads blocked alone in a call, asleep on the ring end's
    /// futex word (the flag's [`WAIT_FUTEX`] bit).
    pub(super) futex_arms: [AtomicU32; 2],
    /// Doorbell arms per direction that name a wake target (a wait set's socket,
    /// `crate::wake`) instead: all of one target; an arm for another target is a plain
    /// doorbell arm.
    pub(super) target_arms: [AtomicU32; 2],
    pub(super) target: [AtomicU32; 2],
    /// Threads asleep on a futex (any direction): the heartbeat looks after them.
    pub(super) futex_sleeping: AtomicU32,
    /// The kernel futexes this connection's ring memory (not a device mapping).
    pub(super) futex_ok: AtomicBool,
    /// Doorbells the peer rang for our arms that no drain has read yet.
    pub(super) owed: AtomicU32,
    /// The socket may hold a doorbell nobody counted ([`Conn::note_socket_ready`]).
    pub(super) maybe_bell: AtomicBool,
    pub(super) spinner: Spinner,
}

impl Sleepers {
    pub(super) fn new(spin: Duration) -> Self {
        Sleepers {
            waiters: AtomicU32::new(0),
            arms: [AtomicU32::new(0), AtomicU32::new(0)],
            futex_arms: [AtomicU32::new(0), AtomicU32::new(0)],
            target_arms: [AtomicU32::new(0), AtomicU32::new(0)],
            target: [AtomicU32::new(0), AtomicU32::new(0)],
            futex_sleeping: AtomicU32::new(0),
            futex_ok: AtomicBool::new(true),
            owed: AtomicU32::new(0),
            maybe_bell: AtomicBool::new(false),
            spinner: Spinner::new(spin),
        }
    }
}

/// One ring end's sleeper counts (this process's): doorbell, futex and targeted arms, and
/// the target of the latter.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Counts {
    doorbell: u32,
    futex: u32,
    targeted: u32,
    target: u32,
}

impl Counts {
    /// The flag value these sleepers need.
    fn bits(self) -> u32 {
        let mut bits = 0;
        if self.doorbell > 0 {
            bits |= WAIT_DOORBELL;
        }
        if self.futex > 0 {
            bits |= WAIT_FUTEX;
        }
        if self.targeted > 0 {
            bits |= target_bits(self.target);
        }
        bits
    }
}

/// One ring end's sleeper counts and flag, under that end's lock.
struct EndFlag<'a> {
    doorbell: &'a AtomicU32,
    futex: &'a AtomicU32,
    targeted: &'a AtomicU32,
    target: &'a AtomicU32,
    cell: &'a WaitCell,
    /// Set when an update found the flag cleared while it named a target.
    woke_target: std::cell::Cell<bool>,
}

impl EndFlag<'_> {
    fn counts(&self) -> Counts {
        Counts {
            doorbell: self.doorbell.load(Relaxed),
            futex: self.futex.load(Relaxed),
            targeted: self.targeted.load(Relaxed),
            target: self.target.load(Relaxed),
        }
    }

    /// Applies `change` to the counts and sets the flag to match if `store` says so (given
    /// the flag values before and after). True if the flag was found cleared while it asked
    /// for a doorbell: the peer rang one for our sleepers, one more byte owed.
    fn update(
        &self,
        change: impl FnOnce(&mut Counts),
        store: impl FnOnce(u32, u32) -> bool,
    ) -> bool {
        let before = self.counts();
        let mut after = before;
        change(&mut after);
        self.doorbell.store(after.doorbell, Relaxed);
        self.futex.store(after.futex, Relaxed);
        self.targeted.store(after.targeted, Relaxed);
        self.target.store(after.target, Relaxed);
        if !store(before.bits(), after.bits()) {
            return false;
        }
        let old = self.cell.set_flag(after.bits());
        let cleared = old == 0 && before.bits() != 0;
        if cleared && flag_target(before.bits()) != 0 {
            // A wake-up went to the target — or, if it could not, a doorbell to the socket.
            self.woke_target.set(true);
        }
        cleared && before.bits() & WAIT_DOORBELL != 0
    }
}

impl Conn {
    /// Wakes the peer's sleepers outside the ring as `wake` (what the ring's notifications
    /// returned) asks: a datagram to its wake target, a doorbell byte over TCP — the latter
    /// also when the datagram cannot go.
    pub(super) fn wake_peer(&self, wake: u32) {
        if wake != 0 {
            let shared = self.side_lock();
            self.wake_peer_locked(wake, shared.is_some());
        }
    }

    /// [`Conn::wake_peer`] with the side lock already held when `shared`.
    pub(super) fn wake_peer_locked(&self, wake: u32, shared: bool) {
        let target = flag_target(wake);
        let mut doorbell = wake & WAIT_DOORBELL != 0;
        if target != 0 && !crate::wake::send(target, self.ch.idx) {
            doorbell = true;
        }
        if doorbell {
            self.ring_doorbell_locked(shared);
        }
    }

    /// Sends one doorbell byte to the peer, counted where every process holding this side
    /// sees it (a switch to TCP discards exactly the peer's unread ones). None once this side
    /// left its ring: the count is published then, and TCP may carry data from then on.
    pub fn ring_doorbell(&self) {
        let shared = self.side_lock();
        self.ring_doorbell_locked(shared.is_some());
    }

    /// [`Conn::ring_doorbell`] with the side lock already held when `shared`.
    pub(super) fn ring_doorbell_locked(&self, shared: bool) {
        let _b = self.switching.bell.lock();
        // (While coming back from TCP our doorbells follow our last TCP byte: allowed.)
        let rung = matches!(self.path(), super::Path::Ring | super::Path::Joining);
        // (A closed side's fd may be closed too, and its number reused by another socket.)
        if !rung || (shared && self.side_left()) || self.share.side_closed.load(Acquire) {
            return;
        }
        if real::ring_doorbell(self.kfd()) {
            if let Some(w) = self.counting() {
                w.doorbells_sent.fetch_add(1, Relaxed);
            }
            // (A doorbell costs a TCP send: one more shared add is nothing beside it.)
            self.engine
                .registry()
                .bump_counter(memloop::registry::COUNTER_DOORBELLS);
        }
    }

    /// The side words to count doorbells in — only while the connection is on its ring and
    /// our side is not closed: otherwise the channel may be freed (a cancelled offer, a
    /// closed side) and its slot reused, and a late count would land on the next occupant.
    fn counting(&self) -> Option<&memloop::registry::SideWords> {
        let rung = matches!(self.path(), super::Path::Ring | super::Path::Joining);
        if !rung || self.share.side_closed.load(Acquire) {
            return None;
        }
        self.share.side_words.as_ref()
    }

    /// Another process holding this side has left the ring (its leave record is set).
    pub(super) fn side_left(&self) -> bool {
        let Some(w) = &self.share.side_words else {
            return false;
        };
        memloop_ring::leave::LeaveCell::new(&w.leave, 0)
            .map_or(true, |c| !matches!(c.read(), Ok(None)))
    }

    /// Stops every drain of this process (waiting out one in progress) while the leave
    /// publishes its count; drains started afterwards see the path has left the ring.
    pub(super) fn stop_drains(&self) {
        loop {
            let v = self.sleepers.waiters.load(Acquire);
            if v & DRAINING == 0
                && self
                    .sleepers
                    .waiters
                    .compare_exchange_weak(v, v | DRAINING, AcqRel, Acquire)
                    .is_ok()
            {
                return;
            }
            std::thread::yield_now();
        }
    }

    pub(super) fn resume_drains(&self) {
        self.sleepers.waiters.fetch_and(!DRAINING, AcqRel);
    }

    /// Drains doorbells from the kernel socket, noting a closed or reset peer.
    ///
    /// Doorbells are consumed only while no thread of ours sleeps on this socket, and no thread
    /// starts sleeping until the drain is over (the DRAINING bit of `waiters`): a drain
    /// overlapping another thread's arm-recheck-sleep could otherwise swallow the doorbell that
    /// thread is waiting for.
    pub fn drain(&self) {
        if self.kfd() < 0 {
            return; // closed here: nothing to read, and nothing to learn about the peer
        }
        if self
            .sleepers
            .waiters
            .compare_exchange(0, DRAINING, AcqRel, Acquire)
            .is_err()
        {
            return; // a sleeper will drain when it is the last one out
        }
        self.drain_now();
        self.sleepers.waiters.store(0, Release);
    }

    /// Reads the doorbells queued on the socket — only while this side is on its ring: after
    /// a leave the socket may carry data. A shared side drains under the side lock, which the
    /// leave takes too, so its count is final when the leave reads it.
    pub(super) fn drain_now(&self) {
        let shared = self.side_lock();
        if self.path() != super::Path::Ring || (shared.is_some() && self.side_left()) {
            return;
        }
        let (state, bytes) = real::drain_doorbells(self.kfd());
        if let Some(w) = self.counting() {
            w.doorbells_read.fetch_add(bytes as u64, Relaxed);
        }
        let read = u32::try_from(bytes).unwrap_or(u32::MAX);
        // The closure always returns Some: this update cannot fail.
        let _ = self
            .sleepers
            .owed
            .fetch_update(Relaxed, Relaxed, |o| Some(o.saturating_sub(read)));
        match state {
            Drain::Open => {}
            Drain::Closed => self.set_peer_closed(),
            Drain::Reset => {
                self.peer.peer_reset.store(true, Release);
                self.set_peer_closed();
            }
        }
    }

    /// poll-style readiness of a ring connection.
    /// [`Conn::revents`] for a waiter that does not ask for `POLLOUT`: while nothing but
    /// data to read can be reported, the ring we write is not looked at (each look costs
    /// cache misses on lines the peer writes: in an epoll set of thousands of readers the
    /// main cost of a wait).
    pub fn revents_for(&self, want_out: bool) -> i16 {
        let quiet_ends = !self.peer_closed()
            && !self.shut_rd.load(Relaxed)
            && !self.shut_wr.load(Relaxed)
            && !self.peer.peer_reset.load(Acquire)
            && !self.peer.peer_dead.load(Acquire);
        if !want_out && quiet_ends {
            // (Bytes there and no shutdown: three words say so.)
            if self.rx_has_unread() {
                return libc::POLLIN;
            }
            if let Some(rx) = self
                .rx_probe()
                .filter(|p| !p.writer_shut && !p.writer_reset)
            {
                return if rx.used > 0 { libc::POLLIN } else { 0 };
            }
        }
        self.revents()
    }

    pub fn revents(&self) -> i16 {
        let (Some(rx), Some(tx)) = (self.rx_probe(), self.tx_probe()) else {
            return libc::POLLERR | libc::POLLIN | libc::POLLOUT;
        };
        // As the kernel: the peer's FIN is POLLIN|POLLRDHUP; POLLHUP needs both directions
        // shut (or a reset); after our own SHUT_WR a write fails at once, so POLLOUT.
        let unread = tx.used > 0;
        let reset = reset_of(rx.writer_reset, rx.writer_shut, &self.peer, unread);
        let fin = rx.writer_shut || reset || self.peer_closed();
        let shut_rd = self.shut_rd.load(Relaxed);
        let shut_wr = self.shut_wr.load(Relaxed);
        let mut ev = 0;
        if rx.used > 0 || fin || shut_rd {
            ev |= libc::POLLIN;
        }
        if fin || shut_rd {
            ev |= libc::POLLRDHUP;
        }
        if tx.free() > 0 || shut_wr || tx.reader_closed || self.peer_closed() {
            ev |= libc::POLLOUT;
        }
        if reset || (fin && shut_wr) {
            ev |= libc::POLLHUP;
        }
        if reset && !self.peer.reset_reported.load(Relaxed) {
            ev |= libc::POLLERR;
        }
        ev
    }

    /// The TCP phase this connection is in (after a switch's takeover, which read the
    /// peer's doorbells off the socket), if it is on TCP or coming back from it: taken before
    /// the kernel is asked about the socket, for [`Conn::off_ring_revents`].
    pub fn tcp_phase(&self) -> Option<u64> {
        matches!(self.path(), super::Path::Tcp | super::Path::Joining)
            .then(|| self.tcp.epoch.load(Acquire))
    }

    /// poll-style readiness of a connection of ours that is off its ring (leaving it, on TCP
    /// after a switch, or coming back), from `kernel`, the kernel's answer for its socket,
    /// asked in TCP phase `asked_in` ([`Conn::tcp_phase`] just before). The socket carries
    /// data only between a switch's takeover and the peer's stop: while the peer leaves its
    /// ring, and once it stopped writing TCP for a promotion, what is queued there are its
    /// doorbells, and a program told "readable" would block in its read (two socats, each in
    /// a blocking read that only the other's next write would end, hung for good).
    pub fn off_ring_revents(&self, kernel: i16, asked_in: Option<u64>) -> i16 {
        const READ: i16 = libc::POLLIN | libc::POLLRDNORM | libc::POLLRDHUP;
        let path = self.path();
        match path {
            super::Path::Ring => return self.revents(), // back on the ring meanwhile
            super::Path::Tcp | super::Path::Joining => {}
            // Leaving: nothing new until the takeover (the design's rule).
            _ => return 0,
        }
        let mut ev = kernel;
        // The kernel looked within this TCP phase (not before its takeover discarded the
        // peer's doorbells): what it saw up to the peer's stop was data, and a peer not
        // stopped now had not stopped then.
        if asked_in.is_none() || asked_in != self.tcp_phase() {
            ev &= !READ;
        }
        if self.tcp_left() == Some(0) {
            // All the peer's TCP data is read: the reads go on from the ring (the promotion
            // gets there in the read call), which has the peer's bytes since its stop.
            ev = (ev & !READ) | (self.revents() & (libc::POLLIN | libc::POLLRDHUP));
        }
        if path == super::Path::Joining {
            // Our writes go to the ring: its room, not the socket's.
            ev = (ev & !(libc::POLLOUT | libc::POLLWRNORM)) | (self.revents() & libc::POLLOUT);
        }
        ev
    }

    /// [`Conn::off_ring_revents`] of a fresh look at the socket (for epoll, which asks the
    /// kernel per connection; poll looks at all its fds at once).
    pub fn off_ring_look(&self, events: i16) -> i16 {
        let phase = self.tcp_phase();
        let mut p = [libc::pollfd {
            fd: self.kfd(),
            events,
            revents: 0,
        }];
        let kernel = match real::poll_now(&mut p) {
            Ok(_) => p[0].revents,
            Err(_) => 0,
        };
        self.off_ring_revents(kernel, phase)
    }

    /// For a poll's sleep on the socket of a connection of ours off its ring: the events the
    /// kernel can answer for (of the program's `events`), and whether the connection's
    /// readiness can change without the kernel seeing it — a switch in flight, whose socket
    /// holds doorbells or whose writes go to the ring: the sleeper must look again soon.
    pub fn off_ring_sleep(&self, events: i16) -> (i16, bool) {
        let path = self.path();
        if !matches!(path, super::Path::Tcp | super::Path::Joining) {
            return (0, true); // leaving (or back on the ring: look again at once)
        }
        let mut ev = events;
        let mut soon = false;
        if self.tcp_left() == Some(0) {
            ev &= !(libc::POLLIN | libc::POLLRDNORM | libc::POLLRDHUP);
            soon = true;
        }
        if path == super::Path::Joining && ev & (libc::POLLOUT | libc::POLLWRNORM) != 0 {
            ev &= !(libc::POLLOUT | libc::POLLWRNORM);
            soon = true;
        }
        (ev, soon)
    }

    /// Whether a `dir` call would not block (only that direction's ring is read). A switch
    /// to deal with, or one done, ends a wait too.
    pub fn ready(&self, dir: Dir) -> bool {
        if self.peer_closed() || self.switch_pending() {
            return true;
        }
        match (self.path(), dir) {
            (super::Path::Ring, _) | (super::Path::Joining, Dir::Write) => {}
            _ => return true,
        }
        match dir {
            Dir::Read => {
                self.shut_rd.load(Relaxed)
                    || self
                        .rx_probe()
                        .map_or(true, |p| p.used > 0 || p.writer_shut)
            }
            Dir::Write => {
                self.shut_wr.load(Relaxed)
                    || self
                        .tx_probe()
                        .map_or(true, |p| p.free() > 0 || p.reader_closed)
            }
        }
    }

    /// Arms our doorbell flag for `dir`: the peer's next publication (or release) will send a
    /// doorbell byte. Counted: the flag stays armed until every arm is matched by a disarm.
    /// The caller re-checks readiness afterwards.
    pub fn arm(&self, dir: Dir) {
        self.arm_for(dir, None);
    }

    /// [`Conn::arm`] for a sleeper that also listens on wake target `target`: the peer wakes
    /// it there instead of over TCP when it can (a peer in our kernel, an end no other process
    /// holds, no other target armed on it). Returns whether the arm is a targeted one (its
    /// disarm must say so).
    pub fn arm_for(&self, dir: Dir, target: Option<u32>) -> bool {
        let target = target.filter(|_| self.wakes_by_name());
        let mut targeted = false;
        self.with_flag(dir, |f| {
            let cleared = f.update(
                |c| match target {
                    Some(t) if c.targeted == 0 || c.target == t => {
                        c.targeted += 1;
                        c.target = t;
                        targeted = true;
                    }
                    _ => c.doorbell += 1,
                },
                |_, _| true,
            );
            self.owe_if(cleared);
        });
        targeted
    }

    /// Whether the peer can wake a target of ours directly (a datagram naming the channel)
    /// rather than by a doorbell: a peer in our kernel, an end no other process holds.
    pub fn wakes_by_name(&self) -> bool {
        self.peer.same_kernel && !self.share.shared.load(Acquire)
    }

    /// Arms `dir` again for a waiter that already holds an arm: a doorbell the peer sent
    /// cleared the flag, and this waiter is about to sleep once more.
    pub fn rearm(&self, dir: Dir) {
        self.with_flag(dir, |f| {
            self.owe_if(f.update(|_| {}, |before, _| before & !WAIT_FUTEX != 0));
        });
    }

    pub fn disarm(&self, dir: Dir) {
        self.disarm_for(dir, false);
    }

    /// Withdraws an arm made by [`Conn::arm_for`] (`targeted`: what it returned). True if
    /// the peer woke the target meanwhile (a wake-up is queued on the target's socket).
    pub fn disarm_for(&self, dir: Dir, targeted: bool) -> bool {
        let mut woke = false;
        self.with_flag(dir, |f| {
            let cleared = f.update(
                |c| match targeted {
                    true => c.targeted = c.targeted.saturating_sub(1),
                    false => c.doorbell = c.doorbell.saturating_sub(1),
                },
                |b, a| b != a,
            );
            self.owe_if(cleared);
            woke = f.woke_target.get();
        });
        // (A wake-up that fell back to a doorbell leaves a byte the kernel reports: the set's
        // or poll's look at the socket then has it read.)
        woke
    }

    /// The connection's socket may hold a doorbell no arm counted (a wake-up that fell back,
    /// a socket the kernel reported readable): the last sleeper out reads it.
    pub fn note_socket_ready(&self) {
        self.sleepers.maybe_bell.store(true, Relaxed);
    }

    fn owe_if(&self, cleared: bool) {
        if cleared {
            self.sleepers.owed.fetch_add(1, Relaxed);
        }
    }

    /// Arms `dir`'s futex bit for a thread about to sleep on the ring end's futex word;
    /// returns the word's cell and its value before the arm (the thread re-checks, then
    /// sleeps while the word holds it). None once the connection left its ring.
    fn arm_futex(&self, dir: Dir) -> Option<(WaitCell, u32)> {
        let mut armed = None;
        self.with_flag(dir, |f| {
            let seq = f.cell.seq_now();
            self.owe_if(f.update(|c| c.futex += 1, |_, _| true));
            armed = Some((f.cell.clone(), seq));
        });
        armed
    }

    fn disarm_futex(&self, dir: Dir) {
        self.with_flag(dir, |f| {
            let cleared = f.update(|c| c.futex = c.futex.saturating_sub(1), |b, a| b != a);
            self.owe_if(cleared);
        });
    }

    /// Drains the doorbells the peer rang for our arms, if any are still unread: a byte
    /// left on the socket would keep reporting the socket (and any epoll set holding it)
    /// readable after the data it announced was consumed.
    pub fn drain_owed(&self) {
        if self.sleepers.owed.load(Relaxed) > 0 {
            self.drain();
        }
    }

    /// Runs `f` on `dir`'s sleeper counts and ring flag under that ring end's lock, so an
    /// arm and the last disarm of another thread cannot interleave between count and flag.
    ///
    /// Not once the connection left its ring: the leave holds both locks when it changes the
    /// path, and after a switch the channel (and its ring memory) may be freed and reused.
    fn with_flag(&self, dir: Dir, f: impl FnOnce(&EndFlag<'_>)) {
        let s = &self.sleepers;
        let flag = |i: usize, cell| EndFlag {
            doorbell: &s.arms[i],
            futex: &s.futex_arms[i],
            targeted: &s.target_arms[i],
            target: &s.target[i],
            cell,
            woke_target: std::cell::Cell::new(false),
        };
        match dir {
            Dir::Read => {
                let end = self.rings.cons.lock();
                if self.path() == super::Path::Ring {
                    f(&flag(0, end.wait_cell()));
                }
            }
            Dir::Write => {
                let end = self.rings.prod.lock();
                if matches!(self.path(), super::Path::Ring | super::Path::Joining) {
                    f(&flag(1, end.wait_cell()));
                }
            }
        }
    }

    /// Whether a blocking call's sleep on `dir` may be a futex sleep: a peer in our kernel,
    /// no time limit (the kernel's `EINTR` rule for timed socket waits is not the futex's),
    /// a ring end this process holds alone (another process's arms share its flag), memory
    /// the kernel can futex on.
    fn futex_sleep_allowed(&self, deadline: Option<Instant>) -> bool {
        self.engine.cfg.direct_wake
            && self.peer.same_kernel
            && deadline.is_none()
            && !self.nonblock.load(Relaxed)
            && !self.share.shared.load(Acquire)
            && self.sleepers.futex_ok.load(Relaxed)
            && self.engine.node.region().futex_usable()
    }

    /// For the heartbeat: a thread asleep on this connection's futex is woken when nothing
    /// the peer publishes can wake it — the peer died (no FIN reaches a futex), or another
    /// process now shares the ring end (its arms may have overwritten our flag bit).
    pub(super) fn look_after_futex_sleepers(&self) {
        if self.sleepers.futex_sleeping.load(Acquire) == 0 {
            return;
        }
        // (Off the ring the channel's sides may be closed by the switch, or the channel
        // freed: its words say nothing of the peer then. A sleeper still counted there wakes
        // anyway: it was woken by the leave and is on its way out, or missed it.)
        let on_ring = self.path() == super::Path::Ring;
        let dead = on_ring && (self.socket_hung_up() || self.peer.watch.dead());
        if dead {
            self.set_peer_closed();
        }
        if dead || !on_ring || self.share.shared.load(Acquire) {
            tracing::debug!(ch = ?self.ch, dead, "waking futex sleepers");
            for cell in &self.rings.own_cells {
                cell.wake_sleepers();
            }
        }
    }

    /// Our kernel socket says the peer's is gone (its FIN, a reset): on the ring the peer
    /// never shuts its socket down, so it closed or died — a killed process in another pid
    /// namespace is seen here at the next beat, not after its heartbeat went stale. (Not once
    /// our side left its ring: the peer's FIN may then follow its takeover.)
    fn socket_hung_up(&self) -> bool {
        if !self.peer.same_kernel || self.side_switched() {
            return false;
        }
        let hup = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
        real::wait_fd(self.kfd(), hup, Some(Duration::ZERO)).is_ok_and(|ev| ev & hup != 0)
    }

    /// The longest spin before sleeping: longer towards another kernel.
    pub fn spin_window(&self) -> Duration {
        self.engine.cfg.spin_for(self.peer.same_kernel)
    }

    /// Spins with this connection's adaptive window (poll over several fds borrows it), as
    /// long as spinning can pay for one of `conns` (the poll's ring members; see
    /// [`spin_inputs_of`]).
    pub fn spin(&self, conns: &[&Conn], ready: impl FnMut() -> bool) -> bool {
        self.sleepers
            .spinner
            .spin_with(self.spin_window(), || spin_inputs_of(conns), ready)
    }

    /// Publishes our presence in the words of both our ring ends (our tx ring's producer,
    /// our rx ring's consumer) — only while the connection is on its ring and our side is
    /// not released: a closed channel's ring memory may be reused by another channel.
    fn publish_presence(&self, p: Presence) {
        if self.path() != super::Path::Ring
            || self.share.released.load(Acquire)
            || self.share.side_closed.load(Acquire)
        {
            return;
        }
        presence::publish(&self.rings.tx_view, End::Producer, p);
        presence::publish(&self.rings.rx_view, End::Consumer, p);
    }

    /// What the spin policy needs about this connection (at the start of a wait, on `cpu`
    /// with the machine's `load`): the peer's published presence, whether its waiting flags
    /// (one per ring) are still armed if it says it is asleep — and our own presence,
    /// published on the way. Off the ring nothing is known.
    pub fn spin_inputs_at(&self, our_cpu: Option<u32>, load: Option<(u32, u32)>) -> SpinInputs {
        if self.path() != super::Path::Ring {
            return SpinInputs::UNKNOWN;
        }
        self.publish_presence(Presence::running(our_cpu));
        // The peer writes both its words; its rx ring's consumer word is in our tx ring.
        let peer = presence::read(&self.rings.rx_view, End::Producer);
        let peer_woken = matches!(peer, Presence::Asleep { .. }).then(|| {
            !(presence::waiting(&self.rings.tx_view, End::Consumer)
                || presence::waiting(&self.rings.rx_view, End::Producer))
        });
        SpinInputs {
            peer,
            peer_woken,
            our_cpu,
            load,
        }
    }

    /// Blocks until `dir` is ready, the deadline passes (`EAGAIN`) or a signal arrives
    /// (`EINTR`, unless `SA_RESTART` made the kernel restart our sleep).
    pub(super) fn wait(&self, dir: Dir, deadline: Option<Instant>) -> Result<(), c_int> {
        let r = self.wait_ring(dir, deadline);
        // Woken by a switch (asked for, or done by another thread): deal with it, and the
        // caller goes to the kernel socket.
        self.settle_switch();
        self.on_ring(dir == Dir::Write)?;
        r
    }

    fn wait_ring(&self, dir: Dir, deadline: Option<Instant>) -> Result<(), c_int> {
        if self.sleepers.spinner.spin_with(
            self.spin_window(),
            || spin_inputs_of(&[self]),
            || self.ready(dir),
        ) {
            return Ok(());
        }
        // Across kernels, time a death during this wait from now (the first heartbeat look).
        if !self.peer.same_kernel {
            self.check_peer();
        }
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let mut park = ConnPark {
            conn: self,
            dir,
            futex_allowed: self.futex_sleep_allowed(deadline),
            futex: None,
        };
        match park_until(&mut park, timeout, || Ok(self.ready(dir))) {
            Ok(true) => Ok(()),
            Ok(false) => Err(libc::EAGAIN),
            Err(e) => Err(e),
        }
    }

    /// Counts a sleeper on the kernel socket (a thread, or an epoll set with a sleeping
    /// thread), after any drain in progress has finished; our presence says asleep.
    pub fn enter_wait(&self) {
        self.publish_presence(Presence::Asleep {
            cpu: memloop_shm::sched::current_cpu(),
        });
        loop {
            let v = self.sleepers.waiters.load(Acquire);
            if v & DRAINING != 0 {
                std::hint::spin_loop();
                continue;
            }
            if self
                .sleepers
                .waiters
                .compare_exchange_weak(v, v + 1, AcqRel, Acquire)
                .is_ok()
            {
                return;
            }
        }
    }

    /// The sleeper is awake. Another one may need the doorbell byte too: the last one out
    /// drains.
    pub fn leave_wait(&self) {
        self.publish_presence(Presence::running(memloop_shm::sched::current_cpu()));
        if self.sleepers.waiters.fetch_sub(1, AcqRel) == 1
            && (self.sleepers.owed.load(Relaxed) > 0
                || self.sleepers.maybe_bell.swap(false, Relaxed))
        {
            // (Only then: with wake-ups off the socket, a look at it would mostly find nothing
            // and cost a system call per sleep.)
            self.drain();
        }
    }

    /// One sleep until a doorbell, FIN or signal. Same kernel: a blocking `MSG_PEEK` receive,
    /// which the kernel restarts after `SA_RESTART` signals exactly as it would the program's
    /// own call. It only peeks: another thread may be asleep on the same socket for the other
    /// direction, and a doorbell consumed here would leave it asleep for good (the last waiter
    /// drains). Otherwise a bounded poll, so a vanished VM is noticed.
    pub(super) fn sleep(&self, left: Option<Duration>) -> Result<(), c_int> {
        let fd = self.kfd();
        if self.peer.same_kernel && !self.nonblock.load(Relaxed) && left.is_none() {
            crate::testpoint::pause(crate::testpoint::Point::RingSleep);
            let mut b = [0u8; 1];
            return match real::peek_blocking(fd, &mut b) {
                // Our side left its ring while we slept: the peer may have taken over and
                // shut its TCP side down — a FIN, not a close (marking its side closed would
                // let the channel be freed under it). The caller's look sees the switch.
                Ok(0) | Err(libc::ECONNRESET) if self.side_switched() => Ok(()),
                Ok(0) => {
                    // On the ring the peer never shuts its socket down: it closed it.
                    self.set_peer_closed();
                    Ok(())
                }
                Ok(_) => {
                    self.note_socket_ready();
                    Ok(())
                }
                Err(e) if e == libc::EINTR || e == libc::EAGAIN => Err(e),
                Err(libc::ECONNRESET) => {
                    self.peer.peer_reset.store(true, Release);
                    self.set_peer_closed();
                    Ok(())
                }
                Err(e) if real::not_about_the_peer(e) => {
                    // Our fd went away under us (closed by another thread): nothing to wait on.
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                }
                Err(_) => {
                    if !self.side_switched() {
                        self.set_peer_closed();
                    }
                    Ok(())
                }
            };
        }
        let slice = left.map_or(memloop::LIVENESS_SLICE_VM, |l| {
            l.min(memloop::LIVENESS_SLICE_VM)
        });
        match real::wait_fd(fd, libc::POLLIN, Some(slice)) {
            Err(libc::EINTR) => Err(libc::EINTR),
            Ok(ev) if ev != 0 => {
                self.note_socket_ready();
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// How many ring members of a poll or epoll set are looked at for the spin decision.
const SPIN_LOOKS: usize = 16;

/// The spin inputs of a wait on several connections (one for a blocking call): spinning can
/// pay if it can for one of (the first [`SPIN_LOOKS`] of) them. Our CPU and the machine's load
/// are sampled once.
pub fn spin_inputs_of(conns: &[&Conn]) -> SpinInputs {
    let our_cpu = memloop_shm::sched::current_cpu();
    let load = memloop_shm::sched::runnable_and_cpus();
    let mut last = SpinInputs::UNKNOWN;
    for c in conns.iter().take(SPIN_LOOKS) {
        last = c.spin_inputs_at(our_cpu, load);
        if spin_plan(&last, Duration::MAX) != SpinPlan::Sleep {
            break;
        }
    }
    last
}

/// A blocking call's sleep on a ring connection: on the ring end's futex when that is
/// allowed ([`Conn::futex_sleep_allowed`]), otherwise counted as a sleeper on the kernel
/// socket with `dir`'s doorbell armed.
struct ConnPark<'a> {
    conn: &'a Conn,
    dir: Dir,
    futex_allowed: bool,
    /// Armed on the futex: its cell and the sequence value to sleep on.
    futex: Option<(WaitCell, u32)>,
}

impl Park for ConnPark<'_> {
    type Error = c_int;
    fn arm(&mut self) {
        let c = self.conn;
        c.publish_presence(Presence::Asleep {
            cpu: memloop_shm::sched::current_cpu(),
        });
        if self.futex_allowed && c.sleepers.futex_ok.load(Relaxed) {
            self.futex = c.arm_futex(self.dir);
            if self.futex.is_some() {
                c.sleepers.futex_sleeping.fetch_add(1, AcqRel);
                return;
            }
        }
        c.enter_wait();
        c.arm(self.dir);
    }
    fn park(&mut self, left: Option<Duration>) -> Result<(), c_int> {
        if let Some((cell, seq)) = &self.futex {
            return match cell.sleep_untimed(*seq) {
                _ if crate::cancel::asked_here() => Err(libc::EINTR),
                Woken::Woken => Ok(()),
                Woken::Interrupted => Err(libc::EINTR),
                Woken::Unsupported => {
                    // A device mapping: sleep on the socket from the next round on.
                    self.conn.sleepers.futex_ok.store(false, Relaxed);
                    Ok(())
                }
            };
        }
        match self.conn.sleep(left) {
            // SO_RCVTIMEO cut a write's sleep (a peek) short: not the write's timeout.
            Err(libc::EAGAIN) if self.dir == Dir::Write => Ok(()),
            r => r,
        }
    }
    fn disarm(&mut self) {
        let c = self.conn;
        if self.futex.take().is_some() {
            c.disarm_futex(self.dir);
            c.sleepers.futex_sleeping.fetch_sub(1, AcqRel);
            c.publish_presence(Presence::running(memloop_shm::sched::current_cpu()));
            c.drain_owed();
            return;
        }
        c.disarm(self.dir);
        c.leave_wait();
    }
    fn after_sleep(&mut self) -> Result<(), c_int> {
        self.conn.check_peer();
        Ok(())
    }
}
