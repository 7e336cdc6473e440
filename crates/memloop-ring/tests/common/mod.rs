#![allow(dead_code)]
use memloop_ring::{init_ring, ring_bytes, RingKind};
use memloop_shm::ShmSlice;

/// A fresh, initialised ring on the heap.
pub fn ring(kind: RingKind, cap: u64, slot: u32) -> ShmSlice {
    let v = ShmSlice::new_heap(ring_bytes(cap) as usize);
    init_ring(&v, kind, cap, slot).unwrap();
    v
}

/// Deterministic test bytes.
pub fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
