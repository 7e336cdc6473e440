//! `memloop bench switch --quick --json`: the run completes, its JSON parses and every available
//! path has positive figures; the preloaded paths switched every connection and brought every
//! one back to its ring. Needs root and
//! `ip` (network namespaces); without them the runner reports it ignored with the reason
//! (failed under `CI`). Figures are never compared with thresholds: timings are not behaviour.

use serde_json::Value;
use std::path::Path;
use std::process::Stdio;

mod common;
use common::{bench_with_preload, needs_domains};

fn main() -> std::process::ExitCode {
    memloop_testkit::run(vec![memloop_testkit::test!(
        quick_run_reports_parseable_figures
    )
    .needs(needs_domains())])
}

fn quick_run_reports_parseable_figures() {
    let json = std::env::temp_dir().join(format!("bench-switch-{}.json", std::process::id()));
    let (mut cmd, preload_built) = bench_with_preload();
    let child = cmd
        .args(["switch", "--quick", "--json"])
        .arg(&json)
        .env_remove("MEMLOOP_REGION")
        .env_remove("MEMLOOP_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run memloop-bench");
    let pid = child.id();
    let out = child.wait_with_output().expect("wait for memloop-bench");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "memloop bench switch failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    assert!(stdout.contains("trigger → return"), "{stdout}");
    let text = std::fs::read_to_string(&json).expect("the JSON file");
    let _ = std::fs::remove_file(&json);
    let v: Value = serde_json::from_str(&text).expect("well-formed JSON");
    assert_eq!(v["bench"], "switch");
    let reps = v["config"]["reps"].as_u64().expect("reps");
    assert!(reps > 0, "{}", v["config"]);
    let figures = v["figures"].as_array().expect("figures");
    let paths = v["paths"].as_array().expect("paths");
    let names: Vec<&str> = paths.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["memloop-lo", "tcp-loopback", "memloop", "veth+bridge"]
    );
    for p in paths {
        let name = p["name"].as_str().unwrap();
        let mine: Vec<&Value> = figures.iter().filter(|f| f["path"] == name).collect();
        if p["available"] != true {
            let reason = p["reason"].as_str().unwrap_or_default();
            assert!(
                p["preload"] == true && !preload_built && reason.contains("preload not built"),
                "{name} unavailable: {reason}"
            );
            assert!(mine.is_empty(), "{name}: figures for an unavailable path");
            continue;
        }
        // Both variants ran on fresh connections each time.
        assert_eq!(p["reps"].as_u64(), Some(2 * reps), "{p}");
        if p["preload"] == true {
            assert_eq!(
                p["switched"], p["reps"],
                "{name}: not every connection switched"
            );
            assert_eq!(
                p["promoted"], p["reps"],
                "{name}: not every connection came back to its ring"
            );
        }
        let has = |variant: &str, metric: &str| {
            mine.iter()
                .any(|f| f["variant"] == variant && f["metric"].as_str().unwrap().contains(metric))
        };
        for variant in ["busy", "idle"] {
            assert!(has(variant, "trigger → return"), "{name} {variant}");
            if p["preload"] == true {
                assert!(
                    has(variant, "peer on TCP"),
                    "{name} {variant}: peer not observed"
                );
                assert!(
                    has(variant, "trigger → peer on the ring"),
                    "{name} {variant}: peer's promotion not observed"
                );
            }
            assert!(
                has(variant, "promote: first round trip"),
                "{name} {variant}"
            );
        }
        assert!(has("busy", "stall"), "{name}: no stall figures");
        assert!(
            has("busy", "demote + promote stall"),
            "{name}: no stall sums"
        );
        assert!(has("-", "round trip after"), "{name}: no round trips");
        assert!(has("-", "round trip after the promotion"), "{name}");
        for f in mine {
            let n = |k: &str| f[k].as_f64().unwrap_or(f64::NAN);
            assert!(n("n") >= 1.0, "{f}");
            assert!(n("p50").is_finite() && n("p50") >= 0.0, "{f}");
            assert!(n("p99") >= n("p50"), "{f}");
            assert!(f["rtts_p50"].is_null() || n("rtts_p50").is_finite(), "{f}");
        }
    }
    // Nothing left behind: the region (the domains are checked by bench_tcp's smoke test).
    let region = format!("swbench-{pid}");
    assert!(
        !Path::new("/dev/shm")
            .join(format!("memloop-{region}"))
            .exists(),
        "leftover region {region}"
    );
}
