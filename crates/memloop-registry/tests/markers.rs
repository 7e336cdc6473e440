#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;

const CAP: u64 = 4096;

fn tuple(client: &str, server: &str) -> ConnTuple {
    ConnTuple {
        client: client.parse().unwrap(),
        server: server.parse().unwrap(),
    }
}

#[test]
fn marker_lifecycle() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = tuple("10.0.0.1:40000", "10.0.0.2:80");
    let m = r.mark_declined(s, ep, &t).unwrap();
    assert_eq!(r.markers_for_client(t.client), vec![(m, t)]);
    let mapped = "[::ffff:10.0.0.1]:40000".parse().unwrap();
    assert_eq!(
        r.markers_for_client(mapped),
        vec![(m, t)],
        "dual-stack view"
    );
    assert!(r
        .markers_for_client("10.0.0.1:40001".parse().unwrap())
        .is_empty());
    assert!(
        r.offers_from_client(t.client).is_empty(),
        "a marker is no offer"
    );
    assert_eq!(r.find_offer_by_tuple(ep, &t), None);
    let info = r.channel(m).unwrap();
    assert!(info.marker);
    assert_eq!(
        (info.state, info.client, info.server, info.tuple),
        (ChannelState::Declined, s, Some(s), Some(t))
    );
    assert_eq!(r.usage().segments_used, 0, "markers have no rings");
    assert_eq!(r.backlog(ep).unwrap(), 0);
    assert!(matches!(r.rings(m), Err(RegistryError::WrongState { .. })));
    assert!(matches!(
        r.side_words(m, Side::Client),
        Err(RegistryError::WrongState { .. })
    ));
    assert!(matches!(
        r.free_marker(m, c),
        Err(RegistryError::WrongState { .. })
    ));
    r.free_marker(m, s).unwrap();
    assert!(matches!(r.free_marker(m, s), Err(RegistryError::Stale)));
    assert_eq!(r.usage().channels, 0);
    assert!(r.markers_for_client(t.client).is_empty());
}

#[test]
fn markers_are_not_channels_for_client_operations() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = tuple("10.0.0.1:40000", "10.0.0.2:80");
    let m = r.mark_declined(s, ep, &t).unwrap();
    for res in [
        r.cancel(m, s),
        r.cancel(m, c),
        r.close(m, Side::Client),
        r.close(m, Side::Server),
    ] {
        assert!(
            matches!(res, Err(RegistryError::WrongState { .. })),
            "{res:?}"
        );
    }
    assert!(matches!(
        r.accept(m, s),
        Err(RegistryError::WrongState { .. })
    ));
    assert_eq!(r.take_offer(ep, s).unwrap(), None);
    assert!(r.channel(m).unwrap().marker, "still there");
    let ch = r.offer(c, ep, CAP, Some(t)).unwrap();
    assert!(matches!(
        r.free_marker(ch, c),
        Err(RegistryError::WrongState { .. })
    ));
    assert!(!r.channel(ch).unwrap().marker);
}

#[test]
fn client_sees_marker_and_cancels() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = tuple("10.0.0.1:40000", "10.0.0.2:80");
    let m = r.mark_declined(s, ep, &t).unwrap(); // server gave up first
    let ch = r.offer(c, ep, CAP, Some(t)).unwrap();
    assert_eq!(r.markers_for_client(t.client), vec![(m, t)]);
    r.cancel(ch, c).unwrap();
    r.free_marker(m, s).unwrap();
    assert_eq!(
        r.usage(),
        Usage {
            members: 2,
            endpoints: 1,
            ..baseline(&r)
        }
    );
}

#[test]
fn server_finds_late_offer_and_declines_translated_ones() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let seen = tuple("10.0.0.1:40000", "10.0.0.2:8080"); // what the server accepted
    let exact = r.offer(c, ep, CAP, Some(seen)).unwrap();
    let natted = tuple("10.0.0.1:40000", "192.168.1.1:80"); // client dialled a mapped port
    let other = r.offer(c, ep, CAP, Some(natted)).unwrap();
    let m = r.mark_declined(s, ep, &seen).unwrap();
    let mut late = r.offers_from_client(seen.client);
    late.sort_by_key(|(id, _)| id.idx);
    assert_eq!(late, vec![(exact, seen), (other, natted)]);
    for (id, t) in late {
        if t == seen {
            r.accept(id, s).unwrap();
        } else {
            r.decline(id).unwrap();
        }
    }
    assert!(r.offers_from_client(seen.client).is_empty());
    assert!(r.peer_gone(other, Side::Client).unwrap(), "declined");
    assert_eq!(r.channel_state(exact).unwrap(), ChannelState::Accepted);
    // The client of the accepted offer may still see the marker: cancel tells it to stay.
    assert!(matches!(
        r.cancel(exact, c),
        Err(RegistryError::WrongState { .. })
    ));
    r.free_marker(m, s).unwrap();
}

#[test]
fn dead_server_markers_are_reclaimed() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = tuple("10.0.0.1:40000", "10.0.0.2:80");
    let m = r.mark_declined(s, ep, &t).unwrap();
    r.mark_declined(s, ep, &tuple("10.0.0.1:40001", "10.0.0.2:80"))
        .unwrap();
    let rep = r.reclaim(s, c).unwrap();
    assert_eq!(rep.channels_freed, 2);
    assert!(matches!(r.channel(m), Err(RegistryError::Stale)));
    assert!(r.markers_for_client(t.client).is_empty());
    assert_eq!(r.sweep_markers(), 0);
    r.leave(c).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn marker_needs_live_server_and_endpoint() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = tuple("10.0.0.1:40000", "10.0.0.2:80");
    r.remove_endpoint(ep).unwrap();
    assert!(r.mark_declined(s, ep, &t).is_err());
    r.leave(c).unwrap();
    assert!(matches!(
        r.mark_declined(c, ep, &t),
        Err(RegistryError::Stale)
    ));
    assert_eq!(r.usage().channels, 0);
}

/// The Dekker pair on real threads: the two sides never both miss and always agree.
#[test]
fn offer_vs_marker_race_always_agrees() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let (mut ring, mut tcp) = (0, 0);
    for i in 0..400u16 {
        let t = tuple(&format!("10.0.0.1:{}", 10000 + i), "10.0.0.2:80");
        let (rc, rs) = (r.clone(), r.clone());
        let ((ch, saw, client_ring), (marker, server_ring)) = std::thread::scope(|sc| {
            let cl = sc.spawn(move || {
                let ch = rc.offer(c, ep, CAP, Some(t)).unwrap();
                let saw = rc.markers_for_client(t.client).iter().any(|m| m.1 == t);
                let on_ring = !saw || rc.cancel(ch, c).is_err();
                (ch, saw, on_ring)
            });
            let sv = sc.spawn(move || {
                if let Some(id) = rs.find_offer_by_tuple(ep, &t) {
                    rs.accept(id, s).unwrap();
                    return (None, true);
                }
                let m = rs.mark_declined(s, ep, &t).unwrap();
                let late = rs
                    .offers_from_client(t.client)
                    .into_iter()
                    .find(|o| o.1 == t);
                (
                    Some(m),
                    late.is_some_and(|(id, _)| rs.accept(id, s).is_ok()),
                )
            });
            (cl.join().unwrap(), sv.join().unwrap())
        });
        assert!(saw || server_ring, "round {i}: both missed");
        assert_eq!(client_ring, server_ring, "round {i}");
        if server_ring {
            ring += 1;
            r.close(ch, Side::Client).unwrap();
            r.close(ch, Side::Server).unwrap();
        } else {
            tcp += 1;
        }
        if let Some(m) = marker {
            r.free_marker(m, s).unwrap();
        }
        assert_eq!(r.usage().channels, 0, "round {i}");
    }
    assert_eq!(ring + tcp, 400);
}

#[test]
fn the_offers_count_follows_every_move_in_and_out_of_offered() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let t = |port: u16| tuple(&format!("10.0.0.1:{port}"), "10.0.0.2:80");
    assert_eq!(r.offers_outstanding(), 0);
    let a = r.offer(c, ep, CAP, Some(t(1))).unwrap();
    let b = r.offer(c, ep, CAP, Some(t(2))).unwrap();
    let d = r.offer(c, ep, CAP, Some(t(3))).unwrap();
    assert_eq!(r.offers_outstanding(), 3);
    assert_eq!(r.find_offer_by_tuple(ep, &t(1)), Some(a));
    r.accept(a, s).unwrap();
    r.decline(b).unwrap();
    r.cancel(d, c).unwrap();
    assert_eq!(r.offers_outstanding(), 0);
    // With none out, both of the server's scans end at once — and find nothing.
    assert_eq!(r.find_offer_by_tuple(ep, &t(2)), None);
    assert!(r.offers_from_client(t(2).client).is_empty());
    // An offer freed by the reclaim of its dead client is uncounted too.
    let e = r.offer(c, ep, CAP, Some(t(4))).unwrap();
    assert_eq!(r.offers_outstanding(), 1);
    r.reclaim(c, s).unwrap();
    assert!(r.channel(e).is_err() || r.channel_state(e).unwrap() != ChannelState::Offered);
    assert_eq!(r.offers_outstanding(), 0);
}
