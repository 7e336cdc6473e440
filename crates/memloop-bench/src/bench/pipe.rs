//! `memloop bench pipe`: the pipe service (issue 20) against what a program does without it, in
//! one run, the paths side by side:
//!
//! 1. **socket → socket relay** (a proxy): a source process sends N bytes over loopback TCP to
//!    the relay (this process), which forwards them over loopback TCP to a sink process. The
//!    relay is a user-space copy loop (read/write, 256 KiB) or hands both sockets to the pipe
//!    service and waits for the completion (a splice loop in the relay is the reference).
//!    Throughput, and CPU per byte of the relay and of the service. See [`relay`].
//! 2. **fairness**: a service with one worker, three tenants of weights 1:2:4 each with a
//!    transfer that never ends (/dev/zero → /dev/null); each tenant's bytes over a window, from
//!    the service's statistics at two times → Jain's index of the weight-normalised shares;
//!    then the shares of the two left after the heaviest stops.
//! 3. **static-file server**: lighttpd or nginx (sendfile on) serving 1, 16 and 64 MiB files
//!    from RAM to a keep-alive HTTP client in this process: the server as it is, and under
//!    `memloop run` with `MEMLOOP_PIPE_SENDFILE=1` and the pipe service serving its region.
//!    Throughput and the server's CPU per byte. The second path must show the service moving
//!    the server's bytes (its statistics), else it reports "not routed" and gives no figures.
//!
//! The service is always a `memloop pipe serve` process of its own (this binary's hidden
//! `pipe-service serve`), so its CPU time is its own. The relay's source and sink are this
//! binary again (hidden `pipe-peer`). Every figure is the median of its rounds; the paths
//! alternate within a round.

mod fair;
pub mod peer;
mod relay;
mod svc;
mod web;

pub use relay::CPU_TOTAL as RELAY_CPU_TOTAL;
pub use web::{CPU_SERVER as SERVER_CPU, NOT_ROUTED};

use super::report::{self, Record};
use super::sys;
use crate::error::{fail, CliResult};
use crate::units::{fmt_size, parse_size};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct PipeArgs {
    /// Short runs (128 MiB per figure, one round, 0.5 s fairness windows): a quick look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE ({test, path, size, unit, value} records).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Bytes per relay run and per file size of the static-file figure (default 1G, or 128M
    /// with --quick).
    #[arg(long, value_name = "SIZE")]
    bytes: Option<String>,
    /// Rounds, the paths interleaved in each; every figure is the median of its rounds
    /// (default 3, 1 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Only these figures (comma separated): relay, fairness, static.
    #[arg(long, value_delimiter = ',', value_name = "FIGURE")]
    only: Option<Vec<String>>,
    /// The static-file server: lighttpd, nginx, or auto (lighttpd if installed, else nginx).
    #[arg(long, default_value = "auto")]
    server: String,
    /// The static-file client's keep-alive connections (one thread each).
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// The service's workers for the relay and static-file figures (default: one per CPU).
    #[arg(long)]
    workers: Option<usize>,
    /// Seconds of each fairness window (default 2, or 0.5 with --quick).
    #[arg(long, value_name = "SECS")]
    window: Option<f64>,
    /// Do not pin: by default the relay (and its service) or the static-file server run on one
    /// CPU, the ends (source and sink, or the HTTP client) on another.
    #[arg(long)]
    no_pin: bool,
    /// Where the static-file figure's service runs: `free` (unpinned), `server` (the server's
    /// CPU) or `ends` (the client's CPU).
    #[arg(long, default_value = "free", value_name = "WHERE")]
    service_cpu: String,
}

/// The figures a run measures, and how.
#[derive(Clone, Debug)]
pub struct Opts {
    pub quick: bool,
    pub bytes: u64,
    pub repeat: usize,
    pub relay: bool,
    pub fairness: bool,
    pub stat: bool,
    pub server: String,
    pub connections: usize,
    pub workers: Option<usize>,
    pub window: Duration,
    /// (CPU of the ends, CPU of the relay or server and the service), if pinned.
    pub cpus: Option<(usize, usize)>,
    /// The static-file figure's service: "free", "server" or "ends".
    pub service_cpu: String,
}

impl Opts {
    /// What `bench pipe [--quick]` runs by default.
    pub fn new(quick: bool) -> Opts {
        Opts {
            quick,
            bytes: if quick { 128 << 20 } else { 1 << 30 },
            repeat: if quick { 1 } else { 3 },
            relay: true,
            fairness: true,
            stat: true,
            server: "auto".into(),
            connections: 2,
            workers: None,
            window: Duration::from_millis(if quick { 500 } else { 2000 }),
            cpus: sys::two_cpus(),
            service_cpu: "free".into(),
        }
    }

    fn from_args(a: &PipeArgs) -> CliResult<Opts> {
        let mut o = Opts::new(a.quick);
        if let Some(b) = &a.bytes {
            o.bytes = parse_size(b)?;
        }
        // Whole 8-byte words of the pattern; at least 1 MiB.
        o.bytes = (o.bytes & !7).max(1 << 20);
        if let Some(r) = a.repeat {
            o.repeat = r.clamp(1, 100);
        }
        if let Some(only) = &a.only {
            for f in only {
                if !["relay", "fairness", "static"].contains(&f.as_str()) {
                    return Err(fail(format!(
                        "--only {f}: the figures are relay, fairness and static"
                    )));
                }
            }
            let has = |f: &str| only.iter().any(|x| x == f);
            (o.relay, o.fairness, o.stat) = (has("relay"), has("fairness"), has("static"));
        }
        if !["auto", "lighttpd", "nginx"].contains(&a.server.as_str()) {
            return Err(fail(format!(
                "--server {}: lighttpd, nginx or auto",
                a.server
            )));
        }
        o.server = a.server.clone();
        o.connections = a.connections.clamp(1, 64);
        if a.no_pin {
            o.cpus = None;
        }
        if !["free", "server", "ends"].contains(&a.service_cpu.as_str()) {
            return Err(fail(format!(
                "--service-cpu {}: free, server or ends",
                a.service_cpu
            )));
        }
        o.service_cpu = a.service_cpu.clone();
        o.workers = a.workers.map(|w| w.clamp(1, 256));
        if let Some(w) = a.window {
            if !(w > 0.0 && w <= 600.0) {
                return Err(fail(format!("--window {w}: seconds in (0, 600]")));
            }
            o.window = Duration::from_secs_f64(w);
        }
        Ok(o)
    }

    /// Progress steps of one round (one per path of each figure run).
    pub fn steps(&self) -> u64 {
        u64::from(self.relay) * relay::PATHS.len() as u64
            + u64::from(self.fairness)
            + u64::from(self.stat) * 2
    }
}

/// The calling thread pinned to a CPU until dropped (then on its former CPUs again); processes
/// it starts meanwhile inherit the pin.
pub(super) struct PinGuard(Option<CpuSet>);

impl PinGuard {
    pub(super) fn to(cpu: Option<usize>) -> CliResult<PinGuard> {
        let Some(cpu) = cpu else {
            return Ok(PinGuard(None));
        };
        let old = sched_getaffinity(None)?;
        sys::pin_to(cpu)?;
        Ok(PinGuard(Some(old)))
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = sched_setaffinity(None, old);
        }
    }
}

/// What a run found besides its records.
#[derive(Default, Debug)]
pub struct Outcome {
    pub records: Vec<Record>,
    /// Lines a reader must see (a path unavailable, the routing missing, the server used).
    pub notes: Vec<String>,
    /// The static-file path through the service could not be measured because the server's
    /// sendfile never reached the service; `Some(true)` if the preload library claims to route
    /// it (`MEMLOOP_PIPE_SENDFILE` in its strings): then that is a failure, not a missing
    /// feature.
    pub not_routed: Option<bool>,
}

/// Runs the figures `o` asks for: `progress` is told the start of each step.
pub fn figures(o: &Opts, progress: &mut dyn FnMut(&str)) -> CliResult<Outcome> {
    let mut out = Outcome::default();
    let mut raw = Vec::new();
    let web = if o.stat {
        match web::Setup::new(o) {
            Ok(w) => Some(w),
            Err(e) => {
                out.notes
                    .push(format!("static-file figure not measured: {e}"));
                None
            }
        }
    } else {
        None
    };
    for round in 1..=o.repeat {
        let tag = match o.repeat {
            1 => String::new(),
            n => format!("round {round}/{n}: "),
        };
        if o.relay {
            for p in relay::PATHS {
                progress(&format!(
                    "{tag}relay {} through {}",
                    fmt_size(o.bytes),
                    p.name()
                ));
                raw.extend(relay::measure(o, p)?);
            }
        }
        if o.fairness {
            progress(&format!("{tag}fairness at weights 1:2:4"));
            raw.extend(fair::measure(o)?);
        }
        if let Some(w) = &web {
            progress(&format!(
                "{tag}static files from {} (own sendfile)",
                w.server_name()
            ));
            raw.extend(w.measure(web::Path::Sendfile)?.records);
            progress(&format!(
                "{tag}static files from {} (pipe service)",
                w.server_name()
            ));
            let r = w.measure(web::Path::Service)?;
            raw.extend(r.records);
            if let Some(n) = r.note {
                out.notes.push(n);
            }
            if r.not_routed.is_some() {
                out.not_routed = r.not_routed;
            }
        }
    }
    if let Some(w) = &web {
        out.notes.push(w.describe());
    }
    let mut records = report::median_of_rounds(raw);
    ratios(&mut records);
    out.records = records;
    out.notes.dedup();
    Ok(out)
}

pub fn run(a: &PipeArgs) -> CliResult<()> {
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
    match out.not_routed {
        Some(true) => Err(fail(
            "static-file server through the pipe service: NOT ROUTED although the preload \
             library knows MEMLOOP_PIPE_SENDFILE (the service moved none of the server's bytes)",
        )),
        _ => Ok(()),
    }
}

/// Each test's baseline path, the service's, and a reference path measured beside them.
const PATHS: [(&str, &str, &str, Option<&str>); 2] = [
    ("relay", relay::COPY, relay::SERVICE, Some(relay::SPLICE)),
    ("static-file", web::SENDFILE, web::SERVICE, None),
];

/// Ratio records (service over baseline) for each figure both paths measured.
fn ratios(records: &mut Vec<Record>) {
    let mut add = Vec::new();
    for (test, base, svc, _) in PATHS {
        let get = |path: &str, size: u64, unit: &str| {
            records
                .iter()
                .find(|r| r.test == test && r.path == path && r.size == size && r.unit == unit)
                .map(|r| r.value)
        };
        let sizes: Vec<u64> = records
            .iter()
            .filter(|r| r.test == test && r.path == svc && r.unit == "GB/s")
            .map(|r| r.size)
            .collect();
        for size in sizes {
            for (unit, ratio_unit) in RATIOS {
                if let (Some(b), Some(s)) = (get(base, size, unit), get(svc, size, unit)) {
                    if b > 0.0 {
                        add.push(Record::new(test, RATIO_PATH, size, ratio_unit, s / b));
                    }
                }
            }
        }
    }
    records.extend(add);
}

/// The path of ratio records: the service's figure over the baseline's.
pub const RATIO_PATH: &str = "pipe-service / baseline";

/// (unit compared, unit of its ratio record).
const RATIOS: [(&str, &str); 3] = [
    ("GB/s", "throughput ratio"),
    (relay::CPU_TOTAL, "cpu/byte ratio"),
    (web::CPU_SERVER, "server cpu/byte ratio"),
];

fn print(out: &Outcome, o: &Opts) {
    let workers = o
        .workers
        .map_or("one worker per CPU".to_string(), |w| format!("{w} workers"));
    let pin = match o.cpus {
        Some((a, b)) => format!(
            "relay and its service, or the server, pinned to CPU {b}; source and sink, or the \
             client, to CPU {a}; the static-file server's service {}; fairness unpinned",
            match o.service_cpu.as_str() {
                "server" => format!("on CPU {b}"),
                "ends" => format!("on CPU {a}"),
                _ => "unpinned".into(),
            }
        ),
        None => "processes not pinned".into(),
    };
    println!(
        "memloop bench pipe: {} per relay run and per file size, {} round(s) (medians); the \
         service is a `memloop pipe serve` process ({workers}); {pin}{}",
        fmt_size(o.bytes),
        o.repeat,
        if o.quick {
            " (--quick: a smoke run, not figures to quote)"
        } else {
            ""
        }
    );
    println!();
    println!(
        "| figure | size | metric | baseline | pipe service | reference | service / baseline | \
         target |"
    );
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |");
    let r = &out.records;
    let find = |test: &str, path: &str, size: u64, unit: &str| {
        r.iter()
            .find(|x| x.test == test && x.path == path && x.size == size && x.unit == unit)
    };
    let v = |x: Option<&Record>| x.map_or("–".into(), |x| report::fmt_num(x.value));
    for (test, base, svc, reference) in PATHS {
        let mut sizes: Vec<u64> = r
            .iter()
            .filter(|x| x.test == test && (x.path == base || x.path == svc))
            .map(|x| x.size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let label = match reference {
            Some(x) => format!("{test} ({base} / {svc} / {x})"),
            None => format!("{test} ({base} / {svc})"),
        };
        for size in sizes {
            let metrics: &[(&str, &str, &str)] = match test {
                "relay" => &[
                    ("GB/s", "throughput ratio", "≥ 2×"),
                    (relay::CPU_RELAY, "", ""),
                    (relay::CPU_SERVICE, "", ""),
                    (relay::CPU_TOTAL, "cpu/byte ratio", ""),
                ],
                _ => &[
                    ("GB/s", "throughput ratio", "≥ 1.0×"),
                    (web::CPU_SERVER, "server cpu/byte ratio", "≤ 0.7×"),
                    (web::CPU_SERVICE, "", ""),
                    (web::CPU_TOTAL, "", ""),
                    (web::ROUTED, "", ""),
                ],
            };
            for (unit, ratio_unit, target) in metrics {
                let b = find(test, base, size, unit);
                let s = find(test, svc, size, unit);
                let x = reference.and_then(|p| find(test, p, size, unit));
                if b.is_none() && s.is_none() && x.is_none() {
                    continue;
                }
                let ratio = find(test, RATIO_PATH, size, ratio_unit)
                    .map_or(String::new(), |x| format!("{:.2}×", x.value));
                println!(
                    "| {label} | {} | {unit} | {} | {} | {} | {ratio} | {target} |",
                    fmt_size(size),
                    v(b),
                    v(s),
                    v(x)
                );
            }
            if find(test, svc, size, web::NOT_ROUTED).is_some() {
                println!(
                    "| {label} | {} | NOT ROUTED: no figure (below) | | – | | | |",
                    fmt_size(size)
                );
            }
        }
    }
    for test in [fair::TEST, fair::TEST_LEAVE] {
        for x in r.iter().filter(|x| x.test == test) {
            let target = match (x.unit, test) {
                ("jain", t) if t == fair::TEST => "≥ 0.95",
                _ => "",
            };
            let what = match x.path {
                fair::PATH => x.unit.to_string(),
                p => format!("{p} {}", x.unit),
            };
            println!(
                "| {test} | {} tenants | {what} | | {} | | | {target} |",
                x.size,
                report::fmt_num(x.value)
            );
        }
    }
    println!();
    // One line per distinct note (fairness shares repeat theirs in the index's note).
    for x in r
        .iter()
        .filter(|x| x.note.is_some() && x.unit != web::NOT_ROUTED && x.unit != "share")
    {
        let size = match x.test {
            fair::TEST | fair::TEST_LEAVE => format!("{} tenants", x.size),
            _ => fmt_size(x.size),
        };
        println!(
            "- {} {} {size}: {}",
            x.test,
            x.path,
            x.note.as_deref().unwrap_or("")
        );
    }
    for n in &out.notes {
        println!("- {n}");
    }
}
