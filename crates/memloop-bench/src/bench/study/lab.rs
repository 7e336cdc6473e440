//! The study's testbed: two network-namespace domains, the regions, and helpers that start the
//! unmodified `tcp-peer` ends on any path (with the options an experiment varies: CPUs,
//! environment, regions) and measure with each end's CPU time.

use crate::bench::sys;
use crate::bench::tcp::procs::{Proc, Testbed};
use crate::bench::tcp::wire::{Reply, Request, Test};
use crate::bench::tcp::{check_preloaded, preload_status, ring_bytes_while};
use crate::error::{fail, CliResult};
use memloop::registry::header::RegionParams;
use memloop::CreateRegion;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The paths of the study.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Domain 0 ↔ domain 1, both ends under `memloop run` in one region.
    Memloop,
    /// Domain 0 ↔ domain 1 through veth pairs and the bridge.
    Veth,
    /// 127.0.0.1 in domain 0.
    Loopback,
    /// Abstract Unix stream socket in domain 0.
    Unix,
    /// As veth+bridge, both ends preloaded but in different regions (no ring).
    VethPreload,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Memloop => "memloop",
            Kind::Veth => "veth+bridge",
            Kind::Loopback => "tcp-loopback",
            Kind::Unix => "unix",
            Kind::VethPreload => "veth+preload",
        }
    }

    pub fn what(self) -> &'static str {
        match self {
            Kind::Memloop => "domain 0 ↔ domain 1, both ends under `memloop run`, one region",
            Kind::Veth => "domain 0 ↔ domain 1 through veth pairs and the bridge",
            Kind::Loopback => "127.0.0.1 in domain 0",
            Kind::Unix => "abstract Unix stream socket in domain 0",
            Kind::VethPreload => {
                "as veth+bridge, both ends under `memloop run` in different regions (no ring)"
            }
        }
    }

    /// The four paths compared side by side.
    pub const MAIN: [Kind; 4] = [Kind::Memloop, Kind::Veth, Kind::Loopback, Kind::Unix];

    fn preloaded(self) -> bool {
        matches!(self, Kind::Memloop | Kind::VethPreload)
    }
}

/// Options an experiment varies when starting a pair.
#[derive(Clone, Default)]
pub struct Opts {
    /// (client, server) CPUs; `None`: the lab's default placement.
    pub cpus: Option<(usize, usize)>,
    /// Do not pin at all.
    pub unpinned: bool,
    /// Extra environment for both ends (e.g. MEMLOOP_RING_BYTES).
    pub env: Vec<(String, String)>,
    /// The client's region instead of the near one (preloaded paths).
    pub client_region: Option<String>,
}

pub struct Lab {
    // Declared first: peers are stopped before the testbed removes domains and regions.
    bed: Testbed,
    pub near: String,
    pub far: String,
    /// A region with room for 16 384 endpoints (the endpoint-count variant).
    pub wide: String,
    /// A region of mode 666 for the real programs (servers that drop privileges attach too).
    pub prog: String,
    /// The domains' prefix (`memloop domains exec N --prefix P`).
    pub prefix: String,
    pub preload: Result<(), String>,
    /// Default (client, server) CPUs.
    pub cpus: Option<(usize, usize)>,
    pub quick: bool,
    pub dur: Duration,
    pub warmup: Duration,
    seq: u32,
    /// Paths found unusable, with why.
    pub unavailable: Vec<(&'static str, String)>,
    pub notes: Vec<(&'static str, String)>,
}

/// A server and a client connected to it.
pub struct Pair {
    pub kind: Kind,
    pub server: Proc,
    pub client: Proc,
}

/// One measurement: the client's reply, wall time and each end's CPU time (s).
pub struct Meas {
    pub reply: Reply,
    pub wall: f64,
    pub cpu_client: f64,
    pub cpu_server: f64,
}

impl Meas {
    pub fn rate(&self) -> f64 {
        self.reply.count as f64 / self.reply.elapsed_s
    }
    pub fn gbit(&self) -> f64 {
        self.reply.bytes as f64 * 8.0 / self.reply.elapsed_s / 1e9
    }
    /// CPU utilisation of each end over the measurement, % of one CPU.
    pub fn util(&self) -> (f64, f64) {
        (
            self.cpu_client / self.wall * 100.0,
            self.cpu_server / self.wall * 100.0,
        )
    }
}

impl Lab {
    pub fn up(quick: bool) -> CliResult<Lab> {
        let pid = std::process::id();
        let (near, far, wide, prog) = (
            format!("study-{pid}"),
            format!("study-{pid}-far"),
            format!("study-{pid}-wide"),
            format!("study-{pid}-prog"),
        );
        let mut bed = Testbed::up(&[near.clone(), far.clone(), wide.clone(), prog.clone()])?;
        let preload = preload_status(bed.exe());
        if preload.is_ok() {
            bed.create_region(&near)?;
            bed.create_region(&far)?;
            let params = RegionParams {
                max_endpoints: 16384,
                ..RegionParams::default()
            };
            bed.create_region_with(
                &wide,
                &CreateRegion {
                    params,
                    ..CreateRegion::default()
                },
            )?;
            bed.create_region_with(
                &prog,
                &CreateRegion {
                    mode: 0o666,
                    ..CreateRegion::default()
                },
            )?;
        }
        let dur = Duration::from_secs_f64(if quick { 0.1 } else { 1.0 });
        Ok(Lab {
            bed,
            near,
            far,
            wide,
            prog,
            // As `Testbed::up` names them.
            prefix: format!("mlb{pid}"),
            preload,
            cpus: sys::two_cpus(),
            quick,
            dur,
            warmup: dur / 5,
            seq: 0,
            unavailable: Vec::new(),
            notes: Vec::new(),
        })
    }

    pub fn pinning(&self) -> String {
        match self.cpus {
            Some((c, s)) => format!(
                "client pinned to CPU {c}, server to CPU {s} unless an experiment says otherwise ({})",
                self.bed.pinning()
            ),
            None => "ends not pinned (fewer than two CPUs)".into(),
        }
    }

    /// Domain `i`'s address.
    pub fn addr(&self, i: u8) -> std::net::Ipv4Addr {
        self.bed.addr(i)
    }

    /// The argv running `cmd` in domain `domain`, under `memloop run --region R` if given.
    pub fn in_domain(&self, domain: u8, region: Option<&str>, cmd: &[String]) -> Vec<String> {
        let exe = self.bed.exe().to_string_lossy().into_owned();
        let mut v = vec![
            exe.clone(),
            "domains".into(),
            "exec".into(),
            domain.to_string(),
        ];
        v.extend(["--prefix".into(), self.prefix.clone(), "--".into()]);
        if let Some(r) = region {
            v.extend([exe, "run".into(), "--strict".into(), "--no-create".into()]);
            v.push("--region".into());
            v.extend([r.into(), "--".into()]);
        }
        v.extend_from_slice(cmd);
        v
    }

    /// Whether a path can run at all.
    pub fn usable(&self, kind: Kind) -> bool {
        let broken = kind.preloaded() && self.preload.is_err();
        !broken && !self.unavailable.iter().any(|(n, _)| *n == kind.name())
    }

    pub fn disable(&mut self, kind: Kind, why: String) {
        if !self.unavailable.iter().any(|(n, _)| *n == kind.name()) {
            self.unavailable.push((kind.name(), why));
        }
    }

    fn command(
        &self,
        domain: u8,
        cpu: Option<usize>,
        region: Option<&str>,
        env: &[(String, String)],
        args: &[String],
    ) -> Vec<String> {
        let mut v = Vec::new();
        if !env.is_empty() {
            v.push("env".into());
            v.extend(env.iter().map(|(k, val)| format!("{k}={val}")));
        }
        v.extend(self.bed.peer_command(domain, cpu, region, args));
        v
    }

    /// Starts a server for `kind`; returns it and the address clients should use.
    pub fn server(&mut self, kind: Kind, o: &Opts) -> CliResult<(Proc, String)> {
        self.seq += 1;
        let listen = match kind {
            Kind::Memloop | Kind::Veth | Kind::VethPreload => format!("{}:0", self.bed.addr(0)),
            Kind::Loopback => "127.0.0.1:0".into(),
            Kind::Unix => format!("unix:@memloop-study-{}-{}", std::process::id(), self.seq),
        };
        let region = match kind {
            Kind::Memloop => Some(self.near.clone()),
            Kind::VethPreload => Some(self.far.clone()),
            _ => None,
        };
        let cpu = self.placement(o).map(|c| c.1);
        let args = ["--role", "server", "--addr", &listen].map(String::from);
        let argv = self.command(0, cpu, region.as_deref(), &o.env, &args);
        let mut p = Proc::spawn(format!("{} server", kind.name()), &argv)?;
        let ready = p.ready()?;
        let addr = ready["addr"]
            .as_str()
            .ok_or_else(|| fail(format!("{} server: no address in {ready}", kind.name())))?
            .to_owned();
        if kind.preloaded() {
            check_preloaded(&p)?;
        }
        Ok((p, addr))
    }

    /// Starts a client of `kind` for the server at `addr`.
    pub fn client(&mut self, kind: Kind, addr: &str, o: &Opts) -> CliResult<Proc> {
        let domain = match kind {
            Kind::Memloop | Kind::Veth | Kind::VethPreload => 1,
            Kind::Loopback | Kind::Unix => 0,
        };
        let region = kind
            .preloaded()
            .then(|| o.client_region.clone().unwrap_or_else(|| self.near.clone()));
        let cpu = self.placement(o).map(|c| c.0);
        let args = ["--role", "client", "--addr", addr].map(String::from);
        let argv = self.command(domain, cpu, region.as_deref(), &o.env, &args);
        let mut p = Proc::spawn(format!("{} client", kind.name()), &argv)?;
        p.ready()?;
        if kind.preloaded() {
            check_preloaded(&p)?;
        }
        Ok(p)
    }

    fn placement(&self, o: &Opts) -> Option<(usize, usize)> {
        if o.unpinned {
            None
        } else {
            o.cpus.or(self.cpus)
        }
    }

    /// Starts a server and a client; on a memloop path, checks that a ring carries the bytes.
    pub fn pair(&mut self, kind: Kind, o: &Opts) -> CliResult<Pair> {
        let (server, addr) = self.server(kind, o)?;
        let client = self.client(kind, &addr, o)?;
        let mut pair = Pair {
            kind,
            server,
            client,
        };
        if kind == Kind::Memloop {
            let region = o.client_region.clone().unwrap_or_else(|| self.near.clone());
            let stop = Arc::new(AtomicBool::new(false));
            let watch = {
                let stop = stop.clone();
                std::thread::spawn(move || ring_bytes_while(&region, &stop))
            };
            let r = self.request(Test::Rr, 64, Duration::from_millis(50), Duration::ZERO);
            let res = pair.client.ask(&r, Duration::from_secs(20));
            stop.store(true, Ordering::Relaxed);
            let bytes = watch.join().unwrap_or(0);
            res?;
            if bytes == 0 {
                return Err(fail(
                    "the preload left the connection on TCP (no bytes went through a ring)",
                ));
            }
        }
        Ok(pair)
    }

    pub fn request(&self, test: Test, size: usize, dur: Duration, warmup: Duration) -> Request {
        Request {
            test,
            size,
            warmup_s: warmup.as_secs_f64(),
            dur_s: dur.as_secs_f64(),
            sleep_us: 1000,
            conns: 0,
        }
    }

    /// Runs `test` at `size` on `pair` (warm-up included unless `cold`), with CPU accounting.
    pub fn measure(&self, pair: &mut Pair, test: Test, size: usize, cold: bool) -> CliResult<Meas> {
        // CPU accounting counts 10 ms ticks: cold runs (the CPU-cost ones) last at least 0.5 s.
        // A sleeping exchange uses little CPU per second (the accounting has 10 ms ticks): longer.
        let least = match test {
            Test::SleepRr => Duration::from_secs(5),
            _ => Duration::from_millis(500),
        };
        let (warmup, dur) = if cold {
            (Duration::ZERO, self.dur.max(least))
        } else {
            (self.warmup, self.dur)
        };
        let req = self.request(test, size, dur, warmup);
        measure_req(pair, &req, dur + warmup + Duration::from_secs(20))
    }
}

/// Sends `req` to the pair's client and accounts both ends' CPU time from each process's own
/// accounting in /proc/PID/stat (utime + stime, which, like getrusage, include the threads that
/// have exited: the server's connection threads end with their connection).
pub fn measure_req(pair: &mut Pair, req: &Request, timeout: Duration) -> CliResult<Meas> {
    let pids = (pair.client.pid(), pair.server.pid());
    let cpu = |p: Option<u32>| p.and_then(process_cpu).unwrap_or(Duration::ZERO);
    let (c0, s0) = (cpu(pids.0), cpu(pids.1));
    let t = Instant::now();
    let reply = pair.client.ask(req, timeout)?;
    let wall = t.elapsed().as_secs_f64();
    let (c1, s1) = (cpu(pids.0), cpu(pids.1));
    if reply.count == 0 || reply.elapsed_s <= 0.0 {
        return Err(fail(format!(
            "{}: empty measurement {reply:?}",
            pair.kind.name()
        )));
    }
    Ok(Meas {
        reply,
        wall,
        cpu_client: c1.saturating_sub(c0).as_secs_f64(),
        cpu_server: s1.saturating_sub(s0).as_secs_f64(),
    })
}

/// utime + stime of a whole process (fields 14 and 15 of /proc/PID/stat, clock ticks of 10 ms).
fn process_cpu(pid: u32) -> Option<Duration> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = s[s.rfind(')')? + 2..].split_whitespace().skip(11);
    let ticks = f.next()?.parse::<u64>().ok()? + f.next()?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The machine, for the report's first lines.
pub fn machine() -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name") || l.starts_with("Model"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let online = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let usable = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or("unknown".into(), |kb| {
            format!("{:.1} GiB", kb as f64 / 1024.0 / 1024.0)
        });
    vec![
        ("CPU".into(), model),
        (
            "cores".into(),
            format!("{usable} usable by this process ({online} online)"),
        ),
        (
            "kernel".into(),
            format!(
                "{} {}",
                read("/proc/sys/kernel/ostype").trim(),
                read("/proc/sys/kernel/osrelease").trim()
            ),
        ),
        ("memory".into(), mem),
    ]
}
