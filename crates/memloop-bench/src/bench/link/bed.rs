//! The testbed of `bench link`: two domains of this run's own, its region, a link service in
//! each domain, and the link's half of the links table (counters, carrier, offloads) read
//! straight from the region, as `memloop status --json` shows it.

use super::{Opts, DROPS, LINK};
use crate::bench::bgproc::BgProcess;
use crate::bench::report::Record;
use crate::bench::tcp::procs::Testbed;
use crate::error::{fail, CliResult, Context};
use memloop::registry::header::RegionParams;
use memloop::{CreateRegion, Region, RegionSpec};
use memloop_cli::link_cmd::{self, LinkCmd};
use serde_json::Value;
use std::io::Read;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Set for a link service the benchmark starts: the service stops (SIGTERM to itself, its
/// clean way down) when its stdin closes, so it never outlives the benchmark.
pub const STOP_ON_EOF: &str = "MEMLOOP_BENCH_STOP_ON_EOF";

/// The hidden `link-service` command: `memloop link`, stopping on end of stdin if asked.
pub fn service(cmd: LinkCmd) -> CliResult<()> {
    if std::env::var_os(STOP_ON_EOF).is_some() {
        std::thread::spawn(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().lock().read_to_end(&mut sink);
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::TERM,
            );
        });
    }
    link_cmd::run(cmd)
}

/// The link's name on both sides (the region is this run's own).
const NAME: &str = "bench";

/// A half's counters, as the links table has them.
#[derive(Clone, Copy, Default, Debug)]
pub struct Counters {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub drops_full: u64,
    pub drops_bad: u64,
    pub restarts: u64,
}

impl Counters {
    fn of(c: &Value) -> Counters {
        let g = |k: &str| c[k].as_u64().unwrap_or(0);
        Counters {
            tx_packets: g("tx_packets"),
            tx_bytes: g("tx_bytes"),
            rx_packets: g("rx_packets"),
            rx_bytes: g("rx_bytes"),
            drops_full: g("drops_full"),
            drops_bad: g("drops_bad"),
            restarts: g("restarts"),
        }
    }

    /// How much each counter grew since `before`.
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            tx_packets: self.tx_packets.saturating_sub(before.tx_packets),
            tx_bytes: self.tx_bytes.saturating_sub(before.tx_bytes),
            rx_packets: self.rx_packets.saturating_sub(before.rx_packets),
            rx_bytes: self.rx_bytes.saturating_sub(before.rx_bytes),
            drops_full: self.drops_full.saturating_sub(before.drops_full),
            drops_bad: self.drops_bad.saturating_sub(before.drops_bad),
            restarts: self.restarts.saturating_sub(before.restarts),
        }
    }
}

/// Both sides' halves at one moment: index 0 is domain 0's.
pub struct Snap {
    pub counters: [Counters; 2],
    pub carrier: [bool; 2],
    pub offloads: [Vec<String>; 2],
    pub ifname: [String; 2],
}

impl Snap {
    /// Each side's growth since `before`.
    pub fn since(&self, before: &Snap) -> [Counters; 2] {
        [
            self.counters[0].since(&before.counters[0]),
            self.counters[1].since(&before.counters[1]),
        ]
    }
}

pub struct Bed {
    // Declared first: the services stop (see the drop) before the region handle goes and the
    // testbed removes the domains and the region.
    sides: Vec<BgProcess>,
    region: Option<Region>,
    tb: Testbed,
    exe: PathBuf,
    prefix: String,
    region_name: String,
    /// The link's subnet: 10.99.K.0/30, domain d at .d+1.
    k: u8,
    spin_us: Option<u64>,
    ring_size: Option<String>,
    /// The halves as they came up.
    first: Option<Snap>,
}

impl Bed {
    pub fn up(o: &Opts) -> CliResult<Bed> {
        if !rustix::process::geteuid().is_root() {
            return Err(fail(
                "`memloop bench link` needs root: it creates network namespaces (domains) and \
                 TUN devices",
            ));
        }
        let pid = std::process::id();
        let prefix = format!("mlk{pid}");
        let region_name = format!("bench-link-{pid}");
        let mut tb = Testbed::up_named(&prefix, std::slice::from_ref(&region_name))?;
        tb.create_region_with(
            &region_name,
            &CreateRegion {
                params: RegionParams::for_size(o.region_bytes()),
                ..CreateRegion::default()
            },
        )?;
        let region = Region::open(&RegionSpec::parse(&region_name))
            .context(format!("opening region {region_name}"))?;
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        // From here on, dropping `bed` (on any error) stops what was started.
        let mut bed = Bed {
            sides: Vec::new(),
            region: Some(region),
            tb,
            exe,
            prefix,
            region_name,
            k: (pid % 250) as u8 + 1,
            spin_us: o.spin_us,
            ring_size: o.ring_size.clone(),
            first: None,
        };
        for d in 0..2 {
            bed.start_side(d)?;
        }
        bed.first = Some(bed.wait_carrier(Duration::from_secs(15))?);
        Ok(bed)
    }

    /// `link-service up NAME --foreground …` in domain `d`, until it prints its interface.
    fn start_side(&mut self, d: u8) -> CliResult<()> {
        let mut args: Vec<String> = ["up", NAME, "--foreground", "--addr"]
            .map(String::from)
            .to_vec();
        args.push(format!("{}/30", self.link_addr(d)));
        args.extend(["--region".into(), self.region_name.clone()]);
        if let Some(s) = self.spin_us {
            args.extend(["--spin-us".into(), s.to_string()]);
        }
        if let Some(r) = &self.ring_size {
            args.extend(["--ring-size".into(), r.clone()]);
        }
        let argv = self.tb.command_of("link-service", d, None, None, &args);
        let env = [("MEMLOOP_LINK_NOTIFY", "1"), (STOP_ON_EOF, "1")];
        let what = format!("domain {d}'s link service");
        let (mut side, _) = BgProcess::start("link", &what, &argv, &env, true)?;
        side.set_grace(Duration::from_secs(5));
        self.sides.push(side);
        Ok(())
    }

    /// Until both halves are in the table with their carrier up.
    fn wait_carrier(&mut self, within: Duration) -> CliResult<Snap> {
        let deadline = Instant::now() + within;
        loop {
            for s in &mut self.sides {
                s.check()?;
            }
            let snap = self.snapshot();
            if let Ok(s) = &snap {
                if s.carrier == [true, true] {
                    return snap;
                }
            }
            if Instant::now() >= deadline {
                let why = match snap {
                    Ok(s) => format!("carrier {:?}", s.carrier),
                    Err(e) => e.to_string(),
                };
                return Err(fail(format!(
                    "the link did not come up within {:.0} s ({why})",
                    within.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The link's entry of the links table (`memloop status --json`'s "links").
    fn entry(&self) -> CliResult<Value> {
        let region = self.region.as_ref().expect("open while the bed is up");
        let links = link_cmd::links_json(region.registry());
        links
            .as_array()
            .into_iter()
            .flatten()
            .find(|l| l["name"] == NAME)
            .cloned()
            .ok_or_else(|| fail(format!("link {NAME} is not in the links table: {links}")))
    }

    /// Both sides' halves now, found by their services' pids.
    pub fn snapshot(&self) -> CliResult<Snap> {
        let e = self.entry()?;
        let mut snap = Snap {
            counters: [Counters::default(); 2],
            carrier: [false; 2],
            offloads: [Vec::new(), Vec::new()],
            ifname: [String::new(), String::new()],
        };
        for (i, side) in self.sides.iter().enumerate() {
            let h = e["halves"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|h| h["pid"].as_u64() == Some(u64::from(side.pid())))
                .ok_or_else(|| {
                    fail(format!(
                        "no half of link {NAME} has domain {i}'s service (pid {}): {e}",
                        side.pid()
                    ))
                })?;
            snap.counters[i] = Counters::of(&h["counters"]);
            snap.carrier[i] = h["carrier"] == true;
            snap.offloads[i] = h["offloads"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str().map(String::from))
                .collect();
            snap.ifname[i] = h["ifname"].as_str().unwrap_or_default().to_string();
        }
        Ok(snap)
    }

    /// Fails if a service has exited or the carrier is down.
    pub fn check(&mut self) -> CliResult<()> {
        for s in &mut self.sides {
            s.check()?;
        }
        let snap = self.snapshot()?;
        if snap.carrier != [true, true] {
            return Err(fail(format!(
                "the link lost its carrier: {:?}",
                snap.carrier
            )));
        }
        Ok(())
    }

    /// A failed measurement's error, with what became of the link if that explains it (a
    /// service exited, the carrier dropped).
    pub fn explain<T>(&mut self, r: CliResult<T>) -> CliResult<T> {
        r.map_err(|e| match self.check() {
            Err(why) => fail(format!("{e} ({why})")),
            Ok(()) => e,
        })
    }

    /// The services' pids, domain 0's first.
    pub fn pids(&self) -> [u32; 2] {
        [self.sides[0].pid(), self.sides[1].pid()]
    }

    /// Domain `d`'s address on the link.
    pub fn link_addr(&self, d: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 99, self.k, d + 1)
    }

    /// Domain `d`'s address on the bridge.
    pub fn bridge_addr(&self, d: u8) -> Ipv4Addr {
        self.tb.addr(d)
    }

    /// The argv running the program `cmd` in domain `d`.
    pub fn in_domain(&self, d: u8, cmd: &[String]) -> Vec<String> {
        let mut v = vec![
            self.exe.to_string_lossy().into_owned(),
            "domains".into(),
            "exec".into(),
            d.to_string(),
            "--prefix".into(),
            self.prefix.clone(),
            "--".into(),
        ];
        v.extend_from_slice(cmd);
        v
    }

    /// The argv of this binary's hidden command `sub` in domain `d` (no preload, unpinned).
    pub fn ours_in_domain(&self, sub: &str, d: u8, args: &[String]) -> Vec<String> {
        self.tb.command_of(sub, d, None, None, args)
    }

    /// What the reader must know of the setup.
    pub fn describe(&self) -> String {
        let offloads = |i: usize| {
            self.first
                .as_ref()
                .map_or("?".into(), |s| s.offloads[i].join(","))
        };
        let ifname = self
            .first
            .as_ref()
            .map_or(String::new(), |s| s.ifname[0].clone());
        format!(
            "link {NAME} ({ifname}) in region {}: domain 0 {}/30 ↔ domain 1 {}/30, each side \
             `memloop link up --foreground` in its domain (--spin-us {}, --ring-size {}); \
             veth+bridge: domain 0 {} ↔ domain 1 {}; offloads negotiated: domain 0 {}, \
             domain 1 {}",
            self.region_name,
            self.link_addr(0),
            self.link_addr(1),
            self.spin_us
                .map_or("default".to_string(), |s| s.to_string()),
            self.ring_size.as_deref().unwrap_or("default"),
            self.bridge_addr(0),
            self.bridge_addr(1),
            offloads(0),
            offloads(1),
        )
    }

    /// The link's drops and restarts over the whole run (both sides), and a note with each
    /// side's counters and offloads.
    pub fn drops(&self) -> CliResult<(Vec<Record>, String)> {
        let s = self.snapshot()?;
        let [a, b] = s.counters;
        let side = |i: usize, c: &Counters| {
            format!(
                "domain {i}: tx {} packets / {} B, rx {} packets / {} B, drops_full {}, \
                 drops_bad {}, sessions {}",
                c.tx_packets,
                c.tx_bytes,
                c.rx_packets,
                c.rx_bytes,
                c.drops_full,
                c.drops_bad,
                c.restarts
            )
        };
        let note = format!(
            "the link's counters at the end (links table, as `memloop status --json` shows \
             them): {}; {}",
            side(0, &a),
            side(1, &b)
        );
        let recs = vec![
            Record::new(
                DROPS,
                LINK,
                2,
                "drops_full",
                (a.drops_full + b.drops_full) as f64,
            ),
            Record::new(
                DROPS,
                LINK,
                2,
                "drops_bad",
                (a.drops_bad + b.drops_bad) as f64,
            ),
            // The counter counts sessions, the first one too: restarts are the others.
            Record::new(
                DROPS,
                LINK,
                2,
                "restarts",
                (a.restarts.saturating_sub(1) + b.restarts.saturating_sub(1)) as f64,
            ),
        ];
        Ok((recs, note))
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        // SIGTERM, as `memloop link down` sends it (which this binary's `link-service down`
        // would refuse: it signals only a process whose command line is `… link up NAME
        // --foreground`): each service takes its carrier down and leaves the links table.
        for s in &self.sides {
            s.term();
        }
        for (d, s) in self.sides.iter_mut().enumerate() {
            if !s.wait_exit(Duration::from_secs(10)) {
                eprintln!(
                    "memloop bench link: domain {d}'s link service did not stop in 10 s: killed"
                );
            }
        }
        // The sides' own drop kills a service still running.
        self.sides.clear();
        self.region = None;
    }
}
