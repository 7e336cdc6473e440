//! `memloop cat`: netcat for native memloop services. `--listen NAME` accepts one stream and
//! copies it to stdout; `--connect NAME` copies stdin into a stream. With `sha256sum` on both
//! sides it checks a transfer end to end; a dead peer ends it with an error that says how long
//! the stream had been silent (how fast the death was noticed).

use crate::error::{fail, CliResult, Context};
use memloop::{Listener, Node, Stream};
use std::io::{Read, Write};
use std::time::Instant;

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
}

const CHUNK: usize = 256 << 10;

pub fn run(a: &CatArgs) -> CliResult<()> {
    let node = Node::join_default("cat").context("joining the region")?;
    let started = Instant::now();
    let bytes = match (&a.listen, &a.connect) {
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
    let mut left = tries.max(1);
    loop {
        match Stream::connect(node, name) {
            Err(memloop::Error::NoService(_)) if left > 1 => {
                left -= 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
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
