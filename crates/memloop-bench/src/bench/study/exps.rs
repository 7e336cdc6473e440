//! The experiments: what each runs, how many measurements it takes (for the progress bar), and
//! its figure.

use super::lab::{Kind, Lab, Meas, Opts, Pair};
use super::plot::{Figure, Series, XAxis};
use super::Rec;
use crate::bench::tcp::procs::Proc;
use crate::bench::tcp::wire::{Reply, Request, Test};
use crate::error::{fail, CliResult};
use crate::units::fmt_size;
use indicatif::ProgressBar;
use memloop::{Listener, Node, Region, RegionSpec};
use std::time::Duration;

pub struct Exp {
    pub id: u32,
    pub slug: &'static str,
    pub title: &'static str,
    pub about: &'static str,
    pub steps: fn(&Lab) -> u64,
    pub run: fn(&mut Lab, &ProgressBar, &mut Vec<Rec>) -> CliResult<()>,
    pub figures: fn(&[Rec]) -> Vec<Figure>,
}

/// Experiment 9 (computed from the others' records, after them).
pub const SEEDS: (u32, &str, &str) = (
    9,
    "The seeds side by side (papers' ratios vs ours)",
    "The seed papers' published ratios (only numbers they state; table ids quoted) next to the \
     same ratio of our paths from this run (experiments 1, 3 and 8). Each row says what differs \
     in the setting.",
);

pub const ALL: [Exp; 14] = [
    Exp {
        id: 1,
        slug: "sizes",
        title: "Message size sweep",
        about: "Stream throughput (Nagle on) and request/response rate (TCP_NODELAY) of one \
                connection, per message size, on each path.",
        steps: |l| ((sizes(l).len() * 2 + udp_sizes(l).len() * 2) * Kind::MAIN.len()) as u64,
        run: exp1,
        figures: fig1,
    },
    Exp {
        id: 7,
        slug: "connections",
        title: "Connection setup rate",
        about: "Short connections one after the other: connect, 1-byte request and response, \
                the server closes.",
        steps: |_| Kind::MAIN.len() as u64,
        run: exp7,
        figures: fig7,
    },
    Exp {
        id: 6,
        slug: "cpu-cost",
        title: "CPU cost per byte and per transaction",
        about: "CPU time both ends spent (each process's own accounting, utime + stime in \
                /proc/PID/stat, as getrusage reports it; 10 ms ticks, runs of at least 0.5 s) \
                divided by the bytes \
                streamed (64 KB messages), the 64-byte round trips (back to back, and with the \
                client pausing 1 ms before each: the server sleeps), or the short connections \
                made.",
        steps: |_| (Kind::MAIN.len() * 4) as u64,
        run: exp6,
        figures: fig6,
    },
    Exp {
        id: 5,
        slug: "ring-size",
        title: "Ring size sweep (memloop)",
        about: "MEMLOOP_RING_BYTES, the preload's ring size per direction, set in both ends; \
                stream of 64 KB messages and 1 KB request/response across the two domains.",
        steps: |l| (rings(l).len() * 2) as u64,
        run: exp5,
        figures: fig5,
    },
    Exp {
        id: 3,
        slug: "remote-cost",
        title: "Cost of interception on remote traffic",
        about: "veth+bridge with and without the preload loaded in both ends (ends in different \
                regions, so no ring: the traffic stays on TCP). Each preloaded run sits between \
                two plain runs and is compared with their mean. Then the same with 1, 100 and \
                10 000 endpoints registered in the client's region.",
        steps: |l| (remote_sizes(l).len() * 2 * 3 + 3 + ENDPOINTS.len() * 2 * 3) as u64,
        run: exp3,
        figures: fig3,
    },
    Exp {
        id: 4,
        slug: "placement",
        title: "Core placement",
        about: "Both ends pinned to one core vs to separate cores: 64-byte request/response \
                (TCP and UDP) and a stream of 16 KB messages, with the CPU utilisation of each \
                end.",
        steps: |_| (Kind::MAIN.len() * 2 * 3) as u64,
        run: exp4,
        figures: fig4,
    },
    Exp {
        id: 2,
        slug: "mixes",
        title: "Mixed local:remote workloads",
        about: "Five concurrent streams of 1 KB messages from domain 1 to domain 0. With \
                memloop: a local flow's ends share a region (ring), a remote flow's server is \
                in another region (a domain outside ours: TCP). Without memloop: all five on \
                veth+bridge. Aggregate throughput per remote:local mix (all flows' bytes over the \
                time from the end of the warm-up to the last flow's end). Ends not pinned.",
        steps: |_| (MIXES * 2) as u64,
        run: exp2,
        figures: fig2,
    },
    Exp {
        id: 11,
        slug: "oversubscribed",
        title: "Oversubscribed: more request/response flows than CPUs",
        about: "Four times as many 64-byte request/response flows as CPUs at once (one client \
                process per flow, domain 1 to domain 0 — or over 127.0.0.1 and a Unix socket — \
                one server thread per flow), ends not pinned: waiters compete with the peers \
                they wait for, so every exchange pays a wake-up. Aggregate transactions/s.",
        steps: |_| Kind::MAIN.len() as u64,
        run: exp11,
        figures: fig11,
    },
    Exp {
        id: 12,
        slug: "concurrency",
        title: "Concurrent connections",
        about: "One client process in domain 1 holds N connections at once to a server in \
                domain 0, one 64-byte request in flight on each, epoll at both ends (the \
                server serves them all from one epoll thread, as an event-loop server does). \
                Aggregate transactions/s per path, and on memloop the share of the N \
                connections on a ring (the most ring channels live in the region during the \
                run, over N). Ends pinned as usual.",
        steps: |l| (fan_counts(l).len() * FAN_KINDS.len()) as u64,
        run: exp12,
        figures: fig12,
    },
    Exp {
        id: 8,
        slug: "programs",
        title: "Real programs (redis-benchmark, pgbench, nginx with ab)",
        about: "Unmodified Debian programs, unpinned, on three paths: memloop (server in domain \
                0, client in domain 1, both under `memloop run`), veth+bridge (the same domains, \
                no preload) and monolithic (both ends in domain 0 over 127.0.0.1, no preload). \
                redis-benchmark `-t set,get -c 8` against redis-server; pgbench `-c 4 -j 2` \
                (TPC-B-like, scale 1, fsync off) against PostgreSQL running as user postgres; \
                ab `-k -c 8` fetching a 1 KB file from nginx (2 workers). Ratios: memloop over \
                veth+bridge and over monolithic.",
        steps: super::progs::steps,
        run: super::progs::exp8,
        figures: fig8,
    },
    Exp {
        id: 10,
        slug: "vms",
        title: "Virtual machines (two QEMU guests and the host on one ivshmem region)",
        about: "Two guests under software emulation (TCG, 1 vCPU each) and the host share one \
                ivshmem region and a virtio-net bridge; the repository's VM test \
                (`tests/vm/memloop.sh`, which also checks transfers and a power-off) measures \
                64 B round trips (median) and 64 KB streams from guest b to guest a and to the \
                host: memloop's native API, the transparent ring (`memloop run`), virtio-net, \
                and a preloaded client against a server outside the region. Not in --quick.",
        steps: |_| 1,
        run: super::vms::exp10,
        figures: super::vms::fig10,
    },
    Exp {
        id: super::vpipe::ID,
        slug: "pipe",
        title: "The pipe service (vPipe): relay, fairness, static-file server",
        about: "`memloop bench pipe` in the host's network (127.0.0.1), the service a `memloop \
                pipe serve` process. A socket → socket relay of 1 GiB (128 MiB with --quick) \
                from a source process to a sink process, ends that copy nothing (sendfile of \
                a RAM file in, splice to /dev/null out; a pass before it checks every byte): \
                a user-space copy loop (256 KiB) vs both sockets handed to the service, and \
                splice in the relay itself for reference; the relay and its service on one \
                CPU, the ends on the other; GB/s and CPU per byte of the relay and the \
                service. Fairness: one worker, tenants of weights 1:2:4 each moving /dev/zero \
                → /dev/null, byte shares over a window (the service's statistics) and Jain's \
                index of the weight-normalised shares (target ≥ 0.95), then 1:2 after the \
                heaviest stops. A static-file server (lighttpd, else nginx; sendfile on) \
                sending 1, 16 and 64 MiB files from RAM to a keep-alive client on the other \
                CPU: its own sendfile vs under `memloop run` with MEMLOOP_PIPE_SENDFILE=1 and \
                the service (unpinned) on the region's socket, which must show the server's \
                bytes (else \"not routed\", and no figure); throughput and the server's CPU \
                per byte.",
        steps: super::vpipe::steps,
        run: super::vpipe::exp13,
        figures: super::vpipe::fig13,
    },
    Exp {
        id: super::vlink::ID,
        slug: "link",
        title: "A network link over shared memory (MMNet) for traffic the library cannot see",
        about: "`memloop bench link`: two domains of its own, a link service (`memloop link \
                up`, a TUN device with the virtio-net header, checksum/TSO offloads, MTU \
                65535) in each on one region, against the veth+bridge between the same \
                domains; nothing preloaded, so this is what any traffic sees, including what \
                the library cannot intercept. One TCP flow (iperf3 -t 5 -O 1; -t 1 with \
                --quick) from domain 0 to domain 1, Gbit/s as received; 64-byte TCP round \
                trips back to back on one connection for 5 s (0.3 s with --quick) between the \
                ordinary socket ends of experiments 1-7 (mean and p99); ping -c 200 -i 0.01 (50 with --quick), \
                average RTT; then, nothing sent, the CPU of both link services over 5 s (1 s \
                with --quick), % of one CPU. A link figure counts only if the link's counters \
                (the links table of `memloop status --json`) grew by at least its traffic, \
                else the experiment fails (\"not routed\"). Ratios link / veth+bridge against \
                the issue's targets: stream ≥ 2×, round trip ≤ 0.7×, idle < 1 %. Processes \
                not pinned.",
        steps: super::vlink::steps,
        run: super::vlink::exp14,
        figures: super::vlink::fig14,
    },
    Exp {
        id: super::vblk::ID,
        slug: "blk",
        title: "A block device over shared memory (MMBlk) vs NBD over TCP and a local file",
        about: "`memloop bench blk`: two domains of its own, storage in domain 0, the client in \
                domain 1, backing files in /dev/shm (256 MiB; 64 MiB with --quick). Three \
                paths, each a loop device with direct I/O in domain 1: `memloop blk export` / \
                `attach` (a loop device on its FUSE file, the data through the region); NBD \
                over TCP (nbdkit's file plugin in domain 0 on the bridge, nbdfuse and a loop \
                device in domain 1: the same shape, another transport); a loop device on a \
                local file (the ceiling). fio --ioengine=libaio --direct=1 for 5 s (1 s with \
                --quick): 4 KiB random read and write at queue depth 32 (IOPS), 1 MiB \
                sequential read and write at queue depth 8 (MiB/s); --quick runs only the \
                random read and the sequential write. A memloop figure counts only if the \
                export's counters (its stats file, `memloop status --json`'s \"blk\") grew \
                by at least the bytes fio moved, else the experiment fails (\"not routed\"). \
                Ratios memloop / NBD (target ≥ 2×) and memloop / local file (target ≥ 0.5×); \
                the export's bytes copied per byte moved. Processes not pinned.",
        steps: super::vblk::steps,
        run: super::vblk::exp15,
        figures: super::vblk::fig15,
    },
];

fn fig8(r: &[Rec]) -> Vec<Figure> {
    // One panel per program (their rates differ by orders of magnitude), then the ratios.
    let mut v: Vec<Figure> = [
        (
            "redis",
            "8. redis-benchmark (SET, GET; 8 connections)",
            "requests/s",
        ),
        (
            "pgbench",
            "8. pgbench (TPC-B-like, 4 clients)",
            "transactions/s",
        ),
        (
            "nginx",
            "8. nginx, ab fetching 1 KB (keep-alive, 8 connections)",
            "requests/s",
        ),
    ]
    .into_iter()
    .filter(|(p, _, _)| r.iter().any(|x| x.test.starts_with(p)))
    .map(|(p, title, unit)| {
        bars(
            title,
            unit,
            r,
            move |x| x.unit != "ratio" && x.test.starts_with(p),
            |x| x.test.clone(),
            |x| x.path.clone(),
        )
    })
    .collect();
    v.push(bars(
        "8. Real programs: memloop relative to the other paths",
        "ratio",
        r,
        |x| x.unit == "ratio",
        |x| x.test.clone(),
        |x| x.path.clone(),
    ));
    v
}

/// Experiment 9's figure: the paper's ratio and ours per row.
pub fn fig9(r: &[Rec]) -> Vec<Figure> {
    vec![bars(
        "9. The seeds' ratios and ours",
        "ratio",
        r,
        |_| true,
        |x| x.test.split(':').next().unwrap_or_default().to_owned(),
        |x| x.variant.clone().unwrap_or_default(),
    )]
}

const KB: usize = 1024;
const ENDPOINTS: [usize; 3] = [1, 100, 10_000];
const MIXES: usize = 6;
const FLOWS: usize = 5;

fn sizes(l: &Lab) -> Vec<usize> {
    if l.quick {
        vec![64, KB, 64 * KB]
    } else {
        vec![64, 256, KB, 4 * KB, 16 * KB, 64 * KB]
    }
}

/// UDP's sizes (a datagram carries at most 65,507 bytes).
fn udp_sizes(l: &Lab) -> Vec<usize> {
    if l.quick {
        vec![64, KB]
    } else {
        vec![64, 256, KB, 4 * KB, 16 * KB]
    }
}

fn rings(l: &Lab) -> Vec<usize> {
    if l.quick {
        vec![4 * KB, 64 * KB, 1 << 20]
    } else {
        vec![4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 << 20, 4 << 20]
    }
}

fn remote_sizes(l: &Lab) -> Vec<usize> {
    if l.quick {
        vec![4, KB, 64 * KB]
    } else {
        vec![4, 64, 256, KB, 4 * KB, 16 * KB, 64 * KB]
    }
}

/// Starts a pair; a preloaded path that cannot start is disabled (and reported), a kernel path
/// that cannot start is an error.
fn start(l: &mut Lab, kind: Kind, o: &Opts) -> CliResult<Option<Pair>> {
    if !l.usable(kind) {
        return Ok(None);
    }
    match l.pair(kind, o) {
        Ok(p) => Ok(Some(p)),
        Err(e) if matches!(kind, Kind::Memloop | Kind::VethPreload) => {
            l.disable(kind, format!("failed to start: {e}"));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// A measurement; on a preloaded path a failure is noted and skipped.
fn try_measure(
    l: &mut Lab,
    exp: u32,
    p: &mut Pair,
    test: Test,
    size: usize,
    cold: bool,
) -> CliResult<Option<Meas>> {
    match l.measure(p, test, size, cold) {
        Ok(m) => Ok(Some(m)),
        Err(e) if matches!(p.kind, Kind::Memloop | Kind::VethPreload) => {
            l.notes
                .push((p.kind.name(), format!("experiment {exp}: {e}")));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------------------------
// 1: sizes.

fn exp1(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let sizes = sizes(l);
    for kind in Kind::MAIN {
        let Some(mut p) = start(l, kind, &Opts::default())? else {
            bar.inc((sizes.len() * 2) as u64);
            continue;
        };
        for &s in &sizes {
            bar.set_message(format!(
                "1. sizes: {} over {}",
                fmt_size(s as u64),
                kind.name()
            ));
            if let Some(m) = try_measure(l, 1, &mut p, Test::Rr, s, false)? {
                out.push(Rec::new(
                    1,
                    "rr",
                    kind.name(),
                    s as u64,
                    "transactions/s",
                    m.rate(),
                ));
            }
            bar.inc(1);
            if let Some(m) = try_measure(l, 1, &mut p, Test::Stream, s, false)? {
                out.push(Rec::new(
                    1,
                    "stream",
                    kind.name(),
                    s as u64,
                    "Gbit/s",
                    m.gbit(),
                ));
            }
            bar.inc(1);
        }
        exp1_udp(l, &mut p, kind, bar, out)?;
    }
    Ok(())
}

/// The study's UDP rows: request/response and a stream (datagrams delivered) by size; not
/// over Unix sockets.
fn exp1_udp(
    l: &mut Lab,
    p: &mut Pair,
    kind: Kind,
    bar: &ProgressBar,
    out: &mut Vec<Rec>,
) -> CliResult<()> {
    let sizes = udp_sizes(l);
    if kind == Kind::Unix {
        bar.inc((sizes.len() * 2) as u64);
        return Ok(());
    }
    for &s in &sizes {
        bar.set_message(format!(
            "1. UDP {} over {}",
            fmt_size(s as u64),
            kind.name()
        ));
        if let Some(m) = try_measure(l, 1, p, Test::UdpRr, s, false)? {
            let r = Rec::new(
                1,
                "udp-rr",
                kind.name(),
                s as u64,
                "transactions/s",
                m.rate(),
            );
            out.push(r);
        }
        bar.inc(1);
        if let Some(m) = try_measure(l, 1, p, Test::UdpStream, s, false)? {
            let name = kind.name();
            out.push(Rec::new(
                1,
                "udp-stream",
                name,
                s as u64,
                "Gbit/s",
                m.gbit(),
            ));
            out.push(Rec::new(1, "udp-stream", name, s as u64, "msg/s", m.rate()));
        }
        bar.inc(1);
    }
    Ok(())
}

/// Series per path (and variant) of the records of `test` in `unit`, x = size.
fn by_path(recs: &[Rec], test: &str, unit: &str) -> Vec<Series> {
    let mut v: Vec<Series> = Vec::new();
    for r in recs.iter().filter(|r| r.test == test && r.unit == unit) {
        let name = match &r.variant {
            Some(x) => format!("{} ({x})", r.path),
            None => r.path.clone(),
        };
        match v.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((r.size as f64, r.value)),
            None => v.push(Series {
                name,
                points: vec![(r.size as f64, r.value)],
            }),
        }
    }
    v
}

fn sizes_fig(title: &str, y: &str, series: Vec<Series>) -> Figure {
    Figure {
        title: title.into(),
        x: XAxis::Bytes,
        x_label: "message size".into(),
        y_label: y.into(),
        series,
    }
}

fn fig1(r: &[Rec]) -> Vec<Figure> {
    vec![
        sizes_fig(
            "1. Stream throughput by message size",
            "Gbit/s",
            by_path(r, "stream", "Gbit/s"),
        ),
        sizes_fig(
            "1. Request/response rate by message size",
            "transactions/s",
            by_path(r, "rr", "transactions/s"),
        ),
        sizes_fig(
            "1. UDP request/response rate by datagram size",
            "transactions/s",
            by_path(r, "udp-rr", "transactions/s"),
        ),
        sizes_fig(
            "1. UDP stream: datagrams delivered, by size",
            "Gbit/s",
            by_path(r, "udp-stream", "Gbit/s"),
        ),
    ]
}

/// Bars: categories in order of first appearance of `cat(r)`, one series per `ser(r)`.
pub(super) fn bars(
    title: &str,
    y: &str,
    recs: &[Rec],
    keep: impl Fn(&Rec) -> bool,
    cat: impl Fn(&Rec) -> String,
    ser: impl Fn(&Rec) -> String,
) -> Figure {
    let mut cats: Vec<String> = Vec::new();
    let mut series: Vec<Series> = Vec::new();
    for r in recs.iter().filter(|r| keep(r)) {
        let c = cat(r);
        let i = cats.iter().position(|x| *x == c).unwrap_or_else(|| {
            cats.push(c);
            cats.len() - 1
        });
        let s = ser(r);
        match series.iter_mut().find(|x| x.name == s) {
            Some(x) => x.points.push((i as f64, r.value)),
            None => series.push(Series {
                name: s,
                points: vec![(i as f64, r.value)],
            }),
        }
    }
    Figure {
        title: title.into(),
        x: XAxis::Categories(cats),
        x_label: String::new(),
        y_label: y.into(),
        series,
    }
}

// ---------------------------------------------------------------------------------------------
// 7: connection setup.

fn exp7(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    for kind in Kind::MAIN {
        bar.set_message(format!("7. short connections over {}", kind.name()));
        if let Some(mut p) = start(l, kind, &Opts::default())? {
            if let Some(m) = try_measure(l, 7, &mut p, Test::Crr, 1, false)? {
                let mut r = Rec::new(7, "crr", kind.name(), 1, "connections/s", m.rate());
                r.note = m.reply.phases_p50_ns.map(|[c, x, e]| {
                    format!(
                        "p50 per phase: connect {:.1} µs, request/response {:.1} µs, close {:.1} µs",
                        c / 1e3,
                        x / 1e3,
                        e / 1e3
                    )
                });
                out.push(r);
            }
        }
        bar.inc(1);
    }
    Ok(())
}

fn fig7(r: &[Rec]) -> Vec<Figure> {
    vec![bars(
        "7. Connection setup rate (connect, 1-byte request/response, close)",
        "connections/s",
        r,
        |_| true,
        |r| r.path.clone(),
        |_| "short connections".into(),
    )]
}

// ---------------------------------------------------------------------------------------------
// 6: CPU cost.

fn exp6(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    for kind in Kind::MAIN {
        let Some(mut p) = start(l, kind, &Opts::default())? else {
            bar.inc(3);
            continue;
        };
        let name = kind.name();
        bar.set_message(format!("6. CPU cost over {name}"));
        let cases = [
            (Test::Stream, 64 * KB, "stream", "CPU ns/KB"),
            (Test::Rr, 64, "rr", "CPU µs/transaction"),
            (Test::SleepRr, 64, "sleep-rr", "CPU µs/transaction"),
            (Test::Crr, 1, "crr", "CPU µs/connection"),
        ];
        for (test, size, label, unit) in cases {
            if let Some(m) = try_measure(l, 6, &mut p, test, size, true)? {
                let per = |cpu: f64| match test {
                    Test::Stream => cpu * 1e9 / (m.reply.bytes as f64 / 1024.0),
                    _ => cpu * 1e6 / m.reply.count as f64,
                };
                let (c, s) = (per(m.cpu_client), per(m.cpu_server));
                // Runs are cold (no warm-up), so the CPU time covers what was counted, except
                // for the first batch of a stream: the stream figure slightly overstates.
                if c + s > 0.0 {
                    out.push(
                        Rec::new(6, label, name, size as u64, unit, c + s).variant("both ends"),
                    );
                }
                for (end, v) in [("client", c), ("server", s)] {
                    if v > 0.0 {
                        out.push(Rec::new(6, label, name, size as u64, unit, v).variant(end));
                    }
                }
            }
            bar.inc(1);
        }
    }
    Ok(())
}

fn fig6(r: &[Rec]) -> Vec<Figure> {
    let both = |r: &Rec| r.variant.as_deref() == Some("both ends");
    let panel = |test: &'static str, title: &str, unit: &str| {
        bars(
            title,
            unit,
            r,
            move |x| x.test == test && !both(x),
            |x| x.path.clone(),
            |x| x.variant.clone().unwrap_or_default(),
        )
    };
    vec![
        panel(
            "stream",
            "6. CPU per KB streamed (64 KB messages), each end",
            "CPU ns/KB",
        ),
        panel(
            "rr",
            "6. CPU per 64-byte transaction, each end",
            "CPU µs/transaction",
        ),
        panel(
            "sleep-rr",
            "6. CPU per 64-byte transaction, client pausing 1 ms, each end",
            "CPU µs/transaction",
        ),
        panel(
            "crr",
            "6. CPU per short connection, each end",
            "CPU µs/connection",
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// 5: ring sizes.

fn exp5(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    for ring in rings(l) {
        bar.set_message(format!("5. ring {} per direction", fmt_size(ring as u64)));
        let o = Opts {
            env: vec![("MEMLOOP_RING_BYTES".into(), ring.to_string())],
            ..Opts::default()
        };
        let Some(mut p) = start(l, Kind::Memloop, &o)? else {
            bar.inc(2);
            continue;
        };
        if let Some(m) = try_measure(l, 5, &mut p, Test::Stream, 64 * KB, false)? {
            out.push(
                Rec::new(5, "stream", "memloop", ring as u64, "Gbit/s", m.gbit())
                    .variant("64 KB messages"),
            );
        }
        bar.inc(1);
        if let Some(m) = try_measure(l, 5, &mut p, Test::Rr, KB, false)? {
            out.push(
                Rec::new(5, "rr", "memloop", ring as u64, "transactions/s", m.rate())
                    .variant("1 KB messages"),
            );
        }
        bar.inc(1);
    }
    Ok(())
}

fn fig5(r: &[Rec]) -> Vec<Figure> {
    let mut v = vec![
        sizes_fig(
            "5. memloop stream throughput by ring size",
            "Gbit/s",
            by_path(r, "stream", "Gbit/s"),
        ),
        sizes_fig(
            "5. memloop request/response rate by ring size",
            "transactions/s",
            by_path(r, "rr", "transactions/s"),
        ),
    ];
    for f in &mut v {
        f.x_label = "ring size per direction (MEMLOOP_RING_BYTES)".into();
    }
    v
}

// ---------------------------------------------------------------------------------------------
// 3: remote cost.

/// veth / veth+preload / veth on the same test; records the preloaded run against the mean of
/// the plain ones.
#[allow(clippy::too_many_arguments)]
fn aba(
    l: &mut Lab,
    plain: &mut Pair,
    pre: &mut Pair,
    test: Test,
    size: usize,
    variant: Option<String>,
    bar: &ProgressBar,
    out: &mut Vec<Rec>,
) -> CliResult<()> {
    let figure = |m: &Meas| match test {
        Test::Stream => m.gbit(),
        _ => m.rate(),
    };
    let (label, unit) = match test {
        Test::Stream => ("stream", "Gbit/s"),
        Test::Crr => ("crr", "connections/s"),
        Test::UdpRr => ("udp-rr", "transactions/s"),
        _ => ("rr", "transactions/s"),
    };
    let a1 = figure(&l.measure(plain, test, size, false)?);
    bar.inc(1);
    let b = try_measure(l, 3, pre, test, size, false)?.map(|m| figure(&m));
    bar.inc(1);
    let a2 = figure(&l.measure(plain, test, size, false)?);
    bar.inc(1);
    let Some(b) = b else { return Ok(()) };
    let a = (a1 + a2) / 2.0;
    let with = |r: Rec| match &variant {
        Some(v) => r.variant(v.clone()),
        None => r,
    };
    out.push(with(Rec::new(
        3,
        label,
        "veth+bridge",
        size as u64,
        unit,
        a,
    )));
    let mut r = with(Rec::new(3, label, "veth+preload", size as u64, unit, b));
    r.change_pct = Some((b / a - 1.0) * 100.0);
    r.note = Some(format!(
        "{:+.1}% against the mean of the plain runs around it ({a1:.4} and {a2:.4}; their \
         difference, the noise: {:.1}%)",
        (b / a - 1.0) * 100.0,
        ((a2 / a1) - 1.0).abs() * 100.0
    ));
    out.push(r);
    out.push(with(Rec::new(
        3,
        label,
        "veth+preload",
        size as u64,
        "preloaded/plain",
        b / a,
    )));
    Ok(())
}

fn exp3(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let sizes = remote_sizes(l);
    let skip = (sizes.len() * 6 + 3 + ENDPOINTS.len() * 6) as u64;
    let Some(mut plain) = start(l, Kind::Veth, &Opts::default())? else {
        bar.inc(skip);
        return Ok(());
    };
    let Some(mut pre) = start(l, Kind::VethPreload, &Opts::default())? else {
        bar.inc(skip);
        return Ok(());
    };
    for &s in &sizes {
        for test in [Test::Rr, Test::Stream] {
            bar.set_message(format!("3. remote cost {}", fmt_size(s as u64)));
            aba(l, &mut plain, &mut pre, test, s, None, bar, out)?;
        }
    }
    // UDP to a non-member (DNS-like: 64-byte request/response).
    bar.set_message("3. remote cost, UDP 64 B");
    aba(l, &mut plain, &mut pre, Test::UdpRr, 64, None, bar, out)?;
    drop(pre);
    // The endpoint-count variant: the client's region holds N endpoints (held by a member in
    // this process) when the preloaded client connects.
    let wide = Region::open(&RegionSpec::parse(&l.wide))
        .map_err(|e| fail(format!("opening region {}: {e}", l.wide)))?;
    let node = Node::join(wide, "study-endpoints")
        .map_err(|e| fail(format!("joining region {}: {e}", l.wide)))?;
    let mut held: Vec<Listener> = Vec::new();
    for n in ENDPOINTS {
        bar.set_message(format!("3. remote cost with {n} endpoints"));
        while held.len() < n {
            let name = format!("study-dummy-{}", held.len());
            held.push(
                Listener::bind(&node, &name)
                    .map_err(|e| fail(format!("registering endpoint {name}: {e}")))?,
            );
        }
        let o = Opts {
            client_region: Some(l.wide.clone()),
            ..Opts::default()
        };
        let Some(mut pre) = start(l, Kind::VethPreload, &o)? else {
            bar.inc(6);
            continue;
        };
        let v = Some(format!("{n} endpoints"));
        aba(l, &mut plain, &mut pre, Test::Rr, 64, v.clone(), bar, out)?;
        aba(l, &mut plain, &mut pre, Test::Crr, 1, v, bar, out)?;
    }
    Ok(())
}

fn fig3(r: &[Rec]) -> Vec<Figure> {
    let ratio = |x: &Rec| x.unit == "preloaded/plain";
    let sized: Vec<Rec> = r
        .iter()
        .filter(|x| ratio(x) && x.variant.is_none())
        .cloned()
        .collect();
    let mut series = by_path(&sized, "rr", "preloaded/plain");
    series.extend(by_path(&sized, "stream", "preloaded/plain"));
    let names = ["transactions/s", "throughput"];
    for (s, n) in series.iter_mut().zip(names) {
        s.name = format!("{n}, preloaded / plain");
    }
    vec![
        sizes_fig(
            "3. Remote traffic with the preload loaded, relative to without (1 = no cost)",
            "preloaded / plain",
            series,
        ),
        bars(
            "3. Relative rate with N endpoints registered in the client's region",
            "preloaded / plain",
            r,
            |x| ratio(x) && x.variant.is_some(),
            |x| x.variant.clone().unwrap_or_default(),
            |x| match x.test.as_str() {
                "crr" => "short connections/s".into(),
                _ => "64 B transactions/s".into(),
            },
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// 4: placement.

fn exp4(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let placements: Vec<(&str, Option<(usize, usize)>)> = match l.cpus {
        Some((a, b)) => vec![
            ("same core", Some((a, a))),
            ("separate cores", Some((a, b))),
        ],
        None => vec![("unpinned", None)],
    };
    for kind in Kind::MAIN {
        for &(label, cpus) in &placements {
            let o = Opts {
                cpus,
                unpinned: cpus.is_none(),
                ..Opts::default()
            };
            let Some(mut p) = start(l, kind, &o)? else {
                bar.inc(3);
                continue;
            };
            bar.set_message(format!("4. {label} over {}", kind.name()));
            for (test, size, name, unit) in [
                (Test::Rr, 64, "rr", "transactions/s"),
                (Test::UdpRr, 64, "udp-rr", "transactions/s"),
                (Test::Stream, 16 * KB, "stream", "Gbit/s"),
            ] {
                if test == Test::UdpRr && kind == Kind::Unix {
                    bar.inc(1); // (no UDP over Unix sockets)
                    continue;
                }
                if let Some(m) = try_measure(l, 4, &mut p, test, size, false)? {
                    let v = match test {
                        Test::Stream => m.gbit(),
                        _ => m.rate(),
                    };
                    let (c, s) = m.util();
                    out.push(Rec::new(4, name, kind.name(), size as u64, unit, v).variant(label));
                    for (end, u) in [("client", c), ("server", s)] {
                        if u > 0.0 {
                            out.push(
                                Rec::new(4, name, kind.name(), size as u64, "cpu%", u)
                                    .variant(format!("{label}, {end}")),
                            );
                        }
                    }
                }
                bar.inc(1);
            }
        }
    }
    Ok(())
}

fn fig4(r: &[Rec]) -> Vec<Figure> {
    let panel = |test: &'static str, unit: &'static str, title: &str| {
        bars(
            title,
            unit,
            r,
            move |x| x.test == test && x.unit == unit,
            |x| x.path.clone(),
            |x| x.variant.clone().unwrap_or_default(),
        )
    };
    vec![
        panel(
            "rr",
            "transactions/s",
            "4. 64-byte request/response: both ends on one core vs on two",
        ),
        panel(
            "udp-rr",
            "transactions/s",
            "4. 64-byte UDP request/response: both ends on one core vs on two",
        ),
        panel(
            "stream",
            "Gbit/s",
            "4. Stream of 16 KB messages: both ends on one core vs on two",
        ),
        panel(
            "rr",
            "cpu%",
            "4. CPU utilisation of each end during request/response (% of a CPU)",
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// 2: mixes.

/// Sends `req` to every client at once; the sum of `amount` over their replies (each checked
/// non-empty), and the window from the end of the warm-up to the last reply (the flows' own
/// windows need not coincide, so summing their rates could count the same second twice).
fn concurrent_sum(
    l: &Lab,
    clients: &mut [&mut Proc],
    req: &Request,
    amount: fn(&Reply) -> u64,
) -> CliResult<(u64, f64)> {
    let timeout = l.dur + l.warmup + Duration::from_secs(30);
    let t0 = std::time::Instant::now();
    let results: Vec<CliResult<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter_mut()
            .map(|c| {
                s.spawn(move || {
                    let r = c.ask(req, timeout)?;
                    if amount(&r) == 0 || r.elapsed_s <= 0.0 {
                        return Err(fail(format!("{}: empty measurement", c.what())));
                    }
                    Ok(amount(&r))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(fail("a flow panicked"))))
            .collect()
    });
    let window = t0.elapsed().saturating_sub(l.warmup).as_secs_f64();
    Ok((results.into_iter().sum::<CliResult<u64>>()?, window))
}

/// Runs a 1 KB stream on every client at once; the aggregate Gbit/s.
fn concurrent(l: &Lab, clients: &mut [&mut Proc]) -> CliResult<f64> {
    let req = l.request(Test::Stream, KB, l.dur, l.warmup);
    let (bytes, window) = concurrent_sum(l, clients, &req, |r| r.bytes)?;
    Ok(bytes as f64 * 8.0 / window / 1e9)
}

// ---------------------------------------------------------------------------------------------
// 11: oversubscribed.

/// Transactions per second of `clients` running 64-byte request/response flows at once.
fn concurrent_rr(l: &Lab, clients: &mut [&mut Proc]) -> CliResult<f64> {
    let req = l.request(Test::Rr, 64, l.dur, l.warmup);
    let (n, window) = concurrent_sum(l, clients, &req, |r| r.count)?;
    Ok(n as f64 / window)
}

fn exp11(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let o = Opts {
        unpinned: true,
        ..Opts::default()
    };
    let flows = 4 * std::thread::available_parallelism().map_or(2, |n| n.get());
    for kind in Kind::MAIN {
        bar.set_message(format!("11. {flows} flows over {}", kind.name()));
        if !l.usable(kind) {
            bar.inc(1);
            continue;
        }
        let run = |l: &mut Lab| -> CliResult<f64> {
            let (_server, addr) = l.server(kind, &o)?;
            let mut clients = (0..flows)
                .map(|_| l.client(kind, &addr, &o))
                .collect::<CliResult<Vec<_>>>()?;
            let mut all: Vec<&mut Proc> = clients.iter_mut().collect();
            concurrent_rr(l, &mut all)
        };
        match run(l) {
            Ok(v) => out.push(
                Rec::new(11, "rr", kind.name(), 64, "transactions/s", v)
                    .variant(format!("{flows} flows")),
            ),
            Err(e) if kind == Kind::Memloop => {
                l.notes.push(("memloop", format!("experiment 11: {e}")))
            }
            Err(e) => return Err(e),
        }
        bar.inc(1);
    }
    Ok(())
}

fn fig11(r: &[Rec]) -> Vec<Figure> {
    vec![bars(
        "11. Aggregate 64-byte transactions/s, 4 flows per CPU, ends not pinned",
        "transactions/s",
        r,
        |_| true,
        |x| x.variant.clone().unwrap_or_default(),
        |x| x.path.clone(),
    )]
}

// ---------------------------------------------------------------------------------------------
// 12: concurrent connections.

const FAN_KINDS: [Kind; 2] = [Kind::Memloop, Kind::Veth];

fn fan_counts(l: &Lab) -> Vec<usize> {
    match l.quick {
        true => vec![1, 100, 1000],
        false => vec![1, 100, 1000, 10_000],
    }
}

fn exp12(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let counts = fan_counts(l);
    for kind in FAN_KINDS {
        let Some(mut p) = start(l, kind, &Opts::default())? else {
            bar.inc(counts.len() as u64);
            continue;
        };
        for &n in &counts {
            bar.set_message(format!("12. {n} connections over {}", kind.name()));
            let mut req = l.request(Test::Fan, 64, l.dur.max(Duration::from_secs(1)), l.warmup);
            req.conns = n;
            let watch = (kind == Kind::Memloop).then(|| RingWatch::start(&l.near));
            // (Setting up 10 000 connections takes a few seconds on either path.)
            let r = super::lab::measure_req(&mut p, &req, Duration::from_secs(120));
            let on_ring = watch.map(RingWatch::most);
            match r {
                Ok(m) => {
                    let conns = format!("{n} conns");
                    let rate = m.rate();
                    let rec = Rec::new(12, "fan", kind.name(), 64, "transactions/s", rate);
                    out.push(rec.variant(conns.clone()));
                    if let Some(live) = on_ring {
                        let share = (live.min(n) as f64 / n as f64) * 100.0;
                        let rec = Rec::new(12, "on-ring", kind.name(), 64, "% of N", share);
                        out.push(rec.variant(conns));
                    }
                }
                Err(e) if kind == Kind::Memloop => l
                    .notes
                    .push(("memloop", format!("experiment 12, {n} connections: {e}"))),
                Err(e) => return Err(e),
            }
            bar.inc(1);
        }
    }
    Ok(())
}

/// Samples the number of live ring channels in a region until asked for the most seen.
struct RingWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    t: std::thread::JoinHandle<usize>,
}

impl RingWatch {
    fn start(region: &str) -> RingWatch {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, name) = (stop.clone(), region.to_owned());
        let t = std::thread::spawn(move || {
            let Ok(r) = Region::open(&RegionSpec::parse(&name)) else {
                return 0;
            };
            let mut most = 0;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(r.registry().channels().len());
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        });
        RingWatch { stop, t }
    }

    fn most(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.t.join().unwrap_or(0)
    }
}

fn fig12(r: &[Rec]) -> Vec<Figure> {
    [
        (
            "12. Aggregate 64-byte transactions/s, N connections at once (epoll)",
            "transactions/s",
            "fan",
        ),
        (
            "12. Share of the connections on a ring (memloop)",
            "% of N",
            "on-ring",
        ),
    ]
    .into_iter()
    .map(|(title, y, test)| {
        bars(
            title,
            y,
            r,
            |x| x.test == test,
            |x| x.variant.clone().unwrap_or_default(),
            |x| x.path.clone(),
        )
    })
    .collect()
}

fn exp2(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let o = Opts {
        unpinned: true,
        ..Opts::default()
    };
    let mix = |k: usize| format!("{k}:{} remote:local", FLOWS - k);
    // Without memloop: five flows over veth+bridge, whatever the mix.
    let (_server, addr) = l.server(Kind::Veth, &o)?;
    let mut plain = (0..FLOWS)
        .map(|_| l.client(Kind::Veth, &addr, &o))
        .collect::<CliResult<Vec<_>>>()?;
    for k in (0..=FLOWS).rev() {
        bar.set_message(format!("2. {} without memloop", mix(k)));
        let mut all: Vec<&mut Proc> = plain.iter_mut().collect();
        let g = concurrent(l, &mut all)?;
        out.push(Rec::new(2, "stream", "veth+bridge", KB as u64, "Gbit/s", g).variant(mix(k)));
        bar.inc(1);
    }
    drop(plain);
    // With memloop: local flows through the ring, remote ones to a server in another region.
    if !(l.usable(Kind::Memloop) && l.usable(Kind::VethPreload)) {
        bar.inc(MIXES as u64);
        return Ok(());
    }
    let started = (|| -> CliResult<_> {
        let (ls, la) = l.server(Kind::Memloop, &o)?;
        let (rs, ra) = l.server(Kind::VethPreload, &o)?;
        let local = (0..FLOWS)
            .map(|_| l.client(Kind::Memloop, &la, &o))
            .collect::<CliResult<Vec<_>>>()?;
        let remote = (0..FLOWS)
            .map(|_| l.client(Kind::VethPreload, &ra, &o))
            .collect::<CliResult<Vec<_>>>()?;
        Ok((ls, rs, local, remote))
    })();
    let (_ls, _rs, mut local, mut remote) = match started {
        Ok(x) => x,
        Err(e) => {
            l.notes
                .push(("memloop", format!("experiment 2: failed to start: {e}")));
            bar.inc(MIXES as u64);
            return Ok(());
        }
    };
    for k in (0..=FLOWS).rev() {
        bar.set_message(format!("2. {} with memloop", mix(k)));
        let mut all: Vec<&mut Proc> = remote.iter_mut().take(k).collect();
        all.extend(local.iter_mut().take(FLOWS - k));
        match concurrent(l, &mut all) {
            Ok(g) => {
                out.push(Rec::new(2, "stream", "memloop", KB as u64, "Gbit/s", g).variant(mix(k)))
            }
            Err(e) => l.notes.push(("memloop", format!("experiment 2: {e}"))),
        }
        bar.inc(1);
    }
    Ok(())
}

fn fig2(r: &[Rec]) -> Vec<Figure> {
    vec![bars(
        "2. Aggregate throughput of five 1 KB streams by remote:local mix",
        "Gbit/s",
        r,
        |_| true,
        |x| x.variant.clone().unwrap_or_default(),
        |x| match x.path.as_str() {
            "memloop" => "with memloop".into(),
            _ => "without memloop (veth+bridge)".into(),
        },
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_records() {
        let recs = vec![
            Rec::new(1, "stream", "unix", 64, "Gbit/s", 1.0),
            Rec::new(1, "stream", "unix", 1024, "Gbit/s", 2.0),
            Rec::new(1, "rr", "memloop", 64, "transactions/s", 3.0),
        ];
        let f = fig1(&recs);
        assert_eq!(f[0].series.len(), 1);
        assert_eq!(f[0].series[0].points.len(), 2);
        assert_eq!(f[1].series[0].name, "memloop");
        let f = fig7(&[Rec::new(7, "crr", "unix", 1, "connections/s", 5.0)]);
        assert!(matches!(&f[0].x, XAxis::Categories(c) if c == &["unix".to_string()]));
    }
}
