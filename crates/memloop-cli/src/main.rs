//! `memloop`: manage regions, show what is in them, and benchmark the native path against the
//! kernel's.
#![forbid(unsafe_code)]

mod bench;
mod cat;
mod domains;
mod error;
mod peer;
mod region_cmd;
mod run;
mod status;
mod units;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memloop",
    version,
    about = "Shared-memory channels between co-resident processes and VMs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create, inspect or destroy a region.
    #[command(subcommand)]
    Region(region_cmd::RegionCmd),
    /// Members, endpoints, channels and counters of a region.
    Status(status::StatusArgs),
    /// Benchmarks, side by side in one run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// The far end of a benchmark (started by `memloop bench`).
    #[command(hide = true)]
    BenchPeer(peer::PeerArgs),
    /// An end of `memloop bench tcp` (an ordinary socket program).
    #[command(hide = true)]
    BenchTcpPeer(bench::tcp::peer::PeerArgs),
    /// Network-namespace domains on a bridge (the veth+bridge baseline).
    #[command(subcommand)]
    Domains(domains::DomainsCmd),
    /// Run an unmodified program with TCP to co-resident peers over shared memory (LD_PRELOAD).
    Run(run::RunArgs),
    /// Copy stdin into a native memloop stream, or one stream to stdout (netcat for services).
    Cat(cat::CatArgs),
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Region(c) => region_cmd::run(c),
        Cmd::Status(a) => status::run(&a),
        Cmd::Bench(c) => bench::run(c),
        Cmd::BenchPeer(a) => peer::run(&a),
        Cmd::BenchTcpPeer(a) => bench::tcp::peer::run(&a),
        Cmd::Domains(c) => domains::run(c),
        Cmd::Run(a) => run::run(&a),
        Cmd::Cat(a) => cat::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memloop: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logging is off unless `MEMLOOP_LOG` holds a filter (e.g. `debug`, `memloop=trace`).
fn init_logging() {
    let Ok(filter) = std::env::var("MEMLOOP_LOG") else {
        return;
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("memloop: ignoring bad MEMLOOP_LOG {filter:?}: {e}");
        tracing_subscriber::EnvFilter::new("off")
    });
    // Colour only for a terminal: logs are often redirected to a file.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
}
