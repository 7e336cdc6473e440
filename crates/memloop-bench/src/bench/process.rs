//! `memloop bench process`: what the preload library costs on process lifecycle and short
//! connections, each figure measured without the library ("plain") and with it ("preload") in
//! one run, all on 127.0.0.1 in one domain.
//!
//! Every process is `memloop-bench proc-peer` (an ordinary program: std::net, libc's fork). A
//! preloaded one is started with `MEMLOOP_REGION` and `LD_PRELOAD` set directly (no `memloop
//! run` in between, so a fresh process is timed fairly); a plain one without either.
//!
//! | figure | preload variant | plain variant |
//! | --- | --- | --- |
//! | fork+exit, fork+_exit | forking process preloaded, nothing open | plain |
//! | … holding a conn | forker holds a ring connection to a preloaded echo server | both plain |
//! | short conns → non-member | client preloaded, server plain | both plain |
//! | short conns → iterative / fork server | server preloaded, client plain | both plain |
//! | fresh process, first conn | `once` preloaded → preloaded server (joins, gets a ring) | both plain |
//! | fresh process, noop | `noop` preloaded (the library's load and exit alone) | plain |
//!
//! Rounds interleave the variants, alternating which goes first (plain, preload, preload,
//! plain, …); each figure is the median of its rounds. The region's counters are read around
//! every run: where a ring is expected (held connection, fresh process) the preload variant
//! must show one ring connection per connection, else the report line carries a warning.

mod forking;
pub mod peer;

use super::report::{align, fmt_num, write_results, Record};
use crate::error::{fail, CliResult, Context};
use crate::run as preload;
use memloop::registry::{counter_name, COUNTER_RING_CONNS};
use memloop::{CreateRegion, Region, RegionSpec};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ProcessArgs {
    /// Two rounds of shorter runs (~10 s in all), for a look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Rounds; each figure is the median of its rounds (default 5, 2 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Region to use (kept afterwards); default: a temporary `bench-<pid>`, destroyed at the end.
    #[arg(long)]
    region: Option<String>,
}

struct Config {
    rounds: usize,
    /// Forks per measured loop (each of exit and _exit).
    forks: u32,
    /// Short connections per run, to an iterative server and to a fork-per-connection one.
    conns: u32,
    fork_conns: u32,
    /// Fresh processes per run (their median is the run's figure).
    spawns: usize,
}

impl Config {
    fn from_args(a: &ProcessArgs) -> Config {
        let q = a.quick;
        Config {
            rounds: a.repeat.unwrap_or(if q { 2 } else { 5 }).max(1),
            forks: if q { 1500 } else { 3000 },
            conns: if q { 3000 } else { 5000 },
            fork_conns: if q { 1000 } else { 2000 },
            spawns: if q { 30 } else { 60 },
        }
    }
}

/// Unmeasured fresh processes before each measured batch.
const SPAWN_WARMUP: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Plain = 0,
    Preload = 1,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Preload => "preload",
        }
    }

    /// Round `r`'s order: plain first in even rounds, preload first in odd ones.
    fn order(r: usize) -> [Variant; 2] {
        if r.is_multiple_of(2) {
            [Variant::Plain, Variant::Preload]
        } else {
            [Variant::Preload, Variant::Plain]
        }
    }
}

/// One kind of run; a run gives one or two figures.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Group {
    ForkBare,
    ForkHold,
    ConnOut,
    ConnIn,
    ConnFork,
    Fresh,
    Noop,
}

const GROUPS: [Group; 7] = [
    Group::ForkBare,
    Group::ForkHold,
    Group::ConnOut,
    Group::ConnIn,
    Group::ConnFork,
    Group::Fresh,
    Group::Noop,
];

impl Group {
    fn label(self) -> &'static str {
        match self {
            Group::ForkBare => "fork loops, nothing open",
            Group::ForkHold => "fork loops holding a connection",
            Group::ConnOut => "short connections to a non-member",
            Group::ConnIn => "short connections to an iterative server",
            Group::ConnFork => "short connections to a fork-per-connection server",
            Group::Fresh => "fresh processes, one connection each",
            Group::Noop => "fresh processes doing nothing",
        }
    }

    /// Ring connections one preload run must make.
    fn rings_per_run(self, cfg: &Config) -> u64 {
        match self {
            Group::ForkHold => 1,
            Group::Fresh => (SPAWN_WARMUP + cfg.spawns) as u64,
            _ => 0,
        }
    }
}

/// A target: the preload / plain ratio at most `max`; `cost` says it reads as a percentage.
#[derive(Clone, Copy, Debug)]
struct Target {
    max: f64,
    cost: bool,
}

impl Target {
    fn met(&self, ratio: f64) -> bool {
        ratio <= self.max
    }

    fn show(&self) -> String {
        if self.cost {
            format!("≤ {:.0}%", (self.max - 1.0) * 100.0)
        } else {
            format!("≤ {:.2}×", self.max)
        }
    }
}

struct Fig {
    name: &'static str,
    group: Group,
    /// Where the library is in the preload variant.
    lib_in: &'static str,
    target: Option<Target>,
}

const fn ratio_target(max: f64) -> Option<Target> {
    Some(Target { max, cost: false })
}

const fn cost_target(pct: f64) -> Option<Target> {
    Some(Target {
        max: 1.0 + pct / 100.0,
        cost: true,
    })
}

const FIGS: [Fig; 9] = [
    Fig {
        name: "fork+exit",
        group: Group::ForkBare,
        lib_in: "forker (nothing open)",
        target: ratio_target(1.05),
    },
    Fig {
        name: "fork+_exit",
        group: Group::ForkBare,
        lib_in: "forker (nothing open)",
        target: ratio_target(1.05),
    },
    Fig {
        name: "fork+exit, conn held",
        group: Group::ForkHold,
        lib_in: "both ends (ring)",
        target: None,
    },
    Fig {
        name: "fork+_exit, conn held",
        group: Group::ForkHold,
        lib_in: "both ends (ring)",
        target: None,
    },
    Fig {
        name: "short conn → non-member",
        group: Group::ConnOut,
        lib_in: "client (server plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "short conn → iterative srv",
        group: Group::ConnIn,
        lib_in: "server (client plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "short conn → fork srv",
        group: Group::ConnFork,
        lib_in: "server (client plain)",
        target: cost_target(3.0),
    },
    Fig {
        name: "fresh process, first conn",
        group: Group::Fresh,
        lib_in: "both ends (ring)",
        target: ratio_target(1.3),
    },
    Fig {
        name: "fresh process, noop",
        group: Group::Noop,
        lib_in: "the process",
        target: None,
    },
];

fn fig_index(name: &str) -> usize {
    FIGS.iter()
        .position(|f| f.name == name)
        .expect("a figure of FIGS")
}

/// The median (the mean of the middle two for an even count); NaN if empty.
fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn fmt_ratio(r: f64) -> String {
    format!("{r:.3}×")
}

/// A ratio as the cost it means: 1.021 → "+2.1%".
fn fmt_cost(r: f64) -> String {
    format!("{:+.1}%", (r - 1.0) * 100.0)
}

/// How the preloaded and plain processes are started.
struct Env {
    exe: PathBuf,
    region: OsString,
    ld_preload: OsString,
}

impl Env {
    fn command(&self, v: Variant, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("proc-peer")
            .args(args)
            .env_remove("LD_PRELOAD")
            .env_remove("MEMLOOP_REGION");
        if v == Variant::Preload {
            c.env("MEMLOOP_REGION", &self.region)
                .env("LD_PRELOAD", &self.ld_preload);
        }
        c
    }
}

/// Whether a peer's `preloaded` answer is what its variant asks.
fn check_loaded(v: &Value, variant: Variant, what: &str) -> CliResult<()> {
    match (v["preloaded"].as_bool(), variant) {
        (Some(true), Variant::Preload) | (Some(false), Variant::Plain) => Ok(()),
        (Some(false), Variant::Preload) => Err(fail(format!(
            "{what}: the preload library is not loaded in the process"
        ))),
        (Some(true), Variant::Plain) => Err(fail(format!(
            "{what}: the preload library is loaded although it should not be"
        ))),
        (None, _) => Err(fail(format!("{what}: unexpected answer {v}"))),
    }
}

/// An echo server (`proc-peer serve`), stopped on drop (it also exits when we vanish: we hold
/// its stdin).
struct Server {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    port: u16,
}

impl Server {
    fn start(env: &Env, v: Variant, forking: bool) -> CliResult<Server> {
        let kind = if forking {
            "fork-per-connection"
        } else {
            "iterative"
        };
        let what = format!("{} {kind} server", v.name());
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        if forking {
            args.push("--fork");
        }
        let mut child = env
            .command(v, &args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context(format!("starting the {what}"))?;
        let out = child.stdout.take().expect("piped stdout");
        let mut s = Server {
            what,
            stdin: child.stdin.take(),
            child,
            port: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = tx.send(BufReader::new(out).read_line(&mut line).map(|_| line));
        });
        let line = match rx.recv_timeout(Duration::from_secs(15)) {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return Err(fail(format!("{}: {e}", s.what))),
            Err(_) => return Err(fail(format!("{}: not ready within 15 s", s.what))),
        };
        let ready: Value = serde_json::from_str(line.trim())
            .map_err(|_| fail(format!("{}: did not start (said {line:?})", s.what)))?;
        check_loaded(&ready, v, &s.what)?;
        s.port = ready["port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| fail(format!("{}: no port in {ready}", s.what)))?;
        Ok(s)
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Why a run against this server may have failed: it is gone.
    fn state(&mut self) -> String {
        match self.child.try_wait() {
            Ok(Some(st)) => format!(" (the {} exited: {st})", self.what),
            _ => String::new(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bench's region; destroyed on drop if the bench created it for itself.
struct BenchRegion {
    region: Region,
    temporary: bool,
}

impl BenchRegion {
    fn open(name: Option<&str>) -> CliResult<BenchRegion> {
        let (arg, temporary) = match name {
            Some(r) => (r.to_string(), false),
            None => (format!("bench-{}", std::process::id()), true),
        };
        let spec = RegionSpec::parse(&arg);
        let region = Region::open_or_create(&spec, &CreateRegion::default())
            .context(format!("opening bench region {}", spec.path().display()))?;
        Ok(BenchRegion { region, temporary })
    }

    fn counters(&self) -> Vec<u64> {
        self.region.registry().counters()
    }

    /// The counters once they stop moving: a server frees the channel of a connection (adding
    /// its bytes) after the client has gone, so the last run's tail would count in the next.
    fn settled_counters(&self) -> Vec<u64> {
        let mut last = self.counters();
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(10));
            let now = self.counters();
            if now == last {
                break;
            }
            last = now;
        }
        last
    }
}

impl Drop for BenchRegion {
    fn drop(&mut self) {
        if self.temporary {
            let spec = self.region.spec();
            if let Err(e) = Region::destroy(spec) {
                eprintln!(
                    "memloop: could not remove bench region {}: {e}",
                    spec.path().display()
                );
            }
        }
    }
}

/// What the region's counters did during one group's runs of one variant.
#[derive(Default, Clone)]
struct Activity {
    runs: u64,
    deltas: Vec<u64>,
}

impl Activity {
    fn add(&mut self, before: &[u64], after: &[u64]) {
        self.runs += 1;
        if self.deltas.len() < after.len() {
            self.deltas.resize(after.len(), 0);
        }
        for (i, (a, b)) in after.iter().zip(before).enumerate() {
            self.deltas[i] += a.saturating_sub(*b);
        }
    }

    fn rings(&self) -> u64 {
        self.deltas.get(COUNTER_RING_CONNS).copied().unwrap_or(0)
    }

    /// The counters that moved, by name.
    fn moved(&self) -> Vec<(String, u64)> {
        self.deltas
            .iter()
            .enumerate()
            .filter(|(_, &d)| d > 0)
            .map(|(i, &d)| (counter_name(i).map_or(format!("#{i}"), String::from), d))
            .collect()
    }
}

struct Bench {
    cfg: Config,
    env: Env,
    region: BenchRegion,
    /// Iterative and fork-per-connection servers, by variant.
    iterative: [Server; 2],
    forking: [Server; 2],
}

impl Bench {
    /// Runs a peer to completion and returns its JSON line.
    fn peer_json(&self, v: Variant, args: &[&str], what: &str) -> CliResult<Value> {
        let out = self
            .env
            .command(v, args)
            .stdin(Stdio::null())
            .output()
            .context(format!("running {what}"))?;
        if !out.status.success() {
            return Err(fail(format!(
                "{what} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().rev().find(|l| !l.trim().is_empty());
        let v_json: Value = line
            .and_then(|l| serde_json::from_str(l).ok())
            .ok_or_else(|| fail(format!("{what}: no JSON result in {stdout:?}")))?;
        check_loaded(&v_json, v, what)?;
        Ok(v_json)
    }

    /// Spawn → exit of `k` fresh processes, in µs each (after a few unmeasured ones).
    fn spawn_times(&self, v: Variant, args: &[&str], what: &str) -> CliResult<Vec<f64>> {
        let mut times = Vec::with_capacity(self.cfg.spawns);
        for i in 0..SPAWN_WARMUP + self.cfg.spawns {
            let mut cmd = self.env.command(v, args);
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let t = Instant::now();
            let status = cmd
                .spawn()
                .and_then(|mut c| c.wait())
                .context(format!("running {what}"))?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if !status.success() {
                // Again, to say why.
                let out = self.env.command(v, args).stdin(Stdio::null()).output();
                let why = out.map_or(String::new(), |o| {
                    String::from_utf8_lossy(&o.stderr).trim().to_owned()
                });
                return Err(fail(format!("{what} failed ({status}): {why}")));
            }
            if i >= SPAWN_WARMUP {
                times.push(us);
            }
        }
        Ok(times)
    }

    /// One run of group `g`, variant `v`: its figures as (index in FIGS, µs).
    fn measure(&mut self, g: Group, v: Variant) -> CliResult<Vec<(usize, f64)>> {
        let who = |s: &str| format!("{s} ({})", v.name());
        let number = |j: &Value, key: &str, what: &str| {
            j[key]
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| fail(format!("{what}: no {key} in {j}")))
        };
        let forks = self.cfg.forks.to_string();
        let vi = v as usize;
        Ok(match g {
            Group::ForkBare | Group::ForkHold => {
                let mut args = vec!["fork", "--n", &forks];
                let hold = self.iterative[vi].addr();
                if g == Group::ForkHold {
                    args.extend(["--hold", &hold]);
                }
                let what = who("the forking peer");
                let j = self.peer_json(v, &args, &what)?;
                let (a, b) = if g == Group::ForkBare {
                    ("fork+exit", "fork+_exit")
                } else {
                    ("fork+exit, conn held", "fork+_exit, conn held")
                };
                vec![
                    (fig_index(a), number(&j, "exit_us", &what)?),
                    (fig_index(b), number(&j, "raw_exit_us", &what)?),
                ]
            }
            Group::ConnOut | Group::ConnIn | Group::ConnFork => {
                let (client, server, n, fig) = match g {
                    Group::ConnOut => (
                        v,
                        &self.iterative[0],
                        self.cfg.conns,
                        "short conn → non-member",
                    ),
                    Group::ConnIn => (
                        Variant::Plain,
                        &self.iterative[vi],
                        self.cfg.conns,
                        "short conn → iterative srv",
                    ),
                    _ => (
                        Variant::Plain,
                        &self.forking[vi],
                        self.cfg.fork_conns,
                        "short conn → fork srv",
                    ),
                };
                let (addr, n) = (server.addr(), n.to_string());
                let what = format!(
                    "the {} client of the {}",
                    client.name(),
                    server.what.clone()
                );
                let j = self.peer_json(client, &["connect", "--addr", &addr, "--n", &n], &what)?;
                vec![(fig_index(fig), number(&j, "mean_us", &what)?)]
            }
            Group::Fresh => {
                let addr = self.iterative[vi].addr();
                let t = self.spawn_times(v, &["once", "--addr", &addr], &who("proc-peer once"))?;
                vec![(fig_index("fresh process, first conn"), median(&t))]
            }
            Group::Noop => {
                let t = self.spawn_times(v, &["noop"], &who("proc-peer noop"))?;
                vec![(fig_index("fresh process, noop"), median(&t))]
            }
        })
    }

    /// The server a failed run of `g` used, if it is gone (for the error message).
    fn server_state(&mut self, g: Group, v: Variant) -> String {
        let vi = v as usize;
        match g {
            Group::ForkHold | Group::ConnIn | Group::Fresh => self.iterative[vi].state(),
            Group::ConnOut => self.iterative[0].state(),
            Group::ConnFork => self.forking[vi].state(),
            _ => String::new(),
        }
    }
}

/// The results: per figure and variant the value of each round; per group and variant what
/// the region's counters did; per group why its preload runs stopped, if they did.
struct Results {
    samples: Vec<[Vec<f64>; 2]>,
    activity: Vec<[Activity; 2]>,
    failed: Vec<Option<String>>,
}

pub fn run(a: &ProcessArgs) -> CliResult<()> {
    let cfg = Config::from_args(a);
    let lib = preload::find_library()?;
    let region = BenchRegion::open(a.region.as_deref())?;
    let (region_val, ld_preload) = preload::preload_env(&lib, region.region.spec(), None)?;
    let env = Env {
        exe: std::env::current_exe().context("locating the memloop-bench binary")?,
        region: region_val,
        ld_preload,
    };
    let servers = |forking| -> CliResult<[Server; 2]> {
        Ok([
            Server::start(&env, Variant::Plain, forking)?,
            Server::start(&env, Variant::Preload, forking)?,
        ])
    };
    let (iterative, forking) = (servers(false)?, servers(true)?);
    let mut bench = Bench {
        cfg,
        env,
        region,
        iterative,
        forking,
    };
    let mut res = Results {
        samples: vec![Default::default(); FIGS.len()],
        activity: vec![Default::default(); GROUPS.len()],
        failed: vec![None; GROUPS.len()],
    };
    let t0 = Instant::now();
    let bar = super::progress((bench.cfg.rounds * GROUPS.len() * 2) as u64);
    for round in 0..bench.cfg.rounds {
        for (gi, &g) in GROUPS.iter().enumerate() {
            for v in Variant::order(round) {
                bar.set_message(format!("{} ({})", g.label(), v.name()));
                bar.inc(1);
                if res.failed[gi].is_some() {
                    continue;
                }
                let before = bench.region.counters();
                let r = bench.measure(g, v);
                res.activity[gi][v as usize].add(&before, &bench.region.settled_counters());
                match r {
                    Ok(figs) => {
                        for (i, us) in figs {
                            res.samples[i][v as usize].push(us);
                        }
                    }
                    Err(e) => {
                        let e = format!("{e}{}", bench.server_state(g, v));
                        if v == Variant::Plain {
                            return Err(fail(e));
                        }
                        res.failed[gi] = Some(e);
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    let elapsed = t0.elapsed();
    let Bench {
        cfg,
        region,
        iterative,
        forking,
        ..
    } = bench;
    // Servers first, then the region.
    drop((iterative, forking));
    let region_name = region.region.spec().path().display().to_string();
    drop(region);
    report(&res, &cfg, a, &region_name, elapsed)
}

/// One figure's medians and verdict.
struct Row {
    fig: &'static Fig,
    plain: Option<f64>,
    preload: Option<f64>,
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        match (self.plain, self.preload) {
            (Some(p), Some(l)) if p > 0.0 => Some(l / p),
            _ => None,
        }
    }

    fn met(&self) -> Option<bool> {
        Some(self.fig.target?.met(self.ratio()?))
    }
}

fn rows(res: &Results) -> Vec<Row> {
    FIGS.iter()
        .zip(&res.samples)
        .map(|(fig, s)| {
            let m = |v: &Vec<f64>| (!v.is_empty()).then(|| median(v));
            Row {
                fig,
                plain: m(&s[0]),
                preload: m(&s[1]),
            }
        })
        .collect()
}

fn table(rows: &[Row]) -> String {
    let head = [
        "figure",
        "library in",
        "unit",
        "plain",
        "preload",
        "ratio",
        "cost",
        "target",
        "",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        let num = |v: Option<f64>| v.map_or("-".into(), fmt_num);
        let ratio = r.ratio();
        let verdict = match r.met() {
            Some(true) => "ok",
            Some(false) => "MISSED",
            None => "",
        };
        lines.push(vec![
            r.fig.name.into(),
            r.fig.lib_in.into(),
            "µs".into(),
            num(r.plain),
            num(r.preload),
            ratio.map_or("-".into(), fmt_ratio),
            ratio.map_or("-".into(), fmt_cost),
            r.fig.target.map_or("-".into(), |t| t.show()),
            verdict.into(),
        ]);
    }
    align(&lines)
}

/// What the region's counters say about group `g`'s runs; a warning where a ring was expected
/// and not used (or used where none could be).
fn verification(g: Group, act: &[Activity; 2], cfg: &Config) -> String {
    let (plain, pre) = (&act[0], &act[1]);
    let moved = |a: &Activity| {
        a.moved()
            .iter()
            .map(|(n, d)| format!("{n} +{d}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let expected = g.rings_per_run(cfg) * pre.runs;
    let mut s = if pre.runs == 0 {
        "no preload run".to_string()
    } else if expected > 0 && pre.rings() < expected {
        format!(
            "WARNING: the ring was not used: {} ring connection(s) in {} preload run(s), \
             expected {expected}",
            pre.rings(),
            pre.runs
        )
    } else if expected == 0 && pre.rings() > 0 {
        format!(
            "WARNING: unexpected ring connections ({}) where no ring can be used",
            pre.rings()
        )
    } else if expected > 0 {
        format!(
            "ring verified: {} ring connection(s) in {} preload run(s)",
            pre.rings(),
            pre.runs
        )
    } else {
        "no ring expected, none used".to_string()
    };
    let m = moved(pre);
    if !m.is_empty() {
        s += &format!("; region counters in the preload runs: {m}");
    }
    let m = moved(plain);
    if !m.is_empty() {
        s += &format!("; WARNING: the plain runs moved region counters: {m}");
    }
    s
}

fn report(
    res: &Results,
    cfg: &Config,
    a: &ProcessArgs,
    region: &str,
    elapsed: Duration,
) -> CliResult<()> {
    println!(
        "memloop bench process: {} round(s) (plain and preload interleaved, alternating which \
         goes first), medians of the rounds; per run {} forks per loop, {} short connections \
         ({} to the fork-per-connection server; mean per connection), {} fresh processes \
         (median spawn → exit); 127.0.0.1, region {region}; ratio = preload / plain (> 1: the \
         library costs); {:.0} s",
        cfg.rounds,
        cfg.forks,
        cfg.conns,
        cfg.fork_conns,
        cfg.spawns,
        elapsed.as_secs_f64()
    );
    println!();
    let rows = rows(res);
    print!("{}", table(&rows));
    println!();
    let ver: Vec<(Group, String)> = GROUPS
        .iter()
        .zip(&res.activity)
        .map(|(&g, act)| (g, verification(g, act, cfg)))
        .collect();
    for ((g, v), failed) in ver.iter().zip(&res.failed) {
        println!("  {:<51} {v}", format!("{}:", g.label()));
        if let Some(e) = failed {
            println!("  {:<51} FAILED, preload runs stopped: {e}", "");
        }
    }
    let val = |name: &str| {
        let r = &rows[fig_index(name)];
        Some((r.plain?, r.preload?))
    };
    if let (Some((op, ol)), Some((np, nl))) =
        (val("fresh process, first conn"), val("fresh process, noop"))
    {
        println!();
        println!(
            "Fresh process: the library adds {:+.0} µs to spawn → first connection → exit, of \
             which {:+.0} µs load and exit alone (noop); joining the region and the first ring \
             connection: {:+.0} µs",
            ol - op,
            nl - np,
            (ol - op) - (nl - np)
        );
    }
    let with_target: Vec<&Row> = rows.iter().filter(|r| r.met().is_some()).collect();
    let missed: Vec<&str> = with_target
        .iter()
        .filter(|r| r.met() == Some(false))
        .map(|r| r.fig.name)
        .collect();
    println!(
        "Targets: {} of {} met{}",
        with_target.len() - missed.len(),
        with_target.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!("; missed: {}", missed.join(", "))
        }
    );
    if let Some(file) = &a.json {
        let records: Vec<Record> = rows
            .iter()
            .flat_map(|r| {
                let note = ver
                    .iter()
                    .find(|(g, _)| *g == r.fig.group)
                    .map(|(_, v)| v.clone());
                [(Variant::Plain, r.plain), (Variant::Preload, r.preload)]
                    .into_iter()
                    .filter_map(move |(v, x)| {
                        let mut rec = Record::new(r.fig.name, v.name(), 0, "us", x?);
                        rec.note = (v == Variant::Preload).then(|| note.clone()).flatten();
                        Some(rec)
                    })
            })
            .collect();
        let figures: Vec<Value> = rows
            .iter()
            .zip(&res.samples)
            .map(|(r, s)| {
                json!({
                    "name": r.fig.name,
                    "library_in": r.fig.lib_in,
                    "unit": "us",
                    "plain": r.plain,
                    "preload": r.preload,
                    "ratio": r.ratio(),
                    "cost_pct": r.ratio().map(|x| (x - 1.0) * 100.0),
                    "target": r.fig.target.map(|t| t.show()),
                    "met": r.met(),
                    "rounds": { "plain": s[0], "preload": s[1] },
                })
            })
            .collect();
        let groups: Vec<Value> = GROUPS
            .iter()
            .zip(&res.activity)
            .zip(&ver)
            .zip(&res.failed)
            .map(|(((g, act), (_, v)), failed)| {
                let counters = |a: &Activity| {
                    Value::Object(a.moved().into_iter().map(|(n, d)| (n, d.into())).collect())
                };
                json!({
                    "group": g.label(),
                    "verification": v,
                    "failed": failed,
                    "plain": { "runs": act[0].runs, "counters": counters(&act[0]) },
                    "preload": { "runs": act[1].runs, "counters": counters(&act[1]) },
                })
            })
            .collect();
        let v = json!({
            "bench": "process",
            "config": {
                "rounds": cfg.rounds,
                "forks_per_loop": cfg.forks,
                "conns_per_run": cfg.conns,
                "fork_server_conns_per_run": cfg.fork_conns,
                "spawns_per_run": cfg.spawns,
                "order": "plain, preload; preload, plain; … (alternating per round)",
                "region": region,
                "elapsed_s": elapsed.as_secs_f64(),
            },
            "figures": figures,
            "groups": groups,
            "records": records,
        });
        write_results(&v, file)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn ratios_and_costs_read_as_targets() {
        assert_eq!(fmt_ratio(1.0213), "1.021×");
        assert_eq!(fmt_cost(1.0213), "+2.1%");
        assert_eq!(fmt_cost(0.99), "-1.0%");
        let cost = cost_target(3.0).unwrap();
        assert_eq!(cost.show(), "≤ 3%");
        assert!(cost.met(1.029) && !cost.met(1.031));
        let ratio = ratio_target(1.3).unwrap();
        assert_eq!(ratio.show(), "≤ 1.30×");
        assert!(ratio.met(1.3) && !ratio.met(1.31));
    }

    #[test]
    fn rounds_alternate_which_variant_goes_first() {
        assert_eq!(Variant::order(0), [Variant::Plain, Variant::Preload]);
        assert_eq!(Variant::order(1), [Variant::Preload, Variant::Plain]);
    }

    #[test]
    fn missing_ring_is_a_warning() {
        let cfg = Config::from_args(&ProcessArgs {
            quick: true,
            json: None,
            repeat: None,
            region: None,
        });
        let mut pre = Activity::default();
        let zero = vec![0u64; COUNTER_RING_CONNS + 1];
        pre.add(&zero, &zero);
        let act = [Activity::default(), pre.clone()];
        assert!(verification(Group::ForkHold, &act, &cfg).starts_with("WARNING"));
        assert!(verification(Group::ConnOut, &act, &cfg).starts_with("no ring expected"));
        let mut one = zero.clone();
        one[COUNTER_RING_CONNS] = 1;
        let mut pre = Activity::default();
        pre.add(&zero, &one);
        let act = [Activity::default(), pre];
        assert!(verification(Group::ForkHold, &act, &cfg).starts_with("ring verified"));
        assert!(verification(Group::ConnIn, &act, &cfg).starts_with("WARNING"));
    }
}
