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
//! Slot state word ([`StateWord`]): generation, the owner's tag, state; the generation bumps at
//! every removal.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state · 8 doorbell seq u32 · 12 listener-waiting u32 · 16 accept backlog |
//! | 24 | owner (packed member id) · 32 key hash · 40 key (72 B) |
//! | 112 | connecting u32: clients between their real `connect` and their offer (a hint) |
//! | 116 | dropped u32: datagrams senders dropped because this (UDP) socket's ring was full |
//! | 120 | returned u32: bumped when a receiver hands this (UDP) socket's unread datagrams back |
//! | 124 | receive buffer u32: the (UDP) socket's `SO_RCVBUF` in bytes, as the kernel reports it (0: unknown) |

use crate::error::RegistryError;
use crate::key::{
    check_key, decode_key, encode_key, hash_key, pack_id, unpack_id, EndpointId, EndpointKey,
    MemberId, KEY_BYTES,
};
use crate::state_word::StateWord;
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use memloop_shm::{ShmU32, ShmU64};

pub(crate) const E_EMPTY: u8 = 0;
pub(crate) const E_CLAIMING: u8 = 1;
pub(crate) const E_INSERTING: u8 = 2;
pub(crate) const E_LIVE: u8 = 3;
pub(crate) const E_TOMB: u8 = 4;

const O_SEQ: u64 = 8;
const O_WAITING: u64 = 12;
const O_BACKLOG: u64 = 16;
const O_OWNER: u64 = 24;
const O_HASH: u64 = 32;
const O_KEY: u64 = 40;
const O_CONNECTING: u64 = 112;
const O_DROPPED: u64 = 116;
const O_RETURNED: u64 = 120;
const O_RCVBUF: u64 = 124;
/// How long the lower-indexed of two racing inserters waits for the other to resolve.
const RESOLVE_SPINS: usize = 100_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub id: EndpointId,
    pub key: EndpointKey,
    pub owner: MemberId,
}

crate::tables::slot_view!(
    /// Typed view of one endpoint slot; the only code that knows the slot's field offsets.
    EndpointSlot,
    endpoints
);

impl<'a> EndpointSlot<'a> {
    /// Writes a new entry's fields; the slot must be CLAIMING by the caller.
    fn write(&self, owner: u64, hash: u64, key: &[u8; KEY_BYTES]) -> Result<(), RegistryError> {
        self.0.st(O_OWNER, owner)?;
        self.0.st(O_HASH, hash)?;
        self.connecting()?.store(0, Relaxed);
        self.dropped()?.store(0, Relaxed);
        self.returned()?.store(0, Relaxed);
        self.rcvbuf()?.store(0, Relaxed);
        self.0.st(O_BACKLOG, 0)?;
        self.waiting()?.store(0, Relaxed);
        self.0.write(O_KEY, key)
    }
    fn owner(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_OWNER)
    }
    fn hash(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_HASH)
    }
    fn key(&self) -> Result<[u8; KEY_BYTES], RegistryError> {
        self.0.bytes(O_KEY)
    }
    fn doorbell_seq(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_SEQ)
    }
    fn waiting(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_WAITING)
    }
    fn backlog(&self) -> Result<ShmU64, RegistryError> {
        self.0.u64(O_BACKLOG)
    }
    fn dropped(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_DROPPED)
    }
    fn returned(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_RETURNED)
    }
    fn rcvbuf(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_RCVBUF)
    }
    fn connecting(&self) -> Result<ShmU32, RegistryError> {
        self.0.u32(O_CONNECTING)
    }
}

/// A published entry's contents, read seqlock-style.
struct Entry {
    word: StateWord,
    owner: u64,
    hash: u64,
    key: [u8; KEY_BYTES],
}

impl Registry {
    pub(crate) fn endpoint_slot(&self, idx: u32) -> Result<EndpointSlot<'_>, RegistryError> {
        EndpointSlot::new_checked(self, idx)
    }

    fn ep_cap(&self) -> u32 {
        self.layout.params.max_endpoints
    }

    pub(crate) fn endpoint_word(&self, idx: u32) -> Result<StateWord, RegistryError> {
        self.endpoint_slot(idx)?.word()
    }

    /// Reads the published fields of slot `idx`; `None` if the slot changed meanwhile.
    fn read_entry(&self, idx: u32, word: StateWord) -> Result<Option<Entry>, RegistryError> {
        let slot = self.endpoint_slot(idx)?;
        let owner = slot.owner()?;
        let hash = slot.hash()?;
        let key = slot.key()?;
        fence(Acquire);
        Ok((slot.word()? == word).then_some(Entry {
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
            match w.low() {
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
        let slot = self.endpoint_slot(idx)?;
        slot.write(pack_id(owner.idx, owner.gen), hash, &enc)?;
        let tag = Self::tag_of(owner);
        let inserting = StateWord::new(gen, tag, E_INSERTING);
        if !slot.cas(StateWord::new(gen, tag, E_CLAIMING), inserting)? {
            return Err(RegistryError::Stale); // reclaimed under us: our member was declared dead
        }
        let conflict = self.has_rival(idx, &enc, hash);
        let next = if conflict {
            inserting.next_gen(E_TOMB)
        } else {
            StateWord::new(gen, tag, E_LIVE)
        };
        if !slot.cas(inserting, next)? {
            return Err(RegistryError::Stale);
        }
        if conflict {
            return Err(RegistryError::AddrInUse);
        }
        if let Some(w) = self.header_hint(crate::header::H_ENDPOINTS_EPOCH) {
            w.fetch_add(1, SeqCst);
        }
        tracing::debug!(idx, gen, ?key, "endpoint added");
        Ok(EndpointId { idx, gen })
    }

    fn claim_endpoint_slot(&self, owner: MemberId, hash: u64) -> Result<(u32, u32), RegistryError> {
        let tag = Self::tag_of(owner);
        for idx in self.probe(hash) {
            let slot = self.endpoint_slot(idx)?;
            let w = slot.word()?;
            if !matches!(w.low(), E_EMPTY | E_TOMB) {
                continue;
            }
            if slot.cas(w, StateWord::new(w.gen(), tag, E_CLAIMING))? {
                return Ok((idx, w.gen()));
            }
        }
        Err(self.full("endpoints"))
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
            let st = w.low();
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

    /// Checks that `id` still names a LIVE endpoint and returns its slot.
    pub(crate) fn live_endpoint(&self, id: EndpointId) -> Result<EndpointSlot<'_>, RegistryError> {
        let slot = self.endpoint_slot(id.idx)?;
        let w = slot.word()?;
        if w.gen() != id.gen {
            return Err(RegistryError::Stale);
        }
        match w.low() {
            E_LIVE => Ok(slot),
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
                gen: e.word.gen(),
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
        let slot = self.live_endpoint(id)?;
        let w = slot.word()?;
        if w.gen() != id.gen || w.low() != E_LIVE {
            return Err(RegistryError::Stale);
        }
        if !slot.cas(w, w.next_gen(E_TOMB))? {
            return Err(RegistryError::Stale);
        }
        slot.doorbell_seq()?.fetch_add(1, Release);
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
            if w.low() != E_LIVE {
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

    /// Bumped after every endpoint added and with [`Registry::membership_epoch`] (read before
    /// a lookup): a lookup that found nothing — or found the address's owner nowhere — still
    /// does while it has not moved.
    pub fn endpoints_epoch(&self) -> u64 {
        self.header_hint(crate::header::H_ENDPOINTS_EPOCH)
            .map_or(0, |w| w.load(SeqCst))
    }

    /// The doorbell of a LIVE endpoint: (sequence word bumped by every offer, "listener waiting"
    /// flag). A listener sets the flag, re-checks for offers and sleeps on the sequence word; a
    /// client that sees the flag after `offer` wakes it (futex where a kernel is shared).
    pub fn endpoint_doorbell(&self, id: EndpointId) -> Result<(ShmU32, ShmU32), RegistryError> {
        let slot = self.live_endpoint(id)?;
        Ok((slot.doorbell_seq()?, slot.waiting()?))
    }

    /// Clients of a LIVE endpoint that are between their real `connect` and their offer. A
    /// transparent server that finds no offer for a new connection waits longer while this is
    /// non-zero, because an offer is on its way. Only a hint: a client that dies in between
    /// leaves it high, which costs servers a bounded wait, never a wrong decision.
    pub fn endpoint_connecting(&self, id: EndpointId) -> Result<ShmU32, RegistryError> {
        self.live_endpoint(id)?.connecting()
    }

    /// Datagrams dropped at a LIVE (UDP) endpoint because its ring was full: senders count
    /// them here, `memloop status` shows them per socket.
    pub fn endpoint_dropped(&self, id: EndpointId) -> Result<ShmU32, RegistryError> {
        self.live_endpoint(id)?.dropped()
    }

    /// A LIVE (UDP) endpoint's receive buffer in bytes (0: unknown): the socket's owner keeps
    /// it as the kernel reports `SO_RCVBUF`; senders size a new pair's ring by it and drop a
    /// datagram that would queue more (a hint from the peer: bounded by the caller).
    pub fn endpoint_rcvbuf(&self, id: EndpointId) -> Result<ShmU32, RegistryError> {
        self.live_endpoint(id)?.rcvbuf()
    }

    /// A LIVE (UDP) endpoint's hand-back count: a receiver that leaves its ring handing a
    /// pair's unread datagrams back to their sender bumps the sender's, so the sender looks
    /// at its pairs (one load per receive while nothing was handed back).
    pub fn endpoint_returned(&self, id: EndpointId) -> Result<ShmU32, RegistryError> {
        self.live_endpoint(id)?.returned()
    }

    /// Offers currently waiting for the endpoint (a hint: maintained by offer/accept/cancel).
    pub fn backlog(&self, id: EndpointId) -> Result<u64, RegistryError> {
        Ok(self.live_endpoint(id)?.backlog()?.load(Relaxed))
    }

    /// Adjusts the backlog of the endpoint packed in `ep` if it is still that incarnation.
    /// Every move into or out of OFFERED comes through here, which keeps the region's count
    /// of offers too (whatever became of the endpoint).
    pub(crate) fn backlog_add(&self, ep: u64, up: bool) {
        self.offers_add(up);
        let Some((idx, gen)) = unpack_id(ep, self.ep_cap()) else {
            return;
        };
        let Ok(slot) = self.live_endpoint(EndpointId { idx, gen }) else {
            return;
        };
        if let Ok(w) = slot.backlog() {
            super::step_count(&w, up);
        }
    }

    /// Bumps the doorbell sequence of the endpoint packed in `ep`.
    pub(crate) fn ring_doorbell(&self, ep: EndpointId) -> Result<(), RegistryError> {
        self.live_endpoint(ep)?
            .doorbell_seq()?
            .fetch_add(1, Release);
        Ok(())
    }

    pub(crate) fn count_endpoints(&self) -> u32 {
        (0..self.ep_cap())
            .filter(|&i| {
                self.endpoint_word(i)
                    .map(|w| w.low() == E_LIVE)
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
            let st = w.low();
            if w.tag() != tag || !matches!(st, E_CLAIMING | E_INSERTING | E_LIVE) {
                continue;
            }
            let id = EndpointId { idx, gen: w.gen() };
            if st == E_LIVE {
                n += self.remove_endpoint(id).is_ok() as u32;
            } else if let Ok(slot) = self.endpoint_slot(idx) {
                let _ = slot.cas(w, w.next_gen(E_TOMB));
            }
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_corrupt_endpoint_state_is_not_live_and_is_skipped() {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let key = EndpointKey::Native("x".into());
        let ep = r.add_endpoint(m, &key).unwrap();
        let slot = r.endpoint_slot(ep.idx).unwrap();
        let w = slot.word().unwrap();
        slot.state().unwrap().store(w.with_low(0x7f));
        assert!(matches!(r.live_endpoint(ep), Err(RegistryError::NotFound)));
        assert!(r.lookup(&key).is_none() && r.endpoints().is_empty());
        assert!(matches!(
            EndpointSlot::new_checked(&r, r.params().max_endpoints),
            Err(RegistryError::NotFound)
        ));
    }
}
