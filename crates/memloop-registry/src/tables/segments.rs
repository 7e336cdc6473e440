//! The ring heap: the rest of the region, cut into equal segments.
//!
//! Each segment has an owner tag word (0 = free, else the packed id of the owning channel slot
//! and its generation). Tags are claimed one by one with CAS; a contiguous multi-segment
//! allocation that meets a conflict rolls back what it claimed. Because the tag names a channel
//! *incarnation*, memory whose owner has moved on (freed, reused, or a freer that died half-way)
//! is recognisable as an orphan and [`Registry::sweep_orphans`] returns it.
//!
//! | offset | field |
//! | --- | --- |
//! | tags + 8·s | owner of segment `s`: packed (channel slot, generation), 0 = free |
//! | heap + s·segment size | the segment's bytes (rings of its owner) |
//!
//! A tag is a packed id, not a [`StateWord`](crate::state_word::StateWord): it has no state of
//! its own, only an owner whose state word says whether the tag is still meant.

use crate::error::RegistryError;
use crate::key::{pack_id, unpack_id, ChannelId};
use crate::tables::channels::{c_phase, C_FREE};
use crate::Registry;
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};

impl Registry {
    /// Borrowed, not a view of its own: allocation and the orphan sweep visit every tag.
    fn tag_word(&self, seg: u64) -> Result<&memloop_shm::sync::AtomicU64, RegistryError> {
        Ok(self.view.atomic_u64(self.layout.tags_off + 8 * seg)?)
    }

    fn tag(&self, seg: u64) -> u64 {
        self.tag_word(seg)
            .map(|w| w.load(SeqCst))
            .unwrap_or(u64::MAX)
    }

    /// Byte offset (in the region) of segment `seg`.
    pub(crate) fn segment_offset(&self, seg: u64) -> u64 {
        self.layout.heap_off + seg * self.layout.params.segment_size
    }

    /// Segments needed for `bytes`.
    pub(crate) fn segments_for(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.layout.params.segment_size)
    }

    /// Claims `k` contiguous free segments for channel `ch`; returns the first one.
    pub(crate) fn alloc_segments(&self, ch: ChannelId, k: u64) -> Result<u64, RegistryError> {
        let n = self.layout.nsegments;
        let full = RegistryError::RegionFull {
            what: "ring memory",
        };
        if k == 0 || k > n {
            return Err(full);
        }
        let tag = pack_id(ch.idx, ch.gen);
        let mut start = 0;
        while start + k <= n {
            match (start..start + k).find(|&s| self.tag(s) != 0) {
                Some(busy) => start = busy + 1,
                None => match self.claim_run(start, k, tag)? {
                    None => return Ok(start),
                    Some(conflict) => start = conflict + 1,
                },
            }
        }
        Err(full)
    }

    /// Reserves memory for segments `first..first+k` before their rings are first touched:
    /// the region is a sparse file, and on a full file system a write to an unbacked page is
    /// a SIGBUS. A reservation costs ~0.2 µs a page even over memory already reserved, so a
    /// header word remembers how far the heap is reserved (every segment below it is) —
    /// allocation is first-fit, so most offers reuse segments below the mark and pay nothing.
    /// Each reserver reserves from the mark it read to its own end, then raises the mark.
    pub(crate) fn commit_segments(&self, first: u64, k: u64) -> Result<(), RegistryError> {
        let end = first + k;
        let mark = self.heap_mark();
        let from = match &mark {
            Some(m) => m.load(SeqCst),
            None => first, // (a loom model's header has no room for the word)
        };
        if end <= from && mark.is_some() {
            return Ok(());
        }
        let (off, len) = (
            self.segment_offset(from),
            self.segment_offset(end) - self.segment_offset(from),
        );
        self.view.commit(off, len).map_err(crate::header::no_room)?;
        if let Some(m) = mark {
            m.fetch_max(end, SeqCst);
        }
        Ok(())
    }

    /// CASes `k` tags from `start`; on a conflict rolls back and returns where it happened.
    fn claim_run(&self, start: u64, k: u64, tag: u64) -> Result<Option<u64>, RegistryError> {
        for s in start..start + k {
            if self
                .tag_word(s)?
                .compare_exchange(0, tag, SeqCst, Relaxed)
                .is_err()
            {
                for r in start..s {
                    self.tag_word(r)?
                        .compare_exchange(tag, 0, SeqCst, Relaxed)
                        .ok();
                }
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// Frees every segment tagged with channel incarnation `ch`; returns how many.
    pub(crate) fn release_segments(&self, ch: ChannelId) -> u64 {
        let tag = pack_id(ch.idx, ch.gen);
        // Fast path: the run the channel entry points at (a closing connection must not scan
        // the whole heap). The entry may be stale if the offer failed half-built; then scan.
        let freed = self.release_run(ch, tag);
        if freed > 0 {
            return freed;
        }
        let mut freed = 0;
        for s in 0..self.layout.nsegments {
            if self.tag(s) == tag {
                if let Ok(w) = self.tag_word(s) {
                    freed += w.compare_exchange(tag, 0, SeqCst, Relaxed).is_ok() as u64;
                }
            }
        }
        freed
    }

    /// Frees the segments from the channel's first ring on while they carry `tag`.
    fn release_run(&self, ch: ChannelId, tag: u64) -> u64 {
        let Some(first) = self.channel_first_segment(ch) else {
            return 0;
        };
        let mut freed = 0;
        for s in first..self.layout.nsegments {
            let Ok(w) = self.tag_word(s) else { break };
            if w.compare_exchange(tag, 0, SeqCst, Relaxed).is_err() {
                break;
            }
            freed += 1;
        }
        freed
    }

    /// Whether every segment under `off..off + len` is tagged as channel `ch`'s (a ring view
    /// that reaches memory of another channel, or free memory, is a corrupt entry).
    pub(crate) fn range_owned_by(&self, ch: ChannelId, off: u64, len: u64) -> bool {
        let seg = self.layout.params.segment_size;
        let (Some(rel), Some(end)) = (off.checked_sub(self.layout.heap_off), off.checked_add(len))
        else {
            return false;
        };
        if len == 0 || end > self.layout.heap_end() {
            return false;
        }
        let (first, last) = (rel / seg, (rel + len - 1) / seg);
        let tag = pack_id(ch.idx, ch.gen);
        (first..=last).all(|s| s < self.layout.nsegments && self.tag(s) == tag)
    }

    /// The segment holding the start of the channel's first ring, if the entry names one.
    fn channel_first_segment(&self, ch: ChannelId) -> Option<u64> {
        let off = self.channel_c2s(ch)?;
        let rel = off.checked_sub(self.layout.heap_off)?;
        let seg = rel / self.layout.params.segment_size;
        (rel % self.layout.params.segment_size == 0 && seg < self.layout.nsegments).then_some(seg)
    }

    pub(crate) fn segments_used(&self) -> u64 {
        (0..self.layout.nsegments)
            .filter(|&s| self.tag(s) != 0)
            .count() as u64
    }

    /// Frees segments whose owner tag names a FREE channel slot, an older generation of the
    /// slot, or no valid slot at all. Returns how many were freed.
    pub fn sweep_orphans(&self) -> u64 {
        let mut freed = 0;
        for s in 0..self.layout.nsegments {
            let t = self.tag(s);
            if t == 0 || !self.is_orphan(t) {
                continue;
            }
            if let Ok(w) = self.tag_word(s) {
                if w.compare_exchange(t, 0, SeqCst, Relaxed).is_ok() {
                    tracing::debug!(segment = s, tag = t, "freed orphan ring segment");
                    freed += 1;
                }
            }
        }
        freed
    }

    /// The tag was read before the slot's state word (SeqCst), so an owner that claimed the slot
    /// and then the segment is seen RESERVED (or later) with the same generation.
    fn is_orphan(&self, tag: u64) -> bool {
        let Some((idx, gen)) = unpack_id(tag, self.layout.params.max_channels) else {
            return true;
        };
        match self.channel_word(idx) {
            Ok(w) => c_phase(w) == C_FREE || w.gen() != gen,
            Err(_) => false,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{RegionParams, Registry};
    use memloop_shm::sync::Ordering::SeqCst;
    use memloop_shm::ShmSlice;

    #[test]
    fn the_reservation_mark_only_rises_and_covers_every_segment_below_it() {
        let p = RegionParams::small(1 << 20);
        let r = Registry::init(ShmSlice::new_heap(p.size as usize), &p).unwrap();
        let mark = || r.heap_mark().unwrap().load(SeqCst);
        assert_eq!(mark(), 0);
        r.commit_segments(2, 2).unwrap(); // from the mark: 0..4 reserved
        assert_eq!(mark(), 4);
        r.commit_segments(0, 3).unwrap(); // below the mark: nothing to do
        assert_eq!(mark(), 4);
        r.commit_segments(6, 1).unwrap(); // the gap 4..6 too
        assert_eq!(mark(), 7);
        assert!(
            r.commit_segments(r.nsegments(), 1).is_err(),
            "past the heap"
        );
        assert_eq!(mark(), 7);
    }
}
