//! `memloop bench blk --quick --json`: every fio run, and PostgreSQL (initdb, pgbench at 1
//! and 4 clients) on an ext4 on each device, is there on the three paths (memloop, NBD over
//! TCP, the local file), each memloop figure was routed (the export's counters cover fio's
//! bytes: the bench says so in the figure's note, and fails otherwise), the ratios and the
//! export's copies are reported, and the run leaves nothing behind (domains, region, services,
//! loop devices, FUSE mounts). Needs root, `ip`, /dev/fuse, losetup, fio, nbdkit, nbdfuse and
//! fusermount3; without them the runner reports it ignored with the reason (failed under
//! `CI`: tests/programs/install-deps.sh installs them). Figures are never compared with
//! targets: timings are not behaviour.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

#[allow(dead_code)]
mod common;
use common::{needs_domains, BIN};

fn main() -> std::process::ExitCode {
    use memloop_testkit::{all, tool};
    let fuse = match Path::new("/dev/fuse").exists() && Path::new("/dev/loop-control").exists() {
        true => Ok(()),
        false => Err("needs /dev/fuse and /dev/loop-control".to_string()),
    };
    memloop_testkit::run(vec![memloop_testkit::test!(
        quick_blk_bench_measures_three_paths_and_routes_memloop
    )
    .needs(needs_domains())
    .needs(fuse)
    .needs(all([
        tool("losetup", &["--version"]),
        tool("fio", &["--version"]),
        tool("nbdkit", &["--version"]),
        tool("nbdfuse", &["--version"]),
        tool("fusermount3", &["--version"]),
        tool("pgbench", &["--version"]),
        tool("mkfs.ext4", &["-V"]),
    ]))])
}

fn quick_blk_bench_measures_three_paths_and_routes_memloop() {
    let json = std::env::temp_dir().join(format!("bench-blk-{}.json", std::process::id()));
    let child = Command::new(BIN)
        .args(["blk", "--quick", "--json"])
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
        "memloop bench blk failed:\n{stdout}\n{stderr}"
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
    for (test, unit, size) in [
        ("randread", "IOPS", 4096),
        ("randwrite", "IOPS", 4096),
        ("read", "MiB/s", 1 << 20),
        ("write", "MiB/s", 1 << 20),
    ] {
        for path in ["memloop", "nbd-tcp", "local-file"] {
            let r = find(test, path, unit);
            assert!(positive(r), "{r}");
            assert_eq!(r["size"], size, "{r}");
        }
        let m = find(test, "memloop", unit);
        let note = m["note"].as_str().unwrap_or_default();
        assert!(
            note.contains("the export's counters grew"),
            "{test}: the memloop figure does not show its routing: {m}"
        );
        assert!(positive(find(test, "memloop / nbd-tcp", "ratio")));
        assert!(positive(find(test, "memloop / local-file", "ratio")));
        // The export copies each byte once (pread into its pool, pwrite from it).
        let c = find(test, "memloop", "copied B/B")["value"]
            .as_f64()
            .unwrap();
        assert!(c >= 1.0, "{test}: the export copied {c} B per byte");
    }
    // PostgreSQL on each path: initdb's seconds and pgbench's TPS at 1 and 4 clients.
    let find_sized = |path: &str, size: u64, unit: &str| -> &Value {
        let mine: Vec<&Value> = records
            .iter()
            .filter(|r| {
                r["test"] == "pgbench"
                    && r["path"] == path
                    && r["size"] == size
                    && r["unit"] == unit
            })
            .collect();
        assert_eq!(mine.len(), 1, "pgbench {path} {size} {unit}: {records:?}");
        mine[0]
    };
    for path in ["memloop", "nbd-tcp", "local-file"] {
        assert!(positive(find_sized(path, 0, "initdb s")));
        for c in [1, 4] {
            assert!(positive(find_sized(path, c, "TPS")));
        }
    }
    let m = find_sized("memloop", 0, "initdb s");
    let note = m["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("flushes") && note.contains("the export's counters grew"),
        "PostgreSQL's memloop figure does not show its routing: {m}"
    );
    assert!(positive(find_sized("memloop / local-file", 4, "ratio")));
    for s in [
        "targets:",
        "nbdkit",
        "nbdfuse",
        "direct I/O on",
        "pgbench -c 4",
    ] {
        assert!(stdout.contains(s), "no {s:?} in:\n{stdout}");
    }

    // Nothing left behind: the domains, the region, the services, loop devices, mounts.
    let show = |args: &[&str]| {
        String::from_utf8_lossy(&Command::new("ip").args(args).output().unwrap().stdout)
            .into_owned()
    };
    let prefix = format!("mbk{pid}");
    assert!(
        !show(&["netns", "list"]).contains(&prefix),
        "leftover netns"
    );
    assert!(!show(&["link", "show"]).contains(&prefix), "leftover links");
    let region = format!("bench-blk-{pid}");
    for f in [
        format!("memloop-{region}"),
        format!("memloop-{region}.wake"),
    ] {
        assert!(
            !Path::new("/dev/shm").join(&f).exists(),
            "leftover region {f}"
        );
    }
    let files = format!("memloop-bench-blk-{pid}");
    for e in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(!n.starts_with(&files), "leftover file /dev/shm/{n}");
    }
    let loops = String::from_utf8_lossy(
        &Command::new("losetup")
            .arg("--list")
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(
        !loops.contains(&files) && !loops.contains(&region),
        "leftover loop device:\n{loops}"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(!mounts.contains(&files), "leftover mount");
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let c = String::from_utf8_lossy(&cmdline);
        assert!(
            !c.contains(&region) && !c.contains(&files),
            "a service left running: {c}"
        );
    }
}
