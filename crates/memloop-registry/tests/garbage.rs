//! Scribble random bytes over the tables (and the header), then call every API: only Ok/Err,
//! never a panic, hang or out-of-bounds access.
#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;
use proptest::prelude::*;

fn populated() -> (Registry, MemberId, MemberId, EndpointId, Vec<ChannelId>) {
    let r = fresh(MIB);
    let (c, s, ep) = pair(&r);
    r.set_addresses(c, &["10.0.0.1".parse().unwrap(), "::1".parse().unwrap()])
        .unwrap();
    let t = ConnTuple {
        client: "10.0.0.1:1".parse().unwrap(),
        server: "10.0.0.2:2".parse().unwrap(),
    };
    let a = r.offer(c, ep, 4096, Some(t)).unwrap();
    let b = r.offer(c, ep, 4096, None).unwrap();
    r.accept(b, s).unwrap();
    let m = r.mark_declined(s, ep, &t).unwrap();
    for reason in [FallbackReason::NoListener, FallbackReason::Cancelled] {
        r.record_conn(c, 7, Proto::Tcp, &t, reason).unwrap();
    }
    (r, c, s, ep, vec![a, b, m])
}

fn exercise(r: &Registry, c: MemberId, s: MemberId, ep: EndpointId, chs: &[ChannelId]) {
    let _ = (
        r.members(),
        r.endpoints(),
        r.channels(),
        r.usage(),
        r.counters(),
        r.params(),
        r.generation(),
    );
    let t = ConnTuple {
        client: "10.0.0.1:1".parse().unwrap(),
        server: "10.0.0.2:2".parse().unwrap(),
    };
    let _ = (
        r.member(c),
        r.member(s),
        r.lookup(&native("svc")),
        r.endpoint_doorbell(ep),
        r.backlog(ep),
    );
    let _ = r.find_offer_by_tuple(ep, &t);
    let _ = (
        r.markers_for_client(t.client),
        r.offers_from_client(t.client),
        r.conns(),
        r.fallback_counts(),
    );
    let p = r.params();
    for idx in 0..p.max_conns.min(8) {
        for gen in 0..2 {
            let id = ConnRecordId { idx, gen };
            if let Ok((sent, _)) = r.conn_bytes(id) {
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let _ = r.release_conn(id);
        }
    }
    for idx in 0..p.max_channels.min(8) {
        for gen in 0..2 {
            let ch = ChannelId { idx, gen };
            let _ = (
                r.channel(ch),
                r.channel_state(ch),
                r.rings(ch),
                r.peer_gone(ch, Side::Client),
                r.side_words(ch, Side::Server),
            );
        }
    }
    for idx in 0..p.max_members {
        let _ = r.member(MemberId { idx, gen: 0 });
    }
    let _ = r.take_offer(ep, s);
    for &ch in chs {
        let _ = (r.close(ch, Side::Client), r.decline(ch), r.cancel(ch, c));
        let _ = r.free_marker(ch, s);
    }
    let _ = r.mark_declined(s, ep, &t);
    let _ = r.record_conn(c, 1, Proto::Udp, &t, FallbackReason::Error);
    let _ = r.sweep_markers();
    let _ = r.offer(c, ep, 4096, None);
    let _ = r.add_endpoint(c, &native("new"));
    let _ = r.reclaim(s, c);
    let _ = r.reclaim(c, c);
    let _ = r.sweep_orphans();
    let _ = r.usage();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn scribbled_tables_never_panic(writes in prop::collection::vec((0u64..1 << 20, prop::collection::vec(any::<u8>(), 1..64)), 1..40)) {
        let (r, c, s, ep, chs) = populated();
        let meta = r.metadata_len();
        for (off, bytes) in &writes {
            let off = 4096 + off % (meta - 4096);
            let len = (bytes.len() as u64).min(r.view().len() as u64 - off);
            r.view().write(off, &bytes[..len as usize]).unwrap();
        }
        exercise(&r, c, s, ep, &chs);
    }

    #[test]
    fn scribbled_words_never_panic(words in prop::collection::vec((0u64..1 << 20, any::<u64>(), 0u8..4), 1..60)) {
        // word-sized garbage that often looks almost valid (small numbers, state-like values)
        let (r, c, s, ep, chs) = populated();
        let meta = r.metadata_len();
        for &(off, v, kind) in &words {
            let off = (4096 + off % (meta - 4096)) & !7;
            let v = match kind { 0 => v, 1 => v & 0xff, 2 => v & 0xffff_ffff_0000_00ff, _ => v % 4096 };
            r.view().u64_at(off).unwrap().store(v, std::sync::atomic::Ordering::SeqCst);
        }
        exercise(&r, c, s, ep, &chs);
    }

    #[test]
    fn scribbled_headers_are_refused_or_valid(words in prop::collection::vec((0u64..32, any::<u64>()), 1..8)) {
        let (r, ..) = populated();
        for &(i, v) in &words {
            let v = if i % 2 == 0 { v % 100_000 } else { v };
            // words 8..128, or (i >= 16) the connection records' count and offset
            let off = if i < 16 { 8 * (1 + i % 15) } else { 256 + 8 * (i % 2) };
            r.view().u64_at(off).unwrap().store(v, std::sync::atomic::Ordering::SeqCst);
        }
        if let Ok(a) = Registry::attach(r.view().clone()) {
            let _ = (a.members(), a.endpoints(), a.channels(), a.usage(), a.sweep_orphans(), a.conns());
        }
    }
}
