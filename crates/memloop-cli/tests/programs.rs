//! The real-program suite (tests/programs/run.sh): python3, curl + nginx, redis, iperf3,
//! sockperf and PostgreSQL with the server in one domain and the client in another, both under
//! `memloop run`, in the ring and the fallback variant. Slow, needs root and installs Debian
//! packages, so it is ignored by default:
//!
//!     cargo test --release -p memloop-cli --test programs -- --ignored --nocapture
//!
//! Passed on to run.sh: ML_PROGRAMS_ONLY (→ --only), ML_PROGRAMS_VARIANT (→ --variant), and the
//! ML_* / MEMLOOP_PRELOAD_LIB variables run.sh reads (e.g. ML_NO_PRELOAD=1: plain TCP).
//! The library is taken from next to the memloop binary under test unless MEMLOOP_PRELOAD_LIB
//! says otherwise: build it first (`cargo build --release -p memloop-preload`).

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

fn main() -> std::process::ExitCode {
    memloop_testkit::run(vec![memloop_testkit::test!(
        real_programs_across_two_domains
    )
    .ignore("slow: real programs across two domains; run with --ignored")
    .needs(memloop_testkit::root())])
}

fn real_programs_across_two_domains() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/programs/run.sh");
    let mut cmd = Command::new("timeout");
    // The suite bounds every case; this bounds the whole run (installing packages included).
    cmd.args(["-k", "30", "3600"]).arg(&script);
    if let Ok(only) = std::env::var("ML_PROGRAMS_ONLY") {
        cmd.args(["--only", &only]);
    }
    let variant = std::env::var("ML_PROGRAMS_VARIANT").unwrap_or_else(|_| "both".into());
    cmd.args(["--variant", &variant]);
    cmd.env("MEMLOOP_BIN", BIN);
    let status = cmd.status().expect("run tests/programs/run.sh");
    assert!(
        status.success(),
        "tests/programs/run.sh failed ({status}); see the table above and the kept logs"
    );
}
