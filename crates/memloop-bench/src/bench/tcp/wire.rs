//! What the two ends of `memloop bench tcp` say to each other, and what the driver asks the
//! client end to measure. Nothing here knows about memloop: both ends are ordinary socket
//! programs (std::net / std::os::unix::net over plain libc calls), so a preloaded library sees
//! exactly what it would see from any TCP application.
//!
//! Every connection starts with a 16-byte header (magic, op, message size):
//! - `Rr`: the server echoes each message until the client shuts down its write side;
//! - `Stream`: the server only receives, and after end of stream answers with the byte count;
//! - `Crr`: one 1-byte request, one 1-byte response, then the server closes.
//!
//! Messages carry their sequence number (three stamps for messages of 16 bytes and more, every
//! byte for shorter ones), so a lost, duplicated or misplaced byte is reported, not measured.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

const MAGIC: u32 = u32::from_le_bytes(*b"MLTB");
pub const HEADER: usize = 16;
/// Largest message size a header may ask for (bounds the server's allocation).
pub const MAX_SIZE: usize = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Rr = 1,
    Stream = 2,
    Crr = 3,
    /// Echo, served by the server's one epoll thread with every other such connection.
    Fan = 4,
}

pub fn header(op: Op, size: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(op as u32).to_le_bytes());
    h[8..].copy_from_slice(&(size as u64).to_le_bytes());
    h
}

pub fn parse_header(h: &[u8; HEADER]) -> io::Result<(Op, usize)> {
    let word = |r: std::ops::Range<usize>| u32::from_le_bytes(h[r].try_into().expect("4 bytes"));
    if word(0..4) != MAGIC {
        return Err(invalid("not a bench-tcp connection (bad magic)".into()));
    }
    let op = match word(4..8) {
        1 => Op::Rr,
        2 => Op::Stream,
        3 => Op::Crr,
        4 => Op::Fan,
        n => return Err(invalid(format!("unknown op {n}"))),
    };
    let size = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
    if !(1..=MAX_SIZE as u64).contains(&size) {
        return Err(invalid(format!("message size {size} out of range")));
    }
    Ok((op, size as usize))
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

// ---------------------------------------------------------------------------------------------
// Message contents.

fn stamp_offsets(len: usize) -> [usize; 3] {
    [0, (len / 2) & !7, len - 8]
}

/// Marks `msg` as message number `seq`.
pub fn fill(msg: &mut [u8], seq: u64) {
    if msg.len() < 16 {
        msg.fill(seq as u8);
        return;
    }
    for o in stamp_offsets(msg.len()) {
        msg[o..o + 8].copy_from_slice(&seq.to_le_bytes());
    }
}

/// Checks that `msg` is message number `seq`.
pub fn verify(msg: &[u8], seq: u64) -> io::Result<()> {
    let bad = |off: usize, got: u64| {
        invalid(format!(
            "DATA MISMATCH: message #{seq} ({} bytes): offset {off} holds {got:#x}",
            msg.len()
        ))
    };
    if msg.len() < 16 {
        return match msg.iter().position(|&b| b != seq as u8) {
            Some(i) => Err(bad(i, u64::from(msg[i]))),
            None => Ok(()),
        };
    }
    for o in stamp_offsets(msg.len()) {
        let got = u64::from_le_bytes(msg[o..o + 8].try_into().expect("8 bytes"));
        if got != seq {
            return Err(bad(o, got));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Addresses and connections.

/// `host:port` (TCP), `unix:@name` (abstract Unix stream socket) or `memloop:NAME` (a native
/// memloop service in the region of `MEMLOOP_REGION`).
#[derive(Clone, Debug)]
pub enum Addr {
    Tcp(SocketAddr),
    Unix(String),
    Native(String),
}

/// This process's membership, for native addresses (joined on first use).
static NODE: std::sync::Mutex<Option<memloop::Node>> = std::sync::Mutex::new(None);

fn node() -> io::Result<memloop::Node> {
    let mut n = NODE.lock().unwrap_or_else(|p| p.into_inner());
    if n.is_none() {
        *n = Some(memloop::Node::join_default("bench")?);
    }
    Ok(n.clone().expect("joined above"))
}

/// Leaves the region once the last native stream is gone (a process that just exits would
/// stay listed until someone reclaims it).
pub fn leave_region() {
    NODE.lock().unwrap_or_else(|p| p.into_inner()).take();
}

impl Addr {
    pub fn parse(s: &str) -> io::Result<Addr> {
        if let Some(name) = s.strip_prefix("unix:@") {
            return Ok(Addr::Unix(name.to_owned()));
        }
        if let Some(name) = s.strip_prefix("memloop:") {
            return Ok(Addr::Native(name.to_owned()));
        }
        let a = s
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| invalid(format!("{s}: no address")))?;
        Ok(Addr::Tcp(a))
    }

    /// The server's UDP address: its TCP listener's (none for the other kinds).
    pub fn udp(&self) -> io::Result<std::net::SocketAddr> {
        match self {
            Addr::Tcp(a) => Ok(*a),
            _ => Err(invalid("UDP needs a host:port address".into())),
        }
    }

    fn unix(name: &str) -> io::Result<UnixAddr> {
        UnixAddr::from_abstract_name(name.as_bytes())
    }

    /// Connects; `nodelay` disables Nagle (request/response traffic does, as RPC programs do).
    pub fn connect(&self, nodelay: bool) -> io::Result<Conn> {
        match self {
            Addr::Tcp(a) => {
                let s = TcpStream::connect(a)?;
                if nodelay {
                    s.set_nodelay(true)?;
                }
                Ok(Conn::Tcp(s))
            }
            Addr::Unix(n) => Ok(Conn::Unix(UnixStream::connect_addr(&Self::unix(n)?)?)),
            Addr::Native(n) => Ok(Conn::Native(Box::new(memloop::Stream::connect(
                &node()?,
                n,
            )?))),
        }
    }

    pub fn listen(&self) -> io::Result<Listener> {
        match self {
            Addr::Tcp(a) => Ok(Listener::Tcp(TcpListener::bind(a)?)),
            Addr::Unix(n) => Ok(Listener::Unix(UnixListener::bind_addr(&Self::unix(n)?)?)),
            Addr::Native(n) => Ok(Listener::Native(memloop::Listener::bind(&node()?, n)?)),
        }
    }
}

pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
    Native(memloop::Listener),
}

impl Listener {
    pub fn accept(&self) -> io::Result<Conn> {
        match self {
            Listener::Tcp(l) => Ok(Conn::Tcp(l.accept()?.0)),
            Listener::Unix(l) => Ok(Conn::Unix(l.accept()?.0)),
            Listener::Native(l) => Ok(Conn::Native(Box::new(l.accept()?))),
        }
    }

    /// The address clients should use (`host:port` with the port the kernel chose).
    pub fn local(&self) -> io::Result<String> {
        match self {
            Listener::Tcp(l) => Ok(l.local_addr()?.to_string()),
            Listener::Unix(l) => {
                let a = l.local_addr()?;
                let name = a.as_abstract_name().unwrap_or_default();
                Ok(format!("unix:@{}", String::from_utf8_lossy(name)))
            }
            Listener::Native(l) => Ok(format!("memloop:{}", l.name())),
        }
    }
}

pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// Boxed: a memloop stream is much larger than a socket.
    Native(Box<memloop::Stream>),
}

impl Conn {
    pub fn shutdown_write(&mut self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.shutdown(Shutdown::Write),
            Conn::Unix(s) => s.shutdown(Shutdown::Write),
            Conn::Native(s) => {
                s.shutdown_write();
                Ok(())
            }
        }
    }

    /// The socket (not for native streams, which have none).
    pub fn as_raw_fd(&self) -> io::Result<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match self {
            Conn::Tcp(s) => Ok(s.as_raw_fd()),
            Conn::Unix(s) => Ok(s.as_raw_fd()),
            Conn::Native(_) => Err(invalid("a native stream has no socket".into())),
        }
    }

    pub fn set_nodelay(&self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nodelay(true),
            Conn::Unix(_) | Conn::Native(_) => Ok(()),
        }
    }

    /// Fills `buf`; `Ok(false)` if the stream ended cleanly before its first byte.
    pub fn read_full(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            match self.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("stream ended {got} bytes into a {}-byte message", buf.len()),
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Expects the peer to close: fails if anything but end of stream arrives.
    pub fn expect_eof(&mut self) -> io::Result<()> {
        let mut b = [0u8; 1];
        match self.read(&mut b)? {
            0 => Ok(()),
            _ => Err(invalid(
                "unexpected data where the peer should close".into(),
            )),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
            Conn::Native(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
            Conn::Native(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The server's side of each op.

/// Echoes messages of `size` bytes until the client closes its write side.
pub fn serve_rr(c: &mut Conn, size: usize) -> io::Result<()> {
    c.set_nodelay()?;
    let mut buf = vec![0u8; size];
    for seq in 0.. {
        if !c.read_full(&mut buf)? {
            break;
        }
        verify(&buf, seq)?;
        c.write_all(&buf)?;
    }
    Ok(())
}

/// Receives messages of `size` bytes until end of stream (checking each), then answers with the
/// number of bytes received.
pub fn serve_stream(c: &mut Conn, size: usize) -> io::Result<()> {
    // Large reads, as a real receiver does.
    let mut buf = vec![0u8; ((256 << 10) / size).max(4) * size];
    let (mut filled, mut seq, mut total) = (0, 0u64, 0u64);
    loop {
        let n = match c.read(&mut buf[filled..]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            if filled != 0 {
                return Err(invalid(format!(
                    "stream ended {filled} bytes into message #{seq}"
                )));
            }
            return c.write_all(&total.to_le_bytes());
        }
        total += n as u64;
        filled += n;
        let whole = filled / size * size;
        for m in buf[..whole].chunks_exact(size) {
            verify(m, seq)?;
            seq += 1;
        }
        buf.copy_within(whole..filled, 0);
        filled -= whole;
    }
}

/// One short connection: a 1-byte request, a 1-byte response; the caller then closes.
pub fn serve_crr(c: &mut Conn) -> io::Result<()> {
    c.set_nodelay()?;
    let mut b = [0u8; 1];
    if !c.read_full(&mut b)? {
        return Err(invalid("connection closed before its request".into()));
    }
    verify(&b, 0)?;
    c.write_all(&b)
}

// ---------------------------------------------------------------------------------------------
// What the driver asks the client for, and the answer.

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// Request/response on one connection, back to back.
    Rr,
    /// One-way stream of messages.
    Stream,
    /// Connection setup: connect, 1-byte request/response, close.
    Crr,
    /// Request/response with a pause between requests (the far end falls asleep).
    SleepRr,
    /// Request/response on `conns` connections at once, one request in flight on each,
    /// multiplexed with epoll at both ends.
    Fan,
    /// Request/response of UDP datagrams (`udp.rs`).
    UdpRr,
    /// A one-way stream of UDP datagrams; the count is what the server received.
    UdpStream,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub struct Request {
    pub test: Test,
    pub size: usize,
    pub warmup_s: f64,
    pub dur_s: f64,
    /// Pause between requests (SleepRr), µs.
    #[serde(default)]
    pub sleep_us: u64,
    /// Connections at once (Fan).
    #[serde(default)]
    pub conns: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Reply {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Transactions, messages or connections measured.
    pub count: u64,
    /// Payload bytes measured (stream).
    pub bytes: u64,
    pub elapsed_s: f64,
    /// Per-transaction time percentiles (round trip, or whole connection for Crr), ns.
    pub p50_ns: f64,
    pub p99_ns: f64,
    /// Crr: median time of each phase (connect; request and response; the server's close
    /// reaching us), ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases_p50_ns: Option<[f64; 3]>,
}

impl Request {
    /// Runs the measurement against the server at `addr`.
    pub fn run(&self, addr: &Addr) -> io::Result<Reply> {
        let (warmup, dur) = (secs(self.warmup_s), secs(self.dur_s));
        match self.test {
            Test::Rr => rr(addr, self.size, warmup, dur, Duration::ZERO),
            Test::SleepRr => rr(
                addr,
                self.size,
                warmup,
                dur,
                Duration::from_micros(self.sleep_us),
            ),
            Test::Stream => stream(addr, self.size, warmup, dur),
            Test::Crr => crr(addr, warmup, dur),
            Test::UdpRr => super::udp::rr(addr.udp()?, self.size, warmup, dur),
            Test::UdpStream => super::udp::stream(addr.udp()?, self.size, warmup, dur),
            Test::Fan => {
                let connect = || addr.connect(true);
                let (count, secs) = super::fan::run(connect, self.size, self.conns, warmup, dur)?;
                Ok(Reply {
                    count,
                    elapsed_s: secs,
                    ..Reply::default()
                })
            }
        }
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 3600.0))
}

pub(super) fn percentiles(mut v: Vec<u64>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64;
    (at(0.5), at(0.99))
}

/// Back-to-back round trips (or with `pause` between them); per-round-trip times after `warmup`.
fn rr(
    addr: &Addr,
    size: usize,
    warmup: Duration,
    dur: Duration,
    pause: Duration,
) -> io::Result<Reply> {
    let mut c = addr.connect(true)?;
    c.write_all(&header(Op::Rr, size))?;
    let (mut tx, mut rx) = (vec![0xa5u8; size], vec![0u8; size]);
    let mut seq = 0u64;
    let mut trip = |c: &mut Conn| -> io::Result<()> {
        fill(&mut tx, seq);
        c.write_all(&tx)?;
        if !c.read_full(&mut rx)? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "server closed the connection",
            ));
        }
        verify(&rx, seq)?;
        seq += 1;
        Ok(())
    };
    let start = Instant::now();
    while start.elapsed() < warmup {
        trip(&mut c)?;
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    let mut times = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    let mut busy = Duration::ZERO;
    loop {
        let t = Instant::now();
        trip(&mut c)?;
        let done = Instant::now();
        times.push((done - t).as_nanos() as u64);
        busy += done - t;
        if done - t0 >= dur {
            break;
        }
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    c.shutdown_write()?;
    c.expect_eof()?;
    let count = times.len() as u64;
    let (p50_ns, p99_ns) = percentiles(times);
    // Back to back, the rate is over wall time; with pauses, over the time spent in round trips.
    let elapsed = if pause.is_zero() { t0.elapsed() } else { busy };
    Ok(Reply {
        count,
        elapsed_s: elapsed.as_secs_f64(),
        p50_ns,
        p99_ns,
        ..Reply::default()
    })
}

/// Streams messages; the rate counts from the end of the warm-up to the server's byte count.
fn stream(addr: &Addr, size: usize, warmup: Duration, dur: Duration) -> io::Result<Reply> {
    let mut c = addr.connect(false)?;
    c.write_all(&header(Op::Stream, size))?;
    let mut tx = vec![0xa5u8; size];
    // Reading the clock per 64-byte message would cost as much as sending it.
    let batch = (65536 / size).max(1);
    let (mut seq, mut mark) = (0u64, None);
    let start = Instant::now();
    loop {
        for _ in 0..batch {
            fill(&mut tx, seq);
            c.write_all(&tx)?;
            seq += 1;
        }
        let now = Instant::now();
        match mark {
            None if now - start >= warmup => mark = Some((now, seq)),
            Some((t, _)) if now - t >= dur => break,
            _ => {}
        }
    }
    c.shutdown_write()?;
    let mut ack = [0u8; 8];
    c.read_exact(&mut ack)?;
    let done = Instant::now();
    c.expect_eof()?;
    let sent = seq * size as u64;
    let got = u64::from_le_bytes(ack);
    if got != sent {
        return Err(invalid(format!(
            "DATA MISMATCH: sent {sent} bytes, the server received {got}"
        )));
    }
    let (t, at) = mark.expect("the warm-up ends before the measurement");
    Ok(Reply {
        count: seq - at,
        bytes: (seq - at) * size as u64,
        elapsed_s: (done - t).as_secs_f64(),
        ..Reply::default()
    })
}

/// Short connections, one after the other: connect, 1-byte request/response, close.
fn crr(addr: &Addr, warmup: Duration, dur: Duration) -> io::Result<Reply> {
    let mut req = [0u8; HEADER + 1];
    req[..HEADER].copy_from_slice(&header(Op::Crr, 1));
    // Returns when each phase ended.
    let once = || -> io::Result<[Instant; 3]> {
        let mut c = addr.connect(true)?;
        let connected = Instant::now();
        c.write_all(&req)?;
        let mut b = [0u8; 1];
        if !c.read_full(&mut b)? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "server closed before responding",
            ));
        }
        let answered = Instant::now();
        verify(&b, 0)?;
        // The server closes first, so the TIME_WAIT state stays on its side and our
        // ephemeral ports are free again at once.
        c.expect_eof()?;
        Ok([connected, answered, Instant::now()])
    };
    let start = Instant::now();
    while start.elapsed() < warmup {
        once()?;
    }
    let mut times = Vec::with_capacity(1 << 14);
    let mut phases: [Vec<u64>; 3] = Default::default();
    let t0 = Instant::now();
    loop {
        let t = Instant::now();
        let ends = once()?;
        let mut from = t;
        for (p, end) in phases.iter_mut().zip(ends) {
            p.push((end - from).as_nanos() as u64);
            from = end;
        }
        times.push((from - t).as_nanos() as u64);
        if from - t0 >= dur {
            break;
        }
    }
    let elapsed = t0.elapsed();
    let count = times.len() as u64;
    let (p50_ns, p99_ns) = percentiles(times);
    Ok(Reply {
        count,
        elapsed_s: elapsed.as_secs_f64(),
        p50_ns,
        p99_ns,
        phases_p50_ns: Some(phases.map(|p| percentiles(p).0)),
        ..Reply::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        let h = header(Op::Stream, 4096);
        assert_eq!(parse_header(&h).unwrap(), (Op::Stream, 4096));
        let mut bad = h;
        bad[0] ^= 1;
        assert!(parse_header(&bad).is_err());
        assert!(parse_header(&header(Op::Rr, MAX_SIZE + 1)).is_err());
        assert!(parse_header(&header(Op::Rr, 0)).is_err());
    }

    #[test]
    fn fill_and_verify_catch_wrong_messages_of_every_size() {
        for size in [1, 7, 15, 16, 64, 1000] {
            let mut m = vec![0u8; size];
            fill(&mut m, 300);
            verify(&m, 300).unwrap();
            assert!(verify(&m, 301).is_err(), "size {size}");
            let i = size - 1;
            m[i] ^= 0x40;
            assert!(verify(&m, 300).is_err(), "size {size}");
        }
    }
}
