#![cfg(not(loom))]
mod common;
use common::ring;
use memloop_ring::{Descriptor, RingError, RingKind, SlotConsumer, SlotProducer, WaitPolicy};
use std::time::Duration;

fn pair(cap: u64, slot: u32) -> (SlotProducer, SlotConsumer) {
    let v = ring(RingKind::Slots, cap, slot);
    (
        SlotProducer::attach(v.clone()).unwrap(),
        SlotConsumer::attach(v).unwrap(),
    )
}

#[test]
fn push_pop_single_and_full() {
    let (mut p, mut c) = pair(64, 16);
    assert_eq!((p.slots(), p.slot_size()), (4, 16));
    for i in 0..4u8 {
        assert!(p.push(&[i; 16]).unwrap());
    }
    assert!(!p.push(&[9; 16]).unwrap(), "full");
    let mut b = [0u8; 16];
    for i in 0..4u8 {
        assert!(c.pop(&mut b).unwrap());
        assert_eq!(b, [i; 16]);
    }
    assert!(!c.pop(&mut b).unwrap());
}

#[test]
fn wrong_sizes_are_rejected() {
    let (mut p, mut c) = pair(64, 16);
    assert!(matches!(
        p.push(&[0; 15]),
        Err(RingError::SlotSize {
            len: 15,
            slot_size: 16
        })
    ));
    assert!(matches!(
        c.pop(&mut [0; 17]),
        Err(RingError::SlotSize { .. })
    ));
    assert!(matches!(
        c.pop_batch(&mut [0; 20]),
        Err(RingError::SlotSize { .. })
    ));
}

#[test]
fn batches_wrap_and_stay_in_order() {
    let (mut p, mut c) = pair(128, 32);
    let mut next_in = 0u8;
    let mut next_out = 0u8;
    for _ in 0..30 {
        let mk: Vec<[u8; 32]> = (0..3).map(|k| [next_in.wrapping_add(k); 32]).collect();
        let refs: Vec<&[u8]> = mk.iter().map(|s| &s[..]).collect();
        let n = p.push_batch(&refs).unwrap();
        next_in = next_in.wrapping_add(n as u8);
        let mut out = [0u8; 64];
        let m = c.pop_batch(&mut out).unwrap();
        for s in out[..m * 32].chunks(32) {
            assert_eq!(s, &[next_out; 32][..]);
            next_out = next_out.wrapping_add(1);
        }
    }
    assert!(next_out > 30);
}

#[test]
fn descriptors_through_a_slot_ring() {
    let (mut p, mut c) = pair(64, Descriptor::SIZE as u32);
    let d = Descriptor {
        pool: 3,
        flags: 0,
        offset: 4096,
        len: 100,
        owner: 5,
        pool_gen: 2,
        user: 42,
    };
    assert!(p.push_desc(&d).unwrap());
    assert_eq!(c.available_slots().unwrap(), 1);
    assert_eq!(c.pop_desc().unwrap(), Some(d));
    assert_eq!(c.pop_desc().unwrap(), None);
    let mut bad = d.encode();
    bad[6] = 0xff;
    assert!(p.push(&bad).unwrap());
    assert!(matches!(c.pop_desc(), Err(RingError::Corrupt { .. })));
}

#[test]
fn eof_close_and_waits() {
    let (mut p, mut c) = pair(64, 32);
    let pol = WaitPolicy::default();
    assert!(p.wait_writable(2, &pol, Duration::ZERO).unwrap());
    p.push(&[1; 32]).unwrap();
    p.push(&[1; 32]).unwrap();
    assert_eq!(p.free_slots().unwrap(), 0);
    assert!(!p.wait_writable(1, &pol, Duration::from_millis(2)).unwrap());
    p.shutdown();
    assert!(!c.is_eof().unwrap());
    let mut b = [0u8; 64];
    assert_eq!(c.pop_batch(&mut b).unwrap(), 2);
    assert!(c.is_eof().unwrap());
    assert!(c.wait_readable(&pol, Duration::ZERO).unwrap());
    c.close();
    assert!(matches!(p.push(&[0; 32]), Err(RingError::Closed)));
}
