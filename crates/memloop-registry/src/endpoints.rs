//! Endpoints: an open-addressing hash table (linear probing, tombstones) in the region.
//!
//! Lock-free insertion without duplicates: an inserter claims a free slot (CLAIMING), writes
//! owner, hash and key, publishes them (INSERTING) and only then scans the whole probe chain for
//! the same key. Because both publish before scanning (SeqCst), of two racing inserters at least
//! one sees the other; ties go to the lower slot index (the higher backs off at once, the lower
//! waits for the higher to resolve). Slots never return to EMPTY once used, so a chain is never
//! cut under a concurrent probe; removed and backed-out slots become tombstones that later
//! inserts reuse.
//!
//! Slot state word: `gen << 32 | owner_tag << 8 | state`; generation bumps at every removal.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state · 8 doorbell seq u32 · 12 listener-waiting u32 · 16 accept backlog |
//! | 24 | owner (packed member id) · 32 key hash · 40 key (72 B) |
//! | 112 | connecting u32: clients between their real `connect` and their offer (a hint) |

use crate::error::RegistryError;
use crate::header::ENDPOINT_BYTES;
use crate::key::{
    check_key, decode_key, encode_key, hash_key, pack_id, unpack_id, EndpointId, EndpointKey,
    MemberId, KEY_BYTES,
};
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use memloop_shm::ShmU32;

pub(crate) const E_EMPTY: u64 = 0;
pub(crate) const E_CLAIMING: u64 = 1;
pub(crate) const E_INSERTING: u64 = 2;
pub(crate) const E_LIVE: u64 = 3;
pub(crate) const E_TOMB: u64 = 4;

const O_SEQ: u64 = 8;
const O_WAITING: u64 = 12;
const O_BACKLOG: u64 = 16;
const O_OWNER: u64 = 24;
const O_HASH: u64 = 32;
const O_KEY: u64 = 40;
const O_CONNECTING: u64 = 112;
/// How long the lower-indexed of two racing inserters waits for the other to resolve.
const RESOLVE_SPINS: usize = 100_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub id: EndpointId,
    pub key: EndpointKey,
    pub owner: MemberId,
}

pub(crate) fn e_state(w: u64) -> u64 {
    w & 0xff
}
pub(crate) fn e_gen(w: u64) -> u32 {
    (w >> 32) as u32
}
pub(crate) fn e_owner_tag(w: u64) -> u32 {
    ((w >> 8) & 0xff_ffff) as u32
}
pub(crate) fn e_word(gen: u32, owner_tag: u32, state: u64) -> u64 {
    ((gen as u64) << 32) | ((owner_tag as u64 & 0xff_ffff) << 8) | state
}

/// A published entry's contents, read seqlock-style.
struct Entry {
    word: u64,
    owner: u64,
    hash: u64,
    key: [u8; KEY_BYTES],
}

impl Registry {
    pub(crate) fn endpoint_off(&self, idx: u32) -> u64 {
        self.layout.endpoints_off + idx as u64 * ENDPOINT_BYTES
    }

    fn ep_cap(&self) -> u32 {
        self.layout.params.max_endpoints
    }

    pub(crate) fn endpoint_word(&self, idx: u32) -> Result<u64, RegistryError> {
        if idx >= self.ep_cap() {
            return Err(RegistryError::NotFound);
        }
        Ok(self.w64(self.endpoint_off(idx))?.load(SeqCst))
    }

    /// Reads the published fields of slot `idx`; `None` if the slot changed meanwhile.
    fn read_entry(&self, idx: u32, word: u64) -> Result<Option<Entry>, RegistryError> {
        let base = self.endpoint_off(idx);
        let owner = self.ld(base + O_OWNER)?;
        let hash = self.ld(base + O_HASH)?;
        let key = self.bytes(base + O_KEY)?;
        fence(Acquire);
        Ok((self.endpoint_word(idx)? == word).then_some(Entry {
            word,
            owner,
            hash,
            key,
        }))
    }

    /// The slot positions of the probe chain for `hash`.
    fn probe(&self, hash: u64) -> impl Iterator<Item = u32> {
        let cap = self.ep_cap();
        let start = (hash % cap as u64) as u32;
        (0..cap).map(move |i| ((start as u64 + i as u64) % cap as u64) as u32)
    }

    fn find(
        &self,
        enc: &[u8; KEY_BYTES],
        hash: u64,
    ) -> Result<Option<(u32, Entry)>, RegistryError> {
        for idx in self.probe(hash) {
            let w = self.endpoint_word(idx)?;
            match e_state(w) {
                E_EMPTY => return Ok(None),
                E_LIVE => {}
                _ => continue,
            }
            if let Some(e) = self.read_entry(idx, w)? {
                if e.hash == hash && &e.key == enc {
                    return Ok(Some((idx, e)));
                }
            }
        }
        Ok(None)
    }

    /// Publishes `key` as owned by `owner`; `AddrInUse` if it is already registered.
    pub fn add_endpoint(
        &self,
        owner: MemberId,
        key: &EndpointKey,
    ) -> Result<EndpointId, RegistryError> {
        check_key(key)?;
        self.live_member(owner)?;
        let enc = encode_key(key);
        let hash = hash_key(&enc);
        if self.find(&enc, hash)?.is_some() {
            return Err(RegistryError::AddrInUse);
        }
        let (idx, gen) = self.claim_endpoint_slot(owner, hash)?;
        let base = self.endpoint_off(idx);
        self.st(base + O_OWNER, pack_id(owner.idx, owner.gen))?;
        self.st(base + O_HASH, hash)?;
        self.view.u32_at(base + O_CONNECTING)?.store(0, Relaxed);
        self.st(base + O_BACKLOG, 0)?;
        self.view.u32_at(base + O_WAITING)?.store(0, Relaxed);
        self.view.write(base + O_KEY, &enc)?;
        let tag = Self::tag_of(owner);
        let slot = self.w64(base)?;
        let inserting = e_word(gen, tag, E_INSERTING);
        if slot
            .compare_exchange(e_word(gen, tag, E_CLAIMING), inserting, SeqCst, Relaxed)
            .is_err()
        {
            return Err(RegistryError::Stale); // reclaimed under us: our member was declared dead
        }
        let conflict = self.has_rival(idx, &enc, hash);
        let next = if conflict {
            e_word(gen.wrapping_add(1), 0, E_TOMB)
        } else {
            e_word(gen, tag, E_LIVE)
        };
        if slot
            .compare_exchange(inserting, next, SeqCst, Relaxed)
            .is_err()
        {
            return Err(RegistryError::Stale);
        }
        if conflict {
            return Err(RegistryError::AddrInUse);
        }
        tracing::debug!(idx, gen, ?key, "endpoint added");
        Ok(EndpointId { idx, gen })
    }

    fn claim_endpoint_slot(&self, owner: MemberId, hash: u64) -> Result<(u32, u32), RegistryError> {
        let tag = Self::tag_of(owner);
        for idx in self.probe(hash) {
            let w = self.endpoint_word(idx)?;
            if !matches!(e_state(w), E_EMPTY | E_TOMB) {
                continue;
            }
            let claim = e_word(e_gen(w), tag, E_CLAIMING);
            if self
                .w64(self.endpoint_off(idx))?
                .compare_exchange(w, claim, SeqCst, Relaxed)
                .is_ok()
            {
                return Ok((idx, e_gen(w)));
            }
        }
        Err(RegistryError::RegionFull { what: "endpoints" })
    }

    /// Scans the probe chain for another published entry with the same key. Errors reading the
    /// region count as a rival (backing off is always safe).
    fn has_rival(&self, me: u32, enc: &[u8; KEY_BYTES], hash: u64) -> bool {
        for idx in self.probe(hash) {
            if idx == me {
                continue;
            }
            match self.rival_at(idx, me, enc, hash) {
                Ok(Some(true)) | Err(_) => return true,
                Ok(Some(false)) => {}
                Ok(None) => return false, // end of the chain
            }
        }
        false
    }

    /// `Some(true)` if slot `idx` holds (or will hold) the same key, `None` at an EMPTY slot.
    fn rival_at(
        &self,
        idx: u32,
        me: u32,
        enc: &[u8; KEY_BYTES],
        hash: u64,
    ) -> Result<Option<bool>, RegistryError> {
        for _ in 0..RESOLVE_SPINS {
            let w = self.endpoint_word(idx)?;
            let st = e_state(w);
            if st == E_EMPTY {
                return Ok(None);
            }
            if !matches!(st, E_INSERTING | E_LIVE) {
                return Ok(Some(false));
            }
            let Some(e) = self.read_entry(idx, w)? else {
                continue;
            };
            if e.hash != hash || &e.key != enc {
                return Ok(Some(false));
            }
            if st == E_LIVE || idx < me {
                return Ok(Some(true));
            }
            memloop_shm::sync::spin_hint(); // a higher-indexed rival: wait for it to resolve
        }
        Ok(Some(true))
    }

    /// Checks that `id` still names a LIVE endpoint and returns its slot offset.
    pub(crate) fn live_endpoint(&self, id: EndpointId) -> Result<u64, RegistryError> {
        let w = self.endpoint_word(id.idx)?;
        if e_gen(w) != id.gen {
            return Err(RegistryError::Stale);
        }
        match e_state(w) {
            E_LIVE => Ok(self.endpoint_off(id.idx)),
            _ => Err(RegistryError::NotFound),
        }
    }

    /// The LIVE endpoint registered under `key`, if any.
    pub fn lookup(&self, key: &EndpointKey) -> Option<EndpointInfo> {
        check_key(key).ok()?;
        let enc = encode_key(key);
        let (idx, e) = self.find(&enc, hash_key(&enc)).ok()??;
        self.entry_info(idx, &e).ok()
    }

    fn entry_info(&self, idx: u32, e: &Entry) -> Result<EndpointInfo, RegistryError> {
        let (midx, mgen) = unpack_id(e.owner, self.layout.params.max_members).ok_or_else(|| {
            RegistryError::corrupt("endpoint owner", format!("slot {idx}: {:#x}", e.owner))
        })?;
        if hash_key(&e.key) != e.hash {
            return Err(RegistryError::corrupt(
                "endpoint hash",
                format!("slot {idx}"),
            ));
        }
        let key = decode_key(&e.key)?;
        Ok(EndpointInfo {
            id: EndpointId {
                idx,
                gen: e_gen(e.word),
            },
            key,
            owner: MemberId {
                idx: midx,
                gen: mgen,
            },
        })
    }

    /// Removes a LIVE endpoint (tombstone, generation + 1), declines its pending offers and
    /// rings its doorbell so a sleeping acceptor notices.
    pub fn remove_endpoint(&self, id: EndpointId) -> Result<(), RegistryError> {
        let off = self.live_endpoint(id)?;
        let w = self.endpoint_word(id.idx)?;
        if e_gen(w) != id.gen || e_state(w) != E_LIVE {
            return Err(RegistryError::Stale);
        }
        let tomb = e_word(id.gen.wrapping_add(1), 0, E_TOMB);
        self.w64(off)?
            .compare_exchange(w, tomb, SeqCst, Relaxed)
            .map_err(|_| RegistryError::Stale)?;
        self.view.u32_at(off + O_SEQ)?.fetch_add(1, Release);
        self.decline_offers_to(id);
        tracing::debug!(?id, "endpoint removed");
        Ok(())
    }

    /// Every LIVE endpoint (entries failing validation are skipped and logged).
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        let mut out = Vec::new();
        for idx in 0..self.ep_cap() {
            let Ok(w) = self.endpoint_word(idx) else {
                continue;
            };
            if e_state(w) != E_LIVE {
                continue;
            }
            match self
                .read_entry(idx, w)
                .and_then(|e| e.map(|e| self.entry_info(idx, &e)).transpose())
            {
                Ok(Some(info)) => out.push(info),
                Ok(None) => {}
                Err(e) => tracing::warn!(idx, error = %e, "skipping endpoint entry"),
            }
        }
        out
    }

    /// The doorbell of a LIVE endpoint: (sequence word bumped by every offer, "listener waiting"
    /// flag). A listener sets the flag, re-checks for offers and sleeps on the sequence word; a
    /// client that sees the flag after `offer` wakes it (futex where a kernel is shared).
    pub fn endpoint_doorbell(&self, id: EndpointId) -> Result<(ShmU32, ShmU32), RegistryError> {
        let off = self.live_endpoint(id)?;
        Ok((
            self.view.u32_at(off + O_SEQ)?,
            self.view.u32_at(off + O_WAITING)?,
        ))
    }

    /// Clients of a LIVE endpoint that are between their real `connect` and their offer. A
    /// transparent server that finds no offer for a new connection waits longer while this is
    /// non-zero, because an offer is on its way. Only a hint: a client that dies in between
    /// leaves it high, which costs servers a bounded wait, never a wrong decision.
    pub fn endpoint_connecting(&self, id: EndpointId) -> Result<ShmU32, RegistryError> {
        let off = self.live_endpoint(id)?;
        Ok(self.view.u32_at(off + O_CONNECTING)?)
    }

    /// Offers currently waiting for the endpoint (a hint: maintained by offer/accept/cancel).
    pub fn backlog(&self, id: EndpointId) -> Result<u64, RegistryError> {
        let off = self.live_endpoint(id)?;
        self.ld(off + O_BACKLOG)
    }

    /// Adjusts the backlog of the endpoint packed in `ep` if it is still that incarnation.
    pub(crate) fn backlog_add(&self, ep: u64, up: bool) {
        let Some((idx, gen)) = unpack_id(ep, self.ep_cap()) else {
            return;
        };
        let Ok(off) = self.live_endpoint(EndpointId { idx, gen }) else {
            return;
        };
        if let Ok(w) = self.w64(off + O_BACKLOG) {
            let _ = w.fetch_update(SeqCst, Relaxed, |v| {
                Some(if up {
                    v.saturating_add(1)
                } else {
                    v.saturating_sub(1)
                })
            });
        }
    }

    /// Bumps the doorbell sequence of the endpoint packed in `ep`.
    pub(crate) fn ring_doorbell(&self, ep: EndpointId) -> Result<(), RegistryError> {
        let off = self.live_endpoint(ep)?;
        self.view.u32_at(off + O_SEQ)?.fetch_add(1, Release);
        Ok(())
    }

    pub(crate) fn count_endpoints(&self) -> u32 {
        (0..self.ep_cap())
            .filter(|&i| {
                self.endpoint_word(i)
                    .map(|w| e_state(w) == E_LIVE)
                    .unwrap_or(false)
            })
            .count() as u32
    }

    /// Tombstones every entry owned by the member with `tag` (LIVE, or half-inserted).
    pub(crate) fn remove_endpoints_of(&self, tag: u32) -> u32 {
        let mut n = 0;
        for idx in 0..self.ep_cap() {
            let Ok(w) = self.endpoint_word(idx) else {
                continue;
            };
            let st = e_state(w);
            if e_owner_tag(w) != tag || !matches!(st, E_CLAIMING | E_INSERTING | E_LIVE) {
                continue;
            }
            let id = EndpointId { idx, gen: e_gen(w) };
            if st == E_LIVE {
                n += self.remove_endpoint(id).is_ok() as u32;
            } else if let Ok(slot) = self.w64(self.endpoint_off(idx)) {
                let _ = slot.compare_exchange(
                    w,
                    e_word(id.gen.wrapping_add(1), 0, E_TOMB),
                    SeqCst,
                    Relaxed,
                );
            }
        }
        n
    }
}
