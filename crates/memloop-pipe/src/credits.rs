//! Which tenant's chunk runs next: weighted, work-conserving fair sharing by virtual time.
//!
//! Design, and why:
//! - **Start-time fair queuing.** Each tenant has a virtual time (`vtime`, in cost-ns per unit
//!   of weight). [`Credits::pick`] hands out the backlogged tenant with the smallest `vtime`
//!   (ties: the one picked longest ago, then the lowest id — a deterministic round robin);
//!   [`Credits::charge`] then advances it by `cost / weight`. Over any busy period the tenants'
//!   costs follow their weights to within about one chunk each.
//! - **Work-conserving, not refilled on a timer** (the blk-iocost idea, "unused budget is lent
//!   out", rather than vPipe's timer refill): only backlogged tenants compete, so one that stops
//!   frees its share at once and the service never idles while someone waits; no refill rate
//!   to tune, nothing to do while all are idle.
//! - **No banking.** A tenant that becomes backlogged again gets
//!   `vtime = max(its vtime, min vtime of the backlogged tenants)` (the global virtual clock,
//!   the start tag of the last pick, if none is backlogged): idling earns no credit, so a
//!   returning tenant gets its weight's share and no burst. Debt (a vtime ahead) is kept.
//! - **Bounded turns** (vhost-net's per-turn byte weight): a pick is one chunk, bounded by the
//!   service's chunk size, so a turn — and everyone else's wait — is bounded.
//! - **Cost** = `bytes × ns_per_byte + cpu_ns × cpu_factor` ([`CostModel`]): the service pays
//!   for the bytes it moves *and* the CPU it burns for the tenant (a copy-loop fallback, a slow
//!   splice). Defaults: 0.1 ns per byte (≈ 10 GB/s, a reference copy rate: a byte costs the time
//!   to move it) and 1.0 per CPU ns (a CPU ns costs a ns of service time).
//! - **Several workers.** Chunks run in parallel and are charged later, so a pick counts the
//!   chunk's *expected* cost (the tenant's recent average per chunk, EWMA gain 1/4; a full
//!   256 KiB chunk before any sample) into `vtime` at once, and [`Credits::charge`] replaces it
//!   by the actual cost. Without it a tenant would go to every free worker until its first
//!   charge arrived.
//! - **Waiting time** is time backlogged with no chunk of the tenant running, summed from the
//!   `now` values passed in (a `Duration` since an arbitrary start: no clock here, no I/O).
//!
//! Every chunk costs at least [`MIN_CHUNK_COST`], so `vtime` always moves. A pick scans the
//! tenants (O(n)): a service has tens of tenants, not thousands.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// The least a charged chunk costs (cost-ns), so that even an empty chunk moves `vtime`.
pub const MIN_CHUNK_COST: f64 = 1.0;
/// Weights are clamped to `1..=MAX_WEIGHT`.
pub const MAX_WEIGHT: u32 = 1000;
/// The chunk assumed before a tenant's first charge (the service's default chunk).
const FIRST_GUESS_BYTES: u64 = 256 << 10;
/// How fast the expected cost per chunk follows new samples.
const AVG_GAIN: f64 = 0.25;

/// A tenant, as [`Credits::add_tenant`] named it. Never reused after removal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TenantId(u64);

impl TenantId {
    pub fn get(self) -> u64 {
        self.0
    }
}

/// What a chunk costs, in ns of service time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// ns per byte moved. Default 0.1 (≈ 10 GB/s).
    pub ns_per_byte: f64,
    /// ns of cost per ns of CPU used on the tenant's behalf. Default 1.0.
    pub cpu_factor: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            ns_per_byte: 0.1,
            cpu_factor: 1.0,
        }
    }
}

impl CostModel {
    /// Counts bytes only (1 per byte): for byte shares in [`weighted_shares`].
    pub const BYTES: CostModel = CostModel {
        ns_per_byte: 1.0,
        cpu_factor: 0.0,
    };

    pub fn cost(&self, bytes: u64, cpu: Duration) -> f64 {
        bytes as f64 * self.ns_per_byte + cpu.as_nanos() as f64 * self.cpu_factor
    }

    /// Negative or NaN factors count as 0.
    fn sane(self) -> Self {
        CostModel {
            ns_per_byte: self.ns_per_byte.max(0.0),
            cpu_factor: self.cpu_factor.max(0.0),
        }
    }
}

/// One tenant's figures, for `memloop status` and its JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TenantStats {
    pub name: String,
    pub weight: u32,
    /// Bytes moved (sum of charges).
    pub bytes: u64,
    /// CPU used on its behalf (sum of charges).
    pub cpu_ns: u64,
    /// Time backlogged with none of its chunks running.
    pub wait_ns: u64,
    /// Wall time its chunks ran (sum of charges; parallel chunks add up).
    pub run_ns: u64,
    /// Chunks charged.
    pub chunks: u64,
    pub backlogged: bool,
}

struct Tenant {
    stats: TenantStats,
    vtime: f64,
    in_flight: u32,
    /// Expected cost of the chunks in flight, already in `vtime`.
    pending: f64,
    avg_cost: Option<f64>,
    /// Pick sequence number of its last pick (0: never), for round robin on ties.
    last_pick: u64,
    /// Since when it has been waiting (backlogged, nothing running).
    wait_from: Option<Duration>,
}

impl Tenant {
    fn new(name: String, weight: u32, vtime: f64) -> Tenant {
        let stats = TenantStats {
            name,
            weight,
            bytes: 0,
            cpu_ns: 0,
            wait_ns: 0,
            run_ns: 0,
            chunks: 0,
            backlogged: false,
        };
        Tenant {
            stats,
            vtime,
            in_flight: 0,
            pending: 0.0,
            avg_cost: None,
            last_pick: 0,
            wait_from: None,
        }
    }

    fn weight(&self) -> f64 {
        f64::from(self.stats.weight)
    }

    /// Opens or closes the waiting interval after a change of state.
    fn sync_wait(&mut self, now: Duration) {
        let waiting = self.stats.backlogged && self.in_flight == 0;
        match (waiting, self.wait_from) {
            (true, None) => self.wait_from = Some(now),
            (false, Some(from)) => {
                self.stats.wait_ns += nanos(now.saturating_sub(from));
                self.wait_from = None;
            }
            _ => {}
        }
    }

    /// Takes one in-flight chunk's share of the expected cost out of `pending`.
    fn settle_one(&mut self) -> f64 {
        if self.in_flight == 0 {
            return 0.0;
        }
        let est = self.pending / f64::from(self.in_flight);
        self.in_flight -= 1;
        self.pending = if self.in_flight == 0 {
            0.0
        } else {
            self.pending - est
        };
        est
    }

    fn learn(&mut self, cost: f64) {
        let avg = self.avg_cost.map_or(cost, |a| a + (cost - a) * AVG_GAIN);
        self.avg_cost = Some(avg);
    }

    fn count(&mut self, bytes: u64, cpu: Duration, wall: Duration) {
        let s = &mut self.stats;
        s.bytes = s.bytes.saturating_add(bytes);
        s.cpu_ns = s.cpu_ns.saturating_add(nanos(cpu));
        s.run_ns = s.run_ns.saturating_add(nanos(wall));
        s.chunks += 1;
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The scheduler: which tenant runs next, and what each has used.
pub struct Credits {
    model: CostModel,
    tenants: BTreeMap<TenantId, Tenant>,
    next_id: u64,
    /// Start tag of the last pick, never going back.
    vclock: f64,
    picks: u64,
    /// The latest `now` seen, up to which [`Credits::stats`] counts open waits.
    last_now: Duration,
}

impl Default for Credits {
    fn default() -> Self {
        Credits::new(CostModel::default())
    }
}

impl Credits {
    pub fn new(model: CostModel) -> Credits {
        Credits {
            model: model.sane(),
            tenants: BTreeMap::new(),
            next_id: 0,
            vclock: 0.0,
            picks: 0,
            last_now: Duration::ZERO,
        }
    }

    /// Adds a tenant (not backlogged), or gives an existing one of this name the new weight.
    /// The weight is clamped to 1..=[`MAX_WEIGHT`].
    pub fn add_tenant(&mut self, name: String, weight: u32) -> TenantId {
        let weight = weight.clamp(1, MAX_WEIGHT);
        if let Some((&id, t)) = self.tenants.iter_mut().find(|(_, t)| t.stats.name == name) {
            t.stats.weight = weight;
            return id;
        }
        let id = TenantId(self.next_id);
        self.next_id += 1;
        self.tenants
            .insert(id, Tenant::new(name, weight, self.vclock));
        id
    }

    /// Forgets a tenant (its chunks in flight may still be charged: they are ignored).
    /// Returns false if there was none.
    pub fn remove_tenant(&mut self, id: TenantId) -> bool {
        self.tenants.remove(&id).is_some()
    }

    /// Call when a tenant gains its first queued chunk (`true`) or loses its last (`false`).
    pub fn set_backlogged(&mut self, id: TenantId, backlogged: bool, now: Duration) {
        self.observe(now);
        let floor = self.rejoin_floor();
        let Some(t) = self.tenants.get_mut(&id) else {
            return;
        };
        if t.stats.backlogged != backlogged {
            t.stats.backlogged = backlogged;
            if backlogged {
                t.vtime = t.vtime.max(floor);
            }
        }
        t.sync_wait(now);
    }

    /// The tenant whose chunk should run next: the backlogged one furthest behind.
    pub fn pick(&mut self, now: Duration) -> Option<TenantId> {
        self.pick_where(now, |_| true)
    }

    /// [`Credits::pick`] among the backlogged tenants `eligible` accepts (say, those with a
    /// chunk queued, when one running also counts as backlogged).
    pub fn pick_where(
        &mut self,
        now: Duration,
        eligible: impl FnMut(TenantId) -> bool,
    ) -> Option<TenantId> {
        self.observe(now);
        let id = self.next_candidate(eligible)?;
        self.picks += 1;
        let guess = self.model.cost(FIRST_GUESS_BYTES, Duration::ZERO);
        let t = self.tenants.get_mut(&id)?;
        self.vclock = self.vclock.max(t.vtime);
        let est = t.avg_cost.unwrap_or(guess).max(MIN_CHUNK_COST);
        t.vtime += est / t.weight();
        t.pending += est;
        t.in_flight += 1;
        t.last_pick = self.picks;
        t.sync_wait(now);
        Some(id)
    }

    /// Reports what a picked chunk used: `bytes` moved, `cpu` spent, `wall` it ran.
    /// Returns false if the tenant is gone (the charge is dropped).
    pub fn charge(
        &mut self,
        id: TenantId,
        bytes: u64,
        cpu: Duration,
        wall: Duration,
        now: Duration,
    ) -> bool {
        self.observe(now);
        let cost = self.model.cost(bytes, cpu).max(MIN_CHUNK_COST);
        let Some(t) = self.tenants.get_mut(&id) else {
            return false;
        };
        let est = t.settle_one();
        t.vtime += (cost - est) / t.weight();
        t.learn(cost);
        t.count(bytes, cpu, wall);
        t.sync_wait(now);
        true
    }

    /// Every tenant's figures, in id order; waits still open count up to the latest `now`.
    pub fn stats(&self) -> Vec<TenantStats> {
        self.tenants.values().map(|t| self.stats_of(t)).collect()
    }

    fn stats_of(&self, t: &Tenant) -> TenantStats {
        let mut s = t.stats.clone();
        if let Some(from) = t.wait_from {
            s.wait_ns += nanos(self.last_now.saturating_sub(from));
        }
        s
    }

    fn observe(&mut self, now: Duration) {
        self.last_now = self.last_now.max(now);
    }

    /// Where a tenant becoming backlogged starts at the least.
    fn rejoin_floor(&self) -> f64 {
        self.tenants
            .values()
            .filter(|t| t.stats.backlogged)
            .map(|t| t.vtime)
            .min_by(f64::total_cmp)
            .unwrap_or(self.vclock)
    }

    fn next_candidate(&self, mut eligible: impl FnMut(TenantId) -> bool) -> Option<TenantId> {
        self.tenants
            .iter()
            .filter(|(&id, t)| t.stats.backlogged && eligible(id))
            .min_by(|(a_id, a), (b_id, b)| {
                let by_vtime = a.vtime.total_cmp(&b.vtime);
                by_vtime
                    .then(a.last_pick.cmp(&b.last_pick))
                    .then(a_id.cmp(b_id))
            })
            .map(|(&id, _)| id)
    }
}

/// Jain's fairness index of `shares`: 1 when all are equal, 1/n when one has everything.
/// An empty or all-zero list counts as fair (1).
pub fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let sq: f64 = shares.iter().map(|x| x * x).sum();
    if shares.is_empty() || sq == 0.0 {
        return 1.0;
    }
    sum * sum / (shares.len() as f64 * sq)
}

/// Each tenant's share of the total cost (by `model`; [`CostModel::BYTES`] for bytes)
/// divided by its share of the total weight: 1.0 each when the split follows the weights.
/// Pass only the tenants that competed (an idle tenant's 0 is not unfairness).
pub fn weighted_shares(stats: &[TenantStats], model: &CostModel) -> Vec<f64> {
    let cost = |s: &TenantStats| model.cost(s.bytes, Duration::from_nanos(s.cpu_ns));
    let total_cost: f64 = stats.iter().map(cost).sum();
    let total_weight: f64 = stats.iter().map(|s| f64::from(s.weight)).sum();
    let share = |s: &TenantStats| match total_cost > 0.0 {
        true => (cost(s) / total_cost) / (f64::from(s.weight) / total_weight),
        false => 1.0,
    };
    stats.iter().map(share).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    const KIB: u64 = 1024;
    const T0: Duration = Duration::ZERO;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// What a tenant's next chunk moves and burns.
    type Work<'a> = &'a dyn Fn(TenantId) -> (u64, Duration);

    /// A chunk on a worker of the simulated service.
    struct Running {
        id: TenantId,
        bytes: u64,
        cpu: Duration,
        took: Duration,
        end: Duration,
    }

    /// A service with `workers` workers and a fake clock; a chunk runs as long as it costs.
    struct Sim {
        c: Credits,
        now: Duration,
        workers: usize,
        busy: Vec<Running>,
        picks: Vec<TenantId>,
    }

    impl Sim {
        /// Tenants `t0, t1, …` with these weights, all backlogged.
        fn new(weights: &[u32], workers: usize) -> (Sim, Vec<TenantId>) {
            let mut c = Credits::new(CostModel::default());
            let ids: Vec<_> = (0..weights.len())
                .map(|i| c.add_tenant(format!("t{i}"), weights[i]))
                .collect();
            ids.iter().for_each(|&id| c.set_backlogged(id, true, T0));
            let sim = Sim {
                c,
                now: T0,
                workers,
                busy: Vec::new(),
                picks: Vec::new(),
            };
            (sim, ids)
        }

        /// Gives every free worker a chunk; returns the tenants picked.
        fn fill(&mut self, work: Work) -> Vec<TenantId> {
            let mut picked = Vec::new();
            while self.busy.len() < self.workers {
                let Some(id) = self.c.pick(self.now) else {
                    break;
                };
                let (bytes, cpu) = work(id);
                let cost = CostModel::default().cost(bytes, cpu);
                let took = Duration::from_nanos(cost as u64 + 1);
                let end = self.now + took;
                self.busy.push(Running {
                    id,
                    bytes,
                    cpu,
                    took,
                    end,
                });
                picked.push(id);
            }
            self.picks.extend(&picked);
            picked
        }

        /// Lets the first chunk to end finish and be charged: (its tenant, charge's answer).
        fn finish_first(&mut self) -> Option<(TenantId, bool)> {
            let i = (0..self.busy.len()).min_by_key(|&i| self.busy[i].end)?;
            let r = self.busy.remove(i);
            self.now = self.now.max(r.end);
            Some((r.id, self.c.charge(r.id, r.bytes, r.cpu, r.took, self.now)))
        }

        fn run(&mut self, chunks: usize, work: Work) {
            for _ in 0..chunks {
                self.fill(work);
                self.finish_first();
            }
        }

        fn run_until_picks(&mut self, picks: usize, work: Work) {
            while self.picks.len() < picks {
                self.run(1, work);
            }
        }

        fn bytes(&self) -> Vec<u64> {
            self.c.stats().iter().map(|s| s.bytes).collect()
        }
    }

    fn fractions(xs: &[u64]) -> Vec<f64> {
        let total: u64 = xs.iter().sum();
        xs.iter().map(|&x| x as f64 / total as f64).collect()
    }

    fn assert_near(got: &[f64], want: &[f64], rel: f64) {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= rel * w,
                "shares {got:?}, want {want:?} ± {rel}"
            );
        }
    }

    fn count(picks: &[TenantId], id: TenantId) -> usize {
        picks.iter().filter(|&&p| p == id).count()
    }

    fn same_size(_: TenantId) -> (u64, Duration) {
        (64 * KIB, Duration::ZERO)
    }

    #[test]
    fn weights_1_2_4_split_equal_chunks_by_weight() {
        for workers in [1, 2] {
            let (mut sim, _) = Sim::new(&[1, 2, 4], workers);
            sim.run(7000, &same_size);
            assert_near(&fractions(&sim.bytes()), &[1. / 7., 2. / 7., 4. / 7.], 0.02);
            let j = jain(&weighted_shares(&sim.c.stats(), &CostModel::BYTES));
            assert!(j >= 0.99, "jain {j} with {workers} workers");
        }
    }

    #[test]
    fn a_tenant_that_stops_frees_its_share_at_once() {
        let (mut sim, ids) = Sim::new(&[1, 2, 4], 2);
        sim.run(700, &same_size);
        sim.c.set_backlogged(ids[2], false, sim.now);
        let (before, from) = (sim.bytes(), sim.picks.len());
        sim.run(3000, &same_size);
        let after = sim.bytes();
        let grew: Vec<u64> = (0..3).map(|i| after[i] - before[i]).collect();
        assert!(grew[2] <= 2 * 64 * KIB, "a stopped tenant ran on: {grew:?}");
        assert_near(&fractions(&grew[..2]), &[1. / 3., 2. / 3.], 0.02);
        let next = &sim.picks[from..from + 30];
        assert_eq!(count(next, ids[2]), 0);
        assert!((9..=11).contains(&count(next, ids[0])), "{next:?}");
    }

    #[test]
    fn a_returning_idle_tenant_gets_no_burst() {
        let (mut sim, ids) = Sim::new(&[1, 2, 4], 1);
        sim.c.set_backlogged(ids[1], false, T0);
        sim.run(5003, &same_size);
        sim.c.set_backlogged(ids[1], true, sim.now);
        let from = sim.picks.len();
        sim.run_until_picks(from + 70, &same_size);
        let back = &sim.picks[from..from + 70];
        assert_eq!(back[0], ids[1], "its share starts at once");
        let n = count(back, ids[1]);
        assert!((18..=22).contains(&n), "{n} of 70 picks at weight 2 of 7");
    }

    #[test]
    fn different_chunk_sizes_still_split_bytes_by_weight() {
        let sizes = |id: TenantId| match id.get() {
            0 => (256 * KIB, Duration::ZERO),
            1 => (64 * KIB, Duration::ZERO),
            _ => (8 * KIB, Duration::ZERO),
        };
        let (mut sim, _) = Sim::new(&[1, 2, 4], 2);
        sim.run(20_000, &sizes);
        assert_near(&fractions(&sim.bytes()), &[1. / 7., 2. / 7., 4. / 7.], 0.02);
    }

    #[test]
    fn cpu_is_charged_too() {
        // Same bytes; the second tenant's chunks burn 9× the bytes' cost in CPU: 10× in all.
        let cpu = Duration::from_nanos(58_982);
        let work = |id: TenantId| (64 * KIB, if id.get() == 1 { cpu } else { Duration::ZERO });
        let (mut sim, _) = Sim::new(&[1, 1], 1);
        sim.run(5500, &work);
        let s = sim.c.stats();
        let ratio = s[0].chunks as f64 / s[1].chunks as f64;
        assert!(
            (9.5..=10.5).contains(&ratio),
            "chunks {} vs {}",
            s[0].chunks,
            s[1].chunks
        );
        assert_eq!(s[1].cpu_ns, s[1].chunks * 58_982);
    }

    #[test]
    fn picks_count_chunks_still_in_flight() {
        let mut c = Credits::new(CostModel::default());
        let (a, b) = (c.add_tenant("a".into(), 1), c.add_tenant("b".into(), 1));
        c.set_backlogged(a, true, T0);
        c.set_backlogged(b, true, T0);
        c.pick(T0);
        c.pick(T0);
        c.charge(a, 64 * KIB, Duration::ZERO, ms(1), ms(1));
        c.charge(b, 160 * KIB, Duration::ZERO, ms(1), ms(1));
        // Four workers ask before any charge: `a` is behind `b` by 1.5 of its chunks, not 4.
        let picks: Vec<_> = (0..4).filter_map(|_| c.pick(ms(2))).collect();
        assert_eq!(picks, [a, a, b, a]);
    }

    #[test]
    fn charges_replace_the_estimate_counted_at_pick() {
        let mut c = Credits::new(CostModel::default());
        let (a, b) = (c.add_tenant("a".into(), 1), c.add_tenant("b".into(), 1));
        c.set_backlogged(a, true, T0);
        c.set_backlogged(b, true, T0);
        let turn = |c: &mut Credits| {
            let id = c.pick(T0).unwrap();
            let bytes = if id == a { 8 * KIB } else { 64 * KIB };
            c.charge(id, bytes, Duration::ZERO, T0, T0);
            id
        };
        assert_eq!((turn(&mut c), turn(&mut c)), (a, b));
        // Both first picks counted a 256 KiB guess; only the actual costs remain: `a` is
        // behind by seven of its chunks.
        let run = (0..20).take_while(|_| turn(&mut c) == a).count();
        assert!((7..=8).contains(&run), "{run} turns of a in a row");
    }

    #[test]
    fn pick_where_skips_the_tenants_it_refuses() {
        let mut c = Credits::new(CostModel::default());
        let (a, b) = (c.add_tenant("a".into(), 1), c.add_tenant("b".into(), 1));
        c.set_backlogged(a, true, T0);
        c.set_backlogged(b, true, T0);
        assert_eq!(c.pick_where(T0, |t| t != a), Some(b));
        assert_eq!(c.pick_where(T0, |t| t != b), Some(a));
        assert_eq!(c.pick_where(T0, |_| false), None);
    }

    #[test]
    fn remove_tenant_while_in_flight_is_safe() {
        let mut c = Credits::new(CostModel::default());
        let (a, b) = (c.add_tenant("a".into(), 4), c.add_tenant("b".into(), 1));
        c.set_backlogged(a, true, T0);
        c.set_backlogged(b, true, T0);
        assert_eq!(c.pick(T0), Some(a));
        assert!(c.remove_tenant(a));
        assert!(!c.remove_tenant(a));
        assert!((0..3).all(|_| c.pick(ms(1)) == Some(b)));
        assert!(!c.charge(a, 64 * KIB, Duration::ZERO, ms(1), ms(2)));
        c.set_backlogged(a, true, ms(2));
        let names: Vec<_> = c.stats().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["b"]);
        let a2 = c.add_tenant("a".into(), 4);
        assert_ne!(a2, a);
        assert_eq!(c.stats()[1].bytes, 0);
        c.set_backlogged(b, false, ms(3));
        assert_eq!(c.pick(ms(3)), None);
    }

    #[test]
    fn re_adding_a_name_keeps_its_id_and_takes_the_new_weight() {
        let mut c = Credits::new(CostModel::default());
        let a = c.add_tenant("a".into(), 0);
        assert_eq!(c.stats()[0].weight, 1);
        assert_eq!(c.add_tenant("a".into(), 5000), a);
        assert_eq!(c.stats()[0].weight, MAX_WEIGHT);
        assert_eq!(c.stats().len(), 1);
    }

    #[test]
    fn stats_sum_charges_and_count_waiting_only_while_nothing_runs() {
        let mut c = Credits::new(CostModel::default());
        let a = c.add_tenant("a".into(), 3);
        c.set_backlogged(a, true, ms(10));
        assert_eq!(c.pick(ms(25)), Some(a)); // waited 15 ms
        c.charge(a, 1000, ms(2), ms(5), ms(30)); // ran 5 ms, waits again from 30
        assert_eq!(c.pick_where(ms(40), |_| false), None);
        assert_eq!(c.stats()[0].wait_ns, nanos(ms(25)));
        c.set_backlogged(a, false, ms(50));
        let want = TenantStats {
            name: "a".into(),
            weight: 3,
            bytes: 1000,
            cpu_ns: nanos(ms(2)),
            wait_ns: nanos(ms(35)),
            run_ns: nanos(ms(5)),
            chunks: 1,
            backlogged: false,
        };
        assert_eq!(c.stats(), [want]);
    }

    #[test]
    fn jain_and_weighted_shares() {
        assert_eq!(jain(&[1.0, 1.0, 1.0]), 1.0);
        assert!((jain(&[1.0, 0.0, 0.0]) - 1.0 / 3.0).abs() < 1e-12);
        assert!((jain(&[1.0, 2.0]) - 0.9).abs() < 1e-12);
        let mut c = Credits::new(CostModel::default());
        for (name, w) in [("a", 1), ("b", 2), ("c", 4)] {
            let id = c.add_tenant(name.into(), w);
            c.charge(id, 100 * u64::from(w), Duration::ZERO, T0, T0);
        }
        c.charge(TenantId(0), 100, Duration::ZERO, T0, T0);
        let shares = weighted_shares(&c.stats(), &CostModel::BYTES);
        let want = [2.0 * 7.0 / 8.0, 7.0 / 8.0, 7.0 / 8.0];
        shares
            .iter()
            .zip(want)
            .for_each(|(s, w)| assert!((s - w).abs() < 1e-12, "{shares:?}"));
    }

    // --- no starvation, no wrong pick, under random weights, sizes and backlog changes ---

    #[derive(Clone, Debug)]
    enum Op {
        /// Fill the free workers, then finish one chunk; new chunks move this many bytes.
        Run(u64),
        Toggle(usize),
        Remove(usize),
        Readd(usize),
    }

    const MIN_CHUNK: u64 = 64 * KIB;
    const MAX_CHUNK: u64 = FIRST_GUESS_BYTES;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            12 => (MIN_CHUNK..=MAX_CHUNK).prop_map(Op::Run),
            3 => (0..6usize).prop_map(Op::Toggle),
            1 => (0..6usize).prop_map(Op::Remove),
            1 => (0..6usize).prop_map(Op::Readd),
        ]
    }

    /// What the service believes about each tenant slot (a slot keeps its name and weight).
    struct Model {
        sim: Sim,
        ids: Vec<TenantId>,
        weights: Vec<u32>,
        on: Vec<bool>,
        removed: HashSet<TenantId>,
        /// Picks of others since the slot became backlogged or was last picked.
        waited: Vec<usize>,
        bound: Vec<usize>,
    }

    impl Model {
        fn new(weights: Vec<u32>, workers: usize) -> Model {
            let (sim, ids) = Sim::new(&weights, workers);
            let n = weights.len();
            let bound = (0..n).map(|k| starvation_bound(&weights, k)).collect();
            let (on, waited) = (vec![true; n], vec![0; n]);
            Model {
                sim,
                ids,
                weights,
                on,
                removed: HashSet::new(),
                waited,
                bound,
            }
        }

        fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
            let n = self.ids.len();
            match *op {
                Op::Run(bytes) => self.run(bytes)?,
                Op::Toggle(k) => self.toggle(k % n),
                Op::Remove(k) => {
                    self.sim.c.remove_tenant(self.ids[k % n]);
                    self.removed.insert(self.ids[k % n]);
                    self.on[k % n] = false;
                }
                Op::Readd(k) => self.readd(k % n),
            }
            Ok(())
        }

        /// A removed slot comes back under a new id, idle; a present one keeps its state.
        fn readd(&mut self, k: usize) {
            let id = self.sim.c.add_tenant(format!("t{k}"), self.weights[k]);
            if id != self.ids[k] {
                (self.ids[k], self.on[k], self.waited[k]) = (id, false, 0);
            }
        }

        fn toggle(&mut self, k: usize) {
            if !self.removed.contains(&self.ids[k]) {
                self.on[k] = !self.on[k];
                self.waited[k] = 0;
                self.sim
                    .c
                    .set_backlogged(self.ids[k], self.on[k], self.sim.now);
            }
        }

        fn run(&mut self, bytes: u64) -> Result<(), TestCaseError> {
            for id in self.sim.fill(&|_| (bytes, Duration::ZERO)) {
                self.check_pick(id)?;
            }
            let idle = self.sim.busy.len() < self.sim.workers;
            prop_assert!(
                !(idle && self.on.contains(&true)),
                "a worker idles while {:?}",
                self.on
            );
            if let Some((id, known)) = self.sim.finish_first() {
                prop_assert_eq!(known, !self.removed.contains(&id));
            }
            Ok(())
        }

        fn check_pick(&mut self, id: TenantId) -> Result<(), TestCaseError> {
            let k = self.ids.iter().position(|&x| x == id);
            prop_assert!(
                k.is_some_and(|k| self.on[k]),
                "picked {:?}, not backlogged",
                id
            );
            for j in (0..self.ids.len()).filter(|&j| self.on[j]) {
                self.waited[j] = if self.ids[j] == id {
                    0
                } else {
                    self.waited[j] + 1
                };
                prop_assert!(self.waited[j] <= self.bound[j], "slot {} starved", j);
            }
            Ok(())
        }
    }

    /// How many picks of others a backlogged slot `k` may see before its own: each other
    /// tenant runs while behind it by at most one of its largest chunks, in steps of that
    /// tenant's smallest, plus what misestimates of chunks in flight (two workers) allow.
    fn starvation_bound(weights: &[u32], k: usize) -> usize {
        let ratio = (MAX_CHUNK / MIN_CHUNK) as usize;
        let others = (0..weights.len()).filter(|&j| j != k);
        let wk = weights[k] as usize;
        others
            .map(|j| (ratio * weights[j] as usize).div_ceil(wk) + 2 * ratio + 2)
            .sum()
    }

    proptest! {
        #[test]
        fn every_backlogged_tenant_is_picked_and_only_those(
            weights in prop::collection::vec(1u32..=16, 2..=6),
            workers in 1usize..=2,
            ops in prop::collection::vec(op(), 1..600),
        ) {
            let mut m = Model::new(weights, workers);
            for op in &ops {
                m.apply(op)?;
            }
        }
    }
}
