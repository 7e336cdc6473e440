//! `memloop bench link --quick --json`: every figure is there on both paths (the link and
//! veth+bridge), each link figure was routed (the link's counters cover its traffic: the bench
//! says so in the figure's note, and fails otherwise), the ratios and the idle CPU are
//! reported, and the run leaves nothing behind. Needs root, `ip` and /dev/net/tun; without
//! them the runner reports it ignored with the reason (failed under `CI`). iperf3 and ping are
//! needed for their figures (CI installs them: tests/programs/install-deps.sh). Figures are
//! never compared with targets: timings are not behaviour.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

#[allow(dead_code)]
mod common;
use common::{needs_domains, BIN};

fn main() -> std::process::ExitCode {
    let tun = if Path::new("/dev/net/tun").exists() {
        Ok(())
    } else {
        Err("needs /dev/net/tun (TUN devices)".to_string())
    };
    memloop_testkit::run(vec![memloop_testkit::test!(
        quick_link_bench_measures_both_paths_and_routes_the_link
    )
    .needs(needs_domains())
    .needs(tun)])
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn quick_link_bench_measures_both_paths_and_routes_the_link() {
    let json = std::env::temp_dir().join(format!("bench-link-{}.json", std::process::id()));
    let child = Command::new(BIN)
        .args(["link", "--quick", "--json"])
        .arg(&json)
        .env_remove("MEMLOOP_REGION")
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
        "memloop bench link failed:\n{stdout}\n{stderr}"
    );
    println!("{stdout}");
    let text = std::fs::read_to_string(&json).expect("the JSON file");
    let _ = std::fs::remove_file(&json);
    let records: Vec<Value> = serde_json::from_str(&text).expect("well-formed JSON");
    for r in &records {
        for k in ["test", "path", "unit"] {
            assert!(r[k].as_str().is_some_and(|s| !s.is_empty()), "{k}: {r}");
        }
        assert!(r["value"].as_f64().is_some_and(f64::is_finite), "{r}");
        assert_ne!(r["unit"], "not routed", "{r}");
    }
    let find = |test: &str, path: &str, unit: &str| -> &Value {
        let mine: Vec<&Value> = records
            .iter()
            .filter(|r| r["test"] == test && r["path"] == path && r["unit"] == unit)
            .collect();
        assert_eq!(mine.len(), 1, "{test} {path} {unit}: {records:?}");
        mine[0]
    };
    let positive = |r: &Value| r["value"].as_f64().is_some_and(|v| v > 0.0);

    // Each traffic figure on both paths, the link's routed, and its ratio.
    let mut figures = vec![("tcp-rr", "us mean")];
    for (test, unit, tool) in [
        ("tcp-stream", "Gbit/s", "iperf3"),
        ("ping", "us avg", "ping"),
    ] {
        if have(tool) {
            figures.push((test, unit));
        } else {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test} needs {tool} (tests/programs/install-deps.sh)"
            );
            assert!(
                stdout.contains(&format!("`{tool}` is not installed")),
                "{stdout}"
            );
            assert!(records.iter().all(|r| r["test"] != test), "{test}");
        }
    }
    for (test, unit) in figures {
        let link = find(test, "link", unit);
        let bridge = find(test, "veth+bridge", unit);
        assert!(positive(link) && positive(bridge), "{link} {bridge}");
        let note = link["note"].as_str().unwrap_or_default();
        assert!(
            note.contains("the link's counters grew"),
            "{test}: the link figure does not show its routing: {link}"
        );
        assert!(positive(find(test, "link / veth+bridge", "ratio")));
        if test == "tcp-rr" {
            for r in [link, bridge] {
                assert!(r["p99"].as_f64().is_some_and(|p| p > 0.0), "{r}");
            }
        }
    }

    // The idle link's CPU, the drops and the offloads.
    let idle = find("idle", "link", "cpu%");
    assert_eq!(idle["size"], 2, "{idle}");
    assert!(idle["value"].as_f64().unwrap() >= 0.0, "{idle}");
    for unit in ["drops_full", "drops_bad", "restarts"] {
        let d = find("link-drops", "link", unit);
        assert!(d["value"].as_f64().unwrap() >= 0.0, "{d}");
    }
    assert_eq!(
        find("link-drops", "link", "restarts")["value"],
        0.0,
        "a side restarted"
    );
    for s in ["targets:", "offloads negotiated", "csum", "idle link:"] {
        assert!(stdout.contains(s), "no {s:?} in:\n{stdout}");
    }

    // Nothing left behind: the domains, the region, the link services.
    let show = |args: &[&str]| {
        String::from_utf8_lossy(&Command::new("ip").args(args).output().unwrap().stdout)
            .into_owned()
    };
    let prefix = format!("mlk{pid}");
    assert!(
        !show(&["netns", "list"]).contains(&prefix),
        "leftover netns"
    );
    assert!(!show(&["link", "show"]).contains(&prefix), "leftover links");
    let region = format!("bench-link-{pid}");
    for f in [
        format!("memloop-{region}"),
        format!("memloop-{region}.wake"),
    ] {
        assert!(
            !Path::new("/dev/shm").join(&f).exists(),
            "leftover region {f}"
        );
    }
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(&region),
            "a link service left running: {}",
            String::from_utf8_lossy(&cmdline)
        );
    }
}
