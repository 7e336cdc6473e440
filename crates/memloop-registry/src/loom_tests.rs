//! loom models of the two races that matter most: a client cancelling its offer while the
//! server takes it, and two channels allocating ring segments at once. The region is tiny
//! (loom models every 8 bytes of it as an atomic).

use crate::key::{ChannelId, EndpointKey};
use crate::{MemberIdentity, RegionParams, Registry, RegistryError, ShmSlice};
use loom::thread;

/// Header 256 + 2 members + 2 endpoints + 2 channels, then four 256-byte segments.
const SIZE: u64 = 2560;

fn tiny() -> RegionParams {
    RegionParams {
        size: SIZE,
        max_members: 2,
        max_endpoints: 2,
        max_channels: 2,
        segment_size: 256,
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.max_branches = 1_000_000;
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    b.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    let n = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("loom explored {n} executions");
    assert!(n > 1, "the model did not branch");
}

fn ident(pid: u32) -> MemberIdentity {
    MemberIdentity {
        pid,
        start_time: 0,
        boot_id: [0; 16],
        pid_ns: 0,
        net_ns: 0,
        name: String::new(),
    }
}

#[test]
fn cancel_races_take_offer_and_both_agree() {
    model(|| {
        let r = Registry::init(ShmSlice::new_model(SIZE as usize), &tiny()).unwrap();
        assert_eq!(r.nsegments(), 4);
        let c = r.join(&ident(1)).unwrap();
        let s = r.join(&ident(2)).unwrap();
        let ep = r.add_endpoint(s, &EndpointKey::Native("s".into())).unwrap();
        let ch = r.offer(c, ep, 64, None).unwrap();
        let rc = r.clone();
        let h = thread::spawn(move || rc.cancel(ch, c));
        let took = r.take_offer(ep, s).unwrap();
        match (h.join().unwrap(), took) {
            (Ok(()), None) => {
                assert_eq!(r.usage().channels, 0);
                assert_eq!(r.usage().segments_used, 0);
            }
            (Err(RegistryError::WrongState { .. }), Some(t)) => {
                assert_eq!(t, ch);
                assert!(r.rings(ch).is_ok());
            }
            (cancel, take) => panic!("sides disagree: cancel {cancel:?}, take {take:?}"),
        }
    });
}

#[test]
fn concurrent_segment_allocations_never_overlap() {
    model(|| {
        let r = Registry::init(ShmSlice::new_model(SIZE as usize), &tiny()).unwrap();
        let r2 = r.clone();
        let h = thread::spawn(move || r2.alloc_segments(ChannelId { idx: 0, gen: 0 }, 2));
        let b = r.alloc_segments(ChannelId { idx: 1, gen: 0 }, 2);
        let a = h.join().unwrap();
        let wins: Vec<u64> = [&a, &b]
            .iter()
            .filter_map(|x| x.as_ref().ok().copied())
            .collect();
        assert!(!wins.is_empty(), "one allocation must succeed: {a:?} {b:?}");
        if let [x, y] = wins[..] {
            assert!(x + 2 <= y || y + 2 <= x, "overlap: {x} and {y}");
        }
        for e in [a, b].into_iter().filter_map(Result::err) {
            assert!(matches!(
                e,
                RegistryError::RegionFull {
                    what: "ring memory"
                }
            ));
        }
        assert_eq!(
            r.usage().segments_used,
            2 * wins.len() as u64,
            "rolled-back claims leaked"
        );
    });
}
