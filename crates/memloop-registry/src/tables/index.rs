//! The offer index: which channel slots hold an offer or a decline marker for one client
//! address (or, for offers without a connection tuple, one endpoint), so that the transparent
//! agreement reads a cache line or two instead of the whole channel table (16,384 slots in the
//! default region).
//!
//! Buckets of eight entries (one cache line) follow the connection records; an entry is 0 or
//! the packed id (slot, generation) of a channel. A publisher inserts its channel into the
//! first free entry of the key's home bucket or one of the next three, *before* the CAS that
//! publishes the offer or marker, and records where in its slot; whoever frees the channel
//! removes the entry (a freer that dies leaves a stale entry: any reader that finds its
//! generation gone clears it). A channel that finds no free entry is counted in a header word
//! instead, and while that count is not zero readers scan the whole table as before.
//!
//! The Dekker argument of the agreement (`markers.rs`) is unchanged: an insert is a SeqCst
//! CAS before the publishing CAS, and a reader reads the entries (and the count) with SeqCst
//! after its fence, so a reader that misses an entry is ordered before the publisher's own
//! scan, which then sees the reader's marker or offer.

use crate::key::{pack_id, unpack_id, ChannelId};
use crate::Registry;
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};
use std::net::{IpAddr, SocketAddr};

/// Entries per bucket (one cache line).
pub(crate) const BUCKET: u64 = 8;
/// Buckets an insert and a lookup look at, from the key's home bucket on.
const PROBE: u64 = 4;
/// The slot's recorded position before any insert (see `Registry::reserve`).
pub(crate) const NOT_INSERTED: u64 = u64::MAX;

/// Buckets for a table of `channels` slots: room for twice as many entries.
pub(crate) fn index_buckets(channels: u32) -> u64 {
    (u64::from(channels) / 4).max(1).next_power_of_two()
}

/// What an offer or a marker is found by.
#[derive(Clone, Copy, Debug)]
pub(crate) enum IndexKey {
    /// The client's address and port of a connection (both ends know it).
    Client(SocketAddr),
    /// The packed endpoint id of an offer without a connection tuple (the native API).
    Endpoint(u64),
}

impl IndexKey {
    fn hash(&self) -> u64 {
        let mut bytes = [0u8; 19];
        match *self {
            IndexKey::Client(a) => {
                let ip = match a.ip().to_canonical() {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                bytes[..16].copy_from_slice(&ip.octets());
                bytes[16..18].copy_from_slice(&a.port().to_le_bytes());
            }
            IndexKey::Endpoint(ep) => {
                bytes[..8].copy_from_slice(&ep.to_le_bytes());
                bytes[18] = 1;
            }
        }
        // FNV-1a: short keys, no attacker choosing them to collide (peers can only make
        // each other scan, never lose an offer).
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

impl Registry {
    fn index_entry(&self, pos: u64) -> Option<&memloop_shm::sync::AtomicU64> {
        let entries = self.layout.index_buckets * BUCKET;
        (pos < entries)
            .then(|| self.view.atomic_u64(self.layout.index_off + 8 * pos).ok())
            .flatten()
    }

    /// Entry positions a key may occupy, home bucket first.
    fn positions(&self, key: IndexKey) -> impl Iterator<Item = u64> {
        let nb = self.layout.index_buckets;
        let home = key.hash() & (nb - 1);
        (0..PROBE.min(nb)).flat_map(move |b| {
            let bucket = (home + b) & (nb - 1);
            (0..BUCKET).map(move |j| bucket * BUCKET + j)
        })
    }

    /// Enters channel `id` under `key`; returns what its slot records: the position + 1, or
    /// 0 when every entry it may take is in use (then counted: readers scan the table).
    pub(crate) fn index_insert(&self, key: IndexKey, id: ChannelId) -> u64 {
        let v = pack_id(id.idx, id.gen);
        for pos in self.positions(key) {
            let Some(e) = self.index_entry(pos) else {
                break;
            };
            if e.load(Relaxed) == 0 && e.compare_exchange(0, v, SeqCst, Relaxed).is_ok() {
                return pos + 1;
            }
        }
        if let Some(w) = self.header_hint(crate::header::H_UNINDEXED) {
            w.fetch_add(1, SeqCst);
        }
        0
    }

    /// Undoes [`Registry::index_insert`] of a freed channel (`recorded` is what its slot held).
    pub(crate) fn index_remove(&self, recorded: u64, id: ChannelId) {
        match recorded {
            NOT_INSERTED => {}
            0 => {
                if let Some(w) = self.header_hint(crate::header::H_UNINDEXED) {
                    crate::tables::step_count_by(&w, 1);
                }
            }
            p => {
                if let Some(e) = self.index_entry(p - 1) {
                    let v = pack_id(id.idx, id.gen);
                    e.compare_exchange(v, 0, SeqCst, Relaxed).ok();
                }
            }
        }
    }

    /// Channel slots that may hold an offer or marker under `key` (the caller checks each):
    /// the key's entries — or every slot while some channel is not in the index.
    pub(crate) fn slots_for(&self, key: IndexKey) -> Vec<u32> {
        let unindexed = self
            .header_hint(crate::header::H_UNINDEXED)
            .map_or(1, |w| w.load(SeqCst));
        if unindexed > 0 {
            return (0..self.layout.params.max_channels).collect();
        }
        let mut out = Vec::new();
        for pos in self.positions(key) {
            let Some(e) = self.index_entry(pos) else {
                break;
            };
            let v = e.load(SeqCst);
            let Some((idx, gen)) = unpack_id(v, self.layout.params.max_channels) else {
                continue;
            };
            match self.channel_word(idx) {
                Ok(w) if w.gen() == gen => out.push(idx),
                // That incarnation is gone and its freer did not clear the entry.
                Ok(_) => drop(e.compare_exchange(v, 0, SeqCst, Relaxed)),
                Err(_) => {}
            }
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn keys_spread_and_one_client_always_hashes_alike() {
        let a: SocketAddr = "10.0.0.1:4000".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:4000".parse().unwrap();
        assert_eq!(IndexKey::Client(a).hash(), IndexKey::Client(mapped).hash());
        let homes: std::collections::HashSet<u64> = (0..1000u16)
            .map(|p| {
                let c = SocketAddr::new(a.ip(), 30000 + p);
                IndexKey::Client(c).hash() & 1023
            })
            .collect();
        assert!(homes.len() > 500, "{} distinct home buckets", homes.len());
        assert_ne!(IndexKey::Endpoint(5).hash(), IndexKey::Client(a).hash());
    }
}
