//! Links: joining and taking over halves, one slot per name under racing creators, freeing
//! against claims, what a reader makes of a scribbled slot, counters, reclaim.

use super::*;
use crate::{MemberIdentity, RegionParams, ShmSlice};
use proptest::prelude::*;
use std::sync::Barrier;

fn setup(n: u32) -> (Registry, Vec<MemberId>) {
    let p = RegionParams::small(1 << 20);
    let r = Registry::init(ShmSlice::new_heap(p.size as usize), &p).unwrap();
    let ids = (0..n)
        .map(|i| {
            let ident = MemberIdentity {
                pid: 100 + i,
                start_time: 0,
                boot_id: [0; 16],
                pid_ns: 0,
                net_ns: 0,
                name: format!("m{i}"),
            };
            r.join(&ident).unwrap()
        })
        .collect();
    (r, ids)
}

fn yes(_: MemberId) -> bool {
    true
}

fn desc() -> LinkHalfDesc {
    LinkHalfDesc {
        pid: 4242,
        mtu: 9000,
        ifname: "mltun0".into(),
        ipv4: Some((Ipv4Addr::new(10, 9, 0, 1), 30)),
        ipv6: Some(("fd00::1".parse().unwrap(), 64)),
        offloads: 0b101,
    }
}

fn half(r: &Registry, l: LinkRef, h: usize) -> Option<LinkHalf> {
    r.link(l).unwrap().halves[h].clone()
}

/// Slot `idx` made NAMED `name` by hand, as a creator tagged `tag` leaves it before its scan.
fn named_by_hand(r: &Registry, name: &str, tag: u32) -> (u32, StateWord) {
    let (slot, reserved) = r.reserve_link(tag).unwrap();
    slot.build(&LinkName::new(name).unwrap()).unwrap();
    let named = reserved.with_low(L_NAMED);
    assert!(slot.cas(reserved, named).unwrap());
    (slot.0.idx(), named)
}

#[test]
fn a_join_creates_the_link_and_the_second_takes_the_other_half() {
    let (r, m) = setup(3);
    let (l, h) = r.link_join("wan0", m[0], yes).unwrap();
    assert_eq!(h, 0);
    assert_eq!(r.usage().links, 1);
    assert_eq!(r.link_join("wan0", m[1], yes).unwrap(), (l, 1));
    assert_eq!(
        r.link_join("wan0", m[0], yes).unwrap(),
        (l, 0),
        "a member joining again gets its half back"
    );
    let all = r.links().unwrap();
    assert_eq!(all.len(), 1);
    let info = &all[0];
    assert_eq!((info.link, info.name.as_str()), (l, "wan0"));
    for (h, who) in [(0, m[0]), (1, m[1])] {
        let half = info.halves[h].clone().unwrap();
        assert_eq!(half.member, who);
        assert!(!half.carrier);
        assert_eq!((half.pid, half.mtu, half.ifname.as_str()), (0, 0, ""));
        assert_eq!((half.ipv4, half.ipv6), (None, None));
        assert_eq!(half.counters, LinkCounters::default());
    }
    let (other, h) = r.link_join("lan1", m[2], yes).unwrap();
    assert_ne!(other.idx, l.idx);
    assert_eq!(h, 0);
    assert_eq!(r.links().unwrap().len(), 2);
    assert_eq!(r.usage().links, 2);
}

#[test]
fn a_third_join_finds_the_link_busy() {
    let (r, m) = setup(3);
    r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    let e = r.link_join("wan0", m[2], yes).unwrap_err();
    assert!(
        matches!(&e, RegistryError::LinkBusy { name } if name == "wan0"),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "link \"wan0\" is busy: both of its sides are held by live members"
    );
    assert_eq!(r.usage().links, 1, "no slot left behind");
}

#[test]
fn a_dead_half_is_taken_over_afresh_but_keeps_counting_restarts() {
    let (r, m) = setup(3);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    r.link_describe(l, 0, &desc()).unwrap();
    r.link_set_carrier(l, 0, true).unwrap();
    let delta = LinkCounters {
        tx_packets: 5,
        rx_bytes: 700,
        drops_bad: 1,
        restarts: 2,
        ..LinkCounters::default()
    };
    r.link_count(l, 0, &delta).unwrap();
    // m[0] is dead by the caller's test (the registry still has it LIVE).
    let (l2, h) = r.link_join("wan0", m[2], |x| x != m[0]).unwrap();
    assert_eq!((l2, h), (l, 0));
    let half = half(&r, l, 0).unwrap();
    assert_eq!(half.member, m[2]);
    assert_eq!(
        (half.pid, half.mtu, half.ifname.as_str(), half.offloads),
        (0, 0, "", 0)
    );
    assert!(!half.carrier);
    assert_eq!((half.ipv4, half.ipv6), (None, None));
    let carried = LinkCounters {
        restarts: 2,
        ..LinkCounters::default()
    };
    assert_eq!(half.counters, carried);
    let session = LinkCounters {
        restarts: 1,
        ..LinkCounters::default()
    };
    r.link_count(l, 0, &session).unwrap();
    assert_eq!(
        r.link(l).unwrap().halves[0]
            .as_ref()
            .unwrap()
            .counters
            .restarts,
        3
    );
    // The old holder's leave is refused: the half is not its any more.
    assert!(matches!(
        r.link_leave(l, 0, m[0]),
        Err(RegistryError::Stale)
    ));
    assert_eq!(half.member, m[2]);
    assert_eq!(half_member(&r, l, 1), Some(m[1]), "the live half stays");
}

fn half_member(r: &Registry, l: LinkRef, h: usize) -> Option<MemberId> {
    half(r, l, h).map(|x| x.member)
}

#[test]
fn a_half_of_a_member_the_registry_no_longer_has_is_free() {
    let (r, m) = setup(3);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    // m[0]'s member slot freed without a reclaim of its links (a reclaimer that died).
    let slot = r.member_slot(m[0].idx).unwrap();
    let w = slot.word().unwrap();
    assert!(slot.cas(w, w.next_gen(0)).unwrap());
    assert_eq!(r.link_join("wan0", m[2], yes).unwrap(), (l, 0));
}

#[test]
fn leaving_both_halves_frees_the_slot() {
    let (r, m) = setup(2);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    r.link_set_carrier(l, 0, true).unwrap();
    r.link_leave(l, 0, m[0]).unwrap();
    assert_eq!(half(&r, l, 0), None);
    assert_eq!(r.link_slot(l.idx).unwrap().0.ld(64 + F_FLAGS).unwrap(), 0);
    assert!(matches!(
        r.link_leave(l, 0, m[0]),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(
        r.link_leave(l, 1, m[0]),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(
        r.link_set_carrier(l, 0, true),
        Err(RegistryError::Stale)
    ));
    assert_eq!(r.usage().links, 1, "one half is still held");
    r.link_leave(l, 1, m[1]).unwrap();
    assert_eq!(r.usage().links, 0);
    assert!(r.links().unwrap().is_empty());
    assert!(matches!(r.link(l), Err(RegistryError::Stale)));
    assert!(matches!(
        r.link_describe(l, 1, &desc()),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(
        r.link_count(l, 1, &LinkCounters::default()),
        Err(RegistryError::Stale)
    ));
    let (again, h) = r.link_join("wan0", m[1], yes).unwrap();
    assert_eq!((again.idx, h), (l.idx, 0));
    assert_ne!(again.gen, l.gen, "a new incarnation");
}

#[test]
fn names_and_descriptions_out_of_range_are_refused() {
    let (r, m) = setup(1);
    for name in [String::new(), "x".repeat(49), "é".repeat(25)] {
        let e = r.link_join(&name, m[0], yes).unwrap_err();
        assert!(
            matches!(&e, RegistryError::BadLinkName { len, max: 48, .. } if *len == name.len()),
            "{e}"
        );
        assert!(e.to_string().contains("1 to 48 bytes"), "{e}");
    }
    let longest = "é".repeat(24);
    let (l, h) = r.link_join(&longest, m[0], yes).unwrap();
    assert_eq!(r.link(l).unwrap().name, longest);
    for d in [
        LinkHalfDesc {
            ifname: "x".repeat(16),
            ..desc()
        },
        LinkHalfDesc {
            ifname: "tun\0".into(),
            ..desc()
        },
        LinkHalfDesc {
            ipv4: Some((Ipv4Addr::LOCALHOST, 33)),
            ..desc()
        },
        LinkHalfDesc {
            ipv6: Some((Ipv6Addr::LOCALHOST, 129)),
            ..desc()
        },
    ] {
        assert!(
            matches!(
                r.link_describe(l, h, &d),
                Err(RegistryError::InvalidParams(_))
            ),
            "{d:?}"
        );
    }
    assert!(matches!(
        r.link_describe(l, 2, &desc()),
        Err(RegistryError::InvalidParams(_))
    ));
    let stale = LinkRef {
        gen: l.gen + 1,
        ..l
    };
    assert!(matches!(
        r.link_describe(stale, h, &desc()),
        Err(RegistryError::Stale)
    ));
    assert!(matches!(
        r.link(LinkRef {
            idx: r.params().max_links,
            gen: 0
        }),
        Err(RegistryError::NotFound)
    ));
}

#[test]
fn a_description_reads_back_as_written() {
    let (r, m) = setup(1);
    let (l, h) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_describe(l, h, &desc()).unwrap();
    r.link_set_carrier(l, h, true).unwrap();
    let half = half(&r, l, 0).unwrap();
    let d = desc();
    assert_eq!(
        (half.pid, half.mtu, half.ifname, half.ipv4, half.ipv6),
        (d.pid, d.mtu, d.ifname, d.ipv4, d.ipv6)
    );
    assert_eq!(half.offloads, d.offloads);
    assert!(half.carrier);
    r.link_set_carrier(l, h, false).unwrap();
    assert!(!r.link(l).unwrap().halves[0].as_ref().unwrap().carrier);
    let none = LinkHalfDesc {
        ipv4: None,
        ipv6: Some((Ipv6Addr::UNSPECIFIED, 0)),
        ..desc()
    };
    r.link_describe(l, h, &none).unwrap();
    let half = r.link(l).unwrap().halves[0].clone().unwrap();
    assert_eq!(
        (half.ipv4, half.ipv6),
        (None, Some((Ipv6Addr::UNSPECIFIED, 0)))
    );
}

#[test]
fn counters_add_up() {
    let (r, m) = setup(2);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    let a = LinkCounters {
        tx_packets: 3,
        tx_bytes: 4500,
        rx_packets: 2,
        rx_bytes: 128,
        drops_full: 1,
        drops_bad: 0,
        restarts: 0,
    };
    let b = LinkCounters {
        tx_packets: 1,
        tx_bytes: 60,
        drops_bad: 7,
        restarts: 1,
        ..LinkCounters::default()
    };
    r.link_count(l, 0, &a).unwrap();
    r.link_count(l, 0, &b).unwrap();
    r.link_count(l, 0, &LinkCounters::default()).unwrap();
    r.link_count(l, 1, &b).unwrap();
    let want0 = LinkCounters {
        tx_packets: 4,
        tx_bytes: 4560,
        rx_packets: 2,
        rx_bytes: 128,
        drops_full: 1,
        drops_bad: 7,
        restarts: 1,
    };
    assert_eq!(half(&r, l, 0).unwrap().counters, want0);
    let want1 = b;
    assert_eq!(half(&r, l, 1).unwrap().counters, want1);
    r.link_leave(l, 1, m[1]).unwrap();
    assert!(matches!(r.link_count(l, 1, &a), Err(RegistryError::Stale)));
}

#[test]
fn racing_creators_end_on_one_slot() {
    let (r, m) = setup(6);
    let barrier = Barrier::new(m.len());
    for round in 0..40 {
        let name = format!("race{round}");
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = m
                .iter()
                .map(|&me| {
                    let (r, name, barrier) = (&r, &name, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        r.link_join(name, me, yes).map(|j| (me, j))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let joined: Vec<_> = results.iter().filter_map(|x| x.as_ref().ok()).collect();
        assert_eq!(joined.len(), 2, "round {round}: {results:?}");
        assert_eq!(joined[0].1 .0, joined[1].1 .0, "one link");
        assert_ne!(joined[0].1 .1, joined[1].1 .1, "two halves");
        for e in results.iter().filter_map(|x| x.as_ref().err()) {
            assert!(matches!(e, RegistryError::LinkBusy { .. }), "{e}");
        }
        let same: Vec<_> = r
            .links()
            .unwrap()
            .into_iter()
            .filter(|i| i.name == name)
            .collect();
        assert_eq!(same.len(), 1);
        assert_eq!(r.usage().links, 1, "losers freed their slots");
        for &&(me, (l, h)) in &joined {
            r.link_leave(l, h, me).unwrap();
        }
        assert_eq!(r.usage().links, 0);
    }
}

#[test]
fn a_named_rival_at_a_lower_index_wins() {
    let (r, m) = setup(2);
    let (rival, named) = named_by_hand(&r, "wan0", member_tag(m[1]));
    let key = LinkName::new("wan0").unwrap();
    assert_eq!(r.create_link(&key, m[0]).unwrap(), None, "we back off");
    assert_eq!(r.usage().links, 1, "and our slot is free again");
    let slot = r.link_slot(rival).unwrap();
    assert!(slot
        .cas(named, StateWord::new(named.gen(), 0, L_LIVE))
        .unwrap());
    let (l, h) = r.link_join("wan0", m[0], yes).unwrap();
    assert_eq!((l.idx, h), (rival, 0), "the winner is joined");
}

#[test]
fn a_live_rival_wins_and_a_stuck_higher_one_of_a_dead_creator_goes() {
    let (r, m) = setup(2);
    let (l, _) = r.link_join("wan0", m[1], yes).unwrap();
    let key = LinkName::new("wan0").unwrap();
    assert_eq!(r.create_link(&key, m[0]).unwrap(), None);
    assert_eq!(r.usage().links, 1);
    r.link_leave(l, 0, m[1]).unwrap();
    // A creator that died between publishing the name and its scan, above a free slot.
    let (low, w) = named_by_hand(&r, "placeholder", member_tag(m[0]));
    let dead = MemberId { idx: 9, gen: 3 };
    let (high, _) = named_by_hand(&r, "wan0", member_tag(dead));
    assert!(high > low);
    let slot = r.link_slot(low).unwrap();
    assert!(slot.cas(w, w.next_gen(L_FREE)).unwrap());
    let (l, h) = r.link_join("wan0", m[0], yes).unwrap();
    assert_eq!((l.idx, h), (low, 0));
    assert_eq!(r.usage().links, 1, "the dead creator's slot went");
}

#[test]
fn claims_and_frees_race_without_losing_a_half_or_a_slot() {
    let (r, m) = setup(2);
    std::thread::scope(|s| {
        for &me in &m {
            let r = &r;
            s.spawn(move || {
                for _ in 0..3000 {
                    let (l, h) = r.link_join("flap", me, yes).unwrap();
                    let info = r.link(l).unwrap();
                    assert_eq!(info.name, "flap");
                    let mine = info.halves[h as usize].as_ref().map(|x| x.member);
                    assert_eq!(mine, Some(me), "we hold what we joined");
                    r.link_count(l, h, &LinkCounters::default()).unwrap();
                    r.link_leave(l, h, me).unwrap();
                }
            });
        }
    });
    assert_eq!(r.usage().links, 0);
}

#[test]
fn a_closing_slot_is_settled_by_whoever_finds_it() {
    let (r, m) = setup(3);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    let slot = r.link_slot(l.idx).unwrap();
    // A freer that died right after LIVE → CLOSING (it missed m[0]'s claim).
    let live = slot.word().unwrap();
    let closing = live.with_low(L_CLOSING);
    assert!(slot.cas(live, closing).unwrap());
    assert_eq!(r.links().unwrap().len(), 1, "still listed");
    assert_eq!(r.link_join("wan0", m[1], yes).unwrap(), (l, 1));
    let reopened = slot.word().unwrap();
    assert_eq!((reopened.low(), reopened.gen()), (L_LIVE, l.gen));
    assert!(
        !r.settle_link(&slot, closing).unwrap(),
        "a stale freer's word no longer matches"
    );
    assert_eq!(slot.word().unwrap(), reopened);
    // Both halves emptied by a freer that died CLOSING: the next joiner frees and recreates.
    for base in HALVES {
        slot.0.st(base + F_MEMBER, 0).unwrap();
    }
    assert!(slot.cas(reopened, reopened.with_low(L_CLOSING)).unwrap());
    let (again, h) = r.link_join("wan0", m[2], yes).unwrap();
    assert_eq!((again.idx, h), (l.idx, 0));
    assert_ne!(again.gen, l.gen);
    assert_eq!(r.usage().links, 1);
}

#[test]
fn a_claim_on_a_freed_slot_is_undone() {
    let (r, m) = setup(1);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_leave(l, 0, m[0]).unwrap();
    assert!(matches!(r.claim_half(l, m[0], &yes).unwrap(), Claim::Gone));
    let slot = r.link_slot(l.idx).unwrap();
    assert_eq!(slot.member(0).unwrap(), 0);
    assert_eq!(slot.word().unwrap().low(), L_FREE);
}

#[test]
fn links_survive_garbage() {
    let (r, m) = setup(2);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    r.link_describe(l, 0, &desc()).unwrap();
    let slot = r.link_slot(l.idx).unwrap();
    let h0 = HALVES[0];
    slot.0.st(F_NAME_LEN, 1000).unwrap();
    slot.0.st(h0 + F_DESC + 24, u64::MAX).unwrap(); // interface name: 0xff, no NUL
    slot.0.st(h0 + F_DESC + 32, u64::MAX).unwrap();
    slot.0.st(h0 + F_DESC + 16, 0xffff).unwrap(); // prefixes 254 and 254
    slot.0.st(h0 + F_SEQ, 7).unwrap(); // a writer that never finishes
    slot.0.st(HALVES[1] + F_MEMBER, u64::MAX).unwrap(); // not a member
    let info = r.link(l).unwrap();
    assert_eq!(info.name, "?");
    let h = info.halves[0].as_ref().unwrap();
    assert_eq!(h.ifname, "\u{fffd}".repeat(16));
    assert_eq!((h.ipv4, h.ipv6), (None, None));
    assert_eq!((h.pid, h.mtu), (4242, 9000));
    assert_eq!(info.halves[1], None);
    slot.0.st(F_NAME_LEN, 3).unwrap();
    slot.0
        .st(F_NAME, u64::from_le_bytes(*b"a\xffb\0\0\0\0\0"))
        .unwrap();
    slot.0.st(h0 + F_DESC + 16, 33 | 200 << 8).unwrap(); // /32, and no IPv6
    let info = r.link(l).unwrap();
    assert_eq!(info.name, "a\u{fffd}b");
    let h = info.halves[0].as_ref().unwrap();
    assert_eq!(
        (h.ipv4, h.ipv6),
        (Some((Ipv4Addr::new(10, 9, 0, 1), 32)), None)
    );
    // An unknown state is skipped; the listing goes on.
    let (other, _) = r.link_join("lan1", m[0], yes).unwrap();
    let oslot = r.link_slot(other.idx).unwrap();
    oslot
        .state()
        .unwrap()
        .store(StateWord::new(other.gen, 0, 9));
    let names: Vec<_> = r.links().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["a\u{fffd}b"]);
}

#[test]
fn a_garbage_member_word_is_free_for_the_taking() {
    let (r, m) = setup(3);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    let slot = r.link_slot(l.idx).unwrap();
    slot.0
        .st(HALVES[1] + F_MEMBER, 0xdead << 32 | 4000)
        .unwrap();
    assert_eq!(half(&r, l, 1), None, "unreadable: shown empty");
    assert_eq!(r.usage().links, 1);
    assert_eq!(r.link_join("wan0", m[2], yes).unwrap(), (l, 1));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn scribbled_slots_never_panic(
        words in prop::collection::vec((1u64..64, any::<u64>(), 0u8..3), 1..40)
    ) {
        let (r, m) = setup(3);
        let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
        r.link_join("wan0", m[1], yes).unwrap();
        r.link_describe(l, 0, &desc()).unwrap();
        let slot = r.link_slot(l.idx).unwrap();
        for &(w, v, kind) in &words {
            let v = match kind { 0 => v, 1 => v & 0xff, _ => v % 4096 };
            slot.0.st(8 * w, v).unwrap();
        }
        let _ = r.links().unwrap();
        let _ = r.link(l);
        let _ = r.link_join("wan0", m[2], |x| x != m[0]);
        let _ = r.link_count(l, 1, &LinkCounters { tx_packets: 1, ..LinkCounters::default() });
        let _ = r.link_leave(l, 1, m[1]);
        let _ = r.reclaim_links_of(m[0]);
        let _ = r.sweep_links();
        let _ = r.links().unwrap();
    }
}

#[test]
fn a_dead_members_halves_are_reclaimed() {
    let (r, m) = setup(3);
    let (l, _) = r.link_join("wan0", m[0], yes).unwrap();
    r.link_join("wan0", m[1], yes).unwrap();
    r.link_set_carrier(l, 0, true).unwrap();
    r.link_set_carrier(l, 1, true).unwrap();
    assert_eq!(r.reclaim_links_of(m[0]).unwrap(), 1);
    assert_eq!(r.reclaim_links_of(m[0]).unwrap(), 0, "done once");
    assert_eq!(half(&r, l, 0), None);
    let slot = r.link_slot(l.idx).unwrap();
    assert_eq!(slot.0.ld(HALVES[0] + F_FLAGS).unwrap(), 0, "carrier down");
    assert!(half(&r, l, 1).unwrap().carrier, "the other side untouched");
    // m[2] takes the half over; a late reclaim of its old holder leaves its flags alone.
    assert_eq!(r.link_join("wan0", m[2], yes).unwrap(), (l, 0));
    r.link_set_carrier(l, 0, true).unwrap();
    slot.0
        .st(HALVES[0] + F_FLAGS, u64::from(member_tag(m[0])) << 32 | 1)
        .unwrap();
    slot.clear_flags_of(0, member_tag(m[2])).unwrap();
    assert_eq!(
        slot.0.ld(HALVES[0] + F_FLAGS).unwrap() & 1,
        1,
        "not m[2]'s word"
    );
    r.link_set_carrier(l, 0, true).unwrap();
    assert_eq!(r.reclaim_links_of(m[0]).unwrap(), 0);
    assert!(half(&r, l, 0).unwrap().carrier);
    // Through the member reclaim: m[1]'s half, then m[2]'s, and the link goes.
    let rep = r.reclaim(m[1], m[2]).unwrap();
    assert_eq!(rep.links_left, 1);
    assert_eq!(half(&r, l, 1), None);
    assert_eq!(r.usage().links, 1);
    r.reclaim(m[2], m[0]).unwrap();
    assert_eq!(r.usage().links, 0);
}

#[test]
fn half_built_links_of_the_dead_and_forgotten_halves_are_collected() {
    let (r, m) = setup(3);
    let (slot_idx, _) = named_by_hand(&r, "wan0", member_tag(m[0]));
    let (reserved, _) = r.reserve_link(member_tag(m[0])).unwrap();
    assert_eq!(r.usage().links, 2);
    assert_eq!(r.reclaim_links_of(m[1]).unwrap(), 0, "not m[1]'s");
    assert_eq!(r.reclaim_links_of(m[0]).unwrap(), 2);
    assert_eq!(r.usage().links, 0);
    assert!(slot_idx != reserved.0.idx());
    // A half whose holder left the registry without its links reclaimed: swept.
    let (l, _) = r.link_join("wan0", m[1], yes).unwrap();
    r.link_join("wan0", m[2], yes).unwrap();
    let slot = r.member_slot(m[1].idx).unwrap();
    let w = slot.word().unwrap();
    assert!(slot.cas(w, w.next_gen(0)).unwrap());
    assert_eq!(r.sweep_leftovers().links_cleared, 1);
    assert_eq!(half(&r, l, 0), None);
    assert_eq!(half_member(&r, l, 1), Some(m[2]));
    assert_eq!(r.sweep_links(), 0);
}
