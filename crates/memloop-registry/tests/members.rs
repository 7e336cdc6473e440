#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;

#[test]
fn join_publishes_identity_and_addresses() {
    let r = fresh(MIB);
    let id = r.join(&ident(3)).unwrap();
    let addrs: Vec<std::net::IpAddr> =
        vec!["10.1.2.3".parse().unwrap(), "fd00::7".parse().unwrap()];
    r.set_addresses(id, &addrs).unwrap();
    r.heartbeat(id).unwrap();
    r.heartbeat(id).unwrap();
    let m = r.member(id).unwrap();
    assert_eq!(
        (m.identity, m.addresses, m.heartbeat, m.state),
        (ident(3), addrs, 2, MemberState::Live)
    );
    assert_eq!(r.members().len(), 1);
    assert_eq!(r.usage().members, 1);
    r.set_addresses(id, &[]).unwrap();
    assert!(r.member(id).unwrap().addresses.is_empty());
}

#[test]
fn leave_frees_the_slot_and_stales_the_id() {
    let r = fresh(MIB);
    let id = r.join(&ident(1)).unwrap();
    r.leave(id).unwrap();
    assert!(matches!(r.member(id), Err(RegistryError::Stale)));
    assert!(matches!(r.heartbeat(id), Err(RegistryError::Stale)));
    assert!(matches!(r.leave(id), Err(RegistryError::Stale)));
    let again = r.join(&ident(1)).unwrap();
    assert_eq!((again.idx, again.gen), (id.idx, id.gen + 1));
    r.leave(again).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn members_table_fills_up() {
    let r = fresh(MIB);
    let ids: Vec<_> = (0..16).map(|i| r.join(&ident(i)).unwrap()).collect();
    assert!(matches!(
        r.join(&ident(99)),
        Err(RegistryError::RegionFull { what: "members" })
    ));
    r.leave(ids[5]).unwrap();
    assert_eq!(r.join(&ident(99)).unwrap().idx, 5);
}

#[test]
fn bad_identity_and_addresses_are_refused() {
    let r = fresh(MIB);
    let mut long = ident(1);
    long.name = "x".repeat(33);
    assert!(matches!(
        r.join(&long),
        Err(RegistryError::InvalidParams(_))
    ));
    let id = r.join(&ident(1)).unwrap();
    let many = vec!["1.2.3.4".parse().unwrap(); 9];
    assert!(matches!(
        r.set_addresses(id, &many),
        Err(RegistryError::InvalidParams(_))
    ));
    assert!(matches!(
        r.member(MemberId { idx: 1000, gen: 0 }),
        Err(RegistryError::NotFound)
    ));
}
