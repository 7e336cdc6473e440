#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;
use std::collections::HashMap;

fn sock(port: u16) -> EndpointKey {
    EndpointKey::Socket {
        proto: Proto::Tcp,
        scope: 0,
        addr: "10.0.0.1".parse().unwrap(),
        port,
    }
}

#[test]
fn insert_lookup_remove() {
    let r = fresh(MIB);
    let m = r.join(&ident(1)).unwrap();
    let a = r.add_endpoint(m, &native("echo")).unwrap();
    let b = r.add_endpoint(m, &sock(80)).unwrap();
    assert_eq!(
        r.lookup(&native("echo")).unwrap(),
        EndpointInfo {
            id: a,
            key: native("echo"),
            owner: m
        }
    );
    assert_eq!(r.lookup(&sock(80)).unwrap().id, b);
    assert!(r.lookup(&sock(81)).is_none());
    let lo = EndpointKey::Socket {
        proto: Proto::Tcp,
        scope: 5,
        addr: "127.0.0.1".parse().unwrap(),
        port: 80,
    };
    assert!(r.lookup(&lo).is_none(), "scope is part of the key");
    assert_eq!(r.endpoints().len(), 2);
    r.remove_endpoint(a).unwrap();
    assert!(r.lookup(&native("echo")).is_none());
    assert!(matches!(r.remove_endpoint(a), Err(RegistryError::Stale)));
    assert!(matches!(r.endpoint_doorbell(a), Err(RegistryError::Stale)));
    r.remove_endpoint(b).unwrap();
    r.leave(m).unwrap();
    assert_eq!(r.usage(), baseline(&r));
}

#[test]
fn duplicates_are_refused() {
    let r = fresh(MIB);
    let m = r.join(&ident(1)).unwrap();
    let n = r.join(&ident(2)).unwrap();
    r.add_endpoint(m, &native("x")).unwrap();
    assert!(matches!(
        r.add_endpoint(n, &native("x")),
        Err(RegistryError::AddrInUse)
    ));
    assert!(matches!(
        r.add_endpoint(m, &native("")),
        Err(RegistryError::InvalidParams(_))
    ));
    assert!(matches!(
        r.add_endpoint(m, &native(&"y".repeat(65))),
        Err(RegistryError::InvalidParams(_))
    ));
}

#[test]
fn table_full_and_tombstone_reuse() {
    let r = fresh(MIB); // 64 endpoint slots
    let m = r.join(&ident(1)).unwrap();
    let ids: Vec<_> = (0..64)
        .map(|p| r.add_endpoint(m, &sock(p)).unwrap())
        .collect();
    assert!(matches!(
        r.add_endpoint(m, &sock(999)),
        Err(RegistryError::RegionFull { what: "endpoints" })
    ));
    r.remove_endpoint(ids[10]).unwrap();
    let reused = r.add_endpoint(m, &sock(999)).unwrap();
    assert_eq!((reused.idx, reused.gen), (ids[10].idx, ids[10].gen + 1));
    for p in 0..64u16 {
        assert_eq!(r.lookup(&sock(p)).is_some(), p != 10);
    }
    assert!(r.lookup(&sock(999)).is_some());
}

#[test]
fn lookups_stay_correct_after_many_inserts_and_removes() {
    let r = fresh(MIB);
    let m = r.join(&ident(1)).unwrap();
    let mut live: HashMap<u16, EndpointId> = HashMap::new();
    let mut rng = 12345u64;
    for _ in 0..5000 {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = (rng >> 33) as u16 % 100;
        if let Some(id) = live.remove(&port) {
            r.remove_endpoint(id).unwrap();
        } else if live.len() < 60 {
            live.insert(port, r.add_endpoint(m, &sock(port)).unwrap());
        }
        if rng % 7 == 0 {
            for p in 0..100 {
                assert_eq!(
                    r.lookup(&sock(p)).map(|e| e.id),
                    live.get(&p).copied(),
                    "port {p}"
                );
            }
        }
    }
    assert_eq!(r.usage().endpoints as usize, live.len());
}

#[test]
fn concurrent_inserts_of_one_key_yield_exactly_one_winner() {
    for round in 0..50 {
        let r = fresh(MIB);
        let ms: Vec<_> = (0..4).map(|i| r.join(&ident(i)).unwrap()).collect();
        // occupy and free some slots so racers pick different tombstones/empties
        let key = native(&format!("race{round}"));
        let barrier = std::sync::Barrier::new(4);
        let wins: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = ms
                .iter()
                .map(|&m| {
                    let (r, key, barrier) = (r.clone(), key.clone(), &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        match r.add_endpoint(m, &key) {
                            Ok(_) => true,
                            Err(RegistryError::AddrInUse) => false,
                            Err(e) => panic!("{e}"),
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(wins.iter().filter(|&&w| w).count(), 1, "round {round}");
        assert_eq!(r.usage().endpoints, 1);
    }
}

#[test]
fn doorbell_words_are_shared() {
    let r = fresh(MIB);
    let (c, _s, ep) = pair(&r);
    let (seq, waiting) = r.endpoint_doorbell(ep).unwrap();
    let before = seq.load(std::sync::atomic::Ordering::SeqCst);
    waiting.store(1, std::sync::atomic::Ordering::SeqCst);
    r.offer(c, ep, 4096, None).unwrap();
    assert_eq!(
        seq.load(std::sync::atomic::Ordering::SeqCst),
        before.wrapping_add(1)
    );
    assert_eq!(
        r.endpoint_doorbell(ep)
            .unwrap()
            .1
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(r.backlog(ep).unwrap(), 1);
}

#[test]
fn keys_display_for_humans() {
    use std::net::{IpAddr, Ipv6Addr};
    assert_eq!(native("echo").to_string(), "native echo");
    let k = EndpointKey::Socket {
        proto: Proto::Tcp,
        scope: 7,
        addr: IpAddr::V6(Ipv6Addr::LOCALHOST),
        port: 80,
    };
    assert_eq!(k.to_string(), "tcp [::1]:80 (netns 7)");
}
