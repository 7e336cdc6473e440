//! UDP measurements of `memloop bench tcp`: the server's peer also binds a UDP socket on its
//! TCP listener's address and port; the first byte of each datagram says what it is.
//!
//! - `ECHO`: sent back to its sender as it came (request/response);
//! - `SINK`: counted per sender, nothing sent back (a stream);
//! - `QUERY`: answered with the number of `SINK` datagrams from that sender since its last
//!   query (8 bytes, little endian), which starts a new count.
//!
//! A stream's figure is the datagrams *delivered* per second: a receiver slower than its sender
//! drops the rest, on the kernel's path as on memloop's.

use super::wire::{fill, verify, Reply};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const ECHO: u8 = 0;
const SINK: u8 = 1;
const QUERY: u8 = 2;
/// Largest datagram the server takes.
const MAX: usize = 65536;

/// Serves UDP on `at` in a thread of its own (the process exits with its TCP server).
pub fn serve(at: SocketAddr) -> io::Result<()> {
    let s = UdpSocket::bind(at)?;
    std::thread::spawn(move || {
        if let Err(e) = serve_on(&s) {
            eprintln!("memloop-bench tcp-peer: udp: {e}");
        }
    });
    Ok(())
}

fn serve_on(s: &UdpSocket) -> io::Result<()> {
    let mut buf = vec![0u8; MAX];
    let mut sunk: HashMap<SocketAddr, u64> = HashMap::new();
    loop {
        let (n, from) = s.recv_from(&mut buf)?;
        match buf.first().copied().filter(|_| n > 0) {
            Some(ECHO) => {
                s.send_to(&buf[..n], from)?;
            }
            Some(SINK) => *sunk.entry(from).or_default() += 1,
            Some(QUERY) => {
                let count = sunk.remove(&from).unwrap_or(0);
                s.send_to(&count.to_le_bytes(), from)?;
            }
            _ => {}
        }
    }
}

fn client(to: SocketAddr) -> io::Result<UdpSocket> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("a literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("a literal"),
    };
    let s = UdpSocket::bind(any)?;
    s.connect(to)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(s)
}

/// Back-to-back round trips of `size`-byte datagrams (the first byte is the tag, the rest
/// stamped and checked as TCP's messages are).
pub fn rr(to: SocketAddr, size: usize, warmup: Duration, dur: Duration) -> io::Result<Reply> {
    let s = client(to)?;
    let size = size.max(2);
    let (mut tx, mut rx) = (vec![ECHO; size], vec![0u8; size]);
    let mut seq = 0u64;
    let mut trip = || -> io::Result<()> {
        fill(&mut tx[1..], seq);
        s.send(&tx)?;
        let n = s.recv(&mut rx)?;
        if n != size || rx[0] != ECHO {
            return Err(io::Error::other(format!(
                "UDP echo of {n} bytes, want {size}"
            )));
        }
        verify(&rx[1..], seq)?;
        seq += 1;
        Ok(())
    };
    let start = Instant::now();
    while start.elapsed() < warmup {
        trip()?;
    }
    let mut times = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    loop {
        let t = Instant::now();
        trip()?;
        let done = Instant::now();
        times.push((done - t).as_nanos() as u64);
        if done - t0 >= dur {
            break;
        }
    }
    let count = times.len() as u64;
    let (p50_ns, p99_ns) = super::wire::percentiles(times);
    Ok(Reply {
        count,
        elapsed_s: t0.elapsed().as_secs_f64(),
        p50_ns,
        p99_ns,
        ..Reply::default()
    })
}

/// Sends `size`-byte datagrams as fast as it can for `dur` (after `warmup`); the count is what
/// the server received of them.
pub fn stream(to: SocketAddr, size: usize, warmup: Duration, dur: Duration) -> io::Result<Reply> {
    let s = client(to)?;
    let tx = vec![SINK; size.max(1)];
    let blast = |d: Duration| -> io::Result<(u64, Duration)> {
        let (start, mut sent) = (Instant::now(), 0u64);
        loop {
            for _ in 0..64 {
                s.send(&tx)?;
            }
            sent += 64;
            if start.elapsed() >= d {
                return Ok((sent, start.elapsed()));
            }
        }
    };
    blast(warmup)?;
    query(&s)?;
    let (sent, took) = blast(dur)?;
    let got = query(&s)?;
    if got > sent {
        return Err(io::Error::other(format!(
            "the server counted {got} datagrams of {sent} sent"
        )));
    }
    Ok(Reply {
        count: got,
        bytes: got * size as u64,
        elapsed_s: took.as_secs_f64(),
        ..Reply::default()
    })
}

/// The server's count of our `SINK` datagrams (asked again if the query or its answer is
/// lost: a receiver busy draining may drop either).
fn query(s: &UdpSocket) -> io::Result<u64> {
    s.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut b = [0u8; 64];
    for _ in 0..50 {
        s.send(&[QUERY])?;
        match s.recv(&mut b) {
            Ok(8) => return Ok(u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))),
            Ok(_) => {} // a late echo: not ours to count
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(
        "the server never answered the UDP count query",
    ))
}
