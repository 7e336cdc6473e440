//! A ring end shared by several processes after fork: a cross-process side lock and index
//! reloads while shared, back to the lock-free path when this process is the sole holder
//! again; and the release of our side when the last holder closes.

use super::{Conn, Path};
use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use memloop::registry::SideWords;
use memloop_ring::{StreamConsumer, StreamProducer};
use std::sync::atomic::{AtomicBool, Ordering::*};

pub(super) struct Sharing {
    /// Set after fork: other processes may use this end, so ring operations take the
    /// cross-process side lock and reload the indices.
    pub(super) shared: AtomicBool,
    /// Reload the indices before the next operation (this end just stopped being shared).
    pub(super) resync_prod: AtomicBool,
    pub(super) resync_cons: AtomicBool,
    pub(super) side_words: Option<SideWords>,
    /// Our side is already closed in the registry (last holder closed).
    pub(super) released: AtomicBool,
    /// Set just before our side is closed in the registry: the channel's words may be freed
    /// and reused from then on, so nothing more is counted in them.
    pub(super) side_closed: AtomicBool,
}

impl Sharing {
    pub(super) fn new(side_words: Option<SideWords>) -> Self {
        Sharing {
            shared: AtomicBool::new(false),
            resync_prod: AtomicBool::new(false),
            resync_cons: AtomicBool::new(false),
            side_words,
            released: AtomicBool::new(false),
            side_closed: AtomicBool::new(false),
        }
    }
}

impl Conn {
    /// Closing steps are best effort (the peer learns of the close from the kernel socket
    /// anyway), but a failure is worth a trace: the indices could not be reloaded.
    fn log_ring_error(&self, what: &str, r: Result<(), libc::c_int>) {
        if let Err(e) = r {
            tracing::debug!(ch = ?self.ch, errno = e, "{what}: failed");
        }
    }

    pub fn mark_shared(&self) {
        self.share.shared.store(true, Release);
    }

    /// About to fork: the child will hold this end too (if the fork fails the count stays one
    /// too high and the end is released by the peer's close or the reclaim of our member).
    pub fn prepare_fork(&self) {
        self.mark_shared();
        if let Some(w) = &self.share.side_words {
            w.holders.fetch_add(1, AcqRel);
        }
    }

    /// In a fork child: a grab (`grab.rs`) is the parent's to drop; the child is counted
    /// among the holders, which is what keeps an unaware holder from promoting.
    pub fn forget_grab_in_child(&self) {
        self.switching.grabbed.store(false, Relaxed);
        self.switching.taken_from.lock().take();
    }

    /// In a fork child: locks of this connection that a parent thread held at the fork —
    /// a thread that is not in the child, so nobody would let them go, and the child's first
    /// call (or its close before an exec) would wait for good. Each is free to take:
    /// - the switching lock: a switch's shared steps are made for a side held by two
    ///   processes, and the child takes them up from where its copy stands;
    /// - the ring ends: the child holds a shared end, whose every operation reloads the
    ///   indices from shared memory under the cross-process side lock (which the parent
    ///   thread, still running in the parent, lets go);
    /// - the resolve, send and read gates: the state they order is in shared memory and the
    ///   kernel, looked at again by the next holder;
    /// - the fallback record and the grab's owner: single-word values.
    ///
    /// (The fd list is held across the fork instead: a `Vec` may be half-grown.)
    pub fn free_locks_in_child(&self) {
        self.switching.lock.free_in_child();
        self.switching.taken_from.free_in_child();
        self.rings.prod.free_in_child();
        self.rings.cons.free_in_child();
        self.decision.resolving.free_in_child();
        self.decision.plain.free_in_child();
        self.tcp.gate.free_in_child();
        self.tcp.read_gate.free_in_child();
    }

    /// About to fork (the table's change lock held): the fd list, held across the fork.
    pub fn hold_fds_for_fork(&self) {
        self.fds.acquire_for_fork(|_| {});
    }

    pub fn release_fds_after_fork(&self) {
        self.fds.release_after_fork();
    }

    /// Shared since a fork — unless every other holder has closed its copy since: then this
    /// end goes back to the lock-free path (the indices are reloaded once, as other processes
    /// may have moved them). Decided while no fork can happen in this process, so a fork
    /// cannot add a holder between the check and the switch.
    pub(super) fn still_shared(&self) -> bool {
        if !self.share.shared.load(Acquire) {
            return false;
        }
        let Some(w) = &self.share.side_words else {
            return true;
        };
        if w.holders.load(Acquire) > 1 {
            return true;
        }
        crate::table::without_fork(|| {
            if w.holders.load(Acquire) <= 1 && self.share.shared.load(Acquire) {
                self.alone_now(); // (after `pidfd_getfd`: nobody else to be unseen by)
                let nb = real::status_flags(self.kfd()) & libc::O_NONBLOCK != 0;
                self.nonblock.store(nb, Relaxed);
                self.share.resync_prod.store(true, Release);
                self.share.resync_cons.store(true, Release);
                self.share.shared.store(false, Release);
                tracing::debug!(ch = ?self.ch, "sole holder again: ring end no longer shared");
            }
        });
        self.share.shared.load(Acquire)
    }

    pub(super) fn side_lock(&self) -> Option<SideLock<'_>> {
        if !self.still_shared() {
            return None;
        }
        let w = self.share.side_words.as_ref()?;
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
                        // Losing this CAS means someone else took over first: fine.
                        let taken = w.lock.compare_exchange(holder, 0, AcqRel, Relaxed);
                        tracing::debug!(holder, ok = taken.is_ok(), "dead side-lock holder");
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    pub(super) fn with_prod<R>(
        &self,
        f: impl FnOnce(&mut StreamProducer) -> R,
    ) -> Result<R, c_int> {
        self.with_end(&self.rings.prod, &self.share.resync_prod, true, f)
    }

    pub(super) fn with_cons<R>(
        &self,
        f: impl FnOnce(&mut StreamConsumer) -> R,
    ) -> Result<R, c_int> {
        self.with_end(&self.rings.cons, &self.share.resync_cons, false, f)
    }

    /// Runs `f` on one ring end under its lock (and the cross-process side lock while the
    /// end is shared, reloading the indices other processes may have moved), then rings the
    /// peer if the operation found it asleep behind a doorbell.
    fn with_end<E: RingEnd, R>(
        &self,
        end: &ForkMutex<E>,
        resync: &AtomicBool,
        writing: bool,
        f: impl FnOnce(&mut E) -> R,
    ) -> Result<R, c_int> {
        let (r, bell) = {
            let mut e = end.lock();
            let _l = self.side_lock();
            self.on_ring(writing)?;
            if _l.is_some() || resync.swap(false, AcqRel) {
                e.resync().map_err(|_| libc::EIO)?;
            }
            let r = f(&mut e);
            (r, e.take_wake())
        };
        // Rung after the locks are dropped: the doorbell takes the side lock itself.
        self.wake_peer(bell);
        Ok(r)
    }

    /// This process closed its last fd for the connection. If no other process holds our
    /// end, shut the rings (what was sent is still delivered, then EOF) and release our side.
    pub fn release_with(&self, fd: c_int) {
        self.release();
        self.fds.lock().retain(|&f| f != fd);
    }

    pub(super) fn release(&self) {
        // No switch step of ours runs while the side is let go, and none starts after (each
        // looks at `released` under this lock): one after the channel is freed would write
        // into the slot's next occupant, and ring a doorbell on whatever socket reuses our fd.
        let _switching = self.switching.lock.lock();
        if let Some(p) = self.rings.prod.try_lock() {
            self.count_resizes(&p);
        }
        self.drop_grab();
        // A switched side (here, or by another process holding it) is still held in the
        // registry — its slot cannot be reused under a forked copy — but its rings are dead.
        let switched = self.side_switched();
        let on_ring = matches!(self.path(), Path::Ring | Path::Joining) && !switched;
        if !(on_ring || switched) || self.share.released.swap(true, AcqRel) {
            return;
        }
        if let Some(w) = &self.share.side_words {
            // A switched side may be held by a process that took its socket with
            // `pidfd_getfd` without telling us (`grab.rs`): counted down even when this
            // process thinks it holds it alone. (Never below zero: 0 is a side let go.)
            if self.share.shared.load(Acquire) || switched {
                let before = w
                    .holders
                    .fetch_update(AcqRel, Acquire, |n| Some(n.saturating_sub(1)))
                    .unwrap_or(0);
                let holders = before.saturating_sub(1);
                tracing::debug!(ch = ?self.ch, holders, "shared end closed here");
                if before > 1 {
                    self.give_side_back();
                    return;
                }
            }
        }
        if switched {
            self.close_side("switched side closed");
            return;
        }
        if self.path() == Path::Joining {
            // Closed while coming back: no read follows, the ring end closes as any other.
            self.decision.path.store(Path::Ring, Release);
        }
        let fd = self.kfd();
        // Claimed before our ring end shuts: a peer that sees our EOF finds us first.
        let peer_first = self
            .share
            .side_words
            .as_ref()
            .is_some_and(|w| w.close_first(self.side));
        // As the kernel: closing with data unread, or with SO_LINGER {1, 0}, resets the
        // connection. The real close then sends the RST; the peer reads what we sent, then
        // gets ECONNRESET (so the ring is not marked shut, which would read as a clean EOF).
        let abort = self.readable_bytes() > 0 || real::linger_zero(fd);
        if abort {
            self.log_ring_error("resetting our ring end", self.with_prod(|p| p.reset()));
            real::set_linger_zero(fd);
        } else {
            self.log_ring_error("shutting our ring end", self.with_prod(|p| p.shutdown()));
            // Doorbells left unread would make the kernel reset instead of closing cleanly.
            self.drain();
        }
        self.log_ring_error("closing our ring end", self.with_cons(|c| c.close()));
        if peer_first && !abort {
            super::linger::hold_for_peer_fin(fd);
        }
        // No doorbell: the shutdown (or reset) above woke the peer's sleepers as a
        // publication does — a futex sleeper directly, one behind a wake target or a doorbell
        // flag through `wake_peer` — and the real close's FIN reaches any sleeper in the
        // kernel. One more byte per close went to a peer that needed none: read, or, if its
        // socket was closed already, answered with a reset.
        if let Some(w) = &self.share.side_words {
            tracing::debug!(
                ch = ?self.ch,
                side = ?self.side,
                sent = w.doorbells_sent.load(Relaxed),
                read = w.doorbells_read.load(Relaxed),
                "doorbell counts at close"
            );
        }
        self.close_side("side closed");
    }

    /// Before an exec: a connection that switched to TCP gives up its hold on the channel (no
    /// later `close` of ours will run in the new image).
    pub fn release_switched(&self) {
        if self.side_switched() {
            self.release();
        }
    }

    /// Closes our side in the registry (the channel is freed with the second side).
    pub(super) fn close_side(&self, what: &str) {
        self.share.side_closed.store(true, Release);
        let reg = self.engine.registry();
        match reg.close(self.ch, self.side) {
            Ok(()) => tracing::debug!(ch = ?self.ch, side = ?self.side, "{what}"),
            Err(e) => tracing::debug!(ch = ?self.ch, "close: {e}"),
        }
    }
}

pub(super) struct SideLock<'a> {
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

/// What [`Conn::with_end`] needs of a ring end, as both ends of a stream ring provide it.
trait RingEnd {
    fn resync(&mut self) -> Result<(), memloop_ring::RingError>;
    fn take_wake(&mut self) -> u32;
}

macro_rules! ring_end {
    ($($end:ty),*) => {$(
        impl RingEnd for $end {
            fn resync(&mut self) -> Result<(), memloop_ring::RingError> {
                <$end>::resync(self)
            }
            fn take_wake(&mut self) -> u32 {
                <$end>::take_wake(self)
            }
        }
    )*};
}

ring_end!(StreamProducer, StreamConsumer);
