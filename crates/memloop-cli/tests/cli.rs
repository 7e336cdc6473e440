//! End-to-end tests of the `memloop` binary. Timings are never asserted: only behaviour.
//! On the `memloop-testkit` harness: the tests of live path switching need the preload library
//! (`cargo build --release -p memloop-preload`) and python3, and say so when they are missing.

use memloop::{Listener, Node, Region, RegionSpec};
use serde_json::Value;
use std::io::{Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

fn main() -> std::process::ExitCode {
    use memloop_testkit::test;
    let preloaded = || memloop_testkit::all([preload_lib().map(|_| ()), python3()]);
    memloop_testkit::run(vec![
        test!(region_create_inspect_destroy_round_trip),
        test!(missing_region_is_a_clear_error),
        test!(status_lists_a_connected_peer),
        test!(status_lists_tcp_connections_and_fallbacks),
        test!(status_leads_with_a_summary_and_lists_long_tables_on_demand),
        test!(bench_is_forwarded_with_its_arguments_and_exit_code),
        test!(bench_without_the_bench_binary_says_how_to_build_it),
        test!(ring_bytes_survive_a_peer_killed_without_closing),
        test!(cat_zero_copy_carries_checksummed_bytes_and_gets_every_buffer_back),
        test!(demote_all_on_an_empty_region_asks_none),
        test!(demote_and_promote_selectors_are_checked),
        test!(demote_sets_the_switch_request_of_a_live_ring_connection).needs(preloaded()),
        test!(demote_moves_a_live_connection_to_tcp_and_promote_brings_it_back).needs(preloaded()),
        test!(pause_moves_live_connections_to_tcp_keeps_new_ones_there_and_resume_brings_them_back)
            .needs(preloaded()),
        test!(destroy_moves_live_connections_to_tcp_before_the_region_goes).needs(preloaded()),
        test!(the_heartbeat_demotes_ring_connections_of_a_paused_region).needs(preloaded()),
        test!(status_shows_switched_records_and_switch_counts),
        test!(a_region_on_a_full_file_system_falls_back_instead_of_crashing).needs(
            memloop_testkit::all([preloaded(), memloop_testkit::root(), mount_tool()]),
        ),
    ])
}

fn mount_tool() -> memloop_testkit::Need {
    memloop_testkit::tool("mount", &["--version"])
}

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

    // The summary counts it and its rings.
    let sum = &v["summary"];
    assert_eq!(
        (
            &sum["connections"]["ring"],
            &sum["members"]["by_state"]["live"]
        ),
        (&1.into(), &2.into()),
        "{sum}"
    );
    let rings = &sum["ring_memory"]["by_ring_size"][0];
    assert_eq!(rings["channels"], 1, "{sum}");
    assert!(rings["bytes"].as_u64() >= Some(2 * rings["ring_size"].as_u64().unwrap()));

    let text = stdout(&memloop(&["status", "--region", &r.0]));
    assert!(
        text.contains("MEMBERS (2)") && text.contains("cli-test-svc"),
        "{text}"
    );
    assert!(
        text.contains("SUMMARY") && text.contains("ring memory") && text.contains(" × 1 ("),
        "{text}"
    );

    // The same figures for a scraper: 32 ring bytes, one live ring channel, two live members.
    let o = memloop(&["status", "--region", &r.0, "--format", "prometheus"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let prom = stdout(&o);
    let path = v["region"]["path"].as_str().unwrap();
    for line in [
        format!("memloop_ring_bytes_total{{region=\"{path}\"}} 32"),
        format!("memloop_channels{{region=\"{path}\",path=\"ring\"}} 1"),
        format!("memloop_members{{region=\"{path}\",alive=\"true\"}} 2"),
        format!("memloop_fallbacks_total{{region=\"{path}\",reason=\"region_full\"}} 0"),
        "# TYPE memloop_ring_bytes_total counter".to_string(),
    ] {
        assert!(prom.lines().any(|l| l == line), "no {line:?} in\n{prom}");
    }

    drop(s);
    assert!(
        peer.wait().unwrap().success(),
        "peer exits cleanly once we close"
    );
}

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
    // Every counter has a name: no unlabeled array a script would have to know by index.
    assert!(v.get("counters").is_none(), "{v}");
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
        // A fresh copy can be "busy" for a moment: another test thread may fork while the copy
        // is still open for writing, and the child holds that fd until it execs.
        for _ in 0..50 {
            match Command::new(self.0.join("memloop")).args(args).output() {
                Err(e) if e.raw_os_error() == Some(26) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                r => return r.expect("run memloop"),
            }
        }
        panic!("{}: text file busy for a second", self.0.display())
    }
}

impl Drop for LoneMemloop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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

/// FNV-1a over the bytes (a checksum the two ends agree on without a hashing crate).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `memloop cat --zero-copy` between two processes: the sender reads stdin into loans of a
/// small pool (4 buffers of 16 KiB: each used about five times) and sends descriptors; the
/// listener writes what it reads in place. The bytes arrive whole and in order, the sender
/// exits 0 only once every buffer came back and the listener finished, and the pool and the
/// channel are gone after.
fn cat_zero_copy_carries_checksummed_bytes_and_gets_every_buffer_back() {
    let r = TestRegion::create("zc-cat");
    // 300 KiB and a bit (the last read is short), from a xorshift generator.
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let sent: Vec<u8> = (0..300 * 1024 + 777)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let cat = |args: &[&str]| {
        Command::new(BIN)
            .arg("cat")
            .args(args)
            .env("MEMLOOP_REGION", &r.0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let listener = cat(&["--zero-copy", "--listen", "cli-zc-svc"]);
    let mut sender = cat(&[
        "--zero-copy",
        "--connect",
        "cli-zc-svc",
        "--buffers",
        "4",
        "--buffer-size",
        "16K",
    ]);
    let mut input = sender.stdin.take().unwrap();
    let data = sent.clone();
    let feeder = std::thread::spawn(move || input.write_all(&data));
    // (The listener's stdout is drained meanwhile: the sender waits for it to drop messages.)
    let listened = std::thread::spawn(move || listener.wait_with_output().unwrap());
    let s = sender.wait_with_output().unwrap();
    feeder
        .join()
        .unwrap()
        .expect("the sender read all of stdin");
    let l = listened.join().unwrap();
    assert!(
        s.status.success() && l.status.success(),
        "sender: {}\nlistener: {}",
        stderr(&s),
        stderr(&l)
    );
    assert_eq!(l.stdout.len(), sent.len(), "{}", stderr(&l));
    assert_eq!(fnv1a(&l.stdout), fnv1a(&sent), "checksum");
    assert!(l.stdout == sent, "the same bytes in the same order");
    let (serr, lerr) = (stderr(&s), stderr(&l));
    assert!(
        serr.contains("from a pool of 4 buffers of 16 KiB; all 4 buffers back"),
        "{serr}"
    );
    assert!(lerr.contains(&format!("{} bytes in", sent.len())), "{lerr}");
    let msgs = |t: &str, what: &str| -> u64 {
        let at = t.find(what).unwrap_or_else(|| panic!("no {what:?} in {t}"));
        let head = t[..at].trim_end();
        head[head.rfind(' ').unwrap() + 1..].parse().unwrap()
    };
    // One message per read of stdin: 16 KiB at most (a pipe may return less).
    let n = msgs(&lerr, " messages received");
    assert!(
        n >= sent.len().div_ceil(16 << 10) as u64 && n == msgs(&serr, " messages from a pool"),
        "sender: {serr}\nlistener: {lerr}"
    );

    let v = status_json(&r.0);
    assert!(
        v["summary"]["pools"].as_array().unwrap().is_empty()
            && v["channels"].as_array().unwrap().is_empty(),
        "the pool and the channel are freed once both ends exit: {v}"
    );

    // A stream listener refuses the descriptor channel, as the sender attaches (then it says
    // so) or later (its buffers come back unread): either way the sender fails.
    let mut stream_listener = Command::new(BIN)
        .args(["cat", "--listen", "cli-zc-stream"])
        .env("MEMLOOP_REGION", &r.0)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut sender = cat(&["--zero-copy", "--connect", "cli-zc-stream"]);
    sender.stdin.take().unwrap().write_all(b"hello").unwrap();
    let s = sender.wait_with_output().unwrap();
    let _ = stream_listener.kill();
    let _ = stream_listener.wait();
    let err = stderr(&s);
    assert!(!s.status.success(), "{err}");
    assert!(
        err.contains("the listener refused the channel (give --zero-copy to both ends")
            || err.contains("waiting for the listener to finish"),
        "{err}"
    );

    // Flags that belong to the zero-copy sender are refused without --zero-copy.
    let o = memloop(&["cat", "--connect", "x", "--buffers", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--zero-copy"), "{}", stderr(&o));
}

// ---- live path switching (issue 12) -----------------------------------------------------------

fn status_json(region: &str) -> Value {
    let o = memloop(&["status", "--region", region, "--json"]);
    assert!(o.status.success(), "status: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("status --json is JSON")
}

fn demote_all_on_an_empty_region_asks_none() {
    let r = TestRegion::create("demote-none");
    let o = memloop(&["demote", "--all", "--region", &r.0]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("asked 0 channels"), "{}", stdout(&o));
    let o = memloop(&["demote", "--pid", "1", "--region", &r.0, "--wait", "5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("asked 0 channels"), "{}", stdout(&o));
    let v = status_json(&r.0);
    assert!(
        v["switches"].as_object().unwrap().values().all(|n| n == 0),
        "{v}"
    );
    assert_eq!(v["switches"]["operator"], 0, "every reason is listed");
}

fn demote_and_promote_selectors_are_checked() {
    let r = TestRegion::create("demote-bad");
    for (args, want) in [
        (&["demote", "--conn", "nonsense"][..], "not a channel id"),
        (&["demote", "--conn", "3.x"], "not a channel id"),
        (&["demote", "--conn", "7.0"], "no channel 7.0"),
        (&["demote", "--conn", "99999"], "no channel 99999"),
        (&["demote"], "required"),
        (&["demote", "--all", "--conn", "1.0"], "cannot be used with"),
        (&["demote", "--all", "--wait=-1"], "--wait -1"),
        (
            &["demote", "--all", "--wait", "nan"],
            "not a number of seconds",
        ),
        (
            &["promote", "--all", "--wait", "nan"],
            "not a number of seconds",
        ),
    ] {
        let mut args = args.to_vec();
        args.extend(["--region", &r.0]);
        let o = memloop(&args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    }
    // A channel that is not accepted has no connection to move: a decline marker here.
    let node = Node::join(Region::open(&RegionSpec::parse(&r.0)).unwrap(), "cli-dm").unwrap();
    let reg = node.region().registry();
    let ep = reg
        .add_endpoint(
            node.id(),
            &memloop::registry::EndpointKey::Native("dm-svc".into()),
        )
        .unwrap();
    let t = memloop::registry::ConnTuple {
        client: "10.0.0.1:1".parse().unwrap(),
        server: "10.0.0.2:2".parse().unwrap(),
    };
    reg.mark_declined(node.id(), ep, &t).unwrap();
    let o = memloop(&["demote", "--all", "--region", &r.0]);
    assert!(
        stdout(&o).contains("asked 0 channels"),
        "markers are not channels: {}",
        stdout(&o)
    );

    // A native stream has no TCP socket to move to: not selected by --all, refused by --conn.
    let listener = Listener::bind(&node, "dm-native").unwrap();
    let mut peer = Command::new(BIN)
        .args(["cat", "--connect", "dm-native"])
        .env("MEMLOOP_REGION", &r.0)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let s = listener
        .accept_timeout(Some(Duration::from_secs(10)))
        .expect("peer connects");
    let v = status_json(&r.0);
    let ch = v["channels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["state"] == "accepted")
        .expect("the native channel")
        .clone();
    let id = format!("{}.{}", ch["idx"], ch["gen"]);
    let o = memloop(&["demote", "--all", "--region", &r.0]);
    assert!(
        o.status.success() && stdout(&o).contains("asked 0 channels"),
        "{}",
        stdout(&o)
    );
    let o = memloop(&["demote", "--conn", &id, "--region", &r.0]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("native stream"), "{}", stderr(&o));
    assert_eq!(
        find_channel(&status_json(&r.0), &id).unwrap()["switch_requested"],
        false
    );
    drop(peer.stdin.take());
    drop(s);
    assert!(peer.wait().unwrap().success());
}

/// The text output leads with a summary (counts, top talkers) and prints a list longer than
/// 20 entries only when asked (`--all`, `--list`); `--summary` prints none; JSON has them all.
fn status_leads_with_a_summary_and_lists_long_tables_on_demand() {
    use memloop::registry::{ConnTuple, FallbackReason, Proto};
    let r = TestRegion::create("summary");
    let node = Node::join(Region::open(&RegionSpec::parse(&r.0)).unwrap(), "cli-sum").unwrap();
    let reg = node.region().registry();
    let tuple = |i: u64| ConnTuple {
        client: format!("10.0.0.1:{}", 40000 + i).parse().unwrap(),
        server: "10.0.0.2:80".parse().unwrap(),
    };
    const N: u64 = 25;
    for i in 0..N {
        let rec = reg
            .record_conn(
                node.id(),
                std::process::id(),
                Proto::Tcp,
                &tuple(i),
                FallbackReason::NoListener,
            )
            .expect("a free record");
        let (sent, _) = reg.conn_bytes(rec).unwrap();
        sent.fetch_add(1000 * (i + 1), std::sync::atomic::Ordering::Relaxed);
    }
    let shown = |t: &str, i: u64| t.contains(&format!("{} → ", tuple(i).client));
    let status = |args: &[&str]| {
        let mut all = vec!["status", "--region", &r.0];
        all.extend(args);
        let o = memloop(&all);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        stdout(&o)
    };

    let text = status(&[]);
    let at = |what: &str| {
        text.find(what)
            .unwrap_or_else(|| panic!("no {what:?} in\n{text}"))
    };
    assert!(at("SUMMARY") < at("MEMBERS (1)"), "{text}");
    at("connections  25: 0 on rings, 0 switched to TCP (channel kept), 25 TCP fallback records");
    at("TOP CONNECTIONS by bytes (10 of 25)");
    at("TOP MEMBERS by connections (1 of 1)");
    at("CONNECTIONS (25): not listed (more than 20; --list connections or --all)");
    at("cli-sum"); // the member list is short: printed
    assert!(shown(&text, N - 1), "the top talker is named:\n{text}");
    assert!(
        !shown(&text, 0),
        "the least is neither a top talker nor listed:\n{text}"
    );

    for args in [&["--all"][..], &["--list", "connections"]] {
        let text = status(args);
        assert!((0..N).all(|i| shown(&text, i)), "{args:?}:\n{text}");
    }
    let text = status(&["--list", "connections"]);
    assert!(
        !text.contains("MEMBERS ("),
        "--list prints only what it names:\n{text}"
    );
    let text = status(&["--summary", "--top", "3"]);
    assert!(
        text.contains("TOP CONNECTIONS by bytes (3 of 25)") && !text.contains("CONNECTIONS ("),
        "{text}"
    );
    assert!(
        !memloop(&["status", "--region", &r.0, "--all", "--summary"])
            .status
            .success()
    );

    let v = status_json(&r.0);
    assert_eq!(v["connections"].as_array().map(Vec::len), Some(N as usize));
    let sum = &v["summary"];
    assert_eq!(sum["connections"]["fallback_records"], N, "{sum}");
    assert_eq!(sum["top_connections"][0]["bytes"], 1000 * N, "{sum}");
    assert_eq!(sum["top_connections"].as_array().map(Vec::len), Some(10));
    assert_eq!(sum["top_members"][0]["tcp"], N, "{sum}");
    assert_eq!(
        sum["channels"]["by_state"]["accepted"], 0,
        "every state is listed"
    );
}

/// `status --json` records a switched connection and the switch counters.
fn status_shows_switched_records_and_switch_counts() {
    use memloop::registry::{ConnTuple, FallbackReason, Proto, SwitchReason};
    let r = TestRegion::create("switched");
    let node = Node::join(Region::open(&RegionSpec::parse(&r.0)).unwrap(), "cli-sw").unwrap();
    let reg = node.region().registry();
    let t = ConnTuple {
        client: "10.0.0.1:40000".parse().unwrap(),
        server: "10.0.0.2:80".parse().unwrap(),
    };
    let pid = std::process::id();
    reg.count_switch(SwitchReason::Exec); // counted once per connection, by the asker
    let rec = reg
        .record_switched_conn(node.id(), pid, Proto::Tcp, &t, SwitchReason::Exec, 4096)
        .expect("a free record");
    let (sent, _) = reg.conn_bytes(rec).unwrap();
    sent.fetch_add(10, std::sync::atomic::Ordering::Relaxed);
    reg.record_conn(node.id(), pid, Proto::Tcp, &t, FallbackReason::Error)
        .unwrap();

    let v = status_json(&r.0);
    let conns = v["connections"].as_array().unwrap();
    let sw = conns.iter().find(|c| c["switched"] == "exec").expect("{v}");
    assert_eq!(
        (
            &sw["switches"],
            &sw["ring_bytes"],
            &sw["reason"],
            &sw["fallback"]
        ),
        (
            &1.into(),
            &4096.into(),
            &"switched_exec".into(),
            &Value::Null
        ),
        "{sw}"
    );
    assert_eq!(
        (&sw["tcp_bytes_sent"], &sw["bytes_sent"]),
        (&10.into(), &10.into())
    );
    let fb = conns.iter().find(|c| c["switched"].is_null()).expect("{v}");
    assert_eq!(
        (
            &fb["reason"],
            &fb["fallback"],
            &fb["switches"],
            &fb["ring_bytes"]
        ),
        (&"error".into(), &"error".into(), &0.into(), &0.into())
    );
    assert_eq!(v["switches"]["exec"], 1);
    assert_eq!(v["switches"]["operator"], 0);
    assert_eq!(v["fallbacks"]["error"], 1, "a switch is not a fallback");

    let text = stdout(&memloop(&["status", "--region", &r.0]));
    for want in [
        "SWITCHES (connections that changed path, by reason): exec: 1",
        "switched from its ring (exec), 1 switch",
        "4096",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert!(
        !text.contains("switch_exec"),
        "not among the fallbacks:\n{text}"
    );
}

/// The preload library: $MEMLOOP_PRELOAD_LIB, else next to the `memloop` under test.
fn preload_lib() -> Result<std::path::PathBuf, String> {
    let p = std::env::var_os("MEMLOOP_PRELOAD_LIB").map_or_else(
        || std::path::Path::new(BIN).with_file_name("libmemloop.so"),
        std::path::PathBuf::from,
    );
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "needs {} (`cargo build --release -p memloop-preload`, or set MEMLOOP_PRELOAD_LIB)",
            p.display()
        ))
    }
}

fn python3() -> memloop_testkit::Need {
    memloop_testkit::tool("python3", &["--version"])
}

/// The two ends of one stream, in python, each under the preload. The server sums what it
/// receives (SHA-256) and sends the digest back at EOF; the client sends `PART` bytes, says
/// `half` and waits for a line on stdin, sends `PART` more, shuts down its side and prints
/// `OK` if the server's digest is its own.
const PEER_PY: &str = r#"
import hashlib, socket, sys
PART = 1 << 18
def data(seed):
    out, h = bytearray(), hashlib.sha256(seed)
    while len(out) < PART:
        h = hashlib.sha256(h.digest()); out += h.digest()
    return bytes(out[:PART])
if sys.argv[1] == "server":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept(); h = hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b: break
        h.update(b)
    c.sendall(h.hexdigest().encode()); c.close()
else:
    c = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    a, b = data(b"a"), data(b"b")
    c.sendall(a); print("half", flush=True)
    sys.stdin.readline()
    c.sendall(b); c.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        x = c.recv(4096)
        if not x: break
        got += x
    want = hashlib.sha256(a + b).hexdigest()
    print("OK" if got.decode() == want else f"MISMATCH {got!r} {want}", flush=True)
"#;

/// A server and a client of [`PEER_PY`], both preloaded in `region`, connected (on a ring if
/// the agreement succeeded) with the first half of the stream sent.
struct Pair {
    server: std::process::Child,
    client: std::process::Child,
    port: u16,
    client_out: std::io::BufReader<std::process::ChildStdout>,
}

impl Pair {
    fn start(region: &str) -> Pair {
        use std::io::BufRead;
        let lib = preload_lib().unwrap();
        let py = |args: &[&str]| {
            let mut c = Command::new("timeout");
            c.args(["-k", "5", "60", "python3", "-c", PEER_PY])
                .args(args)
                .env("LD_PRELOAD", &lib)
                .env("MEMLOOP_REGION", region)
                .env("MEMLOOP_SERVER_WAIT_US", "100000")
                .env("PYTHONDONTWRITEBYTECODE", "1")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped());
            c.spawn().expect("start python3")
        };
        let mut server = py(&["server"]);
        let mut line = String::new();
        std::io::BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port: u16 = line.trim().parse().expect("the server prints its port");
        let mut client = py(&["client", &port.to_string()]);
        let mut client_out = std::io::BufReader::new(client.stdout.take().unwrap());
        let mut line = String::new();
        client_out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "half", "the client sent its first half");
        Pair {
            server,
            client,
            port,
            client_out,
        }
    }

    /// The id (`IDX.GEN`) of the accepted channel carrying this pair's connection.
    fn channel(&self, region: &str) -> String {
        let v = status_json(region);
        let ch = v["channels"].as_array().unwrap().iter().find(|c| {
            c["state"] == "accepted"
                && c["tuple"]["server"]
                    .as_str()
                    .is_some_and(|s| s.ends_with(&format!(":{}", self.port)))
        });
        let ch = ch.unwrap_or_else(|| panic!("no ring channel for port {}: {v}", self.port));
        format!("{}.{}", ch["idx"], ch["gen"])
    }

    /// Sends the second half and checks that the server saw every byte, once, in order.
    fn finish(mut self) {
        use std::io::BufRead;
        self.client
            .stdin
            .take()
            .unwrap()
            .write_all(b"go\n")
            .unwrap();
        let mut line = String::new();
        self.client_out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "OK", "the stream arrived intact");
        assert!(self.client.wait().unwrap().success());
        assert!(self.server.wait().unwrap().success());
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for c in [&mut self.client, &mut self.server] {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn find_channel(v: &Value, id: &str) -> Option<Value> {
    v["channels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| format!("{}.{}", c["idx"], c["gen"]) == id)
        .cloned()
}

/// `demote --conn ID` sets the channel's switch request, which `status` shows. Whether the
/// connection then moves is the preload's business (see the next test).
fn demote_sets_the_switch_request_of_a_live_ring_connection() {
    let r = TestRegion::create("demote-req");
    let pair = Pair::start(&r.0);
    let id = pair.channel(&r.0);
    let ch = find_channel(&status_json(&r.0), &id).unwrap();
    assert_eq!(ch["switch_requested"], false, "{ch}");
    assert_eq!(ch["switch_reason"], Value::Null, "{ch}");

    let o = memloop(&["demote", "--conn", &id, "--wait", "0", "--region", &r.0]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("asked 1 channel "), "{}", stdout(&o));
    let v = status_json(&r.0);
    if let Some(ch) = find_channel(&v, &id) {
        assert_eq!(ch["switch_requested"], true, "{ch}");
        assert_eq!(ch["switch_reason"], "operator", "{ch}");
    } else {
        // The preload acted on the request already: the channel is freed, the stream on TCP.
        assert!(
            v["connections"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["switched"] == "operator"),
            "{v}"
        );
    }
    // Asking again is harmless and says so; `--pid` of either end selects the channel too.
    let o = memloop(&["demote", "--conn", &id, "--wait", "0", "--region", &r.0]);
    if o.status.success() {
        assert!(stdout(&o).contains("already asked"), "{}", stdout(&o));
    }
    let o = memloop(&[
        "demote",
        "--pid",
        &pair.client.id().to_string(),
        "--wait",
        "0",
        "--region",
        &r.0,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    pair.finish();
}

/// The whole of `demote`: the channel is freed, both sides record a switched connection, and
/// the stream goes on over TCP without losing or repeating a byte.
fn demote_moves_a_live_connection_to_tcp_and_promote_brings_it_back() {
    let r = TestRegion::create("demote-move");
    let pair = Pair::start(&r.0);
    let id = pair.channel(&r.0);
    let o = memloop(&["demote", "--conn", &id, "--wait", "10", "--region", &r.0]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("1 of 1 finished"), "{}", stdout(&o));
    let v = status_json(&r.0);
    // The channel stays (its side words) until the connection closes; both sides on TCP.
    let ch = find_channel(&v, &id).expect("the channel is kept while the connection lives");
    assert_eq!(ch["path"], "tcp", "{v}");
    assert_eq!(
        ch["on_tcp"],
        serde_json::json!({"client": true, "server": true}),
        "{v}"
    );
    let switched: Vec<&Value> = v["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["switched"] == "operator"
                && c["tuple"]["server"]
                    .as_str()
                    .is_some_and(|s| s.ends_with(&format!(":{}", pair.port)))
        })
        .collect();
    assert!(!switched.is_empty(), "a switched record: {v}");
    assert!(
        switched
            .iter()
            .all(|c| c["switches"] == 1 && c["path"] == "tcp"),
        "{v}"
    );
    assert!(
        switched
            .iter()
            .any(|c| c["ring_bytes"].as_u64() >= Some(1 << 18)),
        "the first half went over the ring: {v}"
    );
    assert!(v["switches"]["operator"].as_u64() >= Some(1), "{v}");
    // And back: both sides return to the ring at an agreed stream position.
    let o = memloop(&["promote", "--conn", &id, "--wait", "10", "--region", &r.0]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("1 of 1 finished"), "{}", stdout(&o));
    let v = status_json(&r.0);
    let ch = find_channel(&v, &id).expect("the channel");
    assert_eq!(ch["path"], "ring", "{v}");
    assert_eq!(ch["switch_requested"], false, "{v}");
    assert!(v["switches"]["promoted"].as_u64() >= Some(1), "{v}");
    pair.finish();
}

/// `region pause`: the live connection moves to TCP mid-stream (reason `region`), a connection
/// made while paused stays on TCP (fallback `paused`); `region resume` brings the first back.
/// Both streams arrive whole.
fn pause_moves_live_connections_to_tcp_keeps_new_ones_there_and_resume_brings_them_back() {
    let r = TestRegion::create("pause");
    let live = Pair::start(&r.0);
    let id = live.channel(&r.0);
    let o = memloop(&["region", "pause", "--wait", "10", "--region", &r.0]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("1 of 1 finished"), "{}", stdout(&o));
    let v = status_json(&r.0);
    assert_eq!(v["region"]["state"], "paused", "{v}");
    let ch = find_channel(&v, &id).expect("the channel is kept while the connection lives");
    assert_eq!(ch["path"], "tcp", "{v}");
    assert_eq!(ch["switch_reason"], "region", "{v}");
    assert_eq!(v["switches"]["region"], 1, "{v}");

    let late = Pair::start(&r.0);
    let v = status_json(&r.0);
    assert_eq!(
        v["fallbacks"]["paused"], 1,
        "the new connection stayed on TCP: {v}"
    );
    let on_ring = v["channels"].as_array().unwrap().iter().any(|c| {
        c["marker"] == false
            && c["tuple"]["server"]
                .as_str()
                .is_some_and(|s| s.ends_with(&format!(":{}", late.port)))
    });
    assert!(
        !on_ring,
        "no channel for a connection made while paused: {v}"
    );

    let o = memloop(&["region", "resume", "--wait", "10", "--region", &r.0]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("1 of 1 finished"), "{}", stdout(&o));
    let v = status_json(&r.0);
    assert_eq!(v["region"]["state"], "open", "{v}");
    assert_eq!(find_channel(&v, &id).unwrap()["path"], "ring", "{v}");
    assert!(v["switches"]["promoted"].as_u64() >= Some(1), "{v}");
    live.finish();
    late.finish();
}

/// `region destroy` moves a live connection to TCP first; the stream then ends whole on TCP
/// although the region file is gone.
fn destroy_moves_live_connections_to_tcp_before_the_region_goes() {
    let r = TestRegion::create("destroy-live");
    let pair = Pair::start(&r.0);
    let id = pair.channel(&r.0);
    let o = memloop(&["region", "destroy", "--wait", "10", "--region", &r.0]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("demote: asked 1 channel"), "{out}");
    assert!(out.contains("1 of 1 finished"), "channel {id}: {out}");
    assert!(out.contains("destroyed region"), "{out}");
    pair.finish();
}

/// A connection that got onto its ring after `pause` looked (or a pause written by anything
/// else): the processes' heartbeats see the paused state and demote it themselves.
fn the_heartbeat_demotes_ring_connections_of_a_paused_region() {
    let r = TestRegion::create("pause-beat");
    let pair = Pair::start(&r.0);
    let id = pair.channel(&r.0);
    let region = Region::open(&RegionSpec::parse(&r.0)).unwrap();
    region
        .registry()
        .set_state(memloop::registry::RegionState::Paused)
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let ch = loop {
        let ch = find_channel(&status_json(&r.0), &id).expect("the channel is kept");
        if ch["path"] == "tcp" || std::time::Instant::now() > deadline {
            break ch;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(
        (&ch["path"], &ch["switch_reason"]),
        (&"tcp".into(), &"region".into()),
        "{ch}"
    );
    pair.finish();
}

/// Eight connections streaming 4 MiB each through a region whose file system (a tmpfs of
/// 4 MiB under a 64 MiB region: a container's small `/dev/shm`) runs out of memory: before,
/// the first write to a ring page the file system had no room for killed the program with
/// SIGBUS. Now ring memory is reserved before it is touched — a connection's first windows
/// when its rings are made, more when a window grows: a connection that finds no room falls
/// back to TCP (`region_full`), a window that finds none stays as it is (`windows.no_room`),
/// every byte arrives, and creating a region where even its tables do not fit is a clear
/// error that leaves no file behind.
fn a_region_on_a_full_file_system_falls_back_instead_of_crashing() {
    let dir = std::env::temp_dir().join(format!("memloop-fullfs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&dir)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mounting a tmpfs at {}", dir.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _u = Unmount(dir.clone());
    let region = dir.join("r").display().to_string();
    let o = memloop(&["region", "create", "--region", &region, "--size", "64M"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // (The program accepts its own connections from a thread that the GIL may hold off for
    // longer than the 5 ms a self-connect waits for the decision under CI load: those would
    // stay on TCP and never press on the file system.)
    let o = Command::new(BIN)
        .args([
            "run", "--strict", "--region", &region, "--", "python3", "-c", BULK_PY,
        ])
        .env("MEMLOOP_DECIDE_WAIT_SELF_US", "500000")
        .output()
        .expect("running the streams");
    assert!(
        o.status.success(),
        "the program did not survive the full file system ({:?}): {}",
        o.status,
        stderr(&o)
    );
    assert_eq!(stdout(&o).trim(), "OK 8", "{}", stderr(&o));
    let v = status_json(&region);
    // Where memory ran out, a connection stayed on TCP or a ring's window did not grow.
    let full = v["fallbacks"]["region_full"].as_u64().unwrap_or(0);
    let no_room = v["windows"]["no_room"].as_u64().unwrap_or(0);
    assert!(
        full + no_room >= 1,
        "nothing found the file system full: {v}"
    );
    assert!(
        v["ring_bytes"].as_u64().unwrap_or(0) > 0,
        "no ring used: {v}"
    );

    let tiny = dir.join("tiny");
    std::fs::create_dir_all(&tiny).unwrap();
    let _ = std::fs::remove_file(&region); // give the space back; now fill all but ~64 KiB
    let fill = dir.join("fill");
    let filled = Command::new("dd")
        .args(["if=/dev/zero", "bs=64K", "count=63"])
        .arg(format!("of={}", fill.display()))
        .output()
        .expect("dd");
    assert!(filled.status.success(), "{}", stderr(&filled));
    let cramped = tiny.join("r").display().to_string();
    let o = memloop(&["region", "create", "--region", &cramped, "--size", "64M"]);
    assert!(
        !o.status.success(),
        "a region whose tables do not fit was created"
    );
    assert!(stderr(&o).contains("file system"), "{}", stderr(&o));
    assert!(
        !tiny.join("r").exists(),
        "the half-made region file was left behind"
    );
}

/// Eight connections to a server in the same process, 4 MiB each way in, every byte counted.
const BULK_PY: &str = r#"
import socket, threading
N, CHUNK, CHUNKS = 8, 1 << 16, 64
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(N)
got = [0] * N
def drain(i, c):
    while (b := c.recv(1 << 20)):
        got[i] += len(b)
def accept():
    for i in range(N):
        c, _ = ls.accept()
        threading.Thread(target=drain, args=(i, c)).start()
t = threading.Thread(target=accept); t.start()
cs = [socket.create_connection(ls.getsockname()) for _ in range(N)]
for c in cs:
    for _ in range(CHUNKS):
        c.sendall(b"x" * CHUNK)
    c.close()
t.join()
for th in threading.enumerate():
    if th is not threading.current_thread():
        th.join()
assert got == [CHUNK * CHUNKS] * N, got
print("OK", N)
"#;
