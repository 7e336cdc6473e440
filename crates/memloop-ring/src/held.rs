//! A descriptor ring whose reader *holds* what it took: a slot stays in the ring until the
//! reader releases it, and only then may the ring's head pass it (zero-copy receive).
//!
//! Why: a descriptor names a buffer of some member's pool, and that buffer must not be
//! reused while anyone still reads it. Keeping every reference in a ring slot of a live
//! channel — unread, or read and not yet released — means a reference never lives anywhere a
//! crash could lose it: when a member dies, its channels are freed and with them its
//! references, with nothing to undo. A pool's owner finds its free buffers by
//! [`scan_held`]ing the descriptor rings (the pool module of the registry says how a scan and
//! a forward agree: [`note_forward`] and [`scan_stable`]).
//!
//! Releases may come in any order: a released slot is marked [`FLAG_RELEASED`] in place, and
//! the head moves over the run of released slots at its front.

use crate::descriptor::{Descriptor, FLAG_RELEASED};
use crate::header::{
    RingKind, OFF_CAP, OFF_HEAD, OFF_KIND, OFF_MAGIC, OFF_SLOT, OFF_TAIL, RING_HEADER_BYTES,
    RING_MAGIC,
};
use crate::index::{copy_out, ConsCore};
use crate::wait::WaitPolicy;
use crate::RingError;
use memloop_shm::sync::AtomicU64;
use memloop_shm::sync::Ordering::{Acquire, Release, SeqCst};
use memloop_shm::ShmSlice;
use std::time::Duration;

const SLOT: u64 = Descriptor::SIZE as u64;

/// The reading end of a descriptor ring whose slots are held until released.
#[derive(Debug)]
pub struct HeldConsumer {
    core: ConsCore,
    /// The next slot to take (the head is at or behind it: slots held in between).
    next: u64,
}

impl HeldConsumer {
    /// Attaches a ring of [`Descriptor::SIZE`] slots.
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        let core = ConsCore::attach(&view, RingKind::Slots, SLOT)?;
        if core.h.slot_size as u64 != SLOT {
            return Err(RingError::SlotSize {
                len: SLOT,
                slot_size: core.h.slot_size,
            });
        }
        let next = core.head;
        Ok(HeldConsumer { core, next })
    }

    /// Slots taken and not yet released.
    pub fn held(&self) -> u64 {
        self.next.wrapping_sub(self.core.head) / SLOT
    }

    /// Takes the next descriptor: its ring position (to release it with) and its fields.
    /// `Ok(None)` if nothing is waiting. Flag bits outside the mask are corruption.
    pub fn take(&mut self) -> Result<Option<(u64, Descriptor)>, RingError> {
        let taken = self.next.wrapping_sub(self.core.head);
        if self.core.avail_for(taken + SLOT)? < taken + SLOT {
            return Ok(None);
        }
        let mut b = [0u8; Descriptor::SIZE];
        copy_out(&self.core.h.data, self.core.cap(), self.next, &mut b)?;
        let d = Descriptor::decode(&b)?;
        let pos = self.next;
        self.next = self.next.wrapping_add(SLOT);
        Ok(Some((pos, d)))
    }

    /// Lets go of the slot at `pos` (taken, not yet released); the head then passes every
    /// released slot at its front, and a writer waiting for room is woken.
    pub fn release(&mut self, pos: u64) -> Result<(), RingError> {
        let head = self.core.head;
        let inside = pos.wrapping_sub(head) < self.next.wrapping_sub(head);
        if !inside || pos % SLOT != 0 {
            let detail = format!("slot {pos} (held from {head} to {})", self.next);
            return Err(RingError::corrupt("release of a slot not held", detail));
        }
        self.releaser().mark(pos)?;
        self.advance()
    }

    /// Moves the head over the released slots at its front (marked by [`HeldReleaser::mark`]
    /// in another thread, say), waking a writer waiting for room.
    pub fn advance(&mut self) -> Result<(), RingError> {
        let (head, rel) = (self.core.head, self.releaser());
        let mut n = 0;
        while head.wrapping_add(n) != self.next && rel.is_released(head.wrapping_add(n))? {
            n += SLOT;
        }
        if n > 0 {
            self.core.consume(n);
        }
        Ok(())
    }

    /// A handle that marks slots released without this reader (another thread's hold ends
    /// while this one waits for the next descriptor).
    pub fn releaser(&self) -> HeldReleaser {
        HeldReleaser {
            data: self.core.h.data.clone(),
            cap: self.core.h.cap,
        }
    }

    /// Whether a descriptor is waiting to be taken (re-reads the tail).
    pub fn readable(&mut self) -> Result<bool, RingError> {
        let taken = self.next.wrapping_sub(self.core.head);
        Ok(self.core.refresh()? > taken)
    }

    /// True when the writer shut down and every published slot was taken.
    pub fn is_eof(&mut self) -> Result<bool, RingError> {
        Ok(self.core.writer_shut()? && !self.readable()?)
    }

    /// Waits until a descriptor is waiting or the writer shut down.
    pub fn wait_readable(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        let want = self.next.wrapping_sub(self.core.head) + SLOT;
        self.core.wait(policy, timeout, |c| {
            Ok(c.avail_for(want)? >= want || c.writer_shut()?)
        })
    }

    /// What the producer asked for to be woken outside the ring (see the stream ends).
    pub fn take_wake(&mut self) -> u32 {
        self.core.take_wake()
    }

    pub fn close(&mut self) {
        self.core.close();
    }
}

/// Marks slots of one descriptor ring released (see [`HeldConsumer::releaser`]).
#[derive(Clone)]
pub struct HeldReleaser {
    data: ShmSlice,
    cap: u64,
}

impl HeldReleaser {
    fn flags_word(&self, pos: u64) -> Result<&memloop_shm::sync::AtomicU32, RingError> {
        let off = (pos & (self.cap - 1)) + Descriptor::FLAGS_AT;
        Ok(self.data.atomic_u32(off)?)
    }

    /// Marks the held slot at `pos` released (release ordering: a scan that sees the mark
    /// also sees what the holder did before, such as a forward's note). The head moves at
    /// the reader's next [`HeldConsumer::advance`]. A slot marked twice is an error.
    pub fn mark(&self, pos: u64) -> Result<(), RingError> {
        if pos % SLOT != 0 {
            return Err(RingError::corrupt("release of a slot", pos.to_string()));
        }
        if self.flags_word(pos)?.fetch_or(FLAG_RELEASED, Release) & FLAG_RELEASED != 0 {
            return Err(RingError::corrupt("slot released twice", pos.to_string()));
        }
        Ok(())
    }

    fn is_released(&self, pos: u64) -> Result<bool, RingError> {
        Ok(self.flags_word(pos)?.load(Acquire) & FLAG_RELEASED != 0)
    }
}

/// Calls `f` with every descriptor a descriptor ring holds now — published and not released —
/// from a view of the ring alone (a scan by a pool's owner, not by the reader). Descriptors
/// that fail to decode are skipped: they name nothing a pool would hand out. A ring that is
/// not a descriptor ring, or whose indices are out of range on every try, is an error; the
/// scanner must then treat everything as referenced.
pub fn scan_held(view: &ShmSlice, mut f: impl FnMut(&Descriptor)) -> Result<(), RingError> {
    let magic = view.atomic_u64(OFF_MAGIC)?.load(Acquire);
    let kind = view.atomic_u32(OFF_KIND)?.load(Acquire);
    let slot = view.atomic_u32(OFF_SLOT)?.load(Acquire) as u64;
    let cap = view.atomic_u64(OFF_CAP)?.load(Acquire);
    let fits = cap.is_power_of_two() && RING_HEADER_BYTES + cap <= view.len() as u64;
    if magic != RING_MAGIC || kind != RingKind::Slots as u32 || slot != SLOT || !fits {
        let detail = format!("kind {kind}, slot {slot}, capacity {cap}");
        return Err(RingError::corrupt("not a descriptor ring", detail));
    }
    let data = view.slice(RING_HEADER_BYTES, cap)?;
    let (head, tail) = window(view, cap)?;
    let mut pos = head;
    while pos != tail {
        let flags = data
            .atomic_u32((pos & (cap - 1)) + Descriptor::FLAGS_AT)?
            .load(Acquire);
        if flags & FLAG_RELEASED == 0 {
            let mut b = [0u8; Descriptor::SIZE];
            copy_out(&data, cap, pos, &mut b)?;
            let d = Descriptor::decode_any(&b);
            if d.flags & !Descriptor::FLAGS_MASK == 0 {
                f(&d);
            }
        }
        pos = pos.wrapping_add(SLOT);
    }
    Ok(())
}

/// Bumps a pool's forwards word. A holder that forwards a buffer calls it after publishing the
/// new descriptor and before marking its own slot released ([`scan_stable`] says why).
pub fn note_forward(forwards: &AtomicU64) {
    forwards.fetch_add(1, SeqCst);
}

/// Runs `scan` (of every descriptor ring) until the forwards word reads the same before and
/// after it, at most `tries` times. `Ok(Some(r))`: the result of such a stable scan;
/// `Ok(None)`: the word moved under every try (the caller must then count every buffer as
/// referenced); `Err`: the scan's own error, at once.
///
/// Why a stable scan misses no buffer that some slot references throughout: a forward
/// publishes its new descriptor, then [`note_forward`]s, then marks its old slot released
/// ([`HeldReleaser::mark`], release). A scan that sees the mark (acquire) also sees the bump,
/// so its second look differs from a first look that preceded the bump; and a first look
/// that saw the bump (acquire) sees the publication too. Checked by `tests/loom_forward.rs`.
pub fn scan_stable<T, E>(
    forwards: &AtomicU64,
    tries: u32,
    mut scan: impl FnMut() -> Result<T, E>,
) -> Result<Option<T>, E> {
    for _ in 0..tries {
        let before = forwards.load(Acquire);
        let r = scan()?;
        if forwards.load(Acquire) == before {
            return Ok(Some(r));
        }
    }
    Ok(None)
}

/// (head, tail) of a ring read by an observer: head first, so every slot held when the scan
/// began lies at or after it; retried when the two loads straddle a move.
fn window(view: &ShmSlice, cap: u64) -> Result<(u64, u64), RingError> {
    for _ in 0..8 {
        let head = view.atomic_u64(OFF_HEAD)?.load(Acquire);
        let tail = view.atomic_u64(OFF_TAIL)?.load(Acquire);
        let span = tail.wrapping_sub(head);
        if span <= cap && span % SLOT == 0 && head % SLOT == 0 {
            return Ok((head, tail));
        }
    }
    Err(RingError::corrupt(
        "descriptor ring indices",
        "out of range on every look".into(),
    ))
}
