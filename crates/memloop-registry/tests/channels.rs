#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;

const CAP: u64 = 4096;

#[test]
fn full_lifecycle_frees_everything() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    assert_eq!(r.channel_state(ch).unwrap(), ChannelState::Offered);
    assert!(r.usage().segments_used > 0);
    assert_eq!(r.take_offer(ep, s).unwrap(), Some(ch));
    assert_eq!(r.take_offer(ep, s).unwrap(), None);
    assert_eq!(r.backlog(ep).unwrap(), 0);
    let info = r.channel(ch).unwrap();
    assert_eq!(
        (
            info.state,
            info.client,
            info.server,
            info.endpoint,
            info.ring_capacity
        ),
        (ChannelState::Accepted, c, Some(s), ep, CAP)
    );
    let rings = r.rings(ch).unwrap();
    assert_eq!(rings.c2s.len() as u64, memloop_ring::ring_bytes(CAP));
    assert!(!r.peer_gone(ch, Side::Server).unwrap());
    r.close(ch, Side::Client).unwrap();
    r.close(ch, Side::Client).unwrap(); // idempotent
    assert!(r.peer_gone(ch, Side::Server).unwrap());
    assert!(!r.peer_gone(ch, Side::Client).unwrap());
    assert_eq!(
        r.usage().channels,
        1,
        "survivor keeps the memory until it closes"
    );
    r.close(ch, Side::Server).unwrap();
    assert!(matches!(r.channel_state(ch), Err(RegistryError::Stale)));
    assert_eq!(r.usage().segments_used, 0);
    r.leave(c).unwrap();
    r.leave(s).unwrap();
    assert_eq!(r.usage(), baseline(&r));
    assert_eq!(r.sweep_orphans(), 0);
}

#[test]
fn rings_of_a_channel_are_usable_and_disjoint() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let a = r.offer(c, ep, CAP, None).unwrap();
    let b = r.offer(c, ep, CAP, None).unwrap();
    r.accept(a, s).unwrap();
    let (ra, rb) = (r.rings(a).unwrap(), r.rings(b).unwrap());
    ra.c2s.write(300, b"a-c2s").unwrap();
    ra.s2c.write(300, b"a-s2c").unwrap();
    rb.c2s.write(300, b"b-c2s").unwrap();
    let mut buf = [0u8; 5];
    ra.c2s.read(300, &mut buf).unwrap();
    assert_eq!(&buf, b"a-c2s");
    let mut p = memloop_ring::StreamProducer::attach(ra.c2s.clone()).unwrap();
    let mut q = memloop_ring::StreamConsumer::attach(ra.c2s.clone()).unwrap();
    assert_eq!(p.write(b"hello").unwrap(), 5);
    let mut out = [0u8; 8];
    assert_eq!(q.read(&mut out).unwrap(), 5);
}

#[test]
fn oldest_offer_is_taken_first() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let first = r.offer(c, ep, CAP, None).unwrap();
    let second = r.offer(c, ep, CAP, None).unwrap();
    r.cancel(first, c).unwrap();
    let third = offer_in_slot(&r, c, ep, CAP, first.idx); // the first slot, but newer
    assert_eq!(third.idx, first.idx);
    assert_eq!(r.take_offer(ep, s).unwrap(), Some(second));
    assert_eq!(r.take_offer(ep, s).unwrap(), Some(third));
}

#[test]
fn cancel_before_accept_and_after_accept() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.cancel(ch, c).unwrap();
    assert_eq!(r.take_offer(ep, s).unwrap(), None);
    assert!(matches!(r.accept(ch, s), Err(RegistryError::Stale)));
    assert_eq!(r.usage().channels, 0);
    assert_eq!(r.usage().segments_used, 0);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.accept(ch, s).unwrap();
    assert!(matches!(
        r.cancel(ch, c),
        Err(RegistryError::WrongState {
            expected: "OFFERED",
            found: "ACCEPTED"
        })
    ));
    assert!(
        matches!(r.cancel(ch, s), Err(RegistryError::WrongState { .. })),
        "only the client cancels"
    );
}

#[test]
fn cancel_vs_accept_race_has_one_outcome() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let (mut accepted, mut cancelled) = (0, 0);
    for _ in 0..300 {
        let ch = r.offer(c, ep, CAP, None).unwrap();
        let (rc, rs) = (r.clone(), r.clone());
        let (cancel, take) = std::thread::scope(|sc| {
            let a = sc.spawn(move || rc.cancel(ch, c));
            let b = sc.spawn(move || rs.take_offer(ep, s));
            (a.join().unwrap(), b.join().unwrap().unwrap())
        });
        match (cancel, take) {
            (Ok(()), None) => cancelled += 1,
            (Err(RegistryError::WrongState { .. }), Some(t)) => {
                assert_eq!(t, ch);
                accepted += 1;
                r.close(ch, Side::Client).unwrap();
                r.close(ch, Side::Server).unwrap();
            }
            (c, t) => panic!("disagreement: cancel {c:?}, take {t:?}"),
        }
        assert_eq!(r.usage().channels, 0);
    }
    assert_eq!(accepted + cancelled, 300);
}

#[test]
fn decline_then_client_frees() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.decline(ch).unwrap();
    r.decline(ch).unwrap();
    assert_eq!(r.channel_state(ch).unwrap(), ChannelState::Declined);
    assert!(r.peer_gone(ch, Side::Client).unwrap());
    assert!(matches!(
        r.accept(ch, s),
        Err(RegistryError::WrongState { .. })
    ));
    assert_eq!(r.backlog(ep).unwrap(), 0);
    r.close(ch, Side::Client).unwrap();
    assert_eq!(r.usage().channels, 0);
    assert_eq!(r.usage().segments_used, 0);
}

#[test]
fn transparent_accept_by_tuple() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t1 = ConnTuple {
        client: "10.0.0.1:40000".parse().unwrap(),
        server: "10.0.0.2:80".parse().unwrap(),
    };
    let t2 = ConnTuple {
        client: "10.0.0.1:40001".parse().unwrap(),
        ..t1
    };
    let a = r.offer(c, ep, CAP, Some(t1)).unwrap();
    let b = r.offer(c, ep, CAP, Some(t2)).unwrap();
    assert_eq!(r.find_offer_by_tuple(ep, &t2), Some(b));
    assert_eq!(r.find_offer_by_tuple(ep, &t1), Some(a));
    r.accept(b, s).unwrap();
    assert_eq!(r.find_offer_by_tuple(ep, &t2), None);
    assert_eq!(r.channel(b).unwrap().tuple, Some(t2));
    assert_eq!(r.channels().len(), 2);
}

#[test]
fn ring_memory_and_channel_slots_run_out_cleanly() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let mut ids = Vec::new();
    let err = loop {
        match r.offer(c, ep, 64 * 1024, None) {
            Ok(id) => ids.push(id),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            err,
            RegistryError::RegionFull {
                what: "ring memory"
            }
        ),
        "{err}"
    );
    assert_eq!(
        r.usage().channels as usize,
        ids.len(),
        "the failed reservation was returned"
    );
    for id in ids.drain(..) {
        r.cancel(id, c).unwrap();
    }
    let err = loop {
        match r.offer(c, ep, 64, None) {
            Ok(id) => ids.push(id),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, RegistryError::RegionFull { what: "channels" }),
        "{err}"
    );
    assert_eq!(ids.len(), 32);
    for id in ids {
        r.take_offer(ep, s).unwrap().unwrap();
        r.close(id, Side::Client).unwrap();
        r.close(id, Side::Server).unwrap();
    }
    assert_eq!(r.usage().channels, 0);
    assert_eq!(r.usage().segments_used, 0);
}

#[test]
fn stale_ids_fail_cleanly() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.cancel(ch, c).unwrap();
    let reused = offer_in_slot(&r, c, ep, CAP, ch.idx);
    assert_eq!(reused.idx, ch.idx);
    assert!(matches!(r.channel_state(ch), Err(RegistryError::Stale)));
    assert!(matches!(r.rings(ch), Err(RegistryError::Stale)));
    assert!(matches!(
        r.close(ch, Side::Client),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(r.accept(ch, s), Err(RegistryError::Stale)));
    assert!(matches!(r.decline(ch), Err(RegistryError::Stale)));
    assert!(matches!(
        r.peer_gone(ch, Side::Server),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(
        r.channel(ChannelId { idx: 9999, gen: 0 }),
        Err(RegistryError::NotFound)
    ));
    assert_eq!(r.channel_state(reused).unwrap(), ChannelState::Offered);
    assert!(matches!(
        r.offer(c, ep, 1000, None),
        Err(RegistryError::InvalidParams(_))
    ));
}

#[test]
fn removing_an_endpoint_declines_its_offers() {
    let r = fresh(MIB);
    let (c, _s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.remove_endpoint(ep).unwrap();
    assert_eq!(r.channel_state(ch).unwrap(), ChannelState::Declined);
    assert!(matches!(
        r.offer(c, ep, CAP, None),
        Err(RegistryError::Stale)
    ));
    r.cancel(ch, c).unwrap();
    assert_eq!(r.usage().channels, 0);
}

#[test]
fn side_words_start_with_one_holder_and_are_reinitialised() {
    use std::sync::atomic::Ordering::SeqCst;
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    let client = r.side_words(ch, Side::Client).unwrap(); // a client may fork before accept
    assert_eq!(
        (client.holders.load(SeqCst), client.lock.load(SeqCst)),
        (1, 0)
    );
    r.accept(ch, s).unwrap();
    let server = r.side_words(ch, Side::Server).unwrap();
    assert_eq!(
        (server.holders.load(SeqCst), server.lock.load(SeqCst)),
        (1, 0)
    );
    // after fork: two holders of the client side, one of them locking it
    client.holders.fetch_add(1, SeqCst);
    client.lock.store(4242, SeqCst);
    let again = r.side_words(ch, Side::Client).unwrap();
    assert_eq!(
        (again.holders.load(SeqCst), again.lock.load(SeqCst)),
        (2, 4242)
    );
    assert_eq!(server.holders.load(SeqCst), 1, "sides are separate words");
    r.close(ch, Side::Client).unwrap();
    r.close(ch, Side::Server).unwrap();
    assert!(matches!(
        r.side_words(ch, Side::Client),
        Err(RegistryError::Stale)
    ));
    let next = offer_in_slot(&r, c, ep, CAP, ch.idx);
    assert_eq!(next.idx, ch.idx, "slot reused");
    for side in [Side::Client, Side::Server] {
        let w = r.side_words(next, side).unwrap();
        assert_eq!((w.holders.load(SeqCst), w.lock.load(SeqCst)), (1, 0));
    }
    r.decline(next).unwrap();
    assert!(matches!(
        r.side_words(next, Side::Client),
        Err(RegistryError::WrongState { .. })
    ));
}
