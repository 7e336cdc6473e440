//! What the benchmark smoke tests share: the binary, what this machine must offer to run them,
//! and a `memloop-bench` command pointed at the preload `cargo test` built.

use std::path::Path;
use std::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_memloop-bench");
const PRELOAD: &str = "libmemloop.so";

/// Root and `ip` (iproute2), for network namespaces.
pub fn needs_domains() -> memloop_testkit::Need {
    memloop_testkit::all([
        memloop_testkit::root(),
        memloop_testkit::tool("ip", &["-V"]),
    ])
}

/// `memloop-bench` with `MEMLOOP_PRELOAD_LIB` set, and whether a preload was found: `cargo
/// test` builds it into deps/ without copying it next to the binary, so point `run` at the
/// freshest copy there is.
pub fn bench_with_preload() -> (Command, bool) {
    let bin = Path::new(BIN);
    let preload = [
        bin.with_file_name("deps").join(PRELOAD),
        bin.with_file_name(PRELOAD),
    ]
    .into_iter()
    .find(|p| p.is_file());
    let mut cmd = Command::new(BIN);
    if let Some(lib) = &preload {
        cmd.env("MEMLOOP_PRELOAD_LIB", lib);
    }
    (cmd, preload.is_some())
}
