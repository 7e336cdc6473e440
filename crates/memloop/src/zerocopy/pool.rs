//! A member's buffer pool: loans out of it, and finding what came back.

use crate::error::Error;
use crate::node::Node;
use memloop_registry::{PoolId, PoolInfo, Registry};
use memloop_ring::{Descriptor, WaitCell, WaitPolicy, WakeMode};
use memloop_shm::{BufMut, PoolMapping};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest sleep of a blocked [`Pool::loan`] between scans (a release rings the pool's bell
/// and wakes it sooner; a reader that died releases nothing, its channel's end does).
const LOAN_SLICE: Duration = Duration::from_millis(50);
/// Longest polling sleep of a loan waiting for a buffer a VM holds.
const POLL_SLICE: Duration = Duration::from_millis(1);
/// Pools of buffers this large look for returned buffers at every loan (see `loan_now`).
const EAGER_SCAN_BYTES: u32 = 512 << 10;

/// A pool of fixed-size buffers that this member owns and loans out.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

pub(super) struct PoolInner {
    node: Node,
    info: PoolInfo,
    map: Arc<PoolMapping>,
    st: Mutex<PoolState>,
}

/// Which buffers may be free. A buffer is `out` from its loan until a scan finds no
/// descriptor naming it; `loaned` while a [`Loan`] of it lives (not sent yet).
struct PoolState {
    free: Vec<u32>,
    out: Vec<bool>,
    loaned: Vec<bool>,
    /// Loans not yet added to the pool's counter in the region (added at each scan).
    uncounted: u64,
    /// The descriptor channels the last scan found.
    cache: memloop_registry::ScanCache,
}

impl Pool {
    /// Creates a pool of `buffers` buffers of `buf_size` bytes (rounded up to 64) in the
    /// node's region, mapped writable for us only.
    pub fn create(node: &Node, buf_size: u32, buffers: u32) -> Result<Pool, Error> {
        let n = &node.inner;
        let reg = n.region.registry();
        // A full region may be full of the dead's pools: reclaim them and try once more, as
        // an offer does.
        let info = match reg.create_pool(n.id, buf_size, buffers) {
            Err(memloop_registry::RegistryError::RegionFull { .. }) if n.reclaim_dead() > 0 => {
                reg.create_pool(n.id, buf_size, buffers)?
            }
            r => r?,
        };
        let map = PoolMapping::map(
            n.region.mapping(),
            info.data_off,
            info.buf_size,
            info.buffers,
            true,
        );
        let map = match map {
            Ok(m) => m,
            Err(e) => {
                reg.close_pool(info.id).ok();
                reg.collect_pool(info.id).ok();
                return Err(e.into());
            }
        };
        // Our pool must be closed when we die: that is the heartbeat's sweep.
        node.hold();
        Ok(Pool {
            inner: Arc::new(PoolInner {
                node: node.clone(),
                info,
                map,
                st: Mutex::new(PoolState {
                    free: (0..info.buffers).rev().collect(),
                    out: vec![false; info.buffers as usize],
                    loaned: vec![false; info.buffers as usize],
                    uncounted: 0,
                    cache: Default::default(),
                }),
            }),
        })
    }

    pub fn id(&self) -> PoolId {
        self.inner.info.id
    }
    pub fn buf_size(&self) -> usize {
        self.inner.info.buf_size as usize
    }
    pub fn buffers(&self) -> usize {
        self.inner.info.buffers as usize
    }

    /// A buffer now, or [`Error::WouldBlock`] if every one is still referenced.
    pub fn try_loan(&self) -> Result<Loan, Error> {
        self.inner.loan_now()?.ok_or(Error::WouldBlock)
    }

    /// A buffer, waiting for one to come back.
    pub fn loan(&self) -> Result<Loan, Error> {
        self.loan_timeout(None)
    }

    /// [`Pool::loan`] waiting at most `timeout` ([`Error::TimedOut`]).
    pub fn loan_timeout(&self, timeout: Option<Duration>) -> Result<Loan, Error> {
        if let Some(l) = self.inner.loan_now()? {
            return Ok(l);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let bell = self.inner.bell()?;
        let policy = self.inner.policy();
        let mut backoff = memloop_ring::wait::MIN_BACKOFF;
        loop {
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => l,
                    _ => return Err(Error::TimedOut),
                },
                None => LOAN_SLICE,
            };
            // Armed, then looked again: a release after the look rings the bell.
            let seen = bell.arm();
            if let Some(l) = self.inner.loan_now()? {
                bell.disarm();
                return Ok(l);
            }
            bell.sleep(seen, &policy, left.min(LOAN_SLICE), &mut backoff);
            bell.disarm();
            if let Some(l) = self.inner.loan_now()? {
                return Ok(l);
            }
        }
    }

    /// Buffers neither on loan nor referenced by any descriptor ring (scans the rings).
    pub fn free_buffers(&self) -> Result<usize, Error> {
        let mut st = self.inner.state();
        self.inner.refill(&mut st)?;
        Ok(st.free.len())
    }
}

impl PoolInner {
    fn registry(&self) -> &Registry {
        self.node.inner.region.registry()
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bell(&self) -> Result<WaitCell, Error> {
        let (waiting, seq) = self.registry().pool_bell(self.info.id)?;
        Ok(WaitCell::new(waiting, seq))
    }

    /// How a loan waits for a buffer: on the bell's futex, unless a holder may be in another
    /// kernel (a VM on the region), whose release cannot wake a futex — then polling sleeps
    /// of at most [`POLL_SLICE`]. (Looked up per wait: a VM may join at any time.)
    fn policy(&self) -> WaitPolicy {
        let region = &self.node.inner.region;
        let futex = region.futex_usable()
            && !region
                .registry()
                .has_member_booted_elsewhere(&crate::identity::boot_id());
        WaitPolicy {
            mode: if futex {
                WakeMode::Futex
            } else {
                WakeMode::SleepPoll
            },
            spin: Duration::ZERO,
            max_sleep: if futex { LOAN_SLICE } else { POLL_SLICE },
        }
    }

    fn loan_now(self: &Arc<Self>) -> Result<Option<Loan>, Error> {
        let mut st = self.state();
        // Large buffers (beyond a core's L2): a scan per loan (a cached scan: well under a
        // µs) puts the buffer that came back last on top, still warm in the shared cache —
        // cycling through a pool of 4 MiB buffers streams every one from memory. Smaller
        // ones scan only when none is known free: reusing the buffer the peer just read would
        // pull every line back from its cache, where rotation lets them settle.
        if st.free.is_empty() || self.info.buf_size >= EAGER_SCAN_BYTES {
            self.refill(&mut st)?;
        }
        let Some(i) = st.free.pop() else {
            return Ok(None);
        };
        let buf = self
            .map
            .take(i)
            .ok_or_else(|| Error::Io(std::io::Error::other(format!("buffer {i} taken twice"))))?;
        st.out[i as usize] = true;
        st.loaned[i as usize] = true;
        st.uncounted += 1;
        drop(st);
        let len = buf.len();
        Ok(Some(Loan {
            pool: self.clone(),
            buf: Some(buf),
            len,
        }))
    }

    /// Finds the buffers that came back: out, not on loan, named by no descriptor ring. A
    /// scan that could not finish returns nothing this time (never a buffer still in use).
    fn refill(&self, st: &mut PoolState) -> Result<(), Error> {
        self.registry()
            .note_loans(self.info.id, std::mem::take(&mut st.uncounted));
        let refs = match self
            .registry()
            .pool_references_cached(&self.info, &mut st.cache)
        {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(pool = self.info.id.idx, "scan for free buffers: {e}");
                return Ok(());
            }
        };
        for (i, referenced) in refs.into_iter().enumerate() {
            if st.out[i] && !st.loaned[i] && !referenced {
                st.out[i] = false;
                st.free.push(i as u32);
            }
        }
        Ok(())
    }

    /// The loan of buffer `i` was published in a descriptor ring (or dropped unsent).
    fn loan_over(&self, i: u32, sent: bool) {
        let mut st = self.state();
        st.loaned[i as usize] = false;
        if !sent {
            st.out[i as usize] = false;
            st.free.push(i);
        }
    }
}

impl Drop for PoolInner {
    /// Closing: holders keep reading; the pool goes once nothing references it (now, or at
    /// the last release, or at a sweep).
    fn drop(&mut self) {
        let uncounted = self.st.get_mut().map_or(0, |s| s.uncounted);
        let reg = self.registry();
        reg.note_loans(self.info.id, uncounted);
        if let Err(e) = reg.close_pool(self.info.id) {
            tracing::debug!(pool = self.info.id.idx, "closing a pool: {e}");
        }
        reg.collect_pool(self.info.id).ok();
    }
}

/// A buffer on loan: write into it, then send it (or drop it to give it back unsent).
pub struct Loan {
    pool: Arc<PoolInner>,
    buf: Option<BufMut>,
    len: usize,
}

impl Loan {
    /// The buffer's full size.
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Sends only the first `len` bytes (at most the capacity).
    pub fn truncate(&mut self, len: usize) {
        self.len = len.min(self.capacity());
    }

    pub fn pool(&self) -> PoolId {
        self.pool.info.id
    }

    /// The descriptor naming this loan's bytes.
    pub(super) fn descriptor(&self) -> Descriptor {
        let info = &self.pool.info;
        let i = self.buf.as_ref().map_or(0, |b| b.index());
        Descriptor {
            pool: info.id.wire(),
            offset: i as u64 * info.buf_size as u64,
            len: self.len as u32,
            owner: info.owner_tag,
            pool_gen: info.id.gen,
            ..Descriptor::default()
        }
    }

    /// The descriptor is published: the buffer is the rings' now.
    pub(super) fn sent(mut self) {
        if let Some(b) = self.buf.take() {
            let i = b.index();
            drop(b);
            self.pool.loan_over(i, true);
        }
    }
}

impl Deref for Loan {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().map_or(&[], |b| &b[..self.len])
    }
}

impl DerefMut for Loan {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        self.buf.as_deref_mut().map_or(&mut [], |b| &mut b[..len])
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let i = b.index();
            drop(b);
            self.pool.loan_over(i, false);
        }
    }
}
