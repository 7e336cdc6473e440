//! Ring placement and channel-kind validation, with the fields a buggy peer could corrupt.

use super::*;

mod ring_place_tests {
    use super::*;
    use crate::EndpointKey;

    fn offered() -> (Registry, ChannelId, ChannelId) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let ep = r.add_endpoint(m, &EndpointKey::Native("x".into())).unwrap();
        let a = r.offer(m, ep, 4096, None).unwrap();
        let b = r.offer(m, ep, 4096, None).unwrap();
        (r, a, b)
    }

    #[test]
    fn a_channel_whose_rings_overlap_is_corrupt() {
        let (r, a, _) = offered();
        let slot = r.channel_slot(a.idx).unwrap();
        let c2s = slot.c2s().unwrap();
        slot.set_rings_for_test(c2s, c2s + 64).unwrap();
        let e = r.rings(a).err().expect("overlapping rings refused");
        assert!(e.to_string().contains("overlap"), "{e}");
    }

    #[test]
    fn a_ring_in_another_channels_memory_is_corrupt() {
        let (r, a, b) = offered();
        assert!(r.rings(a).is_ok() && r.rings(b).is_ok());
        let (sa, sb) = (
            r.channel_slot(a.idx).unwrap(),
            r.channel_slot(b.idx).unwrap(),
        );
        let theirs = sb.c2s().unwrap();
        sa.set_rings_for_test(sa.c2s().unwrap(), theirs).unwrap();
        let e = r.rings(a).err().expect("a ring in b's memory refused");
        assert!(e.to_string().contains("outside this channel"), "{e}");
        // b itself is untouched and still fine.
        assert!(r.rings(b).is_ok());
    }
}

mod kind_tests {
    use super::*;
    use crate::EndpointKey;

    fn setup() -> (Registry, MemberId, EndpointId) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let ep = r.add_endpoint(m, &EndpointKey::Native("x".into())).unwrap();
        (r, m, ep)
    }

    #[test]
    fn an_offer_records_its_kind_and_attach_checks_it() {
        let (r, m, ep) = setup();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        assert_eq!(r.channel(ch).unwrap().kind, Some(ChannelKind::StreamPair));
        assert!(r.rings_of(ch, ChannelKind::StreamPair).is_ok());
        match r.rings_of(ch, ChannelKind::DatagramPair) {
            Err(RegistryError::ChannelKindMismatch { expected, found }) => {
                assert_eq!(
                    (expected, found),
                    (ChannelKind::DatagramPair, ChannelKind::StreamPair)
                )
            }
            other => panic!("expected a kind mismatch, got {:?}", other.err()),
        }
    }

    #[test]
    fn a_datagram_pair_has_record_rings_and_is_invisible_to_tcp_agreement() {
        let (r, m, ep) = setup();
        let tuple = ConnTuple {
            client: "127.0.0.1:5000".parse().unwrap(),
            server: "127.0.0.1:53".parse().unwrap(),
        };
        let ch = r
            .offer_kind(m, ep, ChannelKind::DatagramPair, 1 << 17, Some(tuple))
            .unwrap();
        let info = r.channel(ch).unwrap();
        assert_eq!(info.kind, Some(ChannelKind::DatagramPair));
        assert_eq!(
            info.tuple,
            Some(tuple),
            "the sender's address travels with it"
        );
        assert!(r.rings_of(ch, ChannelKind::DatagramPair).is_ok());
        // A TCP server accepting a connection with the same addresses never takes it.
        assert_eq!(r.find_offer_by_tuple(ep, &tuple), None);
        assert!(r.offers_from_client(tuple.client).is_empty());
        assert_eq!(r.take_offer(ep, m).unwrap(), Some(ch));
    }

    #[test]
    fn a_descriptor_pair_is_offered_with_slot_rings_and_refused_as_a_stream() {
        let (r, m, ep) = setup();
        let ch = r
            .offer_kind(m, ep, ChannelKind::DescriptorPair, 4096, None)
            .unwrap();
        let rings = r.rings_of(ch, ChannelKind::DescriptorPair).unwrap();
        memloop_ring::HeldConsumer::attach(rings.c2s).unwrap();
        assert!(matches!(
            r.rings(ch),
            Err(RegistryError::ChannelKindMismatch {
                expected: ChannelKind::StreamPair,
                found: ChannelKind::DescriptorPair
            })
        ));
    }

    #[test]
    fn a_corrupt_kind_is_a_typed_error_at_attach_and_accept() {
        let (r, m, ep) = setup();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        let slot = r.channel_slot(ch.idx).unwrap();
        slot.set_kind_for_test(77).unwrap();
        assert!(matches!(
            r.rings(ch),
            Err(RegistryError::UnknownChannelKind { code: 77 })
        ));
        assert!(matches!(
            r.accept(ch, m),
            Err(RegistryError::UnknownChannelKind { code: 77 })
        ));
        assert!(r.channels().is_empty(), "listing skips it");
    }

    #[test]
    fn a_ring_header_of_another_kind_is_refused() {
        let (r, m, ep) = setup();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        let rings = r.rings(ch).unwrap();
        memloop_ring::init_ring(&rings.s2c, memloop_ring::RingKind::Record, 4096, 0).unwrap();
        match r.rings(ch) {
            Err(RegistryError::RingKindMismatch { ring, found, .. }) => {
                assert_eq!(
                    (ring, found),
                    ("s2c", memloop_ring::RingKind::Record as u32)
                )
            }
            other => panic!("expected a ring kind mismatch, got {:?}", other.err()),
        }
    }

    #[test]
    fn a_corrupt_state_word_is_a_typed_error() {
        let (r, m, ep) = setup();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        let slot = r.channel_slot(ch.idx).unwrap();
        let w = slot.word().unwrap();
        // phase 7 does not exist; MARKER on an OFFERED slot neither
        for bad in [w.with_low(7), with_flag(w, MARKER)] {
            slot.0.state().unwrap().store(bad);
            let e = r.channel_state(ch).unwrap_err();
            assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
        }
        assert!(matches!(
            ChannelSlot::new_checked(&r, r.params().max_channels),
            Err(RegistryError::NotFound)
        ));
    }
}

mod carried_tests {
    use super::*;
    use crate::{EndpointKey, COUNTER_RING_BYTES};
    use memloop_ring::StreamProducer;

    /// A channel with 100 bytes client→server and 50 back; the registry, its member and id.
    fn busy_channel() -> (Registry, MemberId, ChannelId) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let ep = r.add_endpoint(m, &EndpointKey::Native("x".into())).unwrap();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        r.accept(ch, m).unwrap();
        let rings = r.rings(ch).unwrap();
        let mut c2s = StreamProducer::attach(rings.c2s).unwrap();
        assert_eq!(c2s.write(&[7; 100]).unwrap(), 100);
        let mut s2c = StreamProducer::attach(rings.s2c).unwrap();
        assert_eq!(s2c.write(&[8; 50]).unwrap(), 50);
        (r, m, ch)
    }

    #[test]
    fn a_freed_channel_adds_what_its_rings_carried_exactly_once() {
        let (r, _, ch) = busy_channel();
        let before = r.counters()[COUNTER_RING_BYTES];
        assert_eq!(
            r.live_ring_bytes(),
            150,
            "live channels are counted from their rings"
        );
        r.close(ch, Side::Client).unwrap();
        assert_eq!(r.live_ring_bytes(), 150, "one side still holds it");
        assert_eq!(r.counters()[COUNTER_RING_BYTES], before);
        r.close(ch, Side::Server).unwrap();
        assert_eq!(r.counters()[COUNTER_RING_BYTES] - before, 150);
        assert_eq!(r.live_ring_bytes(), 0);
    }

    #[test]
    fn a_channel_freed_by_reclaiming_a_dead_member_is_counted_too() {
        // The process holding the server side died without closing: the reclaimer frees the
        // channel, and its bytes still reach the total.
        let (r, m, ch) = busy_channel();
        let before = r.counters()[COUNTER_RING_BYTES];
        r.close(ch, Side::Client).unwrap();
        r.reclaim(m, m).unwrap();
        assert_eq!(r.counters()[COUNTER_RING_BYTES] - before, 150);
        assert_eq!(r.live_ring_bytes(), 0);
    }
}

mod withdraw_tests {
    use super::*;
    use crate::EndpointKey;

    fn offered() -> (Registry, MemberId, EndpointId, ChannelId) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let ep = r.add_endpoint(m, &EndpointKey::Native("x".into())).unwrap();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        (r, m, ep, ch)
    }

    #[test]
    fn a_withdrawn_offer_is_seen_by_its_receiver_until_it_is_freed() {
        let (r, m, ep, ch) = offered();
        assert!(!r.withdrawing_to(ep), "an offer is not a withdrawal");
        r.withdraw_offer(ch, m).unwrap();
        assert!(r.withdrawing_to(ep));
        assert_eq!(
            r.take_offer(ep, m).unwrap(),
            None,
            "never taken once withdrawn"
        );
        assert_eq!(
            r.backlog(ep).unwrap(),
            1,
            "still counted while it is withdrawn"
        );
        r.cancel(ch, m).unwrap();
        assert!(!r.withdrawing_to(ep));
        assert_eq!(r.backlog(ep).unwrap(), 0);
        assert!(r.channel_state(ch).is_err(), "freed");
    }

    #[test]
    fn a_withdrawer_that_dies_leaves_nothing_behind() {
        let (r, m, ep, ch) = offered();
        r.withdraw_offer(ch, m).unwrap();
        r.reclaim(m, m).unwrap();
        assert!(!r.withdrawing_to(ep));
        assert_eq!(r.backlog(ep).unwrap_or(0), 0);
        assert_eq!(r.live_ring_bytes(), 0);
    }

    #[test]
    fn a_plain_cancel_keeps_the_backlog_exact() {
        let (r, m, ep, ch) = offered();
        r.cancel(ch, m).unwrap();
        assert_eq!(r.backlog(ep).unwrap(), 0);
        r.cancel(ch, m)
            .expect_err("freed: a second cancel finds nothing");
        assert_eq!(r.backlog(ep).unwrap(), 0);
    }
}
