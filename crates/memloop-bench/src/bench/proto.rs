//! The benchmark protocol, spoken identically over every path so only the transport differs.
//!
//! The driver sends a 16-byte op header (op, message size), then messages of exactly that size.
//! Every message carries its sequence number at three offsets (start, middle, end), so a lost,
//! duplicated or misaligned byte shows up as a mismatch. [`END`] in all stamps closes an op.
//! - rr: the peer echoes each message; the driver times round trips.
//! - stream: the peer only receives; after [`END`] it answers with the count it received.

use crate::error::{fail, CliError, CliResult, Context};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub const OP_RR: u32 = 1;
pub const OP_STREAM: u32 = 2;
/// The stamp that ends an op.
pub const END: u64 = u64::MAX;
/// Smallest message: room for the three stamps.
pub const MIN_MSG: usize = 16;
/// Largest message we accept from an op header (guards the peer's allocation).
pub const MAX_MSG: usize = 64 << 20;

/// A connected byte stream the benchmark can drive.
pub trait Conn: Read + Write {
    fn shutdown_write(&mut self) -> io::Result<()>;
    /// Blocks in a read for `d` with no data arriving (the idle test); a timeout is success.
    fn idle_wait(&mut self, d: Duration) -> io::Result<()>;
}

impl Conn for memloop::Stream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        memloop::Stream::shutdown_write(self);
        Ok(())
    }
    fn idle_wait(&mut self, d: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(d));
        let r = self.recv(&mut [0u8; 1]);
        self.set_read_timeout(None);
        expect_timeout(r.map_err(io::Error::from))
    }
}

/// Kernel sockets share one implementation: they have the same methods but no common trait.
macro_rules! socket_conn {
    ($($t:ty),*) => {$(
        impl Conn for $t {
            fn shutdown_write(&mut self) -> io::Result<()> {
                self.shutdown(Shutdown::Write)
            }
            fn idle_wait(&mut self, d: Duration) -> io::Result<()> {
                self.set_read_timeout(Some(d))?;
                let r = self.read(&mut [0u8; 1]);
                self.set_read_timeout(None)?;
                expect_timeout(r)
            }
        }
    )*};
}

socket_conn!(UnixStream, TcpStream);

fn expect_timeout(r: io::Result<usize>) -> io::Result<()> {
    match r {
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
        Ok(n) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{n} unexpected byte(s) while idle"),
        )),
    }
}

pub fn send_op(c: &mut dyn Conn, op: u32, size: usize) -> io::Result<()> {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&op.to_le_bytes());
    h[8..].copy_from_slice(&(size as u64).to_le_bytes());
    c.write_all(&h)
}

/// The next op header, or `None` at a clean end of stream.
pub fn read_op(c: &mut dyn Conn) -> CliResult<Option<(u32, usize)>> {
    let mut h = [0u8; 16];
    match c.read_exact(&mut h) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other.context("reading op header")?,
    }
    let op = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let size = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
    if !(MIN_MSG as u64..=MAX_MSG as u64).contains(&size) {
        return Err(fail(format!("op header: message size {size} out of range")));
    }
    Ok(Some((op, size as usize)))
}

fn stamp_offsets(size: usize) -> [usize; 3] {
    [0, (size / 2) & !7, size - 8]
}

/// Writes `seq` into the message's three stamps.
pub fn stamp(msg: &mut [u8], seq: u64) {
    for o in stamp_offsets(msg.len()) {
        msg[o..o + 8].copy_from_slice(&seq.to_le_bytes());
    }
}

fn stamp_at(msg: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(msg[o..o + 8].try_into().expect("8 bytes"))
}

/// Checks that all stamps hold `seq` or all hold [`END`]; returns whether it is the end.
pub fn check(msg: &[u8], seq: u64) -> CliResult<bool> {
    let want = if stamp_at(msg, 0) == END { END } else { seq };
    for o in stamp_offsets(msg.len()) {
        let got = stamp_at(msg, o);
        if got != want {
            return Err(corrupt(seq, o, got, msg.len()));
        }
    }
    Ok(want == END)
}

fn corrupt(seq: u64, off: usize, got: u64, size: usize) -> CliError {
    fail(format!(
        "DATA MISMATCH: message #{seq} ({size} bytes): stamp at offset {off} is {got:#x}, expected {seq:#x}"
    ))
}

/// A message of `size` bytes with a fixed filler (stamps are rewritten per message).
pub fn new_message(size: usize) -> Vec<u8> {
    vec![0xa5; size]
}

/// Round-trip times of one rr op, in nanoseconds, measured after `warmup`.
pub fn drive_rr(
    c: &mut dyn Conn,
    size: usize,
    warmup: Duration,
    dur: Duration,
) -> CliResult<(Vec<u64>, Duration)> {
    send_op(c, OP_RR, size)?;
    let (mut tx, mut rx) = (new_message(size), new_message(size));
    let mut seq = 0;
    let start = Instant::now();
    while start.elapsed() < warmup {
        round_trip(c, &mut tx, &mut rx, seq)?;
        seq += 1;
    }
    let mut rtts = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    let mut prev = t0;
    loop {
        round_trip(c, &mut tx, &mut rx, seq)?;
        seq += 1;
        let now = Instant::now();
        rtts.push((now - prev).as_nanos() as u64);
        prev = now;
        if now - t0 >= dur {
            break;
        }
    }
    round_trip(c, &mut tx, &mut rx, END)?;
    Ok((rtts, prev - t0))
}

fn round_trip(c: &mut dyn Conn, tx: &mut [u8], rx: &mut [u8], seq: u64) -> CliResult<()> {
    stamp(tx, seq);
    c.write_all(tx).context("rr send")?;
    c.read_exact(rx).context("rr receive")?;
    check(rx, seq)?;
    Ok(())
}

/// Streams messages for `dur`; returns how many the peer confirmed and the time until it did.
pub fn drive_stream(c: &mut dyn Conn, size: usize, dur: Duration) -> CliResult<(u64, Duration)> {
    send_op(c, OP_STREAM, size)?;
    let mut tx = new_message(size);
    // Reading the clock per 64-byte message would cost as much as sending it.
    let check_every = (65536 / size).max(1);
    let t0 = Instant::now();
    let mut sent = 0u64;
    loop {
        for _ in 0..check_every {
            stamp(&mut tx, sent);
            c.write_all(&tx).context("stream send")?;
            sent += 1;
        }
        if t0.elapsed() >= dur {
            break;
        }
    }
    stamp(&mut tx, END);
    c.write_all(&tx).context("stream send")?;
    let mut ack = [0u8; 8];
    c.read_exact(&mut ack)
        .context("stream: waiting for the receiver's count")?;
    let elapsed = t0.elapsed();
    let got = u64::from_le_bytes(ack);
    if got != sent {
        return Err(fail(format!(
            "DATA MISMATCH: sent {sent} messages, the receiver counted {got}"
        )));
    }
    Ok((sent, elapsed))
}

/// The peer's side: serves ops until the driver closes the stream.
pub fn serve(c: &mut dyn Conn) -> CliResult<()> {
    while let Some((op, size)) = read_op(c)? {
        match op {
            OP_RR => echo(c, size)?,
            OP_STREAM => sink(c, size)?,
            _ => return Err(fail(format!("unknown op {op}"))),
        }
    }
    Ok(())
}

fn echo(c: &mut dyn Conn, size: usize) -> CliResult<()> {
    let mut buf = new_message(size);
    for seq in 0.. {
        c.read_exact(&mut buf).context("rr peer receive")?;
        let end = check(&buf, seq)?;
        c.write_all(&buf).context("rr peer send")?;
        if end {
            break;
        }
    }
    Ok(())
}

/// Receives with large reads (as a real receiver would) and checks messages in place.
fn sink(c: &mut dyn Conn, size: usize) -> CliResult<()> {
    let mut buf = vec![0u8; ((256 << 10) / size).max(4) * size];
    let (mut filled, mut expect) = (0, 0u64);
    loop {
        let n = c.read(&mut buf[filled..]).context("stream peer receive")?;
        if n == 0 {
            return Err(fail(format!(
                "stream ended after {expect} messages, before the end marker"
            )));
        }
        filled += n;
        let mut start = 0;
        while filled - start >= size {
            if check(&buf[start..start + size], expect)? {
                c.write_all(&expect.to_le_bytes())
                    .context("stream peer ack")?;
                return Ok(());
            }
            start += size;
            expect += 1;
        }
        buf.copy_within(start..filled, 0);
        filled -= start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_detect_corruption() {
        let mut m = new_message(64);
        stamp(&mut m, 7);
        assert!(!check(&m, 7).unwrap());
        assert!(check(&m, 8).is_err());
        m[35] ^= 1; // inside the middle stamp
        assert!(check(&m, 7).is_err());
        stamp(&mut m, END);
        assert!(check(&m, 3).unwrap());
    }

    #[test]
    fn the_peer_fails_loudly_on_a_bad_message() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        send_op(&mut a, OP_STREAM, 32).unwrap();
        let mut m = new_message(32);
        stamp(&mut m, 0);
        a.write_all(&m).unwrap();
        stamp(&mut m, 2); // message #1 lost
        a.write_all(&m).unwrap();
        let err = serve(&mut b).unwrap_err().to_string();
        assert!(err.contains("DATA MISMATCH"), "{err}");
    }

    #[test]
    fn rr_and_stream_over_a_socketpair() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || serve(&mut b).unwrap());
        let ms = Duration::from_millis(20);
        let (rtts, _) = drive_rr(&mut a, 64, ms, ms).unwrap();
        assert!(!rtts.is_empty());
        let (n, _) = drive_stream(&mut a, 1000, ms).unwrap();
        assert!(n > 0);
        a.shutdown_write().unwrap();
        peer.join().unwrap();
    }
}
