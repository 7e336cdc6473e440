//! `memloop-bench`, run as `memloop bench …`: every path measured side by side, each against a
//! peer process. Its own binary so that the operator tool `memloop` does not link plotters and
//! indicatif. The peers it starts are this binary again (hidden commands below), including
//! `domains exec` and `run`, shared with `memloop` through its library: the benchmark works
//! without the `memloop` binary.
// Unsafe code only in `bench::switch::fdpass` (libc's sendmsg with SCM_RIGHTS) and
// `bench::process::forking` (libc's fork, exit, waitpid), which allow it.
#![deny(unsafe_code)]

mod bench;
mod peer;
mod zc_scribble;

// The CLI's helpers, under the paths the benchmark modules use.
use memloop_cli::{error, units};

use clap::{Parser, Subcommand};
use memloop_cli::{blk_cmd, domains, init_logging, link_cmd, pipe_cmd, region_cmd, run};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memloop-bench",
    bin_name = "memloop bench",
    version,
    about = "memloop's benchmarks: every path side by side in one run"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    #[command(flatten)]
    Bench(bench::BenchCmd),
    /// The far end of a `native` path (started by the benchmark).
    #[command(hide = true)]
    Peer(peer::PeerArgs),
    /// An end of `tcp` and `study` (an ordinary socket program).
    #[command(hide = true)]
    TcpPeer(bench::tcp::peer::PeerArgs),
    /// An end of `switch`.
    #[command(hide = true)]
    SwitchPeer(bench::switch::peer::PeerArgs),
    /// An end of `zerocopy` (echo, pipeline stages).
    #[command(hide = true)]
    ZcPeer(bench::zerocopy::ZcPeerArgs),
    /// A process of `process` (fork loops, echo servers, short connections).
    #[command(hide = true)]
    ProcPeer(bench::process::peer::PeerArgs),
    /// An end of `pipe` (the relay's source and sink).
    #[command(hide = true)]
    PipePeer(bench::pipe::peer::PeerArgs),
    /// `memloop pipe`, for the service of `pipe`.
    #[command(hide = true, subcommand)]
    PipeService(pipe_cmd::PipeCmd),
    /// `memloop link`, for the link services of `link` (each stops when its stdin closes if
    /// MEMLOOP_BENCH_STOP_ON_EOF is set).
    #[command(hide = true, subcommand)]
    LinkService(link_cmd::LinkCmd),
    /// `memloop blk`, for the export and attach services of `blk` (run with --foreground;
    /// each stops when its stdin closes if MEMLOOP_BENCH_STOP_ON_EOF is set).
    #[command(hide = true, subcommand)]
    BlkService(blk_cmd::BlkCmd),
    /// A zero-copy receiver that writes into what it received and must die of SIGSEGV
    /// (tests/vm/memloop.sh).
    #[command(hide = true)]
    ZcScribble(zc_scribble::ScribbleArgs),
    /// `memloop domains`, for the peers' domains.
    #[command(hide = true, subcommand)]
    Domains(domains::DomainsCmd),
    /// `memloop run`, for the preloaded peers.
    #[command(hide = true)]
    Run(run::RunArgs),
    /// `memloop region`, for cleaning up after a killed run.
    #[command(hide = true, subcommand)]
    Region(region_cmd::RegionCmd),
}

fn main() -> ExitCode {
    init_logging();
    let result = match Cli::parse().cmd {
        Cmd::Bench(c) => bench::run(c),
        Cmd::Peer(a) => peer::run(&a),
        Cmd::TcpPeer(a) => bench::tcp::peer::run(&a),
        Cmd::SwitchPeer(a) => bench::switch::peer::run(&a),
        Cmd::ProcPeer(a) => bench::process::peer::run(&a),
        Cmd::ZcPeer(a) => bench::zerocopy::run_peer(&a),
        Cmd::ZcScribble(a) => zc_scribble::run(&a),
        Cmd::PipePeer(a) => bench::pipe::peer::run(&a),
        Cmd::PipeService(c) => pipe_cmd::run(c),
        Cmd::LinkService(c) => bench::link::service(c),
        Cmd::BlkService(c) => bench::blk::service(c),
        Cmd::Domains(c) => domains::run(c),
        Cmd::Run(a) => run::run(&a),
        Cmd::Region(c) => region_cmd::run(c),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memloop bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}
