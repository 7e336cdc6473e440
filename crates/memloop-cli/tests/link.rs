//! The `memloop link` suite (tests/link/run.sh): a link between two domains (network namespaces
//! on a bridge) whose wire is a region; ping, iperf3 TCP and UDP, a static Go HTTP client and
//! server, carrier loss on `link down`, a third side refused, and a SIGKILLed side restarted
//! under a live TCP stream. Needs root, `ip`, `jq`, `iperf3`, `ping` and `go`; without them the
//! runner reports it ignored with the reason (failed under `CI`).
//!
//!     cargo test --release -p memloop-cli --test link -- --nocapture
//!
//! ML_LINK_ONLY (→ --only) picks cases; the ML_* variables run.sh reads are passed on.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

fn main() -> std::process::ExitCode {
    use memloop_testkit::{all, root, tool};
    memloop_testkit::run(vec![memloop_testkit::test!(link_suite_across_two_domains)
        .needs(all([
            root(),
            tool("ip", &["-V"]),
            tool("jq", &["--version"]),
            tool("iperf3", &["--version"]),
            tool("ping", &["-V"]),
            tool("go", &["version"]),
            tool("timeout", &["--version"]),
        ]))])
}

fn link_suite_across_two_domains() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/link/run.sh");
    let mut cmd = Command::new("timeout");
    // The suite bounds every case; this bounds the whole run (the Go build included).
    cmd.args(["-k", "10", "600"]).arg(&script);
    if let Ok(only) = std::env::var("ML_LINK_ONLY") {
        cmd.args(["--only", &only]);
    }
    cmd.env("MEMLOOP_BIN", BIN);
    let status = cmd.status().expect("run tests/link/run.sh");
    assert!(
        status.success(),
        "tests/link/run.sh failed ({status}); see the case lines above and the kept logs"
    );
}
