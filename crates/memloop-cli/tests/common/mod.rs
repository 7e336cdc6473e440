//! What the benchmark smoke tests share: the binary, whether this machine can run them, and a
//! `memloop` command pointed at the preload `cargo test` built.

use std::path::Path;
use std::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_memloop");
const PRELOAD: &str = "libmemloop_preload.so";

/// Why these tests cannot run here (they need root and `ip` for network namespaces).
pub fn unsupported() -> Option<&'static str> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root");
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("`ip` (iproute2) missing");
    }
    None
}

/// `memloop` with `MEMLOOP_PRELOAD_LIB` set, and whether a preload was found: `cargo test`
/// builds it into deps/ without copying it next to the binary, so point `memloop run` at the
/// freshest copy there is.
pub fn memloop_with_preload() -> (Command, bool) {
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
