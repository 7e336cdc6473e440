//! `memloop bench link`: the network link over the region (MMNet, `memloop link`) against the
//! veth+bridge path between the same two domains, in one run, the paths side by side:
//!
//! 1. **TCP stream, one flow**: iperf3 (`iperf3 -s -1` in domain 1 bound to the address,
//!    `iperf3 -c … -t N -J` in domain 0); Gbit/s as the receiver counted it. The link's
//!    counters must have grown by at least the bytes iperf3 received (domain 0's half sent
//!    them, domain 1's half received them), else the path reports "not routed" and no figure.
//! 2. **TCP request/response, 64 B**: the ordinary socket ends of `bench tcp` (`tcp-peer`,
//!    no preload): server in domain 1, client in domain 0, back-to-back round trips on one
//!    connection (TCP_NODELAY); mean (elapsed over round trips) and p99. Routed: both halves'
//!    bytes grew by at least 64 B per round trip each way.
//! 3. **ping**: `ping -c 200 -i 0.01 -q` from domain 0; average RTT. Routed: the halves'
//!    packet counters grew by at least the replies received.
//! 4. **idle**: after the traffic of a round, nothing sent: CPU time of both link services
//!    (schedstat, all threads) over 5 s (2 s with --quick), as % of one CPU.
//!
//! Besides: the link's drops (ring full, bad frames), restarts and the offloads each side's
//! device accepted, from the links table (`memloop status --json`'s "links").
//!
//! Each side's service is `memloop link up NAME --foreground` (this binary's hidden
//! `link-service up`) started in its domain with `memloop domains exec`, stopped with
//! `link-service down` in the domain at the end. The domains (prefix `mlk<pid>`, a free
//! subnet) and the region (`bench-link-<pid>`) are this run's own and removed at the end, also
//! on error; if this process dies, the services stop when their stdin closes and a janitor
//! removes the domains and the region. Every figure is the median of its rounds; the two paths
//! alternate within a round (which goes first alternates too). Processes are not pinned: the
//! link's services need CPU time of their own.

mod bed;
mod figs;

use super::report::{self, Record};
use crate::error::{fail, CliResult};
use crate::units::{fmt_size, parse_size};
use std::path::PathBuf;
use std::time::Duration;

pub use bed::service;

#[derive(clap::Args)]
pub struct LinkArgs {
    /// Short runs (1 s per measurement, 2 s idle window, one round): a quick look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE ({test, path, size, unit, value} records).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seconds of each iperf3 run (whole seconds, rounded up) and of each request/response
    /// measurement (default 5, or 1 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Rounds, the paths interleaved in each; every figure is the median of its rounds
    /// (default 3, 1 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Only these figures (comma separated): stream, rr, ping, idle.
    #[arg(long, value_delimiter = ',', value_name = "FIGURE")]
    only: Option<Vec<String>>,
    /// Passed to `memloop link up --spin-us` on both sides (default: link up's own).
    #[arg(long, value_name = "US")]
    spin_us: Option<u64>,
    /// Passed to `memloop link up --ring-size` on both sides (default: link up's own).
    #[arg(long, value_name = "SIZE")]
    ring_size: Option<String>,
}

/// The link's path and the path it is compared with.
pub const LINK: &str = "link";
pub const BRIDGE: &str = "veth+bridge";
/// The path of ratio records: the link's figure over the bridge's.
pub const RATIO_PATH: &str = "link / veth+bridge";
/// The marker of a link figure whose traffic did not cross the link (value 0, a note).
pub const NOT_ROUTED: &str = "not routed";

pub const STREAM: &str = "tcp-stream";
pub const RR: &str = "tcp-rr";
pub const PING: &str = "ping";
pub const IDLE: &str = "idle";
pub const DROPS: &str = "link-drops";
/// Tests whose `size` is the number of link sides (2), not a message size.
pub const PER_SIDE: [&str; 2] = [IDLE, DROPS];

/// Units of the figures.
pub const GBIT: &str = "Gbit/s";
pub const US_MEAN: &str = "us mean";
pub const US_AVG: &str = "us avg";
pub const CPU_PCT: &str = "cpu%";
pub const RATIO: &str = "ratio";
pub const P99_RATIO: &str = "p99 ratio";

/// The figures a run measures, and how.
#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    pub repeat: usize,
    pub stream: bool,
    pub rr: bool,
    pub ping: bool,
    pub idle: bool,
    /// iperf3 -t (whole seconds).
    pub stream_secs: u64,
    /// iperf3 -O: seconds left out at the start (slow start).
    pub omit_secs: u64,
    pub rr_dur: Duration,
    pub rr_warmup: Duration,
    pub ping_count: u32,
    /// The idle window.
    pub idle_for: Duration,
    pub spin_us: Option<u64>,
    pub ring_size: Option<String>,
}

impl Opts {
    /// What `bench link [--quick]` runs by default.
    pub fn new(quick: bool) -> Opts {
        let mut o = Opts {
            quick,
            repeat: if quick { 1 } else { 3 },
            stream: true,
            rr: true,
            ping: true,
            idle: true,
            stream_secs: 0,
            omit_secs: if quick { 0 } else { 1 },
            rr_dur: Duration::ZERO,
            rr_warmup: Duration::ZERO,
            ping_count: 200,
            idle_for: Duration::from_secs(if quick { 2 } else { 5 }),
            spin_us: None,
            ring_size: None,
        };
        o.set_duration(if quick { 1.0 } else { 5.0 });
        o
    }

    /// Seconds per measurement: iperf3's (whole seconds) and the round trips'.
    pub fn set_duration(&mut self, secs: f64) {
        self.stream_secs = (secs.ceil() as u64).max(1);
        self.rr_dur = Duration::from_secs_f64(secs);
        self.rr_warmup = self.rr_dur / 5;
    }

    fn from_args(a: &LinkArgs) -> CliResult<Opts> {
        let mut o = Opts::new(a.quick);
        if let Some(d) = a.duration {
            if !(d > 0.0 && d <= 3600.0) {
                return Err(fail(format!("--duration {d}: seconds in (0, 3600]")));
            }
            o.set_duration(d);
        }
        if let Some(r) = a.repeat {
            o.repeat = r.clamp(1, 100);
        }
        if let Some(only) = &a.only {
            for f in only {
                if !FIGURES.contains(&f.as_str()) {
                    return Err(fail(format!(
                        "--only {f}: the figures are stream, rr, ping and idle"
                    )));
                }
            }
            let has = |f: &str| only.iter().any(|x| x == f);
            (o.stream, o.rr, o.ping, o.idle) = (has("stream"), has("rr"), has("ping"), has("idle"));
        }
        if let Some(r) = &a.ring_size {
            let n = parse_size(r)?;
            if !n.is_power_of_two() || !(1 << 18..=1 << 30).contains(&n) {
                return Err(fail("--ring-size: a power of two from 256K to 1G"));
            }
            o.ring_size = Some(r.clone());
        }
        o.spin_us = a.spin_us;
        Ok(o)
    }

    /// Progress steps of one round (one per path of each figure, and the idle window).
    pub fn steps(&self) -> u64 {
        2 * (u64::from(self.stream) + u64::from(self.rr) + u64::from(self.ping))
            + u64::from(self.idle)
    }

    /// The region's size: room for the link's two rings with plenty to spare.
    fn region_bytes(&self) -> u64 {
        let ring = self
            .ring_size
            .as_deref()
            .and_then(|r| parse_size(r).ok())
            .unwrap_or(4 << 20);
        (ring * 4).max(64 << 20)
    }
}

const FIGURES: [&str; 4] = ["stream", "rr", "ping", "idle"];

/// What a run found besides its records.
#[derive(Default, Debug)]
pub struct Outcome {
    pub records: Vec<Record>,
    /// Lines a reader must see (a figure not measured, the link's setup, its offloads).
    pub notes: Vec<String>,
    /// Link figures whose traffic did not cross the link: a failure of the link.
    pub not_routed: Vec<String>,
}

/// Runs the figures `o` asks for: `progress` is told the start of each step.
pub fn figures(o: &Opts, progress: &mut dyn FnMut(&str)) -> CliResult<Outcome> {
    let mut out = Outcome::default();
    let mut o = o.clone();
    for (wanted, tool, what) in [
        (&mut o.stream, "iperf3", "TCP stream"),
        (&mut o.ping, "ping", "ping"),
    ] {
        if *wanted && !figs::have(tool) {
            *wanted = false;
            out.notes.push(format!(
                "{what} not measured: `{tool}` is not installed (apt-get install {})",
                if tool == "ping" { "iputils-ping" } else { tool }
            ));
        }
    }
    let mut bed = bed::Bed::up(&o)?;
    out.notes.push(bed.describe());
    let mut raw = Vec::new();
    let mut seq = 0u16;
    for round in 1..=o.repeat {
        let tag = match o.repeat {
            1 => String::new(),
            n => format!("round {round}/{n}: "),
        };
        // Which path goes first alternates from round to round.
        let order = if round % 2 == 1 {
            [figs::Path::Link, figs::Path::Bridge]
        } else {
            [figs::Path::Bridge, figs::Path::Link]
        };
        if o.stream {
            for p in order {
                progress(&format!(
                    "{tag}TCP stream (iperf3 -t {}) over {}",
                    o.stream_secs,
                    p.name()
                ));
                seq += 1;
                let r = figs::stream(&mut bed, p, &o, seq);
                raw.extend(bed.explain(r)?);
            }
        }
        if o.rr {
            for p in order {
                progress(&format!("{tag}TCP 64 B round trips over {}", p.name()));
                let r = figs::rr(&mut bed, p, &o);
                raw.extend(bed.explain(r)?);
            }
        }
        if o.ping {
            for p in order {
                progress(&format!(
                    "{tag}ping -c {} -i 0.01 over {}",
                    o.ping_count,
                    p.name()
                ));
                let r = figs::ping(&mut bed, p, &o);
                raw.extend(bed.explain(r)?);
            }
        }
        if o.idle {
            progress(&format!(
                "{tag}idle link for {:.0} s",
                o.idle_for.as_secs_f64()
            ));
            let r = figs::idle(&mut bed, &o);
            raw.push(bed.explain(r)?);
        }
    }
    // A link figure with a round that did not cross the link is no figure at all.
    let unrouted: Vec<&'static str> = raw
        .iter()
        .filter(|r| r.unit == NOT_ROUTED)
        .map(|r| r.test)
        .collect();
    raw.retain(|r| !(r.path == LINK && unrouted.contains(&r.test) && r.unit != NOT_ROUTED));
    for r in raw.iter().filter(|r| r.unit == NOT_ROUTED) {
        out.not_routed
            .push(format!("{}: {}", r.test, r.note.as_deref().unwrap_or("")));
    }
    let mut records = report::median_of_rounds(raw);
    let (drops, note) = bed.drops()?;
    records.extend(drops);
    out.notes.push(note);
    drop(bed);
    ratios(&mut records);
    out.records = records;
    out.notes.dedup();
    Ok(out)
}

pub fn run(a: &LinkArgs) -> CliResult<()> {
    let o = Opts::from_args(a)?;
    let total = o.steps() * o.repeat as u64;
    let mut step = 0;
    let out = figures(&o, &mut |m| {
        step += 1;
        eprintln!("[{step}/{total}] {m}");
    })?;
    print(&out, &o);
    if let Some(f) = &a.json {
        report::write_json(&out.records, f)?;
        println!("results written to {}", f.display());
    }
    if out.not_routed.is_empty() {
        Ok(())
    } else {
        Err(fail(format!(
            "NOT ROUTED: traffic meant for the link did not cross it ({})",
            out.not_routed.join("; ")
        )))
    }
}

/// (test, unit compared, unit of its ratio record, the target on the ratio).
const RATIOS: [(&str, &str, &str, &str); 4] = [
    (STREAM, GBIT, RATIO, "≥ 2×"),
    (RR, US_MEAN, RATIO, "≤ 0.7×"),
    (RR, US_MEAN, P99_RATIO, ""),
    (PING, US_AVG, RATIO, ""),
];

/// Ratio records (link over bridge) for each figure both paths measured.
fn ratios(records: &mut Vec<Record>) {
    let mut add = Vec::new();
    for (test, unit, ratio_unit, _) in RATIOS {
        let get = |path: &str| {
            records
                .iter()
                .find(|r| r.test == test && r.path == path && r.unit == unit)
        };
        if let (Some(l), Some(b)) = (get(LINK), get(BRIDGE)) {
            let (lv, bv) = match ratio_unit {
                P99_RATIO => (l.p99.unwrap_or(0.0), b.p99.unwrap_or(0.0)),
                _ => (l.value, b.value),
            };
            if lv > 0.0 && bv > 0.0 {
                add.push(Record::new(test, RATIO_PATH, l.size, ratio_unit, lv / bv));
            }
        }
    }
    records.extend(add);
}

fn find<'a>(r: &'a [Record], test: &str, path: &str, unit: &str) -> Option<&'a Record> {
    r.iter()
        .find(|x| x.test == test && x.path == path && x.unit == unit)
}

/// The size column: a message size, or the sides a per-side figure sums.
fn size_label(test: &str, size: u64) -> String {
    if PER_SIDE.contains(&test) {
        format!("{size} sides")
    } else {
        fmt_size(size)
    }
}

/// The side-by-side table (rows: test and metric; columns: the paths, their ratio, the target).
pub fn table(r: &[Record]) -> String {
    let head = [
        "test",
        "size",
        "metric",
        LINK,
        BRIDGE,
        "link / bridge",
        "target",
    ];
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    let v = |x: Option<&Record>| x.map_or("-".to_string(), |x| report::fmt_num(x.value));
    let ratio = |test: &str, unit: &str| {
        find(r, test, RATIO_PATH, unit).map_or("-".to_string(), |x| format!("{:.2}×", x.value))
    };
    let target = |test: &str, unit: &str| {
        RATIOS
            .iter()
            .find(|(t, _, u, _)| *t == test && *u == unit)
            .map_or("", |x| x.3)
            .to_string()
    };
    let mut row = |cells: [String; 7]| lines.push(cells.to_vec());
    for (test, unit) in [(STREAM, GBIT), (RR, US_MEAN), (PING, US_AVG)] {
        let (l, b) = (find(r, test, LINK, unit), find(r, test, BRIDGE, unit));
        let nr = find(r, test, LINK, NOT_ROUTED);
        let Some(size) = l.or(b).or(nr).map(|x| x.size) else {
            continue;
        };
        let metric = unit.replace("us", "µs");
        let link = if nr.is_some() {
            "NOT ROUTED".to_string()
        } else {
            v(l)
        };
        row([
            test.into(),
            size_label(test, size),
            metric,
            link.clone(),
            v(b),
            ratio(test, RATIO),
            target(test, RATIO),
        ]);
        if test == RR {
            let p99 = |x: Option<&Record>| {
                x.and_then(|x| x.p99)
                    .map_or("-".to_string(), report::fmt_num)
            };
            row([
                test.into(),
                size_label(test, size),
                "µs p99".into(),
                if nr.is_some() { link } else { p99(l) },
                p99(b),
                ratio(test, P99_RATIO),
                String::new(),
            ]);
        }
    }
    if let Some(i) = find(r, IDLE, LINK, CPU_PCT) {
        row([
            IDLE.into(),
            size_label(IDLE, i.size),
            "cpu% of one CPU".into(),
            report::fmt_num(i.value),
            "-".into(),
            "-".into(),
            "< 1%".into(),
        ]);
    }
    for x in r.iter().filter(|x| x.test == DROPS) {
        row([
            DROPS.into(),
            size_label(DROPS, x.size),
            x.unit.into(),
            format!("{}", x.value),
            "-".into(),
            "-".into(),
            String::new(),
        ]);
    }
    report::align(&lines)
}

/// The targets of the issue, from the ratio records, each said met or not.
pub fn targets(r: &[Record]) -> Vec<String> {
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut out = Vec::new();
    if let Some(x) = find(r, STREAM, RATIO_PATH, RATIO) {
        out.push(format!(
            "TCP stream (one flow) over the link: {:.2}× veth+bridge (target: ≥ 2×): {}",
            x.value,
            met(x.value >= 2.0)
        ));
    } else if find(r, STREAM, LINK, NOT_ROUTED).is_some() {
        out.push("TCP stream over the link: NOT ROUTED, no figure (target: ≥ 2×)".into());
    }
    if let Some(x) = find(r, RR, RATIO_PATH, RATIO) {
        let p99 = find(r, RR, RATIO_PATH, P99_RATIO)
            .map_or(String::new(), |p| format!(", p99 {:.2}×", p.value));
        out.push(format!(
            "TCP 64 B round trip over the link: mean {:.2}× veth+bridge's{p99} (target: ≤ 0.7×): \
             {}",
            x.value,
            met(x.value <= 0.7)
        ));
    } else if find(r, RR, LINK, NOT_ROUTED).is_some() {
        out.push(
            "TCP 64 B round trip over the link: NOT ROUTED, no figure (target: ≤ 0.7×)".into(),
        );
    }
    if let Some(x) = find(r, PING, RATIO_PATH, RATIO) {
        out.push(format!(
            "ping over the link: average RTT {:.2}× veth+bridge's (no target)",
            x.value
        ));
    }
    if let Some(x) = find(r, IDLE, LINK, CPU_PCT) {
        out.push(format!(
            "idle link: both services {:.3}% of one CPU (target: < 1%): {}",
            x.value,
            met(x.value < 1.0)
        ));
    }
    out
}

fn print(out: &Outcome, o: &Opts) {
    println!(
        "memloop bench link: the MMNet link (`memloop link`, TUN devices, one region) vs \
         veth+bridge between the same two domains; iperf3 -t {}{}, 64 B round trips for {:.2} s, \
         ping -c {} -i 0.01, idle window {:.0} s; {} round(s) (medians), the paths alternating; \
         processes not pinned{}",
        o.stream_secs,
        if o.omit_secs > 0 {
            format!(" -O {}", o.omit_secs)
        } else {
            String::new()
        },
        o.rr_dur.as_secs_f64(),
        o.ping_count,
        o.idle_for.as_secs_f64(),
        o.repeat,
        if o.quick {
            " (--quick: a smoke run, not figures to quote)"
        } else {
            ""
        }
    );
    println!();
    print!("{}", table(&out.records));
    println!();
    println!("targets:");
    for t in targets(&out.records) {
        println!("- {t}");
    }
    println!();
    for x in out.records.iter().filter(|x| x.note.is_some()) {
        println!(
            "- {} {} {}: {}",
            x.test,
            x.path,
            size_label(x.test, x.size),
            x.note.as_deref().unwrap_or("")
        );
    }
    for n in &out.notes {
        println!("- {n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(test: &'static str, path: &'static str, unit: &'static str, v: f64) -> Record {
        Record::new(test, path, 64, unit, v)
    }

    #[test]
    fn ratios_and_targets_follow_the_issue() {
        let mut r = vec![
            rec(STREAM, LINK, GBIT, 30.0),
            rec(STREAM, BRIDGE, GBIT, 10.0),
            rec(RR, LINK, US_MEAN, 14.0),
            rec(RR, BRIDGE, US_MEAN, 20.0),
            rec(PING, LINK, US_AVG, 50.0),
            rec(PING, BRIDGE, US_AVG, 40.0),
            Record::new(IDLE, LINK, 2, CPU_PCT, 0.25),
        ];
        r[2].p99 = Some(30.0);
        r[3].p99 = Some(40.0);
        ratios(&mut r);
        let get = |t, u| find(&r, t, RATIO_PATH, u).map(|x| x.value);
        assert_eq!(get(STREAM, RATIO), Some(3.0));
        assert_eq!(get(RR, RATIO), Some(0.7));
        assert_eq!(get(RR, P99_RATIO), Some(0.75));
        assert_eq!(get(PING, RATIO), Some(1.25));
        let t = targets(&r);
        assert_eq!(t.len(), 4, "{t:?}");
        assert!(t[0].contains("3.00×") && t[0].ends_with(": met"), "{t:?}");
        assert!(t[1].contains("0.70×") && t[1].ends_with(": met"), "{t:?}");
        assert!(t[3].contains("0.250%") && t[3].ends_with(": met"), "{t:?}");
        let table = table(&r);
        assert_eq!(table.lines().count(), 6, "{table}");
        assert!(table.contains("3.00×") && table.contains("≥ 2×"), "{table}");
        assert!(table.contains("2 sides"), "{table}");
    }

    #[test]
    fn a_link_figure_not_routed_has_no_value_and_no_ratio() {
        let mut nr = rec(STREAM, LINK, NOT_ROUTED, 0.0);
        nr.note = Some("counters grew by 0 B".into());
        let mut r = vec![nr, rec(STREAM, BRIDGE, GBIT, 10.0)];
        ratios(&mut r);
        assert!(find(&r, STREAM, RATIO_PATH, RATIO).is_none());
        let table = table(&r);
        assert!(table.contains("NOT ROUTED"), "{table}");
        assert!(targets(&r)[0].contains("NOT ROUTED"));
    }
}
