//! `memloop link`: a point-to-point network link over the region (MMNet). `up` starts this
//! side's service — a TUN device with the virtio-net header and checksum/TSO offloads, whose
//! frames cross a link channel to the other side — in the background and prints the
//! interface name; `down` stops this domain's side. The service ([`serve`]) keeps the device
//! while the other side comes and goes: the carrier is up only while a session runs.

use crate::error::{fail, CliResult, Context};
use crate::service;
use crate::units::parse_size;
use memloop::link::tun::{self, TunConfig, TunDevice};
use memloop::link::{Drained, LinkRx, LinkTx, Linker, Pumped, MAX_FRAME, VNET_HDR_LEN};
use memloop::registry::{LinkCounters, LinkHalfDesc, LinkRef};
use memloop::{Node, Region, RegionSpec};
use std::ffi::OsString;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum LinkCmd {
    /// Bring this side of link NAME up: a network interface whose wire is the region (run it
    /// in both domains with the same NAME and each side's own address).
    Up(UpArgs),
    /// Take this domain's side of link NAME down (the other side sees its carrier drop).
    Down(DownArgs),
}

#[derive(clap::Args)]
pub struct UpArgs {
    /// The link's name, the same on both sides (at most 48 bytes).
    name: String,
    /// This side's IPv4 address and prefix, e.g. 10.99.0.1/30.
    #[arg(long, value_name = "ADDR/PREFIX")]
    addr: Option<String>,
    /// This side's IPv6 address and prefix, e.g. fd99::1/64.
    #[arg(long, value_name = "ADDR/PREFIX")]
    addr6: Option<String>,
    /// The interface's name (default: ml-NAME, cut to 15 bytes).
    #[arg(long)]
    ifname: Option<String>,
    /// The interface's MTU: with TSO, TCP moves 64 KiB super-packets whatever it is; this is
    /// the largest packet of any other protocol.
    #[arg(long, default_value_t = 65535)]
    mtu: u32,
    /// Ring size per direction.
    #[arg(long, default_value = "4M", value_name = "SIZE")]
    ring_size: String,
    /// The region (default: MEMLOOP_REGION, else "default").
    #[arg(long)]
    region: Option<String>,
    /// Microseconds the service keeps polling its device and ring after traffic before it
    /// sleeps. 0 (the default) sleeps at once: on a host with few CPUs a spinning service
    /// takes the CPU the programs it serves need (measured: 50 µs made TCP round trips 1.4×
    /// slower and the stream 0.8×). Towards another VM the ring wait keeps its own spin.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
    /// Run the service in the foreground instead of starting it in the background.
    #[arg(long)]
    foreground: bool,
}

#[derive(clap::Args)]
pub struct DownArgs {
    name: String,
    /// The region (default: MEMLOOP_REGION, else "default").
    #[arg(long)]
    region: Option<String>,
}

pub fn run(cmd: LinkCmd) -> CliResult<()> {
    match cmd {
        LinkCmd::Up(a) if a.foreground => serve(&a),
        LinkCmd::Up(a) => start(&a),
        LinkCmd::Down(a) => down(&a),
    }
}

/// The interface's default name: `ml-NAME`, cut to the kernel's 15 bytes.
pub fn default_ifname(link: &str) -> String {
    let mut n = format!("ml-{link}");
    while n.len() > 15 {
        n.pop();
    }
    n
}

/// Parses `ADDR/PREFIX`.
fn parse_cidr<A: std::str::FromStr>(s: &str, max: u8) -> CliResult<(A, u8)> {
    let bad = || fail(format!("{s:?}: want ADDRESS/PREFIX (prefix up to {max})"));
    let (a, p) = s.split_once('/').ok_or_else(bad)?;
    let a = a.parse().map_err(|_| bad())?;
    let p: u8 = p.parse().ok().filter(|p| *p <= max).ok_or_else(bad)?;
    Ok((a, p))
}

/// The service's log, in its state directory.
fn log_path(spec: &RegionSpec, link: &str) -> PathBuf {
    let name = format!("link-{link}-net{}.log", service::netns_number());
    service::state_dir(spec).join(name)
}

/// Starts the service in the background and prints its interface once it is up.
fn start(a: &UpArgs) -> CliResult<()> {
    let spec = service::region_spec(a.region.as_deref());
    let mut args: Vec<OsString> = ["link", "up", &a.name, "--foreground", "--mtu"]
        .map(OsString::from)
        .into();
    args.push(a.mtu.to_string().into());
    args.extend(["--ring-size".into(), OsString::from(&a.ring_size)]);
    args.extend(["--spin-us".into(), a.spin_us.to_string().into()]);
    args.extend(["--region".into(), spec.path().into_os_string()]);
    for (flag, v) in [
        ("--addr", &a.addr),
        ("--addr6", &a.addr6),
        ("--ifname", &a.ifname),
    ] {
        if let Some(v) = v {
            args.extend([flag.into(), v.into()]);
        }
    }
    let log = log_path(&spec, &a.name);
    let ifname = service::start(&spec, "link", &args, &log, NOTIFY)?;
    println!("{ifname}");
    Ok(())
}

/// Set for a service started by `link up`: it prints its interface when ready.
const NOTIFY: &str = "MEMLOOP_LINK_NOTIFY";

/// Device, addresses and what the kernel accepted, for the links table.
fn open_device(a: &UpArgs) -> CliResult<(TunDevice, LinkHalfDesc)> {
    let ipv4 = a
        .addr
        .as_deref()
        .map(|s| parse_cidr::<Ipv4Addr>(s, 32))
        .transpose()?;
    let ipv6 = a
        .addr6
        .as_deref()
        .map(|s| parse_cidr::<Ipv6Addr>(s, 128))
        .transpose()?;
    if !(68..=65535).contains(&a.mtu) {
        return Err(fail(format!("--mtu {}: from 68 to 65535", a.mtu)));
    }
    let cfg = TunConfig {
        name: a.ifname.clone().unwrap_or_else(|| default_ifname(&a.name)),
        vnet_hdr: true,
        offloads: tun::TUN_F_CSUM
            | tun::TUN_F_TSO4
            | tun::TUN_F_TSO6
            | tun::TUN_F_TSO_ECN
            | tun::TUN_F_USO4
            | tun::TUN_F_USO6,
    };
    let dev = TunDevice::create(&cfg).context(format!("creating TUN device {}", cfg.name))?;
    let name = dev.name().to_string();
    let ctx = |what: &str| format!("{what} on {name}");
    dev.set_mtu(a.mtu).context(ctx("setting the MTU"))?;
    if let Some((addr, p)) = ipv4 {
        dev.set_ipv4(addr, p)
            .context(ctx("setting the IPv4 address"))?;
    }
    dev.set_carrier(false)
        .context(ctx("taking the carrier down"))?;
    dev.set_up(true).context(ctx("bringing the interface up"))?;
    if let Some((addr, p)) = ipv6 {
        dev.add_ipv6(addr, p)
            .context(ctx("adding the IPv6 address"))?;
    }
    dev.set_nonblocking(true)
        .context(ctx("making the device non-blocking"))?;
    let desc = LinkHalfDesc {
        pid: std::process::id(),
        mtu: a.mtu,
        ifname: name,
        ipv4,
        ipv6,
        offloads: dev.offloads(),
    };
    Ok((dev, desc))
}

/// The service: joins the link's table entry, makes the device, then runs one session after
/// another until SIGINT or SIGTERM.
fn serve(a: &UpArgs) -> CliResult<()> {
    let ring = parse_size(&a.ring_size)?;
    if !ring.is_power_of_two() || !(1 << 18..=1 << 30).contains(&ring) {
        return Err(fail("--ring-size: a power of two from 256K to 1G"));
    }
    let spec = service::region_spec(a.region.as_deref());
    let region = Region::open(&spec).context("opening the region")?;
    let node = Node::join(region, "link").context("joining the region")?;
    let reg = node.region().registry();
    let (link, half) = reg
        .link_join(&a.name, node.id(), |m| node.peer_alive(m))
        .context(format!("joining link {}", a.name))?;
    let svc = Side {
        node: node.clone(),
        link,
        half,
        spin: Duration::from_micros(a.spin_us),
    };
    let (dev, desc) = open_device(a)?;
    reg.link_describe(link, half, &desc)
        .context("describing the link")?;
    let stop = service::stop_flag()?;
    eprintln!(
        "memloop link {}: {} up (half {half}, offloads {})",
        a.name,
        desc.ifname,
        tun::offload_names(desc.offloads).join(",")
    );
    service::notify_ready(&desc.ifname, NOTIFY, false)?;
    let mut linker = Linker::new(&node, &a.name, ring);
    while !stop.load(Relaxed) {
        match linker.establish(Duration::from_millis(200)) {
            Ok(Some((tx, rx))) => svc.session(&dev, tx, rx, &stop),
            Ok(None) => {}
            Err(e) => {
                eprintln!("memloop link {}: {e}", a.name);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    eprintln!("memloop link {}: going down", a.name);
    let _ = dev.set_carrier(false);
    let _ = reg.link_leave(link, half, node.id());
    Ok(())
}

/// Our half of the link, for the table's counters and carrier.
struct Side {
    node: Node,
    link: LinkRef,
    half: u8,
    /// How long the device → ring pump keeps looking after traffic before it sleeps.
    spin: Duration,
}

impl Side {
    /// One session: the carrier is up while it lasts; a thread moves device → ring while
    /// this one moves ring → device. It ends when the peer goes (closed, died, refused) or
    /// we are stopped.
    fn session(&self, dev: &TunDevice, mut tx: LinkTx, mut rx: LinkRx, stop: &AtomicBool) {
        let reg = self.node.region().registry();
        let restart = LinkCounters {
            restarts: 1,
            ..Default::default()
        };
        let _ = reg.link_count(self.link, self.half, &restart);
        let _ = dev.set_carrier(true);
        let _ = reg.link_set_carrier(self.link, self.half, true);
        tracing::info!(peer = ?rx.peer(), "link session up");
        if rx.peer_same_kernel() {
            rx.set_spin(self.spin);
        }
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                self.device_to_ring(dev, &mut tx, stop, &done);
                done.store(true, Relaxed);
            });
            self.ring_to_device(dev, &mut rx, stop, &done);
            done.store(true, Relaxed);
        });
        tx.shutdown();
        rx.close();
        let _ = dev.set_carrier(false);
        let _ = reg.link_set_carrier(self.link, self.half, false);
        tracing::info!("link session down");
    }

    fn count(&self, c: &mut LinkCounters) {
        if c.tx_packets + c.rx_packets + c.drops_full + c.drops_bad > 0 {
            let reg = self.node.region().registry();
            let _ = reg.link_count(self.link, self.half, c);
            *c = LinkCounters::default();
        }
    }

    /// Device → ring until the session ends. After traffic it keeps looking at the device for
    /// the spin window (a non-blocking read each time) before it sleeps in poll(2): a
    /// request/response exchange then costs no wake-up on this hop.
    fn device_to_ring(
        &self,
        dev: &TunDevice,
        tx: &mut LinkTx,
        stop: &AtomicBool,
        done: &AtomicBool,
    ) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut scratch = vec![0u8; MAX_FRAME];
        let mut looked = Instant::now();
        let mut idle_since: Option<Instant> = None;
        let slice = Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        while !stop.load(Relaxed) && !done.load(Relaxed) {
            match self.pump_batch(dev, tx, &mut scratch) {
                Ok(0) => {}
                Ok(_) => {
                    idle_since = None;
                    continue;
                }
                Err(e) => {
                    tracing::debug!("link: device → ring ends: {e}");
                    return;
                }
            }
            let now = Instant::now();
            if now.duration_since(*idle_since.get_or_insert(now)) < self.spin {
                std::hint::spin_loop();
                continue;
            }
            idle_since = None;
            let mut fds = [PollFd::new(dev, PollFlags::IN)];
            let _ = poll(&mut fds, Some(&slice));
            if looked.elapsed() >= Duration::from_millis(100) {
                looked = Instant::now();
                if tx.peer_lost() {
                    return;
                }
            }
        }
    }

    /// Moves what the device holds into the ring: the frames moved (drops included).
    fn pump_batch(
        &self,
        dev: &TunDevice,
        tx: &mut LinkTx,
        scratch: &mut [u8],
    ) -> Result<u64, memloop::Error> {
        let mut c = LinkCounters::default();
        let r = loop {
            match tx.pump_from_fd(dev.fd(), scratch) {
                Ok(Pumped::Sent(n)) => {
                    c.tx_packets += 1;
                    c.tx_bytes += n - VNET_HDR_LEN as u64;
                }
                Ok(Pumped::Dropped(_)) => c.drops_full += 1,
                Ok(Pumped::Idle) => break Ok(c.tx_packets + c.drops_full),
                Err(e) => break Err(e),
            }
        };
        self.count(&mut c);
        r
    }

    fn ring_to_device(
        &self,
        dev: &TunDevice,
        rx: &mut LinkRx,
        stop: &AtomicBool,
        done: &AtomicBool,
    ) {
        let slice = if rx.peer_same_kernel() {
            memloop::LIVENESS_SLICE
        } else {
            memloop::LIVENESS_SLICE_VM
        };
        while !stop.load(Relaxed) && !done.load(Relaxed) {
            match rx.wait(slice) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::debug!("link: ring → device ends: {e}");
                    return;
                }
            }
            match rx.drain_to_fd(dev.fd()) {
                Ok(Drained {
                    packets,
                    bytes,
                    bad,
                }) => self.count(&mut LinkCounters {
                    rx_packets: packets,
                    rx_bytes: bytes - packets * VNET_HDR_LEN as u64,
                    drops_bad: bad,
                    ..Default::default()
                }),
                Err(e) => {
                    tracing::debug!("link: ring → device ends: {e}");
                    return;
                }
            }
        }
    }
}

/// Stops this network namespace's side of the link (SIGTERM to its service, which takes the
/// carrier down and leaves the table), and waits until it is gone.
fn down(a: &DownArgs) -> CliResult<()> {
    let spec = service::region_spec(a.region.as_deref());
    let region = Region::open(&spec).context("opening the region")?;
    let links = region
        .registry()
        .links()
        .context("reading the links table")?;
    let here = service::netns_of("self");
    let pid = links
        .iter()
        .filter(|l| l.name == a.name)
        .flat_map(|l| l.halves.iter().flatten().map(|h| h.pid))
        .filter(|pid| *pid != 0)
        .filter(|pid| service::netns_of(&pid.to_string()).is_some_and(|ns| Some(ns) == here))
        .find(|pid| serves_link(*pid, &a.name))
        .ok_or_else(|| {
            fail(format!(
                "no side of link {} runs in this network namespace",
                a.name
            ))
        })?;
    service::terminate(pid, "link", Duration::from_secs(10))
}

/// Process `pid` is a link service for `link` (`memloop link up NAME --foreground`, or the
/// benchmark's `memloop-bench link-service up …`).
fn serves_link(pid: u32, link: &str) -> bool {
    let args = service::cmdline(pid);
    let has = |w: &str| args.iter().any(|a| a == w);
    (has("link") || has("link-service")) && has("up") && has(link) && has("--foreground")
}

// ---- `memloop status`: the links table ----

fn cidr<A: std::fmt::Display>(a: &Option<(A, u8)>) -> serde_json::Value {
    a.as_ref()
        .map_or(serde_json::Value::Null, |(a, p)| format!("{a}/{p}").into())
}

fn half_json(h: &memloop::registry::LinkHalf) -> serde_json::Value {
    let c = &h.counters;
    serde_json::json!({
        "member": format!("{}.{}", h.member.idx, h.member.gen),
        "pid": h.pid,
        "ifname": h.ifname,
        "carrier": h.carrier,
        "mtu": h.mtu,
        "ipv4": cidr(&h.ipv4),
        "ipv6": cidr(&h.ipv6),
        "offloads": tun::offload_names(h.offloads),
        "counters": {
            "tx_packets": c.tx_packets, "tx_bytes": c.tx_bytes,
            "rx_packets": c.rx_packets, "rx_bytes": c.rx_bytes,
            "drops_full": c.drops_full, "drops_bad": c.drops_bad, "restarts": c.restarts,
        },
    })
}

/// The region's links for `status --json`: name and both halves (null: nobody holds it).
pub fn links_json(reg: &memloop::registry::Registry) -> serde_json::Value {
    let links = reg.links().unwrap_or_default();
    links
        .iter()
        .map(|l| {
            serde_json::json!({
                "name": l.name,
                "halves": l.halves.iter().map(|h| h.as_ref().map_or(serde_json::Value::Null, half_json)).collect::<Vec<_>>(),
            })
        })
        .collect::<Vec<_>>()
        .into()
}

/// The columns of [`links_rows`].
pub const LINK_COLUMNS: [&str; 11] = [
    "name",
    "half",
    "pid",
    "device",
    "ipv4",
    "carrier",
    "tx pkts/bytes",
    "rx pkts/bytes",
    "drops full/bad",
    "sessions",
    "offloads",
];

/// The links as status text rows, a row per half (empty without links).
pub fn links_rows(reg: &memloop::registry::Registry) -> Vec<Vec<String>> {
    let links = reg.links().unwrap_or_default();
    let mut rows = Vec::new();
    for l in &links {
        for (i, h) in l.halves.iter().enumerate() {
            let Some(h) = h else {
                let mut r = vec![
                    l.name.clone(),
                    i.to_string(),
                    "-".into(),
                    "(no side)".into(),
                ];
                r.resize(LINK_COLUMNS.len(), "-".into());
                rows.push(r);
                continue;
            };
            let c = &h.counters;
            let addr = cidr(&h.ipv4).as_str().unwrap_or("-").to_string();
            rows.push(vec![
                l.name.clone(),
                i.to_string(),
                h.pid.to_string(),
                h.ifname.clone(),
                addr,
                if h.carrier { "up" } else { "down" }.into(),
                format!("{}/{}", c.tx_packets, crate::units::fmt_size(c.tx_bytes)),
                format!("{}/{}", c.rx_packets, crate::units::fmt_size(c.rx_bytes)),
                format!("{}/{}", c.drops_full, c.drops_bad),
                c.restarts.to_string(),
                tun::offload_names(h.offloads).join(","),
            ]);
        }
    }
    rows
}
