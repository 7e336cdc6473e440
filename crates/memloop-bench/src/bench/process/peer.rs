//! `memloop-bench proc-peer` (hidden): the processes of `memloop bench process`, each an
//! ordinary program (std::net, libc's fork): nothing here uses memloop. The driver starts them
//! with or without the preload library in their environment.
//!
//! - `fork --n N [--hold ADDR]`: N × (fork, the child calls `exit(0)`, waitpid), then N × the
//!   same with `_exit(0)`; prints `{"exit_us":…,"raw_exit_us":…,"preloaded":…}` (means per
//!   iteration). With `--hold`, first connects to the echo server at ADDR and exchanges a byte,
//!   keeps the connection open through both loops, and exchanges a byte again after them.
//! - `serve --listen ADDR [--fork]`: prints `{"ready":true,"pid":…,"port":…,"preloaded":…}`,
//!   then serves connections one at a time (with `--fork`, a child per connection): echoes
//!   what it reads until the client closes. Exits when its stdin reaches end of file.
//! - `connect --addr A --n N`: 20 unmeasured, then N measured short connections (connect,
//!   write 1 byte, read 1 byte, close); prints `{"mean_us":…,"p50_us":…,"preloaded":…}`.
//! - `once --addr A`: one short connection, then exit (the driver times the whole process).
//! - `noop`: exits at once (the reference for `once`).

use super::forking::{fork_for, fork_loop, ChildExit};
use crate::error::{fail, CliResult, Context};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Unmeasured short connections before the measured ones.
const CONNECT_WARMUP: u32 = 20;
/// Unmeasured forks before each measured loop.
const FORK_WARMUP: u32 = 10;

#[derive(clap::Args)]
pub struct PeerArgs {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(clap::Subcommand)]
enum Mode {
    /// Times fork + exit and fork + _exit.
    Fork {
        #[arg(long)]
        n: u32,
        /// An echo server to hold a connection to during the loops.
        #[arg(long, value_name = "ADDR")]
        hold: Option<String>,
    },
    /// An echo server, iterative or fork-per-connection.
    Serve {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        #[arg(long)]
        fork: bool,
    },
    /// Times N sequential short connections.
    Connect {
        #[arg(long)]
        addr: String,
        #[arg(long)]
        n: u32,
    },
    /// One short connection.
    Once {
        #[arg(long)]
        addr: String,
    },
    /// Nothing.
    Noop,
}

pub fn run(a: &PeerArgs) -> CliResult<()> {
    match &a.mode {
        Mode::Fork { n, hold } => fork(*n, hold.as_deref()),
        Mode::Serve { listen, fork } => serve(listen, *fork),
        Mode::Connect { addr, n } => connect(addr, *n),
        Mode::Once { addr } => Ok(exchange(addr).context(format!("connecting to {addr}"))?),
        Mode::Noop => Ok(()),
    }
}

/// Whether the preload library is mapped into this process.
fn preloaded() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|m| m.contains("/libmemloop"))
}

/// One byte there and back on `s`.
fn ping(s: &mut TcpStream) -> std::io::Result<()> {
    s.write_all(&[0x5a])?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    if b[0] != 0x5a {
        return Err(std::io::Error::other(format!("echoed {:#x}", b[0])));
    }
    Ok(())
}

/// One short connection: connect, one byte there and back, close.
fn exchange(addr: &str) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    ping(&mut s)
}

fn fork(n: u32, hold: Option<&str>) -> CliResult<()> {
    if n == 0 {
        return Err(fail("--n must be at least 1"));
    }
    let mut held = match hold {
        Some(addr) => {
            let mut s = TcpStream::connect(addr).context(format!("connecting to {addr}"))?;
            ping(&mut s).context("the first exchange on the held connection")?;
            Some(s)
        }
        None => None,
    };
    let timed = |how| -> CliResult<f64> {
        fork_loop(FORK_WARMUP, how).context("forking")?;
        fork_loop(n, how).context("forking")
    };
    let exit_us = timed(ChildExit::Exit)?;
    let raw_exit_us = timed(ChildExit::RawExit)?;
    if let Some(s) = held.as_mut() {
        ping(s).context("the exchange on the held connection after the forks")?;
    }
    println!(
        "{}",
        json!({ "exit_us": exit_us, "raw_exit_us": raw_exit_us, "preloaded": preloaded() })
    );
    Ok(())
}

/// Echoes until the client closes (a short connection: one byte, then end of stream).
fn echo(c: &mut TcpStream) {
    let mut buf = [0u8; 64];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if let Err(e) = c.write_all(&buf[..n]) {
                    eprintln!("memloop-bench proc-peer: write: {e}");
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("memloop-bench proc-peer: read: {e}");
                return;
            }
        }
    }
}

fn serve(listen: &str, forking: bool) -> CliResult<()> {
    let listener = TcpListener::bind(listen).context(format!("listening on {listen}"))?;
    let port = listener.local_addr()?.port();
    println!(
        "{}",
        json!({ "ready": true, "pid": std::process::id(), "port": port, "preloaded": preloaded() })
    );
    crate::bench::tcp::peer::exit_when_stdin_closes();
    loop {
        let mut c = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                eprintln!("memloop-bench proc-peer: accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        if forking {
            fork_for(&listener, c, echo);
        } else {
            echo(&mut c);
        }
    }
}

fn connect(addr: &str, n: u32) -> CliResult<()> {
    if n == 0 {
        return Err(fail("--n must be at least 1"));
    }
    for _ in 0..CONNECT_WARMUP {
        exchange(addr).context(format!("connecting to {addr}"))?;
    }
    let mut each = Vec::with_capacity(n as usize);
    let t0 = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        exchange(addr).context(format!("connecting to {addr}"))?;
        each.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mean = t0.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    println!(
        "{}",
        json!({ "mean_us": mean, "p50_us": super::median(&each), "preloaded": preloaded() })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's per-connection handling and the client's exchange, over loopback.
    #[test]
    fn short_connections_are_echoed() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for c in listener.incoming() {
                echo(&mut c.unwrap());
            }
        });
        for _ in 0..3 {
            exchange(&addr).unwrap();
        }
        // A held connection carries several exchanges.
        let mut s = TcpStream::connect(&addr).unwrap();
        ping(&mut s).unwrap();
        ping(&mut s).unwrap();
    }
}
