//! Connection records: the connections the transparent layer left on plain TCP (or UDP), with
//! the reason and their byte counts, so `memloop status` can show them next to the channels.
//! A record says either why the connection *fell back* at set-up (a [`FallbackReason`]) or that
//! it was a ring connection that *switched* to TCP mid-stream (a [`SwitchReason`], live path
//! switching), with the number of switches and the bytes it carried on its ring before.
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
//! | 0 | state · 8 owner (packed member id) · 16 pid · 24 proto · 32 fallback reason code |
//! | 40 | bytes sent · 48 bytes received · 56 connection 4-tuple (40 B) |
//! | 96 | switch reason code · 104 switches · 112 ring bytes (both directions) · 120 reserved |
//!
//! Exactly one of the two reason codes is non-zero: a fallback record has switch code 0, no
//! switches and no ring bytes; a switched record has fallback code 0 and at least one switch.
//! The switch fields sit in bytes layout version 3 reserved (zeroed at init, never written
//! before), so they need no new version: a version-3 record without them reads as a fallback.

use crate::error::RegistryError;
use crate::fallback::{FallbackReason, COUNTER_CONNS_DROPPED};
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, unpack_id, ConnTuple, MemberId, Proto,
    TUPLE_BYTES,
};
use crate::state_word::{bad_state, StateWord};
use crate::switch::SwitchReason;
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
const O_SWITCH: u64 = 96;
const O_SWITCHES: u64 = 104;
const O_RING_BYTES: u64 = 112;
const _: () = assert!(O_TUPLE + TUPLE_BYTES as u64 <= O_SWITCH);
const _: () = assert!(O_RING_BYTES + 8 <= crate::header::CONN_BYTES);
const RETRIES: usize = 1000;

/// A connection record slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnRecordId {
    pub idx: u32,
    pub gen: u32,
}

/// Why a connection is on the kernel's path: it fell back when it was set up, or it was a ring
/// connection and switched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordReason {
    Fallback(FallbackReason),
    Switched(SwitchReason),
}

impl RecordReason {
    /// A short identifier (`no_listener`, …; a switch reads `switched_<reason>`).
    pub fn name(self) -> String {
        match self {
            Self::Fallback(r) => r.name().to_string(),
            Self::Switched(r) => format!("switched_{}", r.name()),
        }
    }
}

impl std::fmt::Display for RecordReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fallback(r) => write!(f, "{r}"),
            Self::Switched(r) => write!(f, "switched from its ring ({r})"),
        }
    }
}

/// One connection on the kernel's path: it stayed there, or switched to it from a ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnRecord {
    pub id: ConnRecordId,
    /// The member that recorded it (the process that connected or accepted).
    pub owner: MemberId,
    pub pid: u32,
    pub proto: Proto,
    pub tuple: ConnTuple,
    pub reason: RecordReason,
    /// Times the connection switched path (0 for a fallback record).
    pub switches: u32,
    /// Bytes the connection carried on its ring before it switched, both directions together
    /// as seen by the recording process (sent + received); 0 for a fallback record.
    pub ring_bytes: u64,
    /// Bytes the recording process sent and received on it over TCP.
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

impl ConnRecord {
    /// Why it switched, if it was a ring connection that switched to TCP.
    pub fn switched(&self) -> Option<SwitchReason> {
        match self.reason {
            RecordReason::Switched(r) => Some(r),
            RecordReason::Fallback(_) => None,
        }
    }

    /// Why it fell back, if it never was on a ring.
    pub fn fallback(&self) -> Option<FallbackReason> {
        match self.reason {
            RecordReason::Fallback(r) => Some(r),
            RecordReason::Switched(_) => None,
        }
    }
}

crate::tables::slot_view!(
    /// Typed view of one connection record slot; the only code that knows its field offsets.
    ConnSlot,
    conns
);

/// Header counter: TCP bytes (sent + received) of connection records already freed; live
/// records add theirs in [`Registry::tcp_bytes`].
pub const COUNTER_TCP_BYTES: usize =
    crate::switch::COUNTER_SWITCH_FIRST + crate::switch::FIRST_SWITCH_REASONS;

const _: () = assert!(COUNTER_TCP_BYTES < crate::header::NCOUNTERS);

impl<'a> ConnSlot<'a> {
    /// The record's TCP bytes, sent + received (statistics: a corrupt word reads as 0).
    fn carried(&self) -> u64 {
        let ld = |o| self.0.ld(o).unwrap_or(0);
        ld(O_SENT).saturating_add(ld(O_RECEIVED))
    }

    /// Writes a record; the slot must be CLAIMED by the caller.
    fn write(&self, raw: &RawRecord) -> Result<(), RegistryError> {
        for (off, v) in [
            (O_OWNER, raw.owner),
            (O_PID, raw.pid),
            (O_PROTO, raw.proto),
            (O_REASON, raw.reason),
            (O_SENT, raw.sent),
            (O_RECEIVED, raw.received),
            (O_SWITCH, raw.switch),
            (O_SWITCHES, raw.switches),
            (O_RING_BYTES, raw.ring_bytes),
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
            switch: self.0.ld(O_SWITCH)?,
            switches: self.0.ld(O_SWITCHES)?,
            ring_bytes: self.0.ld(O_RING_BYTES)?,
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
    switch: u64,
    switches: u64,
    ring_bytes: u64,
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
        let raw = RawRecord {
            owner: pack_id(member.idx, member.gen),
            pid: pid as u64,
            proto: proto_code(proto),
            reason: reason.as_code() as u64,
            sent: 0,
            received: 0,
            tuple: encode_tuple(tuple),
            switch: 0,
            switches: 0,
            ring_bytes: 0,
        };
        self.publish_conn(member, &raw)
    }

    /// Records a ring connection of `owner` (process `pid`) that switched to TCP for `reason`
    /// after carrying `ring_bytes` on its ring (sent + received by this process). The switch
    /// itself is counted once per connection, by the side whose request won
    /// ([`Registry::count_switch`]), not here. The record
    /// then counts its TCP bytes like any other ([`Registry::conn_bytes`]). `None` if the
    /// member is not live or the table is full (counted too).
    pub fn record_switched_conn(
        &self,
        owner: MemberId,
        pid: u32,
        proto: Proto,
        tuple: &ConnTuple,
        reason: SwitchReason,
        ring_bytes: u64,
    ) -> Option<ConnRecordId> {
        let raw = RawRecord {
            owner: pack_id(owner.idx, owner.gen),
            pid: pid as u64,
            proto: proto_code(proto),
            reason: 0,
            sent: 0,
            received: 0,
            tuple: encode_tuple(tuple),
            switch: reason.as_code() as u64,
            switches: 1,
            ring_bytes,
        };
        self.publish_conn(owner, &raw)
    }

    /// Claims a slot for `member`, writes `raw` and publishes it.
    fn publish_conn(&self, member: MemberId, raw: &RawRecord) -> Option<ConnRecordId> {
        self.live_member(member).ok()?;
        let Some((slot, claimed)) = self.claim_conn(member) else {
            self.bump_counter(COUNTER_CONNS_DROPPED);
            return None;
        };
        let id = ConnRecordId {
            idx: slot.0.idx(),
            gen: claimed.gen(),
        };
        if slot.write(raw).is_err() {
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
        let n = self.layout.params.max_conns;
        self.next_fit(crate::header::H_CONN_HINT, n, |idx| {
            let slot = self.conn_slot(idx).ok()?;
            let w = slot.word().ok()?;
            if w.low() != R_FREE {
                return None;
            }
            let claimed = StateWord::new(w.gen(), tag, R_CLAIMED);
            slot.cas(w, claimed).ok()?.then_some((slot, claimed))
        })
    }

    /// The (sent, received) byte counters of a record; the owner adds with relaxed
    /// `fetch_add`. Like ring views they name the slot: stop using them after `release_conn`.
    pub fn conn_bytes(&self, id: ConnRecordId) -> Result<(ShmU64, ShmU64), RegistryError> {
        self.check_conn(id)?.0.counters()
    }

    /// Frees a record (the connection is closed). Any process holding the id may release it.
    /// Its TCP bytes go to the region's total ([`COUNTER_TCP_BYTES`]), so they are counted
    /// once, whoever frees the record.
    pub fn release_conn(&self, id: ConnRecordId) -> Result<(), RegistryError> {
        for _ in 0..RETRIES {
            let (slot, w) = self.check_conn(id)?;
            let carried = slot.carried();
            if slot.cas(w, w.next_gen(R_FREE))? {
                self.add_counter(COUNTER_TCP_BYTES, carried);
                return Ok(());
            }
        }
        Err(RegistryError::corrupt(
            "connection record state",
            "release did not converge",
        ))
    }

    /// TCP bytes of every recorded connection, closed (the counter) and live (the records).
    pub fn tcp_bytes(&self) -> u64 {
        let live: u64 = self
            .conns()
            .iter()
            .map(|c| c.bytes_sent.saturating_add(c.bytes_received))
            .sum();
        self.counters()
            .get(COUNTER_TCP_BYTES)
            .copied()
            .unwrap_or(0)
            .saturating_add(live)
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
        let switches = u32::try_from(raw.switches)
            .map_err(|_| bad("connection record switches", raw.switches))?;
        let reason = match (raw.reason, raw.switch) {
            (0, code) => {
                let r = u8::try_from(code)
                    .ok()
                    .and_then(SwitchReason::from_code)
                    .ok_or_else(|| bad("connection record switch reason", code))?;
                if switches == 0 {
                    return Err(bad("connection record switches", 0));
                }
                RecordReason::Switched(r)
            }
            (code, 0) => {
                let r = u32::try_from(code)
                    .ok()
                    .and_then(FallbackReason::from_code)
                    .ok_or_else(|| bad("connection record reason", code))?;
                if switches != 0 || raw.ring_bytes != 0 {
                    return Err(bad(
                        "connection record switches of a fallback",
                        raw.switches,
                    ));
                }
                RecordReason::Fallback(r)
            }
            (_, code) => return Err(bad("connection record with two reasons", code)),
        };
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
            switches,
            ring_bytes: raw.ring_bytes,
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
            let carried = slot.carried();
            if slot.cas(w, w.next_gen(R_FREE)).unwrap_or(false) {
                // A process killed without closing: its bytes still count.
                self.add_counter(COUNTER_TCP_BYTES, carried);
                n += 1;
            }
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
        for reason in SwitchReason::ALL {
            r.record_switched_conn(m, 9, Proto::Tcp, &t, reason, 77)
                .unwrap();
        }
        (r, m, t)
    }

    #[test]
    fn tcp_bytes_survive_the_release_of_their_record() {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let t = ConnTuple {
            client: "10.0.0.1:1".parse().unwrap(),
            server: "10.0.0.2:2".parse().unwrap(),
        };
        let id = r
            .record_conn(m, 7, Proto::Tcp, &t, FallbackReason::Error)
            .unwrap();
        let (sent, received) = r.conn_bytes(id).unwrap();
        sent.fetch_add(100, Relaxed);
        received.fetch_add(20, Relaxed);
        assert_eq!(r.tcp_bytes(), 120, "a live record counts");
        r.release_conn(id).unwrap();
        assert_eq!(r.tcp_bytes(), 120, "and still after its release, once");
        assert!(r.release_conn(id).is_err());
        assert_eq!(r.tcp_bytes(), 120);
    }

    #[test]
    fn a_switched_record_keeps_its_reason_switches_and_ring_bytes() {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let t = ConnTuple {
            client: "10.0.0.1:1".parse().unwrap(),
            server: "10.0.0.2:2".parse().unwrap(),
        };
        let id = r
            .record_switched_conn(m, 7, Proto::Tcp, &t, SwitchReason::Operator, 1 << 33)
            .unwrap();
        let (sent, _) = r.conn_bytes(id).unwrap();
        sent.fetch_add(5, Relaxed);
        let rec = r.conns().into_iter().find(|c| c.id == id).unwrap();
        assert_eq!(rec.reason, RecordReason::Switched(SwitchReason::Operator));
        assert_eq!(rec.switched(), Some(SwitchReason::Operator));
        assert_eq!(rec.fallback(), None);
        assert_eq!((rec.switches, rec.ring_bytes), (1, 1 << 33));
        assert_eq!((rec.bytes_sent, rec.bytes_received, rec.pid), (5, 0, 7));
        assert!(
            r.switch_counts().iter().all(|&(_, n)| n == 0),
            "a record does not count the switch (the asker does, once per connection)"
        );
        assert_eq!(
            r.fallback_counts().iter().map(|x| x.1).sum::<u64>(),
            0,
            "a switch is not a fallback"
        );
        assert_eq!(rec.reason.name(), "switched_operator");

        let fb = r
            .record_conn(m, 7, Proto::Udp, &t, FallbackReason::Error)
            .unwrap();
        let rec = r.conns().into_iter().find(|c| c.id == fb).unwrap();
        assert_eq!(
            (rec.switched(), rec.fallback()),
            (None, Some(FallbackReason::Error))
        );
        assert_eq!((rec.switches, rec.ring_bytes), (0, 0));

        // Not live: counted, not recorded.
        r.release_conn(id).unwrap();
        let gone = MemberId {
            idx: m.idx,
            gen: m.gen + 1,
        };
        assert!(r
            .record_switched_conn(gone, 7, Proto::Tcp, &t, SwitchReason::Exec, 0)
            .is_none());
    }

    #[test]
    fn corrupt_switch_fields_are_typed_errors() {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let t = ConnTuple {
            client: "10.0.0.1:1".parse().unwrap(),
            server: "10.0.0.2:2".parse().unwrap(),
        };
        let base =
            |off: u64, idx: u32| r.layout.conns_off + idx as u64 * crate::header::CONN_BYTES + off;
        // (field, value, record is a switched one)
        let cases = [
            (O_SWITCH, 0u64, true),      // no reason at all
            (O_SWITCH, 99, true),        // unknown switch code
            (O_SWITCH, 1 << 40, true),   // not even a u8
            (O_SWITCHES, 0, true),       // switched, but never
            (O_SWITCHES, 1 << 32, true), // not a u32
            (O_SWITCH, 2, false),        // two reasons
            (O_SWITCHES, 3, false),      // a fallback that switched
            (O_RING_BYTES, 9, false),    // a fallback that carried ring bytes
        ];
        for (off, v, switched) in cases {
            let id = if switched {
                r.record_switched_conn(m, 1, Proto::Tcp, &t, SwitchReason::Peer, 3)
            } else {
                r.record_conn(m, 1, Proto::Tcp, &t, FallbackReason::Error)
            }
            .unwrap();
            assert!(r.conns().iter().any(|c| c.id == id));
            r.view.u64_at(base(off, id.idx)).unwrap().store(v, SeqCst);
            let slot = r.conn_slot(id.idx).unwrap();
            let raw = slot.read().unwrap();
            let e = r.decode_conn(id, &raw).unwrap_err();
            assert!(matches!(e, RegistryError::Corrupt { .. }), "{off} {v}: {e}");
            assert!(r.conns().iter().all(|c| c.id != id), "{off} {v}: skipped");
            r.release_conn(id).unwrap();
        }
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
            let _ = r.record_switched_conn(m, 1, Proto::Tcp, &t, SwitchReason::Region, 1);
            let _ = r.reclaim(m, m);
            prop_assert!(r.conns().is_empty(), "the only owner left: all released");
        }
    }
}
