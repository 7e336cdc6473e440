//! `memloop bench pipe --quick --json`: the relay's bytes all arrive and check (the bench fails
//! otherwise), fairness gives a `jain` record and shares, the static-file server (when lighttpd
//! or nginx is installed) gives figures for its own sendfile, and the service path is either
//! routed (the service moved bytes) or says "not routed" with no figure — never a silent number.
//! The run leaves nothing behind. Figures are never compared: timings are not behaviour.

use serde_json::Value;
use std::path::Path;
use std::process::Stdio;

#[allow(dead_code)]
mod common;
use common::bench_with_preload;

fn have(cmd: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn quick_pipe_bench_records_every_figure_and_never_a_silent_unrouted_one() {
    let json = std::env::temp_dir().join(format!("bench-pipe-{}.json", std::process::id()));
    let (mut cmd, preload_built) = bench_with_preload();
    let child = cmd
        .args(["pipe", "--quick", "--bytes", "32M", "--json"])
        .arg(&json)
        .env_remove("MEMLOOP_REGION")
        .env_remove("MEMLOOP_PIPE_SENDFILE")
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
    let text = std::fs::read_to_string(&json).unwrap_or_default();
    let _ = std::fs::remove_file(&json);
    let records: Vec<Value> = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("no JSON ({e}):\n{stdout}\n{stderr}"));
    let not_routed: Vec<&Value> = records
        .iter()
        .filter(|r| r["unit"] == "not routed")
        .collect();
    // Not routed fails the run only when the preload claims to route (then it is a bug).
    let claims = !not_routed.is_empty() && stderr.contains("NOT ROUTED although");
    assert!(
        out.status.success() != claims,
        "exit {:?}:\n{stdout}\n{stderr}",
        out.status
    );
    println!("{stdout}");
    let find = |test: &str, path: &str, unit: &str| -> Vec<&Value> {
        records
            .iter()
            .filter(|r| r["test"] == test && r["path"] == path && r["unit"] == unit)
            .collect()
    };
    let positive = |r: &Value| {
        r["value"]
            .as_f64()
            .is_some_and(|v| v.is_finite() && v > 0.0)
    };
    for r in &records {
        for k in ["test", "path", "unit"] {
            assert!(r[k].as_str().is_some_and(|s| !s.is_empty()), "{k}: {r}");
        }
        assert!(r["size"].as_u64().is_some_and(|s| s > 0), "{r}");
    }

    // 1. Relay: both paths moved all 32 MiB (the sink checked every byte, else the run fails).
    for path in ["copy-loop", "pipe-service"] {
        let g = find("relay", path, "GB/s");
        assert_eq!(g.len(), 1, "relay {path}");
        assert_eq!(g[0]["size"], 32u64 << 20);
        assert!(positive(g[0]), "{}", g[0]);
        assert!(find("relay", path, "relay+service cpu ns/B").len() == 1);
    }
    let note = find("relay", "pipe-service", "GB/s")[0]["note"].to_string();
    assert!(note.contains("SpliceViaPipe"), "{note}");
    assert_eq!(find("relay", "pipe-service", "service cpu ns/B").len(), 1);

    // 2. Fairness: an index in (0, 1] and shares that add up, for 3 tenants then 2.
    for (test, n, tenants) in [
        ("fairness", 3u64, &["w1", "w2", "w4"][..]),
        ("fairness-leave", 2, &["w1", "w2"][..]),
    ] {
        let j = find(test, "pipe-service", "jain");
        assert_eq!(j.len(), 1, "{test}: a jain record");
        let v = j[0]["value"].as_f64().unwrap();
        assert!(v > 0.0 && v <= 1.0 + 1e-9, "{test}: jain {v}");
        assert_eq!(j[0]["size"], n);
        let sum: f64 = tenants
            .iter()
            .map(|t| {
                let s = find(test, t, "share");
                assert_eq!(s.len(), 1, "{test}: share of {t}");
                assert!(positive(s[0]), "{}", s[0]);
                s[0]["value"].as_f64().unwrap()
            })
            .sum();
        assert!((sum - 1.0).abs() < 1e-6, "{test}: shares add up to {sum}");
    }

    // 3. Static-file server: its own sendfile measured at every size; through the service,
    // either routed figures or "not routed" and nothing else.
    let sizes = [1u64 << 20, 16 << 20, 64 << 20];
    if !have("lighttpd") && !have("nginx") {
        // CI installs both (tests/programs/install-deps.sh): there, this part must run.
        assert!(
            std::env::var_os("CI").is_none(),
            "the static-file part needs lighttpd or nginx (tests/programs/install-deps.sh)"
        );
        assert!(
            stdout.contains("is installed") || stdout.contains("not installed"),
            "{stdout}"
        );
        assert!(records.iter().all(|r| r["test"] != "static-file"));
    } else {
        for size in sizes {
            for unit in ["GB/s", "server cpu ns/B"] {
                let r = find("static-file", "sendfile", unit);
                assert!(
                    r.iter().any(|r| r["size"] == size && positive(r)),
                    "static-file sendfile {size} {unit}"
                );
            }
        }
        let svc: Vec<&Value> = records
            .iter()
            .filter(|r| r["test"] == "static-file" && r["path"] == "pipe-service")
            .collect();
        if !preload_built && svc.is_empty() {
            assert!(stdout.contains("preload not built"), "{stdout}");
        } else if !not_routed.is_empty() {
            assert!(
                svc.iter()
                    .all(|r| r["unit"] == "not routed" && r["value"] == 0.0),
                "a figure of a path that was not routed: {svc:?}"
            );
            assert_eq!(svc.len(), sizes.len());
            assert!(stdout.contains("NOT ROUTED"), "{stdout}");
        } else {
            for size in sizes {
                let routed = find("static-file", "pipe-service", "routed fraction");
                assert!(
                    routed.iter().any(|r| r["size"] == size && positive(r)),
                    "routed fraction at {size}: {svc:?}"
                );
            }
        }
    }

    // Nothing left behind: the files, the region, the servers.
    for p in [
        format!("/dev/shm/memloop-bench-pipe-{pid}"),
        format!("/dev/shm/memloop-bench-{pid}"),
        format!("/dev/shm/memloop-bench-{pid}.wake"),
    ] {
        assert!(!Path::new(&p).exists(), "left behind: {p}");
    }
    let mark = format!("memloop-bench-pipe-{pid}");
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(&mark),
            "a server left running: {}",
            String::from_utf8_lossy(&cmdline)
        );
    }
}
