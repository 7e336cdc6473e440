//! A TCP connection that stays on the kernel path after memloop considered it: recorded in
//! the region so `memloop status` can show it with its reason and byte counts.

use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::late::Late;
use crate::real;
use libc::c_int;
use memloop::registry::{ChannelId, ConnRecordId, ConnTuple, FallbackReason, Proto, SwitchReason};
use memloop_shm::ShmU64;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::*};
use std::sync::Arc;
use std::time::Duration;

pub struct PlainTcp {
    engine: Arc<Engine>,
    record: Option<(ConnRecordId, ShmU64, ShmU64)>,
    /// The server's decline marker, freed when the connection closes.
    marker: Option<ChannelId>,
    /// Bytes a switch from the ring still re-sends: the program's own sends wait for them.
    resend: Option<Arc<Resend>>,
    /// Armed for a late ring (`crate::late`): only if the peer is a member and the reason
    /// for TCP may pass.
    late: Option<Arc<Late>>,
    /// The process that made the record and the marker: only it counts into the record and
    /// frees both. A fork child holds a copy of this object, but the parent may close first
    /// and free the record, whose slot the next connection then takes: the child's counts
    /// would land on that one (they are left out: `memloop status` under-reports a forked
    /// handler's TCP bytes rather than give them to another connection).
    pid: u32,
}

/// Bytes the peer never consumed from our ring, re-sent over TCP after a switch. What the
/// socket takes at once is sent inline; the rest by a thread of its own (both sides may be
/// re-sending a full ring to each other, and neither reads until its takeover is over), on a
/// duplicate of the socket so the program may close its fd meanwhile.
pub struct Resend {
    done: AtomicBool,
    /// The duplicate the thread writes on (-1 once closed).
    fd: AtomicI32,
}

/// Re-sends still under way in this process (exec waits for them; a fork child forgets them).
static RESENDS: ForkMutex<Vec<Arc<Resend>>> = ForkMutex::new(Vec::new());

impl Resend {
    /// Sends `bytes` on `fd`; `None` when that finished inline.
    /// Sends `bytes` on `fd`, then shuts its write side down if `shut_wr`; `None` when that
    /// finished inline.
    pub fn start(fd: c_int, bytes: Vec<u8>, shut_wr: bool) -> Result<Option<Arc<Resend>>, c_int> {
        let sent = real::send_now(fd, &bytes)?;
        if sent == bytes.len() {
            if shut_wr {
                real::shutdown_now(fd, libc::SHUT_WR);
            }
            return Ok(None);
        }
        let dup = real::dup_cloexec(fd)?;
        let r = Arc::new(Resend {
            done: AtomicBool::new(false),
            fd: AtomicI32::new(dup),
        });
        RESENDS.lock().push(r.clone());
        let t = r.clone();
        let bytes: Arc<[u8]> = bytes.into();
        let rest = bytes.clone();
        let spawned = std::thread::Builder::new()
            .name("memloop-resend".into())
            .spawn(move || {
                match real::send_all(dup, &rest[sent..]) {
                    Ok(()) if shut_wr => real::shutdown_now(dup, libc::SHUT_WR),
                    Ok(()) => {}
                    Err(e) => tracing::debug!(errno = e, "re-sending after a switch failed"),
                }
                t.finish();
            });
        if let Err(e) = spawned {
            tracing::debug!("no re-send thread ({e}): sending inline");
            let r2 = real::send_all(dup, &bytes[sent..]);
            if r2.is_ok() && shut_wr {
                real::shutdown_now(dup, libc::SHUT_WR);
            }
            r.finish();
            r2?;
        }
        Ok(Some(r))
    }

    fn finish(&self) {
        let fd = self.fd.swap(-1, AcqRel);
        if fd >= 0 {
            real::close_own(fd);
        }
        self.done.store(true, Release);
        RESENDS.lock().retain(|r| !r.done.load(Acquire));
    }

    /// Waits until every byte went out (or the connection failed).
    pub fn wait(&self) {
        let mut pause = Duration::from_micros(10);
        while !self.done.load(Acquire) {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}

/// Before exec: every re-send must be out (its thread does not survive the exec).
pub fn finish_resends() {
    let pending: Vec<_> = RESENDS.lock().clone();
    pending.iter().for_each(|r| r.wait());
}

pub fn lock_for_fork() {
    RESENDS.acquire_for_fork(|r| {
        if !r.is_empty() {
            crate::dispatch::child_needs_engine();
        }
    });
}

pub fn release_after_fork() {
    RESENDS.release_after_fork();
}

/// In a fork child: the re-send threads are the parent's; close our copies of their fds
/// (they would hold the connection open) and let our sends go on.
pub fn forget_resends_in_child() {
    for r in RESENDS.lock().drain(..) {
        let fd = r.fd.swap(-1, AcqRel);
        if fd >= 0 {
            real::close_own(fd);
        }
        r.done.store(true, Release);
    }
}

impl PlainTcp {
    /// Counts the fallback and records the connection (unrecorded if the table is full).
    pub fn record(
        engine: &Arc<Engine>,
        tuple: &ConnTuple,
        reason: FallbackReason,
        marker: Option<ChannelId>,
        late: Option<Arc<Late>>,
    ) -> Arc<PlainTcp> {
        let reg = engine.registry();
        let record = reg
            .record_conn(
                engine.me(),
                crate::real::getpid(),
                Proto::Tcp,
                tuple,
                reason,
            )
            .and_then(|id| match reg.conn_bytes(id) {
                Ok((s, r)) => Some((id, s, r)),
                Err(e) => {
                    // Recorded without byte counts: `memloop status` shows the connection.
                    tracing::debug!(?id, %e, "connection record without byte counters");
                    None
                }
            });
        Arc::new(PlainTcp {
            engine: engine.clone(),
            record,
            marker,
            resend: None,
            late,
            pid: crate::real::getpid(),
        })
    }

    /// Its late-ring state, if armed.
    #[inline]
    pub fn late(&self) -> Option<&Arc<Late>> {
        self.late.as_ref()
    }

    /// A connection that switched from its ring to TCP for `reason`, after `ring_bytes`
    /// (sent + received here) on its ring.
    pub fn switched(
        engine: &Arc<Engine>,
        tuple: &ConnTuple,
        reason: SwitchReason,
        ring_bytes: u64,
        resend: Option<Arc<Resend>>,
    ) -> Arc<PlainTcp> {
        let reg = engine.registry();
        let pid = crate::real::getpid();
        let record = reg
            .record_switched_conn(engine.me(), pid, Proto::Tcp, tuple, reason, ring_bytes)
            .and_then(|id| reg.conn_bytes(id).ok().map(|(s, r)| (id, s, r)));
        Arc::new(PlainTcp {
            engine: engine.clone(),
            record,
            marker: None,
            resend,
            late: None,
            pid: crate::real::getpid(),
        })
    }

    /// No bytes of a switch are still being re-sent.
    pub fn resent(&self) -> bool {
        self.resend.as_ref().map_or(true, |r| r.done.load(Acquire))
    }

    /// A send waits for the bytes a switch still re-sends (they come first in the stream).
    pub fn before_send(&self) {
        if let Some(r) = &self.resend {
            r.wait();
        }
    }

    pub fn unrecorded(engine: &Arc<Engine>, marker: Option<ChannelId>) -> Arc<PlainTcp> {
        PlainTcp::unrecorded_late(engine, marker, None)
    }

    /// Not recorded for `memloop status`, armed for a late ring if `late`.
    pub fn unrecorded_late(
        engine: &Arc<Engine>,
        marker: Option<ChannelId>,
        late: Option<Arc<Late>>,
    ) -> Arc<PlainTcp> {
        Arc::new(PlainTcp {
            engine: engine.clone(),
            record: None,
            marker,
            resend: None,
            late,
            pid: crate::real::getpid(),
        })
    }

    pub fn count_sent(&self, n: isize) {
        if let (Some((_, s, _)), true) = (self.own_record(), n > 0) {
            s.fetch_add(n as u64, Relaxed);
        }
    }

    pub fn count_received(&self, n: isize) {
        if let (Some((_, _, r)), true) = (self.own_record(), n > 0) {
            r.fetch_add(n as u64, Relaxed);
        }
    }

    /// The record, in the process that made it (see `pid`).
    fn own_record(&self) -> Option<&(ConnRecordId, ShmU64, ShmU64)> {
        self.record.as_ref().filter(|_| self.made_here())
    }

    fn made_here(&self) -> bool {
        self.pid == crate::real::getpid()
    }
}

impl PlainTcp {
    /// A fork child may use this connection without the engine: nothing of it is armed for a
    /// late ring or being re-sent (the child never counts into the parent's record).
    pub fn child_needs_nothing(&self) -> bool {
        self.late.is_none() && self.resend.is_none()
    }
}

impl Drop for PlainTcp {
    fn drop(&mut self) {
        if !self.made_here() {
            return; // the record and the marker are the parent's to free
        }
        let reg = self.engine.registry();
        // Best effort in a destructor: a failure means the slot was reclaimed or reused.
        if let Some((id, _, _)) = self.record {
            if let Err(e) = reg.release_conn(id) {
                tracing::debug!(?id, %e, "connection record not released");
            }
        }
        if let Some(m) = self.marker {
            if let Err(e) = reg.free_marker(m, self.engine.me()) {
                tracing::debug!(?m, %e, "decline marker not freed");
            }
        }
    }
}
