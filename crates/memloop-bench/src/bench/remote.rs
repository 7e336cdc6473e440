//! `memloop bench serve` and `memloop bench probe`: the two ends of one measurement, started by
//! hand where the driver of `bench tcp` cannot reach, e.g. one end in each VM. The same ends
//! as `bench tcp` (every message checked), over TCP (`host:port`, under `memloop run` or
//! not), a Unix socket, or a native memloop service (`memloop:NAME`).

use super::tcp::peer;
use super::tcp::wire::{Addr, Reply, Request, Test};
use crate::error::{fail, CliResult, Context};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Where to listen: `host:port`, `unix:@name` or `memloop:NAME`.
    #[arg(long)]
    addr: String,
}

#[derive(clap::Args)]
pub struct ProbeArgs {
    /// The server (`memloop bench serve`): `host:port`, `unix:@name` or `memloop:NAME`.
    #[arg(long)]
    addr: String,
    /// rr (request/response), stream (one way), crr (short connections), fan (request/response
    /// on --conns connections at once, epoll at both ends).
    #[arg(long, value_enum, default_value = "rr")]
    test: Test,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Seconds measured (after a warm-up of a fifth of that).
    #[arg(long, default_value_t = 1.0)]
    secs: f64,
    /// fan: connections at once, each with one request in flight.
    #[arg(long, default_value_t = 100)]
    conns: usize,
    /// Connection attempts before giving up (one per 100 ms): the server may still be starting.
    #[arg(long, default_value_t = 50)]
    tries: u32,
}

pub fn serve(a: &ServeArgs) -> CliResult<()> {
    let addr = Addr::parse(&a.addr).context(format!("--addr {}", a.addr))?;
    let listener = addr.listen().context("listening")?;
    println!("serving on {}", listener.local()?);
    peer::serve(&listener)
}

/// Runs one measurement and prints its reply as one JSON line (the figures, or the error).
pub fn probe(a: &ProbeArgs) -> CliResult<()> {
    if a.secs.is_nan() || a.secs <= 0.0 || a.size == 0 {
        return Err(fail("--secs and --size must be positive"));
    }
    let addr = Addr::parse(&a.addr).context(format!("--addr {}", a.addr))?;
    let req = Request {
        test: a.test,
        size: a.size,
        warmup_s: a.secs / 5.0,
        dur_s: a.secs,
        sleep_us: 0,
        conns: a.conns,
    };
    let r = run_when_listening(&req, &addr, a.tries);
    super::tcp::wire::leave_region();
    let r = r.context(format!("{:?} against {}", a.test, a.addr))?;
    println!("{}", serde_json::to_string(&r)?);
    match r.error {
        Some(e) => Err(fail(e)),
        None => Ok(()),
    }
}

/// Runs `req`, retrying while nobody listens yet (a VM boots at its own pace).
fn run_when_listening(req: &Request, addr: &Addr, tries: u32) -> std::io::Result<Reply> {
    let mut left = tries.max(1);
    loop {
        match req.run(addr) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && left > 1 => {
                left -= 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            other => return other,
        }
    }
}
