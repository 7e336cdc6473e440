//! `memloop bench switch`: what a live demote (ring → TCP, issue 12) and the promotion back
//! (TCP → ring) cost, on fresh ring connections between two preloaded processes, beside the
//! same runs on plain kernel TCP (where each trigger is a no-op: the control for the
//! measurement itself).
//!
//! Each repetition is one fresh connection (`memloop-bench switch-peer`, an ordinary TCP
//! program): 8-byte round trips (the path before), then — busy: both ends streaming both ways,
//! idle: nothing moving — the client passes its own fd to itself with `SCM_RIGHTS` (the
//! `sendmsg` returns once this side is on TCP), then round trips again (the path after: TCP).
//! Then the promotion: the client takes the fd it passed back out (the preload gives the
//! in-flight hold back: its side is no longer shared) and — busy: amid a second stream phase,
//! idle: after a silence — asks this process, which asks the region's registry for the
//! promotion (`Registry::request_promote`, what `memloop promote` does); then round trips
//! again (the ring).
//! Measured per repetition:
//! - trigger → return: the `sendmsg`, i.e. this side's switch (the client does not log its
//!   demote: a log line costs a few µs here, the first after a pause ~35 µs);
//! - trigger → peer on TCP: the server's "switched to TCP" line of the preload's log
//!   (`MEMLOOP_LOG=memloop_preload::switch=debug`: the switch milestones only, each logged
//!   after that step's wake-ups; wall clock, µs, appended to a file in /dev/shm: a pipe would
//!   wake our reader on every line), and its "left the ring" (the peer noticed);
//! - promotion: trigger → each side's "promoted: back on the ring", and → the switch word
//!   quiet again as this process polls it (every 100 µs);
//! - busy: the largest gap between consecutive reads that returned data, in the window after
//!   each trigger (the stall), beside the median and largest gap in the window before the
//!   demote, at each receiving end; and per repetition the two stalls' sum (demote + promote);
//! - the round trips before (ring), after the demote (TCP) and after the promotion (ring), so
//!   costs read in round trips of the slower path.
//!
//! Paths: `memloop-lo` (127.0.0.1 in domain 0) and `memloop` (domain 0 ↔ domain 1 over the
//! bridge), both ends under `memloop run` in one region; their controls `tcp-loopback` and
//! `veth+bridge`, no preload. Repetitions interleave the paths and variants.

pub mod fdpass;
mod figures;
mod logs;
pub mod peer;
mod promote;

use super::sys;
use super::tcp::procs::{Proc, Testbed};
use super::tcp::{check_preloaded, preload_status, MEMLOOP, MEMLOOP_LO, TCP_LO, VETH};
use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use figures::{figures, slower_rtt, table, targets, Samples};
use logs::{Events, LOG_FILTER, LOG_FILTER_CLIENT, LOG_TARGET};
use peer::{Outcome, PromoteAsk, Rep};
use promote::Promoter;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct SwitchArgs {
    /// A few short repetitions (3 per path and variant), for a look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Repetitions per path and variant, each on a fresh connection (default 20, 3 with
    /// --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Round trips before, between and after the switches (default 200, 50 with --quick).
    #[arg(long)]
    pings: Option<u32>,
    /// Chunk size of the busy streams.
    #[arg(long, default_value = "16K")]
    chunk: String,
    /// Do not pin client and server to different CPUs.
    #[arg(long)]
    no_pin: bool,
}

struct PathDef {
    name: &'static str,
    /// Client in domain 1 over the bridge (else both in domain 0 over 127.0.0.1).
    veth: bool,
    preload: bool,
    what: &'static str,
}

const PATHS: [PathDef; 4] = [
    PathDef {
        name: MEMLOOP_LO,
        veth: false,
        preload: true,
        what: "127.0.0.1 in domain 0, both under `memloop run`",
    },
    PathDef {
        name: TCP_LO,
        veth: false,
        preload: false,
        what: "127.0.0.1 in domain 0 (control: the trigger is a plain sendmsg)",
    },
    PathDef {
        name: MEMLOOP,
        veth: true,
        preload: true,
        what: "domain 0 ↔ domain 1, both under `memloop run`",
    },
    PathDef {
        name: VETH,
        veth: true,
        preload: false,
        what: "domain 0 ↔ domain 1 through veth pairs and the bridge (control)",
    },
];

struct Path {
    def: &'static PathDef,
    ends: Option<(Proc, Proc)>,
    unavailable: Option<String>,
    s: Samples,
}

struct Config {
    reps: usize,
    pings: u32,
    chunk: usize,
    pre: Duration,
    post: Duration,
    window: Duration,
    idle: Duration,
    cpus: Option<(usize, usize)>,
}

impl Config {
    fn from_args(a: &SwitchArgs) -> CliResult<Config> {
        let chunk = parse_size(&a.chunk)? as usize;
        if !(peer::MIN_CHUNK..=peer::MAX_CHUNK).contains(&chunk) {
            return Err(fail(format!(
                "--chunk {chunk}: must be {}..={} bytes",
                peer::MIN_CHUNK,
                peer::MAX_CHUNK
            )));
        }
        let ms = Duration::from_millis;
        let q = a.quick;
        Ok(Config {
            reps: a.reps.unwrap_or(if q { 3 } else { 20 }).max(1),
            pings: a.pings.unwrap_or(if q { 50 } else { 200 }).max(1),
            chunk,
            pre: ms(if q { 30 } else { 60 }),
            post: ms(if q { 30 } else { 60 }),
            window: ms(if q { 10 } else { 20 }),
            idle: ms(if q { 10 } else { 20 }),
            cpus: if a.no_pin { None } else { sys::two_cpus() },
        })
    }

    fn rep(&self, busy: bool) -> Rep {
        Rep {
            busy,
            pings: self.pings,
            chunk: self.chunk,
            pre_ms: if busy { self.pre } else { self.idle }.as_millis() as u64,
            post_ms: self.post.as_millis() as u64,
            window_ms: self.window.as_millis() as u64,
            promote: true,
        }
    }
}

pub fn run(a: &SwitchArgs) -> CliResult<()> {
    let cfg = Config::from_args(a)?;
    let region = format!("swbench-{}", std::process::id());
    let mut bed = Testbed::up(std::slice::from_ref(&region))?;
    let preload = preload_status(bed.exe());
    if preload.is_ok() {
        bed.create_region(&region)?;
    }
    let promoter = Promoter::open(preload.is_ok().then_some(region.as_str()))?;
    let mut paths: Vec<Path> = Vec::new();
    for def in &PATHS {
        let mut p = Path {
            def,
            ends: None,
            unavailable: None,
            s: Samples::default(),
        };
        match (&preload, def.preload) {
            (Err(why), true) => p.unavailable = Some(why.clone()),
            _ => match start(&bed, def, &cfg, &region) {
                Ok(ends) => p.ends = Some(ends),
                Err(e) if def.preload => p.unavailable = Some(format!("failed to start: {e}")),
                Err(e) => return Err(e),
            },
        }
        paths.push(p);
    }
    let live = paths.iter().filter(|p| p.ends.is_some()).count();
    let bar = super::progress((live * 2 * cfg.reps) as u64);
    for _ in 0..cfg.reps {
        for p in paths.iter_mut() {
            for busy in [true, false] {
                if p.ends.is_none() {
                    continue;
                }
                let v = if busy { "busy" } else { "idle" };
                bar.set_message(format!("{v} demote + promote over {}", p.def.name));
                if let Err(e) = one(p, &cfg, &promoter, busy) {
                    if !p.def.preload {
                        return Err(e);
                    }
                    p.ends = None;
                    p.unavailable = Some(format!("failed: {e}"));
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    for p in &mut paths {
        p.ends = None;
        if p.def.preload && p.unavailable.is_none() && p.s.switched < p.s.reps {
            p.unavailable = Some(format!(
                "failed: {} of {} connections logged no switch (not on a ring?)",
                p.s.reps - p.s.switched,
                p.s.reps
            ));
        }
        // (A connection that did not come back is a figure missing, not a failed path: its
        // count is printed beside the path.)
    }
    report(&paths, &cfg, &bed, a)
}

fn start(bed: &Testbed, def: &PathDef, cfg: &Config, region: &str) -> CliResult<(Proc, Proc)> {
    let (client_domain, listen) = if def.veth {
        (1, format!("{}:0", bed.addr(0)))
    } else {
        (0, "127.0.0.1:0".into())
    };
    let region = def.preload.then_some(region);
    let args = |role: &str, addr: &str| -> Vec<String> {
        ["--role", role, "--addr", addr].map(String::from).into()
    };
    // The preload logs to a file each: a line costs one `write` to tmpfs, where a pipe would
    // wake our reader on every line — inside the very switch being timed.
    let spawn = |role: &str, domain: u8, cpu: Option<usize>, addr: &str| {
        let argv = bed.command_of("switch-peer", domain, cpu, region, &args(role, addr));
        let what = format!("{} {role}", def.name);
        if !def.preload {
            return Proc::spawn_with(what, &argv, &[], None);
        }
        let log = log_file(&what)?;
        let filter = if role == "client" {
            LOG_FILTER_CLIENT
        } else {
            LOG_FILTER
        };
        let env = [
            ("MEMLOOP_LOG", filter),
            ("MEMLOOP_LOG_FILE", log.to_str().unwrap_or_default()),
        ];
        Ok(Proc::spawn_with(what, &argv, &env, Some(LOG_TARGET))?.with_log_file(log))
    };
    let mut server = spawn("server", 0, cfg.cpus.map(|c| c.1), &listen)?;
    let ready = server.ready()?;
    let addr = ready["addr"]
        .as_str()
        .ok_or_else(|| fail(format!("{} server: no address in {ready}", def.name)))?
        .to_owned();
    let mut client = spawn("client", client_domain, cfg.cpus.map(|c| c.0), &addr)?;
    client.ready()?;
    if def.preload {
        check_preloaded(&server)?;
        check_preloaded(&client)?;
    }
    Ok((server, client))
}

/// A fresh, empty log file for the peer `what` (in /dev/shm: a write there is a memory copy).
fn log_file(what: &str) -> CliResult<PathBuf> {
    let name = format!(
        "memloop-bench-switch-{}-{}.log",
        std::process::id(),
        what.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    );
    let path = std::path::Path::new("/dev/shm").join(name);
    std::fs::write(&path, b"").context(format!("creating {}", path.display()))?;
    Ok(path)
}

/// How long the driver waits for a promotion to finish before it lets the client go on (its
/// round trips then drive the rest).
const PROMOTE_WAIT: Duration = Duration::from_secs(2);

/// One repetition on path `p`: the client demotes, then asks us for the promotion.
fn one(p: &mut Path, cfg: &Config, promoter: &Promoter, busy: bool) -> CliResult<()> {
    let (server, client) = p.ends.as_mut().expect("measured paths are live");
    let timeout = cfg.pre + cfg.post + Duration::from_secs(30);
    let mut v = client.ask_json(&cfg.rep(busy), timeout)?;
    if let Some(q) = v.get("promote") {
        let q: PromoteAsk = serde_json::from_value(q.clone()).context("a promotion request")?;
        let t = promoter.trigger(&q, p.def.preload, PROMOTE_WAIT)?;
        v = client.ask_json(&t, timeout + PROMOTE_WAIT)?;
    }
    let o: Outcome = serde_json::from_value(v).context("a switch-peer reply")?;
    let ev = p.def.preload.then(|| events(server, client, &o));
    p.s.add(&o, ev.as_ref(), busy);
    Ok(())
}

/// What the ends logged about repetition `o`. Each logs a switch before it moves another byte,
/// but its stderr may lag its answer: a moment for the server's last line.
fn events(server: &Proc, client: &Proc, o: &Outcome) -> Events {
    let promote = o.promote.as_ref().map(|p| p.trigger_wall_ns);
    let (mut lines, t0) = (Vec::new(), Instant::now());
    loop {
        lines.extend(client.take_kept());
        lines.extend(server.take_kept());
        let ev = Events::from_lines(&lines, o.trigger_wall_ns, promote);
        if ev.peer_complete(promote.is_some()) || t0.elapsed() > Duration::from_millis(500) {
            return ev;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn report(paths: &[Path], cfg: &Config, bed: &Testbed, a: &SwitchArgs) -> CliResult<()> {
    let pinning = match cfg.cpus {
        Some((c, s)) => format!(
            "client pinned to CPU {c}, server to CPU {s} ({})",
            bed.pinning()
        ),
        None => "ends not pinned".into(),
    };
    println!(
        "memloop bench switch: {} repetitions per path and variant, each a fresh connection; \
         busy: both ends stream {} chunks both ways, the client demotes {} ms in and streams \
         {} ms more; idle: the client demotes after {} ms of silence; then the same again \
         around a promotion (asked by this process in the region's registry, as `memloop \
         promote` does); gaps over {} ms windows before \
         and after each trigger; {} round trips of 8 B before, between and after; {pinning}",
        cfg.reps,
        fmt_size(cfg.chunk as u64),
        cfg.pre.as_millis(),
        cfg.post.as_millis(),
        cfg.idle.as_millis(),
        cfg.window.as_millis(),
        cfg.pings
    );
    println!();
    for p in paths {
        let state = match &p.unavailable {
            Some(why) => why.clone(),
            None if p.def.preload => format!(
                "switch logged on {} of {} connections, back on the ring on {}",
                p.s.switched, p.s.reps, p.s.promoted
            ),
            None => String::new(),
        };
        println!("  {:<13} {}  {state}", p.def.name, p.def.what);
    }
    println!();
    let figs = figures(paths);
    print!("{}", table(&figs));
    println!();
    println!(
        "RTTs: the figure divided by the path's slower median round trip (before or after the \
         demote, i.e. ring or TCP); p99 over {} repetitions is close to their maximum. On the \
         controls each trigger is a no-op (a plain sendmsg; a time taken).",
        cfg.reps
    );
    for line in targets(&figs, paths) {
        println!("{line}");
    }
    if let Some(file) = &a.json {
        let paths_json: Vec<_> = paths
            .iter()
            .map(|p| {
                json!({
                    "name": p.def.name,
                    "what": p.def.what,
                    "preload": p.def.preload,
                    "available": p.unavailable.is_none(),
                    "reason": p.unavailable,
                    "reps": p.s.reps,
                    "switched": p.s.switched,
                    "promoted": p.s.promoted,
                    "slower_rtt_us": slower_rtt(&p.s),
                    "per_rep_us": p.s.per_rep_json(),
                })
            })
            .collect();
        let v = json!({
            "bench": "switch",
            "config": {
                "reps": cfg.reps,
                "pings": cfg.pings,
                "chunk": cfg.chunk,
                "busy_pre_ms": cfg.pre.as_millis() as u64,
                "busy_post_ms": cfg.post.as_millis() as u64,
                "idle_ms": cfg.idle.as_millis() as u64,
                "window_ms": cfg.window.as_millis() as u64,
                "trigger": "SCM_RIGHTS self-pass in the client",
                "promote_trigger": "Registry::request_promote from the bench process",
                "pinning": pinning,
            },
            "paths": paths_json,
            "figures": figs,
        });
        super::report::write_results(&v, file)?;
    }
    Ok(())
}
