//! Connection records: the connections the transparent layer left on plain TCP (or UDP), with
//! the reason and their byte counts, so `memloop status` can show them next to the channels.
//!
//! Fixed slots, each driven by CAS on its state word `gen << 32 | owner_tag << 8 | state`
//! (FREE → CLAIMED → USED → FREE with generation + 1). The owner writes the fields while
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
use crate::header::CONN_BYTES;
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, unpack_id, ConnTuple, MemberId, Proto,
    TUPLE_BYTES,
};
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, SeqCst};
use memloop_shm::ShmU64;

const R_FREE: u64 = 0;
const R_CLAIMED: u64 = 1;
const R_USED: u64 = 2;

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

fn r_state(w: u64) -> u64 {
    w & 0xff
}
fn r_gen(w: u64) -> u32 {
    (w >> 32) as u32
}
fn r_owner_tag(w: u64) -> u32 {
    ((w >> 8) & 0xff_ffff) as u32
}
fn r_word(gen: u32, owner_tag: u32, state: u64) -> u64 {
    ((gen as u64) << 32) | ((owner_tag as u64 & 0xff_ffff) << 8) | state
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
    fn conn_off(&self, idx: u32) -> u64 {
        self.layout.conns_off + idx as u64 * CONN_BYTES
    }

    fn conn_word(&self, idx: u32) -> Result<ShmU64, RegistryError> {
        if idx >= self.layout.params.max_conns {
            return Err(RegistryError::NotFound);
        }
        self.w64(self.conn_off(idx))
    }

    /// The state word of `id` if the slot still holds that incarnation.
    fn check_conn(&self, id: ConnRecordId) -> Result<u64, RegistryError> {
        let w = self.conn_word(id.idx)?.load(SeqCst);
        if r_gen(w) != id.gen {
            return Err(RegistryError::Stale);
        }
        match r_state(w) {
            R_FREE => Err(RegistryError::NotFound),
            R_CLAIMED | R_USED => Ok(w),
            s => Err(RegistryError::corrupt(
                "connection record state",
                format!("slot {} state {s}", id.idx),
            )),
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
        let Some(id) = self.claim_conn(member) else {
            self.bump_counter(COUNTER_CONNS_DROPPED);
            return None;
        };
        let claimed = r_word(id.gen, member_tag(member), R_CLAIMED);
        let written = self.write_conn(id, member, pid, proto, tuple, reason);
        let slot = self.conn_word(id.idx).ok()?;
        if written.is_err() {
            slot.compare_exchange(
                claimed,
                r_word(id.gen.wrapping_add(1), 0, R_FREE),
                SeqCst,
                Relaxed,
            )
            .ok();
            return None;
        }
        let used = r_word(id.gen, member_tag(member), R_USED);
        // A CAS: a reclaimer that declared us dead meanwhile has freed the slot.
        slot.compare_exchange(claimed, used, SeqCst, Relaxed)
            .ok()
            .map(|_| id)
    }

    fn claim_conn(&self, member: MemberId) -> Option<ConnRecordId> {
        let tag = member_tag(member);
        for idx in 0..self.layout.params.max_conns {
            let Ok(slot) = self.conn_word(idx) else {
                continue;
            };
            let w = slot.load(SeqCst);
            if r_state(w) != R_FREE {
                continue;
            }
            let claimed = r_word(r_gen(w), tag, R_CLAIMED);
            if slot.compare_exchange(w, claimed, SeqCst, Relaxed).is_ok() {
                return Some(ConnRecordId { idx, gen: r_gen(w) });
            }
        }
        None
    }

    fn write_conn(
        &self,
        id: ConnRecordId,
        member: MemberId,
        pid: u32,
        proto: Proto,
        tuple: &ConnTuple,
        reason: FallbackReason,
    ) -> Result<(), RegistryError> {
        let base = self.conn_off(id.idx);
        for (off, v) in [
            (O_OWNER, pack_id(member.idx, member.gen)),
            (O_PID, pid as u64),
            (O_PROTO, proto_code(proto)),
            (O_REASON, reason.as_code() as u64),
            (O_SENT, 0),
            (O_RECEIVED, 0),
        ] {
            self.st(base + off, v)?;
        }
        self.view.write(base + O_TUPLE, &encode_tuple(tuple))?;
        Ok(())
    }

    /// The (sent, received) byte counters of a record; the owner adds with relaxed
    /// `fetch_add`. Like ring views they name the slot: stop using them after `release_conn`.
    pub fn conn_bytes(&self, id: ConnRecordId) -> Result<(ShmU64, ShmU64), RegistryError> {
        self.check_conn(id)?;
        let base = self.conn_off(id.idx);
        Ok((self.w64(base + O_SENT)?, self.w64(base + O_RECEIVED)?))
    }

    /// Frees a record (the connection is closed). Any process holding the id may release it.
    pub fn release_conn(&self, id: ConnRecordId) -> Result<(), RegistryError> {
        let slot = self.conn_word(id.idx)?;
        for _ in 0..RETRIES {
            let w = self.check_conn(id)?;
            let free = r_word(id.gen.wrapping_add(1), 0, R_FREE);
            if slot.compare_exchange(w, free, SeqCst, Relaxed).is_ok() {
                return Ok(());
            }
        }
        Err(RegistryError::corrupt(
            "connection record state",
            "release did not converge",
        ))
    }

    fn read_conn(&self, idx: u32, w: u64) -> Result<Option<RawRecord>, RegistryError> {
        let base = self.conn_off(idx);
        let raw = RawRecord {
            owner: self.ld(base + O_OWNER)?,
            pid: self.ld(base + O_PID)?,
            proto: self.ld(base + O_PROTO)?,
            reason: self.ld(base + O_REASON)?,
            sent: self.ld(base + O_SENT)?,
            received: self.ld(base + O_RECEIVED)?,
            tuple: self.bytes(base + O_TUPLE)?,
        };
        fence(Acquire);
        Ok((self.conn_word(idx)?.load(SeqCst) == w).then_some(raw))
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
            let Ok(w) = self.conn_word(idx).map(|s| s.load(SeqCst)) else {
                continue;
            };
            if r_state(w) != R_USED {
                continue;
            }
            let id = ConnRecordId { idx, gen: r_gen(w) };
            match self
                .read_conn(idx, w)
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
                self.conn_word(i)
                    .map(|s| r_state(s.load(SeqCst)) != R_FREE)
                    .unwrap_or(false)
            })
            .count() as u32
    }

    /// Releases every record (claimed or used) whose owner is not a live member: the member
    /// being reclaimed, and owners declared dead while they were recording. Returns how many.
    pub(crate) fn reclaim_conns(&self) -> u32 {
        let mut n = 0;
        for idx in 0..self.layout.params.max_conns {
            let Ok(slot) = self.conn_word(idx) else {
                continue;
            };
            let w = slot.load(SeqCst);
            if r_state(w) == R_FREE || self.tag_alive(r_owner_tag(w)) {
                continue;
            }
            let free = r_word(r_gen(w).wrapping_add(1), 0, R_FREE);
            n += slot.compare_exchange(w, free, SeqCst, Relaxed).is_ok() as u32;
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn populated() -> (Registry, MemberId, ConnTuple) {
        let (r, m) = crate::members::test_registry_with_member("m");
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
            let len = r.layout.params.max_conns as u64 * CONN_BYTES;
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
