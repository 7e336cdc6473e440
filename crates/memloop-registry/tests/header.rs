#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;

#[test]
fn init_then_attach_sees_the_same_layout() {
    let view = ShmSlice::new_heap(2 * MIB as usize);
    let r = Registry::init(view.clone(), &params(2 * MIB)).unwrap();
    let a = Registry::attach(view).unwrap();
    assert_eq!(a.params(), r.params());
    assert_eq!(a.generation(), 1);
    assert_eq!(a.usage(), baseline(&r));
    assert!(r.nsegments() > 0 && r.metadata_len() % 4096 == 0);
}

#[test]
fn default_params_are_valid_and_documented_values() {
    let p = RegionParams::default();
    assert_eq!(
        (
            p.size,
            p.max_members,
            p.max_endpoints,
            p.max_channels,
            p.segment_size,
            p.max_conns
        ),
        (2 << 30, 1024, 16_384, 16_384, 4096, 16_384)
    );
    p.validate().unwrap();
    // Tables in proportion to smaller regions, never below the floors.
    let small = RegionParams::for_size(64 << 20);
    assert_eq!((small.max_members, small.max_channels), (64, 512));
    assert_eq!(RegionParams::for_size(1 << 20).max_channels, 64);
    assert_eq!(p.resized(64 << 20), small, "default tables follow the size");
    let custom = RegionParams {
        max_members: 5,
        ..small
    };
    assert_eq!(custom.resized(1 << 30).max_members, 5, "chosen tables stay");
    let r = Registry::init(ShmSlice::new_heap(p.size as usize), &p).unwrap();
    assert!(r.nsegments() > 500_000);
    assert!(r.metadata_len() < 16 << 20, "{}", r.metadata_len());
}

#[test]
fn attach_rejects_zero_bad_magic_version_and_size() {
    let view = ShmSlice::new_heap(MIB as usize);
    assert!(matches!(
        Registry::attach(view.clone()),
        Err(RegistryError::NotInitialised)
    ));
    Registry::init(view.clone(), &params(MIB)).unwrap();
    view.u64_at(8)
        .unwrap()
        .store(99, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(
        Registry::attach(view.clone()),
        Err(RegistryError::BadVersion {
            found: 99,
            expected: header::VERSION
        })
    ));
    view.u64_at(8)
        .unwrap()
        .store(header::VERSION as u64, std::sync::atomic::Ordering::SeqCst);
    view.u64_at(0)
        .unwrap()
        .store(0x1234, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(
        Registry::attach(view.clone()),
        Err(RegistryError::BadMagic { found: 0x1234 })
    ));
}

#[test]
fn attach_of_a_region_smaller_than_its_header_claims_fails() {
    let big = ShmSlice::new_heap(2 * MIB as usize);
    Registry::init(big.clone(), &params(2 * MIB)).unwrap();
    let small = big.slice(0, MIB).unwrap();
    match Registry::attach(small) {
        Err(RegistryError::SizeMismatch { header, actual }) => {
            assert_eq!((header, actual), (2 * MIB, MIB))
        }
        other => panic!("expected SizeMismatch, got {:?}", other.err()),
    }
    let p = params(2 * MIB);
    assert!(matches!(
        Registry::init(ShmSlice::new_heap(MIB as usize), &p),
        Err(RegistryError::SizeMismatch { .. })
    ));
}

#[test]
fn corrupt_offsets_or_params_are_detected() {
    let view = ShmSlice::new_heap(MIB as usize);
    Registry::init(view.clone(), &params(MIB)).unwrap();
    let w = view.u64_at(88).unwrap(); // channels offset
    w.store(
        w.load(std::sync::atomic::Ordering::SeqCst) + 8,
        std::sync::atomic::Ordering::SeqCst,
    );
    assert!(matches!(
        Registry::attach(view.clone()),
        Err(RegistryError::Corrupt { .. })
    ));
    Registry::init(view.clone(), &params(MIB)).unwrap();
    view.u64_at(56)
        .unwrap()
        .store(1000, std::sync::atomic::Ordering::SeqCst); // segment size
    assert!(matches!(
        Registry::attach(view.clone()),
        Err(RegistryError::Corrupt { .. })
    ));
    // connection records (count at 384, offset at 392 since version 3)
    for (off, delta) in [(392, 128), (384, 1)] {
        Registry::init(view.clone(), &params(MIB)).unwrap();
        let w = view.u64_at(off).unwrap();
        w.fetch_add(delta, std::sync::atomic::Ordering::SeqCst);
        assert!(
            matches!(
                Registry::attach(view.clone()),
                Err(RegistryError::Corrupt { .. })
            ),
            "header word {off}"
        );
        w.store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
        assert!(Registry::attach(view.clone()).is_err());
    }
}

#[test]
fn invalid_params_are_refused() {
    let ok = params(MIB);
    for p in [
        RegionParams {
            max_members: 0,
            ..ok
        },
        RegionParams {
            max_members: 5000,
            ..ok
        },
        RegionParams {
            max_channels: 0,
            ..ok
        },
        RegionParams { max_conns: 0, ..ok },
        RegionParams { max_links: 0, ..ok },
        RegionParams {
            segment_size: 3000,
            ..ok
        },
        RegionParams { size: 8192, ..ok },
    ] {
        assert!(
            matches!(p.validate(), Err(RegistryError::InvalidParams(_))),
            "{p:?}"
        );
    }
}

#[test]
fn reinit_bumps_generation_and_clears_tables() {
    let view = ShmSlice::new_heap(MIB as usize);
    let r = Registry::init(view.clone(), &params(MIB)).unwrap();
    let (c, _s, ep) = pair(&r);
    r.offer(c, ep, 4096, None).unwrap();
    r.bump_counter(3);
    let r2 = Registry::init(view, &params(MIB)).unwrap();
    assert_eq!(r2.generation(), 2);
    assert_eq!(r2.usage(), baseline(&r2));
    assert_eq!(r2.counters()[3], 0);
    assert!(matches!(r2.member(c), Err(RegistryError::NotFound)));
}

#[test]
fn counters_bump_and_ignore_out_of_range() {
    let r = fresh(MIB);
    r.bump_counter(0);
    r.bump_counter(31);
    r.bump_counter(31);
    r.bump_counter(32); // the first of the second block
    r.bump_counter(63);
    r.bump_counter(64);
    r.bump_counter(usize::MAX);
    let c = r.counters();
    assert_eq!(c.len(), 64);
    assert_eq!(
        (c[0], c[31], c[32], c[63], c[1..31].iter().sum::<u64>()),
        (1, 2, 1, 1, 0)
    );
    assert_eq!(c[33..63].iter().sum::<u64>(), 0);
    // The second block does not overlap the header fields after the first one.
    assert_eq!(r.state(), memloop_registry::RegionState::Open);
}

#[test]
fn region_state_is_kept_in_the_header_and_starts_open() {
    use memloop_registry::RegionState;
    let r = fresh(MIB);
    assert_eq!(r.state(), RegionState::Open);
    assert_eq!(r.set_state(RegionState::Paused).unwrap(), RegionState::Open);
    assert_eq!(r.state(), RegionState::Paused);
    assert_eq!(r.counters().iter().sum::<u64>(), 0, "no counter moved");
    r.set_state(RegionState::Destroying).unwrap();
    assert_eq!(r.state(), RegionState::Destroying);
    r.set_state(RegionState::Open).unwrap();
    assert_eq!(r.state(), RegionState::Open);
}

#[test]
fn a_region_of_the_previous_layout_version_is_refused_naming_both_versions() {
    let view = ShmSlice::new_heap(MIB as usize);
    Registry::init(view.clone(), &params(MIB)).unwrap();
    assert_eq!(header::VERSION, 10);
    view.u64_at(8)
        .unwrap()
        .store(9, std::sync::atomic::Ordering::SeqCst);
    let e = Registry::attach(view).err().expect("version 9 refused");
    assert!(matches!(
        e,
        RegistryError::BadVersion {
            found: 9,
            expected: 10
        }
    ));
    assert_eq!(
        e.to_string(),
        "region layout version 9, this build understands 10: recreate the region \
         (`memloop region destroy`, then `memloop region create`)"
    );
}
