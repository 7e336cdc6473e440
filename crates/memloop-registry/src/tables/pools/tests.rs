//! Pools: creation, validation of what a peer could corrupt, the reference scan, lifetime.

use super::*;
use crate::tables::members::test_registry_with_member;
use crate::{EndpointKey, MemberIdentity, Side};
use memloop_ring::{Descriptor, HeldConsumer, SlotProducer};

fn desc(p: &PoolInfo, buf: u32, len: u32) -> Descriptor {
    Descriptor {
        pool: p.id.wire(),
        offset: buf as u64 * p.buf_size as u64,
        len,
        owner: p.owner_tag,
        pool_gen: p.id.gen,
        ..Descriptor::default()
    }
}

/// A descriptor channel offered by `m` to its own endpoint: (producer on c2s, reader of c2s).
fn channel(r: &Registry, m: MemberId) -> (ChannelId, SlotProducer, HeldConsumer) {
    let ep = r
        .add_endpoint(m, &EndpointKey::Native("zc".into()))
        .unwrap();
    let ch = r
        .offer_kind(m, ep, ChannelKind::DescriptorPair, 4096, None)
        .unwrap();
    let rings = r.rings_of(ch, ChannelKind::DescriptorPair).unwrap();
    (
        ch,
        SlotProducer::attach(rings.c2s.clone()).unwrap(),
        HeldConsumer::attach(rings.c2s).unwrap(),
    )
}

#[test]
fn a_pool_is_created_page_aligned_in_its_own_segments() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 1000, 8).unwrap();
    assert_eq!((p.buf_size, p.buffers, p.owner), (1024, 8, m));
    assert_eq!(p.data_off % 4096, 0);
    assert_eq!(p.data_len, 8192);
    assert!(!p.closing);
    assert_eq!(r.pool(p.id).unwrap(), p);
    assert_eq!(r.pools(), vec![p]);
    assert_eq!(r.usage().pools, 1);
    assert!(r.range_tagged(p.id.segment_tag(), p.data_off, p.data_len));
    assert_eq!(r.sweep_orphans(), 0, "its segments are not orphans");
    for (size, n) in [
        (0, 1),
        (64, 0),
        (MAX_POOL_BUFFER + 1, 1),
        (64, MAX_POOL_BUFFERS + 1),
    ] {
        assert!(matches!(
            r.create_pool(m, size, n),
            Err(RegistryError::InvalidParams(_))
        ));
    }
}

#[test]
fn descriptor_ranges_must_lie_inside_one_buffer() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 256, 4).unwrap();
    assert_eq!(p.buffer_of(0, 256), Some(0));
    assert_eq!(p.buffer_of(300, 10), Some(1));
    assert_eq!(p.buffer_of(1023, 1), Some(3));
    for (off, len) in [(0, 0), (200, 100), (1024, 1), (u64::MAX, 1), (0, u32::MAX)] {
        assert_eq!(p.buffer_of(off, len), None, "{off}+{len}");
    }
}

#[test]
fn the_pool_table_fills_with_a_clear_error() {
    let (r, m) = test_registry_with_member("owner");
    for _ in 0..r.params().max_pools {
        r.create_pool(m, 64, 1).unwrap();
    }
    assert!(matches!(
        r.create_pool(m, 64, 1),
        Err(RegistryError::RegionFull {
            what: "buffer pools"
        })
    ));
}

#[test]
fn a_corrupt_pool_entry_is_refused() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 64, 4).unwrap();
    let slot = r.pool_slot(p.id.idx).unwrap();
    let good = slot.ld(F_DATA).unwrap();
    for (field, bad) in [
        (F_DATA, good + 4096),
        (F_GEOMETRY, 64 | 1 << 40),
        (F_NSEG, 0),
    ] {
        let was = slot.ld(field).unwrap();
        slot.st(field, bad).unwrap();
        assert!(
            matches!(r.pool(p.id), Err(RegistryError::Corrupt { .. })),
            "field {field}"
        );
        slot.st(field, was).unwrap();
    }
    assert!(r.pool(p.id).is_ok());
    let stale = PoolId {
        gen: p.id.gen + 1,
        ..p.id
    };
    assert!(matches!(r.pool(stale), Err(RegistryError::Stale)));
}

#[test]
fn references_are_what_descriptor_rings_hold() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 128, 4).unwrap();
    let other = r.create_pool(m, 128, 4).unwrap();
    let (_ch, mut tx, mut rx) = channel(&r, m);
    assert_eq!(r.pool_references(&p).unwrap(), vec![false; 4]);
    tx.push_desc(&desc(&p, 1, 128)).unwrap();
    tx.push_desc(&desc(&p, 3, 10)).unwrap();
    tx.push_desc(&desc(&other, 2, 10)).unwrap();
    assert_eq!(r.pool_references(&p).unwrap(), [false, true, false, true]);
    assert_eq!(
        r.pool_references(&other).unwrap(),
        [false, false, true, false]
    );
    let (a, _) = rx.take().unwrap().unwrap();
    let (b, _) = rx.take().unwrap().unwrap();
    assert_eq!(
        r.pool_references(&p).unwrap(),
        [false, true, false, true],
        "held"
    );
    rx.release(b).unwrap();
    assert_eq!(r.pool_references(&p).unwrap(), [false, true, false, false]);
    rx.release(a).unwrap();
    assert_eq!(r.pool_references(&p).unwrap(), vec![false; 4]);
    // A descriptor of an earlier incarnation of the pool references nothing of this one.
    let mut old = desc(&p, 0, 1);
    old.pool_gen += 1;
    tx.push_desc(&old).unwrap();
    assert_eq!(r.pool_references(&p).unwrap(), vec![false; 4]);
}

#[test]
fn a_closing_pool_goes_when_its_last_reference_is_released() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 4096, 2).unwrap();
    let (_ch, mut tx, mut rx) = channel(&r, m);
    tx.push_desc(&desc(&p, 0, 100)).unwrap();
    let used = r.segments_used();
    r.close_pool(p.id).unwrap();
    assert!(r.pool(p.id).unwrap().closing);
    assert!(!r.collect_pool(p.id).unwrap(), "still referenced");
    let (pos, _) = rx.take().unwrap().unwrap();
    assert!(!r.collect_pool(p.id).unwrap(), "held");
    rx.release(pos).unwrap();
    assert!(r.collect_pool(p.id).unwrap());
    assert!(matches!(r.pool(p.id), Err(RegistryError::Stale)));
    assert_eq!(r.segments_used(), used - 2);
    assert_eq!(r.usage().pools, 0);
}

#[test]
fn a_dead_owners_pools_close_and_a_sweep_frees_them_once_unreferenced() {
    let (r, m) = test_registry_with_member("reader");
    let owner = r
        .join(&MemberIdentity {
            pid: 2,
            start_time: 0,
            boot_id: [0; 16],
            pid_ns: 0,
            net_ns: 0,
            name: "owner".into(),
        })
        .unwrap();
    let p = r.create_pool(owner, 64, 4).unwrap();
    let (ch, mut tx, mut rx) = channel(&r, m);
    tx.push_desc(&desc(&p, 2, 64)).unwrap();
    let rep = r.reclaim_member(owner, m).unwrap();
    assert_eq!(rep.pools_closed, 1);
    assert!(r.pool(p.id).unwrap().closing);
    assert_eq!(
        r.sweep_leftovers().pools_freed,
        0,
        "a reader still holds buffer 2"
    );
    let (pos, _) = rx.take().unwrap().unwrap();
    rx.release(pos).unwrap();
    assert_eq!(r.sweep_leftovers().pools_freed, 1);
    assert!(matches!(r.pool(p.id), Err(RegistryError::Stale)));
    // A channel that goes takes its references along: nothing to release by hand.
    let q = r.create_pool(m, 64, 1).unwrap();
    tx.push_desc(&desc(&q, 0, 1)).unwrap();
    assert_eq!(r.pool_references(&q).unwrap(), [true]);
    r.close(ch, Side::Client).unwrap();
    r.decline(ch).ok();
    assert_eq!(r.pool_references(&q).unwrap(), [false]);
}

#[test]
fn a_cached_scan_finds_channels_offered_after_it_and_skips_freed_ones() {
    let (r, m) = test_registry_with_member("owner");
    let p = r.create_pool(m, 64, 4).unwrap();
    let mut cache = ScanCache::default();
    let (ch1, mut tx1, _rx1) = channel(&r, m);
    tx1.push_desc(&desc(&p, 0, 1)).unwrap();
    assert_eq!(
        r.pool_references_cached(&p, &mut cache).unwrap(),
        [true, false, false, false]
    );
    // Offered after the cache was filled: the epoch moved, so the next scan looks again.
    let ep = r
        .add_endpoint(m, &EndpointKey::Native("zc2".into()))
        .unwrap();
    let ch2 = r
        .offer_kind(m, ep, ChannelKind::DescriptorPair, 4096, None)
        .unwrap();
    let rings = r.rings_of(ch2, ChannelKind::DescriptorPair).unwrap();
    SlotProducer::attach(rings.c2s)
        .unwrap()
        .push_desc(&desc(&p, 2, 1))
        .unwrap();
    assert_eq!(
        r.pool_references_cached(&p, &mut cache).unwrap(),
        [true, false, true, false]
    );
    // Freed: its references go with it, cache or not.
    r.close(ch1, Side::Client).unwrap();
    r.decline(ch1).ok();
    assert_eq!(
        r.pool_references_cached(&p, &mut cache).unwrap(),
        [false, false, true, false]
    );
    assert_eq!(r.pool_references(&p).unwrap(), [false, false, true, false]);
}
