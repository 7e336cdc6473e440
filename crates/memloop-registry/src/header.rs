//! Region layout: the header page, section offsets, and `init`/`attach`.
//!
//! The layout is a pure function of [`RegionParams`]; `init` records both the parameters and the
//! resulting offsets, and `attach` recomputes the layout from the recorded parameters and insists
//! that every recorded offset matches and fits the mapping. After that, every table access is a
//! bounds-checked view access at an offset derived from validated numbers.
//!
//! | offset | header field (all u64) |
//! | --- | --- |
//! | 0 | magic (written last, release) |
//! | 8 | layout version · 16 region size · 24 generation |
//! | 32..56 | max members, max endpoints, max channels, segment size |
//! | 64..104 | nsegments, members, endpoints, channels, segment tags, heap offsets |
//! | 112, 120 | channel creation counter, join counter |
//! | 128..384 | 32 global counters (fallback reasons etc.) |
//! | 384, 392 | max connection records, connections offset · 400 decline markers published |
//! | 408 | region state: 0 open, 1 paused, 2 being destroyed ([`RegionState`]) |
//! | 1024..1280 | global counters 32..64 |
//! | 1280..2304 | 256 kick lanes (u32): a member's heartbeat thread sleeps on lane `idx % 256` |
//! | 2304, 2312 | max buffer pools, pools offset |
//! | 2320, 2328 | max links, links offset (`tables/links.rs`) |
//!
//! Versions: 2 added connection records; 3 added the channel kind to channel slots and grew the
//! counters to 32 (fallback causes); 4 grew them to 64 (a second block; the fallback reason
//! `paused` moved the counters after the fallback reasons); 5 added the offer index (tuple →
//! channel) and the segment tags' free-but-reserved state; 6 to 8 are listed at [`VERSION`];
//! 9 added the buffer pools, 10 the links table. Nothing older is migrated: regions are cheap
//! to recreate.

use crate::error::RegistryError;
use crate::tables::Table;
use crate::Registry;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use memloop_shm::{ShmSlice, ShmU32, ShmU64};

/// "MLREGN01", little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MLREGN01");
/// Layout version; bump on any incompatible change (2: connection records, 3: channel kinds
/// and 32 counters, 4: 64 counters, 5: the offer index and free-but-reserved segment tags,
/// 6: endpoint keys hashed a word at a time, the endpoint's hand-back count, 7: the
/// heartbeat word's flags `BEAT_LOCKED` / `BEAT_NONE`, 8: a channel's first-close and
/// decision words — a server no longer rings an accept doorbell nobody asked for, 9: the
/// buffer pools of zero-copy channels, 10: the links table).
pub const VERSION: u32 = 10;
/// Bytes reserved for the header (one page; small under loom to keep the model tractable).
pub const HEADER_BYTES: u64 = if cfg!(loom) { 512 } else { 4096 };
/// Number of global counters in the header (two blocks of 32).
pub const NCOUNTERS: usize = 64;
/// Default ring capacity per direction.
pub const DEFAULT_RING_CAPACITY: u64 = 1 << 20;

pub(crate) const MEMBER_BYTES: u64 = 256;
pub(crate) const ENDPOINT_BYTES: u64 = 128;
pub(crate) const CHANNEL_BYTES: u64 = 320;
pub(crate) const CONN_BYTES: u64 = 128;
pub(crate) const POOL_BYTES: u64 = 128;
pub(crate) const LINK_BYTES: u64 = 512;
/// Member slots are tagged with 12 bits of index elsewhere.
pub const MAX_MEMBERS: u32 = 4095;
const MAX_TABLE: u32 = 1 << 24;

const H_MAGIC: u64 = 0;
const H_VERSION: u64 = 8;
const H_SIZE: u64 = 16;
const H_GEN: u64 = 24;
const H_MEMBERS: u64 = 32;
const H_ENDPOINTS: u64 = 40;
const H_CHANNELS: u64 = 48;
const H_SEGSIZE: u64 = 56;
const H_NSEG: u64 = 64;
const H_OFFSETS: u64 = 72; // five offsets
pub(crate) const H_CREATE_SEQ: u64 = 112;
pub(crate) const H_JOIN_SEQ: u64 = 120;
const H_COUNTERS: u64 = 128;
/// The second block of counters (beyond the loom model's small header: not counted there).
const H_COUNTERS2: u64 = 1024;
const COUNTER_BLOCK: usize = 32;
const H_CONNS: u64 = H_COUNTERS + 8 * COUNTER_BLOCK as u64;
const H_CONNS_OFF: u64 = H_CONNS + 8;
/// Decline markers currently published: lets a client skip the marker scan when there are
/// none (see `markers.rs` for why that keeps the Dekker guarantee).
pub(crate) const H_MARKERS: u64 = H_CONNS + 16;
/// The region's [`RegionState`] (0 in regions made before it existed: open).
const H_STATE: u64 = H_MARKERS + 8;
/// Offers currently OFFERED, to any endpoint: lets a server skip its offer scans when there
/// are none (the Dekker argument of `H_MARKERS`, the other way round). Zero in regions made
/// before it: a server there misses offers of clients built before it (they fall back).
pub(crate) const H_OFFERS: u64 = H_STATE + 8;
/// Where the next search for a free channel slot, connection record and ring segment starts
/// (next fit: with thousands of live entries a search from slot 0 would walk all of them).
/// Hints only: any value is safe, a stale one costs a longer search.
pub(crate) const H_CHANNEL_HINT: u64 = H_OFFERS + 8;
pub(crate) const H_CONN_HINT: u64 = H_CHANNEL_HINT + 8;
pub(crate) const H_SEGMENT_HINT: u64 = H_CONN_HINT + 8;
/// Ring segments owned by channels (a count kept as a hint: ring sizes under pressure).
pub(crate) const H_SEGMENTS_USED: u64 = H_SEGMENT_HINT + 8;
/// When a member last looked for the dead on everyone's behalf (ms of CLOCK_REALTIME): one
/// sweep a second for the region, not one per member.
pub(crate) const H_SWEPT_AT: u64 = H_SEGMENTS_USED + 8;
/// Bumped whenever a member joins, leaves, is reclaimed or changes its addresses: a cache of
/// "who owns this address" is good while it has not moved.
pub(crate) const H_MEMBERSHIP: u64 = H_SWEPT_AT + 8;
/// Channels published without an entry in the offer index (`tables/index.rs`): while not
/// zero, readers scan the channel table.
pub(crate) const H_UNINDEXED: u64 = H_MEMBERSHIP + 8;
/// Member clients that may look for a server's decline marker (a late ring, `markers.rs`):
/// while none does, a server whose accepted connection came with neither an offer nor an
/// announced connect knows its client runs without the library, and publishes no marker.
/// Zero in regions made before it: a server there publishes none for such clients either,
/// and a client of an older build that falls back stays on TCP.
pub(crate) const H_LATE_CLIENTS: u64 = H_UNINDEXED + 8;
/// Bumped after every endpoint added and every move of the membership: "no member socket is
/// bound at this address" stands while it has not moved — a sender's negative cache.
pub(crate) const H_ENDPOINTS_EPOCH: u64 = H_LATE_CLIENTS + 8;
/// One more than the highest channel slot a descriptor pair was ever built in (a hint, only
/// raised): a pool's scan of the channel kinds stops there.
pub(crate) const H_DESC_HIGH: u64 = H_ENDPOINTS_EPOCH + 8;
/// Bumped after each descriptor channel is offered: a pool owner's cached list of them
/// (`tables/pools.rs`, `ScanCache`) stands while it has not moved.
pub(crate) const H_DESC_EPOCH: u64 = H_DESC_HIGH + 8;
const _: () = assert!(H_DESC_EPOCH + 8 <= HEADER_BYTES);
const _: () = assert!(H_DESC_EPOCH + 8 <= H_COUNTERS2);
const _: () = assert!(cfg!(loom) || H_COUNTERS2 + 8 * COUNTER_BLOCK as u64 <= HEADER_BYTES);
/// Kick lanes: a futex word per lane, bumped to wake a member's heartbeat early (zero and
/// unused in regions made before them: a member there only beats on its period).
const H_KICKS: u64 = H_COUNTERS2 + 8 * COUNTER_BLOCK as u64;
const KICK_LANES: u32 = 256;
const _: () = assert!(cfg!(loom) || H_KICKS + 4 * KICK_LANES as u64 <= HEADER_BYTES);
/// The pools table's size and offset (beyond the loom model's header: read as none there).
const H_POOLS: u64 = H_KICKS + 4 * KICK_LANES as u64;
const H_POOLS_OFF: u64 = H_POOLS + 8;
/// The links table's size and offset (beyond the loom model's header too: one link there).
const H_LINKS: u64 = H_POOLS_OFF + 8;
const H_LINKS_OFF: u64 = H_LINKS + 8;
const _: () = assert!(cfg!(loom) || H_LINKS_OFF + 8 <= HEADER_BYTES);

/// Where global counter `i` lives in the header (none: beyond the loom model's header).
fn counter_off(i: usize) -> Option<u64> {
    match i {
        _ if i < COUNTER_BLOCK => Some(H_COUNTERS + 8 * i as u64),
        _ if i < NCOUNTERS && !cfg!(loom) => Some(H_COUNTERS2 + 8 * (i - COUNTER_BLOCK) as u64),
        _ => None,
    }
}

/// Whether a region takes new ring connections. An operator pauses a region (or starts to
/// destroy it) to move every connection off its rings: new connections stay on TCP, live
/// ones are demoted by the processes holding them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionState {
    Open,
    Paused,
    /// `memloop region destroy` is under way: the file is about to be removed.
    Destroying,
}

impl RegionState {
    fn code(self) -> u64 {
        match self {
            Self::Open => 0,
            Self::Paused => 1,
            Self::Destroying => 2,
        }
    }

    /// Unknown codes (a newer writer, or a corrupt word) read as paused: never a ring on doubt.
    fn from_code(c: u64) -> Self {
        match c {
            0 => Self::Open,
            2 => Self::Destroying,
            _ => Self::Paused,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Paused => "paused",
            Self::Destroying => "destroying",
        }
    }
}

/// Sizes of a region, chosen at init and recorded in its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionParams {
    pub size: u64,
    pub max_members: u32,
    pub max_endpoints: u32,
    pub max_channels: u32,
    pub segment_size: u64,
    /// Slots for records of connections that took the plain-TCP path (`memloop status`).
    pub max_conns: u32,
    /// Buffer pools of zero-copy channels, region-wide.
    pub max_pools: u32,
    /// Named point-to-point links (`memloop link`), region-wide.
    pub max_links: u32,
}

impl Default for RegionParams {
    /// The default region: 2 GiB of address space (a sparse file: memory is taken only as rings
    /// are used), tables for a real host (see [`RegionParams::for_size`]).
    fn default() -> Self {
        Self::for_size(DEFAULT_REGION_BYTES)
    }
}

/// Size of the default region.
pub const DEFAULT_REGION_BYTES: u64 = 2 << 30;

impl RegionParams {
    /// Tables in proportion to a region of `size` bytes: a channel slot, an endpoint and a
    /// connection record per 128 KiB (at most 16,384 each; at least 64), a member and a
    /// buffer pool per 16 channels (64 to 1,024), 64 links, 4 KiB ring segments. The default
    /// 2 GiB region gets 1,024 members and 16,384 channels, endpoints and records: ~14 MiB of
    /// tables, reserved at creation; a 64 MiB region ~1 MiB.
    pub fn for_size(size: u64) -> Self {
        let per = |bytes: u64, lo: u64, hi: u64| (size / bytes).clamp(lo, hi) as u32;
        let channels = per(128 << 10, 64, 16_384);
        Self {
            size,
            max_members: (channels / 16).clamp(64, 1024),
            max_endpoints: channels,
            max_channels: channels,
            segment_size: 4096,
            max_conns: channels,
            max_pools: (channels / 16).clamp(64, 1024),
            max_links: 64,
        }
    }

    /// The same tables for another size, or the tables for that size if these are the ones
    /// [`RegionParams::for_size`] chose for ours (a device's size is known only when it is
    /// opened).
    pub fn resized(&self, size: u64) -> Self {
        if *self == Self::for_size(self.size) {
            Self::for_size(size)
        } else {
            Self { size, ..*self }
        }
    }

    /// Small tables for a region of `size` bytes (tests, tiny regions).
    pub fn small(size: u64) -> Self {
        Self {
            size,
            max_members: 16,
            max_endpoints: 64,
            max_channels: 32,
            segment_size: 4096,
            max_conns: 32,
            max_pools: 16,
            max_links: 16,
        }
    }

    /// Checks the parameters and that the layout leaves at least one ring segment.
    pub fn validate(&self) -> Result<(), RegistryError> {
        Layout::compute(self).map(|_| ())
    }
}

/// Where everything is; derived from [`RegionParams`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub params: RegionParams,
    pub nsegments: u64,
    pub members_off: u64,
    pub endpoints_off: u64,
    pub channels_off: u64,
    pub conns_off: u64,
    /// Buffer pools (`tables/pools.rs`), after the connection records.
    pub pools_off: u64,
    /// Links (`tables/links.rs`), after the pools.
    pub links_off: u64,
    /// A byte per channel slot: the kind of the channel last built in it (see
    /// `Registry::note_kind`), so a pool's scan finds descriptor channels without reading
    /// every channel slot. After the links.
    pub kinds_off: u64,
    /// The offer index (`tables/index.rs`), between the connection records and the tags.
    pub index_off: u64,
    pub index_buckets: u64,
    pub tags_off: u64,
    pub heap_off: u64,
}

fn bad(msg: String) -> RegistryError {
    RegistryError::InvalidParams(msg)
}

impl Layout {
    pub fn compute(p: &RegionParams) -> Result<Layout, RegistryError> {
        if p.max_members == 0 || p.max_members > MAX_MEMBERS {
            return Err(bad(format!(
                "max_members {} not in 1..={MAX_MEMBERS}",
                p.max_members
            )));
        }
        for (n, what) in [
            (p.max_endpoints, "max_endpoints"),
            (p.max_channels, "max_channels"),
            (p.max_conns, "max_conns"),
            (p.max_pools, "max_pools"),
            (p.max_links, "max_links"),
        ] {
            if n == 0 || n > MAX_TABLE {
                return Err(bad(format!("{what} {n} not in 1..={MAX_TABLE}")));
            }
        }
        if !p.segment_size.is_power_of_two() || !(256..=1 << 30).contains(&p.segment_size) {
            return Err(bad(format!(
                "segment_size {} is not a power of two in 256..=1GiB",
                p.segment_size
            )));
        }
        let members_off = HEADER_BYTES;
        let endpoints_off = members_off + p.max_members as u64 * MEMBER_BYTES;
        let channels_off = endpoints_off + p.max_endpoints as u64 * ENDPOINT_BYTES;
        let conns_off = channels_off + p.max_channels as u64 * CHANNEL_BYTES;
        let pools_off = conns_off + p.max_conns as u64 * CONN_BYTES;
        let links_off = pools_off + p.max_pools as u64 * POOL_BYTES;
        let kinds_off = links_off + p.max_links as u64 * LINK_BYTES;
        let index_off = kinds_off + (p.max_channels as u64).div_ceil(8) * 8;
        let index_buckets = crate::tables::index::index_buckets(p.max_channels);
        let tags_off = index_off + index_buckets * crate::tables::index::BUCKET * 8;
        let too_small = || {
            bad(format!(
                "region of {} bytes has no room for ring segments",
                p.size
            ))
        };
        let rest = p.size.checked_sub(tags_off).ok_or_else(too_small)?;
        let max_segs = rest / p.segment_size;
        let align = p.segment_size.min(4096);
        let heap_off = (tags_off + max_segs * 8).div_ceil(align) * align;
        let nsegments = p.size.checked_sub(heap_off).ok_or_else(too_small)? / p.segment_size;
        if nsegments == 0 {
            return Err(too_small());
        }
        Ok(Layout {
            params: *p,
            nsegments,
            members_off,
            endpoints_off,
            channels_off,
            conns_off,
            pools_off,
            links_off,
            kinds_off,
            index_off,
            index_buckets,
            tags_off,
            heap_off,
        })
    }

    pub fn members(&self) -> Table {
        Table {
            off: self.members_off,
            slot_bytes: MEMBER_BYTES,
            count: self.params.max_members,
        }
    }
    pub fn endpoints(&self) -> Table {
        Table {
            off: self.endpoints_off,
            slot_bytes: ENDPOINT_BYTES,
            count: self.params.max_endpoints,
        }
    }
    pub fn channels(&self) -> Table {
        Table {
            off: self.channels_off,
            slot_bytes: CHANNEL_BYTES,
            count: self.params.max_channels,
        }
    }
    pub fn conns(&self) -> Table {
        Table {
            off: self.conns_off,
            slot_bytes: CONN_BYTES,
            count: self.params.max_conns,
        }
    }
    pub fn pools(&self) -> Table {
        Table {
            off: self.pools_off,
            slot_bytes: POOL_BYTES,
            count: self.params.max_pools,
        }
    }
    pub fn links(&self) -> Table {
        Table {
            off: self.links_off,
            slot_bytes: LINK_BYTES,
            count: self.params.max_links,
        }
    }

    pub fn heap_end(&self) -> u64 {
        self.heap_off + self.nsegments * self.params.segment_size
    }

    fn offsets(&self) -> [u64; 5] {
        [
            self.members_off,
            self.endpoints_off,
            self.channels_off,
            self.tags_off,
            self.heap_off,
        ]
    }
}

/// [`ShmSlice::commit`]'s error as ours: no room is a full region.
pub(crate) fn no_room(e: memloop_shm::CommitError) -> RegistryError {
    match e {
        memloop_shm::CommitError::OutOfBounds(e) => RegistryError::Shm(e),
        memloop_shm::CommitError::NoRoom(_) => RegistryError::RegionFull {
            what: "memory in the file system behind the region",
        },
    }
}

impl Registry {
    /// Lays out a fresh region in `view` (zeroed memory, or a region being re-initialised: the
    /// tables are cleared and the generation bumped). The magic is written last, with release,
    /// so a concurrent `attach` sees either nothing or a complete header.
    pub fn init(view: ShmSlice, params: &RegionParams) -> Result<Registry, RegistryError> {
        let layout = Layout::compute(params)?;
        let actual = view.len() as u64;
        if params.size > actual {
            return Err(RegistryError::SizeMismatch {
                header: params.size,
                actual,
            });
        }
        // The tables' memory first (a sparse file on a full file system would SIGBUS below).
        view.commit(0, layout.heap_off).map_err(no_room)?;
        let magic = view.u64_at(H_MAGIC)?;
        let old_gen = if magic.load(Acquire) == MAGIC {
            view.u64_at(H_GEN)?.load(Relaxed)
        } else {
            0
        };
        magic.store(0, SeqCst);
        if old_gen != 0 || !cfg!(loom) {
            // Fresh loom models are zero already; filling would only add modelled accesses.
            view.fill(0, layout.heap_off, 0)?;
        }
        let words = [
            (H_VERSION, VERSION as u64),
            (H_SIZE, params.size),
            (H_GEN, old_gen.wrapping_add(1)),
            (H_MEMBERS, params.max_members as u64),
            (H_ENDPOINTS, params.max_endpoints as u64),
            (H_CHANNELS, params.max_channels as u64),
            (H_SEGSIZE, params.segment_size),
            (H_NSEG, layout.nsegments),
            (H_CONNS, params.max_conns as u64),
            (H_CONNS_OFF, layout.conns_off),
        ];
        for (off, v) in words {
            view.u64_at(off)?.store(v, Relaxed);
        }
        if !cfg!(loom) {
            view.u64_at(H_POOLS)?
                .store(params.max_pools as u64, Relaxed);
            view.u64_at(H_POOLS_OFF)?.store(layout.pools_off, Relaxed);
            view.u64_at(H_LINKS)?
                .store(params.max_links as u64, Relaxed);
            view.u64_at(H_LINKS_OFF)?.store(layout.links_off, Relaxed);
        }
        for (i, v) in layout.offsets().into_iter().enumerate() {
            view.u64_at(H_OFFSETS + 8 * i as u64)?.store(v, Relaxed);
        }
        magic.store(MAGIC, Release);
        tracing::debug!(
            size = params.size,
            nsegments = layout.nsegments,
            "registry region initialised"
        );
        Ok(Registry { view, layout })
    }

    /// Attaches to an initialised region, validating the header against the mapping.
    pub fn attach(view: ShmSlice) -> Result<Registry, RegistryError> {
        let found = view.u64_at(H_MAGIC)?.load(Acquire);
        match found {
            0 => return Err(RegistryError::NotInitialised),
            MAGIC => {}
            _ => return Err(RegistryError::BadMagic { found }),
        }
        let rd = |off: u64| view.u64_at(off).map(|w| w.load(Relaxed));
        let version = rd(H_VERSION)?;
        if version != VERSION as u64 {
            let found = u32::try_from(version).unwrap_or(u32::MAX);
            return Err(RegistryError::BadVersion {
                found,
                expected: VERSION,
            });
        }
        let size = rd(H_SIZE)?;
        let actual = view.len() as u64;
        if size > actual {
            return Err(RegistryError::SizeMismatch {
                header: size,
                actual,
            });
        }
        let layout = Self::recorded_layout(&view, size)?;
        Ok(Registry { view, layout })
    }

    fn recorded_layout(view: &ShmSlice, size: u64) -> Result<Layout, RegistryError> {
        let rd = |off: u64| view.u64_at(off).map(|w| w.load(Relaxed));
        let small = |off: u64| -> Result<u32, RegistryError> {
            let v = rd(off)?;
            u32::try_from(v)
                .map_err(|_| RegistryError::corrupt("header", format!("table size {v}")))
        };
        let params = RegionParams {
            size,
            max_members: small(H_MEMBERS)?,
            max_endpoints: small(H_ENDPOINTS)?,
            max_channels: small(H_CHANNELS)?,
            segment_size: rd(H_SEGSIZE)?,
            max_conns: small(H_CONNS)?,
            // (The loom models' header has no room for these: their regions have one pool
            // and one link.)
            max_pools: match cfg!(loom) {
                true => 1,
                false => small(H_POOLS)?,
            },
            max_links: match cfg!(loom) {
                true => 1,
                false => small(H_LINKS)?,
            },
        };
        let layout = Layout::compute(&params)
            .map_err(|e| RegistryError::corrupt("header", e.to_string()))?;
        let mut recorded = [0u64; 5];
        for (i, r) in recorded.iter_mut().enumerate() {
            *r = rd(H_OFFSETS + 8 * i as u64)?;
        }
        let (nseg, conns_off) = (rd(H_NSEG)?, rd(H_CONNS_OFF)?);
        let (pools_off, links_off) = match cfg!(loom) {
            true => (layout.pools_off, layout.links_off),
            false => (rd(H_POOLS_OFF)?, rd(H_LINKS_OFF)?),
        };
        if recorded != layout.offsets()
            || conns_off != layout.conns_off
            || pools_off != layout.pools_off
            || links_off != layout.links_off
            || nseg != layout.nsegments
            || layout.heap_end() > size
        {
            let detail = format!(
                "recorded offsets {recorded:?}+{conns_off}/{nseg} segments, expected {:?}+{}/{}",
                layout.offsets(),
                layout.conns_off,
                layout.nsegments
            );
            return Err(RegistryError::corrupt("header", detail));
        }
        Ok(layout)
    }

    /// The parameters recorded in the header.
    pub fn params(&self) -> RegionParams {
        self.layout.params
    }

    /// Number of ring segments in the heap.
    pub fn nsegments(&self) -> u64 {
        self.layout.nsegments
    }

    /// Bytes of header and tables in front of the ring heap.
    pub fn metadata_len(&self) -> u64 {
        self.layout.heap_off
    }

    /// Bumped on every re-initialisation of the region.
    pub fn generation(&self) -> u64 {
        self.view
            .u64_at(H_GEN)
            .map(|w| w.load(Acquire))
            .unwrap_or(0)
    }

    /// Whether the region takes ring connections (one shared load).
    pub fn state(&self) -> RegionState {
        self.view.u64_at(H_STATE).map_or(RegionState::Paused, |w| {
            RegionState::from_code(w.load(Acquire))
        })
    }

    /// The word a member's heartbeat sleeps on (shared by members whose index is equal modulo
    /// the lane count: a kick may wake another one too). `None` beyond the loom model's header.
    pub fn kick_lane(&self, member_idx: u32) -> Option<ShmU32> {
        let off = H_KICKS + 4 * u64::from(member_idx % KICK_LANES);
        self.view.u32_at(off).ok()
    }

    /// Sets the region's state; returns the one before.
    pub fn set_state(&self, s: RegionState) -> Result<RegionState, RegistryError> {
        let old = self.view.u64_at(H_STATE)?.swap(s.code(), SeqCst);
        Ok(RegionState::from_code(old))
    }

    /// The whole region.
    pub fn view(&self) -> &ShmSlice {
        &self.view
    }

    /// Adds `n` to global counter `i` (ignored if `i >= NCOUNTERS`).
    pub fn add_counter(&self, i: usize, n: u64) {
        if let Some(off) = counter_off(i) {
            if let Ok(w) = self.view.u64_at(off) {
                w.fetch_add(n, Relaxed);
            }
        }
    }

    /// Adds one to global counter `i` (ignored if `i >= NCOUNTERS`).
    pub fn bump_counter(&self, i: usize) {
        self.add_counter(i, 1);
    }

    /// Next-fit search of a table of `n` slots: `claim(idx)` from the slot after the last one
    /// claimed (kept in the header word at `hint_off`), wrapping once. With thousands of live
    /// entries a search from slot 0 would walk past all of them at every claim.
    pub(crate) fn next_fit<T>(
        &self,
        hint_off: u64,
        n: u32,
        mut claim: impl FnMut(u32) -> Option<T>,
    ) -> Option<T> {
        let hint = self.header_hint(hint_off);
        let from = hint
            .as_ref()
            .map_or(0, |h| (h.load(Relaxed) % n as u64) as u32);
        let (idx, found) = (from..n)
            .chain(0..from)
            .find_map(|idx| claim(idx).map(|t| (idx, t)))?;
        if let Some(h) = hint {
            h.store(u64::from(idx + 1) % n as u64, Relaxed);
        }
        Some(found)
    }

    /// Whether the caller should sweep the region for the dead now, on everyone's behalf: true
    /// for one caller per `period` (wall clock, shared by every kernel on the region; a clock
    /// that went back more than ten periods counts as due). With a thousand members, a sweep
    /// by each of them every second would read a thousand `/proc` entries a thousand times.
    pub fn take_sweep_turn(&self, period: std::time::Duration) -> bool {
        let Some(w) = self.header_hint(crate::header::H_SWEPT_AT) else {
            return true;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let period = period.as_millis() as u64;
        let last = w.load(Relaxed);
        let due = now >= last.saturating_add(period) || now.saturating_add(10 * period) < last;
        due && w.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
    }

    /// A table was found full: counted by which (`members`, `endpoints`, `channels`, `ring
    /// memory`), then the error.
    pub(crate) fn full(&self, what: &'static str) -> RegistryError {
        let tables = crate::switch::FULL_TABLES;
        if let Some(i) = tables.iter().position(|&n| n == what) {
            self.bump_counter(crate::switch::COUNTER_FULL_FIRST + i);
        }
        RegistryError::RegionFull { what }
    }

    /// A header word kept as a hint (search starts, counts); `None` if it cannot be reached.
    pub(crate) fn header_hint(&self, off: u64) -> Option<ShmU64> {
        self.view.u64_at(off).ok()
    }

    /// All global counters.
    pub fn counters(&self) -> Vec<u64> {
        (0..NCOUNTERS)
            .map(|i| {
                counter_off(i)
                    .and_then(|off| self.view.u64_at(off).ok())
                    .map(|w| w.load(Relaxed))
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Next value of a header sequence counter (channel creation, joins).
    pub(crate) fn next_seq(&self, off: u64) -> Result<u64, RegistryError> {
        Ok(self.view.u64_at(off)?.fetch_add(1, Relaxed).wrapping_add(1))
    }
}
