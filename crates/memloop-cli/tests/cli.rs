//! End-to-end tests of the `memloop` binary. Timings are never asserted: only behaviour.

use memloop::{Listener, Node, Region, RegionSpec};
use serde_json::Value;
use std::io::{Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

fn memloop(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("MEMLOOP_REGION")
        .output()
        .expect("run memloop")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A region name unique to this test process; destroyed on drop.
struct TestRegion(String);

impl TestRegion {
    fn new(tag: &str) -> Self {
        let r = TestRegion(format!("cli-test-{}-{tag}", std::process::id()));
        let _ = Region::destroy(&RegionSpec::parse(&r.0));
        r
    }
    fn create(tag: &str) -> Self {
        let r = Self::new(tag);
        let o = memloop(&["region", "create", "--region", &r.0, "--size", "8M"]);
        assert!(o.status.success(), "create: {}", stderr(&o));
        r
    }
}

impl Drop for TestRegion {
    fn drop(&mut self) {
        let _ = Region::destroy(&RegionSpec::parse(&self.0));
    }
}

#[test]
fn region_create_inspect_destroy_round_trip() {
    let r = TestRegion::new("rt");
    let o = memloop(&[
        "region",
        "create",
        "--region",
        &r.0,
        "--size",
        "8M",
        "--members",
        "8",
        "--mode",
        "600",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let again = memloop(&["region", "create", "--region", &r.0]);
    assert!(!again.status.success(), "creating twice must fail");

    let o = memloop(&["region", "inspect", "--region", &r.0]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains(&format!("/dev/shm/memloop-{}", r.0)) && text.contains("generation"),
        "{text}"
    );

    let o = memloop(&["region", "inspect", "--region", &r.0, "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).expect("inspect --json is JSON");
    assert_eq!(v["size"], 8 << 20);
    assert_eq!(v["params"]["max_members"], 8);
    assert_eq!(v["usage"]["members"], 0);

    let o = memloop(&["region", "destroy", "--region", &r.0]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!memloop(&["region", "inspect", "--region", &r.0])
        .status
        .success());
}

#[test]
fn missing_region_is_a_clear_error() {
    let r = TestRegion::new("missing");
    for cmd in [
        &["region", "inspect"][..],
        &["status"],
        &["region", "destroy"],
    ] {
        let mut args = cmd.to_vec();
        args.extend(["--region", &r.0]);
        let o = memloop(&args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = stderr(&o);
        assert!(
            err.contains("no memloop region") && err.contains("memloop region create"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bench_quick_writes_positive_results_for_every_path() {
    let file = std::env::temp_dir().join(format!("memloop-cli-bench-{}.json", std::process::id()));
    let child = Command::new(BIN)
        .args([
            "bench",
            "native",
            "--quick",
            "--json",
            file.to_str().unwrap(),
        ])
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

#[test]
fn status_lists_a_connected_peer() {
    let r = TestRegion::create("status");
    let region = Region::open(&RegionSpec::parse(&r.0)).unwrap();
    let node = Node::join(region, "cli-test").unwrap();
    let listener = Listener::bind(&node, "cli-test-svc").unwrap();
    // The bench's peer process connects and echoes what the bench protocol sends it.
    let mut peer = Command::new(BIN)
        .args([
            "bench-peer",
            "--path",
            "memloop",
            "--addr",
            "cli-test-svc",
            "--region",
            &r.0,
        ])
        .spawn()
        .unwrap();
    let mut s = listener
        .accept_timeout(Some(Duration::from_secs(10)))
        .expect("peer connects");
    // One rr op of one 16-byte message (sequence number 0), then the end marker.
    let mut header = [0u8; 16];
    header[0] = 1;
    header[8] = 16;
    s.write_all(&header).unwrap();
    for msg in [[0u8; 16], [0xff; 16]] {
        s.write_all(&msg).unwrap();
        let mut echo = [0u8; 16];
        s.read_exact(&mut echo).unwrap();
        assert_eq!(echo, msg);
    }

    let o = memloop(&["status", "--region", &r.0, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("status --json is JSON");
    let names: Vec<&str> = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"cli-test") && names.contains(&"memloop-bench-peer"),
        "{names:?}"
    );
    assert!(v["members"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["alive"] == true && m["same_kernel"] == true));
    assert!(
        v["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["key"] == "native cli-test-svc"),
        "{v}"
    );
    let ch = &v["channels"].as_array().unwrap()[0];
    assert_eq!(ch["state"], "accepted");
    assert!(
        ch["bytes_c2s"].as_u64().unwrap() >= 32 && ch["bytes_s2c"].as_u64().unwrap() >= 32,
        "{ch}"
    );

    let text = stdout(&memloop(&["status", "--region", &r.0]));
    assert!(
        text.contains("MEMBERS (2)") && text.contains("cli-test-svc"),
        "{text}"
    );

    drop(s);
    assert!(
        peer.wait().unwrap().success(),
        "peer exits cleanly at end of stream"
    );
}

#[test]
fn status_lists_tcp_connections_and_fallbacks() {
    use memloop::registry::{ConnTuple, EndpointKey, FallbackReason, Proto};
    let r = TestRegion::create("fallbacks");
    let node = Node::join(Region::open(&RegionSpec::parse(&r.0)).unwrap(), "cli-fb").unwrap();
    let reg = node.region().registry();
    let t = ConnTuple {
        client: "10.0.0.1:40000".parse().unwrap(),
        server: "10.0.0.2:80".parse().unwrap(),
    };
    let pid = std::process::id();
    let rec = reg
        .record_conn(node.id(), pid, Proto::Tcp, &t, FallbackReason::NoListener)
        .expect("a free record");
    let (sent, received) = reg.conn_bytes(rec).unwrap();
    sent.fetch_add(123, std::sync::atomic::Ordering::Relaxed);
    received.fetch_add(45, std::sync::atomic::Ordering::Relaxed);
    reg.count_fallback(FallbackReason::Cancelled);
    let ep = reg
        .add_endpoint(node.id(), &EndpointKey::Native("fb-svc".into()))
        .unwrap();
    reg.mark_declined(node.id(), ep, &t).unwrap();

    let o = memloop(&["status", "--region", &r.0, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("status --json is JSON");
    let conns = v["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 1, "{v}");
    let c = &conns[0];
    assert_eq!(
        (&c["path"], &c["pid"], &c["reason"]),
        (&"tcp".into(), &pid.into(), &"no_listener".into())
    );
    assert_eq!(
        (c["bytes_sent"].as_u64(), c["bytes_received"].as_u64()),
        (Some(123), Some(45))
    );
    assert_eq!(c["tuple"]["client"], "10.0.0.1:40000");
    assert_eq!(c["tuple"]["server"], "10.0.0.2:80");
    let fb = &v["fallbacks"];
    assert_eq!(
        (fb["no_listener"].as_u64(), fb["cancelled"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(fb["declined"], 0, "every reason is listed");
    assert_eq!(v["counters"].as_array().unwrap().len(), 16, "old key kept");
    let marker = &v["channels"].as_array().unwrap()[0];
    assert_eq!(
        (&marker["marker"], &marker["path"]),
        (&true.into(), &"ring".into())
    );
    assert_eq!(v["usage"]["conns"], 1);

    let text = stdout(&memloop(&["status", "--region", &r.0]));
    for want in [
        "CONNECTIONS (1)",
        "10.0.0.1:40000 → 10.0.0.2:80",
        "no co-resident listener",
        "no_listener (no co-resident listener): 1",
        "decline-marker",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }

    reg.release_conn(rec).unwrap();
    let o = memloop(&["status", "--region", &r.0, "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["connections"].as_array().unwrap().is_empty());
    assert_eq!(
        v["fallbacks"]["no_listener"], 1,
        "counters outlive the records"
    );
}
