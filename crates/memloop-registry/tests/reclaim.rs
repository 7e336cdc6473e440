#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;

const CAP: u64 = 4096;

#[test]
fn dead_client_of_an_accepted_channel() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.accept(ch, s).unwrap();
    let rep = r.reclaim(c, s).unwrap();
    assert_eq!((rep.channels_marked, rep.channels_freed), (1, 0));
    assert!(r.peer_gone(ch, Side::Server).unwrap());
    assert!(r.channel(ch).unwrap().client_dead);
    assert!(r.rings(ch).is_ok(), "survivor's mapping stays valid");
    r.close(ch, Side::Server).unwrap();
    r.leave(s).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn dead_server_loses_endpoints_and_marks_channels() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let accepted = r.offer(c, ep, CAP, None).unwrap();
    r.accept(accepted, s).unwrap();
    let pending = r.offer(c, ep, CAP, None).unwrap();
    let rep = r.reclaim(s, c).unwrap();
    assert_eq!((rep.endpoints_removed, rep.channels_marked), (1, 1));
    assert!(r.lookup(&native("svc")).is_none());
    assert!(r.peer_gone(accepted, Side::Client).unwrap());
    assert!(
        r.peer_gone(pending, Side::Client).unwrap(),
        "pending offer declined"
    );
    r.close(accepted, Side::Client).unwrap();
    r.close(pending, Side::Client).unwrap();
    r.leave(c).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn dead_client_with_pending_offer_and_closed_server() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let pending = r.offer(c, ep, CAP, None).unwrap();
    let done = r.offer(c, ep, CAP, None).unwrap();
    r.accept(done, s).unwrap();
    r.close(done, Side::Server).unwrap();
    let rep = r.reclaim(c, s).unwrap();
    assert_eq!(rep.channels_freed, 2);
    assert!(matches!(
        r.channel_state(pending),
        Err(RegistryError::Stale)
    ));
    assert_eq!(r.take_offer(ep, s).unwrap(), None);
    assert_eq!(r.backlog(ep).unwrap(), 0);
    r.leave(s).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn self_connection_is_fully_reclaimed() {
    let r = fresh(MIB);
    let m = r.join(&ident(1)).unwrap();
    let ep = r.add_endpoint(m, &native("loop")).unwrap();
    let ch = r.offer(m, ep, CAP, None).unwrap();
    r.accept(ch, m).unwrap();
    r.leave(m).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn reclaim_twice_is_stale_and_unrelated_state_survives() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let other = r.join(&ident(3)).unwrap();
    let ep2 = r.add_endpoint(other, &native("other")).unwrap();
    let ch = r.offer(c, ep2, CAP, None).unwrap();
    r.reclaim(s, c).unwrap();
    assert!(matches!(r.reclaim(s, c), Err(RegistryError::Stale)));
    assert!(r.lookup(&native("other")).is_some());
    assert_eq!(r.channel_state(ch).unwrap(), ChannelState::Offered);
    assert!(matches!(r.take_offer(ep, other), Err(RegistryError::Stale)));
}

/// A side moved to another member (a process that adopted the socket) is that member's: the
/// old owner's death no longer marks it dead, the new owner's does. Both sides can move.
#[test]
fn a_transferred_side_dies_with_its_new_member_only() {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    let adopter = r.join(&ident(3)).unwrap();
    let ch = r.offer(c, ep, CAP, None).unwrap();
    r.accept(ch, s).unwrap();
    assert!(
        r.transfer_side(ch, Side::Server, c, adopter).is_err(),
        "not c's"
    );
    r.transfer_side(ch, Side::Server, s, adopter).unwrap();
    r.transfer_side(ch, Side::Client, c, adopter).unwrap();
    let info = r.channel(ch).unwrap();
    assert_eq!((info.server, info.client), (Some(adopter), adopter));
    r.reclaim(s, adopter).unwrap();
    r.reclaim(c, adopter).unwrap();
    let info = r.channel(ch).unwrap();
    assert!(!info.server_dead && !info.client_dead, "{info:?}");
    r.reclaim(adopter, adopter).unwrap();
    assert!(r.channel(ch).is_err(), "both sides dead: freed");
    assert_eq!(r.usage(), baseline(&r));
}
