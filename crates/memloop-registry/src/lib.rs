//! The registry in the shared region — memloop's "XenStore": members advertise themselves,
//! listeners publish endpoints, clients offer channels that servers accept, and whoever notices a
//! death reclaims what the dead member held.
//!
//! The region is shared by processes *and* by VMs that share memory but not a kernel, so nothing
//! here uses a process-local lock or a kernel object: every table entry is driven by CAS on a
//! state word that carries a generation counter, ids carry the generation they were issued with,
//! and stale ids fail with [`RegistryError::Stale`]. The crate is pure: no file or process I/O,
//! no clock — liveness decisions and time come from the caller.
//!
//! Modules: [`header`] (layout, init/attach), `state_word` (the packed state + generation word
//! every slot starts with), `tables::{members, endpoints (open-addressing hash table), channels
//! (offer/accept state machine), markers (decline markers of transparent TCP), conns (records
//! of connections left on TCP), pools (zero-copy buffer pools), links (named point-to-point
//! links of `memloop link`), segments (ring heap)}` — each with its slot layout and a typed
//! slot view — `kind` (channel kinds), `fallback` (why a connection stayed on TCP), `reclaim`,
//! and `key` (binary encodings). Every value read from the region is validated; garbage yields
//! [`RegistryError::Corrupt`] (or a more specific typed error), never a panic.
#![forbid(unsafe_code)]

mod decide;
mod error;
mod fallback;
pub mod header;
mod key;
mod kind;
mod reclaim;
mod state_word;
mod switch;
mod tables;

#[cfg(all(test, loom))]
mod loom_tests;

pub use decide::DecideWord;
pub use error::RegistryError;
pub use fallback::{
    counter_name, FallbackReason, COUNTER_CONNS_DROPPED, COUNTER_RING_BYTES, COUNTER_RING_CONNS,
};
pub use header::{RegionParams, RegionState, DEFAULT_REGION_BYTES, DEFAULT_RING_CAPACITY};
pub use key::{ChannelId, ConnTuple, EndpointId, EndpointKey, MemberId, Proto, MAX_NATIVE_NAME};
pub use kind::ChannelKind;
pub use memloop_shm::{ShmSlice, ShmU32, ShmU64};
pub use reclaim::{Leftovers, ReclaimReport};
pub use switch::{
    SwitchReason, SwitchWord, COUNTER_DOORBELLS, COUNTER_FULL_FIRST, COUNTER_LATE_FAILED,
    COUNTER_PIDFD_FAILED, COUNTER_SEGMENTS_GIVEN_BACK, COUNTER_SWITCH_FIRST, COUNTER_WAKE_FALLBACK,
    COUNTER_WINDOWS_GROWN, COUNTER_WINDOWS_NO_ROOM, COUNTER_WINDOWS_SHRUNK,
};
pub use tables::channels::{
    ChannelInfo, ChannelRings, ChannelState, Side, SideWords, INITIAL_WINDOW, PRESSURE_FLOOR,
};
pub use tables::conns::{ConnRecord, ConnRecordId, RecordReason, COUNTER_TCP_BYTES};
pub use tables::endpoints::EndpointInfo;
pub use tables::links::{
    LinkCounters, LinkHalf, LinkHalfDesc, LinkInfo, LinkRef, MAX_LINK_IFNAME, MAX_LINK_NAME,
};
pub use tables::members::{
    net_scope, MemberIdentity, MemberInfo, MemberState, BEAT_LOCKED, BEAT_NONE, MAX_ADDRESSES,
    MAX_MEMBER_NAME,
};
pub use tables::pools::{
    PoolId, PoolInfo, ScanCache, MAX_POOL_BUFFER, MAX_POOL_BUFFERS, POOL_ALIGN,
};

use header::Layout;

/// A handle on the registry of one region. Cheap to clone (a view and the parsed layout).
#[derive(Clone)]
pub struct Registry {
    view: ShmSlice,
    layout: Layout,
}

/// How much of each table is in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub members: u32,
    pub endpoints: u32,
    /// Channel slots in use, decline markers included.
    pub channels: u32,
    /// Connection records in use.
    pub conns: u32,
    /// Buffer pools in use (closing ones included).
    pub pools: u32,
    /// Links in use (half-built and closing ones included).
    pub links: u32,
    pub segments_used: u64,
    pub segments_total: u64,
}

impl Registry {
    /// Current use of every table.
    pub fn usage(&self) -> Usage {
        Usage {
            members: self.count_members(),
            endpoints: self.count_endpoints(),
            channels: self.count_channels(),
            conns: self.count_conns(),
            pools: self.count_pools(),
            links: self.count_links(),
            segments_used: self.segments_used(),
            segments_total: self.layout.nsegments,
        }
    }
}
