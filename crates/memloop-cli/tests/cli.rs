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
fn status_lists_a_connected_peer() {
    let r = TestRegion::create("status");
    let region = Region::open(&RegionSpec::parse(&r.0)).unwrap();
    let node = Node::join(region, "cli-test").unwrap();
    let listener = Listener::bind(&node, "cli-test-svc").unwrap();
    // A peer process: `memloop cat` copies its stdin into a stream to our listener.
    let mut peer = Command::new(BIN)
        .args(["cat", "--connect", "cli-test-svc"])
        .env("MEMLOOP_REGION", &r.0)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut s = listener
        .accept_timeout(Some(Duration::from_secs(10)))
        .expect("peer connects");
    let sent: Vec<u8> = (0..32).collect();
    let mut input = peer.stdin.take().unwrap();
    input.write_all(&sent).unwrap();
    drop(input);
    let mut got = [0u8; 32];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got[..], sent[..]);

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
        names.contains(&"cli-test") && names.contains(&"cat"),
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
        ch["bytes_c2s"].as_u64() == Some(32) && ch["bytes_s2c"].as_u64() == Some(0),
        "{ch}"
    );
    // Native streams wake each other by futex: no doorbell bytes on any socket.
    for side in ["client", "server"] {
        let d = &ch["doorbells"][side];
        assert!(
            d["sent"].as_u64() == Some(0) && d["read"].as_u64() == Some(0),
            "{ch}"
        );
    }

    let text = stdout(&memloop(&["status", "--region", &r.0]));
    assert!(
        text.contains("MEMBERS (2)") && text.contains("cli-test-svc"),
        "{text}"
    );

    drop(s);
    assert!(
        peer.wait().unwrap().success(),
        "peer exits cleanly once we close"
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
    assert_eq!(
        v["counters"].as_array().unwrap().len(),
        memloop::registry::header::NCOUNTERS,
        "old key kept"
    );
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

/// A scratch directory holding a copy of `memloop` and, if given, a `memloop-bench` script.
struct LoneMemloop(std::path::PathBuf);

impl LoneMemloop {
    fn new(tag: &str, bench_script: Option<&str>) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("memloop-fwd-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(BIN, dir.join("memloop")).unwrap();
        if let Some(script) = bench_script {
            let bench = dir.join("memloop-bench");
            std::fs::write(&bench, script).unwrap();
            std::fs::set_permissions(&bench, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        LoneMemloop(dir)
    }
    fn run(&self, args: &[&str]) -> Output {
        Command::new(self.0.join("memloop"))
            .args(args)
            .output()
            .expect("run memloop")
    }
}

impl Drop for LoneMemloop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn bench_is_forwarded_with_its_arguments_and_exit_code() {
    // The stand-in records its arguments one per line and exits with a code of its own.
    let lone = LoneMemloop::new(
        "args",
        Some("#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$0.args\"\nexit 7\n"),
    );
    let args = ["tcp", "--quick", "--json", "a b.json", "-x", "--help", "--"];
    let o = lone.run(&[&["bench"], &args[..]].concat());
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    let seen = std::fs::read_to_string(lone.0.join("memloop-bench.args")).unwrap();
    assert_eq!(seen.lines().collect::<Vec<_>>(), args);

    let o = lone.run(&["bench", "--help"]);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    let seen = std::fs::read_to_string(lone.0.join("memloop-bench.args")).unwrap();
    assert_eq!(seen, "--help\n");
}

#[test]
fn bench_without_the_bench_binary_says_how_to_build_it() {
    let lone = LoneMemloop::new("missing", None);
    let o = lone.run(&["bench", "native", "--quick"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("memloop-bench") && err.contains("cargo build --release -p memloop-bench"),
        "{err}"
    );
}

/// The region's `ring_bytes` stays exact when a process dies without closing: the channel is
/// counted from its rings while it lives, and once when it is freed — here by `region
/// reclaim`, after the peer was SIGKILLed and our side closed.
#[test]
fn ring_bytes_survive_a_peer_killed_without_closing() {
    let r = TestRegion::create("bytes");
    let ring_bytes = || {
        let o = memloop(&["status", "--region", &r.0, "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).expect("status --json is JSON");
        v["ring_bytes"].as_u64().expect("ring_bytes is a number")
    };
    let region = Region::open(&RegionSpec::parse(&r.0)).unwrap();
    let node = Node::join(region, "cli-test").unwrap();
    let listener = Listener::bind(&node, "cli-bytes-svc").unwrap();
    let mut peer = Command::new(BIN)
        .args(["cat", "--connect", "cli-bytes-svc"])
        .env("MEMLOOP_REGION", &r.0)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut s = listener
        .accept_timeout(Some(Duration::from_secs(10)))
        .expect("peer connects");
    let sent = vec![0x5a_u8; 4096];
    let mut input = peer.stdin.take().unwrap();
    input.write_all(&sent).unwrap();
    let mut got = vec![0u8; sent.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got, sent);
    assert_eq!(ring_bytes(), 4096, "counted from the live channel's rings");

    // SIGKILL: the peer never closes its end of the channel.
    peer.kill().unwrap();
    peer.wait().unwrap();
    drop(input);
    drop(s);
    assert_eq!(
        ring_bytes(),
        4096,
        "still counted while the channel waits for reclaim"
    );
    let o = memloop(&["region", "reclaim", "--region", &r.0]);
    assert!(o.status.success(), "reclaim: {}", stderr(&o));
    assert_eq!(
        ring_bytes(),
        4096,
        "counted exactly once after the channel is freed"
    );
    let o = memloop(&["status", "--region", &r.0, "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(
        v["channels"].as_array().unwrap().is_empty(),
        "the reclaim freed the channel: {v}"
    );
}
