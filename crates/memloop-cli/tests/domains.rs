//! End-to-end tests of `memloop domains`: namespaces on a bridge (the veth+bridge baseline).
//! Most need root, `ip` (iproute2) and python3; without them the runner reports them ignored
//! with the reason (failed under `CI`).

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::process::{Child, ChildStdout, Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

/// Listens on argv[1]:argv[2], prints "ready", then echoes everything one client sends to stdout.
const LISTENER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
s.settimeout(20)
c, _ = s.accept()
c.settimeout(20)
data = b""
while True:
    b = c.recv(4096)
    if not b:
        break
    data += b
sys.stdout.write(data.decode())
"#;

/// Connects to argv[1]:argv[2] and sends argv[3]; exit code 3 if the connection is refused.
const CLIENT: &str = r#"
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
except ConnectionRefusedError:
    sys.exit(3)
c.sendall(sys.argv[3].encode())
c.close()
"#;

fn memloop(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run memloop")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn main() -> std::process::ExitCode {
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(domains_up_connect_isolate_list_down).needs(needs()),
        test!(domains_exec_in_unknown_domain_is_a_clear_error).needs(needs()),
        test!(domains_exec_becomes_the_command_signals_and_status_included).needs(needs()),
        test!(domains_reject_bad_plans_before_touching_anything),
        test!(domains_down_with_nothing_there_is_fine).needs(needs()),
    ])
}

/// What most of these tests need: root, `ip` and python3.
fn needs() -> memloop_testkit::Need {
    memloop_testkit::all([
        memloop_testkit::root(),
        memloop_testkit::tool("ip", &["-V"]),
        memloop_testkit::tool("python3", &["-V"]),
    ])
}

/// Domains under a prefix unique to this process; `domains down` on drop, whatever happened.
struct Domains {
    prefix: String,
    /// The subnet's first three octets with the trailing dot, e.g. "10.142.7."
    net: String,
    subnet: String,
}

impl Domains {
    fn up(n: u32) -> Self {
        Self::up_as(n, 0)
    }

    /// [`Domains::up`] for test number `k` of this process (tests run at once: each its own
    /// prefix and subnet).
    fn up_as(n: u32, k: u32) -> Self {
        let pid = std::process::id();
        // "t<pid>-br0" is at most 12 bytes, 13 with a test number: within the 15-byte
        // interface name limit.
        let net = format!("10.{}.{}.", 100 + pid % 100, (pid / 100 + k) % 256);
        let tag = if k == 0 { String::new() } else { k.to_string() };
        let d = Domains {
            prefix: format!("t{pid}{tag}"),
            subnet: format!("{net}0/24"),
            net,
        };
        let o = d.run(&["up", &n.to_string(), "--subnet", &d.subnet]);
        assert!(o.status.success(), "domains up: {}", text(&o.stderr));
        d
    }

    /// `memloop domains SUB --prefix PREFIX ARGS…`
    fn run(&self, args: &[&str]) -> Output {
        memloop(&self.argv(args))
    }

    fn argv<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["domains", args[0], "--prefix", &self.prefix];
        v.extend_from_slice(&args[1..]);
        v
    }

    /// Host `i` of the subnet (domain i-1's address).
    fn addr(&self, host: u32) -> String {
        format!("{}{host}", self.net)
    }

    /// `domains exec I -- python3 -c SCRIPT ARGS…`
    fn python(&self, i: u32, script: &str, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        let i = i.to_string();
        c.args(self.argv(&["exec", &i, "--", "python3", "-c", script]))
            .args(args);
        c
    }

    /// Starts LISTENER in domain `i` on host:port and waits until it listens.
    fn listen(&self, i: u32, host: &str, port: &str) -> Bg {
        let mut child = self
            .python(i, LISTENER, &[host, port])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn listener");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).expect("read listener");
        let bg = Bg { child, out };
        assert_eq!(line.trim(), "ready", "listener in domain {i} did not start");
        bg
    }

    /// Runs CLIENT in domain `i`; returns its exit code.
    fn connect(&self, i: u32, host: &str, port: &str, msg: &str) -> i32 {
        let o = self
            .python(i, CLIENT, &[host, port, msg])
            .output()
            .expect("run client");
        o.status.code().unwrap_or(-1)
    }
}

impl Drop for Domains {
    fn drop(&mut self) {
        let o = self.run(&["down"]);
        if !o.status.success() {
            eprintln!("cleanup: domains down failed: {}", text(&o.stderr));
        }
    }
}

/// A background process, killed on drop if still running.
struct Bg {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Bg {
    /// Waits for it to exit; returns what it printed after "ready".
    fn finish(mut self) -> String {
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).expect("read output");
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "background process failed: {status}");
        rest
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn netns_names() -> String {
    text(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
}

fn domains_up_connect_isolate_list_down() {
    let d = Domains::up(2);
    let (a0, a1) = (d.addr(1), d.addr(2));

    // Idempotent: the same layout again is reported, not rebuilt.
    let o = d.run(&["up", "2", "--subnet", &d.subnet]);
    assert!(o.status.success(), "second up: {}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("already up"),
        "{}",
        text(&o.stdout)
    );

    // Domain 0 reaches domain 1 over the bridge.
    let listener = d.listen(1, "0.0.0.0", "5000");
    assert_eq!(d.connect(0, &a1, "5000", "over the bridge"), 0);
    assert_eq!(listener.finish(), "over the bridge");

    // Domain 1's loopback is its own: domain 0 is refused (exit code 3 propagates) while
    // domain 1 itself gets through.
    let listener = d.listen(1, "127.0.0.1", "5001");
    assert_eq!(d.connect(0, "127.0.0.1", "5001", "x"), 3);
    assert_eq!(d.connect(1, "127.0.0.1", "5001", "local"), 0);
    assert_eq!(listener.finish(), "local");

    check_list(&d, &[a0, a1]);

    let o = d.run(&["down"]);
    assert!(o.status.success(), "down: {}", text(&o.stderr));
    let left = netns_names();
    assert!(!left.contains(&format!("{}-d", d.prefix)), "left: {left}");
    let bridge = format!("{}-br0", d.prefix);
    let o = Command::new("ip")
        .args(["link", "show", "dev", &bridge])
        .output();
    assert!(!o.unwrap().status.success(), "bridge {bridge} still there");
}

/// `list --json` shows both domains with their addresses and two distinct namespaces.
fn check_list(d: &Domains, addrs: &[String]) {
    let o = d.run(&["list", "--json"]);
    assert!(o.status.success(), "list: {}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).expect("list --json is JSON");
    let ds = v["domains"].as_array().expect("domains array");
    assert_eq!(ds.len(), 2, "{v}");
    for (i, (dom, addr)) in ds.iter().zip(addrs).enumerate() {
        assert_eq!(dom["index"], i);
        assert_eq!(dom["netns"], format!("{}-d{i}", d.prefix).as_str());
        assert_eq!(dom["address"], format!("{addr}/24").as_str());
    }
    let inodes: Vec<u64> = ds
        .iter()
        .map(|x| x["netns_inode"].as_u64().unwrap())
        .collect();
    let root = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
    assert_ne!(inodes[0], inodes[1], "{v}");
    assert!(
        !inodes.contains(&root),
        "a domain is the root namespace: {v}"
    );
}

fn domains_exec_in_unknown_domain_is_a_clear_error() {
    // A domain that does not exist is a clear error.
    let o = memloop(&["domains", "exec", "0", "--prefix", "nonexist", "--", "true"]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("memloop domains up"),
        "{}",
        text(&o.stderr)
    );
}

/// `domains exec` is CMD itself: a signal sent to the pid it was started as reaches CMD (no
/// process left behind), and CMD's exit status is what its caller sees.
fn domains_exec_becomes_the_command_signals_and_status_included() {
    let d = Domains::up_as(1, 1);
    let o = d.run(&["exec", "0", "--", "sh", "-c", "exit 7"]);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o.stderr));

    let mut child = Command::new(BIN)
        .args(d.argv(&["exec", "0", "--", "sleep", "30"]))
        .spawn()
        .expect("spawning memloop domains exec");
    let comm = format!("/proc/{}/comm", child.id());
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "the started pid never became the command"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a child's pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill -TERM");
    let status = child.wait().expect("waiting for it");
    use std::os::unix::process::ExitStatusExt;
    let term = rustix::process::Signal::TERM.as_raw();
    assert_eq!(status.signal(), Some(term), "{status:?}");
}

fn domains_reject_bad_plans_before_touching_anything() {
    // Interface names over 15 bytes, a subnet without room for .254: errors, no root needed.
    let o = memloop(&["domains", "up", "2", "--prefix", "averyverylongprefix"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--prefix"), "{}", text(&o.stderr));
    let o = memloop(&["domains", "up", "2", "--subnet", "10.0.0.0/28"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--subnet"), "{}", text(&o.stderr));
}

/// Nothing there is fine for `down`.
fn domains_down_with_nothing_there_is_fine() {
    let o = memloop(&["domains", "down", "--prefix", "nonexist"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}
