//! Threads sharing one region do random joins, offers, accepts, closes, deaths and reclaims;
//! afterwards everything must be back to baseline with nothing leaked.
#![cfg(not(loom))]
mod common;
use common::*;
use memloop_registry::*;
use rand::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn params() -> RegionParams {
    RegionParams {
        size: 4 * MIB,
        max_members: 16,
        max_endpoints: 64,
        max_channels: 64,
        segment_size: 4096,
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
        match self.rng.gen_range(0..100) {
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
            93..=95 => {
                corpses.lock().unwrap().push(self.me); // "SIGKILL": abandon everything in place
                self.rejoin(t);
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
        let hs: Vec<_> = (0..6u32)
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
