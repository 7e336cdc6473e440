//! One TCP connection that reached a co-resident peer: a ring in each direction, plus the real
//! kernel socket, which stays open as the liveness proof (the peer's kernel closes it when the
//! last process holding it is gone) and carries one doorbell byte whenever a peer that sleeps
//! in `poll`/`epoll`/`recv` must be woken.
//!
//! A client connection starts `Pending` (offer published, server undecided) and becomes
//! `Ring` or `Tcp`; a server connection is born decided.

use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::plain::PlainTcp;
use crate::real::{self, Drain};
use libc::c_int;
use memloop::registry::{ChannelId, ChannelState, ConnTuple, FallbackReason, Side, SideWords};
use memloop_ring::header::{probe_attached, Probe};
use memloop_ring::{StreamConsumer, StreamProducer};
use memloop_shm::ShmSlice;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const PENDING: u8 = 0;
pub const RING: u8 = 1;
pub const TCP: u8 = 2;

/// `waiters` bit: a thread is draining doorbells; nobody may start sleeping meanwhile.
const DRAINING: u32 = 1 << 31;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    Read,
    Write,
}

pub struct Conn {
    pub engine: Arc<Engine>,
    pub ch: ChannelId,
    pub side: Side,
    pub tuple: ConnTuple,
    path: AtomicU8,
    fds: ForkMutex<Vec<c_int>>,
    prod: ForkMutex<StreamProducer>,
    cons: ForkMutex<StreamConsumer>,
    tx_view: ShmSlice,
    rx_view: ShmSlice,
    /// Ring capacities (rx, tx) as validated at attach.
    caps: (u64, u64),
    pub nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in µs (0 = none), kept current by the setsockopt hook so a
    /// blocking call costs no getsockopt.
    rcvtimeo_us: AtomicU64,
    sndtimeo_us: AtomicU64,
    shut_rd: AtomicBool,
    shut_wr: AtomicBool,
    peer_closed: AtomicBool,
    /// The peer's socket was reset: after the ring drains, one ECONNRESET, then EOF.
    peer_reset: AtomicBool,
    reset_reported: AtomicBool,
    /// Set after fork: other processes may use this end, so ring operations take the
    /// cross-process side lock and reload the indices.
    shared: AtomicBool,
    /// Reload the indices before the next operation (this end just stopped being shared).
    resync_prod: AtomicBool,
    resync_cons: AtomicBool,
    side_words: Option<SideWords>,
    created: Instant,
    same_kernel: bool,
    /// Threads (and sleeping epoll sets) asleep on the kernel socket, plus the DRAINING bit.
    waiters: AtomicU32,
    /// Doorbell arms per direction (read, write): several waiters of this process may sleep
    /// on one ring end; its flag is cleared only when the last of them disarms.
    arms: [AtomicU32; 2],
    /// Doorbells the peer rang for our arms that no drain has read yet.
    owed: AtomicU32,
    spinner: Spinner,
    resolving: ForkMutex<()>,
    plain: ForkMutex<Option<Arc<PlainTcp>>>,
    /// Our side is already closed in the registry (last holder closed).
    released: AtomicBool,
    decide_wait: Duration,
    /// The program's TCP_NODELAY, restored if the connection stays on TCP.
    nodelay: std::sync::atomic::AtomicI32,
}

/// What creating a connection needs.
pub struct ConnParts {
    pub engine: Arc<Engine>,
    pub ch: ChannelId,
    pub side: Side,
    pub tuple: ConnTuple,
    pub fd: c_int,
    pub path: u8,
    pub same_kernel: bool,
    /// How long a pending client waits for the server's decision.
    pub decide_wait: Duration,
}

impl Conn {
    pub fn new(p: ConnParts) -> Result<Arc<Conn>, FallbackReason> {
        let spinner = Spinner::new(p.engine.cfg.spin_for(p.same_kernel));
        // Doorbells are single bytes the peer never answers on TCP: with Nagle on, the second
        // one would wait for the delayed ACK of the first (~40 ms).
        let nodelay = real::sockopt_int(p.fd, libc::IPPROTO_TCP, libc::TCP_NODELAY).unwrap_or(0);
        real::set_sockopt_int(p.fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
        let reg = p.engine.registry();
        let rings = reg.rings(p.ch).map_err(|_| FallbackReason::Error)?;
        let (tx_view, rx_view) = match p.side {
            Side::Client => (rings.c2s, rings.s2c),
            Side::Server => (rings.s2c, rings.c2s),
        };
        let prod = StreamProducer::attach(tx_view.clone()).map_err(|_| FallbackReason::Error)?;
        let cons = StreamConsumer::attach(rx_view.clone()).map_err(|_| FallbackReason::Error)?;
        let caps = (cons.capacity(), prod.capacity());
        let side_words = reg.side_words(p.ch, p.side).ok();
        let nonblock = real::status_flags(p.fd) & libc::O_NONBLOCK != 0;
        Ok(Arc::new(Conn {
            engine: p.engine,
            ch: p.ch,
            side: p.side,
            tuple: p.tuple,
            path: AtomicU8::new(p.path),
            fds: ForkMutex::new(vec![p.fd]),
            prod: ForkMutex::new(prod),
            cons: ForkMutex::new(cons),
            caps,
            tx_view,
            rx_view,
            nonblock: AtomicBool::new(nonblock),
            rcvtimeo_us: AtomicU64::new(timeout_us(p.fd, libc::SO_RCVTIMEO)),
            sndtimeo_us: AtomicU64::new(timeout_us(p.fd, libc::SO_SNDTIMEO)),
            shut_rd: AtomicBool::new(false),
            shut_wr: AtomicBool::new(false),
            peer_closed: AtomicBool::new(false),
            peer_reset: AtomicBool::new(false),
            reset_reported: AtomicBool::new(false),
            shared: AtomicBool::new(false),
            resync_prod: AtomicBool::new(false),
            resync_cons: AtomicBool::new(false),
            side_words,
            created: Instant::now(),
            same_kernel: p.same_kernel,
            waiters: AtomicU32::new(0),
            arms: [AtomicU32::new(0), AtomicU32::new(0)],
            owed: AtomicU32::new(0),
            spinner,
            resolving: ForkMutex::new(()),
            plain: ForkMutex::new(None),
            released: AtomicBool::new(false),
            decide_wait: p.decide_wait,
            nodelay: std::sync::atomic::AtomicI32::new(nodelay),
        }))
    }

    pub fn path(&self) -> u8 {
        self.path.load(Acquire)
    }

    /// The kernel socket (any of our fds for it).
    pub fn kfd(&self) -> c_int {
        self.fds.lock().first().copied().unwrap_or(-1)
    }

    pub fn add_fd(&self, fd: c_int) {
        self.fds.lock().push(fd);
    }

    /// `fd` is being closed; true if it is this process's last fd for the connection (the
    /// fd stays usable for the doorbell until [`Conn::release_with`] returns).
    pub fn close_fd(&self, fd: c_int) -> bool {
        let mut fds = self.fds.lock();
        if fds.len() > 1 {
            fds.retain(|&f| f != fd);
            return false;
        }
        true
    }

    pub fn plain(&self) -> Option<Arc<PlainTcp>> {
        self.plain.lock().clone()
    }

    // ---- decision -------------------------------------------------------------------------

    /// Settles a pending client connection: `Ring` once the server accepted, `Tcp` if it
    /// declined or did not answer within `decide_wait`. With `wait == false` it only looks.
    pub fn resolve(&self, wait: bool) -> u8 {
        let p = self.path();
        if p != PENDING {
            return p;
        }
        let _g = self.resolving.lock();
        let deadline = self.created + self.decide_wait;
        let mut polls = 0u32;
        loop {
            let p = self.path();
            if p != PENDING {
                return p;
            }
            let reg = self.engine.registry();
            match reg.channel_state(self.ch) {
                Ok(ChannelState::Accepted) => {
                    // The server rings one doorbell when it accepts: ours to read.
                    self.owed.fetch_add(1, Relaxed);
                    self.path.store(RING, Release);
                    tracing::debug!(ch = ?self.ch, "server accepted: ring");
                }
                Ok(ChannelState::Declined) => {
                    let _ = reg.cancel(self.ch, self.engine.me());
                    self.to_tcp(FallbackReason::Declined);
                }
                Ok(ChannelState::Offered) if Instant::now() >= deadline => {
                    // The CAS decides: either our cancel wins or the server's accept did.
                    if reg.cancel(self.ch, self.engine.me()).is_ok() {
                        self.to_tcp(FallbackReason::Cancelled);
                    }
                }
                Ok(ChannelState::Offered) if !wait => return PENDING,
                Ok(ChannelState::Offered) => {
                    polls += 1;
                    if polls < 200 {
                        std::thread::yield_now();
                    } else if self.connection_failed() {
                        // Reset before any accept (listener closed, backlog dropped): TCP,
                        // where the program meets the kernel's error.
                        if reg.cancel(self.ch, self.engine.me()).is_ok() {
                            self.to_tcp(FallbackReason::Cancelled);
                        }
                    }
                }
                _ => self.to_tcp(FallbackReason::Error),
            }
        }
    }

    /// Sleeps up to 200 µs on the kernel socket (the server's accept doorbell ends it early);
    /// true if the connection failed meanwhile.
    fn connection_failed(&self) -> bool {
        let r = real::wait_fd(self.kfd(), libc::POLLIN, Some(Duration::from_micros(200)));
        matches!(r, Ok(ev) if ev & (libc::POLLERR | libc::POLLHUP) != 0)
    }

    fn to_tcp(&self, reason: FallbackReason) {
        real::set_sockopt_int(
            self.kfd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            self.nodelay.load(Relaxed),
        );
        let plain = PlainTcp::record(&self.engine, &self.tuple, reason, None);
        *self.plain.lock() = Some(plain);
        self.path.store(TCP, Release);
        tracing::debug!(ch = ?self.ch, %reason, "connection stays on TCP");
    }

    // ---- ring access ------------------------------------------------------------------------

    pub fn mark_shared(&self) {
        self.shared.store(true, Release);
    }

    /// About to fork: the child will hold this end too (if the fork fails the count stays one
    /// too high and the end is released by the peer's close or the reclaim of our member).
    pub fn prepare_fork(&self) {
        self.mark_shared();
        if let Some(w) = &self.side_words {
            w.holders.fetch_add(1, AcqRel);
        }
    }

    /// Shared since a fork — unless every other holder has closed its copy since: then this
    /// end goes back to the lock-free path (the indices are reloaded once, as other processes
    /// may have moved them). Decided while no fork can happen in this process, so a fork
    /// cannot add a holder between the check and the switch.
    fn still_shared(&self) -> bool {
        if !self.shared.load(Acquire) {
            return false;
        }
        let Some(w) = &self.side_words else {
            return true;
        };
        if w.holders.load(Acquire) > 1 {
            return true;
        }
        crate::table::without_fork(|| {
            if w.holders.load(Acquire) <= 1 && self.shared.load(Acquire) {
                let nb = real::status_flags(self.kfd()) & libc::O_NONBLOCK != 0;
                self.nonblock.store(nb, Relaxed);
                self.resync_prod.store(true, Release);
                self.resync_cons.store(true, Release);
                self.shared.store(false, Release);
                tracing::debug!(ch = ?self.ch, "sole holder again: ring end no longer shared");
            }
        });
        self.shared.load(Acquire)
    }

    fn side_lock(&self) -> Option<SideLock<'_>> {
        if !self.still_shared() {
            return None;
        }
        let w = self.side_words.as_ref()?;
        let me = real::getpid();
        let mut spins = 0u32;
        loop {
            match w.lock.compare_exchange(0, me, Acquire, Relaxed) {
                Ok(_) => return Some(SideLock { w }),
                Err(holder) => {
                    spins += 1;
                    if spins % 4096 == 0 && !process_alive(holder) {
                        // Its holder died inside a ring operation; the indices it published
                        // are consistent (publication is a single store), so take over.
                        let _ = w.lock.compare_exchange(holder, 0, AcqRel, Relaxed);
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    fn with_prod<R>(&self, f: impl FnOnce(&mut StreamProducer) -> R) -> Result<R, c_int> {
        let mut p = self.prod.lock();
        let _l = self.side_lock();
        if _l.is_some() || self.resync_prod.swap(false, AcqRel) {
            p.resync().map_err(|_| libc::EIO)?;
        }
        let r = f(&mut p);
        if p.take_doorbell() {
            real::ring_doorbell(self.kfd());
        }
        Ok(r)
    }

    fn with_cons<R>(&self, f: impl FnOnce(&mut StreamConsumer) -> R) -> Result<R, c_int> {
        let mut c = self.cons.lock();
        let _l = self.side_lock();
        if _l.is_some() || self.resync_cons.swap(false, AcqRel) {
            c.resync().map_err(|_| libc::EIO)?;
        }
        let r = f(&mut c);
        if c.take_doorbell() {
            real::ring_doorbell(self.kfd());
        }
        Ok(r)
    }

    pub fn rx_probe(&self) -> Option<Probe> {
        probe_attached(&self.rx_view, self.caps.0)
    }

    pub fn tx_probe(&self) -> Option<Probe> {
        probe_attached(&self.tx_view, self.caps.1)
    }

    pub fn peer_closed(&self) -> bool {
        self.peer_closed.load(Acquire)
    }

    /// The peer's kernel socket is gone: every process holding that end closed it or died,
    /// so its side of the channel can be released even if its holder count says otherwise.
    pub fn set_peer_closed(&self) {
        if !self.peer_closed.swap(true, AcqRel) {
            tracing::debug!(ch = ?self.ch, "peer's socket closed");
            let _ = self
                .engine
                .registry()
                .peer_socket_closed(self.ch, self.side);
        }
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
            .waiters
            .compare_exchange(0, DRAINING, AcqRel, Acquire)
            .is_err()
        {
            return; // a sleeper will drain when it is the last one out
        }
        self.drain_now();
        self.waiters.store(0, Release);
    }

    fn drain_now(&self) {
        let (state, bytes) = real::drain_doorbells(self.kfd());
        let read = u32::try_from(bytes).unwrap_or(u32::MAX);
        let _ = self
            .owed
            .fetch_update(Relaxed, Relaxed, |o| Some(o.saturating_sub(read)));
        match state {
            Drain::Open => {}
            Drain::Closed => self.set_peer_closed(),
            Drain::Reset => {
                self.peer_reset.store(true, Release);
                self.set_peer_closed();
            }
        }
    }

    // ---- data -------------------------------------------------------------------------------

    /// `recv` family on a ring connection. `Ok(0)` is EOF.
    pub fn recv(&self, bufs: &mut [IoSliceMut<'_>], flags: c_int) -> Result<usize, c_int> {
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want == 0 {
            return Ok(0);
        }
        let peek = flags & libc::MSG_PEEK != 0;
        let waitall = flags & libc::MSG_WAITALL != 0;
        // After our own SHUT_RD the kernel still hands out what was queued, then EOF.
        let shut_rd = self.shut_rd.load(Acquire);
        let dontwait = shut_rd || flags & libc::MSG_DONTWAIT != 0 || self.nonblocking();
        let timeout = if dontwait {
            None
        } else {
            us(&self.rcvtimeo_us)
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut got = 0usize;
        loop {
            // MSG_PEEK|MSG_WAITALL: wait until the whole length is there, then peek it.
            let enough = !(peek && waitall) || self.readable_bytes() >= want;
            if enough {
                let n = self.read_some(bufs, got, peek)?;
                got = if peek { n } else { got + n };
                if got == want || (got > 0 && !waitall) {
                    return Ok(got);
                }
            }
            if self.rx_at_eof()? {
                return self.eof(got);
            }
            if dontwait {
                return match (got, shut_rd) {
                    (0, true) => Ok(0),
                    (0, false) => Err(libc::EAGAIN),
                    _ => Ok(got),
                };
            }
            match self.wait(Dir::Read, deadline) {
                Ok(()) => {}
                Err(e) if got > 0 && (e == libc::EINTR || e == libc::EAGAIN) => return Ok(got),
                Err(e) => return Err(e),
            }
        }
    }

    /// End of the stream: a reset peer gives one ECONNRESET (after everything it sent).
    fn eof(&self, got: usize) -> Result<usize, c_int> {
        if got == 0 && self.reset() && !self.reset_reported.swap(true, AcqRel) {
            return Err(libc::ECONNRESET);
        }
        Ok(got)
    }

    /// The peer reset the connection (flagged in the ring, or seen on the kernel socket).
    fn reset(&self) -> bool {
        self.rx_probe()
            .is_some_and(|p| reset_of(p.writer_reset, p.writer_shut, &self.peer_reset))
    }

    /// O_NONBLOCK. After fork the open file description (and its flags) is shared with other
    /// processes, which may change it: then ask the kernel.
    fn nonblocking(&self) -> bool {
        if self.still_shared() {
            return real::status_flags(self.kfd()) & libc::O_NONBLOCK != 0;
        }
        self.nonblock.load(Relaxed)
    }

    /// Copies into `bufs` starting `skip` bytes in.
    fn read_some(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        skip: usize,
        peek: bool,
    ) -> Result<usize, c_int> {
        let r = if skip == 0 {
            self.with_cons(|c| read_into(c, bufs, peek))?
        } else {
            let mut rest = advance_mut(bufs, skip);
            self.with_cons(|c| read_into(c, &mut rest, peek))?
        };
        r.map_err(|e| self.ring_error(e))
    }

    /// EOF: the writer shut down and the ring is drained, or the peer's socket is gone.
    fn rx_at_eof(&self) -> Result<bool, c_int> {
        let p = self.rx_probe().ok_or(libc::EIO)?;
        if p.used > 0 {
            return Ok(false);
        }
        // Re-read after the flag: bytes published before the shutdown are visible by now.
        let shut = p.writer_shut || p.writer_reset || self.peer_closed();
        Ok(shut && self.rx_probe().is_some_and(|p| p.used == 0))
    }

    fn ring_error(&self, e: memloop_ring::RingError) -> c_int {
        match e {
            memloop_ring::RingError::Closed => libc::EPIPE,
            e => {
                tracing::warn!(ch = ?self.ch, "ring error: {e}");
                libc::EIO
            }
        }
    }

    /// `send` family on a ring connection (blocking sends queue everything, as TCP does).
    pub fn send(&self, bufs: &[IoSlice<'_>], flags: c_int) -> Result<usize, c_int> {
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        let nosignal = flags & libc::MSG_NOSIGNAL != 0;
        let dontwait = flags & libc::MSG_DONTWAIT != 0 || self.nonblocking();
        let timeout = if dontwait {
            None
        } else {
            us(&self.sndtimeo_us)
        };
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut sent = 0usize;
        loop {
            if self.shut_wr.load(Acquire) || self.peer_closed() {
                return self.broken_pipe(sent, nosignal);
            }
            let r = if sent == 0 {
                self.with_prod(|p| p.write_vectored(bufs))?
            } else {
                let rest = advance(bufs, sent);
                self.with_prod(|p| p.write_vectored(&rest))?
            };
            match r {
                Ok(n) => sent += n,
                Err(memloop_ring::RingError::Closed) => return self.broken_pipe(sent, nosignal),
                Err(e) => return Err(self.ring_error(e)),
            }
            if sent == want {
                return Ok(sent);
            }
            if dontwait {
                return if sent > 0 {
                    Ok(sent)
                } else {
                    Err(libc::EAGAIN)
                };
            }
            match self.wait(Dir::Write, deadline) {
                Ok(()) => {}
                Err(e) if sent > 0 && (e == libc::EINTR || e == libc::EAGAIN) => return Ok(sent),
                Err(e) => return Err(e),
            }
        }
    }

    fn broken_pipe(&self, sent: usize, nosignal: bool) -> Result<usize, c_int> {
        if sent > 0 {
            return Ok(sent);
        }
        if !nosignal {
            real::raise_sigpipe();
        }
        Err(libc::EPIPE)
    }

    // ---- readiness and waiting ------------------------------------------------------------

    /// poll-style readiness of a ring connection.
    pub fn revents(&self) -> i16 {
        let (Some(rx), Some(tx)) = (self.rx_probe(), self.tx_probe()) else {
            return libc::POLLERR | libc::POLLIN | libc::POLLOUT;
        };
        // As the kernel: the peer's FIN is POLLIN|POLLRDHUP; POLLHUP needs both directions
        // shut (or a reset); after our own SHUT_WR a write fails at once, so POLLOUT.
        let reset = reset_of(rx.writer_reset, rx.writer_shut, &self.peer_reset);
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
        if reset && !self.reset_reported.load(Relaxed) {
            ev |= libc::POLLERR;
        }
        ev
    }

    /// Whether a `dir` call would not block (only that direction's ring is read).
    pub fn ready(&self, dir: Dir) -> bool {
        if self.peer_closed() {
            return true;
        }
        match dir {
            Dir::Read => {
                self.shut_rd.load(Relaxed)
                    || self
                        .rx_probe()
                        .map_or(true, |p| p.used > 0 || p.writer_shut)
            }
            Dir::Write => self
                .tx_probe()
                .map_or(true, |p| p.free() > 0 || p.reader_closed),
        }
    }

    /// Arms our doorbell flag for `dir`: the peer's next publication (or release) will send a
    /// doorbell byte. Counted: the flag stays armed until every arm is matched by a disarm.
    /// The caller re-checks readiness afterwards.
    pub fn arm(&self, dir: Dir) {
        self.with_flag(dir, |arms, flag| {
            if arms.fetch_add(1, Relaxed) == 0 {
                flag.arm();
            } else if flag.rearm() {
                self.owed.fetch_add(1, Relaxed);
            }
        });
    }

    /// Arms `dir` again for a waiter that already holds an arm: a doorbell the peer sent
    /// cleared the flag, and this waiter is about to sleep once more.
    pub fn rearm(&self, dir: Dir) {
        self.with_flag(dir, |arms, flag| {
            if arms.load(Relaxed) > 0 && flag.rearm() {
                self.owed.fetch_add(1, Relaxed);
            }
        });
    }

    pub fn disarm(&self, dir: Dir) {
        self.with_flag(dir, |arms, flag| {
            let left = arms.load(Relaxed).saturating_sub(1);
            arms.store(left, Relaxed);
            if left == 0 && flag.disarm() {
                self.owed.fetch_add(1, Relaxed);
            }
        });
    }

    /// Drains the doorbells the peer rang for our arms, if any are still unread: a byte
    /// left on the socket would keep reporting the socket (and any epoll set holding it)
    /// readable after the data it announced was consumed.
    pub fn drain_owed(&self) {
        if self.owed.load(Relaxed) > 0 {
            self.drain();
        }
    }

    /// Runs `f` on `dir`'s arm count and ring flag under that ring end's lock, so an arm and
    /// the last disarm of another thread cannot interleave between count and flag.
    fn with_flag(&self, dir: Dir, f: impl FnOnce(&AtomicU32, &dyn DoorbellFlag)) {
        match dir {
            Dir::Read => f(&self.arms[0], &*self.cons.lock()),
            Dir::Write => f(&self.arms[1], &*self.prod.lock()),
        }
    }

    /// The longest spin before sleeping: longer towards another kernel.
    pub fn spin_window(&self) -> Duration {
        self.engine.cfg.spin_for(self.same_kernel)
    }

    /// Spins with this connection's adaptive window (poll over several fds borrows it).
    pub fn spin(&self, ready: impl FnMut() -> bool) -> bool {
        self.spinner.spin(self.spin_window(), ready)
    }

    /// Blocks until `dir` is ready, the deadline passes (`EAGAIN`) or a signal arrives
    /// (`EINTR`, unless `SA_RESTART` made the kernel restart our sleep).
    fn wait(&self, dir: Dir, deadline: Option<Instant>) -> Result<(), c_int> {
        if self.spinner.spin(self.spin_window(), || self.ready(dir)) {
            return Ok(());
        }
        // Across kernels, time a death during this wait from now (the first heartbeat look).
        if !self.same_kernel {
            self.check_peer();
        }
        loop {
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Err(libc::EAGAIN),
                },
                None => None,
            };
            self.enter_wait();
            self.arm(dir);
            let r = if self.ready(dir) {
                Ok(())
            } else {
                self.sleep(left)
            };
            self.disarm(dir);
            self.leave_wait();
            match r {
                Err(libc::EAGAIN) if dir == Dir::Write => {} // SO_RCVTIMEO cut our sleep short
                Err(e) => return Err(e),
                Ok(()) => {}
            }
            if self.ready(dir) {
                return Ok(());
            }
            self.check_peer();
        }
    }

    /// For poll and epoll after an idle slice: a peer in another kernel may have vanished.
    pub fn watch_peer(&self) {
        if !self.same_kernel && self.path() == RING {
            self.check_peer();
        }
    }

    /// Notes a peer that closed its end or died. In our kernel its death closes the kernel
    /// socket too; across kernels nothing tells a powered-off VM's peer but the VM's heartbeat,
    /// and the connection ends as TCP's would once it gave up: reset.
    fn check_peer(&self) {
        let reg = self.engine.registry();
        if !self.same_kernel && (self.peer_reclaimed() || !self.peer_alive()) {
            self.peer_reset.store(true, Release);
            self.set_peer_closed();
        } else if reg.peer_gone(self.ch, self.side).unwrap_or(true) {
            self.set_peer_closed();
        }
    }

    /// Whether someone found the peer dead and reclaimed it (its side carries the dead bit).
    fn peer_reclaimed(&self) -> bool {
        match self.engine.registry().channel(self.ch) {
            Ok(info) => match self.side {
                Side::Client => info.server_dead,
                Side::Server => info.client_dead,
            },
            Err(_) => false,
        }
    }

    /// The peer member's heartbeat (or /proc) says it lives; reclaims it if not.
    fn peer_alive(&self) -> bool {
        let Ok(info) = self.engine.registry().channel(self.ch) else {
            return false;
        };
        let peer = match self.side {
            Side::Client => info.server,
            Side::Server => Some(info.client),
        };
        peer.map_or(true, |p| self.engine.node.peer_alive(p))
    }

    /// Counts a sleeper on the kernel socket (a thread, or an epoll set with a sleeping
    /// thread), after any drain in progress has finished.
    pub fn enter_wait(&self) {
        loop {
            let v = self.waiters.load(Acquire);
            if v & DRAINING != 0 {
                std::hint::spin_loop();
                continue;
            }
            if self
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
        if self.waiters.fetch_sub(1, AcqRel) == 1 {
            self.drain();
        }
    }

    /// One sleep until a doorbell, FIN or signal. Same kernel: a blocking `MSG_PEEK` receive,
    /// which the kernel restarts after `SA_RESTART` signals exactly as it would the program's
    /// own call. It only peeks: another thread may be asleep on the same socket for the other
    /// direction, and a doorbell consumed here would leave it asleep for good (the last waiter
    /// drains). Otherwise a bounded poll, so a vanished VM is noticed.
    fn sleep(&self, left: Option<Duration>) -> Result<(), c_int> {
        let fd = self.kfd();
        if self.same_kernel && !self.nonblock.load(Relaxed) && left.is_none() {
            let mut b = [0u8; 1];
            return match real::peek_blocking(fd, &mut b) {
                Ok(0) => {
                    self.set_peer_closed();
                    Ok(())
                }
                Ok(_) => Ok(()),
                Err(e) if e == libc::EINTR || e == libc::EAGAIN => Err(e),
                Err(libc::ECONNRESET) => {
                    self.peer_reset.store(true, Release);
                    self.set_peer_closed();
                    Ok(())
                }
                Err(e) if real::not_about_the_peer(e) => {
                    // Our fd went away under us (closed by another thread): nothing to wait on.
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                }
                Err(_) => {
                    self.set_peer_closed();
                    Ok(())
                }
            };
        }
        let slice = left.map_or(memloop::LIVENESS_SLICE_VM, |l| {
            l.min(memloop::LIVENESS_SLICE_VM)
        });
        match real::wait_fd(fd, libc::POLLIN, Some(slice)) {
            Err(libc::EINTR) => Err(libc::EINTR),
            _ => Ok(()),
        }
    }

    // ---- shutdown, close, fork ------------------------------------------------------------

    pub fn shutdown(&self, how: c_int) -> Result<(), c_int> {
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            self.shut_rd.store(true, Release);
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.shut_wr.store(true, Release);
            self.with_prod(|p| p.shutdown())?;
            // The peer may sleep in epoll without having armed for this end: always ring.
            real::ring_doorbell(self.kfd());
        }
        Ok(())
    }

    /// This process closed its last fd for the connection. If no other process holds our
    /// end, shut the rings (what was sent is still delivered, then EOF) and release our side.
    pub fn release_with(&self, fd: c_int) {
        self.release();
        self.fds.lock().retain(|&f| f != fd);
    }

    fn release(&self) {
        if self.path() != RING || self.released.swap(true, AcqRel) {
            return;
        }
        if let Some(w) = &self.side_words {
            if self.shared.load(Acquire) {
                let before = w.holders.fetch_sub(1, AcqRel);
                tracing::debug!(ch = ?self.ch, holders = before - 1, "shared end closed here");
                if before > 1 {
                    return;
                }
            }
        }
        let fd = self.kfd();
        // As the kernel: closing with data unread, or with SO_LINGER {1, 0}, resets the
        // connection. The real close then sends the RST; the peer reads what we sent, then
        // gets ECONNRESET (so the ring is not marked shut, which would read as a clean EOF).
        let abort = self.readable_bytes() > 0 || real::linger_zero(fd);
        if abort {
            let _ = self.with_prod(|p| p.reset());
            real::set_linger_zero(fd);
        } else {
            let _ = self.with_prod(|p| p.shutdown());
            // Doorbells left unread would make the kernel reset instead of closing cleanly.
            self.drain();
        }
        // The ring's tail counts every byte ever published, whichever process wrote it.
        let sent = memloop_ring::header::totals(&self.tx_view).map(|(tail, _)| tail);
        let _ = self.with_cons(|c| c.close());
        real::ring_doorbell(fd);
        let reg = self.engine.registry();
        reg.add_counter(memloop::registry::COUNTER_RING_BYTES, sent.unwrap_or(0));
        if let Err(e) = reg.close(self.ch, self.side) {
            tracing::debug!(ch = ?self.ch, "close: {e}");
        }
    }

    /// A pending client connection closed before the decision: withdraw the offer.
    pub fn abandon(&self) {
        if self.path() == PENDING {
            let reg = self.engine.registry();
            if reg.cancel(self.ch, self.engine.me()).is_err() {
                // The server accepted meanwhile: close our side like a ring connection.
                self.path.store(RING, Release);
                self.release();
            }
        }
    }

    /// TCP_NODELAY as the program set it (the kernel socket keeps it on for the doorbells).
    pub fn app_nodelay(&self) -> c_int {
        self.nodelay.load(Relaxed)
    }

    pub fn set_app_nodelay(&self, v: c_int) {
        self.nodelay.store(v, Relaxed);
    }

    /// The program changed SO_RCVTIMEO or SO_SNDTIMEO: re-read it from the kernel.
    pub fn refresh_timeout(&self, fd: c_int, opt: c_int) {
        let v = timeout_us(fd, opt);
        match opt {
            libc::SO_RCVTIMEO => self.rcvtimeo_us.store(v, Relaxed),
            libc::SO_SNDTIMEO => self.sndtimeo_us.store(v, Relaxed),
            _ => {}
        }
    }

    /// SIOCOUTQ: bytes we sent that the peer has not read yet.
    pub fn unread_by_peer(&self) -> usize {
        self.tx_probe().map_or(0, |p| p.used as usize)
    }

    /// Waits (unless `nonblock`) until the tx ring has room; returns how much (≤ `max`).
    pub fn wait_room(&self, max: usize, nonblock: bool) -> Result<usize, c_int> {
        let dontwait = nonblock || self.nonblocking();
        let deadline = us(&self.sndtimeo_us).map(|t| Instant::now() + t);
        loop {
            if self.shut_wr.load(Acquire) || self.peer_closed() {
                return Err(libc::EPIPE);
            }
            let free = self.tx_probe().map_or(0, |p| p.free() as usize);
            if free > 0 {
                return Ok(free.min(max).max(1));
            }
            if dontwait {
                return Err(libc::EAGAIN);
            }
            self.wait(Dir::Write, deadline)?;
        }
    }

    /// FIONREAD.
    pub fn readable_bytes(&self) -> usize {
        self.rx_probe().map_or(0, |p| p.used as usize)
    }

    /// For epoll edge-triggering: values that change whenever new data or space appears, and
    /// whether the peer's end of the stream arrived (an edge of its own, like a FIN).
    pub fn progress(&self) -> (u64, u64, bool) {
        let t = memloop_ring::header::totals(&self.rx_view).map_or(0, |(t, _)| t);
        let h = memloop_ring::header::totals(&self.tx_view).map_or(0, |(_, h)| h);
        let fin = self.peer_closed()
            || self
                .rx_probe()
                .is_some_and(|p| p.writer_shut || p.writer_reset);
        (t, h, fin)
    }
}

/// Whether a connection was reset: the peer said so in the ring, or the kernel socket was
/// reset before the peer shut its ring end down. After a clean ring shutdown a kernel reset
/// only means a doorbell byte reached the peer's socket as it closed (the kernel resets a
/// socket closed with unread bytes): the stream itself ended cleanly.
fn reset_of(writer_reset: bool, writer_shut: bool, kernel_reset: &AtomicBool) -> bool {
    writer_reset || (kernel_reset.load(Acquire) && !writer_shut)
}

fn timeout_us(fd: c_int, opt: c_int) -> u64 {
    real::sockopt_timeout(fd, opt).map_or(0, |d| d.as_micros().clamp(1, u64::MAX as u128) as u64)
}

fn us(v: &AtomicU64) -> Option<Duration> {
    match v.load(Relaxed) {
        0 => None,
        n => Some(Duration::from_micros(n)),
    }
}

struct SideLock<'a> {
    w: &'a SideWords,
}

impl Drop for SideLock<'_> {
    fn drop(&mut self) {
        self.w.lock.store(0, Release);
    }
}

fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A ring end's doorbell flag, as both ring ends expose it. `rearm` and `disarm` say whether
/// the peer had cleared the flag, i.e. rang a doorbell.
trait DoorbellFlag {
    fn arm(&self);
    fn rearm(&self) -> bool;
    fn disarm(&self) -> bool;
}

macro_rules! doorbell_flag {
    ($($end:ty),*) => {$(
        impl DoorbellFlag for $end {
            fn arm(&self) {
                self.arm_doorbell();
            }
            fn rearm(&self) -> bool {
                self.rearm_doorbell()
            }
            fn disarm(&self) -> bool {
                self.disarm_doorbell()
            }
        }
    )*};
}

doorbell_flag!(StreamConsumer, StreamProducer);

/// Pure spinning (no yield) for up to this long: a peer on the other core usually answers
/// well within it, and yielding early hands the CPU to unrelated work for a whole time slice.
const PURE_SPIN: Duration = Duration::from_micros(10);

/// Spins until `ready` or `window` passes; after the first [`PURE_SPIN`] it yields now and
/// then, since on two cores the peer may need our CPU.
pub fn spin_until(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    for _ in 0..16 {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    if window.is_zero() {
        return false;
    }
    let start = Instant::now();
    let mut i = 0u32;
    let mut yielding = false;
    loop {
        if ready() {
            return true;
        }
        i = i.wrapping_add(1);
        if i % 8 == 0 {
            let t = start.elapsed();
            if t >= window {
                return false;
            }
            yielding = t >= PURE_SPIN;
        }
        if yielding && i % 32 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// An adaptive spin window (per connection or wait set): halves when spinning fails (the peer
/// is slow or shares our core, so sleeping is cheaper), doubles back when it succeeds.
pub struct Spinner {
    ns: AtomicU64,
}

impl Spinner {
    pub fn new(max: Duration) -> Self {
        Spinner {
            ns: AtomicU64::new(max.as_nanos() as u64),
        }
    }

    pub fn spin(&self, max: Duration, ready: impl FnMut() -> bool) -> bool {
        let max_ns = max.as_nanos() as u64;
        let cur = self.ns.load(Relaxed).min(max_ns);
        let hit = spin_until(Duration::from_nanos(cur), ready);
        let next = if hit { (cur * 2).max(1_000) } else { cur / 2 };
        self.ns.store(next.clamp(max_ns / 8, max_ns), Relaxed);
        hit
    }
}

fn read_into(
    c: &mut StreamConsumer,
    bufs: &mut [IoSliceMut<'_>],
    peek: bool,
) -> Result<usize, memloop_ring::RingError> {
    if !peek {
        return c.read_vectored(bufs);
    }
    match bufs.first_mut() {
        Some(b) => c.peek(b),
        None => Ok(0),
    }
}

/// `bufs` without its first `skip` bytes.
fn advance<'a>(bufs: &'a [IoSlice<'a>], mut skip: usize) -> Vec<IoSlice<'a>> {
    let mut out = Vec::with_capacity(bufs.len());
    for b in bufs {
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        out.push(IoSlice::new(&b[skip..]));
        skip = 0;
    }
    out
}

fn advance_mut<'a, 'b>(bufs: &'a mut [IoSliceMut<'b>], mut skip: usize) -> Vec<IoSliceMut<'a>> {
    let mut out = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        out.push(IoSliceMut::new(&mut b[skip..]));
        skip = 0;
    }
    out
}
