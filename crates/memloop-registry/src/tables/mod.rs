//! The registry's tables, one module each. Every table is an array of fixed-size slots that
//! start with a [`StateWord`](crate::state_word::StateWord); a module's typed slot view
//! (`MemberSlot`, `EndpointSlot`, `ChannelSlot`, `ConnSlot`, `PoolSlot`, `LinkSlot`) is the
//! only code that knows the offsets of its fields, and other modules go through it.
//!
//! Views follow the checked-view pattern: `XSlot::new_checked(registry, idx)` validates the
//! index against the table size and the slot against the region once; field accessors are
//! checked against the slot's size, so they cannot reach a neighbour even with a wrong offset.

pub(crate) mod channels;
pub(crate) mod conns;
pub(crate) mod endpoints;
pub(crate) mod index;
pub(crate) mod links;
pub(crate) mod markers;
pub(crate) mod members;
pub(crate) mod pools;
pub(crate) mod segments;

use crate::error::RegistryError;
use crate::state_word::{StateCell, StateWord};
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};
use memloop_shm::{ShmSlice, ShmU32, ShmU64};

/// Declares a table's typed slot view: the struct, `new_checked` against that table and the
/// state-word accessors every table shares. Field accessors stay in the table's own module,
/// the only code that knows its offsets.
macro_rules! slot_view {
    ($(#[$meta:meta])* $name:ident, $table:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name<'a>($crate::tables::Slot<'a>);

        impl<'a> $name<'a> {
            /// `NotFound` if `idx` is outside the table.
            pub fn new_checked(
                r: &'a $crate::Registry,
                idx: u32,
            ) -> Result<Self, $crate::error::RegistryError> {
                $crate::tables::Slot::new_checked(&r.view, r.layout.$table(), idx).map(Self)
            }
            /// Tests only: slots change by CAS.
            #[cfg(all(test, not(loom)))]
            #[allow(dead_code)]
            pub fn state(
                &self,
            ) -> Result<$crate::state_word::StateCell, $crate::error::RegistryError> {
                self.0.state()
            }
            pub fn word(
                &self,
            ) -> Result<$crate::state_word::StateWord, $crate::error::RegistryError> {
                self.0.word()
            }
            pub fn cas(
                &self,
                old: $crate::state_word::StateWord,
                new: $crate::state_word::StateWord,
            ) -> Result<bool, $crate::error::RegistryError> {
                self.0.cas(old, new)
            }
        }
    };
}
pub(crate) use slot_view;

/// Where a table lives in the region.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Table {
    pub off: u64,
    pub slot_bytes: u64,
    pub count: u32,
}

/// One slot of a table, bounds-checked once. It borrows the region (scans visit every slot of
/// a table on connection set-up, so a view that took a reference count per slot or per field
/// would cost more than the scan itself); field accessors check `off + len <= slot_bytes`, so
/// they cannot reach a neighbour even with a wrong offset.
#[derive(Clone, Copy)]
pub(crate) struct Slot<'a> {
    region: &'a ShmSlice,
    base: u64,
    bytes: u64,
    idx: u32,
}

impl<'a> Slot<'a> {
    /// `NotFound` for an index outside the table (ids come from peers and callers).
    pub fn new_checked(
        region: &'a ShmSlice,
        t: Table,
        idx: u32,
    ) -> Result<Slot<'a>, RegistryError> {
        if idx >= t.count {
            return Err(RegistryError::NotFound);
        }
        let base = t.off + idx as u64 * t.slot_bytes;
        // The whole slot must lie in the region: checked here, once.
        region.check_slice(base, t.slot_bytes)?;
        Ok(Slot {
            region,
            base,
            bytes: t.slot_bytes,
            idx,
        })
    }
    pub fn idx(&self) -> u32 {
        self.idx
    }
    /// The region offset of field `off..off+len` of this slot.
    fn at(&self, off: u64, len: u64) -> Result<u64, RegistryError> {
        match off.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(self.base + off),
            _ => Err(memloop_shm::OutOfBounds::Range {
                off,
                len,
                view: self.bytes,
            }
            .into()),
        }
    }
    pub fn state(&self) -> Result<StateCell, RegistryError> {
        Ok(StateCell::new(self.u64(0)?))
    }
    pub fn word(&self) -> Result<StateWord, RegistryError> {
        let a = self.region.atomic_u64(self.at(0, 8)?)?;
        Ok(StateWord::from_raw(a.load(SeqCst)))
    }
    pub fn cas(&self, old: StateWord, new: StateWord) -> Result<bool, RegistryError> {
        Ok(self.state()?.cas(old, new))
    }
    pub fn u64(&self, off: u64) -> Result<ShmU64, RegistryError> {
        Ok(self.region.u64_at(self.at(off, 8)?)?)
    }
    pub fn u32(&self, off: u64) -> Result<ShmU32, RegistryError> {
        Ok(self.region.u32_at(self.at(off, 4)?)?)
    }
    /// Relaxed load of a data word (published by a state-word CAS, or re-checked after).
    pub fn ld(&self, off: u64) -> Result<u64, RegistryError> {
        Ok(self.region.atomic_u64(self.at(off, 8)?)?.load(Relaxed))
    }
    pub fn st(&self, off: u64, v: u64) -> Result<(), RegistryError> {
        self.region.atomic_u64(self.at(off, 8)?)?.store(v, Relaxed);
        Ok(())
    }
    /// SeqCst load of a data word that a CAS protocol of its own decides (a link's half).
    pub fn ld_sc(&self, off: u64) -> Result<u64, RegistryError> {
        Ok(self.region.atomic_u64(self.at(off, 8)?)?.load(SeqCst))
    }
    /// SeqCst CAS of such a data word: whether it was `old` and is now `new`.
    pub fn cas_data(&self, off: u64, old: u64, new: u64) -> Result<bool, RegistryError> {
        let a = self.region.atomic_u64(self.at(off, 8)?)?;
        Ok(a.compare_exchange(old, new, SeqCst, Relaxed).is_ok())
    }
    /// Relaxed add to a data word (statistics, one writer or many).
    pub fn add(&self, off: u64, n: u64) -> Result<(), RegistryError> {
        self.region
            .atomic_u64(self.at(off, 8)?)?
            .fetch_add(n, Relaxed);
        Ok(())
    }
    /// A sub-view of `len` bytes at `off` in this slot (8-aligned), for a record another
    /// crate lays out (e.g. a ring-leave cell).
    pub fn view(&self, off: u64, len: u64) -> Result<ShmSlice, RegistryError> {
        Ok(self.region.slice(self.at(off, len)?, len)?)
    }
    pub fn bytes<const N: usize>(&self, off: u64) -> Result<[u8; N], RegistryError> {
        let mut b = [0u8; N];
        self.region.read(self.at(off, N as u64)?, &mut b)?;
        Ok(b)
    }
    pub fn write(&self, off: u64, b: &[u8]) -> Result<(), RegistryError> {
        Ok(self.region.write(self.at(off, b.len() as u64)?, b)?)
    }
}

/// `n` down on a count word kept as a hint (saturating).
pub(crate) fn step_count_by(w: &ShmU64, n: u64) {
    if n > 0 {
        let _ = w.fetch_update(SeqCst, Relaxed, |v| Some(v.saturating_sub(n)));
    }
}

/// One up or down on a count word kept as a hint (saturating: a count that stays too high
/// only costs scans, one that wrapped below zero would skip them wrongly).
pub(crate) fn step_count(w: &ShmU64, up: bool) {
    let _ = w.fetch_update(SeqCst, Relaxed, |v| {
        Some(if up {
            v.saturating_add(1)
        } else {
            v.saturating_sub(1)
        })
    });
}
