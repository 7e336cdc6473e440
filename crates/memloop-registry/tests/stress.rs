//! Threads sharing one region do random joins, offers, accepts, closes, decline markers,
//! connection records, deaths and reclaims; afterwards everything must be back to baseline with
//! nothing leaked.
#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;
use rand::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Workers of the random workload.
const WORKERS: u32 = 6;
/// Members killed and not yet reclaimed, at most: the rest of the table after the workers
/// and the janitor.
const MAX_CORPSES: usize = 16 - WORKERS as usize - 1;

fn params() -> RegionParams {
    RegionParams {
        size: 4 * MIB,
        max_members: 16,
        max_endpoints: 64,
        max_channels: 64,
        segment_size: 4096,
        max_conns: 16,
        max_pools: 4,
        max_links: 4,
    }
}

fn tolerated(e: &RegistryError) -> bool {
    !matches!(
        e,
        RegistryError::Corrupt { .. }
            | RegistryError::Shm(_)
            | RegistryError::Ring(_)
            | RegistryError::InvalidParams(_)
    )
}

struct Worker {
    r: Registry,
    me: MemberId,
    ep: Option<EndpointId>,
    client: Vec<ChannelId>,
    server: Vec<ChannelId>,
    markers: Vec<ChannelId>,
    conns: Vec<ConnRecordId>,
    rng: StdRng,
    n: u32,
}

impl Worker {
    fn join(r: &Registry, t: u32) -> MemberId {
        loop {
            match r.join(&ident(t)) {
                Ok(id) => return id,
                Err(RegistryError::RegionFull { .. }) => std::thread::yield_now(),
                Err(e) => panic!("join: {e}"),
            }
        }
    }

    fn rejoin(&mut self, t: u32) {
        self.me = Self::join(&self.r, t);
        self.ep = None;
        self.client.clear();
        self.server.clear();
        self.markers.clear();
        self.conns.clear();
    }

    fn tuple(&mut self, t: u32) -> ConnTuple {
        let port = self.rng.gen_range(1..4u16);
        ConnTuple {
            client: std::net::SocketAddr::new([10, 0, 0, t as u8].into(), port),
            server: "10.0.1.1:80".parse().unwrap(),
        }
    }

    /// Markers and connection records (the transparent layer's bookkeeping).
    fn step_transparent(&mut self, t: u32, op: u32) {
        let r = self.r.clone();
        let tuple = self.tuple(t);
        match (op, self.ep) {
            (0..=3, Some(ep)) => {
                self.markers
                    .extend(Self::check(r.mark_declined(self.me, ep, &tuple)));
                let _ = (
                    r.markers_for_client(tuple.client),
                    r.offers_from_client(tuple.client),
                );
            }
            (4..=5, _) if !self.markers.is_empty() => {
                let m = self.markers.swap_remove(0);
                Self::check(r.free_marker(m, self.me));
            }
            (6..=7, _) => {
                let reason = FallbackReason::ALL[op as usize];
                if let Some(id) = r.record_conn(self.me, t, Proto::Tcp, &tuple, reason) {
                    if let Some((sent, _)) = Self::check(r.conn_bytes(id)) {
                        sent.fetch_add(10, std::sync::atomic::Ordering::Relaxed);
                    }
                    self.conns.push(id);
                }
            }
            (8, _) if !self.conns.is_empty() => {
                let id = self.conns.swap_remove(0);
                Self::check(r.release_conn(id));
            }
            (9, _) if !self.client.is_empty() => {
                let ch = self.client[0];
                Self::check(r.side_words(ch, Side::Client));
            }
            _ => {
                let _ = r.conns();
            }
        }
    }

    fn check<T>(res: Result<T, RegistryError>) -> Option<T> {
        match res {
            Ok(v) => Some(v),
            Err(e) if tolerated(&e) => None,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    fn step(&mut self, t: u32, corpses: &Mutex<Vec<MemberId>>) {
        let r = self.r.clone();
        match self.rng.gen_range(0..110) {
            op @ 100.. => self.step_transparent(t, op - 100),
            0..=9 if self.ep.is_none() => {
                self.n += 1;
                self.ep =
                    Self::check(r.add_endpoint(self.me, &native(&format!("t{t}-{}", self.n))));
            }
            10..=34 => {
                let eps = r.endpoints();
                if let Some(e) = eps.choose(&mut self.rng) {
                    if let Some(ch) = Self::check(r.offer(self.me, e.id, 1024, None)) {
                        self.client.push(ch);
                    }
                }
            }
            35..=54 => {
                if let Some(ep) = self.ep {
                    if let Some(Some(ch)) = Self::check(r.take_offer(ep, self.me)) {
                        self.server.push(ch);
                    }
                }
            }
            55..=69 if !self.client.is_empty() => {
                let ch = self
                    .client
                    .swap_remove(self.rng.gen_range(0..self.client.len()));
                if self.rng.gen_bool(0.5) {
                    match r.cancel(ch, self.me) {
                        Err(RegistryError::WrongState { .. }) => self.client.push(ch), // accepted: keep
                        other => drop(Self::check(other)),
                    }
                } else {
                    Self::check(r.close(ch, Side::Client));
                }
            }
            70..=84 if !self.server.is_empty() => {
                let ch = self
                    .server
                    .swap_remove(self.rng.gen_range(0..self.server.len()));
                Self::check(r.close(ch, Side::Server));
            }
            85..=92 => {
                let corpse = corpses.lock().unwrap().pop();
                if let Some(dead) = corpse {
                    if let Err(RegistryError::WrongState { .. }) = r.reclaim(dead, self.me) {
                        corpses.lock().unwrap().push(dead);
                    }
                }
            }
            // "SIGKILL": abandon everything in place — while the member table keeps a slot for
            // every worker (with all of them waiting to rejoin, nobody would reclaim).
            93..=95 => {
                let killed = {
                    let mut c = corpses.lock().unwrap();
                    (c.len() < MAX_CORPSES).then(|| c.push(self.me)).is_some()
                };
                if killed {
                    self.rejoin(t);
                } else {
                    Self::check(r.heartbeat(self.me));
                }
            }
            96 => {
                Self::check(r.leave(self.me));
                self.rejoin(t);
            }
            _ => {
                Self::check(r.heartbeat(self.me));
            }
        }
    }
}

#[test]
fn random_workload_returns_to_baseline() {
    let secs = std::env::var("STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let r = Registry::init(ShmSlice::new_heap(4 * MIB as usize), &params()).unwrap();
    let corpses = Mutex::new(Vec::new());
    let deadline = Instant::now() + Duration::from_secs(secs);
    let ops: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|t| {
                let (r, corpses) = (r.clone(), &corpses);
                s.spawn(move || {
                    let me = Worker::join(&r, t);
                    let rng = StdRng::seed_from_u64(t as u64 ^ 0x5eed);
                    let mut w = Worker {
                        r,
                        me,
                        ep: None,
                        client: vec![],
                        server: vec![],
                        markers: vec![],
                        conns: vec![],
                        rng,
                        n: 0,
                    };
                    let mut ops = 0u64;
                    while Instant::now() < deadline {
                        w.step(t, corpses);
                        ops += 1;
                    }
                    w.r.leave(w.me).unwrap();
                    ops
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert!(ops > 1000, "only {ops} operations");
    let janitor = r.join(&ident(99)).unwrap();
    for dead in corpses.into_inner().unwrap() {
        r.reclaim(dead, janitor).unwrap();
    }
    r.leave(janitor).unwrap();
    assert_eq!(r.sweep_orphans(), 0, "leaked segments");
    assert_eq!(
        r.usage(),
        Usage {
            segments_total: r.nsegments(),
            ..Usage::default()
        }
    );
    assert!(r.members().is_empty() && r.endpoints().is_empty() && r.channels().is_empty());
}
