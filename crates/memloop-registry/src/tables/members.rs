//! The members table: one fixed slot per process or VM of the trust group.
//!
//! Slot state word ([`StateWord`]): generation, the reclaimer's tag (while RECLAIMING), state. Identity fields are written while
//! the slot is CLAIMING (only by the joiner) and published by the store that makes it LIVE; they
//! never change until the slot is FREE again with `gen + 1`, so a reader checks the state word
//! before and after reading them. Addresses (soft state, re-advertised at will) have their own
//! seqlock word.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state · 8 heartbeat · 16 join counter · 24 address seqlock |
//! | 32 | pid · 40 start time · 48 pid-ns inode · 56 net-ns inode (u64 each) |
//! | 64 | boot id (16 B) · 80 name (32 B, NUL padded) |
//! | 112 | address count · 120 families (8 B) · 128 addresses (8 × 16 B) |

use crate::error::RegistryError;
use crate::header::H_JOIN_SEQ;
use crate::key::{arr16, decode_ip, encode_ip, member_tag, MemberId};
use crate::state_word::{bad_state, StateWord};
use crate::Registry;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use memloop_shm::sync::{fence, spin_hint};
use memloop_shm::ShmU64;
use std::net::IpAddr;

pub(crate) const M_FREE: u8 = 0;
pub(crate) const M_CLAIMING: u8 = 1;
pub(crate) const M_LIVE: u8 = 2;
pub(crate) const M_RECLAIMING: u8 = 3;

/// Longest member name in bytes.
pub const MAX_MEMBER_NAME: usize = 32;
/// Addresses a member can advertise.
pub const MAX_ADDRESSES: usize = 8;

const O_HEARTBEAT: u64 = 8;

/// Heartbeat word flag: the member's kernel can prove it alive by a lock it holds on its byte
/// of the region file (`memloop_shm::member_lock`), from any pid namespace.
pub const BEAT_LOCKED: u64 = 1 << 62;
/// Heartbeat word flag: the member runs no heartbeat thread (it holds nothing a sweep must look
/// after). Only its own kernel can judge it (by `/proc` or its lock); another kernel takes it
/// for alive.
pub const BEAT_NONE: u64 = 1 << 63;
const O_JOIN: u64 = 16;
const O_ADDR_SEQ: u64 = 24;
const O_PID: u64 = 32;
const O_START: u64 = 40;
const O_PIDNS: u64 = 48;
const O_NETNS: u64 = 56;
const O_BOOT: u64 = 64;
const O_NAME: u64 = 80;
const O_NADDR: u64 = 112;
const O_FAMS: u64 = 120;
const O_ADDRS: u64 = 128;
const READ_TRIES: usize = 64;

/// Who a member is: enough for a peer to check liveness (pid + start time within one kernel,
/// identified by its boot id) and to match loopback addresses (namespaces).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberIdentity {
    pub pid: u32,
    pub start_time: u64,
    pub boot_id: [u8; 16],
    pub pid_ns: u64,
    pub net_ns: u64,
    pub name: String,
}

impl MemberIdentity {
    /// The network namespace this member's socket addresses belong to, across kernels.
    pub fn net_scope(&self) -> u64 {
        net_scope(&self.boot_id, self.net_ns)
    }
}

/// One network namespace of one kernel. Namespace inode numbers repeat across kernels (every
/// kernel's initial namespace has the same one, so two VMs and their host would look alike), so
/// the kernel's boot id is folded in (FNV-1a; 0 is never returned, it means "unknown").
pub fn net_scope(boot_id: &[u8; 16], net_ns: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in boot_id.iter().chain(net_ns.to_le_bytes().iter()) {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberState {
    Claiming,
    Live,
    Reclaiming,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    pub id: MemberId,
    pub identity: MemberIdentity,
    pub addresses: Vec<IpAddr>,
    /// The heartbeat word: a counter, and the flags [`BEAT_LOCKED`] and [`BEAT_NONE`].
    pub heartbeat: u64,
    pub state: MemberState,
}

impl MemberInfo {
    /// It holds a lock on its byte of the region file for as long as it lives.
    pub fn locked(&self) -> bool {
        self.heartbeat & BEAT_LOCKED != 0
    }
    /// It runs no heartbeat thread: its counter never moves.
    pub fn beatless(&self) -> bool {
        self.heartbeat & BEAT_NONE != 0
    }
    /// The heartbeat counter, without the flags.
    pub fn beats(&self) -> u64 {
        self.heartbeat & !(BEAT_LOCKED | BEAT_NONE)
    }
}

crate::tables::slot_view!(
    /// Typed view of one member slot; the only code that knows the slot's field offsets.
    MemberSlot,
    members
);

impl<'a> MemberSlot<'a> {
    /// Writes the identity; the slot must be CLAIMING by the caller.
    fn write_identity(
        &self,
        join: u64,
        beat: u64,
        ident: &MemberIdentity,
    ) -> Result<(), RegistryError> {
        for (off, v) in [
            (O_HEARTBEAT, beat),
            (O_JOIN, join),
            (O_ADDR_SEQ, 0),
            (O_PID, ident.pid as u64),
            (O_START, ident.start_time),
            (O_PIDNS, ident.pid_ns),
            (O_NETNS, ident.net_ns),
            (O_NADDR, 0),
        ] {
            self.0.st(off, v)?;
        }
        self.0.write(O_BOOT, &ident.boot_id)?;
        let mut name = [0u8; MAX_MEMBER_NAME];
        name[..ident.name.len()].copy_from_slice(ident.name.as_bytes());
        self.0.write(O_NAME, &name)
    }
    fn read_identity(&self) -> Result<MemberIdentity, RegistryError> {
        let pid = self.0.ld(O_PID)?;
        let pid = u32::try_from(pid)
            .map_err(|_| RegistryError::corrupt("member", format!("pid {pid}")))?;
        let name: [u8; MAX_MEMBER_NAME] = self.0.bytes(O_NAME)?;
        let len = name.iter().position(|&b| b == 0).unwrap_or(MAX_MEMBER_NAME);
        let name = std::str::from_utf8(&name[..len])
            .map_err(|e| RegistryError::corrupt("member name", e.to_string()))?
            .to_owned();
        Ok(MemberIdentity {
            pid,
            start_time: self.0.ld(O_START)?,
            boot_id: self.0.bytes(O_BOOT)?,
            pid_ns: self.0.ld(O_PIDNS)?,
            net_ns: self.0.ld(O_NETNS)?,
            name,
        })
    }
    fn heartbeat(&self) -> Result<ShmU64, RegistryError> {
        self.0.u64(O_HEARTBEAT)
    }
    fn addr_seq(&self) -> Result<ShmU64, RegistryError> {
        self.0.u64(O_ADDR_SEQ)
    }
    /// Writes the addresses; the caller holds the address seqlock.
    fn write_addresses(&self, addrs: &[IpAddr]) -> Result<(), RegistryError> {
        let mut fams = [0u8; 8];
        for (i, a) in addrs.iter().enumerate() {
            let (f, b) = encode_ip(a);
            fams[i] = f;
            self.0.write(O_ADDRS + 16 * i as u64, &b)?;
        }
        self.0.write(O_FAMS, &fams)?;
        self.0.st(O_NADDR, addrs.len() as u64)
    }
    /// The raw address fields (count, families, addresses), to be validated by the reader.
    fn raw_addresses(&self) -> Result<(u64, [u8; 8], [u8; 16 * MAX_ADDRESSES]), RegistryError> {
        Ok((
            self.0.ld(O_NADDR)?,
            self.0.bytes(O_FAMS)?,
            self.0.bytes(O_ADDRS)?,
        ))
    }
}

pub(crate) fn state_name(st: u8) -> &'static str {
    match st {
        M_FREE => "FREE",
        M_CLAIMING => "CLAIMING",
        M_LIVE => "LIVE",
        M_RECLAIMING => "RECLAIMING",
        _ => "invalid",
    }
}

fn check_identity(ident: &MemberIdentity) -> Result<(), RegistryError> {
    if ident.name.len() > MAX_MEMBER_NAME || ident.name.contains('\0') {
        return Err(RegistryError::InvalidParams(format!(
            "member name must be <= {MAX_MEMBER_NAME} bytes without NUL"
        )));
    }
    Ok(())
}

impl Registry {
    pub(crate) fn member_slot(&self, idx: u32) -> Result<MemberSlot<'_>, RegistryError> {
        MemberSlot::new_checked(self, idx)
    }

    pub(crate) fn member_word(&self, idx: u32) -> Result<StateWord, RegistryError> {
        self.member_slot(idx)?.word()
    }

    /// The state word of `id`'s slot if it still belongs to `id` (any non-FREE state).
    pub(crate) fn check_member(&self, id: MemberId) -> Result<StateWord, RegistryError> {
        let w = self.member_word(id.idx)?;
        if w.gen() != id.gen {
            return Err(RegistryError::Stale);
        }
        match w.low() {
            M_FREE => Err(RegistryError::NotFound),
            M_CLAIMING | M_LIVE | M_RECLAIMING => Ok(w),
            _ => Err(bad_state("member state", id.idx, w)),
        }
    }

    /// Like [`Self::check_member`] but the member must be LIVE.
    pub(crate) fn live_member(&self, id: MemberId) -> Result<(), RegistryError> {
        let w = self.check_member(id)?;
        match w.low() {
            M_LIVE => Ok(()),
            s => Err(RegistryError::wrong("LIVE", state_name(s))),
        }
    }

    /// Is the member incarnation named by a 24-bit tag LIVE?
    pub(crate) fn tag_alive(&self, tag: u32) -> bool {
        let Some(idx) = (tag & 0xfff).checked_sub(1) else {
            return false;
        };
        match self.member_word(idx) {
            Ok(w) => w.low() == M_LIVE && (w.gen() & 0xfff) == tag >> 12,
            Err(_) => false,
        }
    }

    /// Takes a free member slot and publishes `ident` in it.
    pub fn join(&self, ident: &MemberIdentity) -> Result<MemberId, RegistryError> {
        self.join_with(ident, |_| 0)
    }

    /// [`Registry::join`], with `prove` called on the claimed slot's index before the member
    /// is published: it returns the heartbeat word's flags ([`BEAT_LOCKED`], [`BEAT_NONE`]),
    /// e.g. after taking the slot's lock.
    pub fn join_with(
        &self,
        ident: &MemberIdentity,
        mut prove: impl FnMut(u32) -> u64,
    ) -> Result<MemberId, RegistryError> {
        check_identity(ident)?;
        for idx in 0..self.layout.params.max_members {
            let slot = self.member_slot(idx)?;
            let w = slot.word()?;
            if w.low() != M_FREE {
                continue;
            }
            let claim = StateWord::new(w.gen(), 0, M_CLAIMING);
            if slot.cas(w, claim)? {
                let id = MemberId { idx, gen: w.gen() };
                let beat = prove(idx) & (BEAT_LOCKED | BEAT_NONE);
                slot.write_identity(self.next_seq(H_JOIN_SEQ)?, beat, ident)?;
                // A CAS, not a store: if we were so slow that our claim was expired as
                // abandoned (see `expire_claim`), the slot is someone else's now.
                if slot.cas(claim, StateWord::new(id.gen, 0, M_LIVE))? {
                    self.membership_moved();
                    tracing::debug!(?id, name = %ident.name, "member joined");
                    return Ok(id);
                }
            }
        }
        Err(self.full("members"))
    }

    /// Graceful exit: reclaims everything `id` holds, as if it had died.
    pub fn leave(&self, id: MemberId) -> Result<(), RegistryError> {
        self.reclaim(id, id).map(|_| ())
    }

    /// Proof of life: bumps the member's heartbeat counter.
    pub fn heartbeat(&self, id: MemberId) -> Result<(), RegistryError> {
        self.live_member(id)?;
        self.member_slot(id.idx)?.heartbeat()?.fetch_add(1, Release);
        Ok(())
    }

    /// From now on the member beats: clears [`BEAT_NONE`] and bumps the counter once.
    pub fn start_beating(&self, id: MemberId) -> Result<(), RegistryError> {
        self.live_member(id)?;
        let w = self.member_slot(id.idx)?.heartbeat()?;
        w.fetch_and(!BEAT_NONE, Release);
        w.fetch_add(1, Release);
        Ok(())
    }

    /// The member no longer holds its lock (the program closed its fd): clears
    /// [`BEAT_LOCKED`]. The member must beat first.
    pub fn lock_given_up(&self, id: MemberId) -> Result<(), RegistryError> {
        self.live_member(id)?;
        self.member_slot(id.idx)?
            .heartbeat()?
            .fetch_and(!BEAT_LOCKED, Release);
        Ok(())
    }

    /// Replaces the advertised addresses (at most [`MAX_ADDRESSES`]).
    pub fn set_addresses(&self, id: MemberId, addrs: &[IpAddr]) -> Result<(), RegistryError> {
        if addrs.len() > MAX_ADDRESSES {
            return Err(RegistryError::InvalidParams(format!(
                "at most {MAX_ADDRESSES} addresses"
            )));
        }
        self.live_member(id)?;
        let slot = self.member_slot(id.idx)?;
        let seq = slot.addr_seq()?;
        let start = self.lock_addresses(&seq);
        slot.write_addresses(addrs)?;
        seq.store(start.wrapping_add(2), Release);
        self.membership_moved();
        Ok(())
    }

    /// Bumped after every change of who is a member or of a member's addresses: what was
    /// derived from the member table (who owns an address) stands while it has not moved.
    pub fn membership_epoch(&self) -> u64 {
        self.header_hint(crate::header::H_MEMBERSHIP)
            .map_or(0, |w| w.load(SeqCst))
    }

    pub(crate) fn membership_moved(&self) {
        // (The endpoints' epoch too: it stands for "who can be found where".)
        for h in [
            crate::header::H_MEMBERSHIP,
            crate::header::H_ENDPOINTS_EPOCH,
        ] {
            if let Some(w) = self.header_hint(h) {
                w.fetch_add(1, SeqCst);
            }
        }
    }

    /// Makes the address seqlock odd; returns the even value it had. A writer that died with the
    /// lock odd can only have been this member itself, so after a bounded wait we take it over.
    fn lock_addresses(&self, seq: &ShmU64) -> u64 {
        for _ in 0..1000 {
            let s = seq.load(Relaxed);
            if s % 2 == 0 && seq.compare_exchange(s, s + 1, Acquire, Relaxed).is_ok() {
                return s;
            }
            spin_hint();
        }
        let s = seq.load(Relaxed) | 1;
        seq.store(s, Relaxed);
        fence(Release);
        s.wrapping_sub(1)
    }

    /// Reads one member; `Stale` if the slot no longer belongs to `id`.
    pub fn member(&self, id: MemberId) -> Result<MemberInfo, RegistryError> {
        let w = self.check_member(id)?;
        let state = match w.low() {
            M_LIVE => MemberState::Live,
            M_RECLAIMING => MemberState::Reclaiming,
            _ => MemberState::Claiming,
        };
        let slot = self.member_slot(id.idx)?;
        let identity = slot.read_identity()?;
        let heartbeat = slot.heartbeat()?.load(Relaxed);
        let addresses = Self::read_addresses(&slot)?;
        fence(Acquire);
        let w2 = self.check_member(id)?;
        if state == MemberState::Claiming || w2.low() == M_CLAIMING {
            return Err(RegistryError::wrong("LIVE", "CLAIMING"));
        }
        Ok(MemberInfo {
            id,
            identity,
            addresses,
            heartbeat,
            state,
        })
    }

    /// One member's boot id alone (which kernel it runs in): what a connection asks on its
    /// setup path, without reading (and allocating) the whole identity and its addresses.
    pub fn member_boot_id(&self, id: MemberId) -> Result<[u8; 16], RegistryError> {
        let w = self.check_member(id)?;
        if w.low() == M_CLAIMING {
            return Err(RegistryError::wrong("LIVE", "CLAIMING"));
        }
        let boot = self.member_slot(id.idx)?.0.bytes(O_BOOT)?;
        fence(Acquire);
        self.check_member(id)?;
        Ok(boot)
    }

    fn read_addresses(slot: &MemberSlot<'_>) -> Result<Vec<IpAddr>, RegistryError> {
        let seq = slot.addr_seq()?;
        for _ in 0..READ_TRIES {
            let s1 = seq.load(Acquire);
            if s1 % 2 == 1 {
                spin_hint();
                continue;
            }
            let (n, fams, raw) = slot.raw_addresses()?;
            fence(Acquire);
            if seq.load(Relaxed) != s1 {
                continue;
            }
            if n > MAX_ADDRESSES as u64 {
                return Err(RegistryError::corrupt(
                    "member addresses",
                    format!("count {n}"),
                ));
            }
            return (0..n as usize)
                .map(|i| decode_ip(fams[i], &arr16(&raw[16 * i..])))
                .collect();
        }
        Err(RegistryError::corrupt(
            "member addresses",
            "writer never finished",
        ))
    }

    /// Every LIVE or RECLAIMING member (entries that fail validation are skipped and logged).
    pub fn members(&self) -> Vec<MemberInfo> {
        let mut out = Vec::new();
        for idx in 0..self.layout.params.max_members {
            let Ok(w) = self.member_word(idx) else {
                continue;
            };
            if !matches!(w.low(), M_LIVE | M_RECLAIMING) {
                continue;
            }
            match self.member(MemberId { idx, gen: w.gen() }) {
                Ok(m) => out.push(m),
                Err(RegistryError::Stale) => {}
                Err(e) => tracing::warn!(idx, error = %e, "skipping member entry"),
            }
        }
        out
    }

    /// Whether a live member runs in a kernel other than `boot`: one word and one boot id per
    /// live slot, no identity copied (asked on every join).
    pub fn has_member_booted_elsewhere(&self, boot: &[u8; 16]) -> bool {
        (0..self.layout.params.max_members).any(|idx| {
            let Ok(w) = self.member_word(idx) else {
                return false;
            };
            w.low() == M_LIVE
                && self
                    .member_boot_id(MemberId { idx, gen: w.gen() })
                    .is_ok_and(|b| b != *boot)
        })
    }

    /// Slots caught in the middle of a join, as (index, state word). A claimer killed there
    /// owns nothing yet; an observer that sees the same word for long enough expires it.
    pub fn claims(&self) -> Vec<(u32, u64)> {
        (0..self.layout.params.max_members)
            .filter_map(|idx| Some((idx, self.member_word(idx).ok()?)))
            .filter(|(_, w)| w.low() == M_CLAIMING)
            .map(|(idx, w)| (idx, w.raw()))
            .collect()
    }

    /// Frees a join claim that has not moved (its state word is still `word`). Returns whether
    /// this call freed it. A claimer that was merely slow fails its final CAS and joins again.
    pub fn expire_claim(&self, idx: u32, word: u64) -> Result<bool, RegistryError> {
        let word = StateWord::from_raw(word);
        if word.low() != M_CLAIMING || idx >= self.layout.params.max_members {
            return Err(RegistryError::WrongState {
                expected: "claiming",
                found: "other",
            });
        }
        self.member_slot(idx)?.cas(word, word.next_gen(M_FREE))
    }

    pub(crate) fn count_members(&self) -> u32 {
        (0..self.layout.params.max_members)
            .filter(|&i| {
                self.member_word(i)
                    .map(|w| w.low() != M_FREE)
                    .unwrap_or(false)
            })
            .count() as u32
    }

    /// The 24-bit tag of `id` (for tables that record their owner in their state word).
    pub(crate) fn tag_of(id: MemberId) -> u32 {
        member_tag(id)
    }
}

/// Unit tests elsewhere in the crate: a small heap region with one live member `name`.
#[cfg(all(test, not(loom)))]
pub(crate) fn test_registry_with_member(name: &str) -> (Registry, MemberId) {
    let p = crate::RegionParams::small(1 << 20);
    let r = Registry::init(memloop_shm::ShmSlice::new_heap(p.size as usize), &p).unwrap();
    let ident = MemberIdentity {
        pid: 1,
        start_time: 0,
        boot_id: [0; 16],
        pid_ns: 0,
        net_ns: 0,
        name: name.into(),
    };
    let m = r.join(&ident).unwrap();
    (r, m)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::RegionParams;
    use memloop_shm::ShmSlice;

    fn ident() -> MemberIdentity {
        MemberIdentity {
            pid: 1,
            start_time: 2,
            boot_id: [3; 16],
            pid_ns: 4,
            net_ns: 5,
            name: "m".into(),
        }
    }

    #[test]
    fn abandoned_claim_is_expired_and_a_late_claimer_does_not_win_it() {
        let size = 1 << 20;
        let r = Registry::init(
            ShmSlice::new_heap(size as usize),
            &RegionParams::small(size),
        )
        .unwrap();
        // A process died between claiming slot 0 and going live.
        let slot = r.member_slot(0).unwrap();
        let claim = StateWord::new(0, 0, M_CLAIMING);
        slot.state().unwrap().store(claim);
        let claim = claim.raw();
        assert_eq!(r.claims(), vec![(0, claim)]);
        assert!(r.members().is_empty());
        assert!(r.expire_claim(0, claim).unwrap());
        assert!(!r.expire_claim(0, claim).unwrap(), "expired twice");
        assert!(r.claims().is_empty());
        assert_eq!(r.usage().members, 0);
        // The slot is reusable, with a new generation so the old claim's word can never match.
        let id = r.join(&ident()).unwrap();
        assert_eq!((id.idx, id.gen), (0, 1));
        assert!(r
            .expire_claim(0, StateWord::new(1, 0, M_LIVE).raw())
            .is_err());
    }

    #[test]
    fn a_corrupt_member_state_is_a_typed_error() {
        let (r, m) = test_registry_with_member("m");
        let slot = r.member_slot(m.idx).unwrap();
        slot.state().unwrap().store(StateWord::new(m.gen, 0, 9));
        let e = r.member(m).unwrap_err();
        assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
        assert!(r.members().is_empty(), "listing skips it");
        assert!(matches!(
            MemberSlot::new_checked(&r, r.params().max_members),
            Err(RegistryError::NotFound)
        ));
    }
}
