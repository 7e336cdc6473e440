//! Index bookkeeping shared by every ring flavour.
//!
//! Each side owns its index (the local copy is authoritative, the shared one is only published)
//! and keeps a cached copy of the peer's index, re-read only when the cache says full/empty.
//! Every re-read is validated: the peer's index may only move forward, never past ours (or
//! more than `capacity` ahead of it), and stays a multiple of the flavour's granule.

use crate::header::{
    Header, Mapping, RingKind, RFLAGS_KNOWN, RFLAG_CLOSED, RFLAG_RETURNED, WFLAGS_KNOWN,
    WFLAG_RESET, WFLAG_SHUTDOWN,
};
use crate::wait::{block_until, merge_wakes, Presences, Spinner, WaitPolicy};
use crate::RingError;
use memloop_shm::sync::Ordering::{Acquire, Release};
use memloop_shm::{ShmSlice, ShmU32};
use std::time::Duration;

/// Validates a (tail, head) pair read at attach time against the window in force.
fn check_span(tail: u64, head: u64, window: u64, granule: u64) -> Result<(), RingError> {
    let used = tail.wrapping_sub(head);
    if used > window {
        return Err(RingError::corrupt(
            "indices",
            format!("tail {tail} - head {head} exceeds the window {window}"),
        ));
    }
    if tail % granule != 0 || head % granule != 0 {
        return Err(RingError::corrupt(
            "indices",
            format!("tail {tail} / head {head} not multiples of {granule}"),
        ));
    }
    Ok(())
}

/// Loads a flag word and rejects unknown bits.
fn load_flags(word: &ShmU32, known: u32, what: &'static str) -> Result<u32, RingError> {
    let f = word.load(Acquire);
    if f & !known != 0 {
        return Err(RingError::corrupt(what, format!("unknown bits in {f:#x}")));
    }
    Ok(f)
}

/// Copies `src` into the data area at ring index `idx`, wrapping at the end.
pub(crate) fn copy_in(data: &ShmSlice, cap: u64, idx: u64, src: &[u8]) -> Result<(), RingError> {
    let off = idx & (cap - 1);
    let first = src.len().min((cap - off) as usize);
    data.write(off, &src[..first])?;
    data.write(0, &src[first..])?;
    Ok(())
}

/// Copies from the data area at ring index `idx` into `dst`, wrapping at the end.
pub(crate) fn copy_out(
    data: &ShmSlice,
    cap: u64,
    idx: u64,
    dst: &mut [u8],
) -> Result<(), RingError> {
    let off = idx & (cap - 1);
    let first = dst.len().min((cap - off) as usize);
    let (a, b) = dst.split_at_mut(first);
    data.read(off, a)?;
    data.read(0, b)?;
    Ok(())
}

/// The mapping of window `to` (larger than `m`'s) under which the `used` bytes from `head`
/// stay where `m` has them: the head keeps its offset, and a part wrapped around the old
/// window's end is first copied to just past it (its memory reserved by the caller). Returns
/// the mapping and whether it copied (then the originals must stay untouched until every
/// reader that may hold `m` has passed them).
pub(crate) fn grown_mapping(
    data: &ShmSlice,
    m: Mapping,
    head: u64,
    used: u64,
    to: u64,
) -> Result<(Mapping, bool), RingError> {
    let w = m.window;
    let s = m.at(head) & (w - 1);
    let wrapped = (s + used).saturating_sub(w);
    if wrapped > 0 {
        let mut tmp = vec![0u8; wrapped as usize];
        data.read(0, &mut tmp)?;
        data.write(w, &tmp)?;
    }
    let base = head.wrapping_sub(s);
    Ok((Mapping { window: to, base }, wrapped > 0))
}

/// Producer half: owns `tail`, caches `head`.
pub(crate) struct ProdCore {
    pub h: Header,
    pub tail: u64,
    /// The mapping in force (the producer is the one who changes it).
    pub map: Mapping,
    /// While the head is below this tail, writes do not wrap (header module text).
    hazard: Option<u64>,
    head_cache: u64,
    granule: u64,
    spinner: Spinner,
    /// What the consumer asked for to be woken outside the ring since the last `take_wake`.
    wake: u32,
}

impl ProdCore {
    pub fn attach(view: &ShmSlice, kind: RingKind, granule: u64) -> Result<Self, RingError> {
        let h = Header::attach(view, kind)?;
        // Granules are powers of two (slot sizes are validated so), checked with a mask.
        let granule = granule.max(1).next_power_of_two();
        let tail = h.tail.load(Acquire);
        let head = h.head.load(Acquire);
        let map = h.load_mapping()?;
        check_span(tail, head, map.window, granule)?;
        let hazard = Some(h.hazard.load(Acquire)).filter(|&z| z != 0);
        Ok(ProdCore {
            h,
            tail,
            map,
            hazard,
            head_cache: head,
            granule,
            spinner: Spinner::default(),
            wake: 0,
        })
    }

    /// The bytes in use: the window (indices map into it).
    pub fn cap(&self) -> u64 {
        self.map.window
    }

    /// The whole data area, the most the window can grow to.
    pub fn cap_max(&self) -> u64 {
        self.h.cap
    }

    fn free_cached(&self) -> u64 {
        let w = self.map.window;
        let free = w - self.tail.wrapping_sub(self.head_cache);
        match self.hazard {
            // No wrap yet: a reader with the mapping before the last copying grow may still
            // be reading the window's first bytes.
            Some(z) if self.head_cache.wrapping_sub(z) > u64::MAX / 2 => {
                let at = self.map.at(self.tail) & (w - 1);
                free.min(if at == 0 { 0 } else { w - at })
            }
            _ => free,
        }
    }

    /// Bytes published and not yet consumed as of the head last read: at least the truth.
    pub fn used_cached(&self) -> u64 {
        self.tail.wrapping_sub(self.head_cache)
    }

    /// Bytes published and not yet consumed (re-reads the head).
    pub fn used(&mut self) -> Result<u64, RingError> {
        self.refresh()?;
        Ok(self.tail.wrapping_sub(self.head_cache))
    }

    /// The head as last read.
    pub fn head(&self) -> u64 {
        self.head_cache
    }

    /// Puts mapping `m` in force (the caller holds the producer and keeps every unconsumed
    /// byte where `m` finds it: header module text); `hazard`: the tail of a grow that copied.
    pub fn set_mapping(&mut self, m: Mapping, hazard: Option<u64>) {
        debug_assert!(m.window.is_power_of_two() && m.window <= self.h.cap);
        if hazard.is_some() {
            self.hazard = hazard;
            self.h.hazard.store(hazard.unwrap_or(0), Release);
        }
        self.map = m;
        self.h.mapping.store(m.word(), Release);
    }

    /// Re-reads and validates the consumer's head; returns the free space.
    pub fn refresh(&mut self) -> Result<u64, RingError> {
        let new = self.h.head.load(Acquire);
        let moved = new.wrapping_sub(self.head_cache);
        if moved > self.tail.wrapping_sub(self.head_cache) || new & (self.granule - 1) != 0 {
            let detail = format!("head {new} (was {}, tail {})", self.head_cache, self.tail);
            return Err(RingError::corrupt(
                "consumer head moved backwards or past tail",
                detail,
            ));
        }
        self.head_cache = new;
        Ok(self.free_cached())
    }

    /// Free space, re-reading the head only if the cache shows less than `want`.
    pub fn free_for(&mut self, want: u64) -> Result<u64, RingError> {
        let free = self.free_cached();
        if free >= want {
            return Ok(free);
        }
        self.refresh()
    }

    /// Publishes `n` more bytes and wakes the consumer if it sleeps.
    pub fn publish(&mut self, n: u64) {
        self.tail = self.tail.wrapping_add(n);
        self.h.tail.store(self.tail, Release);
        self.wake = merge_wakes(self.wake, self.h.cons.notify());
    }

    /// `Err(Closed)` if the reader is gone, `Corrupt` on garbage flags.
    pub fn check_open(&self) -> Result<(), RingError> {
        let f = load_flags(&self.h.rflags, RFLAGS_KNOWN, "reader flags")?;
        if f & RFLAG_CLOSED != 0 {
            return Err(RingError::Closed);
        }
        Ok(())
    }

    /// Whether the reader handed back what it had not read ([`RFLAG_RETURNED`]; acquire:
    /// its last consumption is visible after it).
    pub fn handed_back(&self) -> Result<bool, RingError> {
        Ok(load_flags(&self.h.rflags, RFLAGS_KNOWN, "reader flags")? & RFLAG_RETURNED != 0)
    }

    pub fn reader_closed(&self) -> bool {
        !matches!(self.check_open(), Ok(()))
    }

    pub fn shutdown(&mut self) {
        self.h.wflags.fetch_or(WFLAG_SHUTDOWN, Release);
        self.wake = merge_wakes(self.wake, self.h.cons.notify());
    }

    /// The writer aborts (a TCP reset): the consumer reads what was published, then an error.
    pub fn reset(&mut self) {
        self.h.wflags.fetch_or(WFLAG_RESET, Release);
        self.wake = merge_wakes(self.wake, self.h.cons.notify());
    }

    /// Re-reads this side's own index from shared memory, for a producer shared between
    /// processes (after `fork`) that another holder may have advanced under a lock.
    pub fn resync(&mut self) -> Result<(), RingError> {
        let tail = self.h.tail.load(Acquire);
        let head = self.h.head.load(Acquire);
        let map = self.h.load_mapping()?;
        check_span(tail, head, map.window, self.granule)?;
        self.tail = tail;
        self.head_cache = head;
        self.map = map;
        self.hazard = Some(self.h.hazard.load(Acquire)).filter(|&z| z != 0);
        Ok(())
    }

    pub fn take_wake(&mut self) -> u32 {
        std::mem::take(&mut self.wake)
    }

    /// Waits until at least `bytes` are free or the reader closed.
    pub fn wait_writable(
        &mut self,
        bytes: u64,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        self.wait(policy, timeout, |c| Ok(c.free_for(bytes)? >= bytes))
    }

    /// Blocks until `ready(self)` or the reader closed.
    pub fn wait(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
        mut ready: impl FnMut(&mut Self) -> Result<bool, RingError>,
    ) -> Result<bool, RingError> {
        let cell = self.h.prod.clone();
        let (ours, peer) = (self.h.ppres.clone(), self.h.cpres.clone());
        let spinner = std::mem::take(&mut self.spinner);
        let who = Presences {
            ours: &ours,
            peer: &peer,
        };
        let r = block_until(&cell, &spinner, policy, Some(who), timeout, || {
            match self.check_open() {
                Err(RingError::Closed) => Ok(true),
                Err(e) => Err(e),
                Ok(()) => ready(self),
            }
        });
        self.spinner = spinner;
        r
    }
}

/// Consumer half: owns `head`, caches `tail`.
pub(crate) struct ConsCore {
    pub h: Header,
    pub head: u64,
    /// The mapping the bytes up to `tail_cache` are found with.
    pub map: Mapping,
    tail_cache: u64,
    granule: u64,
    spinner: Spinner,
    /// What the producer asked for to be woken outside the ring since the last `take_wake`.
    wake: u32,
    /// Reads without consuming: the head moves here only (see [`ConsCore::detach`]).
    detached: bool,
}

impl ConsCore {
    /// From now on this reader's consumption stays local: the ring's head does not move
    /// (a look at what the real reader has not read yet).
    pub fn detach(&mut self) {
        self.detached = true;
    }

    pub fn attach(view: &ShmSlice, kind: RingKind, granule: u64) -> Result<Self, RingError> {
        let h = Header::attach(view, kind)?;
        // Granules are powers of two (slot sizes are validated so), checked with a mask.
        let granule = granule.max(1).next_power_of_two();
        let head = h.head.load(Acquire);
        let tail = h.tail.load(Acquire);
        let map = h.load_mapping()?;
        check_span(tail, head, map.window, granule)?;
        Ok(ConsCore {
            h,
            head,
            map,
            tail_cache: tail,
            granule,
            spinner: Spinner::default(),
            wake: 0,
            detached: false,
        })
    }

    /// The window of the mapping the bytes in the ring are found with.
    pub fn cap(&self) -> u64 {
        self.map.window
    }

    fn avail_cached(&self) -> u64 {
        self.tail_cache.wrapping_sub(self.head)
    }

    /// Re-reads and validates the producer's tail; returns the bytes available.
    pub fn refresh(&mut self) -> Result<u64, RingError> {
        let new = self.h.tail.load(Acquire);
        // After the tail (acquire): a mapping that finds every byte up to it (header module
        // text: the producer keeps unconsumed bytes where every later mapping finds them).
        let map = self.h.load_mapping()?;
        let span = new.wrapping_sub(self.head);
        if span > map.window || span < self.avail_cached() || new & (self.granule - 1) != 0 {
            let detail = format!(
                "tail {new} (was {}, head {}, window {})",
                self.tail_cache, self.head, map.window
            );
            return Err(RingError::corrupt(
                "producer tail moved backwards or too far",
                detail,
            ));
        }
        self.tail_cache = new;
        self.map = map;
        Ok(span)
    }

    /// Bytes available, re-reading the tail only if the cache shows less than `want`.
    pub fn avail_for(&mut self, want: u64) -> Result<u64, RingError> {
        let avail = self.avail_cached();
        if avail >= want {
            return Ok(avail);
        }
        self.refresh()
    }

    /// Releases `n` bytes to the producer and wakes it if it sleeps.
    pub fn consume(&mut self, n: u64) {
        self.head = self.head.wrapping_add(n);
        if self.detached {
            return;
        }
        self.h.head.store(self.head, Release);
        self.wake = merge_wakes(self.wake, self.h.prod.notify());
    }

    /// See [`ProdCore::resync`].
    pub fn resync(&mut self) -> Result<(), RingError> {
        let head = self.h.head.load(Acquire);
        let tail = self.h.tail.load(Acquire);
        let map = self.h.load_mapping()?;
        check_span(tail, head, map.window, self.granule)?;
        self.head = head;
        self.tail_cache = tail;
        self.map = map;
        Ok(())
    }

    pub fn take_wake(&mut self) -> u32 {
        std::mem::take(&mut self.wake)
    }

    /// Whether the writer shut down (load before re-reading the tail: acquire makes every
    /// byte published before the shutdown visible).
    pub fn writer_shut(&self) -> Result<bool, RingError> {
        Ok(load_flags(&self.h.wflags, WFLAGS_KNOWN, "writer flags")? & WFLAG_SHUTDOWN != 0)
    }

    /// True when the writer shut down and everything published has been consumed.
    pub fn is_eof(&mut self) -> Result<bool, RingError> {
        if !self.writer_shut()? {
            return Ok(false);
        }
        Ok(self.refresh()? == 0)
    }

    /// Waits until at least `min` bytes are available or the writer shut down.
    pub fn wait_readable(
        &mut self,
        min: u64,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        self.wait(policy, timeout, |c| {
            Ok(c.avail_for(min)? >= min || c.writer_shut()?)
        })
    }

    pub fn close(&mut self) {
        self.close_with(RFLAG_CLOSED);
    }

    /// Closes, leaving what is unread to the producer ([`RFLAG_RETURNED`]).
    pub fn hand_back(&mut self) {
        self.close_with(RFLAG_CLOSED | RFLAG_RETURNED);
    }

    fn close_with(&mut self, flags: u32) {
        self.h.rflags.fetch_or(flags, Release);
        self.wake = merge_wakes(self.wake, self.h.prod.notify());
    }

    /// Blocks until `ready(self)`.
    pub fn wait(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
        mut ready: impl FnMut(&mut Self) -> Result<bool, RingError>,
    ) -> Result<bool, RingError> {
        let cell = self.h.cons.clone();
        let (ours, peer) = (self.h.cpres.clone(), self.h.ppres.clone());
        let spinner = std::mem::take(&mut self.spinner);
        let who = Presences {
            ours: &ours,
            peer: &peer,
        };
        let r = block_until(&cell, &spinner, policy, Some(who), timeout, || ready(self));
        self.spinner = spinner;
        r
    }
}

impl std::fmt::Debug for ProdCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &self.h.cap)
            .field("mapping", &self.map)
            .field("tail", &self.tail)
            .field("head_cache", &self.head_cache)
            .finish()
    }
}

impl std::fmt::Debug for ConsCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &self.h.cap)
            .field("mapping", &self.map)
            .field("head", &self.head)
            .field("tail_cache", &self.tail_cache)
            .finish()
    }
}
