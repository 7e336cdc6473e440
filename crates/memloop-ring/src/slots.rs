//! Slot rings: fixed-size entries, e.g. a descriptor ring and its completion ring (zero-copy).
//!
//! Indices still count bytes and advance by whole slots, so the shared header and its
//! validation are those of the other flavours (plus: indices must be multiples of the slot).
//! Batch operations copy several slots and publish once.

use crate::header::RingKind;
use crate::index::{copy_in, copy_out, ConsCore, ProdCore};
use crate::wait::WaitPolicy;
use crate::{Descriptor, RingError};
use memloop_shm::ShmSlice;
use std::time::Duration;

fn check_len(len: usize, slot: u32) -> Result<(), RingError> {
    if len as u64 != slot as u64 {
        return Err(RingError::SlotSize {
            len: len as u64,
            slot_size: slot,
        });
    }
    Ok(())
}

/// Producing end of a slot ring.
#[derive(Debug)]
pub struct SlotProducer {
    core: ProdCore,
}

impl SlotProducer {
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        let slot = Self::slot_of(&view)?;
        Ok(SlotProducer {
            core: ProdCore::attach(&view, RingKind::Slots, slot)?,
        })
    }

    /// Reads the slot size for the granule; Header::attach validates it properly afterwards.
    fn slot_of(view: &ShmSlice) -> Result<u64, RingError> {
        Ok(crate::header::Header::attach(view, RingKind::Slots)?.slot_size as u64)
    }

    pub fn slot_size(&self) -> u32 {
        self.core.h.slot_size
    }

    /// Number of slots in the ring.
    pub fn slots(&self) -> u64 {
        self.core.cap() / self.slot_size() as u64
    }

    /// Free slots right now.
    pub fn free_slots(&mut self) -> Result<u64, RingError> {
        Ok(self.core.refresh()? / self.slot_size() as u64)
    }

    /// Pushes one slot (`slot` must be exactly `slot_size` bytes); `Ok(false)` if full.
    pub fn push(&mut self, slot: &[u8]) -> Result<bool, RingError> {
        Ok(self.push_batch(&[slot])? == 1)
    }

    /// Pushes as many of `slots` as fit, publishing once; returns how many were pushed.
    pub fn push_batch(&mut self, slots: &[&[u8]]) -> Result<usize, RingError> {
        self.core.check_open()?;
        let size = self.slot_size() as u64;
        slots
            .iter()
            .try_for_each(|s| check_len(s.len(), self.slot_size()))?;
        let fit = (self.core.free_for(size * slots.len() as u64)? / size).min(slots.len() as u64);
        for (i, s) in slots[..fit as usize].iter().enumerate() {
            let idx = self.core.tail.wrapping_add(i as u64 * size);
            copy_in(&self.core.h.data, self.core.cap(), idx, s)?;
        }
        if fit > 0 {
            self.core.publish(fit * size);
        }
        Ok(fit as usize)
    }

    /// Pushes one descriptor (the ring's slot size must be [`Descriptor::SIZE`]).
    pub fn push_desc(&mut self, d: &Descriptor) -> Result<bool, RingError> {
        self.push(&d.encode())
    }

    pub fn shutdown(&mut self) {
        self.core.shutdown();
    }

    pub fn reader_closed(&self) -> bool {
        self.core.reader_closed()
    }

    /// Waits until `min` slots (clamped to the ring) are free or the reader closed.
    pub fn wait_writable(
        &mut self,
        min: u64,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        let bytes = min.clamp(1, self.slots()) * self.slot_size() as u64;
        self.core.wait_writable(bytes, policy, timeout)
    }
}

/// Consuming end of a slot ring.
#[derive(Debug)]
pub struct SlotConsumer {
    core: ConsCore,
}

impl SlotConsumer {
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        let slot = SlotProducer::slot_of(&view)?;
        Ok(SlotConsumer {
            core: ConsCore::attach(&view, RingKind::Slots, slot)?,
        })
    }

    pub fn slot_size(&self) -> u32 {
        self.core.h.slot_size
    }

    pub fn slots(&self) -> u64 {
        self.core.cap() / self.slot_size() as u64
    }

    /// Filled slots right now.
    pub fn available_slots(&mut self) -> Result<u64, RingError> {
        Ok(self.core.refresh()? / self.slot_size() as u64)
    }

    /// Pops one slot into `dst` (exactly `slot_size` bytes); `Ok(false)` if empty.
    pub fn pop(&mut self, dst: &mut [u8]) -> Result<bool, RingError> {
        check_len(dst.len(), self.slot_size())?;
        Ok(self.pop_batch(dst)? == 1)
    }

    /// Pops up to `dst.len() / slot_size` slots into `dst` (a whole number of slots), releasing
    /// them once; returns how many were popped.
    pub fn pop_batch(&mut self, dst: &mut [u8]) -> Result<usize, RingError> {
        let size = self.slot_size() as u64;
        if dst.len() as u64 % size != 0 {
            return Err(RingError::SlotSize {
                len: dst.len() as u64,
                slot_size: self.slot_size(),
            });
        }
        let avail = self.core.avail_for(dst.len() as u64)?;
        let n = (avail / size).min(dst.len() as u64 / size);
        copy_out(
            &self.core.h.data,
            self.core.cap(),
            self.core.head,
            &mut dst[..(n * size) as usize],
        )?;
        if n > 0 {
            self.core.consume(n * size);
        }
        Ok(n as usize)
    }

    /// Pops one descriptor (slot size [`Descriptor::SIZE`]); reserved bits are rejected.
    pub fn pop_desc(&mut self) -> Result<Option<Descriptor>, RingError> {
        let mut b = [0u8; Descriptor::SIZE];
        if !self.pop(&mut b)? {
            return Ok(None);
        }
        Descriptor::decode(&b).map(Some)
    }

    pub fn is_eof(&mut self) -> Result<bool, RingError> {
        self.core.is_eof()
    }

    pub fn close(&mut self) {
        self.core.close();
    }

    pub fn wait_readable(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        let size = self.slot_size() as u64;
        self.core.wait_readable(size, policy, timeout)
    }
}
