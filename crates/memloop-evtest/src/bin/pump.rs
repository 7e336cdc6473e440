//! `memloop-pump`: one checksummed TCP connection, fast enough for 10^10 bytes. Each side
//! sends a deterministic pseudo-random stream (byte `o` of the stream with seed `s` is byte
//! `o % 8` of `splitmix64(s + (o / 8 + 1) · φ)`, so any stretch can be regenerated from its
//! offset) in writes of random sizes, while it reads the peer's stream in reads of random sizes
//! and compares every byte with the stream regenerated at that offset: the first wrong byte
//! ends the run with its offset. Both directions at once, on plain std sockets (so
//! `libmemloop_preload.so` intercepts them). Driven by `crates/memloop-preload/tests/semantics.rs`
//! (`switch_ten_gigabytes_through_one_flipping_connection`, `switch_flip_sigkill_at_random_moments`).
//!
//! ```text
//! memloop-pump server --port-file F [--bind ADDR] [OPTIONS]   # prints nothing until done
//! memloop-pump client --host H --port P [OPTIONS]
//!   --send N         bytes to send, then shutdown(SHUT_WR) ("inf": until the peer is gone)
//!   --expect N       bytes to receive before the EOF ("inf": until the peer is gone)
//!   --seed S         our stream's seed        --peer-seed S   the peer's stream's seed
//!   --peer-may-die   the peer is SIGKILLed on purpose: an early EOF or ECONNRESET ends the
//!                    reads, EPIPE or ECONNRESET the writes (everything received must still be
//!                    a correct prefix of the peer's stream)
//!   --pid-file F     write our pid there once connected
//!   --stall SECS     exit 3 (a hang) when nothing moved either way for SECS (default 60)
//!   --progress GB    a progress line on stderr every GB·10^9 bytes received (default off)
//! ```
//!
//! Ends with `OK pump ROLE sent=… received=… read_end=… write_end=… secs=…` (exit 0) or
//! `FAIL pump ROLE: why` (exit 1) on stdout.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
/// Write and read sizes, drawn at random (a few tiny ones among mostly large ones).
const SIZES: [usize; 9] = [1, 7, 100, 1500, 4096, 65536, 300_000, 1 << 20, 1 << 20];
const MAX_IO: usize = 1 << 20;

fn mix(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `i` of the stream with this seed.
fn word(seed: u64, i: u64) -> u64 {
    mix(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Fills `buf` with the stream's bytes from offset `at`.
fn fill(seed: u64, at: u64, buf: &mut [u8]) {
    let mut o = at;
    let mut rest = buf;
    // Up to the next word boundary.
    let head = ((8 - (o % 8)) % 8).min(rest.len() as u64) as usize;
    if head > 0 {
        let w = word(seed, o / 8).to_le_bytes();
        let k = (o % 8) as usize;
        rest[..head].copy_from_slice(&w[k..k + head]);
        o += head as u64;
        rest = &mut rest[head..];
    }
    let mut i = o / 8;
    let mut chunks = rest.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, i).to_le_bytes());
        i += 1;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let n = tail.len();
        tail.copy_from_slice(&word(seed, i).to_le_bytes()[..n]);
    }
}

/// A small generator for the I/O sizes (splitmix64).
struct Rng(u64);

impl Rng {
    fn size(&mut self) -> usize {
        self.0 = self.0.wrapping_add(GOLDEN);
        SIZES[(mix(self.0) % SIZES.len() as u64) as usize]
    }
}

struct Opts {
    role: String,
    host: String,
    bind: Option<String>,
    port: u16,
    port_file: Option<String>,
    send: u64,
    expect: u64,
    seed: u64,
    peer_seed: u64,
    peer_may_die: bool,
    pid_file: Option<String>,
    stall: u64,
    progress: u64,
}

fn parse() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    let role = args
        .next()
        .ok_or("usage: memloop-pump server|client [OPTIONS]")?;
    if role != "server" && role != "client" {
        return Err(format!("unknown role {role:?}"));
    }
    let mut o = Opts {
        role,
        host: "127.0.0.1".into(),
        bind: None,
        port: 0,
        port_file: None,
        send: 0,
        expect: 0,
        seed: 1,
        peer_seed: 2,
        peer_may_die: false,
        pid_file: None,
        stall: 60,
        progress: 0,
    };
    let count = |v: String| -> Result<u64, String> {
        if v == "inf" {
            Ok(u64::MAX)
        } else {
            v.replace('_', "")
                .parse()
                .map_err(|_| format!("bad count {v:?}"))
        }
    };
    while let Some(a) = args.next() {
        if a == "--peer-may-die" {
            o.peer_may_die = true;
            continue;
        }
        let v = args.next().ok_or(format!("{a} needs a value"))?;
        let num = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{a}: bad number {v:?}"))
        };
        match a.as_str() {
            "--host" => o.host = v,
            "--bind" => o.bind = Some(v),
            "--port" => o.port = num(&v)? as u16,
            "--port-file" => o.port_file = Some(v),
            "--send" => o.send = count(v)?,
            "--expect" => o.expect = count(v)?,
            "--seed" => o.seed = num(&v)?,
            "--peer-seed" => o.peer_seed = num(&v)?,
            "--pid-file" => o.pid_file = Some(v),
            "--stall" => o.stall = num(&v)?,
            "--progress" => o.progress = num(&v)?.saturating_mul(1_000_000_000),
            _ => return Err(format!("unknown option {a}")),
        }
    }
    Ok(o)
}

fn write_atomically(path: &str, text: &str) -> Result<(), String> {
    let tmp = format!("{path}.tmp");
    std::fs::write(&tmp, text).map_err(|e| format!("write {tmp}: {e}"))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("rename {tmp}: {e}"))
}

fn connect(o: &Opts) -> Result<TcpStream, String> {
    if o.role == "server" {
        let bind = o.bind.as_deref().unwrap_or(&o.host);
        let l = TcpListener::bind((bind, 0)).map_err(|e| format!("bind {bind}: {e}"))?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        let pf = o
            .port_file
            .as_deref()
            .ok_or("the server needs --port-file")?;
        write_atomically(pf, &format!("{port}\n"))?;
        let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
        return Ok(s);
    }
    // The peer's network may still be coming up (domains): retry for a while.
    let end = Instant::now() + Duration::from_secs(10);
    let addr = (o.host.as_str(), o.port)
        .to_socket_addrs()
        .map_err(|e| format!("{}: {e}", o.host))?
        .next()
        .ok_or("no address")?;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < end && e.kind() != ErrorKind::PermissionDenied => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(format!("connect {addr}: {e}")),
        }
    }
}

/// How a direction ended, for the OK line.
fn errno_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPIPE) => "EPIPE".into(),
        Some(libc::ECONNRESET) => "ECONNRESET".into(),
        _ => format!("{e}"),
    }
}

fn peer_gone(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPIPE) | Some(libc::ECONNRESET))
}

struct Progress {
    sent: AtomicU64,
    received: AtomicU64,
    done: AtomicBool,
}

/// Sends `o.send` bytes of our stream; returns how the writes ended.
fn send(s: &TcpStream, o: &Opts, p: &Progress) -> Result<String, String> {
    let mut buf = vec![0u8; MAX_IO];
    let mut rng = Rng(o.seed ^ 0x7365_6e64);
    let mut at = 0u64;
    let mut w = s;
    while at < o.send {
        let n = (rng.size() as u64).min(o.send - at) as usize;
        fill(o.seed, at, &mut buf[..n]);
        let mut off = 0;
        while off < n {
            match w.write(&buf[off..n]) {
                Ok(0) => return Err(format!("send returned 0 at byte {}", at + off as u64)),
                Ok(k) => {
                    off += k;
                    p.sent.fetch_add(k as u64, Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if o.peer_may_die && peer_gone(&e) => return Ok(errno_name(&e)),
                Err(e) => return Err(format!("send at byte {}: {e}", at + off as u64)),
            }
        }
        at += n as u64;
    }
    match s.shutdown(Shutdown::Write) {
        Ok(()) => Ok("done".into()),
        Err(e) if o.peer_may_die && peer_gone(&e) => Ok(format!("done+{}", errno_name(&e))),
        Err(e) => Err(format!("shutdown(SHUT_WR) after {at} bytes: {e}")),
    }
}

/// Reads the peer's stream to its end, comparing every byte; returns how the reads ended.
fn receive(s: &TcpStream, o: &Opts, p: &Progress) -> Result<String, String> {
    let mut got = vec![0u8; MAX_IO];
    let mut want = vec![0u8; MAX_IO];
    let mut rng = Rng(o.peer_seed ^ 0x7265_6376);
    let mut at = 0u64;
    let mut next_progress = o.progress;
    let t0 = Instant::now();
    let mut r = s;
    loop {
        let n = rng.size();
        let k = match r.read(&mut got[..n]) {
            Ok(0) => {
                if at == o.expect || o.peer_may_die {
                    return Ok("EOF".into());
                }
                return Err(format!(
                    "EOF after {at} of {} bytes from the peer",
                    o.expect
                ));
            }
            Ok(k) => k,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if o.peer_may_die && peer_gone(&e) => return Ok(errno_name(&e)),
            Err(e) => return Err(format!("recv at byte {at}: {e}")),
        };
        if o.expect != u64::MAX && at + k as u64 > o.expect {
            return Err(format!(
                "{} bytes past the {} expected from the peer",
                at + k as u64 - o.expect,
                o.expect
            ));
        }
        fill(o.peer_seed, at, &mut want[..k]);
        if got[..k] != want[..k] {
            let i = (0..k).find(|&i| got[i] != want[i]).unwrap_or(0);
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
            let j = (i + 16).min(k);
            return Err(format!(
                "first wrong byte at offset {} of the peer's stream (in a read of {k} at {at}): \
                 got {} want {}; {}",
                at + i as u64,
                hex(&got[i..j]),
                hex(&want[i..j]),
                locate(o.peer_seed, at + i as u64, &got[i..k])
            ));
        }
        at += k as u64;
        p.received.store(at, Relaxed);
        if o.progress > 0 && at >= next_progress {
            eprintln!(
                "pump {}: {at} bytes received, {} sent, {:.1} s",
                o.role,
                p.sent.load(Relaxed),
                t0.elapsed().as_secs_f64()
            );
            next_progress += o.progress;
        }
    }
}

/// Where the wrong bytes come from, if they are the peer's stream at another offset nearby (a
/// duplicated or skipped stretch): the distance, searched up to 64 MiB either way.
fn locate(seed: u64, at: u64, got: &[u8]) -> String {
    if got.len() < 16 {
        return "too few bytes to locate".into();
    }
    // Align: the word-aligned 8 bytes of `got` that start at a stream offset ≡ 0 mod 8 would
    // be some word(seed, j); try every alignment of the shift.
    let window: u64 = 8 << 20; // words
    for shift in 0..8usize {
        let mut w = [0u8; 8];
        w.copy_from_slice(&got[shift..shift + 8]);
        let v = u64::from_le_bytes(w);
        let base = (at + shift as u64) / 8;
        let lo = base.saturating_sub(window);
        for j in lo..base + window {
            if word(seed, j) == v {
                let from = (j * 8) as i128 - (at + shift as u64) as i128;
                return format!("they are the stream's bytes {from:+} bytes away");
            }
        }
    }
    "they are not the stream's bytes within 64 MiB of there".into()
}

fn watchdog(o: &Opts, p: &'static Progress) {
    let (stall, role) = (o.stall, o.role.clone());
    std::thread::spawn(move || {
        let mut last = (0, 0);
        let mut still = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(500));
            if p.done.load(Relaxed) {
                return;
            }
            let now = (p.sent.load(Relaxed), p.received.load(Relaxed));
            if now != last {
                last = now;
                still = Instant::now();
            } else if still.elapsed() >= Duration::from_secs(stall) {
                say(&format!(
                    "FAIL pump {role}: stalled: nothing moved for {stall} s (sent {} received {})",
                    now.0, now.1
                ));
                // SAFETY: _exit ends the process at once; nothing to unwind or flush (said above).
                unsafe { libc::_exit(3) };
            }
        }
    });
}

/// `FAIL pump ROLE: why`, and the process ends (exit 1) whatever its other thread does.
fn fatal(o: &Opts, why: &str) -> ! {
    say(&format!("FAIL pump {}: {why}", o.role));
    // SAFETY: _exit ends the process at once; the line above is flushed.
    unsafe { libc::_exit(1) }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn run(o: &Opts) -> Result<String, String> {
    let s = connect(o)?;
    if let Some(pf) = &o.pid_file {
        write_atomically(pf, &format!("{}\n", std::process::id()))?;
    }
    let p: &'static Progress = Box::leak(Box::new(Progress {
        sent: AtomicU64::new(0),
        received: AtomicU64::new(0),
        done: AtomicBool::new(false),
    }));
    watchdog(o, p);
    let t0 = Instant::now();
    // The first failure either way ends the process at once (a reader that stopped would
    // leave the peer's writes, and with them our own, blocked).
    let (write_end, read_end) = std::thread::scope(|sc| {
        let w = sc.spawn(|| send(&s, o, p).unwrap_or_else(|e| fatal(o, &e)));
        let r = receive(&s, o, p).unwrap_or_else(|e| fatal(o, &e));
        let w = w.join().unwrap_or_else(|_| fatal(o, "the sender panicked"));
        (w, r)
    });
    p.done.store(true, Relaxed);
    Ok(format!(
        "sent={} received={} read_end={read_end} write_end={write_end} secs={:.2}",
        p.sent.load(Relaxed),
        p.received.load(Relaxed),
        t0.elapsed().as_secs_f64()
    ))
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            say(&format!("FAIL pump: {e}"));
            std::process::exit(2);
        }
    };
    match run(&o) {
        Ok(line) => {
            say(&format!("OK pump {} {line}", o.role));
            std::process::exit(0);
        }
        Err(e) => {
            say(&format!("FAIL pump {}: {e}", o.role));
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_stretch_regenerates_from_its_offset() {
        let mut all = vec![0u8; 4096];
        fill(9, 0, &mut all);
        for at in [0usize, 1, 5, 7, 8, 9, 1000, 4000] {
            for len in [0usize, 1, 3, 8, 15, 17, 96] {
                let len = len.min(4096 - at);
                let mut part = vec![0u8; len];
                fill(9, at as u64, &mut part);
                assert_eq!(part, all[at..at + len], "at {at} len {len}");
            }
        }
        let mut other = vec![0u8; 64];
        fill(10, 0, &mut other);
        assert_ne!(other, all[..64]);
    }

    #[test]
    fn a_shifted_stretch_is_located() {
        let mut buf = vec![0u8; 64];
        fill(3, 1000 - 24, &mut buf);
        assert!(
            locate(3, 1000, &buf).contains("-24 bytes"),
            "{}",
            locate(3, 1000, &buf)
        );
    }
}
