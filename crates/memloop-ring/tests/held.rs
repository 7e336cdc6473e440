#![cfg(not(loom))]
//! The zero-copy reader: slots held until released, in any order; what a scan sees.

use memloop_ring::{
    init_ring, ring_bytes, scan_held, Descriptor, HeldConsumer, RingError, RingKind, SlotProducer,
};
use memloop_shm::ShmSlice;

fn ring(slots: u64) -> ShmSlice {
    let cap = slots * Descriptor::SIZE as u64;
    let v = ShmSlice::new_heap(ring_bytes(cap) as usize);
    init_ring(&v, RingKind::Slots, cap, Descriptor::SIZE as u32).unwrap();
    v
}

fn desc(i: u32) -> Descriptor {
    Descriptor {
        pool: 1,
        offset: i as u64 * 64,
        len: 64,
        user: i,
        ..Descriptor::default()
    }
}

fn held_users(v: &ShmSlice) -> Vec<u32> {
    let mut seen = Vec::new();
    scan_held(v, |d| seen.push(d.user)).unwrap();
    seen
}

#[test]
fn slots_stay_until_released_in_any_order() {
    let v = ring(4);
    let mut p = SlotProducer::attach(v.clone()).unwrap();
    let mut c = HeldConsumer::attach(v.clone()).unwrap();
    for i in 0..4 {
        assert!(p.push_desc(&desc(i)).unwrap());
    }
    assert!(!p.push_desc(&desc(9)).unwrap(), "full");
    let taken: Vec<(u64, Descriptor)> = (0..4).map(|_| c.take().unwrap().unwrap()).collect();
    assert_eq!(c.take().unwrap(), None);
    assert_eq!(c.held(), 4);
    assert_eq!(held_users(&v), vec![0, 1, 2, 3]);
    // Released out of order: the head waits for slot 0, the scan skips the released.
    c.release(taken[2].0).unwrap();
    c.release(taken[1].0).unwrap();
    assert_eq!(held_users(&v), vec![0, 3]);
    assert_eq!(p.free_slots().unwrap(), 0, "head still at slot 0");
    c.release(taken[0].0).unwrap();
    assert_eq!(p.free_slots().unwrap(), 3);
    assert_eq!(c.held(), 1);
    // The ring wraps; a new slot in a released place is held again.
    assert!(p.push_desc(&desc(4)).unwrap());
    assert_eq!(c.take().unwrap().unwrap().1, desc(4));
    assert_eq!(held_users(&v), vec![3, 4]);
}

#[test]
fn bad_releases_are_errors() {
    let v = ring(4);
    let mut p = SlotProducer::attach(v.clone()).unwrap();
    let mut c = HeldConsumer::attach(v.clone()).unwrap();
    p.push_desc(&desc(0)).unwrap();
    p.push_desc(&desc(1)).unwrap();
    let (pos, _) = c.take().unwrap().unwrap();
    for bad in [pos + 32, pos + 7, pos.wrapping_sub(32)] {
        assert!(
            matches!(c.release(bad), Err(RingError::Corrupt { .. })),
            "{bad}"
        );
    }
    c.release(pos).unwrap();
    assert!(matches!(c.release(pos), Err(RingError::Corrupt { .. })));
}

#[test]
fn a_slot_with_ring_bits_is_refused_on_take_and_skipped_by_a_scan() {
    let v = ring(4);
    let mut p = SlotProducer::attach(v.clone()).unwrap();
    let mut c = HeldConsumer::attach(v.clone()).unwrap();
    let mut bad = desc(7).encode();
    bad[6] = 0x40;
    p.push(&bad).unwrap();
    assert!(held_users(&v).is_empty());
    assert!(matches!(c.take(), Err(RingError::Corrupt { .. })));
}

#[test]
fn a_scan_refuses_what_is_not_a_descriptor_ring() {
    let v = ShmSlice::new_heap(ring_bytes(1024) as usize);
    init_ring(&v, RingKind::Stream, 1024, 0).unwrap();
    assert!(matches!(
        scan_held(&v, |_| ()),
        Err(RingError::Corrupt { .. })
    ));
    let w = ring(4);
    w.u64_at(0)
        .unwrap()
        .store(1 << 40, std::sync::atomic::Ordering::SeqCst); // the tail
    assert!(matches!(
        scan_held(&w, |_| ()),
        Err(RingError::Corrupt { .. })
    ));
}

#[test]
fn eof_after_everything_was_taken() {
    let v = ring(4);
    let mut p = SlotProducer::attach(v.clone()).unwrap();
    let mut c = HeldConsumer::attach(v).unwrap();
    p.push_desc(&desc(0)).unwrap();
    p.shutdown();
    assert!(!c.is_eof().unwrap());
    let (pos, _) = c.take().unwrap().unwrap();
    assert!(c.is_eof().unwrap(), "eof while the slot is still held");
    c.release(pos).unwrap();
}
