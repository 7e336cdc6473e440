//! The ring heap: the rest of the region, cut into equal segments.
//!
//! Each segment has an owner tag word: the packed id of the owning channel slot and its
//! generation, or one of the free states below. Tags are claimed one by one with CAS; a
//! contiguous multi-segment allocation that meets a conflict rolls back what it claimed.
//! Because the tag names a channel *incarnation*, memory whose owner has moved on (freed,
//! reused, or a freer that died half-way) is recognisable as an orphan and
//! [`Registry::sweep_orphans`] returns it.
//!
//! | offset | field |
//! | --- | --- |
//! | tags + 8·s | owner of segment `s`: packed (channel slot, generation), or a free state |
//! | heap + s·segment size | the segment's bytes (rings of its owner) |
//!
//! The region is a sparse file: an owner reserves memory (`fallocate`) for the part of its
//! segments it uses before touching it — on a full file system a write to an unbacked page is
//! a SIGBUS — and memory comes back to the system (a hole punched) once a segment has been
//! free for a while. The free states say how long: `0` free (never used, or given back);
//! [`FREE_RESERVED`] freed by its last owner, some of its memory perhaps still reserved;
//! [`FREE_AGED`] found free by one [`Registry::trim_segments`] already — the next one gives
//! it back, under [`TRIMMING`] so that nobody claims memory while its hole is punched.
//!
//! A tag is a packed id, not a [`StateWord`](crate::state_word::StateWord): it has no state of
//! its own, only an owner whose state word says whether the tag is still meant.

use crate::error::RegistryError;
use crate::header::{H_SEGMENTS_USED, H_SEGMENT_HINT};
use crate::key::{member_tag, pack_id, unpack_id, ChannelId, MemberId};
use crate::tables::channels::{c_phase, C_FREE};
use crate::tables::pools::POOL_TAG_BIT;
use crate::Registry;
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};

/// Free, memory reserved (see the module text). Packed ids never have all-ones low words.
pub(crate) const FREE_RESERVED: u64 = 0xffff_ffff;
/// Free, memory reserved, already seen free by one trim.
pub(crate) const FREE_AGED: u64 = 0xffff_fffe;
/// Low word of a tag held by a member giving the segment's memory back (its member tag in the
/// high word: a trimmer that dies leaves it to the orphan sweep).
pub(crate) const TRIMMING: u64 = 0xffff_fffd;

fn is_free(t: u64) -> bool {
    matches!(t, 0 | FREE_RESERVED | FREE_AGED)
}

fn is_trimming(t: u64) -> bool {
    t & 0xffff_ffff == TRIMMING
}

/// A tag naming a channel (neither free nor being trimmed).
fn is_owned(t: u64) -> bool {
    !is_free(t) && !is_trimming(t)
}

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

    /// Claims `k` contiguous free segments for channel `ch`; returns the first one. Next fit
    /// from a header hint: with thousands of live rings a search from segment 0 would walk
    /// all of them. The caller reserves memory for the part it touches.
    pub(crate) fn alloc_segments(&self, ch: ChannelId, k: u64) -> Result<u64, RegistryError> {
        self.alloc_tagged(pack_id(ch.idx, ch.gen), k)
    }

    /// [`Registry::alloc_segments`] for any owner's tag (a channel's, a pool's).
    pub(crate) fn alloc_tagged(&self, tag: u64, k: u64) -> Result<u64, RegistryError> {
        let n = self.layout.nsegments;
        let full = RegistryError::RegionFull {
            what: "ring memory",
        };
        if k == 0 || k > n {
            return Err(full);
        }
        let hint = self.header_hint(H_SEGMENT_HINT);
        let from = hint.as_ref().map_or(0, |h| h.load(Relaxed) % n);
        let first = self.find_run(from, k, tag)?.ok_or(full)?;
        if let Some(h) = hint {
            h.store((first + k) % n, Relaxed);
        }
        if let Some(used) = self.header_hint(H_SEGMENTS_USED) {
            used.fetch_add(k, Relaxed);
        }
        Ok(first)
    }

    /// The first run of `k` free segments from `from` on (then from 0), claimed for `tag`.
    fn find_run(&self, from: u64, k: u64, tag: u64) -> Result<Option<u64>, RegistryError> {
        let n = self.layout.nsegments;
        for (lo, hi) in [(from, n), (0, (from + k).min(n))] {
            let mut start = lo;
            while start + k <= hi {
                match (start..start + k).find(|&s| !is_free(self.tag(s))) {
                    Some(busy) => start = busy + 1,
                    None => match self.claim_run(start, k, tag)? {
                        None => return Ok(Some(start)),
                        Some(conflict) => start = conflict + 1,
                    },
                }
            }
        }
        Ok(None)
    }

    /// CASes `k` tags from `start` to `tag`; on a conflict rolls back and says where it
    /// happened.
    fn claim_run(&self, start: u64, k: u64, tag: u64) -> Result<Option<u64>, RegistryError> {
        for s in start..start + k {
            let w = self.tag_word(s)?;
            let t = w.load(SeqCst);
            if !is_free(t) || w.compare_exchange(t, tag, SeqCst, Relaxed).is_err() {
                // (Back to "perhaps not reserved": safe, the next owner reserves again.)
                self.free_run(start, s - start, tag, 0);
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// Sets the tags of `first..first+k` still carrying `tag` to `to`; returns how many.
    fn free_run(&self, first: u64, k: u64, tag: u64, to: u64) -> u64 {
        let mut freed = 0;
        for s in first..first + k {
            if let Ok(w) = self.tag_word(s) {
                freed += w.compare_exchange(tag, to, SeqCst, Relaxed).is_ok() as u64;
            }
        }
        self.segments_gone(freed);
        freed
    }

    fn segments_gone(&self, n: u64) {
        if let Some(used) = self.header_hint(H_SEGMENTS_USED) {
            crate::tables::step_count_by(&used, n);
        }
    }

    /// Frees every segment tagged with channel incarnation `ch`; returns how many. Their
    /// memory stays reserved for the next owner until a trim gives it back.
    pub(crate) fn release_segments(&self, ch: ChannelId) -> u64 {
        let tag = pack_id(ch.idx, ch.gen);
        // Fast path: the run the channel entry points at (a closing connection must not scan
        // the whole heap). The entry may be stale if the offer failed half-built; then scan.
        let freed = self.release_run(ch, tag);
        if freed > 0 {
            return freed;
        }
        self.release_tagged(tag)
    }

    /// Frees every segment tagged `tag` (a scan of the heap's tags); returns how many.
    pub(crate) fn release_tagged(&self, tag: u64) -> u64 {
        let mut freed = 0;
        for s in 0..self.layout.nsegments {
            if self.tag(s) == tag {
                freed += self.free_run(s, 1, tag, FREE_RESERVED);
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
            if w.compare_exchange(tag, FREE_RESERVED, SeqCst, Relaxed)
                .is_err()
            {
                break;
            }
            freed += 1;
        }
        self.segments_gone(freed);
        // The next ring starts its search here: a connection that comes after one that went
        // gets its memory, still reserved and warm (else next fit would walk the whole heap
        // on fresh memory, reserving and zeroing pages while these wait to be given back).
        if let (true, Some(h)) = (freed > 0, self.header_hint(H_SEGMENT_HINT)) {
            h.store(first, Relaxed);
        }
        freed
    }

    /// Gives back the memory of segments free since the last trim ([`FREE_AGED`]), and ages
    /// those freed since ([`FREE_RESERVED`]): a segment's memory goes back one to two trims
    /// after it was freed, so connections that come and go keep reusing reserved memory.
    /// Returns the segments whose memory went back. `by` is the trimming member.
    pub fn trim_segments(&self, by: MemberId) -> u64 {
        let hold = TRIMMING | (member_tag(by) as u64) << 32;
        let (n, mut s, mut given) = (self.layout.nsegments, 0, 0);
        while s < n {
            match self.tag(s) {
                FREE_RESERVED => {
                    if let Ok(w) = self.tag_word(s) {
                        w.compare_exchange(FREE_RESERVED, FREE_AGED, SeqCst, Relaxed)
                            .ok();
                    }
                    s += 1;
                }
                FREE_AGED => {
                    let k = self.hold_aged(s, hold);
                    given += self.give_back(s, k, hold);
                    s += k.max(1);
                }
                _ => s += 1,
            }
        }
        if given > 0 {
            self.add_counter(crate::switch::COUNTER_SEGMENTS_GIVEN_BACK, given);
        }
        given
    }

    /// Takes the run of aged free segments from `first` for the trim; returns its length.
    fn hold_aged(&self, first: u64, hold: u64) -> u64 {
        let mut k = 0;
        while first + k < self.layout.nsegments {
            let Ok(w) = self.tag_word(first + k) else {
                break;
            };
            if w.compare_exchange(FREE_AGED, hold, SeqCst, Relaxed)
                .is_err()
            {
                break;
            }
            k += 1;
        }
        k
    }

    /// Punches the held run's hole, then frees it as unreserved.
    fn give_back(&self, first: u64, k: u64, hold: u64) -> u64 {
        if k == 0 {
            return 0;
        }
        let off = self.segment_offset(first);
        let len = self.segment_offset(first + k) - off;
        let punched = self.view.release(off, len).unwrap_or(false);
        let to = if punched { 0 } else { FREE_RESERVED };
        for s in first..first + k {
            if let Ok(w) = self.tag_word(s) {
                w.compare_exchange(hold, to, SeqCst, Relaxed).ok();
            }
        }
        if punched {
            k
        } else {
            0
        }
    }

    /// Whether every segment under `off..off + len` is tagged as channel `ch`'s (a ring view
    /// that reaches memory of another channel, or free memory, is a corrupt entry).
    pub(crate) fn range_owned_by(&self, ch: ChannelId, off: u64, len: u64) -> bool {
        self.range_tagged(pack_id(ch.idx, ch.gen), off, len)
    }

    /// Whether every segment under `off..off + len` carries `tag`.
    pub(crate) fn range_tagged(&self, tag: u64, off: u64, len: u64) -> bool {
        let seg = self.layout.params.segment_size;
        let (Some(rel), Some(end)) = (off.checked_sub(self.layout.heap_off), off.checked_add(len))
        else {
            return false;
        };
        if len == 0 || end > self.layout.heap_end() {
            return false;
        }
        let (first, last) = (rel / seg, (rel + len - 1) / seg);
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
            .filter(|&s| is_owned(self.tag(s)))
            .count() as u64
    }

    /// Frees segments whose owner tag names a FREE channel slot, an older generation of the
    /// slot, or no valid slot at all. Returns how many were freed.
    pub fn sweep_orphans(&self) -> u64 {
        let mut freed = 0;
        for s in 0..self.layout.nsegments {
            let t = self.tag(s);
            if is_free(t) || !self.is_orphan(t) {
                continue;
            }
            // A dead trimmer's hole may be half punched: "perhaps not reserved".
            let to = if is_trimming(t) { 0 } else { FREE_RESERVED };
            if let Ok(w) = self.tag_word(s) {
                if w.compare_exchange(t, to, SeqCst, Relaxed).is_ok() {
                    tracing::debug!(segment = s, tag = t, "freed orphan ring segment");
                    freed += is_owned(t) as u64;
                }
            }
        }
        self.segments_gone(freed);
        freed
    }

    /// The tag was read before the slot's state word (SeqCst), so an owner that claimed the slot
    /// and then the segment is seen RESERVED (or later) with the same generation.
    fn is_orphan(&self, tag: u64) -> bool {
        if is_trimming(tag) {
            return !self.tag_alive((tag >> 32) as u32);
        }
        let low = (tag as u32).wrapping_sub(1);
        if low & POOL_TAG_BIT != 0 {
            return !self.pool_owns(low & !POOL_TAG_BIT, (tag >> 32) as u32);
        }
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
    use super::{FREE_AGED, FREE_RESERVED};
    use crate::key::ChannelId;
    use crate::{MemberIdentity, RegionParams, Registry};
    use memloop_shm::ShmSlice;

    fn region() -> Registry {
        let p = RegionParams::small(1 << 20);
        Registry::init(ShmSlice::new_heap(p.size as usize), &p).unwrap()
    }

    #[test]
    fn freed_segments_keep_their_memory_until_two_trims_have_seen_them_free() {
        let r = region();
        let me = r
            .join(&MemberIdentity {
                pid: 1,
                start_time: 0,
                boot_id: [0; 16],
                pid_ns: 0,
                net_ns: 0,
                name: "t".into(),
            })
            .unwrap();
        let ch = ChannelId { idx: 3, gen: 0 };
        let first = r.alloc_segments(ch, 4).unwrap();
        assert_eq!(r.segments_used(), 4);
        assert_eq!(r.release_segments(ch), 4);
        assert!((first..first + 4).all(|s| r.tag(s) == FREE_RESERVED));
        r.trim_segments(me);
        assert!((first..first + 4).all(|s| r.tag(s) == FREE_AGED));
        // Reused while aged: still free.
        let again = ChannelId { idx: 4, gen: 0 };
        let s2 = r.find_run(first, 2, super::pack_id(4, 0)).unwrap().unwrap();
        assert_eq!(s2, first);
        r.free_run(s2, 2, super::pack_id(again.idx, again.gen), FREE_RESERVED);
        // Heap memory cannot be given back: the trim leaves it reserved, never half freed.
        assert_eq!(r.trim_segments(me), 0);
        assert!((first..first + 4).all(|s| matches!(r.tag(s), FREE_RESERVED | FREE_AGED)));
    }

    #[test]
    fn next_fit_wraps_around_and_fails_only_when_no_run_fits() {
        let r = region();
        let n = r.nsegments();
        let a = ChannelId { idx: 1, gen: 0 };
        let b = ChannelId { idx: 2, gen: 0 };
        let fa = r.alloc_segments(a, n - 2).unwrap();
        let fb = r.alloc_segments(b, 2).unwrap();
        assert_eq!((fa, fb), (0, n - 2));
        assert!(r.alloc_segments(ChannelId { idx: 5, gen: 0 }, 1).is_err());
        r.release_segments(a);
        // The hint is past the end: the search wraps to the front.
        assert_eq!(
            r.alloc_segments(ChannelId { idx: 6, gen: 0 }, 3).unwrap(),
            0
        );
        assert_eq!(r.segments_used(), 5);
    }
}
