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
//! Modules: [`header`] (layout, init/attach), `members`, `endpoints` (open-addressing hash
//! table), `channels` (offer/accept state machine), `markers` (decline markers of transparent
//! TCP), `conns` (records of connections left on TCP), `fallback` (why), `segments` (ring
//! heap), `reclaim`, and `key` (binary encodings). Every value read from the region is validated; garbage yields
//! [`RegistryError::Corrupt`], never a panic.
#![forbid(unsafe_code)]

mod channels;
mod conns;
mod endpoints;
mod error;
mod fallback;
pub mod header;
mod key;
mod markers;
mod members;
mod reclaim;
mod segments;

#[cfg(all(test, loom))]
mod loom_tests;

pub use channels::{ChannelInfo, ChannelRings, ChannelState, Side, SideWords};
pub use conns::{ConnRecord, ConnRecordId};
pub use endpoints::EndpointInfo;
pub use error::RegistryError;
pub use fallback::{
    counter_name, FallbackReason, COUNTER_CONNS_DROPPED, COUNTER_RING_BYTES, COUNTER_RING_CONNS,
};
pub use header::{RegionParams, DEFAULT_RING_CAPACITY};
pub use key::{ChannelId, ConnTuple, EndpointId, EndpointKey, MemberId, Proto, MAX_NATIVE_NAME};
pub use members::{
    net_scope, MemberIdentity, MemberInfo, MemberState, MAX_ADDRESSES, MAX_MEMBER_NAME,
};
pub use memloop_shm::{ShmSlice, ShmU32, ShmU64};
pub use reclaim::ReclaimReport;

use header::Layout;
use memloop_shm::sync::Ordering::Relaxed;

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
    pub segments_used: u64,
    pub segments_total: u64,
}

impl Registry {
    fn w64(&self, off: u64) -> Result<ShmU64, RegistryError> {
        Ok(self.view.u64_at(off)?)
    }
    /// Relaxed load of a data word (published by a state-word CAS or checked seqlock-style).
    fn ld(&self, off: u64) -> Result<u64, RegistryError> {
        Ok(self.view.u64_at(off)?.load(Relaxed))
    }
    fn st(&self, off: u64, v: u64) -> Result<(), RegistryError> {
        self.view.u64_at(off)?.store(v, Relaxed);
        Ok(())
    }
    fn bytes<const N: usize>(&self, off: u64) -> Result<[u8; N], RegistryError> {
        let mut b = [0u8; N];
        self.view.read(off, &mut b)?;
        Ok(b)
    }

    /// Current use of every table.
    pub fn usage(&self) -> Usage {
        Usage {
            members: self.count_members(),
            endpoints: self.count_endpoints(),
            channels: self.count_channels(),
            conns: self.count_conns(),
            segments_used: self.segments_used(),
            segments_total: self.layout.nsegments,
        }
    }
}
