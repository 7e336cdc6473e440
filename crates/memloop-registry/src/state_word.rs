//! The state word every table slot starts with: `gen << 32 | tag << 8 | low`.
//!
//! - `gen` (32 bits) is bumped whenever a slot is freed, so ids and remembered words of an
//!   earlier occupant never match again (no ABA).
//! - `tag` (24 bits) names a member incarnation ([`crate::key::member_tag`]): the owner, the
//!   reserving client, or the reclaimer, depending on the table. Keeping it in the word lets a
//!   reclaimer find a dead member's half-built entries with one load per slot.
//! - `low` (8 bits) is the table's state; channels split it into a 3-bit phase and 5 flag bits.
//!
//! One type for all tables, so the packing (and its masking of out-of-range tags) exists once.

use crate::error::RegistryError;
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};
use memloop_shm::ShmU64;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct StateWord(u64);

impl std::fmt::Debug for StateWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StateWord({:#x})", self.0)
    }
}

impl StateWord {
    pub const TAG_MASK: u32 = 0xff_ffff;

    /// Packs the fields; bits of `tag` above 24 are dropped (tags never have them).
    pub const fn new(gen: u32, tag: u32, low: u8) -> Self {
        Self(((gen as u64) << 32) | (((tag & Self::TAG_MASK) as u64) << 8) | low as u64)
    }
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }
    pub const fn raw(self) -> u64 {
        self.0
    }
    pub const fn gen(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub const fn tag(self) -> u32 {
        ((self.0 >> 8) as u32) & Self::TAG_MASK
    }
    pub const fn low(self) -> u8 {
        self.0 as u8
    }
    /// Same generation and tag, another state.
    pub const fn with_low(self, low: u8) -> Self {
        Self((self.0 & !0xff) | low as u64)
    }
    /// The word of the slot's next incarnation: generation + 1, no tag, state `low`.
    pub const fn next_gen(self, low: u8) -> Self {
        Self::new(self.gen().wrapping_add(1), 0, low)
    }
}

/// The atomic holding a slot's [`StateWord`]. All transitions are SeqCst: the Dekker pairs
/// (endpoint insertion, offers vs decline markers) rely on a total order of these CASes.
#[derive(Clone)]
pub(crate) struct StateCell(ShmU64);

impl StateCell {
    pub fn new(word: ShmU64) -> Self {
        Self(word)
    }
    /// Tests only: slots read their word without making a cell (see `Slot::word`).
    #[cfg(all(test, not(loom)))]
    pub fn load(&self) -> StateWord {
        StateWord(self.0.load(SeqCst))
    }
    /// Tests only: slots change by CAS.
    #[cfg(all(test, not(loom)))]
    pub fn store(&self, w: StateWord) {
        self.0.store(w.0, SeqCst)
    }
    /// Whether the word was `old` and is now `new`.
    pub fn cas(&self, old: StateWord, new: StateWord) -> bool {
        self.0
            .compare_exchange(old.0, new.0, SeqCst, Relaxed)
            .is_ok()
    }
}

/// A slot whose low byte is not a state its table defines.
pub(crate) fn bad_state(table: &'static str, idx: u32, w: StateWord) -> RegistryError {
    RegistryError::corrupt(table, format!("slot {idx}: state word {:#x}", w.raw()))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fields_pack_and_unpack() {
        let w = StateWord::new(0xdead_beef, 0x12_3456, 0x9a);
        assert_eq!(w.raw(), 0xdead_beef_1234_569a);
        assert_eq!((w.gen(), w.tag(), w.low()), (0xdead_beef, 0x12_3456, 0x9a));
        assert_eq!(StateWord::from_raw(w.raw()), w);
    }

    #[test]
    fn an_oversized_tag_does_not_leak_into_the_generation() {
        let w = StateWord::new(7, 0xff00_0001, 2);
        assert_eq!((w.gen(), w.tag(), w.low()), (7, 1, 2));
    }

    #[test]
    fn with_low_keeps_gen_and_tag_and_next_gen_wraps() {
        let w = StateWord::new(3, 9, 1).with_low(0x2b);
        assert_eq!((w.gen(), w.tag(), w.low()), (3, 9, 0x2b));
        let n = StateWord::new(u32::MAX, 9, 1).next_gen(0);
        assert_eq!((n.gen(), n.tag(), n.low()), (0, 0, 0));
    }

    #[test]
    fn cas_succeeds_only_from_the_expected_word() {
        let view = memloop_shm::ShmSlice::new_heap(64);
        let cell = StateCell::new(view.u64_at(8).unwrap());
        let (a, b) = (StateWord::new(1, 2, 1), StateWord::new(1, 2, 2));
        assert!(!cas_ok(&cell, a, b), "the cell holds 0");
        cell.store(a);
        assert!(cas_ok(&cell, a, b));
        assert_eq!(cell.load(), b);
        assert!(!cas_ok(&cell, a, b), "stale expectation");
    }

    fn cas_ok(c: &StateCell, old: StateWord, new: StateWord) -> bool {
        c.cas(old, new)
    }

    proptest! {
        #[test]
        fn round_trips(gen: u32, tag in 0u32..=StateWord::TAG_MASK, low: u8) {
            let w = StateWord::new(gen, tag, low);
            prop_assert_eq!((w.gen(), w.tag(), w.low()), (gen, tag, low));
        }
    }
}
