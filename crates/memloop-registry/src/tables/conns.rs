//! Connection records: the connections the transparent layer left on plain TCP (or UDP), with
//! the reason and their byte counts, so `memloop status` can show them next to the channels.
//!
//! Fixed slots, each driven by CAS on its [`StateWord`] (generation, owner's tag, state:
//! FREE → CLAIMED → USED → FREE with generation + 1). The owner writes the fields while
//! CLAIMED and publishes them with the CAS to USED; they are immutable until the slot is freed,
//! except the two byte counters, which the owner bumps with relaxed adds (statistics only).
//! Records are soft state: a full table only costs visibility (and is counted), and a record
//! whose owner is no longer a live member is released by the next reclaim.
//!
//! | offset | field (u64) |
//! | --- | --- |
//! | 0 | state · 8 owner (packed member id) · 16 pid · 24 proto · 32 reason code |
//! | 40 | bytes sent · 48 bytes received · 56 connection 4-tuple (40 B) |

use crate::error::RegistryError;
use crate::fallback::{FallbackReason, COUNTER_CONNS_DROPPED};
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, unpack_id, ConnTuple, MemberId, Proto,
    TUPLE_BYTES,
};
use crate::state_word::{bad_state, StateWord};
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::Acquire;
use memloop_shm::ShmU64;

const R_FREE: u8 = 0;
const R_CLAIMED: u8 = 1;
const R_USED: u8 = 2;

const O_OWNER: u64 = 8;
const O_PID: u64 = 16;
const O_PROTO: u64 = 24;
const O_REASON: u64 = 32;
const O_SENT: u64 = 40;
const O_RECEIVED: u64 = 48;
const O_TUPLE: u64 = 56;
const RETRIES: usize = 1000;

/// A connection record slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnRecordId {
    pub idx: u32,
    pub gen: u32,
}

/// One connection that stayed on the kernel's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnRecord {
    pub id: ConnRecordId,
    /// The member that recorded it (the process that connected or accepted).
    pub owner: MemberId,
    pub pid: u32,
    pub proto: Proto,
    pub tuple: ConnTuple,
    pub reason: FallbackReason,
    /// Bytes the recording process sent and received on it.
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

crate::tables::slot_view!(
    /// Typed view of one connection record slot; the only code that knows its field offsets.
    ConnSlot,
    conns
);

impl<'a> ConnSlot<'a> {
    /// Writes a record; the slot must be CLAIMED by the caller.
    fn write(&self, raw: &RawRecord) -> Result<(), RegistryError> {
        for (off, v) in [
            (O_OWNER, raw.owner),
            (O_PID, raw.pid),
            (O_PROTO, raw.proto),
            (O_REASON, raw.reason),
            (O_SENT, raw.sent),
            (O_RECEIVED, raw.received),
        ] {
            self.0.st(off, v)?;
        }
        self.0.write(O_TUPLE, &raw.tuple)
    }
    fn read(&self) -> Result<RawRecord, RegistryError> {
        Ok(RawRecord {
            owner: self.0.ld(O_OWNER)?,
            pid: self.0.ld(O_PID)?,
            proto: self.0.ld(O_PROTO)?,
            reason: self.0.ld(O_REASON)?,
            sent: self.0.ld(O_SENT)?,
            received: self.0.ld(O_RECEIVED)?,
            tuple: self.0.bytes(O_TUPLE)?,
        })
    }
    fn counters(&self) -> Result<(ShmU64, ShmU64), RegistryError> {
        Ok((self.0.u64(O_SENT)?, self.0.u64(O_RECEIVED)?))
    }
}

fn proto_code(p: Proto) -> u64 {
    match p {
        Proto::Tcp => 1,
        Proto::Udp => 2,
    }
}

fn proto_from(code: u64) -> Option<Proto> {
    match code {
        1 => Some(Proto::Tcp),
        2 => Some(Proto::Udp),
        _ => None,
    }
}

/// The raw fields of a USED record, read consistently.
struct RawRecord {
    owner: u64,
    pid: u64,
    proto: u64,
    reason: u64,
    sent: u64,
    received: u64,
    tuple: [u8; TUPLE_BYTES],
}

impl Registry {
    fn conn_slot(&self, idx: u32) -> Result<ConnSlot<'_>, RegistryError> {
        ConnSlot::new_checked(self, idx)
    }

    /// The slot and its word if the slot still holds incarnation `id`.
    fn check_conn(&self, id: ConnRecordId) -> Result<(ConnSlot<'_>, StateWord), RegistryError> {
        let slot = self.conn_slot(id.idx)?;
        let w = slot.word()?;
        if w.gen() != id.gen {
            return Err(RegistryError::Stale);
        }
        match w.low() {
            R_FREE => Err(RegistryError::NotFound),
            R_CLAIMED | R_USED => Ok((slot, w)),
            _ => Err(bad_state("connection record state", id.idx, w)),
        }
    }

    /// Records a connection of `member` (process `pid`) that falls back to the kernel for
    /// `reason`, and counts the fallback (so one call per such connection; use
    /// [`Registry::count_fallback`] alone when there is nothing to record). `None` if the
    /// member is not live or the table is full (counted too).
    pub fn record_conn(
        &self,
        member: MemberId,
        pid: u32,
        proto: Proto,
        tuple: &ConnTuple,
        reason: FallbackReason,
    ) -> Option<ConnRecordId> {
        self.count_fallback(reason);
        self.live_member(member).ok()?;
        let Some((slot, claimed)) = self.claim_conn(member) else {
            self.bump_counter(COUNTER_CONNS_DROPPED);
            return None;
        };
        let id = ConnRecordId {
            idx: slot.0.idx(),
            gen: claimed.gen(),
        };
        let raw = RawRecord {
            owner: pack_id(member.idx, member.gen),
            pid: pid as u64,
            proto: proto_code(proto),
            reason: reason.as_code() as u64,
            sent: 0,
            received: 0,
            tuple: encode_tuple(tuple),
        };
        if slot.write(&raw).is_err() {
            slot.cas(claimed, claimed.next_gen(R_FREE)).ok();
            return None;
        }
        // A CAS: a reclaimer that declared us dead meanwhile has freed the slot.
        match slot.cas(claimed, claimed.with_low(R_USED)) {
            Ok(true) => Some(id),
            _ => None,
        }
    }

    fn claim_conn(&self, member: MemberId) -> Option<(ConnSlot<'_>, StateWord)> {
        let tag = member_tag(member);
        for idx in 0..self.layout.params.max_conns {
            let Ok(slot) = self.conn_slot(idx) else {
                continue;
            };
            let Ok(w) = slot.word() else {
                continue;
            };
            if w.low() != R_FREE {
                continue;
            }
            let claimed = StateWord::new(w.gen(), tag, R_CLAIMED);
            if slot.cas(w, claimed).unwrap_or(false) {
                return Some((slot, claimed));
            }
        }
        None
    }

    /// The (sent, received) byte counters of a record; the owner adds with relaxed
    /// `fetch_add`. Like ring views they name the slot: stop using them after `release_conn`.
    pub fn conn_bytes(&self, id: ConnRecordId) -> Result<(ShmU64, ShmU64), RegistryError> {
        self.check_conn(id)?.0.counters()
    }

    /// Frees a record (the connection is closed). Any process holding the id may release it.
    pub fn release_conn(&self, id: ConnRecordId) -> Result<(), RegistryError> {
        for _ in 0..RETRIES {
            let (slot, w) = self.check_conn(id)?;
            if slot.cas(w, w.next_gen(R_FREE))? {
                return Ok(());
            }
        }
        Err(RegistryError::corrupt(
            "connection record state",
            "release did not converge",
        ))
    }

    fn read_conn(
        &self,
        slot: &ConnSlot<'_>,
        w: StateWord,
    ) -> Result<Option<RawRecord>, RegistryError> {
        let raw = slot.read()?;
        fence(Acquire);
        Ok((slot.word()? == w).then_some(raw))
    }

    fn decode_conn(&self, id: ConnRecordId, raw: &RawRecord) -> Result<ConnRecord, RegistryError> {
        let bad = |what: &'static str, v: u64| {
            RegistryError::corrupt(what, format!("connection record {}: {v:#x}", id.idx))
        };
        let (midx, mgen) = unpack_id(raw.owner, self.layout.params.max_members)
            .ok_or_else(|| bad("connection record owner", raw.owner))?;
        let reason = u32::try_from(raw.reason)
            .ok()
            .and_then(FallbackReason::from_code)
            .ok_or_else(|| bad("connection record reason", raw.reason))?;
        Ok(ConnRecord {
            id,
            owner: MemberId {
                idx: midx,
                gen: mgen,
            },
            pid: u32::try_from(raw.pid).map_err(|_| bad("connection record pid", raw.pid))?,
            proto: proto_from(raw.proto)
                .ok_or_else(|| bad("connection record proto", raw.proto))?,
            tuple: decode_tuple(&raw.tuple)?.ok_or_else(|| bad("connection record tuple", 0))?,
            reason,
            bytes_sent: raw.sent,
            bytes_received: raw.received,
        })
    }

    /// Every published record (entries failing validation are skipped and logged).
    pub fn conns(&self) -> Vec<ConnRecord> {
        let mut out = Vec::new();
        for idx in 0..self.layout.params.max_conns {
            let Ok(slot) = self.conn_slot(idx) else {
                continue;
            };
            let Ok(w) = slot.word() else {
                continue;
            };
            if w.low() != R_USED {
                continue;
            }
            let id = ConnRecordId { idx, gen: w.gen() };
            match self
                .read_conn(&slot, w)
                .and_then(|raw| raw.map(|r| self.decode_conn(id, &r)).transpose())
            {
                Ok(Some(rec)) => out.push(rec),
                Ok(None) => {}
                Err(e) => tracing::warn!(idx, error = %e, "skipping connection record"),
            }
        }
        out
    }

    pub(crate) fn count_conns(&self) -> u32 {
        (0..self.layout.params.max_conns)
            .filter(|&i| {
                self.conn_slot(i)
                    .and_then(|s| s.word())
                    .map(|w| w.low() != R_FREE)
                    .unwrap_or(false)
            })
            .count() as u32
    }

    /// Releases every record (claimed or used) whose owner is not a live member: the member
    /// being reclaimed, and owners declared dead while they were recording. Returns how many.
    pub(crate) fn reclaim_conns(&self) -> u32 {
        let mut n = 0;
        for idx in 0..self.layout.params.max_conns {
            let Ok(slot) = self.conn_slot(idx) else {
                continue;
            };
            let Ok(w) = slot.word() else {
                continue;
            };
            if w.low() == R_FREE || self.tag_alive(w.tag()) {
                continue;
            }
            n += slot.cas(w, w.next_gen(R_FREE)).unwrap_or(false) as u32;
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::Ordering::{Relaxed, SeqCst};

    #[test]
    fn a_corrupt_record_state_is_a_typed_error() {
        let (r, _, _) = populated();
        let id = r.conns()[0].id;
        let slot = r.conn_slot(id.idx).unwrap();
        slot.state().unwrap().store(StateWord::new(id.gen, 0, 7));
        let e = r.release_conn(id).unwrap_err();
        assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
        assert!(r.conns().iter().all(|c| c.id != id), "listing skips it");
        assert!(matches!(
            ConnSlot::new_checked(&r, r.params().max_conns),
            Err(RegistryError::NotFound)
        ));
    }

    fn populated() -> (Registry, MemberId, ConnTuple) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let t = ConnTuple {
            client: "10.0.0.1:1".parse().unwrap(),
            server: "[::1]:2".parse().unwrap(),
        };
        for reason in FallbackReason::ALL {
            r.record_conn(m, 9, Proto::Tcp, &t, reason).unwrap();
        }
        (r, m, t)
    }

    /// Values that often look almost valid: state words, codes, packed ids, small numbers.
    fn plausible(v: u64, kind: u8) -> u64 {
        match kind {
            0 => v,
            1 => v & 0xff,
            2 => v & 0xffff_ffff_0000_00ff,
            3 => (v & 0xffff_ffff_ffff_ff00) | (v % 4),
            _ => v % 16,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        #[test]
        fn scribbled_records_are_errors_never_panics(
            words in prop::collection::vec((0u64..4096, any::<u64>(), 0u8..5), 1..48)
        ) {
            let (r, m, t) = populated();
            let len = r.layout.params.max_conns as u64 * crate::header::CONN_BYTES;
            for &(off, v, kind) in &words {
                let off = r.layout.conns_off + ((off % len) & !7);
                r.view.u64_at(off).unwrap().store(plausible(v, kind), SeqCst);
            }
            let listed = r.conns();
            prop_assert!(listed.len() as u32 <= r.layout.params.max_conns);
            for idx in 0..r.layout.params.max_conns {
                for gen in 0..3 {
                    let id = ConnRecordId { idx, gen };
                    if let Ok((s, rcv)) = r.conn_bytes(id) {
                        s.fetch_add(1, Relaxed);
                        rcv.fetch_add(1, Relaxed);
                    }
                    let _ = r.release_conn(id);
                }
            }
            let _ = (r.record_conn(m, 1, Proto::Udp, &t, FallbackReason::Error), r.usage());
            let _ = r.reclaim(m, m);
            prop_assert!(r.conns().is_empty(), "the only owner left: all released");
        }
    }
}
