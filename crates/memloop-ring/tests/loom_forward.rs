#![cfg(loom)]
//! Loom model of a forward racing a pool owner's scan (the registry's pools module text): the
//! forwarder holds X (naming buffer b) in ring A, publishes Y (naming b) in ring B, bumps the
//! pool's forwards word, marks X released and moves A's head past it; the scanner scans both
//! rings with `scan_stable` + `scan_held`, the production functions. A stable scan must have
//! seen b, which some slot referenced at every instant. Controls: without the bump, or with a
//! scan that does not look at the word again, loom finds the scan that misses b. (A relaxed
//! bump would pass: `push_desc` fences (SeqCst) after publishing, for its wake-up check.)
//! Run: RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_forward
mod common;
use loom::thread;
use memloop_ring::*;
use memloop_shm::ShmSlice;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

/// Buffer b: its offset in the pool.
const B_OFF: u64 = 128;

/// A descriptor ring of two slots (the smallest capacity). Each slot is used once: in the
/// model, a push does not clear the flags word that `FLAG_RELEASED` lives in.
fn ring() -> ShmSlice {
    let cap = 2 * Descriptor::SIZE as u64;
    let v = ShmSlice::new_model(ring_bytes(cap) as usize);
    init_ring(&v, RingKind::Slots, cap, Descriptor::SIZE as u32).unwrap();
    v
}

fn naming_b(user: u32) -> Descriptor {
    Descriptor {
        pool: 1,
        offset: B_OFF,
        len: 64,
        pool_gen: 1,
        user,
        ..Descriptor::default()
    }
}

/// `bump`: the forwarder notes its forward; `stable`: the scan goes through `scan_stable`.
fn forward_during_scan(bump: bool, stable: bool) {
    let retried = Arc::new(AtomicBool::new(false));
    let retried_in = retried.clone();
    common::model_all(move || {
        let (a, b, words) = (ring(), ring(), ShmSlice::new_model(8));
        // X in ring A, taken: held by the forwarder (A's reader) until it marks it released.
        let mut to_a = SlotProducer::attach(a.clone()).unwrap();
        assert!(to_a.push_desc(&naming_b(1)).unwrap());
        let mut reader = HeldConsumer::attach(a.clone()).unwrap();
        let (x, _) = reader.take().unwrap().unwrap();
        let mut to_b = SlotProducer::attach(b.clone()).unwrap();
        let fw = words.u64_at(0).unwrap();
        let forwarder = thread::spawn(move || {
            assert!(to_b.push_desc(&naming_b(2)).unwrap());
            if bump {
                note_forward(&fw);
            }
            reader.releaser().mark(x).unwrap();
            reader.advance().unwrap();
            assert_eq!(reader.held(), 0);
        });
        // B before A: the order in which a scan can miss the forward (A first, the acquire of
        // X's release would carry Y's publication along).
        let scan = || {
            let mut seen = false;
            for r in [&b, &a] {
                scan_held(r, |d| seen |= d.pool == 1 && d.offset == B_OFF)?;
            }
            Ok::<_, RingError>(seen)
        };
        let saw_b = if stable {
            let (forwards, mut tries) = (words.u64_at(0).unwrap(), 0);
            let seen = scan_stable(&forwards, 2, || {
                tries += 1;
                scan()
            })
            .unwrap()
            .expect("one forward moves the word once: the second try is stable");
            if tries > 1 {
                retried_in.store(true, Relaxed);
            }
            seen
        } else {
            scan().unwrap()
        };
        assert!(saw_b, "the scan missed buffer b, referenced all along");
        forwarder.join().unwrap();
    });
    assert!(retried.load(Relaxed), "no execution had a scan retry");
}

#[test]
fn a_stable_scan_sees_a_forwarded_buffer() {
    forward_during_scan(true, true);
}

/// The controls: the model can fail. Without the bump the scan has nothing to notice...
#[test]
#[should_panic(expected = "the scan missed buffer b")]
fn without_the_bump_a_scan_misses_a_forward() {
    forward_during_scan(false, true);
}

/// ... and a single look misses it whatever the forwarder does.
#[test]
#[should_panic(expected = "the scan missed buffer b")]
fn a_scan_that_does_not_retry_misses_a_forward() {
    forward_during_scan(true, false);
}
