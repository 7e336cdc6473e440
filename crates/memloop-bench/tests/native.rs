//! `memloop bench native --quick` (run as `memloop-bench native`): every path gives positive
//! figures and the run leaves nothing behind. Timings are never asserted: only behaviour.

use serde_json::Value;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_memloop-bench");

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bench_quick_writes_positive_results_for_every_path() {
    let file =
        std::env::temp_dir().join(format!("memloop-bench-native-{}.json", std::process::id()));
    let child = Command::new(BIN)
        .args(["native", "--quick", "--json", file.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let bench_pid = child.id();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "bench failed: {}", stderr(&o));
    assert!(stdout(&o).contains("memloop vs tcp"), "{}", stdout(&o));
    let records: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).expect("JSON array");
    let _ = std::fs::remove_file(&file);
    let value = |test: &str, path: &str, size: u64, unit: &str| {
        let r = records.iter().find(|r| {
            r["test"] == test && r["path"] == path && r["size"] == size && r["unit"] == unit
        });
        r.unwrap_or_else(|| panic!("no {test}/{path}/{size}/{unit} record"))["value"]
            .as_f64()
            .unwrap()
    };
    for path in ["memloop", "unix", "tcp-loopback"] {
        for size in [64, 1024, 65536] {
            for (test, unit) in [
                ("rr", "us"),
                ("rr", "rt/s"),
                ("stream", "msg/s"),
                ("stream", "Gbit/s"),
            ] {
                let v = value(test, path, size, unit);
                assert!(
                    v > 0.0 && v.is_finite(),
                    "{test}/{path}/{size}/{unit} = {v}"
                );
            }
        }
    }
    assert!(value("pingpong", "cacheline", 64, "us") > 0.0);
    assert!(value("idle", "memloop", 0, "cpu%") >= 0.0);
    // The temporary region and the ping-pong line are gone.
    for leftover in [
        format!("memloop-bench-{bench_pid}"),
        format!("memloop-bench-{bench_pid}-line"),
    ] {
        assert!(!std::path::Path::new("/dev/shm").join(leftover).exists());
    }
}
