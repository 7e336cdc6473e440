#![cfg(loom)]
//! Loom model of loan / send / release on one held descriptor ring (`held.rs`): a producer
//! pushes `N` = 4 descriptors (distinct `user` words) into a ring of two slots, retrying with
//! `yield_now` while it is full; the reader (the model's main thread) takes d0 and d1,
//! releases d0 (the head passes slot 0, which the producer refills with d2 while d1 is held
//! in slot 1), takes d2, releases d2 and then d1 — out of order: the head must stay at d1
//! until d1 goes — then takes and releases d3. Every release is done the way
//! `memloop::zerocopy::Received::drop` does it: [`HeldReleaser::mark`] from a handle, then
//! [`HeldConsumer::advance`]. Checked in every execution: the reader sees every descriptor
//! once and in order; a slot it holds still has the bytes it took when the reader looks at it
//! a last time, just before letting go (the producer never overwrote it); once all is
//! released and the producer is done, [`scan_held`] lists nothing and the reader holds
//! nothing.
//!
//! Model caveat (see `loom_forward.rs`): the model `ShmSlice` keeps data bytes and 4-byte
//! atomics in separate arrays, so a push's byte copy does not reach the atomic flags word that
//! `FLAG_RELEASED` lives in. On real memory it does: the copy of a new descriptor into a slot
//! overwrites the whole 32 bytes, flags word included, clearing the previous use's mark. Both
//! slots are reused here (`N` > 2 is what makes the producer wait for room), so the producer
//! does to that word what a real overwrite does: having seen room (the acquire load of the
//! head in `SlotProducer::free_slots`), it stores 0 to the flags word of the slot it is about
//! to fill (relaxed, as the model's byte writes are), then pushes. Without that, a reused slot
//! reads as released already and the reader's mark of it fails as "released twice"
//! (`model_without_the_overwrite_keeps_the_mark` shows it).
//!
//! The last look reads the slot's model data words (`ShmSlice::atomic_u64` at a data offset
//! is, in the model, the word that holds those bytes) each with a relaxed `fetch_add(0)`, not
//! with `ShmSlice::read`. Loom's DPOR compares an access only with the last access to the same
//! object, and the model's byte copy loads each word before storing it: a producer store that
//! follows a reader's plain load finds its own load as the last access and is never seen to
//! race with the look, so loom never moves the copy before it. With plain loads the control
//! below passed (260,936 executions, none overwritten); an RMW counts as a write, so the race
//! is explored, and it reads the newest value of the word, the one an overwrite leaves.
//!
//! Control: a reader whose first release of the pair marks d1 — still read — where it meant
//! d2 lets the head pass d1; loom finds the producer's push of d3 landing in d1's slot before
//! the reader's last look at it.
//! Run: RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_held -- --nocapture
mod common;
use loom::thread;
use memloop_ring::*;
use memloop_shm::sync::Ordering::Relaxed;
use memloop_shm::ShmSlice;

/// Descriptors pushed through two slots, so each slot is used twice (the reader's script
/// below is written for four).
const N: u32 = 4;
const SLOT: u64 = Descriptor::SIZE as u64;
/// Two slots: the smallest capacity.
const CAP: u64 = 2 * SLOT;

fn ring() -> ShmSlice {
    let v = ShmSlice::new_model(ring_bytes(CAP) as usize);
    init_ring(&v, RingKind::Slots, CAP, SLOT as u32).unwrap();
    v
}

fn desc(user: u32) -> Descriptor {
    Descriptor {
        pool: 1,
        offset: 64 * user as u64,
        len: 64,
        pool_gen: 1,
        user,
        ..Descriptor::default()
    }
}

/// Offset, in the ring's view, of the slot at ring position `pos`.
fn slot_at(pos: u64) -> u64 {
    RING_HEADER_BYTES + (pos & (CAP - 1))
}

/// How the reader lets go of the pair (d1, d2) it holds, d2 taken after d1.
#[derive(Clone, Copy)]
enum Release {
    /// d2 first, then d1 (out of order), each marked after the reader's last look at it.
    OutOfOrder,
    /// Broken: the first mark lands on d1 — still read — where d2 was meant; the second on d2.
    MarksTheSlotStillRead,
}

/// `overwrite`: the producer clears a slot's flags word before filling it (what the copy of a
/// descriptor does to real memory, not to the model's; see the header).
fn loan_send_release(release: Release, overwrite: bool) {
    common::model_all(move || {
        let v = ring();
        let mut to = SlotProducer::attach(v.clone()).unwrap();
        let pv = v.clone();
        let producer = thread::spawn(move || {
            let mut pushed = 0u32;
            while pushed < N {
                if to.free_slots().unwrap() == 0 {
                    thread::yield_now();
                    continue;
                }
                if overwrite {
                    let pos = pushed as u64 * SLOT;
                    let flags = pv.atomic_u32(slot_at(pos) + Descriptor::FLAGS_AT).unwrap();
                    flags.store(0, Relaxed);
                }
                assert!(to.push_desc(&desc(pushed)).unwrap(), "room was seen");
                pushed += 1;
            }
        });

        let mut reader = HeldConsumer::attach(v.clone()).unwrap();
        let rel = reader.releaser();
        let mut seen = Vec::new();
        let mut take = |reader: &mut HeldConsumer| loop {
            if let Some((pos, d)) = reader.take().unwrap() {
                seen.push(d.user);
                return (pos, d);
            }
            thread::yield_now();
        };
        // The reader's last look at a slot it holds: the bytes it took are still there. Read
        // as the model's data words, each by a relaxed RMW that adds 0 (see the header).
        let look = |pos: u64, d: &Descriptor| {
            let mut now = [0u8; Descriptor::SIZE];
            for (i, w) in now.chunks_exact_mut(8).enumerate() {
                let word = v.atomic_u64(slot_at(pos) + 8 * i as u64).unwrap();
                w.copy_from_slice(&word.fetch_add(0, Relaxed).to_le_bytes());
            }
            assert_eq!(now, d.encode(), "a held slot was overwritten (pos {pos})");
        };
        // Let go of a slot: mark it from the handle, then move the head.
        let release_at = |reader: &mut HeldConsumer, pos: u64| {
            rel.mark(pos).unwrap();
            reader.advance().unwrap();
        };
        let (p0, d0) = take(&mut reader);
        let (p1, d1) = take(&mut reader);
        // d0 in order: the head passes slot 0 and the producer refills it (with d2, after
        // waiting for room) while d1 is held in slot 1.
        look(p0, &d0);
        release_at(&mut reader, p0);
        let (p2, d2) = take(&mut reader);
        assert_eq!(reader.held(), 2);
        // Out of order: d2 first (the head stays at d1, so the producer, with d3 to push,
        // still finds no room: were d1's slot passed, d3 would land in it), then d1 (the head
        // passes both).
        let (first, second) = match release {
            Release::OutOfOrder => (p2, p1),
            Release::MarksTheSlotStillRead => (p1, p2),
        };
        look(p2, &d2);
        release_at(&mut reader, first);
        look(p1, &d1);
        release_at(&mut reader, second);
        let (p3, d3) = take(&mut reader);
        look(p3, &d3);
        release_at(&mut reader, p3);
        assert_eq!(reader.held(), 0);
        assert_eq!(seen, (0..N).collect::<Vec<_>>(), "each once, in order");
        producer.join().unwrap();
        let mut listed = Vec::new();
        scan_held(&v, |d| listed.push(d.user)).unwrap();
        assert!(listed.is_empty(), "released, yet the ring holds {listed:?}");
        assert!(!reader.readable().unwrap());
    });
}

#[test]
fn held_slots_are_never_overwritten_and_released_out_of_order() {
    loan_send_release(Release::OutOfOrder, true);
}

/// The control: the model can fail. Marking the slot still read lets the head pass it, and
/// the producer's next push lands in it.
#[test]
#[should_panic(expected = "a held slot was overwritten")]
fn marking_a_slot_still_read_lets_it_be_overwritten() {
    loan_send_release(Release::MarksTheSlotStillRead, true);
}

/// The model caveat, shown: without the producer clearing the flags word, a reused slot still
/// carries the mark of its previous use, and the reader's mark of it fails.
#[test]
#[should_panic(expected = "slot released twice")]
fn model_without_the_overwrite_keeps_the_mark() {
    loan_send_release(Release::OutOfOrder, false);
}
