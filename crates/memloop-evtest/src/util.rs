//! What the scenarios share: errors, a seeded generator, checksummable byte streams,
//! connection pairs through a listener of this process, and bounded waits.

use crate::sys::{self, Errno};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// A scenario's verdict: `Err` carries the reason printed after `FAIL <scenario>:`.
pub type Res<T> = Result<T, String>;

/// Adds what was being done to a C library error.
pub trait Ctx<T> {
    fn ctx(self, what: &str) -> Res<T>;
}

impl<T> Ctx<T> for Result<T, Errno> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

impl<T> Ctx<T> for std::io::Result<T> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// `Err(format!(...))` unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Options shared by every scenario.
#[derive(Clone, Copy, Debug)]
pub struct Opts {
    pub seed: u64,
    /// Events the stress test must see (other scenarios: a scale for their round counts).
    pub events: u64,
}

/// Prints a diagnostic line (stdout, flushed: the driver shows it when a run fails).
pub fn info(msg: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "info: {msg}");
    let _ = out.flush();
}

// ---- randomness ---------------------------------------------------------------------------

pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small seeded generator (splitmix64).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(splitmix(seed ^ 0x6576_7465_7374))
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        splitmix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

// ---- byte streams -------------------------------------------------------------------------

/// Byte `off` of the deterministic stream `key`.
pub fn stream_byte(key: u64, off: u64) -> u8 {
    let w = splitmix(key.wrapping_mul(0x1000_0000_01b3) ^ (off >> 3));
    (w >> ((off & 7) * 8)) as u8
}

/// `len` bytes of stream `key` from `off`.
pub fn stream_bytes(key: u64, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| stream_byte(key, off + i)).collect()
}

/// Where `got` (bytes `off..` of stream `key`) first differs from the stream.
pub fn stream_mismatch(key: u64, off: u64, got: &[u8]) -> Option<u64> {
    got.iter()
        .zip(off..)
        .find(|(b, o)| **b != stream_byte(key, *o))
        .map(|(_, o)| o)
}

// ---- connections ----------------------------------------------------------------------------

/// Connections this process made that the preload must accept on rings (printed at the end as
/// `rings N`; the driver compares it with the "accepted on a ring" lines of the debug log).
static RINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

pub fn count_rings(n: usize) {
    RINGS.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

pub fn rings() -> usize {
    RINGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A listener of this process on 127.0.0.1 (a process may connect to its own listener; under
/// the preload that is still a ring connection).
pub struct Net {
    pub listener: TcpListener,
    pub addr: SocketAddrV4,
}

impl Net {
    pub fn new() -> Res<Net> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).ctx("bind 127.0.0.1:0")?;
        let port = listener.local_addr().ctx("local_addr")?.port();
        Ok(Net {
            listener,
            addr: SocketAddrV4::new(Ipv4Addr::LOCALHOST, port),
        })
    }

    pub fn accept(&self) -> Res<OwnedFd> {
        let (s, _) = self.listener.accept().ctx("accept")?;
        Ok(OwnedFd::from(s))
    }

    /// A connected pair (client, server), both blocking: connect, then accept at once.
    pub fn pair(&self) -> Res<(OwnedFd, OwnedFd)> {
        let c = sys::tcp_socket(false).ctx("socket")?;
        sys::connect(c.as_raw_fd(), self.addr).ctx("connect")?;
        let s = self.accept()?;
        count_rings(1);
        Ok((c, s))
    }

    /// `n` pairs whose ends are non-blocking, each confirmed by one byte each way (which also
    /// settles a ring connection before the scenario starts).
    pub fn pairs(&self, n: usize) -> Res<Vec<(OwnedFd, OwnedFd)>> {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let (c, s) = self.pair()?;
            handshake(c.as_raw_fd(), s.as_raw_fd())?;
            sys::set_nonblock(c.as_raw_fd(), true).ctx("O_NONBLOCK")?;
            sys::set_nonblock(s.as_raw_fd(), true).ctx("O_NONBLOCK")?;
            v.push((c, s));
        }
        Ok(v)
    }
}

/// One byte each way over a blocking pair.
pub fn handshake(c: RawFd, s: RawFd) -> Res<()> {
    sys::send_all(c, b"h").ctx("handshake send")?;
    read_exact(s, 1, Duration::from_secs(5))?;
    sys::send_all(s, b"h").ctx("handshake reply")?;
    read_exact(c, 1, Duration::from_secs(5))?;
    Ok(())
}

/// Reads exactly `n` bytes (blocking or non-blocking fd) within `limit`.
pub fn read_exact(fd: RawFd, n: usize, limit: Duration) -> Res<Vec<u8>> {
    let end = Instant::now() + limit;
    let mut got = vec![0u8; n];
    let mut have = 0;
    while have < n {
        match sys::recv(fd, &mut got[have..], libc::MSG_DONTWAIT) {
            Ok(0) => return Err(format!("fd {fd}: EOF after {have} of {n} bytes")),
            Ok(k) => have += k,
            Err(Errno(libc::EAGAIN)) | Err(Errno(libc::EINTR)) => {
                ensure!(
                    Instant::now() < end,
                    "fd {fd}: only {have} of {n} bytes within {limit:?}"
                );
                let left = end.saturating_duration_since(Instant::now());
                let _ = sys::poll1(fd, libc::POLLIN, left.as_millis().min(20) as i32);
            }
            Err(e) => return Err(format!("fd {fd}: recv: {e}")),
        }
    }
    Ok(got)
}

/// Reads what is there without blocking (until EAGAIN, EOF or an error).
pub fn drain(fd: RawFd) -> (Vec<u8>, Option<Errno>, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        match sys::recv(fd, &mut buf, libc::MSG_DONTWAIT) {
            Ok(0) => return (out, None, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(Errno(libc::EAGAIN)) => return (out, None, false),
            Err(Errno(libc::EINTR)) => continue,
            Err(e) => return (out, Some(e), false),
        }
    }
}

// ---- waiting ------------------------------------------------------------------------------

/// Polls `f` every `step` until it returns `Some`, or fails after `limit` with `what`.
pub fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Res<Option<T>>) -> Res<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        ensure!(Instant::now() < end, "{what} (waited {limit:?})");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Waits until thread `tid` of this process is asleep (state S in /proc): a waiter that
/// entered `epoll_wait` and blocked there.
pub fn wait_asleep(tid: i32) -> Res<()> {
    let path = format!("/proc/self/task/{tid}/stat");
    wait_until(
        Duration::from_secs(5),
        "waiter thread never went to sleep",
        || {
            let s = std::fs::read_to_string(&path).ctx(&path)?;
            let state = s
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next());
            Ok((state == Some("S")).then_some(()))
        },
    )?;
    // Asleep may still mean "in a short spin's sched_yield": give it time to block for real.
    std::thread::sleep(Duration::from_millis(5));
    Ok(())
}

/// Milliseconds of a duration, for messages.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The median and the maximum of some durations.
pub fn median_max(v: &mut [Duration]) -> (Duration, Duration) {
    if v.is_empty() {
        return (Duration::ZERO, Duration::ZERO);
    }
    v.sort();
    (v[v.len() / 2], v[v.len() - 1])
}

/// Describes an event mask (`IN|OUT|RDHUP`).
pub fn evname(e: u32) -> String {
    let names = [
        (sys::IN, "IN"),
        (sys::OUT, "OUT"),
        (sys::RDHUP, "RDHUP"),
        (sys::HUP, "HUP"),
        (sys::ERR, "ERR"),
        (libc::EPOLLPRI as u32, "PRI"),
    ];
    let mut v: Vec<String> = names
        .iter()
        .filter(|(b, _)| e & b != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let rest = e & !names.iter().fold(0, |a, (b, _)| a | b);
    if rest != 0 {
        v.push(format!("{rest:#x}"));
    }
    if v.is_empty() {
        "0".into()
    } else {
        v.join("|")
    }
}

/// memloop's own epoll tag in the high half of a data word (a leak of its registrations).
pub fn looks_like_memloop_tag(data: u64) -> bool {
    data >> 32 == 0x4d4c_7470
}
