//! `memloop bench zerocopy`: zero-copy descriptors against memloop's copying streams, between
//! processes — one-way latency by size (payload untouched, and written by the sender and read
//! by the receiver), a three-stage pipeline of 1 MiB messages, and the copying stream's
//! message rate at 64 B.
//!
//! Every figure runs the two paths back to back in each round; the report gives medians of
//! the rounds and the ratio. The peers are this binary again (`zc-peer`, hidden), talking to
//! the driver over stdout lines.
//!
//! With the `iceoryx2` feature (scripts/bench-zerocopy.sh), iceoryx2's publish-subscribe with
//! loaned samples is a third path in the same arrangement: see [`iceoryx`].

use super::native::OwnedRegion;
use super::report::{self, Record};
use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use memloop::zerocopy::{Message, Pool, ZcListener, ZcPort};
use memloop::{Listener, Node, Region, RegionSpec, Stream};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ZC: &str = "memloop zero-copy";
const STREAM: &str = "memloop stream";
const IOX: &str = "iceoryx2";
/// memloop's zero-copy ports told never to sleep while a message is due — how the iceoryx2
/// receivers here wait (they spin, then yield, and never sleep): the like-for-like pair.
const ZC_POLL: &str = "memloop zero-copy polling";
/// The spin of [`ZC_POLL`] ports: longer than any wait of a run.
const POLL_SPIN: Duration = Duration::from_secs(30);
const PIPE_MSG: usize = 1 << 20;
/// Bytes a pipeline stage looks at (its "inspection"): a header.
const HEADER: usize = 64;
/// Buffers of each latency pool: an owner scans for returned buffers when its free list runs
/// dry, so a pool of N costs one scan per ~N loans.
const LAT_BUFFERS: u32 = 16;

#[cfg(feature = "iceoryx2")]
mod iceoryx;

#[derive(clap::Args)]
pub struct ZcArgs {
    /// Short measurements (0.2 s each, one round): a quick look or CI.
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to FILE ({test, path, size, unit, value} records).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seconds per measurement (default 1, or 0.2 with --quick).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Rounds; each figure is the median of its rounds (default 3, 1 with --quick).
    #[arg(long)]
    repeat: Option<usize>,
    /// Message sizes of the latency figures, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "64,4K,64K,1M,4M")]
    sizes: Vec<String>,
    /// Zero-copy ports spin this many µs before sleeping (`ZcPort::set_spin`; default: the
    /// library's ~50 µs, adaptive).
    #[arg(long, value_name = "US")]
    zc_spin_us: Option<u64>,
}

/// A peer role: `echo` (latency), `middle` and `sink` (pipeline), `drain` (stream rate).
#[derive(clap::Args)]
pub struct ZcPeerArgs {
    #[arg(long)]
    role: String,
    /// `zc`, `stream` or `iox` (iceoryx2).
    #[arg(long)]
    mode: String,
    /// The memloop region; for `iox`, the run's tag (which names its iceoryx2 files).
    #[arg(long)]
    region: String,
    /// The service this peer binds.
    #[arg(long)]
    svc: String,
    /// The service it connects to (middle).
    #[arg(long)]
    out: Option<String>,
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Read every byte received and write every byte sent (else only a sequence word).
    #[arg(long)]
    touch: bool,
    #[arg(long)]
    cpu: Option<usize>,
    /// See `memloop bench zerocopy --zc-spin-us`.
    #[arg(long)]
    zc_spin_us: Option<u64>,
}

pub(super) struct Cfg {
    pub(super) dur: Duration,
    repeat: usize,
    sizes: Vec<usize>,
    pub(super) cpus: Option<(usize, usize)>,
    zc_spin: Option<Duration>,
}

pub fn run(a: &ZcArgs) -> CliResult<()> {
    let secs = a.duration.unwrap_or(if a.quick { 0.2 } else { 1.0 });
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(fail(format!("--duration {secs}: out of range")));
    }
    let sizes = a
        .sizes
        .iter()
        .map(|s| parse_size(s).map(|v| v as usize))
        .collect::<CliResult<Vec<_>>>()?;
    if sizes.iter().any(|&s| !(8..=64 << 20).contains(&s)) {
        return Err(fail("--sizes: each from 8 bytes to 64 MiB"));
    }
    let cfg = Cfg {
        dur: Duration::from_secs_f64(secs),
        repeat: a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1),
        sizes,
        cpus: super::sys::two_cpus(),
        zc_spin: a.zc_spin_us.map(Duration::from_micros),
    };
    if let Some((mine, _)) = cfg.cpus {
        super::sys::pin_to(mine)?;
    }
    let owned = OwnedRegion::open(None)?;
    let node = Node::join(owned.region.clone(), "memloop-bench").context("joining")?;
    #[cfg(feature = "iceoryx2")]
    let iox = iceoryx::Run::new()?;
    let mut records = Vec::new();
    for round in 0..cfg.repeat {
        eprintln!("round {} of {}", round + 1, cfg.repeat);
        for &size in &cfg.sizes {
            for touch in [false, true] {
                records.push(latency_zc(&node, &owned.arg, size, touch, &cfg, ZC)?);
                records.push(latency_zc(&node, &owned.arg, size, touch, &cfg, ZC_POLL)?);
                records.push(latency_stream(&node, &owned.arg, size, touch, &cfg)?);
                #[cfg(feature = "iceoryx2")]
                records.push(iox.latency(size, touch, &cfg)?);
            }
        }
        records.extend(pipeline(&node, &owned.arg, "zc", &cfg)?);
        records.extend(pipeline(&node, &owned.arg, "stream", &cfg)?);
        #[cfg(feature = "iceoryx2")]
        records.extend(iox.pipeline(&cfg)?);
        records.push(stream_rate(&node, &owned.arg, &cfg)?);
    }
    let records = report::median_of_rounds(records);
    print(&records, &cfg);
    if let Some(f) = &a.json {
        report::write_json(&records, f)?;
        println!("wrote {}", f.display());
    }
    drop(node);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Peers.

/// A peer process, its stdout read line by line; killed if dropped unfinished.
pub(super) struct ZcPeer {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl ZcPeer {
    fn spawn(args: &[String]) -> CliResult<ZcPeer> {
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let mut child = Command::new(exe)
            .arg("zc-peer")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a zero-copy peer")?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        let mut p = ZcPeer { child, out };
        p.expect("ready")?;
        Ok(p)
    }

    fn line(&mut self) -> CliResult<String> {
        let mut l = String::new();
        self.out.read_line(&mut l).context("a peer's output")?;
        if l.is_empty() {
            return Err(fail("a zero-copy peer ended early"));
        }
        Ok(l.trim().to_string())
    }

    fn expect(&mut self, what: &str) -> CliResult<()> {
        let l = self.line()?;
        match l == what {
            true => Ok(()),
            false => Err(fail(format!(
                "zero-copy peer said {l:?}, expected {what:?}"
            ))),
        }
    }

    fn finish(mut self) -> CliResult<()> {
        drop(self.child.stdin.take());
        let st = self.child.wait()?;
        match st.success() {
            true => Ok(()),
            false => Err(fail(format!("a zero-copy peer failed: {st}"))),
        }
    }
}

impl Drop for ZcPeer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn peer_args(role: &str, mode: &str, region: &str, svc: &str, size: usize) -> Vec<String> {
    [
        "--role", role, "--mode", mode, "--region", region, "--svc", svc,
    ]
    .map(String::from)
    .into_iter()
    .chain(["--size".to_string(), size.to_string()])
    .collect()
}

fn unique(what: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("zc-{what}-{}-{n}", std::process::id())
}

pub fn run_peer(a: &ZcPeerArgs) -> CliResult<()> {
    super::pin_peer(a.cpu)?;
    if a.mode == "iox" {
        #[cfg(feature = "iceoryx2")]
        return iceoryx::run_peer(a);
        #[cfg(not(feature = "iceoryx2"))]
        return Err(fail(NOT_BUILT));
    }
    let region = Region::open(&RegionSpec::parse(&a.region)).context("opening the region")?;
    let node = Node::join(region, "memloop-bench-zc-peer").context("joining")?;
    match (a.role.as_str(), a.mode.as_str()) {
        ("echo", "zc") => echo_zc(&node, a),
        ("echo", "stream") => echo_stream(&node, a),
        ("middle", "zc") => middle_zc(&node, a),
        ("middle", "stream") => middle_stream(&node, a),
        ("sink", "zc") => sink_zc(&node, a),
        ("sink", "stream") => sink_stream(&node, a),
        ("drain", "stream") => drain_stream(&node, a),
        (r, m) => Err(fail(format!("unknown zero-copy peer role {r} / {m}"))),
    }
}

fn ready() {
    say("ready");
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}").and_then(|()| o.flush());
}

/// Sum of the bytes (so that reading them cannot be optimised away).
fn read_all(b: &[u8]) -> u64 {
    b.iter().map(|&x| x as u64).sum()
}

fn seq_of(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]))
}

fn stamp(b: &mut [u8], seq: u64, touch: bool) {
    if touch {
        b.fill(seq as u8);
    }
    b[..8].copy_from_slice(&seq.to_le_bytes());
}

/// Zero-copy echo: untouched, the received message goes back as it is (forwarded); touched,
/// every byte is read and a buffer of our own is written and sent back.
fn echo_zc(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let pool = Pool::create(node, a.size as u32, LAT_BUFFERS)?;
    let l = ZcListener::bind(node, &a.svc)?;
    ready();
    let mut port = l.accept()?;
    port.set_spin(a.zc_spin_us.map(Duration::from_micros));
    let mut sink = 0u64;
    while let Some(m) = port.recv()? {
        let seq = seq_of(m.bytes());
        if a.touch {
            sink = sink.wrapping_add(read_all(m.bytes()));
            let mut b = pool.loan()?;
            stamp(&mut b, seq, true);
            drop(m);
            port.send(b)?;
        } else {
            port.send(&m)?;
        }
    }
    std::hint::black_box(sink);
    Ok(())
}

fn echo_stream(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let l = Listener::bind(node, &a.svc)?;
    ready();
    let mut s = l.accept()?;
    let mut buf = vec![0u8; a.size];
    let mut sink = 0u64;
    loop {
        if s.read_exact(&mut buf).is_err() {
            return Ok(());
        }
        if a.touch {
            sink = sink.wrapping_add(read_all(&buf));
            let seq = seq_of(&buf);
            stamp(&mut buf, seq, true);
        }
        s.send_all(&buf)?;
        std::hint::black_box(sink);
    }
}

/// Forwards each message behind a header of its own, looking only at the headers.
fn middle_zc(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let pool = Pool::create(node, HEADER as u32, 64)?;
    let l = ZcListener::bind(node, &a.svc)?;
    let mut out = ZcPort::connect(node, a.out.as_deref().unwrap_or_default())?;
    ready();
    let mut port = l.accept()?;
    while let Some(m) = port.recv()? {
        let seq = seq_of(m.bytes());
        let mut h = pool.loan()?;
        stamp(&mut h, seq, false);
        out.send(Message::new().loan(h).forward(&m).user(m.user()))?;
    }
    out.shutdown_send();
    say("0 payload bytes copied");
    Ok(())
}

fn middle_stream(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let l = Listener::bind(node, &a.svc)?;
    let mut out = Stream::connect(node, a.out.as_deref().unwrap_or_default())?;
    ready();
    let mut s = l.accept()?;
    let mut buf = vec![0u8; HEADER + a.size];
    let mut copied = 0u64;
    while s.read_exact(&mut buf[HEADER..]).is_ok() {
        let seq = seq_of(&buf[HEADER..]);
        stamp(&mut buf[..HEADER], seq, false);
        out.send_all(&buf)?;
        copied += 2 * a.size as u64;
    }
    out.shutdown_write();
    say(&format!("{copied} payload bytes copied"));
    Ok(())
}

/// Counts whole messages (checking their order by the headers) until the stream ends; says
/// the count and the seconds from the first to the last.
fn sink_zc(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let l = ZcListener::bind(node, &a.svc)?;
    ready();
    let mut port = l.accept()?;
    let mut c = Counter::default();
    while let Some(m) = port.recv()? {
        let mut segs = m.segments();
        let (h, p) = (segs.next().unwrap_or(&[]), segs.next().unwrap_or(&[]));
        c.see(seq_of(h), seq_of(p), p.len() == a.size)?;
    }
    say(&c.report());
    Ok(())
}

fn sink_stream(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let l = Listener::bind(node, &a.svc)?;
    ready();
    let mut s = l.accept()?;
    let mut buf = vec![0u8; HEADER + a.size];
    let mut c = Counter::default();
    while s.read_exact(&mut buf).is_ok() {
        c.see(seq_of(&buf), seq_of(&buf[HEADER..]), true)?;
    }
    say(&c.report());
    Ok(())
}

#[derive(Default)]
struct Counter {
    n: u64,
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Counter {
    fn see(&mut self, hdr: u64, payload: u64, whole: bool) -> CliResult<()> {
        if hdr != self.n || payload != self.n || !whole {
            return Err(fail(format!("message {}: got {hdr}/{payload}", self.n)));
        }
        let now = Instant::now();
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.n += 1;
        Ok(())
    }

    fn report(&self) -> String {
        let secs = match (self.first, self.last) {
            (Some(a), Some(b)) => (b - a).as_secs_f64(),
            _ => 0.0,
        };
        format!("{} {secs}", self.n.saturating_sub(1))
    }
}

/// Reads 64-byte messages until the stream ends; says how many.
fn drain_stream(node: &Node, a: &ZcPeerArgs) -> CliResult<()> {
    let l = Listener::bind(node, &a.svc)?;
    ready();
    let mut s = l.accept()?;
    let mut buf = vec![0u8; 64 << 10];
    let mut bytes = 0u64;
    loop {
        match s.recv(&mut buf)? {
            0 => break,
            n => bytes += n as u64,
        }
    }
    say(&format!("{}", bytes / a.size as u64));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Driver.

fn spawn_echo(
    region: &str,
    mode: &str,
    size: usize,
    touch: bool,
    cfg: &Cfg,
    zc_spin: Option<Duration>,
) -> CliResult<(ZcPeer, String)> {
    let svc = unique("echo");
    let mut args = peer_args("echo", mode, region, &svc, size);
    if touch {
        args.push("--touch".into());
    }
    if let Some((_, peer)) = cfg.cpus {
        args.extend(["--cpu".into(), peer.to_string()]);
    }
    if let Some(s) = zc_spin.filter(|_| mode == "zc") {
        args.extend(["--zc-spin-us".into(), s.as_micros().to_string()]);
    }
    Ok((ZcPeer::spawn(&args)?, svc))
}

fn latency_test(touch: bool) -> &'static str {
    match touch {
        true => "latency-touched",
        false => "latency",
    }
}

/// Round trips of `size`-byte messages, timed each; the record is half the median.
fn latency_record(touch: bool, path: &'static str, size: usize, mut rtts: Vec<f64>) -> Record {
    rtts.sort_by(f64::total_cmp);
    let at = |q: f64| rtts[((rtts.len() - 1) as f64 * q) as usize] / 2.0;
    let mut r = Record::new(latency_test(touch), path, size as u64, "us", at(0.5));
    r.p99 = Some(at(0.99));
    r
}

/// Runs `once` (one round trip) for the configured time, at least 20 times.
fn time_trips(cfg: &Cfg, mut once: impl FnMut(u64) -> CliResult<()>) -> CliResult<Vec<f64>> {
    let start = Instant::now();
    let mut rtts = Vec::new();
    let mut seq = 0u64;
    while start.elapsed() < cfg.dur || rtts.len() < 20 {
        let t = Instant::now();
        once(seq)?;
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
        seq += 1;
    }
    Ok(rtts)
}

/// Zero-copy round trips; `path` [`ZC`] waits as configured, [`ZC_POLL`] polls (both ends).
fn latency_zc(
    node: &Node,
    region: &str,
    size: usize,
    touch: bool,
    cfg: &Cfg,
    path: &'static str,
) -> CliResult<Record> {
    let spin = match path {
        ZC_POLL => Some(POLL_SPIN),
        _ => cfg.zc_spin,
    };
    let (peer, svc) = spawn_echo(region, "zc", size, touch, cfg, spin)?;
    let pool = Pool::create(node, size as u32, LAT_BUFFERS)?;
    let mut port = ZcPort::connect(node, &svc)?;
    port.set_spin(spin);
    let mut sink = 0u64;
    let rtts = time_trips(cfg, |seq| {
        let mut b = pool.loan()?;
        b.truncate(size);
        stamp(&mut b, seq, touch);
        port.send(b)?;
        let m = port.recv()?.ok_or_else(|| fail("echo ended"))?;
        if touch {
            sink = sink.wrapping_add(read_all(m.bytes()));
        }
        match seq_of(m.bytes()) == seq {
            true => Ok(()),
            false => Err(fail("zero-copy echo out of order")),
        }
    })?;
    std::hint::black_box(sink);
    port.shutdown_send();
    drop(port);
    peer.finish()?;
    Ok(latency_record(touch, path, size, rtts))
}

fn latency_stream(
    node: &Node,
    region: &str,
    size: usize,
    touch: bool,
    cfg: &Cfg,
) -> CliResult<Record> {
    let (peer, svc) = spawn_echo(region, "stream", size, touch, cfg, None)?;
    let mut s = Stream::connect(node, &svc)?;
    let (mut out, mut inp) = (vec![0u8; size], vec![0u8; size]);
    let mut sink = 0u64;
    let rtts = time_trips(cfg, |seq| {
        stamp(&mut out, seq, touch);
        s.send_all(&out)?;
        s.read_exact(&mut inp)?;
        if touch {
            sink = sink.wrapping_add(read_all(&inp));
        }
        match seq_of(&inp) == seq {
            true => Ok(()),
            false => Err(fail("stream echo out of order")),
        }
    })?;
    std::hint::black_box(sink);
    s.shutdown_write();
    drop(s);
    peer.finish()?;
    Ok(latency_record(touch, STREAM, size, rtts))
}

/// source (here) → middle → sink, 1 MiB messages for the configured time. Records the sink's
/// message rate and the payload bytes each path copied per message after the source.
fn pipeline(node: &Node, region: &str, mode: &str, cfg: &Cfg) -> CliResult<Vec<Record>> {
    let (sink_svc, mid_svc) = (unique("sink"), unique("mid"));
    let sink = ZcPeer::spawn(&peer_args("sink", mode, region, &sink_svc, PIPE_MSG))?;
    let mut margs = peer_args("middle", mode, region, &mid_svc, PIPE_MSG);
    margs.extend(["--out".into(), sink_svc]);
    let mid = ZcPeer::spawn(&margs)?;
    let start = Instant::now();
    let mut seq = 0u64;
    if mode == "zc" {
        let pool = Pool::create(node, PIPE_MSG as u32, 16)?;
        let mut port = ZcPort::connect(node, &mid_svc)?;
        while start.elapsed() < cfg.dur {
            let mut b = pool.loan()?;
            stamp(&mut b, seq, false);
            port.send(b)?;
            seq += 1;
        }
        port.shutdown_send();
    } else {
        let mut s = Stream::connect(node, &mid_svc)?;
        let mut buf = vec![0x5au8; PIPE_MSG];
        while start.elapsed() < cfg.dur {
            stamp(&mut buf, seq, false);
            s.send_all(&buf)?;
            seq += 1;
        }
        s.shutdown_write();
    }
    pipeline_records(mid, sink, if mode == "zc" { ZC } else { STREAM }, seq, {
        // The source's own copy into the stream counts too.
        if mode == "zc" {
            0
        } else {
            PIPE_MSG as u64
        }
    })
}

/// A pipeline's end: the middle stage says the payload bytes it copied, the sink its count
/// and the seconds from its first message to its last. Records the sink's rate and the
/// bytes copied per message after the source (plus `source_copy` per message).
pub(super) fn pipeline_records(
    mut mid: ZcPeer,
    mut sink: ZcPeer,
    path: &'static str,
    sent: u64,
    source_copy: u64,
) -> CliResult<Vec<Record>> {
    let copied: u64 = mid
        .line()?
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or(0);
    let said = sink.line()?;
    let mut f = said.split_whitespace();
    let n: f64 = f.next().and_then(|w| w.parse().ok()).unwrap_or(0.0);
    let secs: f64 = f.next().and_then(|w| w.parse().ok()).unwrap_or(0.0);
    mid.finish()?;
    sink.finish()?;
    if n < 1.0 || secs <= 0.0 {
        return Err(fail(format!(
            "pipeline over {path}: the sink said {said:?}"
        )));
    }
    let per_msg = copied as f64 / sent.max(1) as f64 + source_copy as f64;
    let m = PIPE_MSG as u64;
    Ok(vec![
        Record::new("pipeline", path, m, "msg/s", n / secs),
        Record::new("pipeline-copied", path, m, "B/msg", per_msg),
    ])
}

/// The copying stream's message rate: 64-byte messages, one pair, for the configured time.
fn stream_rate(node: &Node, region: &str, cfg: &Cfg) -> CliResult<Record> {
    let svc = unique("drain");
    let mut args = peer_args("drain", "stream", region, &svc, 64);
    if let Some((_, peer)) = cfg.cpus {
        args.extend(["--cpu".into(), peer.to_string()]);
    }
    let mut peer = ZcPeer::spawn(&args)?;
    let mut s = Stream::connect(node, &svc)?;
    let msg = [7u8; 64];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < cfg.dur {
        for _ in 0..1024 {
            s.send_all(&msg)?;
        }
        sent += 1024;
    }
    s.shutdown_write();
    let got: u64 = peer.line()?.parse().unwrap_or(0);
    let secs = start.elapsed().as_secs_f64();
    peer.finish()?;
    if got != sent {
        return Err(fail(format!(
            "stream rate: sent {sent}, the peer read {got}"
        )));
    }
    Ok(Record::new(
        "stream-rate",
        STREAM,
        64,
        "msg/s",
        got as f64 / secs,
    ))
}

/// Said instead of the iceoryx2 figures when the binary was built without them.
#[cfg(not(feature = "iceoryx2"))]
const NOT_BUILT: &str = "iceoryx2 path not built: build memloop-bench with `--features iceoryx2` \
                         (scripts/bench-zerocopy.sh does)";

fn print(records: &[Record], cfg: &Cfg) {
    let pin = match cfg.cpus {
        Some((a, b)) => format!("latency ends pinned to CPUs {a} and {b}; pipeline unpinned"),
        None => "ends not pinned".into(),
    };
    println!(
        "memloop bench zerocopy: {} s per figure, median of {} round(s); {pin}",
        cfg.dur.as_secs_f64(),
        cfg.repeat
    );
    let get = |test: &str, path: &str, size: u64| {
        records
            .iter()
            .find(|r| r.test == test && r.path == path && r.size == size)
    };
    // The iceoryx2 columns: a value and a ratio, when that path was built.
    let iox = cfg!(feature = "iceoryx2");
    let cols = |value: String, ratio: String| match iox {
        true => (
            format!(" {value} |"),
            format!(" {ratio} |").replace("  |", " |"),
        ),
        false => (String::new(), String::new()),
    };
    // iceoryx2's receivers poll, so it is compared with the polling zero-copy figure.
    let (h, hr) = cols(
        "iceoryx2 (polls)".into(),
        "iceoryx2 / zero-copy polling".into(),
    );
    println!(
        "\n| test | size | zero-copy | zero-copy polling | stream |{h} stream / zero-copy |{hr}"
    );
    let (h, hr) = cols("---:".into(), "---:".into());
    println!("| --- | ---: | ---: | ---: | ---: |{h} ---: |{hr}");
    let lat = |r: Option<&Record>| match r {
        Some(r) => format!("{:.2} ({:.2})", r.value, r.p99.unwrap_or(0.0)),
        None => "–".into(),
    };
    for test in ["latency", "latency-touched"] {
        for &s in &cfg.sizes {
            let size = s as u64;
            let (Some(z), Some(st)) = (get(test, ZC, size), get(test, STREAM, size)) else {
                continue;
            };
            let zp = get(test, ZC_POLL, size);
            let (c, cr) = match (get(test, IOX, size), zp) {
                (Some(x), Some(p)) => cols(lat(Some(x)), format!("{:.2}×", x.value / p.value)),
                (x, _) => cols(lat(x), String::new()),
            };
            println!(
                "| {test} one-way p50 (p99), µs | {} | {} | {} | {} |{c} {:.2}× |{cr}",
                fmt_size(size),
                lat(Some(z)),
                lat(zp),
                lat(Some(st)),
                st.value / z.value
            );
        }
    }
    let m = PIPE_MSG as u64;
    if let (Some(z), Some(st)) = (get("pipeline", ZC, m), get("pipeline", STREAM, m)) {
        let (c, cr) = match get("pipeline", IOX, m) {
            Some(x) => cols(
                format!("{:.0}", x.value),
                format!("{:.2}× (zero-copy / iceoryx2)", z.value / x.value),
            ),
            None => cols("–".into(), String::new()),
        };
        println!(
            "| 3-stage pipeline, msg/s | 1 MiB | {:.0} | – | {:.0} |{c} {:.2}× (zero-copy faster) |{cr}",
            z.value,
            st.value,
            z.value / st.value
        );
    }
    if let (Some(z), Some(st)) = (
        get("pipeline-copied", ZC, m),
        get("pipeline-copied", STREAM, m),
    ) {
        let (c, cr) = match get("pipeline-copied", IOX, m) {
            Some(x) => cols(format!("{:.0}", x.value), String::new()),
            None => cols("–".into(), String::new()),
        };
        println!(
            "| payload bytes copied per message after the source | 1 MiB | {:.0} | – | {:.0} |{c} |{cr}",
            z.value, st.value
        );
    }
    #[cfg(not(feature = "iceoryx2"))]
    println!("\n{NOT_BUILT}");
    if let Some(r) = get("stream-rate", STREAM, 64) {
        println!(
            "\ncopying stream, 64 B messages, one pair: {:.1} M msg/s",
            r.value / 1e6
        );
    }
    let flat = (
        get("latency", ZC, 64),
        cfg.sizes
            .iter()
            .max()
            .and_then(|&s| get("latency", ZC, s as u64)),
    );
    if let (Some(a), Some(b)) = flat {
        println!(
            "zero-copy latency, largest size vs 64 B: {:.2}× (target ≤ 1.5×)",
            b.value / a.value
        );
    }
}
