//! `memloop cat`: netcat for native memloop services. `--listen NAME` accepts one stream and
//! copies it to stdout; `--connect NAME` copies stdin into a stream. With `sha256sum` on both
//! sides it checks a transfer end to end; a dead peer ends it with an error that says how long
//! the stream had been silent (how fast the death was noticed).
//!
//! `--zero-copy` moves descriptors instead of bytes (`memloop::zerocopy`): the connecting side
//! reads stdin into loans of a pool of its own and sends them; the listener writes each
//! message from the sender's buffer, read in place, and drops it, which gives the buffer back.
//! At EOF the sender waits until every buffer is back and the listener has finished, so its
//! exit status says that the listener took every message and gave every buffer back.

use crate::error::{fail, CliResult, Context};
use crate::units::{fmt_size, parse_size};
use memloop::registry::RegistryError;
use memloop::zerocopy::{Pool, ZcListener, ZcPort};
use memloop::{Listener, Node, Stream};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["listen", "connect"])))]
pub struct CatArgs {
    /// Serve this name; copy the first stream that connects to stdout.
    #[arg(long, value_name = "NAME")]
    listen: Option<String>,
    /// Connect to this service; copy stdin into the stream.
    #[arg(long, value_name = "NAME")]
    connect: Option<String>,
    /// Connection attempts (one per 100 ms) while the service is not there yet.
    #[arg(long, default_value_t = 100)]
    tries: u32,
    /// Send descriptors of pool buffers instead of bytes; the listener reads them in place
    /// (both sides must say so).
    #[arg(long)]
    zero_copy: bool,
    /// Zero-copy sender: buffers in its pool.
    #[arg(long, default_value_t = 8, requires = "zero_copy")]
    buffers: u32,
    /// Zero-copy sender: bytes per buffer (e.g. 64K, 1M); at most one read of stdin each.
    #[arg(
        long,
        default_value = "64K",
        value_name = "SIZE",
        requires = "zero_copy"
    )]
    buffer_size: String,
    /// Zero-copy sender: how long to wait at EOF for every buffer to come back (seconds).
    #[arg(
        long,
        default_value_t = 30,
        value_name = "SECS",
        requires = "zero_copy"
    )]
    return_wait: u64,
}

const CHUNK: usize = 256 << 10;

pub fn run(a: &CatArgs) -> CliResult<()> {
    let node = Node::join_default("cat").context("joining the region")?;
    let started = Instant::now();
    let bytes = match (&a.listen, &a.connect) {
        (Some(name), _) if a.zero_copy => {
            let l = ZcListener::bind(&node, name).context(format!("serving {name}"))?;
            let p = l.accept().context("accepting")?;
            zc_receive(p)?
        }
        (None, Some(name)) if a.zero_copy => zc_send(&node, name, a)?,
        (Some(name), _) => {
            let l = Listener::bind(&node, name).context(format!("serving {name}"))?;
            let s = l.accept().context("accepting")?;
            receive(s)?
        }
        (None, Some(name)) => send(connect(&node, name, a.tries)?)?,
        (None, None) => return Err(fail("give --listen NAME or --connect NAME")),
    };
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "memloop cat: {bytes} bytes in {secs:.3} s ({:.2} Gbit/s)",
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

fn connect(node: &Node, name: &str, tries: u32) -> CliResult<Stream> {
    retry(name, tries, || Stream::connect(node, name))
}

/// `connect` until the service is there, at most `tries` times.
fn retry<T>(
    name: &str,
    tries: u32,
    mut connect: impl FnMut() -> Result<T, memloop::Error>,
) -> CliResult<T> {
    let mut left = tries.max(1);
    loop {
        match connect() {
            Err(memloop::Error::NoService(_)) if left > 1 => {
                left -= 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            // (A listener of the other kind declines the channel as it attaches.)
            Err(memloop::Error::Registry(RegistryError::WrongState {
                found: "DECLINED", ..
            })) => {
                return Err(fail(format!(
                    "connecting to {name}: the listener refused the channel (give --zero-copy \
                     to both ends or to neither)"
                )))
            }
            other => return other.context(format!("connecting to {name}")),
        }
    }
}

/// Copies the stream to stdout; an error says how long nothing had arrived.
fn receive(mut s: Stream) -> CliResult<u64> {
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; CHUNK];
    let (mut total, mut last) = (0u64, Instant::now());
    loop {
        match s.recv(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => {
                out.write_all(&buf[..n]).context("writing stdout")?;
                total += n as u64;
                last = Instant::now();
            }
            Err(e) => {
                return Err(fail(format!(
                    "after {total} bytes: {e} ({:.3} s after the last data)",
                    last.elapsed().as_secs_f64()
                )))
            }
        }
    }
}

/// Copies stdin into the stream, then waits for the peer to close its end.
fn send(mut s: Stream) -> CliResult<u64> {
    let mut input = std::io::stdin().lock();
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = input.read(&mut buf).context("reading stdin")?;
        if n == 0 {
            break;
        }
        s.send_all(&buf[..n]).context("sending")?;
        total += n as u64;
    }
    s.shutdown_write();
    // The reader closes after taking everything: then every byte has been consumed.
    let mut b = [0u8; 1];
    match s.recv(&mut b) {
        Ok(0) => Ok(total),
        Ok(_) => Err(fail("the listener sent data back")),
        Err(e) => Err(fail(format!("waiting for the listener to finish: {e}"))),
    }
}

/// Writes every message's segments to stdout, dropping each after writing it (its buffers go
/// back to their owner).
fn zc_receive(mut p: ZcPort) -> CliResult<u64> {
    let mut out = std::io::stdout().lock();
    let (mut total, mut msgs, mut last) = (0u64, 0u64, Instant::now());
    loop {
        match p.recv() {
            Ok(None) => break,
            Ok(Some(m)) => {
                for seg in m.segments() {
                    out.write_all(seg).context("writing stdout")?;
                }
                total += m.len() as u64;
                msgs += 1;
                last = Instant::now();
            }
            Err(e) => {
                return Err(fail(format!(
                    "after {total} bytes: {e} ({:.3} s after the last message)",
                    last.elapsed().as_secs_f64()
                )))
            }
        }
    }
    out.flush().context("writing stdout")?;
    eprintln!("memloop cat: zero-copy: {msgs} messages received");
    Ok(total)
}

/// Reads stdin into loans (one per read) and sends them; at EOF shuts down sending and waits
/// until every buffer is back and the listener has closed its end.
fn zc_send(node: &Node, name: &str, a: &CatArgs) -> CliResult<u64> {
    let size = parse_size(&a.buffer_size)?;
    let buf_size = u32::try_from(size)
        .ok()
        .filter(|&s| s > 0 && a.buffers > 0)
        .ok_or_else(|| {
            fail(format!(
                "a pool of {} buffers of {}: give at least one buffer of 1 byte to 4 GiB",
                a.buffers, a.buffer_size
            ))
        })?;
    let what = format!("a pool of {} buffers of {}", a.buffers, fmt_size(size));
    let pool = Pool::create(node, buf_size, a.buffers).context(format!("creating {what}"))?;
    let mut p = retry(name, a.tries, || ZcPort::connect(node, name))?;
    let mut input = std::io::stdin().lock();
    let (mut total, mut msgs) = (0u64, 0u64);
    loop {
        let mut loan = pool.loan().context("waiting for a free buffer")?;
        let n = input.read(&mut loan).context("reading stdin")?;
        if n == 0 {
            break; // (the loan goes back unsent)
        }
        loan.truncate(n);
        p.send(loan)
            .map_err(|e| fail(format!("sending after {total} bytes: {e}")))?;
        total += n as u64;
        msgs += 1;
    }
    p.shutdown_send();
    // Every buffer back: the listener dropped every message (it wrote them all out), or its
    // end went away (closed, dead, or it refused the channel): the listener's own end of
    // the channel, below, tells which.
    let (started, wait) = (Instant::now(), Duration::from_secs(a.return_wait));
    let mut free = pool.free_buffers().context("counting free buffers")?;
    while free < pool.buffers() {
        if started.elapsed() >= wait {
            return Err(fail(format!(
                "after {total} bytes: {} of {} buffers still held by the listener {} s after EOF",
                pool.buffers() - free,
                pool.buffers(),
                a.return_wait
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
        free = pool.free_buffers().context("counting free buffers")?;
    }
    // The listener closes its end after taking our EOF: then it took every message.
    p.set_timeout(Some(wait));
    match p.recv() {
        Ok(None) => {}
        Ok(Some(_)) => return Err(fail("the listener sent data back")),
        Err(e) => return Err(fail(format!("waiting for the listener to finish: {e}"))),
    }
    eprintln!(
        "memloop cat: zero-copy: {msgs} messages from {what}; all {} buffers back {:.3} s after EOF",
        pool.buffers(),
        started.elapsed().as_secs_f64()
    );
    Ok(total)
}
