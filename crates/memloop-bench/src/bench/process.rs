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
//!
//! This file holds the arguments, the servers and the runner; `figures` what is measured and
//! its targets, `report` what is printed and written.

mod figures;
mod forking;
pub mod peer;
mod report;

use super::native::OwnedRegion;
use crate::error::{fail, CliResult, Context};
use crate::run as preload;
use figures::{fig_index, median, Group, Variant, FIGS, GROUPS};
use memloop::RegionSpec;
use report::{report, Results};
use serde_json::Value;
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

/// How the preloaded and plain processes are started.
struct Env {
    exe: PathBuf,
    region: OsString,
    ld_preload: OsString,
}

impl Env {
    fn command(&self, v: Variant, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("proc-peer").args(args);
        self.environment(&mut c, v);
        c
    }

    /// `sh` running `/bin/true` `n` times (a fork and an exec each).
    fn script(&self, v: Variant, n: usize) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"
            ))
            .stdin(Stdio::null());
        self.environment(&mut c, v);
        c
    }

    fn environment(&self, c: &mut Command, v: Variant) {
        c.env_remove("LD_PRELOAD").env_remove("MEMLOOP_REGION");
        if v == Variant::Preload {
            c.env("MEMLOOP_REGION", &self.region)
                .env("LD_PRELOAD", &self.ld_preload);
        }
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

/// The bench's region (destroyed on drop if the bench made it), and what it counted.
struct BenchRegion {
    owned: OwnedRegion,
}

impl BenchRegion {
    fn open(name: Option<&str>) -> CliResult<BenchRegion> {
        Ok(BenchRegion {
            owned: OwnedRegion::open(name)?,
        })
    }

    fn spec(&self) -> &RegionSpec {
        self.owned.region.spec()
    }

    fn counters(&self) -> Vec<u64> {
        self.owned.region.registry().counters()
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
            Group::Script => {
                let n = self.cfg.spawns * 5;
                let t = Instant::now();
                let status = self.env.script(v, n).status().context(who("running sh"))?;
                if !status.success() {
                    return Err(fail(format!("{}: {status}", who("the sh loop"))));
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                vec![(fig_index("script: sh → /bin/true"), us)]
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

pub fn run(a: &ProcessArgs) -> CliResult<()> {
    let cfg = Config::from_args(a);
    let lib = preload::find_library()?;
    let region = BenchRegion::open(a.region.as_deref())?;
    let (region_val, ld_preload) = preload::preload_env(&lib, region.spec(), None)?;
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
    let region_name = region.spec().path().display().to_string();
    drop(region);
    report(&res, &cfg, a, &region_name, elapsed)
}
