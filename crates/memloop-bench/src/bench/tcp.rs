//! `memloop bench tcp`: unmodified TCP programs over memloop (the LD_PRELOAD library started by
//! `memloop run`) beside the kernel paths, in one run, interleaved rounds, medians.
//!
//! Both ends of every path are processes (`memloop-bench tcp-peer`, an ordinary socket program)
//! started in network-namespace domains through `memloop domains exec`:
//!
//! | path | server | client | preload |
//! | --- | --- | --- | --- |
//! | memloop | domain 0 | domain 1, via the bridge address | both, one region |
//! | veth+bridge | domain 0 | domain 1 | no |
//! | memloop-v6, veth+bridge-v6 | the same over the domains' IPv6 addresses | | both / no |
//! | memloop-lo | domain 0, 127.0.0.1 | domain 0 | both, one region |
//! | tcp-loopback | domain 0, 127.0.0.1 | domain 0 | no |
//!
//! The UDP rows (`udp-rr`, `udp-stream`) run on the same paths but Unix (the server's peer
//! binds a UDP socket on its TCP listener's address: `tcp/udp.rs`); in them `tcp-loopback` is
//! loopback UDP.
//! | unix | domain 0, abstract socket | domain 0 | no |
//! | veth+preload | domain 0 | domain 1 | both, different regions: no ring (remote cost) |
//!
//! The client measures and prints one JSON line per request; this driver only sends requests,
//! collects replies and reports.

pub mod fan;
pub mod peer;
pub(crate) mod procs;
mod table;
mod udp;
pub(crate) mod wire;

use super::report::{median_of_rounds, Record};
use super::sys;
use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use memloop::{Region, RegionSpec};
use procs::{Proc, Testbed};
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wire::{Request, Test};

#[derive(clap::Args)]
pub struct TcpArgs {
    /// Short measurements (0.2 s each, one round): well under a minute, for a look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seconds per measurement (default 1, or 0.2 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Rounds over all paths; each figure is the median of its rounds (default 3, 1 with
    /// --quick). Rounds interleave the paths, so a burst of noise cannot favour one of them.
    #[arg(long)]
    repeat: Option<usize>,
    /// Message sizes for both request/response and stream, comma separated (default:
    /// 1,64,1K,16K for request/response and 64,1K,16K,64K for stream).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<String>>,
    /// Do not pin client and server to different CPUs.
    #[arg(long)]
    no_pin: bool,
    /// Only the cost of the preload on traffic that cannot use a ring (the remote-cost
    /// triples), nothing else: with `--triples`, a close look at a small cost.
    #[arg(long)]
    remote_only: bool,
    /// Remote-cost triples per test and round (default 4, or 2 with --quick).
    #[arg(long, value_name = "N")]
    triples: Option<usize>,
}

// Path names, as in the table and the JSON.
pub(super) const MEMLOOP: &str = "memloop";
pub(super) const VETH: &str = "veth+bridge";
pub(super) const MEMLOOP6: &str = "memloop-v6";
pub(super) const VETH6: &str = "veth+bridge-v6";
pub(super) const MEMLOOP_LO: &str = "memloop-lo";
pub(super) const TCP_LO: &str = "tcp-loopback";
const UNIX: &str = "unix";
const REMOTE: &str = "veth+preload";

/// The message size of the "one end sleeps" test and of the remote-cost comparison.
const SMALL: usize = 64;
/// The datagram size of the UDP stream (the figure: 1 KiB datagrams).
const UDP_STREAM: usize = 1024;
/// The pause between requests in the "one end sleeps" test.
const SLEEP_US: u64 = 1000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Net {
    /// Server in domain 0 on its bridge address, client in domain 1.
    Veth,
    /// The same over the domains' IPv6 addresses.
    Veth6,
    /// Both in domain 0 over 127.0.0.1.
    Loopback,
    /// Both in domain 0 over an abstract Unix socket.
    Unix,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Preload {
    No,
    /// Both ends under `memloop run` with the bench region: the ring should carry the traffic.
    Ring,
    /// Both ends under `memloop run`, in different regions: the ring cannot be used.
    Remote,
}

struct PathDef {
    name: &'static str,
    net: Net,
    preload: Preload,
    what: &'static str,
}

const PATHS: [PathDef; 8] = [
    PathDef {
        name: MEMLOOP,
        net: Net::Veth,
        preload: Preload::Ring,
        what: "domain 0 ↔ domain 1, both under `memloop run`",
    },
    PathDef {
        name: VETH,
        net: Net::Veth,
        preload: Preload::No,
        what: "domain 0 ↔ domain 1 through veth pairs and the bridge",
    },
    PathDef {
        name: MEMLOOP6,
        net: Net::Veth6,
        preload: Preload::Ring,
        what: "domain 0 ↔ domain 1 over IPv6, both under `memloop run`",
    },
    PathDef {
        name: VETH6,
        net: Net::Veth6,
        preload: Preload::No,
        what: "domain 0 ↔ domain 1 over IPv6 through veth pairs and the bridge",
    },
    PathDef {
        name: MEMLOOP_LO,
        net: Net::Loopback,
        preload: Preload::Ring,
        what: "127.0.0.1 in domain 0, both under `memloop run`",
    },
    PathDef {
        name: TCP_LO,
        net: Net::Loopback,
        preload: Preload::No,
        what: "127.0.0.1 in domain 0",
    },
    PathDef {
        name: UNIX,
        net: Net::Unix,
        preload: Preload::No,
        what: "abstract Unix stream socket in domain 0",
    },
    PathDef {
        name: REMOTE,
        net: Net::Veth,
        preload: Preload::Remote,
        what: "as veth+bridge, both under `memloop run` but in different regions (no ring)",
    },
];

/// A path of this run: its two processes, or why it is not measured.
struct Path {
    def: &'static PathDef,
    ends: Option<(Proc, Proc)>,
    unavailable: Option<String>,
    note: Option<String>,
}

impl Path {
    fn live(&self) -> bool {
        self.ends.is_some()
    }

    fn disable(&mut self, why: String) {
        self.ends = None;
        self.unavailable = Some(why);
    }
}

/// One measurement of a round.
#[derive(Clone, Copy, PartialEq)]
struct Case {
    test: Test,
    size: usize,
}

impl Case {
    /// The side-by-side cases run on every path but veth+preload, which only takes part in the
    /// paired remote-cost runs.
    fn applies(&self, p: &PathDef) -> bool {
        let udp = matches!(self.test, Test::UdpRr | Test::UdpStream);
        p.preload != Preload::Remote && !(udp && p.net == Net::Unix)
    }

    fn label(&self) -> String {
        let t = match self.test {
            Test::Rr => "rr",
            Test::Stream => "stream",
            Test::Crr => "crr",
            Test::SleepRr => "sleep-rr",
            Test::Fan => "fan",
            Test::UdpRr => "udp-rr",
            Test::UdpStream => "udp-stream",
        };
        format!("{t} {}", fmt_size(self.size as u64))
    }
}

struct Config {
    rr_sizes: Vec<usize>,
    stream_sizes: Vec<usize>,
    dur: Duration,
    warmup: Duration,
    repeat: usize,
    /// (client, server) CPUs.
    cpus: Option<(usize, usize)>,
    /// Remote cost: veth, veth+preload, veth runs per test and round, and their length.
    aba: usize,
    aba_dur: Duration,
    /// Only the remote-cost triples.
    remote_only: bool,
}

impl Config {
    fn from_args(a: &TcpArgs) -> CliResult<Config> {
        let secs = a.duration.unwrap_or(if a.quick { 0.2 } else { 1.0 });
        if !(secs > 0.0 && secs <= 3600.0) {
            return Err(fail(format!(
                "--duration {secs}: expected seconds in (0, 3600]"
            )));
        }
        let parse = |list: &[String]| -> CliResult<Vec<usize>> {
            list.iter()
                .map(|s| {
                    let n = parse_size(s)? as usize;
                    if (1..=wire::MAX_SIZE).contains(&n) {
                        Ok(n)
                    } else {
                        Err(fail(format!(
                            "message size {n}: must be 1..={} bytes",
                            wire::MAX_SIZE
                        )))
                    }
                })
                .collect()
        };
        let defaults = |d: &[&str]| d.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (rr, stream) = match &a.sizes {
            Some(s) => (s.clone(), s.clone()),
            None => (
                defaults(&["1", "64", "1K", "16K"]),
                defaults(&["64", "1K", "16K", "64K"]),
            ),
        };
        let dur = Duration::from_secs_f64(secs);
        Ok(Config {
            rr_sizes: parse(&rr)?,
            stream_sizes: parse(&stream)?,
            dur,
            warmup: dur / 5,
            repeat: a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1),
            cpus: if a.no_pin { None } else { sys::two_cpus() },
            aba: a.triples.unwrap_or(if a.quick { 2 } else { 4 }).max(1),
            aba_dur: (dur * 2 / 5).max(Duration::from_millis(50)),
            remote_only: a.remote_only,
        })
    }

    fn cases(&self) -> Vec<Case> {
        if self.remote_only {
            return Vec::new();
        }
        let case = |test, size| Case { test, size };
        let mut v: Vec<Case> = self.rr_sizes.iter().map(|&s| case(Test::Rr, s)).collect();
        v.extend(self.stream_sizes.iter().map(|&s| case(Test::Stream, s)));
        v.push(case(Test::Crr, 1));
        v.push(case(Test::SleepRr, SMALL));
        v.push(case(Test::UdpRr, SMALL));
        v.push(case(Test::UdpStream, UDP_STREAM));
        v
    }

    fn request(&self, c: &Case, dur: Duration) -> Request {
        Request {
            test: c.test,
            size: c.size,
            warmup_s: self.warmup.min(dur).as_secs_f64(),
            dur_s: dur.as_secs_f64(),
            sleep_us: SLEEP_US,
            conns: 0,
        }
    }

    fn pinning(&self, bed: &Testbed) -> String {
        match self.cpus {
            Some((c, s)) => format!(
                "client pinned to CPU {c}, server to CPU {s} on every path ({})",
                bed.pinning()
            ),
            None => "ends not pinned".into(),
        }
    }
}

pub fn run(a: &TcpArgs) -> CliResult<()> {
    let cfg = Config::from_args(a)?;
    let pid = std::process::id();
    let (bench_region, far_region) = (format!("tcpbench-{pid}"), format!("tcpbench-{pid}-far"));
    // Declared before the paths, so it is dropped after their processes are stopped.
    let mut bed = Testbed::up(&[bench_region.clone(), far_region.clone()])?;
    let preload = preload_status(bed.exe());
    if preload.is_ok() {
        bed.create_region(&bench_region)?;
        bed.create_region(&far_region)?;
    }
    let mut paths: Vec<Path> = Vec::new();
    for def in &PATHS {
        let mut p = Path {
            def,
            ends: None,
            unavailable: None,
            note: None,
        };
        let region = |r: &str| (def.preload != Preload::No).then(|| r.to_owned());
        let (server_region, client_region) = match def.preload {
            Preload::Remote => (region(&far_region), region(&bench_region)),
            _ => (region(&bench_region), region(&bench_region)),
        };
        match (&preload, def.preload) {
            (Err(why), Preload::Ring | Preload::Remote) => p.unavailable = Some(why.clone()),
            _ => match start(&bed, def, &cfg, server_region, client_region) {
                Ok(ends) => p.ends = Some(ends),
                Err(e) if def.preload != Preload::No => {
                    p.unavailable = Some(format!("failed to start: {e}"))
                }
                Err(e) => return Err(e),
            },
        }
        if p.live() && def.preload != Preload::No {
            probe(&mut p, &cfg, &bench_region, &far_region);
        }
        paths.push(p);
    }

    let cases = cfg.cases();
    let live = |c: &Case| {
        paths
            .iter()
            .filter(|p| p.live() && c.applies(p.def))
            .count()
    };
    let per_round: usize = cases.iter().map(live).sum::<usize>() + REMOTE_CASES.len() * cfg.aba * 3;
    let bar = super::progress((per_round * cfg.repeat) as u64);
    let (mut raw, mut triples) = (Vec::new(), Vec::new());
    for _ in 0..cfg.repeat {
        for case in &cases {
            for p in paths.iter_mut().filter(|p| p.live() && case.applies(p.def)) {
                bar.set_message(format!("{} over {}", case.label(), p.def.name));
                if let Some(r) = measure_or_disable(p, case, &cfg, cfg.dur)? {
                    raw.extend(r);
                }
                bar.inc(1);
            }
        }
        remote_round(&mut paths, &cfg, &bar, &mut raw, &mut triples)?;
    }
    bar.finish_and_clear();
    // Stop the processes before reporting (the testbed goes when this function returns).
    for p in &mut paths {
        p.ends = None;
    }
    let dead: Vec<&str> = paths
        .iter()
        .filter(|p| p.unavailable.is_some())
        .map(|p| p.def.name)
        .collect();
    raw.retain(|r| !dead.contains(&r.path));
    let records = median_of_rounds(raw);
    let remote = table::remote_rows(&triples);
    report(&records, &remote, &paths, &cfg, &bed, a)
}

/// The remote-cost cases: 64 B request/response and stream, and UDP request/response (to a
/// non-member: DNS-like).
const REMOTE_CASES: [Case; 3] = [
    Case {
        test: Test::Rr,
        size: SMALL,
    },
    Case {
        test: Test::Stream,
        size: SMALL,
    },
    Case {
        test: Test::UdpRr,
        size: SMALL,
    },
];

/// The cost of the preload on traffic that cannot use a ring is small, so it is measured in
/// tight triples — veth+bridge, veth+preload, veth+bridge again — each compared with the mean of
/// its neighbours: drifts in the machine's load cancel, and the two plain runs of a triple
/// compared with each other give the noise floor.
fn remote_round(
    paths: &mut [Path],
    cfg: &Config,
    bar: &indicatif::ProgressBar,
    raw: &mut Vec<Record>,
    triples: &mut Vec<table::Triple>,
) -> CliResult<()> {
    let at = |name| paths.iter().position(|p| p.def.name == name);
    let (Some(v), Some(r)) = (at(VETH), at(REMOTE)) else {
        return Ok(());
    };
    for case in &REMOTE_CASES {
        for _ in 0..cfg.aba {
            if !paths[v].live() || !paths[r].live() {
                bar.inc(3);
                continue;
            }
            bar.set_message(format!("{} over {VETH} / {REMOTE}", case.label()));
            let a1 = measure_or_disable(&mut paths[v], case, cfg, cfg.aba_dur)?;
            bar.inc(1);
            let b = measure_or_disable(&mut paths[r], case, cfg, cfg.aba_dur)?;
            bar.inc(1);
            let a2 = measure_or_disable(&mut paths[v], case, cfg, cfg.aba_dur)?;
            bar.inc(1);
            if let (Some(a1), Some(b), Some(a2)) = (a1, b, a2) {
                raw.extend(b.iter().cloned());
                triples.push(table::Triple { a1, b, a2 });
            }
        }
    }
    Ok(())
}

/// Measures; a failure disables a preloaded path (its reason is reported) and is an error for
/// a kernel path.
fn measure_or_disable(
    p: &mut Path,
    case: &Case,
    cfg: &Config,
    dur: Duration,
) -> CliResult<Option<Vec<Record>>> {
    match measure(p, case, cfg, dur) {
        Ok(r) => Ok(Some(r)),
        Err(e) if p.def.preload != Preload::No => {
            p.disable(format!("failed in {}: {e}", case.label()));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Whether the memloop paths can run: the preload library and `memloop run` must exist.
pub(crate) fn preload_status(exe: &std::path::Path) -> Result<(), String> {
    // Where `memloop run` looks: $MEMLOOP_PRELOAD_LIB, else next to the binary, else ../lib.
    let so = match std::env::var_os("MEMLOOP_PRELOAD_LIB").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => {
            let here = exe.with_file_name("libmemloop.so");
            let lib = exe.with_file_name("../lib/libmemloop.so");
            if !here.exists() && lib.exists() {
                lib
            } else {
                here
            }
        }
    };
    if !so.exists() {
        return Err(format!(
            "unavailable (preload not built: no {}; build it with `cargo build --release -p memloop-preload`)",
            so.display()
        ));
    }
    let help = std::process::Command::new(exe)
        .args(["run", "--help"])
        .output();
    if !help.is_ok_and(|o| o.status.success()) {
        return Err("unavailable (this binary has no `run` command)".into());
    }
    Ok(())
}

/// Starts a path's server, then its client (which needs the server's port).
fn start(
    bed: &Testbed,
    def: &PathDef,
    cfg: &Config,
    server_region: Option<String>,
    client_region: Option<String>,
) -> CliResult<(Proc, Proc)> {
    let (server_domain, client_domain, listen) = match def.net {
        Net::Veth => (0, 1, format!("{}:0", bed.addr(0))),
        Net::Veth6 => (0, 1, format!("[{}]:0", bed.addr6(0))),
        Net::Loopback => (0, 0, "127.0.0.1:0".into()),
        Net::Unix => (
            0,
            0,
            format!("unix:@memloop-tcpbench-{}", std::process::id()),
        ),
    };
    let args = |role: &str, addr: &str| -> Vec<String> {
        ["--role", role, "--addr", addr].map(String::from).into()
    };
    let mut server = Proc::spawn(
        format!("{} server", def.name),
        &bed.peer_command(
            server_domain,
            cfg.cpus.map(|c| c.1),
            server_region.as_deref(),
            &args("server", &listen),
        ),
    )?;
    let ready = server.ready()?;
    let addr = ready["addr"]
        .as_str()
        .ok_or_else(|| fail(format!("{} server: no address in {ready}", def.name)))?
        .to_owned();
    let mut client = Proc::spawn(
        format!("{} client", def.name),
        &bed.peer_command(
            client_domain,
            cfg.cpus.map(|c| c.0),
            client_region.as_deref(),
            &args("client", &addr),
        ),
    )?;
    client.ready()?;
    if def.preload != Preload::No {
        for end in [&server, &client] {
            check_preloaded(end)?;
        }
    }
    Ok((server, client))
}

/// Fails unless the preload library is mapped into the peer (the dynamic loader only warns when
/// it cannot preload a library, and the program would then run on plain TCP).
pub(crate) fn check_preloaded(end: &Proc) -> CliResult<()> {
    let pid = end
        .pid()
        .ok_or_else(|| fail(format!("{}: no pid", end.what())))?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .context(format!("reading the mappings of {}", end.what()))?;
    if maps.contains("/libmemloop") {
        Ok(())
    } else {
        Err(fail(format!(
            "{}: the preload library is not loaded in the process",
            end.what()
        )))
    }
}

/// A short exchange on a preloaded path while we watch the regions: the memloop paths must show
/// bytes moving through a ring (else the preload silently stayed on TCP and the figures would be
/// TCP's), the remote path must not.
fn probe(p: &mut Path, cfg: &Config, bench_region: &str, far_region: &str) {
    let stop = Arc::new(AtomicBool::new(false));
    let watch = |name: &str| {
        let (name, stop) = (name.to_owned(), stop.clone());
        std::thread::spawn(move || ring_bytes_while(&name, &stop))
    };
    let watchers = [watch(bench_region), watch(far_region)];
    let req = Request {
        test: Test::Rr,
        size: SMALL,
        warmup_s: 0.0,
        dur_s: 0.1,
        sleep_us: 0,
        conns: 0,
    };
    let (_, client) = p.ends.as_mut().expect("probed paths are live");
    let r = client.ask(&req, timeout(cfg));
    stop.store(true, Ordering::Relaxed);
    let bytes: u64 = watchers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
    match (r, p.def.preload) {
        (Err(e), _) => p.disable(format!("failed in the first exchange: {e}")),
        (Ok(_), Preload::Ring) if bytes == 0 => p.disable(
            "failed: the preload left the connection on TCP (no bytes went through a ring; \
             see `memloop status` and its fallback counters)"
                .into(),
        ),
        (Ok(_), Preload::Ring) => {
            p.note = Some(format!(
                "ring verified: {bytes} bytes through the region in a {:.1} s probe",
                req.dur_s
            ))
        }
        (Ok(_), _) if bytes > 0 => {
            p.note = Some(format!(
                "unexpected: {bytes} bytes went through a ring although the ends are in different regions"
            ))
        }
        (Ok(_), _) => {
            p.note = Some("preload loaded in both ends, no ring used (TCP fallback), as intended".into())
        }
    }
}

/// Largest total of bytes seen in the region's channel rings until `stop` (0 if unreadable).
pub(crate) fn ring_bytes_while(region: &str, stop: &AtomicBool) -> u64 {
    let Ok(region) = Region::open(&RegionSpec::parse(region)) else {
        return 0;
    };
    let reg = region.registry();
    let mut most = 0;
    while !stop.load(Ordering::Relaxed) {
        let total: u64 = reg
            .channels()
            .iter()
            .filter_map(|c| reg.rings(c.id).ok())
            .filter_map(|r| {
                let c2s = memloop::ring::header::totals(&r.c2s)?.0;
                let s2c = memloop::ring::header::totals(&r.s2c)?.0;
                Some(c2s + s2c)
            })
            .sum();
        most = most.max(total);
        std::thread::sleep(Duration::from_millis(2));
    }
    most
}

fn timeout(cfg: &Config) -> Duration {
    cfg.warmup + cfg.dur + Duration::from_secs(20)
}

/// One measurement on one path, as records.
fn measure(p: &mut Path, case: &Case, cfg: &Config, dur: Duration) -> CliResult<Vec<Record>> {
    let (_, client) = p.ends.as_mut().expect("measured paths are live");
    let r = client.ask(&cfg.request(case, dur), timeout(cfg))?;
    if r.count == 0 || r.elapsed_s <= 0.0 {
        return Err(fail(format!("{}: empty measurement {r:?}", p.def.name)));
    }
    let (path, size) = (p.def.name, case.size as u64);
    let rate = r.count as f64 / r.elapsed_s;
    let timed = |test, unit| {
        let mut rec = Record::new(test, path, size, unit, r.p50_ns / 1e3);
        rec.p99 = Some(r.p99_ns / 1e3);
        rec
    };
    Ok(match case.test {
        Test::Rr => vec![
            timed("rr", table::RTT),
            Record::new("rr", path, size, table::TPS, rate),
        ],
        Test::SleepRr => vec![timed("sleep-rr", table::RTT)],
        Test::UdpRr => vec![
            timed("udp-rr", table::RTT),
            Record::new("udp-rr", path, size, table::TPS, rate),
        ],
        Test::UdpStream => vec![
            Record::new("udp-stream", path, size, table::MSGS, rate),
            Record::new(
                "udp-stream",
                path,
                size,
                table::GBIT,
                r.bytes as f64 * 8.0 / r.elapsed_s / 1e9,
            ),
        ],
        Test::Fan => vec![Record::new("fan", path, size, table::TPS, rate)],
        Test::Crr => {
            let mut cps = Record::new("crr", path, size, table::CPS, rate);
            cps.note = r.phases_p50_ns.map(|[c, x, e]| {
                format!(
                    "p50 per phase: connect {:.1} µs, request/response {:.1} µs, close {:.1} µs",
                    c / 1e3,
                    x / 1e3,
                    e / 1e3
                )
            });
            vec![cps, timed("crr", table::CONN)]
        }
        Test::Stream => vec![
            Record::new(
                "stream",
                path,
                size,
                table::GBIT,
                r.bytes as f64 * 8.0 / r.elapsed_s / 1e9,
            ),
            Record::new("stream", path, size, table::MSGS, rate),
        ],
    })
}

fn report(
    records: &[Record],
    remote: &[table::RemoteRow],
    paths: &[Path],
    cfg: &Config,
    bed: &Testbed,
    a: &TcpArgs,
) -> CliResult<()> {
    let pinning = cfg.pinning(bed);
    println!(
        "memloop bench tcp: {:.2} s per measurement, median of {} round(s); {pinning}; \
         latencies are round trips; request/response and short connections use TCP_NODELAY, \
         streams keep Nagle; ratios >1 mean memloop is better",
        cfg.dur.as_secs_f64(),
        cfg.repeat
    );
    println!();
    for p in paths {
        let state = match (&p.unavailable, &p.note) {
            (Some(why), _) => why.clone(),
            (None, Some(n)) => n.clone(),
            (None, None) => String::new(),
        };
        println!("  {:<13} {}  {state}", p.def.name, p.def.what);
    }
    println!();
    print!("{}", table::main_table(records));
    println!();
    let phases: Vec<&Record> = records
        .iter()
        .filter(|r| r.test == "crr" && r.note.is_some())
        .collect();
    if !phases.is_empty() {
        println!("Short connections (median of the round whose rate is the median):");
        for r in phases {
            println!("  {:<13} {}", r.path, r.note.as_deref().unwrap_or_default());
        }
        println!();
    }
    if !remote.is_empty() {
        println!(
            "Cost of the preload on traffic that cannot use a ring ({VETH} vs {REMOTE}, {}; \
             medians over {} {VETH} / {REMOTE} / {VETH} triples of {:.2} s runs; noise: the two \
             {VETH} runs of a triple against each other):",
            fmt_size(SMALL as u64),
            cfg.aba * cfg.repeat,
            cfg.aba_dur.as_secs_f64()
        );
        print!("{}", table::remote_table(remote));
        println!();
    }
    for line in table::targets(records, remote) {
        println!("{line}");
    }
    if let Some(file) = &a.json {
        let paths_json: Vec<_> = paths
            .iter()
            .map(|p| {
                json!({
                    "name": p.def.name,
                    "what": p.def.what,
                    "available": p.unavailable.is_none(),
                    "reason": p.unavailable,
                    "note": p.note,
                })
            })
            .collect();
        let v = json!({
            "bench": "tcp",
            "config": {
                "duration_s": cfg.dur.as_secs_f64(),
                "warmup_s": cfg.warmup.as_secs_f64(),
                "repeat": cfg.repeat,
                "rr_sizes": cfg.rr_sizes,
                "stream_sizes": cfg.stream_sizes,
                "sleep_rr": { "size": SMALL, "pause_us": SLEEP_US },
                "remote_cost": { "size": SMALL, "triples_per_round": cfg.aba,
                                 "run_s": cfg.aba_dur.as_secs_f64() },
                "pinning": pinning,
            },
            "paths": paths_json,
            "records": records,
            "preload_remote_cost": remote,
        });
        super::report::write_results(&v, file)?;
    }
    Ok(())
}
