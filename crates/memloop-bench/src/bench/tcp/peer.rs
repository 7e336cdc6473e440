//! `memloop-bench tcp-peer` (hidden): the two ends of `memloop bench tcp`, each an ordinary
//! socket program. Nothing here uses memloop: when the driver starts an end under
//! `memloop run`, the preloaded library sees plain std::net calls, as from any application.
//!
//! - `--role server --addr A`: listens on A (`host:port`, port 0 for any, or `unix:@name`),
//!   prints `{"ready":true,"pid":..,"addr":..}` and serves connections until stdin closes.
//! - `--role client --addr A`: prints `{"ready":true,"pid":..}`, then for each JSON request
//!   line on stdin runs that measurement against A and prints one JSON reply line; exits at end
//!   of stdin.
//! - `--role janitor`: the clean-up of last resort. It waits for stdin to close; unless the
//!   driver wrote `done` first (it cleaned up itself), the driver died, so it removes the
//!   driver's domains and regions.
//!
//! Servers and clients exit when their stdin closes, so they never outlive the driver.

use super::wire::{self, Addr, Op, Reply, Request};
use crate::error::{fail, CliResult, Context};
use serde_json::json;
use std::io::{BufRead, Read};
use std::process::{Command, Stdio};
use std::time::Duration;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Role {
    Server,
    Client,
    Janitor,
}

#[derive(clap::Args)]
pub struct PeerArgs {
    #[arg(long, value_enum)]
    role: Role,
    /// Server: where to listen; client: where to connect (`host:port` or `unix:@name`).
    #[arg(long)]
    addr: Option<String>,
    /// CPU to pin this process to (used when `taskset` is not available).
    #[arg(long)]
    cpu: Option<usize>,
    /// Janitor: the domains prefix to remove.
    #[arg(long)]
    prefix: Option<String>,
    /// Janitor: regions to remove.
    #[arg(long)]
    region: Vec<String>,
}

pub fn run(a: &PeerArgs) -> CliResult<()> {
    if let Some(cpu) = a.cpu {
        crate::bench::pin_peer(Some(cpu))?;
    }
    let addr = || -> CliResult<Addr> {
        let s = a
            .addr
            .as_deref()
            .ok_or_else(|| fail("--addr is required"))?;
        Addr::parse(s).context(format!("--addr {s}"))
    };
    match a.role {
        Role::Server => server(&addr()?),
        Role::Client => client(&addr()?),
        Role::Janitor => janitor(a.prefix.as_deref(), &a.region),
    }
}

fn say(v: serde_json::Value) {
    // One line per message; stdout is line buffered.
    println!("{v}");
}

fn server(addr: &Addr) -> CliResult<()> {
    let listener = addr.listen().context("listening")?;
    if let wire::Listener::Tcp(l) = &listener {
        super::udp::serve(l.local_addr()?).context("binding the UDP socket")?;
    }
    say(json!({ "ready": true, "pid": std::process::id(), "addr": listener.local()? }));
    exit_when_stdin_closes();
    serve(&listener)
}

/// Serves every connection's measurement (in a thread each, short connections in line).
pub fn serve(listener: &wire::Listener) -> ! {
    loop {
        let mut c = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("memloop-bench tcp-peer: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let mut h = [0u8; wire::HEADER];
        let op = c.read_exact(&mut h).and_then(|()| wire::parse_header(&h));
        match op {
            // Short connections are served in line, as a simple server would.
            Ok((Op::Crr, _)) => report(wire::serve_crr(&mut c), "crr"),
            Ok((Op::Fan, _)) => report(super::fan::adopt(c), "fan"),
            Ok((op, size)) => {
                std::thread::spawn(move || {
                    let r = match op {
                        Op::Stream => wire::serve_stream(&mut c, size),
                        _ => wire::serve_rr(&mut c, size),
                    };
                    report(r, &format!("{op:?} {size} B"));
                });
            }
            Err(e) => eprintln!("memloop-bench tcp-peer: connection header: {e}"),
        }
    }
}

fn report(r: std::io::Result<()>, what: &str) {
    if let Err(e) = r {
        eprintln!("memloop-bench tcp-peer: {what}: {e}");
    }
}

/// The driver holds our stdin: when it goes away (whatever happened to it), so do we.
pub(crate) fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().lock().read_to_end(&mut sink);
        std::process::exit(0);
    });
}

fn client(addr: &Addr) -> CliResult<()> {
    say(json!({ "ready": true, "pid": std::process::id() }));
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading a request")?;
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => req.run(addr).unwrap_or_else(|e| Reply {
                error: Some(e.to_string()),
                ..Reply::default()
            }),
            Err(e) => Reply {
                error: Some(format!("bad request {line:?}: {e}")),
                ..Reply::default()
            },
        };
        say(serde_json::to_value(&reply)?);
    }
    Ok(())
}

fn janitor(prefix: Option<&str>, regions: &[String]) -> CliResult<()> {
    let mut said = String::new();
    let _ = std::io::stdin().lock().read_to_string(&mut said);
    if said.trim() == "done" {
        return Ok(());
    }
    // Give the peers a moment to notice their stdin closed and exit.
    std::thread::sleep(Duration::from_millis(500));
    let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
    let quiet = |args: &[&str]| {
        let _ = Command::new(&exe)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    };
    if let Some(p) = prefix {
        quiet(&["domains", "down", "--prefix", p]);
    }
    for r in regions {
        quiet(&["region", "destroy", "--region", r]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::tcp::wire::Test;

    /// A server thread on loopback and every measurement against it: behaviour, not speed.
    #[test]
    fn every_test_runs_against_the_server() {
        let listener = Addr::parse("127.0.0.1:0").unwrap().listen().unwrap();
        let addr = Addr::parse(&listener.local().unwrap()).unwrap();
        std::thread::spawn(move || loop {
            let mut c = listener.accept().unwrap();
            let mut h = [0u8; wire::HEADER];
            c.read_exact(&mut h).unwrap();
            let (op, size) = wire::parse_header(&h).unwrap();
            std::thread::spawn(move || match op {
                Op::Crr => wire::serve_crr(&mut c).unwrap(),
                Op::Stream => wire::serve_stream(&mut c, size).unwrap(),
                Op::Rr => wire::serve_rr(&mut c, size).unwrap(),
                Op::Fan => super::super::fan::adopt(c).unwrap(),
            });
        });
        for (test, size) in [
            (Test::Rr, 1),
            (Test::Rr, 20000),
            (Test::Stream, 7),
            (Test::Stream, 65536),
            (Test::Crr, 1),
            (Test::SleepRr, 64),
            (Test::Fan, 64),
        ] {
            let req = Request {
                test,
                size,
                warmup_s: 0.005,
                dur_s: 0.02,
                sleep_us: 500,
                conns: 50,
            };
            let r = req.run(&addr).unwrap();
            assert!(
                r.error.is_none() && r.count > 0 && r.elapsed_s > 0.0,
                "{test:?}: {r:?}"
            );
        }
    }
}
