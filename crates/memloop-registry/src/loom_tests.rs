//! loom models of the races that matter most: a client cancelling its offer while the server
//! takes it, a client's offer racing a server's decline marker (transparent TCP), and two
//! channels allocating ring segments at once. The region is tiny
//! (loom models every 8 bytes of it as an atomic).

use crate::key::{ChannelId, ConnTuple, EndpointId, EndpointKey, MemberId};
use crate::{ChannelState, MemberIdentity, RegionParams, Registry, RegistryError, ShmSlice};
use loom::thread;

/// Header 512 + 2 members + 2 endpoints + 2 channels (320 B each) + 1 connection record + 1 pool
/// + 1 link (512 B), segment tags, then four 256-byte segments.
const SIZE: u64 = 3840;

fn tiny() -> RegionParams {
    RegionParams {
        size: SIZE,
        max_members: 2,
        max_endpoints: 2,
        max_channels: 2,
        segment_size: 256,
        max_conns: 1,
        max_pools: 1,
        max_links: 1,
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

/// The transparent-TCP agreement when the client's offer and the server's decline marker race:
/// the client publishes its offer then scans markers; the server, having found no offer,
/// publishes a marker then scans offers once more. Both must end up on the same path: either
/// the server accepts the offer (ring) or the client sees the marker and cancels it (TCP).
#[test]
fn offer_races_decline_marker_and_both_agree() {
    model(|| {
        let (r, c, s, ep, t) = client_and_server();
        let rc = r.clone();
        let client = thread::spawn(move || {
            let ch = rc.offer(c, ep, 64, Some(t)).unwrap();
            let saw = rc.markers_for_client(t.client).iter().any(|m| m.1 == t);
            let ring = !saw
                || match rc.cancel(ch, c) {
                    Ok(()) => false,
                    Err(RegistryError::WrongState { .. }) => true, // accepted first
                    Err(e) => panic!("cancel: {e}"),
                };
            (ch, saw, ring)
        });
        let (marker, server_ring) = serve(&r, s, ep, &t);
        let (ch, saw, client_ring) = client.join().unwrap();
        assert!(
            saw || server_ring,
            "both missed: the client would wait forever"
        );
        assert_eq!(
            client_ring, server_ring,
            "client ring {client_ring}, server ring {server_ring}"
        );
        if let Some(m) = marker {
            r.free_marker(m, s).unwrap();
        }
        let usage = r.usage();
        if server_ring {
            assert_eq!(r.channel_state(ch).unwrap(), ChannelState::Accepted);
            assert_eq!(usage.channels, 1);
        } else {
            assert!(r.channel_state(ch).is_err(), "cancelled offer freed");
            assert_eq!((usage.channels, usage.segments_used), (0, 0));
        }
    });
}

/// A fresh tiny region with a client member, a server member, the server's endpoint and the
/// connection's 4-tuple.
fn client_and_server() -> (Registry, MemberId, MemberId, EndpointId, ConnTuple) {
    let r = Registry::init(ShmSlice::new_model(SIZE as usize), &tiny()).unwrap();
    let c = r.join(&ident(1)).unwrap();
    let s = r.join(&ident(2)).unwrap();
    let ep = r.add_endpoint(s, &EndpointKey::Native("s".into())).unwrap();
    let t = ConnTuple {
        client: "10.0.0.1:4000".parse().unwrap(),
        server: "10.0.0.2:80".parse().unwrap(),
    };
    (r, c, s, ep, t)
}

/// The server side: look for the offer; if none, publish a marker and look once more.
/// Returns (the marker, whether the connection is on the ring).
fn serve(r: &Registry, s: MemberId, ep: EndpointId, t: &ConnTuple) -> (Option<ChannelId>, bool) {
    if let Some(id) = r.find_offer_by_tuple(ep, t) {
        // No marker yet, so the client cannot have cancelled: the accept must win.
        r.accept(id, s).unwrap();
        return (None, true);
    }
    let m = r.mark_declined(s, ep, t).unwrap();
    let late = r
        .offers_from_client(t.client)
        .into_iter()
        .find(|o| o.1 == *t);
    let ring = late.is_some_and(|(id, _)| r.accept(id, s).is_ok());
    (Some(m), ring)
}

/// A client whose offer goes unanswered cancels it and stays on TCP, armed for a late ring: it
/// will look for the server's decline marker. A server that accepts the connection finds
/// neither an offer nor an announced connect, and publishes a marker only while some client
/// counts as looking (`late_clients_looking`). So the client counts itself *before* it cancels
/// its offer and withdraws its announcement: then a server that skips the marker never leaves
/// a looking client without one. `count_first == false` is the control (counted after).
fn late_client_seen_by_a_server_after_its_connect(count_first: bool) {
    use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    model(move || {
        let (r, c, s, ep, t) = client_and_server();
        // The kernel's handshake: the server's accept returns after the client's connect.
        let connected = Arc::new(AtomicBool::new(false));
        let (rc, conn) = (r.clone(), connected.clone());
        let client = thread::spawn(move || {
            let announced = rc.endpoint_connecting(ep).unwrap();
            announced.fetch_add(1, SeqCst);
            let ch = rc.offer(c, ep, 64, Some(t)).unwrap();
            conn.store(true, SeqCst);
            // The decide wait ran out: cancel (unless accepted), then stop announcing.
            if count_first {
                rc.late_clients_add(true);
            }
            let looking = rc.cancel(ch, c).is_ok();
            announced.fetch_sub(1, SeqCst);
            if !count_first && looking {
                rc.late_clients_add(true);
            }
            looking
        });
        while !connected.load(SeqCst) {
            thread::yield_now();
        }
        let announced = r.endpoint_connecting(ep).unwrap().load(SeqCst) > 0;
        let offer = r.find_offer_by_tuple(ep, &t);
        let skipped = !announced && offer.is_none() && !r.late_clients_looking();
        let ring = offer.is_some_and(|id| r.accept(id, s).is_ok());
        let looking = client.join().unwrap();
        assert!(
            !(skipped && looking),
            "the server published no marker for a client that looks for one"
        );
        assert!(!(ring && looking), "accepted and cancelled");
    });
}

#[test]
fn late_client_counts_itself_before_it_stops_being_seen() {
    late_client_seen_by_a_server_after_its_connect(true);
}

#[test]
#[should_panic(expected = "no marker for a client that looks")]
fn late_client_counted_after_it_withdrew_is_missed() {
    late_client_seen_by_a_server_after_its_connect(false);
}
