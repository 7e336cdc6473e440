//! `memloop-bench switch-peer` (hidden): the two ends of `memloop bench switch`, ordinary TCP
//! programs (std::net over libc). The client demotes its own connection by passing its fd to
//! itself with `SCM_RIGHTS`, the trigger a real fd-passing server pulls; under the preload the
//! `sendmsg` returns once this side has moved to TCP, on a plain kernel path it is a no-op.
//! The promotion is the driver's: it holds the region.
//!
//! - `--role server --addr A`: listens on A (port 0 for any), prints
//!   `{"ready":true,"pid":..,"addr":..}`, serves connections until stdin closes.
//! - `--role client --addr A`: prints `{"ready":true,"pid":..}`, then for each [`Rep`] line on
//!   stdin makes one fresh connection, measures, and prints one [`Outcome`] line.
//!
//! A connection: a 16-byte header (magic, flags: busy, promote; pings, chunk); `pings` 8-byte
//! round trips (the path before the switch); busy: both ends stream `chunk`-byte chunks both
//! ways while the client triggers the switch, until the client's END chunk (carrying the
//! trigger time) and the server's (carrying the gaps it saw); idle: nothing moves while the
//! client triggers; then `pings` round trips (the path after the switch). With promote, the
//! client then asks the driver for the promotion (a `{"promote":{..}}` line on stdout, the
//! answer a [`Promoted`] line on stdin) — busy: amid a second stream phase like the first;
//! idle: after a silence — and round trips follow until the client closes.
//! Every chunk is checked (sequence, kind, pattern): a lost, duplicated or misplaced byte is an
//! error, not a figure.

use super::fdpass::SelfPass;
use crate::error::{CliResult, Context};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::io::{self, BufRead, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const MAGIC: u32 = u32::from_le_bytes(*b"MLSW");
const HEADER: usize = 16;
const PING: usize = 8;
/// Chunk header: sequence, kind, then four words of what an END chunk carries.
const CHUNK_HEAD: usize = 48;
pub const MIN_CHUNK: usize = 64;
pub const MAX_CHUNK: usize = 1 << 20;
const DATA: u64 = 0;
const END: u64 = 1;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Role {
    Server,
    Client,
}

#[derive(clap::Args)]
pub struct PeerArgs {
    #[arg(long, value_enum)]
    role: Role,
    /// Server: where to listen; client: where to connect (`host:port`).
    #[arg(long)]
    addr: String,
    /// CPU to pin this process to (used when `taskset` is not available).
    #[arg(long)]
    cpu: Option<usize>,
}

/// One repetition, as the driver asks for it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub struct Rep {
    /// Both ends stream both ways around the switch (else the connection is idle).
    pub busy: bool,
    /// Round trips before and after the switch.
    pub pings: u32,
    /// Chunk size of the streams.
    pub chunk: usize,
    /// Busy: streaming before the trigger, and after it; idle: quiet time before it.
    pub pre_ms: u64,
    pub post_ms: u64,
    /// Gaps are looked at within this long before and after the trigger.
    pub window_ms: u64,
    /// After the round trips on TCP, ask the driver to promote the connection back to its
    /// ring (busy: amid a second stream phase; idle: after as long a silence), then round
    /// trips again (the path after the promotion).
    #[serde(default)]
    pub promote: bool,
}

/// The client's question to the driver: promote this connection (its 4-tuple as this side
/// sees it). The driver answers with a [`Promoted`] line on our stdin.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct PromoteAsk {
    pub local: String,
    pub peer: String,
}

/// The driver's answer: when it asked (no-op on a plain kernel path), and when it saw the
/// promotion finished.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default)]
pub struct Promoted {
    /// The trigger: CLOCK_MONOTONIC and wall clock, ns.
    pub at_mono: u64,
    pub at_wall: u64,
    /// Trigger → the channel's switch word quiet again (as polled by the driver), ns; `None`
    /// when not seen (or no promotion: a control path).
    pub done_ns: Option<u64>,
}

/// What the promotion half of a repetition saw.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct PromoteOutcome {
    /// The driver's trigger, wall clock, ns.
    pub trigger_wall_ns: u64,
    pub done_ns: Option<u64>,
    /// Round trips after the promotion, ns.
    pub rtt_after: Vec<u64>,
    /// Busy: the gaps around the promotion at each receiving end.
    pub rx_client: Option<Gaps>,
    pub rx_server: Option<Gaps>,
}

/// The gaps between consecutive reads that returned data, one receiving end, ns.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
pub struct Gaps {
    /// Median gap in the window before the trigger.
    pub typical: u64,
    /// Largest gap in the window before the trigger.
    pub before_max: u64,
    /// Largest gap in the window after the trigger (one that spans the trigger included).
    pub after_max: u64,
    /// Reads that returned data.
    pub reads: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Outcome {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Round trips before and after the switch, ns.
    pub rtt_before: Vec<u64>,
    pub rtt_after: Vec<u64>,
    /// The trigger, wall clock (ns since the epoch; the preload's log lines are on it).
    pub trigger_wall_ns: u64,
    /// The `sendmsg` that triggers, ns: this side done.
    pub cost_ns: u64,
    /// Busy: what the client received (server → client) and what the server received.
    pub rx_client: Option<Gaps>,
    pub rx_server: Option<Gaps>,
    /// Bytes streamed each way (busy).
    pub bytes_c2s: u64,
    pub bytes_s2c: u64,
    /// The promotion half, if asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote: Option<PromoteOutcome>,
}

pub fn run(a: &PeerArgs) -> CliResult<()> {
    if let Some(cpu) = a.cpu {
        crate::bench::pin_peer(Some(cpu))?;
    }
    match a.role {
        Role::Server => server(&a.addr),
        Role::Client => client(&a.addr),
    }
}

fn say(v: serde_json::Value) {
    println!("{v}");
}

/// CLOCK_MONOTONIC, ns: the same clock in every process of the machine.
pub fn now() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

pub fn wall() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn server(addr: &str) -> CliResult<()> {
    let l = TcpListener::bind(addr).context(format!("listening on {addr}"))?;
    say(json!({ "ready": true, "pid": std::process::id(), "addr": l.local_addr()?.to_string() }));
    crate::bench::tcp::peer::exit_when_stdin_closes();
    loop {
        match l.accept() {
            Ok((c, _)) => {
                std::thread::spawn(move || {
                    if let Err(e) = serve(&c) {
                        eprintln!("memloop-bench switch-peer: {e}");
                    }
                });
            }
            Err(e) => {
                eprintln!("memloop-bench switch-peer: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Header flags (the header's second word).
const F_BUSY: u32 = 1;
const F_PROMOTE: u32 = 2;

fn serve(c: &TcpStream) -> io::Result<()> {
    c.set_nodelay(true)?;
    let mut h = [0u8; HEADER];
    (&*c).read_exact(&mut h)?;
    let word = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let (flags, pings, chunk) = (word(4), word(8), word(12) as usize);
    let (busy, promote) = (flags & F_BUSY != 0, flags & F_PROMOTE != 0);
    if word(0) != MAGIC || !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) {
        return Err(invalid(format!("bad connection header {h:?}")));
    }
    echo(c, pings)?;
    if busy {
        serve_stream(c, chunk)?;
        if promote {
            echo(c, pings)?; // the round trips on TCP, then the stream around the promotion
            serve_stream(c, chunk)?;
        }
    }
    // Echo until the client closes.
    let mut p = [0u8; PING];
    loop {
        match read_full(c, &mut p)? {
            true => (&*c).write_all(&p)?,
            false => return Ok(()),
        }
    }
}

/// Echoes `n` round trips.
fn echo(c: &TcpStream, n: u32) -> io::Result<()> {
    let mut p = [0u8; PING];
    for _ in 0..n {
        (&*c).read_exact(&mut p)?;
        (&*c).write_all(&p)?;
    }
    Ok(())
}

/// The server's side of one stream phase: streams until the client's END chunk, then ends its
/// own with the gaps it saw around the trigger the client's END carries.
fn serve_stream(c: &TcpStream, chunk: usize) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<Gaps>();
    std::thread::scope(|s| {
        let writer = s.spawn(move || {
            stream_out(c, chunk, || match rx.try_recv() {
                Ok(g) => Ok(Some(gaps_word(g))),
                Err(mpsc::TryRecvError::Empty) => Ok(None),
                Err(mpsc::TryRecvError::Disconnected) => {
                    Err(invalid("the server's reader stopped".into()))
                }
            })
        });
        let r = receive(c, chunk).and_then(|(times, trigger, _)| {
            let (window, trigger) = (trigger[1], trigger[0]);
            tx.send(gaps(&times, trigger, window))
                .map_err(|_| invalid("the server's writer stopped".into()))
        });
        let w = writer.join().expect("writer thread");
        r.and(w.map(|_| ()))
    })
}

/// An END chunk's four words, from the server's gaps.
fn gaps_word(g: Gaps) -> [u64; 4] {
    [g.typical, g.before_max, g.after_max, g.reads]
}

/// Fills `buf`; `Ok(false)` on a clean end of stream before its first byte.
fn read_full(c: &TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match (&*c).read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// 256 + chunk bytes of 0, 1, 2, …: chunk `seq`'s payload is the slice at `seq % 256`.
fn pattern(chunk: usize) -> Vec<u8> {
    (0..chunk + 256).map(|i| i as u8).collect()
}

/// Sends chunks until `end()` gives the END chunk's words; returns the bytes sent.
fn stream_out(
    c: &TcpStream,
    chunk: usize,
    mut end: impl FnMut() -> io::Result<Option<[u64; 4]>>,
) -> io::Result<u64> {
    let pat = pattern(chunk);
    let mut buf = vec![0u8; chunk];
    for seq in 0u64.. {
        let fin = end()?;
        let off = (seq % 256) as usize;
        buf[CHUNK_HEAD..].copy_from_slice(&pat[off + CHUNK_HEAD..off + chunk]);
        buf[..8].copy_from_slice(&seq.to_le_bytes());
        buf[8..16].copy_from_slice(&(if fin.is_some() { END } else { DATA }).to_le_bytes());
        for (i, w) in fin.unwrap_or_default().iter().enumerate() {
            buf[16 + 8 * i..24 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        (&*c).write_all(&buf)?;
        if fin.is_some() {
            return Ok((seq + 1) * chunk as u64);
        }
    }
    unreachable!("the sequence never runs out")
}

/// Receives and checks chunks until the END chunk: the time of every read that returned data,
/// the END chunk's words, and the bytes received.
fn receive(c: &TcpStream, chunk: usize) -> io::Result<(Vec<u64>, [u64; 4], u64)> {
    let pat = pattern(chunk);
    let mut buf = vec![0u8; (256 << 10).max(2 * chunk)];
    let mut times = Vec::with_capacity(1 << 16);
    let (mut filled, mut seq) = (0usize, 0u64);
    loop {
        let n = match (&*c).read(&mut buf[filled..]) {
            Ok(0) => return Err(invalid(format!("stream ended at chunk #{seq}"))),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        times.push(now());
        filled += n;
        let whole = filled / chunk * chunk;
        for (k, m) in buf[..whole].chunks_exact(chunk).enumerate() {
            let word = |i: usize| u64::from_le_bytes(m[i..i + 8].try_into().expect("8 bytes"));
            let off = (seq % 256) as usize;
            if word(0) != seq || m[CHUNK_HEAD..] != pat[off + CHUNK_HEAD..off + chunk] {
                return Err(invalid(format!(
                    "DATA MISMATCH in chunk #{seq} (it says #{})",
                    word(0)
                )));
            }
            match word(8) {
                DATA => seq += 1,
                END => {
                    if (k + 1) * chunk != filled {
                        return Err(invalid("data after the END chunk".into()));
                    }
                    let words = [word(16), word(24), word(32), word(40)];
                    return Ok((times, words, (seq + 1) * chunk as u64));
                }
                k => return Err(invalid(format!("chunk #{seq}: unknown kind {k}"))),
            }
        }
        buf.copy_within(whole..filled, 0);
        filled -= whole;
    }
}

/// The gaps between consecutive reads, around `trigger` (ns, monotonic), within `window` ns.
pub fn gaps(times: &[u64], trigger: u64, window: u64) -> Gaps {
    let mut before = Vec::new();
    let mut after_max = 0;
    for w in times.windows(2) {
        let (from, to) = (w[0], w[1]);
        let gap = to - from;
        if to <= trigger && to + window > trigger {
            before.push(gap);
        } else if to > trigger && from < trigger + window {
            after_max = after_max.max(gap);
        }
    }
    before.sort_unstable();
    Gaps {
        typical: before.get(before.len() / 2).copied().unwrap_or(0),
        before_max: before.last().copied().unwrap_or(0),
        after_max,
        reads: times.len() as u64,
    }
}

fn client(addr: &str) -> CliResult<()> {
    say(json!({ "ready": true, "pid": std::process::id() }));
    let mut lines = std::io::stdin().lock().lines();
    while let Some(line) = lines.next() {
        let line = line.context("reading a request")?;
        if line.trim().is_empty() {
            continue;
        }
        // The driver's answer to a promotion request: the next line on stdin.
        let mut ask = |q: &PromoteAsk| -> io::Result<Promoted> {
            say(json!({ "promote": q }));
            let l = lines
                .next()
                .ok_or_else(|| invalid("stdin closed while asking for a promotion".into()))??;
            serde_json::from_str(&l).map_err(|e| invalid(format!("bad answer {l:?}: {e}")))
        };
        let out = match serde_json::from_str::<Rep>(&line) {
            Ok(rep) => one(addr, &rep, &mut ask).unwrap_or_else(|e| Outcome {
                error: Some(e.to_string()),
                ..Outcome::default()
            }),
            Err(e) => Outcome {
                error: Some(format!("bad request {line:?}: {e}")),
                ..Outcome::default()
            },
        };
        say(serde_json::to_value(&out)?);
    }
    Ok(())
}

fn pings(c: &TcpStream, n: u32, into: &mut Vec<u64>) -> io::Result<()> {
    let mut p = [0u8; PING];
    for i in 0..n {
        let t = now();
        (&*c).write_all(&u64::from(i).to_le_bytes())?;
        if !read_full(c, &mut p)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        into.push(now() - t);
        if p != u64::from(i).to_le_bytes() {
            return Err(invalid(format!("round trip #{i}: wrong echo {p:?}")));
        }
    }
    Ok(())
}

/// A trigger: (monotonic, wall) when it started, and how long it took, ns.
type Fired = (u64, u64, u64);

/// What one stream phase saw.
struct Phase {
    fired: Fired,
    rx_client: Gaps,
    rx_server: Gaps,
    bytes_c2s: u64,
    bytes_s2c: u64,
}

/// One stream phase: both ends stream both ways, `trigger` fires `pre_ms` in, the streams go
/// on `post_ms` more; then both END chunks (ours carries the trigger time, the server's the
/// gaps it saw around it).
fn stream_phase(
    c: &TcpStream,
    rep: &Rep,
    trigger: &mut dyn FnMut() -> io::Result<Fired>,
) -> io::Result<Phase> {
    let ms = Duration::from_millis;
    let window = ms(rep.window_ms).as_nanos() as u64;
    let (stop, at) = (AtomicBool::new(false), AtomicU64::new(0));
    let (rx, tx, fired) = std::thread::scope(|s| -> io::Result<_> {
        let writer = s.spawn(|| {
            stream_out(c, rep.chunk, || {
                Ok(stop
                    .load(Ordering::Acquire)
                    .then(|| [at.load(Ordering::Acquire), window, 0, 0]))
            })
        });
        let reader = s.spawn(|| receive(c, rep.chunk));
        std::thread::sleep(ms(rep.pre_ms));
        let fired = trigger();
        if let Ok((t, _, _)) = fired {
            at.store(t, Ordering::Release);
        }
        std::thread::sleep(ms(rep.post_ms));
        stop.store(true, Ordering::Release);
        let tx = writer.join().expect("writer thread");
        let rx = reader.join().expect("reader thread");
        Ok((rx?, tx?, fired?))
    })?;
    let (times, server, got) = rx;
    let [typical, before_max, after_max, reads] = server;
    Ok(Phase {
        rx_client: gaps(&times, fired.0, window),
        rx_server: Gaps {
            typical,
            before_max,
            after_max,
            reads,
        },
        fired,
        bytes_c2s: tx,
        bytes_s2c: got,
    })
}

/// One repetition on a fresh connection; `ask` asks the driver for a promotion.
fn one(
    addr: &str,
    rep: &Rep,
    ask: &mut dyn FnMut(&PromoteAsk) -> io::Result<Promoted>,
) -> io::Result<Outcome> {
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&rep.chunk) {
        return Err(invalid(format!("chunk {}: out of range", rep.chunk)));
    }
    let c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let flags = u32::from(rep.busy) * F_BUSY + u32::from(rep.promote) * F_PROMOTE;
    let mut h = [0u8; HEADER];
    for (i, w) in [MAGIC, flags, rep.pings, rep.chunk as u32]
        .iter()
        .enumerate()
    {
        h[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    (&c).write_all(&h)?;
    let mut out = Outcome::default();
    pings(&c, rep.pings, &mut out.rtt_before)?;
    let pass = SelfPass::new()?;
    // The demote: this process passes its own fd to itself; the sendmsg returns once this
    // side is on TCP.
    let mut demote = || -> io::Result<Fired> {
        let (w, t) = (wall(), now());
        pass.send(c.as_raw_fd())?;
        Ok((t, w, now() - t))
    };
    let fired = if rep.busy {
        let ph = stream_phase(&c, rep, &mut demote)?;
        (out.rx_client, out.rx_server) = (Some(ph.rx_client), Some(ph.rx_server));
        (out.bytes_c2s, out.bytes_s2c) = (ph.bytes_c2s, ph.bytes_s2c);
        ph.fired
    } else {
        std::thread::sleep(Duration::from_millis(rep.pre_ms));
        demote()?
    };
    (out.trigger_wall_ns, out.cost_ns) = (fired.1, fired.2);
    pings(&c, rep.pings, &mut out.rtt_after)?;
    if rep.promote {
        // Claim the fd in flight: until then its hold keeps our side shared (no promotion).
        drop(pass.claim()?);
        out.promote = Some(promote_half(&c, rep, ask, &mut out)?);
    }
    c.shutdown(Shutdown::Write)?;
    let mut b = [0u8; 1];
    if read_full(&c, &mut b)? {
        return Err(invalid("data where the server should close".into()));
    }
    Ok(out)
}

/// The promotion half: the driver triggers it (busy: amid a second stream phase; idle: after
/// a silence as long as before the demote), then round trips.
fn promote_half(
    c: &TcpStream,
    rep: &Rep,
    ask: &mut dyn FnMut(&PromoteAsk) -> io::Result<Promoted>,
    out: &mut Outcome,
) -> io::Result<PromoteOutcome> {
    let q = PromoteAsk {
        local: c.local_addr()?.to_string(),
        peer: c.peer_addr()?.to_string(),
    };
    let mut answer = Promoted::default();
    let mut trigger = || -> io::Result<Fired> {
        answer = ask(&q)?;
        Ok((answer.at_mono, answer.at_wall, 0))
    };
    let mut p = PromoteOutcome::default();
    if rep.busy {
        let ph = stream_phase(c, rep, &mut trigger)?;
        (p.rx_client, p.rx_server) = (Some(ph.rx_client), Some(ph.rx_server));
        out.bytes_c2s += ph.bytes_c2s;
        out.bytes_s2c += ph.bytes_s2c;
    } else {
        std::thread::sleep(Duration::from_millis(rep.pre_ms));
        trigger()?;
    }
    (p.trigger_wall_ns, p.done_ns) = (answer.at_wall, answer.done_ns);
    pings(c, rep.pings, &mut p.rtt_after)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_split_at_the_trigger() {
        // Reads every 10 ns, one gap of 100 spanning the trigger at 55.
        let times = [0, 10, 20, 30, 40, 50, 150, 160, 170, 500];
        let g = gaps(&times, 55, 60);
        assert_eq!(g.before_max, 10);
        assert_eq!(g.typical, 10);
        assert_eq!(g.after_max, 100, "{g:?}");
        assert_eq!(g.reads, 10);
    }

    /// Both variants, with and without the promotion half, against a server thread on
    /// loopback (no preload: the triggers are no-ops; the driver's answer is made up here).
    #[test]
    fn both_variants_run_on_loopback() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || loop {
            let (c, _) = l.accept().unwrap();
            std::thread::spawn(move || serve(&c).unwrap());
        });
        for (busy, promote) in [(true, true), (false, true), (true, false), (false, false)] {
            let rep = Rep {
                busy,
                pings: 5,
                chunk: 4096,
                pre_ms: 20,
                post_ms: 20,
                window_ms: 10,
                promote,
            };
            let mut asked = Vec::new();
            let mut ask = |q: &PromoteAsk| {
                asked.push(q.clone());
                Ok(Promoted {
                    at_mono: now(),
                    at_wall: wall(),
                    done_ns: None,
                })
            };
            let o = one(&addr, &rep, &mut ask).unwrap();
            assert_eq!((o.rtt_before.len(), o.rtt_after.len()), (5, 5));
            assert!(o.cost_ns > 0 && o.trigger_wall_ns > 0);
            if busy {
                let (c, s) = (o.rx_client.unwrap(), o.rx_server.unwrap());
                assert!(c.reads > 0 && s.reads > 0, "{o:?}");
                assert!(o.bytes_c2s > 0 && o.bytes_s2c > 0, "{o:?}");
            }
            assert_eq!(asked.len(), usize::from(promote));
            let Some(p) = o.promote else {
                assert!(!promote);
                continue;
            };
            assert_eq!(asked[0].peer, addr, "{asked:?}");
            assert!(
                p.trigger_wall_ns > o.trigger_wall_ns && p.rtt_after.len() == 5,
                "{p:?}"
            );
            assert_eq!(
                p.rx_client.is_some() && p.rx_server.is_some(),
                busy,
                "{p:?}"
            );
            if let (Some(d), Some(g)) = (o.rx_client, p.rx_client) {
                assert!(g.reads > 0 && d.reads > 0);
            }
        }
    }
}
