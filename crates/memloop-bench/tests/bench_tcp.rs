//! `memloop bench tcp --quick --json`: every path produces well-formed, positive figures and the
//! run leaves nothing behind. Needs root and `ip` (network namespaces); without them the runner
//! reports it ignored with the reason (failed under `CI`). Figures are never compared with each other: timings are not behaviour.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::{bench_with_preload, needs_domains};

/// The tests each path must have figures for.
fn tests_of(path: &str) -> &'static [&'static str] {
    match path {
        "veth+preload" => &["rr", "stream"],
        _ => &["rr", "stream", "crr", "sleep-rr"],
    }
}

fn main() -> std::process::ExitCode {
    memloop_testkit::run(vec![memloop_testkit::test!(
        quick_run_reports_positive_figures_for_every_path
    )
    .needs(needs_domains())])
}

fn quick_run_reports_positive_figures_for_every_path() {
    let json = std::env::temp_dir().join(format!("bench-tcp-{}.json", std::process::id()));
    let (mut cmd, preload_built) = bench_with_preload();
    let child = cmd
        .args(["tcp", "--quick", "--json"])
        .arg(&json)
        .env_remove("MEMLOOP_REGION")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run memloop-bench");
    let pid = child.id();
    let out = child.wait_with_output().expect("wait for memloop");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "memloop bench tcp failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    let text = std::fs::read_to_string(&json).expect("the JSON file");
    let _ = std::fs::remove_file(&json);
    let v: Value = serde_json::from_str(&text).expect("well-formed JSON");

    assert_eq!(v["bench"], "tcp");
    assert!(
        v["config"]["duration_s"].as_f64().unwrap() > 0.0,
        "{}",
        v["config"]
    );
    let records = v["records"].as_array().expect("records");
    let paths = v["paths"].as_array().expect("paths");
    let names: Vec<&str> = paths.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "memloop",
            "veth+bridge",
            "memloop-v6",
            "veth+bridge-v6",
            "memloop-lo",
            "tcp-loopback",
            "unix",
            "veth+preload"
        ]
    );
    for p in paths {
        let name = p["name"].as_str().unwrap();
        let mine: Vec<&Value> = records.iter().filter(|r| r["path"] == name).collect();
        if p["available"] != true {
            let reason = p["reason"].as_str().unwrap_or_default();
            // Only the preloaded paths may be missing, and only while the preload is not built.
            assert!(
                name.contains("memloop") || name == "veth+preload",
                "{name} unavailable: {reason}"
            );
            assert!(
                !preload_built && reason.contains("preload not built"),
                "{name} unavailable although the preload is built: {reason}"
            );
            assert!(mine.is_empty(), "{name}: figures for an unavailable path");
            continue;
        }
        for test in tests_of(name) {
            assert!(
                mine.iter().any(|r| r["test"] == *test),
                "{name}: no {test} figures"
            );
        }
        for r in mine {
            let positive = |k: &str| r[k].as_f64().is_some_and(|x| x.is_finite() && x > 0.0);
            assert!(positive("value") && positive("size"), "{name}: {r}");
            assert!(r["p99"].is_null() || positive("p99"), "{name}: {r}");
            assert!(r["unit"].is_string() && r["test"].is_string(), "{r}");
        }
    }
    for row in v["preload_remote_cost"]
        .as_array()
        .expect("remote cost rows")
    {
        assert!(row["plain"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["preload"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["cost_pct"].as_f64().unwrap().is_finite(), "{row}");
    }

    // Nothing left behind: domains, bridge, regions.
    let prefix = format!("mlb{pid}");
    let netns = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(!netns.contains(&prefix), "leftover namespaces: {netns}");
    let links = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["link", "show"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(!links.contains(&prefix), "leftover interfaces: {links}");
    for r in [format!("tcpbench-{pid}"), format!("tcpbench-{pid}-far")] {
        assert!(
            !Path::new("/dev/shm").join(format!("memloop-{r}")).exists(),
            "leftover region {r}"
        );
    }
}
