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

/// `loom::model` without a preemption bound, whatever `LOOM_MAX_PREEMPTIONS` says, for
/// models small enough to explore every execution; reports how many it explored, and how
/// long that took.
#[cfg(loom)]
pub fn model_all(f: impl Fn() + Sync + Send + 'static) {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let mut b = loom::model::Builder::new();
    b.max_branches = 1_000_000;
    b.preemption_bound = None;
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let t0 = std::time::Instant::now();
    b.check(move || {
        counted.fetch_add(1, Relaxed);
        f()
    });
    let n = runs.load(Relaxed);
    eprintln!("loom explored {n} executions in {:.2?}", t0.elapsed());
    assert!(n > 1, "the model did not branch");
}
