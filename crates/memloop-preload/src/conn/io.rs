//! The data calls on a ring connection, with the kernel's semantics (partial reads, EOF after
//! a FIN, one ECONNRESET after a reset, EPIPE/SIGPIPE, MSG_PEEK/WAITALL/DONTWAIT, timeouts).

use super::{deadline, Conn, Dir, SWITCHED};
use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use memloop::channel::StreamEnds;
use memloop_ring::header::{probe_attached, Probe};
use memloop_ring::{StreamConsumer, StreamProducer, WaitCell};
use memloop_shm::ShmSlice;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::Ordering::*;

/// Our ends of the channel's two rings.
pub(super) struct Rings {
    pub(super) prod: ForkMutex<StreamProducer>,
    pub(super) cons: ForkMutex<StreamConsumer>,
    pub(super) tx_view: ShmSlice,
    pub(super) rx_view: ShmSlice,
    /// Ring capacities (rx, tx) as validated at attach.
    pub(super) caps: (u64, u64),
    /// Our ends' waiting cells (rx: our reader's, tx: our writer's), for waking our own
    /// futex sleepers without taking the ends' locks.
    pub(super) own_cells: [WaitCell; 2],
    /// Grows of the tx window (made, refused) already counted in the region.
    grown_counted: [std::sync::atomic::AtomicU64; 2],
}

impl Rings {
    pub(super) fn new(e: StreamEnds) -> Self {
        // The data areas' sizes (a window within them grows and shrinks).
        let caps = (e.rx.max_capacity(), e.tx.max_capacity());
        let own_cells = [e.rx.wait_cell().clone(), e.tx.wait_cell().clone()];
        Rings {
            own_cells,
            prod: ForkMutex::new(e.tx),
            cons: ForkMutex::new(e.rx),
            tx_view: e.tx_view,
            rx_view: e.rx_view,
            caps,
            grown_counted: Default::default(),
        }
    }
}

/// Heartbeat looks (200 ms apart) that find an end idle before its window shrinks.
const IDLE_LOOKS: u32 = 5;

impl Conn {
    /// The heartbeat's look at our tx ring's window: back to the initial window once the
    /// connection has idled for about a second (its memory goes back to the system); grows
    /// (made by the writes themselves) and shrinks are counted in the region. Skipped while
    /// a program thread writes, and for an end other processes share.
    pub(super) fn look_after_window(&self) {
        // Under the switching lock, which a release takes: a ring let go may be another
        // channel's memory already.
        let Some(_g) = self.switching.lock.try_lock() else {
            return;
        };
        if self.let_go() || self.path() != super::Path::Ring || self.share.shared.load(Acquire) {
            return;
        }
        let Some(mut p) = self.rings.prod.try_lock() else {
            return;
        };
        let idle_window = (self.engine.cfg.ring_window)
            .unwrap_or(memloop::registry::INITIAL_WINDOW)
            .min(p.max_capacity());
        let shrunk = p.shrink_if_idle(idle_window, IDLE_LOOKS).unwrap_or(false);
        self.count_resizes(&p);
        drop(p);
        let reg = self.engine.registry();
        if shrunk {
            reg.bump_counter(memloop::registry::COUNTER_WINDOWS_SHRUNK);
            tracing::trace!(ch = ?self.ch, "idle: tx window shrunk");
        }
    }

    /// Adds the tx window's grows (made, refused) since the last count to the region's
    /// counters: from the heartbeat, and when the connection is let go.
    pub(super) fn count_resizes(&self, p: &StreamProducer) {
        let (grown, _, refused) = p.resizes();
        let reg = self.engine.registry();
        for (i, now, counter) in [
            (0, grown, memloop::registry::COUNTER_WINDOWS_GROWN),
            (1, refused, memloop::registry::COUNTER_WINDOWS_NO_ROOM),
        ] {
            let before = self.rings.grown_counted[i].swap(now, AcqRel);
            reg.add_counter(counter, now.saturating_sub(before));
        }
    }

    pub fn rx_probe(&self) -> Option<Probe> {
        probe_attached(&self.rings.rx_view, self.rings.caps.0)
    }

    /// [`memloop_ring::header::has_unread`] of the ring we read.
    pub fn rx_has_unread(&self) -> bool {
        memloop_ring::header::has_unread(&self.rings.rx_view, self.rings.caps.0).is_some()
    }

    pub fn tx_probe(&self) -> Option<Probe> {
        probe_attached(&self.rings.tx_view, self.rings.caps.1)
    }

    /// `recv` family on a ring connection. `Ok(0)` is EOF.
    pub fn recv(&self, bufs: &mut [IoSliceMut<'_>], flags: c_int) -> Result<usize, c_int> {
        if matches!(self.path(), super::Path::Tcp | super::Path::Joining) && self.switched() {
            return self.tcp_recv(bufs, flags);
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want == 0 {
            return Ok(0);
        }
        let peek = flags & libc::MSG_PEEK != 0;
        let waitall = flags & libc::MSG_WAITALL != 0;
        let nowait = flags & libc::MSG_DONTWAIT != 0 || self.nonblocking();
        let deadline = deadline(nowait, &self.rcvtimeo_us);
        let mut got = 0usize;
        loop {
            // After our own SHUT_RD (this thread's or, while it waited, another's) the kernel
            // still hands out what was queued, then EOF.
            let shut_rd = self.shut_rd.load(Acquire);
            let dontwait = nowait || shut_rd;
            // MSG_PEEK|MSG_WAITALL: wait until the whole length is there, then peek it.
            let enough = !(peek && waitall) || self.readable_bytes() >= want;
            if enough {
                let n = match self.read_some(bufs, got, peek) {
                    Ok(n) => n,
                    Err(SWITCHED) if got > 0 && !peek => return Ok(got),
                    Err(e) => {
                        if e != SWITCHED {
                            tracing::debug!(ch = ?self.ch, errno = e, got, "recv: read failed");
                        }
                        return Err(e);
                    }
                };
                got = if peek { n } else { got + n };
                if got == want || (got > 0 && !waitall) {
                    return Ok(got);
                }
            }
            if self.rx_at_eof().inspect_err(|e| {
                tracing::debug!(ch = ?self.ch, errno = e, "recv: no probe");
            })? {
                let p = self.rx_probe();
                tracing::debug!(ch = ?self.ch, got, ?p, closed = self.peer_closed(), "recv: end of stream");
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
                Err(e) if got > 0 && !peek && partial_ok(e) => return Ok(got),
                Err(e) => {
                    if e != SWITCHED {
                        tracing::debug!(ch = ?self.ch, errno = e, "recv: the wait failed");
                    }
                    return Err(e);
                }
            }
        }
    }

    /// End of the stream: a reset peer gives one ECONNRESET (after everything it sent).
    pub(super) fn eof(&self, got: usize) -> Result<usize, c_int> {
        if got == 0 && self.reset() && !self.peer.reset_reported.swap(true, AcqRel) {
            return Err(libc::ECONNRESET);
        }
        Ok(got)
    }

    /// The peer reset the connection (flagged in the ring, or seen on the kernel socket).
    pub(super) fn reset(&self) -> bool {
        self.rx_probe().is_some_and(|p| {
            let unread = self.unread_by_peer() > 0;
            reset_of(p.writer_reset, p.writer_shut, &self.peer, unread)
        })
    }

    /// O_NONBLOCK. After fork the open file description (and its flags) is shared with other
    /// processes, which may change it: then ask the kernel.
    pub(super) fn nonblocking(&self) -> bool {
        if self.still_shared() {
            return real::status_flags(self.kfd()) & libc::O_NONBLOCK != 0;
        }
        self.nonblock.load(Relaxed)
    }

    /// Copies into `bufs` starting `skip` bytes in.
    pub(super) fn read_some(
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
    pub(super) fn rx_at_eof(&self) -> Result<bool, c_int> {
        let p = self.rx_probe().ok_or(libc::EIO)?;
        if p.used > 0 {
            return Ok(false);
        }
        // Re-read after the flag: bytes published before the shutdown are visible by now.
        let shut = p.writer_shut || p.writer_reset || self.peer_closed();
        Ok(shut && self.rx_probe().is_some_and(|p| p.used == 0))
    }

    pub(super) fn ring_error(&self, e: memloop_ring::RingError) -> c_int {
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
        if self.path() == super::Path::Tcp && self.switched() {
            return self.tcp_send(bufs, flags);
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        let nosignal = flags & libc::MSG_NOSIGNAL != 0;
        let dontwait = flags & libc::MSG_DONTWAIT != 0 || self.nonblocking();
        let deadline = deadline(dontwait, &self.sndtimeo_us);
        let mut sent = 0usize;
        loop {
            if self.shut_wr.load(Acquire) || self.peer_closed() {
                return self.broken_pipe(sent, nosignal);
            }
            if let Some(k) = crate::testpoint::resize_due() {
                self.test_resize(k);
            }
            let r = if sent == 0 {
                self.with_prod(|p| p.write_vectored(bufs))
            } else {
                let rest = advance(bufs, sent);
                self.with_prod(|p| p.write_vectored(&rest))
            };
            let r = match r {
                Ok(r) => r,
                Err(SWITCHED) if sent > 0 => return Ok(sent),
                Err(e) => return Err(e),
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
                Err(e) if sent > 0 && partial_ok(e) => return Ok(sent),
                Err(e) => return Err(e),
            }
        }
    }

    /// `MEMLOOP_TEST_RESIZE`: our tx window to 64 << `k` (at most the ring), if it can be now.
    fn test_resize(&self, k: u32) {
        let done = self.with_prod(|p| {
            let to = (64u64 << k).min(p.max_capacity());
            p.resize(to).unwrap_or(false).then_some(to)
        });
        if let Ok(Some(to)) = done {
            tracing::debug!(ch = ?self.ch, to, "test resize");
        }
    }

    pub(super) fn broken_pipe(&self, sent: usize, nosignal: bool) -> Result<usize, c_int> {
        if sent > 0 {
            return Ok(sent);
        }
        if !nosignal {
            real::raise_sigpipe();
        }
        Err(libc::EPIPE)
    }

    pub fn shutdown(&self, how: c_int) -> Result<(), c_int> {
        // A thread of ours blocked in a call on this connection returns at once, as the
        // kernel's shutdown wakes it (a futex sleeper hears nothing else of it).
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            self.shut_rd.store(true, Release);
            self.rings.own_cells[0].wake_sleepers();
        }
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            self.shut_wr.store(true, Release);
            self.rings.own_cells[1].wake_sleepers();
            self.with_prod(|p| p.shutdown())?;
            // The peer may sleep in epoll without having armed for this end: always ring.
            self.ring_doorbell();
        }
        Ok(())
    }

    /// SIOCOUTQ: bytes we sent that the peer has not read yet.
    pub fn unread_by_peer(&self) -> usize {
        self.tx_probe().map_or(0, |p| p.used as usize)
    }

    /// Waits (unless `nonblock`) until the tx ring has room; returns how much (≤ `max`).
    pub fn wait_room(&self, max: usize, nonblock: bool) -> Result<usize, c_int> {
        let dontwait = nonblock || self.nonblocking();
        let deadline = deadline(false, &self.sndtimeo_us);
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
        let t = memloop_ring::header::totals(&self.rings.rx_view).map_or(0, |(t, _)| t);
        let h = memloop_ring::header::totals(&self.rings.tx_view).map_or(0, |(_, h)| h);
        let fin = self.peer_closed()
            || self
                .rx_probe()
                .is_some_and(|p| p.writer_shut || p.writer_reset);
        (t, h, fin)
    }
}

/// Errors after which a call that already moved bytes returns their count instead: a
/// signal, a timeout, or the connection leaving its ring (the rest goes by TCP next call).
fn partial_ok(e: c_int) -> bool {
    e == libc::EINTR || e == libc::EAGAIN || e == SWITCHED
}

/// Whether a connection was reset: the peer said so in the ring, or its kernel socket was
/// reset while the peer left bytes of ours unread — as the kernel resets a socket closed with
/// data unread. A kernel reset without unread data only means doorbell bytes were left on the
/// peer's socket when it closed (a clean ring shutdown, or a process that exited without
/// closing): the stream itself ended cleanly. A peer in another kernel judged dead (nothing
/// closes its socket) ends with a reset unless it had shut its ring end.
pub(super) fn reset_of(
    writer_reset: bool,
    writer_shut: bool,
    peer: &super::peer::PeerState,
    peer_left_unread: bool,
) -> bool {
    let kernel_reset = peer.peer_reset.load(Acquire) && peer_left_unread;
    writer_reset || (!writer_shut && (peer.peer_dead.load(Acquire) || kernel_reset))
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
