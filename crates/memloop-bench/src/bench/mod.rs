//! `memloop bench`: every path measured side by side in one run, each against a peer process.

mod baselines;
pub mod bgproc;
pub mod blk;
pub mod link;
mod native;
mod pingpong;
pub mod pipe;
pub mod process;
pub mod proto;
mod remote;
mod report;
pub mod study;
pub mod switch;
mod sys;
pub mod tcp;
pub mod zerocopy;

use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use indicatif::{ProgressBar, ProgressStyle};
use proto::Conn;
use report::Record;
use std::path::PathBuf;
use std::time::Duration;
use sys::Peer;

pub use baselines::connect as connect_baseline;
pub use native::connect as connect_native;
pub use pingpong::respond as pingpong_respond;

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Native memloop streams vs Unix sockets vs loopback TCP vs a bare cache-line ping-pong.
    Native(NativeArgs),
    /// Unmodified TCP programs over memloop (`memloop run`) vs veth+bridge, loopback TCP, Unix.
    Tcp(tcp::TcpArgs),
    /// What a live demote (ring → TCP) costs: this side, the peer, the stream's stall, in
    /// round trips of the slower path; busy and idle connections, loopback and two domains.
    Switch(switch::SwitchArgs),
    /// What the preload library costs on fork, exit, short connections and fresh processes:
    /// each figure with and without the library, interleaved rounds, medians.
    Process(process::ProcessArgs),
    /// The residency study on every path: report.md, results.json and one SVG per experiment.
    Study(study::StudyArgs),
    /// Zero-copy descriptors vs memloop's copying streams: one-way latency by size, a
    /// three-stage pipeline of 1 MiB messages, the copying stream's 64-byte message rate.
    Zerocopy(zerocopy::ZcArgs),
    /// The pipe service (vPipe) vs what programs do without it: a socket→socket relay vs a
    /// copy loop, fairness at weights 1:2:4 (Jain's index), a static-file server (lighttpd or
    /// nginx) with the service vs its own sendfile.
    Pipe(pipe::PipeArgs),
    /// The network link over the region (MMNet, `memloop link`) vs veth+bridge between two
    /// domains: one TCP flow (iperf3), 64 B TCP round trips, ping, and the idle link's CPU;
    /// interleaved rounds, medians; ratios against the targets.
    Link(link::LinkArgs),
    /// The block device over the region (MMBlk, `memloop blk`) vs NBD over TCP between two
    /// domains vs a loop device on a local file: fio 4 KiB random and 1 MiB sequential read
    /// and write; rotating rounds, medians; ratios against the targets.
    Blk(blk::BlkArgs),
    /// The server end of one measurement, started by hand (e.g. in another VM).
    Serve(remote::ServeArgs),
    /// The client end: one measurement against `bench serve`, printed as a JSON line.
    Probe(remote::ProbeArgs),
}

#[derive(clap::Args)]
pub struct NativeArgs {
    /// Short measurements (~0.2 s each) for a quick look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Region to use (kept afterwards); default: a temporary `bench-<pid>`, destroyed at the end.
    #[arg(long)]
    region: Option<String>,
    /// Message sizes, comma separated (each at least 16 bytes).
    #[arg(long, value_delimiter = ',', default_value = "64,1024,65536")]
    sizes: Vec<String>,
    /// Seconds per measurement (default 1, or 0.2 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// memloop ring capacity per direction (a power of two).
    #[arg(long, default_value = "1M")]
    ring: String,
    /// Do not pin the two ends to different CPUs.
    #[arg(long)]
    no_pin: bool,
    /// Rounds over all paths; each figure is the median of its rounds (default 3, 1 with
    /// --quick). Rounds interleave the paths, so a burst of noise cannot favour one of them.
    #[arg(long)]
    repeat: Option<usize>,
}

pub fn run(cmd: BenchCmd) -> CliResult<()> {
    match cmd {
        BenchCmd::Native(a) => run_native(&a),
        BenchCmd::Tcp(a) => tcp::run(&a),
        BenchCmd::Switch(a) => switch::run(&a),
        BenchCmd::Process(a) => process::run(&a),
        BenchCmd::Zerocopy(a) => zerocopy::run(&a),
        BenchCmd::Pipe(a) => pipe::run(&a),
        BenchCmd::Link(a) => link::run(&a),
        BenchCmd::Blk(a) => blk::run(&a),
        BenchCmd::Study(a) => study::run(&a),
        BenchCmd::Serve(a) => remote::serve(&a),
        BenchCmd::Probe(a) => remote::probe(&a),
    }
}

/// One benchmarked path: our end of the connection and the peer process at the other.
pub struct Link {
    name: &'static str,
    conn: Box<dyn Conn>,
    peer: Peer,
}

impl Link {
    fn new(name: &'static str, conn: Box<dyn Conn>, peer: Peer) -> Self {
        Link { name, conn, peer }
    }

    /// Ends the session: the peer sees end of stream and must exit cleanly.
    fn close(mut self) -> CliResult<()> {
        self.conn.shutdown_write()?;
        drop(self.conn);
        self.peer.finish()
    }

    /// Runs `f` on the connection; if it fails, says whether the peer died first.
    fn drive<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut dyn Conn) -> CliResult<T>,
    ) -> CliResult<T> {
        f(self.conn.as_mut()).map_err(|e| {
            let peer = self
                .peer
                .check_running()
                .err()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default();
            fail(format!("{what} over {}: {e}{peer}", self.name))
        })
    }
}

struct Config {
    sizes: Vec<usize>,
    dur: Duration,
    warmup: Duration,
    ring: u64,
    cpus: Option<(usize, usize)>,
    repeat: usize,
}

impl Config {
    fn from_args(a: &NativeArgs) -> CliResult<Config> {
        let secs = a.duration.unwrap_or(if a.quick { 0.2 } else { 1.0 });
        if !(secs > 0.0 && secs <= 3600.0) {
            return Err(fail(format!(
                "--duration {secs}: expected seconds in (0, 3600]"
            )));
        }
        let mut sizes = Vec::new();
        for s in &a.sizes {
            let n = parse_size(s)? as usize;
            if !(proto::MIN_MSG..=proto::MAX_MSG).contains(&n) {
                return Err(fail(format!(
                    "message size {n}: must be {}..={} bytes",
                    proto::MIN_MSG,
                    proto::MAX_MSG
                )));
            }
            sizes.push(n);
        }
        let ring = parse_size(&a.ring)?;
        let dur = Duration::from_secs_f64(secs);
        let cpus = if a.no_pin { None } else { sys::two_cpus() };
        let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
        Ok(Config {
            sizes,
            dur,
            warmup: dur / 5,
            ring,
            cpus,
            repeat,
        })
    }

    /// Arguments every peer gets (its CPU).
    fn peer_args(&self) -> Vec<String> {
        self.cpus
            .map(|(_, b)| vec!["--cpu".into(), b.to_string()])
            .unwrap_or_default()
    }
}

fn run_native(a: &NativeArgs) -> CliResult<()> {
    let cfg = Config::from_args(a)?;
    if let Some((mine, _)) = cfg.cpus {
        // Before joining, so the node's heartbeat thread inherits the pin too.
        sys::pin_to(mine)?;
    }
    let region = native::BenchRegion::open(a.region.as_deref())?;
    let pargs = cfg.peer_args();
    let mut links = vec![
        region.connect_peer(cfg.ring, &pargs)?,
        baselines::unix(&pargs)?,
        baselines::tcp(&pargs)?,
    ];
    let rounds = cfg.sizes.len() * 2 * links.len() * cfg.repeat;
    let bar = progress(rounds as u64 + 2);
    let mut records = Vec::new();
    for &size in cfg
        .sizes
        .iter()
        .flat_map(|s| std::iter::repeat_n(s, cfg.repeat))
    {
        for link in links.iter_mut() {
            bar.set_message(format!("rr {} over {}", fmt_size(size as u64), link.name));
            records.extend(rr(link, size, &cfg)?);
            bar.inc(1);
        }
        for link in links.iter_mut() {
            bar.set_message(format!(
                "stream {} over {}",
                fmt_size(size as u64),
                link.name
            ));
            records.extend(stream(link, size, &cfg)?);
            bar.inc(1);
        }
    }
    bar.set_message("cache-line ping-pong");
    let mut records = report::median_of_rounds(records);
    records.push(pingpong(&cfg, &pargs)?);
    bar.inc(1);
    bar.set_message("idle memloop pair");
    records.push(idle(&mut links[0], &cfg)?);
    bar.finish_and_clear();
    for link in links {
        link.close()?;
    }
    drop(region);
    print_results(&records, &cfg, a)
}

fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
        .expect("valid template");
    bar.set_style(style);
    bar
}

fn rr(link: &mut Link, size: usize, cfg: &Config) -> CliResult<Vec<Record>> {
    let (mut rtts, elapsed) =
        link.drive("rr", |c| proto::drive_rr(c, size, cfg.warmup, cfg.dur))?;
    let n = rtts.len() as f64;
    rtts.sort_unstable();
    let at = |q: f64| rtts[((rtts.len() - 1) as f64 * q).round() as usize] as f64;
    // One-way latency: half the round trip, in µs.
    let mut lat = Record::new("rr", link.name, size as u64, "us", at(0.5) / 2e3);
    lat.p99 = Some(at(0.99) / 2e3);
    let rate = Record::new(
        "rr",
        link.name,
        size as u64,
        "rt/s",
        n / elapsed.as_secs_f64(),
    );
    Ok(vec![lat, rate])
}

fn stream(link: &mut Link, size: usize, cfg: &Config) -> CliResult<Vec<Record>> {
    // A short unmeasured run first, so both ends are warm.
    link.drive("stream warm-up", |c| {
        proto::drive_stream(c, size, cfg.warmup)
    })?;
    let (msgs, elapsed) = link.drive("stream", |c| proto::drive_stream(c, size, cfg.dur))?;
    let rate = msgs as f64 / elapsed.as_secs_f64();
    Ok(vec![
        Record::new("stream", link.name, size as u64, "msg/s", rate),
        Record::new(
            "stream",
            link.name,
            size as u64,
            "Gbit/s",
            rate * size as f64 * 8.0 / 1e9,
        ),
    ])
}

fn pingpong(cfg: &Config, pargs: &[String]) -> CliResult<Record> {
    let (p50, p99) = pingpong::measure(cfg.warmup, cfg.dur, pargs)?;
    let mut r = Record::new("pingpong", "cacheline", 64, "us", p50 / 2e3);
    r.p99 = Some(p99 / 2e3);
    Ok(r)
}

/// CPU both ends burn while a connected pair waits for data that never comes.
fn idle(link: &mut Link, cfg: &Config) -> CliResult<Record> {
    let (me, peer) = (std::process::id(), link.peer.pid());
    let idle_for = if cfg.dur < Duration::from_secs(1) {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(1)
    };
    let (a0, b0) = (sys::cpu_time(me)?, sys::cpu_time(peer)?);
    let t0 = std::time::Instant::now();
    link.drive("idle wait", |c| Ok(c.idle_wait(idle_for)?))?;
    let wall = t0.elapsed().as_secs_f64();
    let (a, b) = (sys::cpu_time(me)? - a0, sys::cpu_time(peer)? - b0);
    let pct = |d: Duration| d.as_secs_f64() / wall * 100.0;
    let mut r = Record::new("idle", link.name, 0, "cpu%", pct(a) + pct(b));
    r.note = Some(format!(
        "both processes over {wall:.2} s: driver {:.3}%, peer {:.3}%",
        pct(a),
        pct(b)
    ));
    Ok(r)
}

fn print_results(records: &[Record], cfg: &Config, a: &NativeArgs) -> CliResult<()> {
    let pin = match cfg.cpus {
        Some((x, y)) => format!("ends pinned to CPUs {x} and {y}"),
        None => "ends not pinned".into(),
    };
    println!(
        "memloop bench native: {:.2} s per measurement, {pin}; ratios >1 mean memloop is better",
        cfg.dur.as_secs_f64()
    );
    println!();
    print!("{}", report::table(records));
    println!();
    for line in report::targets(records) {
        println!("{line}");
    }
    if let Some(file) = &a.json {
        report::write_json(records, file)?;
        println!("results written to {}", file.display());
    }
    Ok(())
}

/// Pins the peer if asked (used by the hidden peer command).
pub fn pin_peer(cpu: Option<usize>) -> CliResult<()> {
    cpu.map_or(Ok(()), sys::pin_to).context("peer")
}
