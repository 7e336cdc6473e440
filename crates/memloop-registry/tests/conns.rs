#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;
use std::sync::atomic::Ordering::Relaxed;

fn tuple(port: u16) -> ConnTuple {
    ConnTuple {
        client: std::net::SocketAddr::new([10, 0, 0, 1].into(), port),
        server: "[fd00::2]:443".parse().unwrap(),
    }
}

#[test]
fn record_count_bytes_release() {
    let r = fresh(MIB);
    let (c, _s, _ep) = pair(&r);
    let id = r
        .record_conn(
            c,
            4242,
            Proto::Tcp,
            &tuple(5000),
            FallbackReason::NoListener,
        )
        .unwrap();
    let (sent, received) = r.conn_bytes(id).unwrap();
    sent.fetch_add(100, Relaxed);
    received.fetch_add(7, Relaxed);
    let recs = r.conns();
    assert_eq!(
        recs,
        vec![ConnRecord {
            id,
            owner: c,
            pid: 4242,
            proto: Proto::Tcp,
            tuple: tuple(5000),
            reason: RecordReason::Fallback(FallbackReason::NoListener),
            switches: 0,
            ring_bytes: 0,
            bytes_sent: 100,
            bytes_received: 7,
        }]
    );
    assert_eq!(r.usage().conns, 1);
    let counted = r.fallback_counts();
    assert!(counted.contains(&(FallbackReason::NoListener, 1)));
    assert_eq!(
        counted.iter().map(|x| x.1).sum::<u64>(),
        1,
        "one call, one count"
    );
    r.release_conn(id).unwrap();
    assert!(matches!(r.release_conn(id), Err(RegistryError::Stale)));
    assert!(matches!(r.conn_bytes(id), Err(RegistryError::Stale)));
    assert!(r.conns().is_empty());
    // Records are handed out next-fit: the slot comes round again after a lap of the table.
    let again = (0..=r.params().max_conns)
        .map(|_| {
            let a = r
                .record_conn(c, 1, Proto::Udp, &tuple(5001), FallbackReason::Error)
                .unwrap();
            if a.idx != id.idx {
                r.release_conn(a).unwrap();
            }
            a
        })
        .find(|a| a.idx == id.idx)
        .unwrap();
    assert_eq!((again.idx, again.gen), (id.idx, id.gen + 1));
    assert_eq!(
        r.conn_bytes(again).unwrap().0.load(Relaxed),
        0,
        "counters reset"
    );
    assert!(matches!(
        r.conn_bytes(ConnRecordId { idx: 9999, gen: 0 }),
        Err(RegistryError::NotFound)
    ));
}

#[test]
fn full_table_is_counted_and_dead_owners_are_released() {
    let r = fresh(MIB);
    let (c, s, _ep) = pair(&r);
    let n = r.params().max_conns;
    for i in 0..n {
        let who = if i % 2 == 0 { c } else { s };
        let reason = FallbackReason::ALL[i as usize % FallbackReason::ALL.len()];
        assert!(r
            .record_conn(who, i, Proto::Tcp, &tuple(i as u16), reason)
            .is_some());
    }
    assert_eq!(
        r.record_conn(c, 0, Proto::Tcp, &tuple(1), FallbackReason::Declined),
        None
    );
    let counters = r.counters();
    assert_eq!(counters[COUNTER_CONNS_DROPPED], 1);
    assert_eq!(
        counter_name(COUNTER_CONNS_DROPPED),
        Some("conn_records_dropped")
    );
    let declined = counters[FallbackReason::Declined.counter_index()];
    let recorded = (0..n as usize)
        .filter(|i| i % FallbackReason::ALL.len() == FallbackReason::Declined.counter_index())
        .count() as u64;
    assert_eq!(
        declined,
        recorded + 1,
        "the recorded ones, then the dropped one"
    );
    assert_eq!(r.conns().len() as u32, n);
    let rep = r.reclaim(s, c).unwrap();
    assert_eq!(rep.conns_released, n / 2);
    assert!(r.conns().iter().all(|x| x.owner == c));
    r.leave(c).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn records_need_a_live_member() {
    let r = fresh(MIB);
    let (c, s, _ep) = pair(&r);
    r.leave(s).unwrap();
    assert_eq!(
        r.record_conn(s, 1, Proto::Tcp, &tuple(1), FallbackReason::NotMember),
        None
    );
    assert_eq!(r.counters()[FallbackReason::NotMember.counter_index()], 1);
    assert_eq!(r.counters()[COUNTER_CONNS_DROPPED], 0, "not a full table");
    r.count_fallback(FallbackReason::Disabled);
    assert!(r.fallback_counts().contains(&(FallbackReason::Disabled, 1)));
    r.leave(c).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}
