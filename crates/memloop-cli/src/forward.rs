//! `memloop bench …` → `memloop-bench …`: the benchmarks are their own binary, installed (and
//! built) next to this one.

use memloop_cli::error::{fail, CliResult, Context};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The benchmark binary's file name.
pub const BENCH_BIN: &str = "memloop-bench";

/// Replaces this process with `memloop-bench ARGS`: same pid, signals and exit status, so
/// scripts and tests cannot tell the forwarding apart. Returns only on failure.
pub fn bench(args: &[OsString]) -> CliResult<()> {
    let exe = std::env::current_exe().context("locating the memloop executable")?;
    let bin = exe.with_file_name(BENCH_BIN);
    if !bin.is_file() {
        return Err(fail(format!(
            "`memloop bench` runs {}, which is missing: build it with \
             `cargo build --release -p memloop-bench` (or `cargo build --release --workspace`)",
            bin.display()
        )));
    }
    let e = Command::new(&bin).args(args).exec();
    Err(fail(format!("cannot execute {}: {e}", bin.display())))
}
