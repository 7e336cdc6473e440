//! Buffer pools of zero-copy channels: a member's fixed-size buffers in the ring heap, which
//! other members read in place (through a read-only mapping of their own).
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state word: generation, owner tag, phase (FREE, RESERVED, LIVE, CLOSING) |
//! | 8 | owner (packed member id) |
//! | 16, 20 | buffer size, buffer count (u32) |
//! | 24 | data offset (region; segment-aligned, so page-aligned for a mapping of its own) |
//! | 32, 40 | first segment, segments |
//! | 48, 52 | return bell: a sequence word and a waiting flag ([`memloop_ring::WaitCell`]) |
//! | 56 | forwards: bumped by every send of a descriptor that is not a fresh loan |
//! | 64, 72 | loans and scans so far (statistics) |
//!
//! **Which buffers are free.** Nothing counts references. A buffer is referenced while a
//! descriptor naming it sits in a descriptor ring of a live channel, unread or read and not
//! yet released (`memloop_ring::held`), or while its owner has it on loan. So the owner finds
//! free buffers by a scan of the descriptor rings ([`Registry::pool_references`]), and a dead
//! member's references vanish with its channels: there is nothing to undo after a crash.
//!
//! A scan is not atomic, and a holder may forward a buffer meanwhile: publish a new reference
//! in ring B, then release its own in ring A. A scan that read B before the publication and A
//! after the release would miss both. So a forward bumps the pool's forwards word between the
//! two steps (release/acquire: the release of A comes after the bump), and a scan that sees
//! the word move retries: a scan that read A's release has also read the bump
//! (`memloop_ring::note_forward` and `memloop_ring::scan_stable`, loom-checked). Fresh loans
//! need no bump: only their owner scans for them, and it knows its own loans.
//!
//! **Lifetime.** The owner creates a pool LIVE; closing it (or the owner's death) makes it
//! CLOSING: holders keep reading, and whoever then finds no reference left frees the slot and
//! its segments (the owner on close, a holder on release, the heartbeat's sweep).

use crate::error::RegistryError;
use crate::key::{member_tag, pack_id, unpack_id, ChannelId, MemberId};
use crate::state_word::{bad_state, StateWord};
use crate::tables::channels::{c_phase, is_marker, C_ACCEPTED, C_OFFERED};
use crate::tables::slot_view;
use crate::{ChannelKind, Registry};
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};
use memloop_shm::{ShmU32, ShmU64};

const P_FREE: u8 = 0;
const P_RESERVED: u8 = 1;
const P_LIVE: u8 = 2;
const P_CLOSING: u8 = 3;

const F_OWNER: u64 = 8;
const F_GEOMETRY: u64 = 16;
const F_DATA: u64 = 24;
const F_FIRST: u64 = 32;
const F_NSEG: u64 = 40;
const F_BELL_SEQ: u64 = 48;
const F_BELL_WAIT: u64 = 52;
const F_FORWARDS: u64 = 56;
const F_LOANS: u64 = 64;
const F_SCANS: u64 = 72;

/// Buffers are cache-line multiples, so neighbours never share a line.
pub const POOL_ALIGN: u32 = 64;
/// Largest buffer (a descriptor's length is a `u32`).
pub const MAX_POOL_BUFFER: u32 = 1 << 30;
/// Most buffers in one pool (a scan keeps a flag per buffer).
pub const MAX_POOL_BUFFERS: u32 = 1 << 20;
/// Scans that see a forward under way are retried this often before giving up (then every
/// buffer counts as referenced this time).
const SCAN_TRIES: u32 = 8;

/// Segment tags of pools: the low word has this bit beside the slot index (channel slots stay
/// far below it, and the free states far above).
pub(crate) const POOL_TAG_BIT: u32 = 1 << 30;

/// A pool slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolId {
    pub idx: u32,
    pub gen: u32,
}

impl PoolId {
    /// The pool as a descriptor names it: slot index + 1 (0 names nothing).
    pub fn wire(self) -> u32 {
        self.idx + 1
    }

    /// The pool a descriptor names (`wire`, `gen`), if any.
    pub fn from_wire(wire: u32, gen: u32) -> Option<PoolId> {
        Some(PoolId {
            idx: wire.checked_sub(1)?,
            gen,
        })
    }

    pub(crate) fn segment_tag(self) -> u64 {
        pack_id(self.idx | POOL_TAG_BIT, self.gen)
    }
}

/// A pool owner's memory between scans: the descriptor channels its last full look found,
/// valid while no descriptor channel was offered since (the region's epoch of them). A
/// channel offered later moves the epoch before it can hold a descriptor, so a scan with an
/// unchanged epoch has every channel that may; freed or refused ones it skips by their state
/// word. (One scan misses nothing either way: what appears during it is a forward, which the
/// forwards word catches, or the owner's own loan, which it knows.)
#[derive(Default)]
pub struct ScanCache {
    epoch: Option<u64>,
    chans: Vec<CachedChannel>,
}

struct CachedChannel {
    id: ChannelId,
    c2s: memloop_shm::ShmSlice,
    s2c: memloop_shm::ShmSlice,
}

/// A validated pool entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    pub id: PoolId,
    pub owner: MemberId,
    /// The owner's tag, as descriptors carry it.
    pub owner_tag: u32,
    pub buf_size: u32,
    pub buffers: u32,
    /// Region offset of buffer 0 (page-aligned).
    pub data_off: u64,
    /// Bytes of buffers (`buf_size * buffers`).
    pub data_len: u64,
    /// The owner closed it or died: no new loans; freed once nothing references it.
    pub closing: bool,
    pub loans: u64,
    pub scans: u64,
}

impl PoolInfo {
    /// The buffer holding `offset..offset+len` of the pool's data, if that range is non-empty
    /// and lies inside one buffer (a descriptor's range, checked on receipt).
    pub fn buffer_of(&self, offset: u64, len: u32) -> Option<u32> {
        let end = offset.checked_add(len as u64)?;
        let buf = offset / self.buf_size as u64;
        let inside = len > 0 && end <= self.data_len && (end - 1) / self.buf_size as u64 == buf;
        inside.then_some(buf as u32)
    }
}

slot_view!(
    /// Typed view of one pool slot.
    PoolSlot,
    pools
);

impl PoolSlot<'_> {
    fn ld(&self, off: u64) -> Result<u64, RegistryError> {
        self.0.ld(off)
    }
    fn st(&self, off: u64, v: u64) -> Result<(), RegistryError> {
        self.0.st(off, v)
    }
    fn u32(&self, off: u64) -> Result<ShmU32, RegistryError> {
        self.0.u32(off)
    }
    fn u64(&self, off: u64) -> Result<ShmU64, RegistryError> {
        self.0.u64(off)
    }
}

impl Registry {
    fn pool_slot(&self, idx: u32) -> Result<PoolSlot<'_>, RegistryError> {
        PoolSlot::new_checked(self, idx)
    }

    /// Creates a pool of `buffers` buffers of `buf_size` bytes (rounded up to
    /// [`POOL_ALIGN`]) owned by `owner`, its memory reserved. `RegionFull` if no slot or no
    /// run of segments is free.
    pub fn create_pool(
        &self,
        owner: MemberId,
        buf_size: u32,
        buffers: u32,
    ) -> Result<PoolInfo, RegistryError> {
        let size = buf_size.checked_next_multiple_of(POOL_ALIGN).unwrap_or(0);
        if size == 0 || size > MAX_POOL_BUFFER || buffers == 0 || buffers > MAX_POOL_BUFFERS {
            return Err(RegistryError::InvalidParams(format!(
                "a pool of {buffers} buffers of {buf_size} bytes (1..={MAX_POOL_BUFFERS} \
                 buffers of 1..={MAX_POOL_BUFFER} bytes)"
            )));
        }
        self.live_member(owner)?;
        let (idx, reserved) = self.reserve_pool(owner)?;
        let slot = self.pool_slot(idx)?;
        let id = PoolId {
            idx,
            gen: reserved.gen(),
        };
        let len = size as u64 * buffers as u64;
        match self.build_pool(&slot, id, owner, size, buffers, len) {
            Ok(()) if slot.cas(reserved, reserved.with_low(P_LIVE))? => self.pool(id),
            other => {
                self.release_tagged(id.segment_tag());
                slot.cas(reserved, reserved.next_gen(P_FREE))?;
                other.and(Err(RegistryError::Stale))
            }
        }
    }

    fn reserve_pool(&self, owner: MemberId) -> Result<(u32, StateWord), RegistryError> {
        for idx in 0..self.layout.params.max_pools {
            let slot = self.pool_slot(idx)?;
            let w = slot.word()?;
            if w.low() != P_FREE {
                continue;
            }
            let reserved = StateWord::new(w.gen(), member_tag(owner), P_RESERVED);
            if slot.cas(w, reserved)? {
                return Ok((idx, reserved));
            }
        }
        Err(self.full("buffer pools"))
    }

    fn build_pool(
        &self,
        slot: &PoolSlot<'_>,
        id: PoolId,
        owner: MemberId,
        size: u32,
        buffers: u32,
        len: u64,
    ) -> Result<(), RegistryError> {
        let k = self.segments_for(len);
        let first = self.alloc_tagged(id.segment_tag(), k)?;
        let data = self.segment_offset(first);
        // Reserved now, all of it: receivers read it through mappings of their own, where an
        // unbacked page on a full file system would be a SIGBUS.
        self.view
            .commit(data, len)
            .map_err(crate::header::no_room)?;
        for (off, v) in [
            (F_OWNER, pack_id(owner.idx, owner.gen)),
            (F_GEOMETRY, size as u64 | (buffers as u64) << 32),
            (F_DATA, data),
            (F_FIRST, first),
            (F_NSEG, k),
            (F_FORWARDS, 0),
            (F_LOANS, 0),
            (F_SCANS, 0),
        ] {
            slot.st(off, v)?;
        }
        slot.u64(F_BELL_SEQ)?.store(0, Relaxed);
        Ok(())
    }

    /// The pool `id`, validated: LIVE or CLOSING with that generation, its geometry sane and
    /// its data in segments tagged as its own. `Stale` for a pool since freed.
    pub fn pool(&self, id: PoolId) -> Result<PoolInfo, RegistryError> {
        let slot = self.pool_slot(id.idx)?;
        let w = slot.word()?;
        let closing = match w.low() {
            P_LIVE => false,
            P_CLOSING => true,
            P_FREE | P_RESERVED => return Err(RegistryError::Stale),
            _ => return Err(bad_state("pools", id.idx, w)),
        };
        if w.gen() != id.gen {
            return Err(RegistryError::Stale);
        }
        let geometry = slot.ld(F_GEOMETRY)?;
        let (size, buffers) = (geometry as u32, (geometry >> 32) as u32);
        let (data, first, nseg) = (slot.ld(F_DATA)?, slot.ld(F_FIRST)?, slot.ld(F_NSEG)?);
        let owner = unpack_id(slot.ld(F_OWNER)?, self.layout.params.max_members);
        let len = size as u64 * buffers as u64;
        let sane = size % POOL_ALIGN == 0
            && (1..=MAX_POOL_BUFFER).contains(&size)
            && (1..=MAX_POOL_BUFFERS).contains(&buffers)
            && first < self.layout.nsegments
            && data == self.segment_offset(first)
            && nseg == self.segments_for(len)
            && self.range_tagged(id.segment_tag(), data, len);
        let (Some((oi, og)), true) = (owner, sane) else {
            let detail = format!("pool {}: {size} x {buffers} at {data:#x}", id.idx);
            return Err(RegistryError::corrupt("pool entry", detail));
        };
        let owner = MemberId { idx: oi, gen: og };
        if slot.word()? != w {
            return Err(RegistryError::Stale);
        }
        Ok(PoolInfo {
            id,
            owner,
            owner_tag: member_tag(owner),
            buf_size: size,
            buffers,
            data_off: data,
            data_len: len,
            closing,
            loans: slot.ld(F_LOANS)?,
            scans: slot.ld(F_SCANS)?,
        })
    }

    /// Whether pool `id` is CLOSING: one load of its state word (a holder's release asks,
    /// to free the pool with its last reference).
    pub fn pool_closing(&self, id: PoolId) -> bool {
        self.pool_slot(id.idx)
            .and_then(|s| s.word())
            .is_ok_and(|w| w.gen() == id.gen && w.low() == P_CLOSING)
    }

    /// Every LIVE or CLOSING pool (`memloop status`).
    pub fn pools(&self) -> Vec<PoolInfo> {
        (0..self.layout.params.max_pools)
            .filter_map(|idx| {
                let w = self.pool_slot(idx).ok()?.word().ok()?;
                self.pool(PoolId { idx, gen: w.gen() }).ok()
            })
            .collect()
    }

    /// The pool's return bell: (waiting flag, sequence), for a [`memloop_ring::WaitCell`]
    /// its owner sleeps on while no buffer is free, rung by holders as they release.
    pub fn pool_bell(&self, id: PoolId) -> Result<(ShmU32, ShmU32), RegistryError> {
        let slot = self.pool_slot(id.idx)?;
        Ok((slot.u32(F_BELL_WAIT)?, slot.u32(F_BELL_SEQ)?))
    }

    /// Notes a send of a descriptor of pool `id` that is not a fresh loan, between its
    /// publication and the sender's release of what it forwarded (see the module text).
    pub fn note_forward(&self, id: PoolId) -> Result<(), RegistryError> {
        let forwards = self.pool_slot(id.idx)?.u64(F_FORWARDS)?;
        memloop_ring::note_forward(&forwards);
        Ok(())
    }

    /// Counts `n` loans (statistics).
    pub fn note_loans(&self, id: PoolId, n: u64) {
        if let Ok(w) = self.pool_slot(id.idx).and_then(|s| s.u64(F_LOANS)) {
            w.fetch_add(n, Relaxed);
        }
    }

    /// Which buffers of `pool` a descriptor ring of a live channel holds now: a flag per
    /// buffer. `Err` (then count every buffer as referenced) when a ring could not be read or
    /// forwards kept moving under the scan.
    pub fn pool_references(&self, pool: &PoolInfo) -> Result<Vec<bool>, RegistryError> {
        self.pool_references_cached(pool, &mut ScanCache::default())
    }

    /// [`Registry::pool_references`] keeping the descriptor channels it found in `cache`
    /// for the next scan, which then reads one state word and the two ring windows per
    /// channel — unless a descriptor channel was offered since (the epoch moved): then it
    /// looks for them all again.
    pub fn pool_references_cached(
        &self,
        pool: &PoolInfo,
        cache: &mut ScanCache,
    ) -> Result<Vec<bool>, RegistryError> {
        let slot = self.pool_slot(pool.id.idx)?;
        slot.u64(F_SCANS)?.fetch_add(1, Relaxed);
        let forwards = slot.u64(F_FORWARDS)?;
        let stable = memloop_ring::scan_stable(&forwards, SCAN_TRIES, || {
            let mut refs = vec![false; pool.buffers as usize];
            self.scan_descriptor_rings(cache, |d| {
                let named = PoolId::from_wire(d.pool, d.pool_gen) == Some(pool.id);
                if let Some(b) = named.then(|| pool.buffer_of(d.offset, d.len)).flatten() {
                    refs[b as usize] = true;
                }
            })?;
            Ok::<_, RegistryError>(refs)
        })?;
        stable.ok_or_else(|| {
            RegistryError::corrupt("pool scan", "forwards kept moving under every try")
        })
    }

    /// Calls `f` with every descriptor held by a descriptor ring of an OFFERED or ACCEPTED
    /// channel whose reader is still there (a refused offer's rings, and those of a reader
    /// that closed or died, are never read again).
    fn scan_descriptor_rings(
        &self,
        cache: &mut ScanCache,
        mut f: impl FnMut(&memloop_ring::Descriptor),
    ) -> Result<(), RegistryError> {
        let epoch = self.desc_epoch();
        if cache.epoch != Some(epoch) {
            cache.chans = self.descriptor_channels()?;
            cache.epoch = Some(epoch);
        }
        for c in &cache.chans {
            let w = self.channel_word(c.id.idx)?;
            let live = !is_marker(w) && matches!(c_phase(w), C_OFFERED | C_ACCEPTED);
            if w.gen() != c.id.gen || !live {
                continue; // freed (with its references), or refused
            }
            // A reader that closed its side holds nothing (its messages keep the side open
            // while they live), nor does a dead one: such a ring's slots are never read.
            let gone = |side| crate::tables::channels::side_gone(w, side);
            if !gone(crate::Side::Server) {
                memloop_ring::scan_held(&c.c2s, &mut f)?;
            }
            if !gone(crate::Side::Client) {
                memloop_ring::scan_held(&c.s2c, &mut f)?;
            }
        }
        Ok(())
    }

    /// Every OFFERED or ACCEPTED descriptor channel now, with views of its rings.
    fn descriptor_channels(&self) -> Result<Vec<CachedChannel>, RegistryError> {
        let mut out = Vec::new();
        for idx in self.slots_of_kind(ChannelKind::DescriptorPair) {
            let w = self.channel_word(idx)?;
            if is_marker(w) || !matches!(c_phase(w), C_OFFERED | C_ACCEPTED) {
                continue;
            }
            let kind = self.channel_slot(idx)?.kind_code()?;
            if kind != ChannelKind::DescriptorPair.code() as u32 {
                continue;
            }
            let id = ChannelId { idx, gen: w.gen() };
            match self.rings_of(id, ChannelKind::DescriptorPair) {
                Ok(r) => out.push(CachedChannel {
                    id,
                    c2s: r.c2s,
                    s2c: r.s2c,
                }),
                Err(RegistryError::Stale) => {} // freed meanwhile: nothing held
                Err(e) if self.channel_word(idx)?.gen() != id.gen => {
                    tracing::trace!("channel {idx} moved on under the scan: {e}");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Descriptor channels offered so far (see [`ScanCache`]).
    fn desc_epoch(&self) -> u64 {
        self.header_hint(crate::header::H_DESC_EPOCH)
            .map_or(0, |w| w.load(SeqCst))
    }

    /// A descriptor channel was offered (after it is OFFERED, before anyone can put a
    /// descriptor in it): cached scans look for descriptor channels again.
    pub(crate) fn desc_channel_offered(&self) {
        if let Some(w) = self.header_hint(crate::header::H_DESC_EPOCH) {
            w.fetch_add(1, SeqCst);
        }
    }

    /// LIVE → CLOSING: no new loans; the pool goes once nothing references it. By its owner,
    /// or by whoever reclaims the owner.
    pub fn close_pool(&self, id: PoolId) -> Result<(), RegistryError> {
        let slot = self.pool_slot(id.idx)?;
        loop {
            let w = slot.word()?;
            if w.gen() != id.gen || w.low() == P_FREE {
                return Err(RegistryError::Stale);
            }
            if w.low() != P_LIVE || slot.cas(w, w.with_low(P_CLOSING))? {
                return Ok(());
            }
        }
    }

    /// Frees a CLOSING pool that nothing references any more; `Ok(true)` if it went now.
    pub fn collect_pool(&self, id: PoolId) -> Result<bool, RegistryError> {
        let info = self.pool(id)?;
        if !info.closing {
            return Ok(false);
        }
        let refs = self.pool_references(&info)?;
        if refs.iter().any(|&r| r) {
            return Ok(false);
        }
        self.free_pool_slot(id, P_CLOSING)
    }

    /// `phase` → FREE (generation + 1), then the pool's segments back to the heap.
    fn free_pool_slot(&self, id: PoolId, phase: u8) -> Result<bool, RegistryError> {
        let slot = self.pool_slot(id.idx)?;
        let w = slot.word()?;
        if w.gen() != id.gen || w.low() != phase || !slot.cas(w, w.next_gen(P_FREE))? {
            return Ok(false);
        }
        let freed = self.release_tagged(id.segment_tag());
        tracing::debug!(pool = id.idx, segments = freed, "pool freed");
        Ok(true)
    }

    /// Pools of the dead member `tag` (by its member tag in the state word): LIVE ones close,
    /// half-built ones go at once. Returns how many.
    pub(crate) fn reclaim_pools_of(&self, tag: u32) -> u32 {
        let mut n = 0;
        for idx in 0..self.layout.params.max_pools {
            let Ok(w) = self.pool_slot(idx).and_then(|s| s.word()) else {
                continue;
            };
            if w.tag() != tag {
                continue;
            }
            let id = PoolId { idx, gen: w.gen() };
            n += match w.low() {
                P_LIVE => self.close_pool(id).is_ok() as u32,
                P_RESERVED => self.free_pool_slot(id, P_RESERVED).unwrap_or(false) as u32,
                _ => 0,
            };
        }
        n
    }

    /// Pools whose owner is gone (closed, or reclaimed by a sweep that missed them) and that
    /// nothing references any more: freed. Returns how many.
    pub(crate) fn sweep_pools(&self) -> u32 {
        let mut freed = 0;
        for idx in 0..self.layout.params.max_pools {
            let Ok(w) = self.pool_slot(idx).and_then(|s| s.word()) else {
                continue;
            };
            let id = PoolId { idx, gen: w.gen() };
            let owner_gone = !self.tag_alive(w.tag());
            match w.low() {
                P_LIVE if owner_gone => {
                    self.close_pool(id).ok();
                }
                P_RESERVED if owner_gone => {
                    freed += self.free_pool_slot(id, P_RESERVED).unwrap_or(false) as u32;
                    continue;
                }
                P_CLOSING => {}
                _ => continue,
            }
            freed += self.collect_pool(id).unwrap_or(false) as u32;
        }
        freed
    }

    pub(crate) fn count_pools(&self) -> u32 {
        (0..self.layout.params.max_pools)
            .filter(|&idx| {
                self.pool_slot(idx)
                    .and_then(|s| s.word())
                    .is_ok_and(|w| w.low() != P_FREE)
            })
            .count() as u32
    }

    /// Whether a segment tagged for pool slot `idx` of generation `gen` still belongs to it.
    pub(crate) fn pool_owns(&self, idx: u32, gen: u32) -> bool {
        self.pool_slot(idx)
            .and_then(|s| s.word())
            .is_ok_and(|w| w.gen() == gen && w.low() != P_FREE)
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
