//! The registry's tables, one module each. Every table is an array of fixed-size slots that
//! start with a [`StateWord`](crate::state_word::StateWord); a module's typed slot view
//! (`MemberSlot`, `EndpointSlot`, `ChannelSlot`, `ConnSlot`) is the only code that knows the
//! offsets of its fields, and other modules go through it.
//!
//! Views follow the checked-view pattern: `XSlot::new_checked(registry, idx)` validates the
//! index against the table size once and cuts the slot's bytes out of the region, so field
//! accessors work on a slot-sized view and cannot reach a neighbour even with a wrong offset.

pub(crate) mod channels;
pub(crate) mod conns;
pub(crate) mod endpoints;
pub(crate) mod markers;
pub(crate) mod members;
pub(crate) mod segments;

use crate::error::RegistryError;
use crate::state_word::{StateCell, StateWord};
use memloop_shm::sync::Ordering::Relaxed;
use memloop_shm::{ShmSlice, ShmU32, ShmU64};

/// Where a table lives in the region.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Table {
    pub off: u64,
    pub slot_bytes: u64,
    pub count: u32,
}

/// The bytes of one slot, bounds-checked once.
#[derive(Clone)]
pub(crate) struct Slot {
    view: ShmSlice,
    idx: u32,
}

impl Slot {
    /// `NotFound` for an index outside the table (ids come from peers and callers).
    pub fn new_checked(region: &ShmSlice, t: Table, idx: u32) -> Result<Slot, RegistryError> {
        if idx >= t.count {
            return Err(RegistryError::NotFound);
        }
        let view = region.slice(t.off + idx as u64 * t.slot_bytes, t.slot_bytes)?;
        Ok(Slot { view, idx })
    }
    pub fn idx(&self) -> u32 {
        self.idx
    }
    pub fn state(&self) -> Result<StateCell, RegistryError> {
        Ok(StateCell::new(self.view.u64_at(0)?))
    }
    pub fn word(&self) -> Result<StateWord, RegistryError> {
        Ok(self.state()?.load())
    }
    pub fn cas(&self, old: StateWord, new: StateWord) -> Result<bool, RegistryError> {
        Ok(self.state()?.cas(old, new))
    }
    pub fn u64(&self, off: u64) -> Result<ShmU64, RegistryError> {
        Ok(self.view.u64_at(off)?)
    }
    pub fn u32(&self, off: u64) -> Result<ShmU32, RegistryError> {
        Ok(self.view.u32_at(off)?)
    }
    /// Relaxed load of a data word (published by a state-word CAS, or re-checked after).
    pub fn ld(&self, off: u64) -> Result<u64, RegistryError> {
        Ok(self.view.u64_at(off)?.load(Relaxed))
    }
    pub fn st(&self, off: u64, v: u64) -> Result<(), RegistryError> {
        self.view.u64_at(off)?.store(v, Relaxed);
        Ok(())
    }
    pub fn bytes<const N: usize>(&self, off: u64) -> Result<[u8; N], RegistryError> {
        let mut b = [0u8; N];
        self.view.read(off, &mut b)?;
        Ok(b)
    }
    pub fn write(&self, off: u64, b: &[u8]) -> Result<(), RegistryError> {
        Ok(self.view.write(off, b)?)
    }
}
