//! `memloop bench switch`: what a live demote (ring → TCP, issue 12) costs, on fresh ring
//! connections between two preloaded processes, beside the same runs on plain kernel TCP (where
//! the trigger is a no-op `sendmsg`: the control for the measurement itself).
//!
//! Each repetition is one fresh connection (`memloop-bench switch-peer`, an ordinary TCP
//! program): 8-byte round trips (the path before), then — busy: both ends streaming both ways,
//! idle: nothing moving — the client passes its own fd to itself with `SCM_RIGHTS` (the
//! `sendmsg` returns once this side is on TCP), then round trips again (the path after: TCP).
//! Measured per repetition:
//! - trigger → return: the `sendmsg`, i.e. this side's switch;
//! - trigger → peer on TCP: the server's "switched to TCP" line of the preload's log
//!   (`MEMLOOP_LOG=memloop_preload::conn::switch=debug`, wall clock, µs), and its "left the
//!   ring" (the peer noticed);
//! - busy: the largest gap between consecutive reads that returned data, in the window after
//!   the trigger (the stall), beside the median and largest gap in the window before, at each
//!   receiving end;
//! - the round trips before (ring) and after (TCP), so costs read in round trips of the slower
//!   path.
//!
//! Paths: `memloop-lo` (127.0.0.1 in domain 0) and `memloop` (domain 0 ↔ domain 1 over the
//! bridge), both ends under `memloop run` in one region; their controls `tcp-loopback` and
//! `veth+bridge`, no preload. Repetitions interleave the paths and variants.

pub mod fdpass;
pub mod peer;

use super::pingpong::percentile;
use super::report::fmt_num;
use super::sys;
use super::tcp::procs::{Proc, Testbed};
use super::tcp::{check_preloaded, preload_status, MEMLOOP, MEMLOOP_LO, TCP_LO, VETH};
use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use peer::{Gaps, Outcome, Rep};
use serde::Serialize;
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
    /// Round trips before and after each switch (default 200, 50 with --quick).
    #[arg(long)]
    pings: Option<u32>,
    /// Chunk size of the busy streams.
    #[arg(long, default_value = "16K")]
    chunk: String,
    /// Do not pin client and server to different CPUs.
    #[arg(long)]
    no_pin: bool,
}

/// The preload's log, switch events only.
const LOG_FILTER: &str = "memloop_preload::conn::switch=debug";
const LOG_TARGET: &str = "memloop_preload::conn::switch";

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

/// What one path collected over its repetitions, in µs.
#[derive(Default)]
struct Samples {
    rtt_before: Vec<f64>,
    rtt_after: Vec<f64>,
    /// Per variant (0 busy, 1 idle).
    cost: [Vec<f64>; 2],
    peer_done: [Vec<f64>; 2],
    peer_noticed: [Vec<f64>; 2],
    left: [Vec<f64>; 2],
    first_rtt: [Vec<f64>; 2],
    /// Busy, per receiving end (0 client, 1 server).
    stall: [Vec<f64>; 2],
    typical: [Vec<f64>; 2],
    before_max: [Vec<f64>; 2],
    /// Busy: streamed bytes and time, for the rate.
    bytes: u64,
    switched: usize,
    reps: usize,
}

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
                bar.set_message(format!("{v} demote over {}", p.def.name));
                if let Err(e) = one(p, &cfg, busy) {
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
    let env: &[(&str, &str)] = if def.preload {
        &[("MEMLOOP_LOG", LOG_FILTER)]
    } else {
        &[]
    };
    let args = |role: &str, addr: &str| -> Vec<String> {
        ["--role", role, "--addr", addr].map(String::from).into()
    };
    let spawn = |role: &str, domain: u8, cpu: Option<usize>, addr: &str| {
        let argv = bed.command_of("switch-peer", domain, cpu, region, &args(role, addr));
        Proc::spawn_with(format!("{} {role}", def.name), &argv, env, Some(LOG_TARGET))
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

/// A log line's time: the RFC 3339 UTC stamp tracing starts it with, as ns since the epoch.
fn log_time(line: &str) -> Option<u64> {
    let t = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut h = hms.splitn(3, ':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    let digits = frac.len().min(9);
    let ns = frac[..digits].parse::<i64>().ok()? * 10i64.pow(9 - digits as u32);
    // Days from 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs * 1_000_000_000 + ns).ok()
}

/// The first log line of `side` with `what` at or after `from` (wall ns), as its time.
fn logged(lines: &[String], what: &str, side: &str, from: u64) -> Option<u64> {
    lines
        .iter()
        .filter(|l| l.contains(what) && l.contains(&format!("side={side}")))
        .filter_map(|l| log_time(l))
        // The log has µs: a line of the trigger's own µs counts.
        .filter(|&t| t + 1_000 >= from)
        .min()
}

/// One repetition on path `p`.
fn one(p: &mut Path, cfg: &Config, busy: bool) -> CliResult<()> {
    let (server, client) = p.ends.as_mut().expect("measured paths are live");
    let timeout = cfg.pre + cfg.post + Duration::from_secs(30);
    let v = client.ask_json(&cfg.rep(busy), timeout)?;
    let o: Outcome = serde_json::from_value(v).context("a switch-peer reply")?;
    let us = |ns: u64| ns as f64 / 1e3;
    let s = &mut p.s;
    let k = usize::from(!busy);
    s.reps += 1;
    s.rtt_before.extend(o.rtt_before.iter().map(|&x| us(x)));
    s.rtt_after.extend(o.rtt_after.iter().map(|&x| us(x)));
    s.cost[k].push(us(o.cost_ns));
    if let Some(&first) = o.rtt_after.first() {
        s.first_rtt[k].push(us(first));
    }
    for (i, g) in [o.rx_client, o.rx_server].into_iter().enumerate() {
        let Some(g): Option<Gaps> = g else { continue };
        s.stall[i].push(us(g.after_max));
        s.typical[i].push(us(g.typical));
        s.before_max[i].push(us(g.before_max));
    }
    s.bytes += o.bytes_c2s + o.bytes_s2c;
    if !p.def.preload {
        return Ok(());
    }
    // The server logs its switch before it answers another byte; give its stderr a moment.
    let (mut lines, t0) = (client.take_kept(), Instant::now());
    let from = o.trigger_wall_ns;
    loop {
        lines.extend(server.take_kept());
        let done = logged(&lines, "switched to TCP", "Server", from);
        if done.is_some() || t0.elapsed() > Duration::from_millis(500) {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if logged(&lines, "switched to TCP", "Client", from).is_some() {
        s.switched += 1;
    }
    let since = |t: u64| us(t.saturating_sub(from));
    if let Some(t) = logged(&lines, "switched to TCP", "Server", from) {
        s.peer_done[k].push(since(t));
    }
    if let Some(t) = logged(&lines, "left the ring", "Server", from) {
        s.peer_noticed[k].push(since(t));
    }
    if let Some(t) = logged(&lines, "left the ring", "Client", from) {
        s.left[k].push(since(t));
    }
    Ok(())
}

/// p50 and p99 of `v` (None if empty).
fn stats(v: &[f64]) -> Option<(f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    Some((percentile(&v, 0.5), percentile(&v, 0.99)))
}

/// One figure of the report and the JSON.
#[derive(Serialize, Clone)]
struct Figure {
    path: &'static str,
    variant: &'static str,
    metric: &'static str,
    unit: &'static str,
    n: usize,
    p50: f64,
    p99: f64,
    /// In round trips of the slower path (times only).
    #[serde(skip_serializing_if = "Option::is_none")]
    rtts_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rtts_p99: Option<f64>,
}

// Metric names, as in the table and the JSON.
const RTT_BEFORE: &str = "round trip before the switch";
const RTT_AFTER: &str = "round trip after the switch";
const COST: &str = "trigger → return (this side on TCP)";
const LEFT: &str = "trigger → this side left the ring";
const PEER_NOTICED: &str = "trigger → peer left the ring";
const PEER_DONE: &str = "trigger → peer on TCP";
const FIRST_RTT: &str = "first round trip after";
const STALL: [&str; 2] = [
    "stall: largest gap after, client rx",
    "stall: largest gap after, server rx",
];
const TYPICAL: [&str; 2] = [
    "median gap before, client rx",
    "median gap before, server rx",
];
const BEFORE_MAX: [&str; 2] = [
    "largest gap before, client rx",
    "largest gap before, server rx",
];

/// The slower path's median round trip on `p`: the larger of before and after.
fn slower_rtt(s: &Samples) -> Option<f64> {
    let b = stats(&s.rtt_before)?.0;
    let a = stats(&s.rtt_after)?.0;
    Some(b.max(a))
}

fn figures(paths: &[Path]) -> Vec<Figure> {
    let mut out = Vec::new();
    for p in paths.iter().filter(|p| p.unavailable.is_none()) {
        let s = &p.s;
        let rtt = slower_rtt(s);
        let mut put = |variant, metric, v: &[f64], in_rtts: bool| {
            let Some((p50, p99)) = stats(v) else { return };
            let r = rtt.filter(|&r| in_rtts && r > 0.0);
            out.push(Figure {
                path: p.def.name,
                variant,
                metric,
                unit: "us",
                n: v.len(),
                p50,
                p99,
                rtts_p50: r.map(|r| p50 / r),
                rtts_p99: r.map(|r| p99 / r),
            });
        };
        put("-", RTT_BEFORE, &s.rtt_before, false);
        put("-", RTT_AFTER, &s.rtt_after, false);
        for (k, variant) in ["busy", "idle"].into_iter().enumerate() {
            put(variant, LEFT, &s.left[k], true);
            put(variant, COST, &s.cost[k], true);
            put(variant, PEER_NOTICED, &s.peer_noticed[k], true);
            put(variant, PEER_DONE, &s.peer_done[k], true);
            put(variant, FIRST_RTT, &s.first_rtt[k], true);
        }
        for end in 0..2 {
            put("busy", STALL[end], &s.stall[end], true);
            put("busy", TYPICAL[end], &s.typical[end], false);
            put("busy", BEFORE_MAX[end], &s.before_max[end], false);
        }
    }
    out
}

/// The table: one row per (variant, metric, p50|p99), one column per path, then each memloop
/// path's figure in round trips of its slower path.
fn table(figs: &[Figure]) -> String {
    let cols = [MEMLOOP_LO, TCP_LO, MEMLOOP, VETH];
    let mut head: Vec<String> = ["variant", "metric (µs)", "stat"].map(String::from).into();
    head.extend(cols.iter().map(|c| c.to_string()));
    head.extend([
        format!("{MEMLOOP_LO} in RTTs"),
        format!("{MEMLOOP} in RTTs"),
    ]);
    let mut lines = vec![head];
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for f in figs {
        if !keys.contains(&(f.variant, f.metric)) {
            keys.push((f.variant, f.metric));
        }
    }
    for (variant, metric) in keys {
        for (q, stat) in [(false, "p50"), (true, "p99")] {
            let find = |path: &str| {
                figs.iter()
                    .find(|f| f.path == path && f.variant == variant && f.metric == metric)
            };
            let mut line: Vec<String> = vec![variant.into(), metric.into(), stat.into()];
            for c in cols {
                line.push(find(c).map_or("-".into(), |f| fmt_num(if q { f.p99 } else { f.p50 })));
            }
            for c in [MEMLOOP_LO, MEMLOOP] {
                let r = find(c).and_then(|f| if q { f.rtts_p99 } else { f.rtts_p50 });
                line.push(r.map_or("-".into(), |r| format!("{r:.2}")));
            }
            lines.push(line);
        }
    }
    super::report::align(&lines)
}

/// The targets this run speaks to.
fn targets(figs: &[Figure], paths: &[Path]) -> Vec<String> {
    let find = |path: &str, variant: &str, metric: &str| {
        figs.iter()
            .find(|f| f.path == path && f.variant == variant && f.metric == metric)
    };
    let mut out = Vec::new();
    for p in paths
        .iter()
        .filter(|p| p.def.preload && p.unavailable.is_none())
    {
        let name = p.def.name;
        let rtt = slower_rtt(&p.s).unwrap_or(0.0);
        for variant in ["busy", "idle"] {
            let (Some(c), done) = (find(name, variant, COST), find(name, variant, PEER_DONE))
            else {
                continue;
            };
            let rt = |f: &Figure| {
                format!(
                    "{:.2} / {:.2}",
                    f.rtts_p50.unwrap_or(0.0),
                    f.rtts_p99.unwrap_or(0.0)
                )
            };
            let peer = done.map_or("peer not observed".into(), |d| {
                format!("peer on TCP {} RTTs", rt(d))
            });
            out.push(format!(
                "{name}, {variant}: a demote costs {} RTTs (p50 / p99; slower path's RTT {} µs), \
                 {peer} (target: ≤ 2)",
                rt(c),
                fmt_num(rtt)
            ));
        }
        let stall: Vec<f64> = (0..2)
            .filter_map(|e| find(name, "busy", STALL[e]).map(|f| f.p99))
            .collect();
        let p50: Vec<f64> = (0..2)
            .filter_map(|e| find(name, "busy", STALL[e]).map(|f| f.p50))
            .collect();
        if !stall.is_empty() {
            let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            out.push(format!(
                "{name}, busy: the stream stalls {} µs at the median, {} µs at p99 (worse \
                 direction) for a demote alone (target for demote + promote: < 1000 µs; \
                 promote is opt-in and not measured here)",
                fmt_num(max(&p50)),
                fmt_num(max(&stall))
            ));
        }
    }
    out
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
         {} ms more; idle: the client demotes after {} ms of silence; gaps over {} ms windows \
         before and after the trigger; {} round trips of 8 B before and after; {pinning}",
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
                "switch logged on {} of {} connections",
                p.s.switched, p.s.reps
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
         switch, i.e. ring or TCP); p99 over {} repetitions is close to their maximum.",
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
                    "slower_rtt_us": slower_rtt(&p.s),
                    "per_rep_us": {
                        "busy_cost": p.s.cost[0], "idle_cost": p.s.cost[1],
                        "busy_peer_on_tcp": p.s.peer_done[0], "idle_peer_on_tcp": p.s.peer_done[1],
                        "busy_stall_client_rx": p.s.stall[0], "busy_stall_server_rx": p.s.stall[1],
                    },
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
                "pinning": pinning,
            },
            "paths": paths_json,
            "figures": figs,
        });
        super::report::write_results(&v, file)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_times_parse_as_tracing_prints_them() {
        let l = "2024-03-01T00:00:01.000002Z DEBUG memloop_preload::conn::switch: switched to TCP side=Server";
        // 2024-03-01 is day 19783 since the epoch.
        assert_eq!(
            log_time(l),
            Some(19_783 * 86_400_000_000_000 + 1_000_002_000)
        );
        assert_eq!(log_time("garbage"), None);
        let lines = vec![l.to_string()];
        assert!(logged(&lines, "switched to TCP", "Server", 0).is_some());
        assert!(logged(&lines, "switched to TCP", "Client", 0).is_none());
        assert!(logged(&lines, "switched to TCP", "Server", u64::MAX / 2).is_none());
    }
}
