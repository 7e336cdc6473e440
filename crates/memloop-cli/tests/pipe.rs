//! `memloop pipe` as separate processes: a service, clients handing it files and pipes, a
//! client killed mid-transfer, the service stopped by SIGTERM.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_memloop");

struct Serve {
    child: Child,
    socket: PathBuf,
}

impl Serve {
    fn start(tag: &str) -> Serve {
        let socket =
            std::env::temp_dir().join(format!("memloop-pipe-cli-{tag}-{}", std::process::id()));
        let child = Command::new(BIN)
            .args(["pipe", "serve", "--socket"])
            .arg(&socket)
            .stderr(Stdio::null())
            .spawn()
            .expect("memloop pipe serve");
        wait_until("the socket", || socket.exists());
        Serve { child, socket }
    }

    fn status(&self) -> serde_json::Value {
        let o = Command::new(BIN)
            .args(["pipe", "status", "--json", "--socket"])
            .arg(&self.socket)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn copy(socket: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["pipe", "copy", "--socket"]).arg(socket).args(args);
    c
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
}

#[test]
fn copy_moves_a_file_and_stdin_to_stdout_and_status_charges_the_tenant() {
    let s = Serve::start("copy");
    let dir = std::env::temp_dir();
    let (a, b) = (
        dir.join(format!("pipe-a-{}", std::process::id())),
        dir.join(format!("pipe-b-{}", std::process::id())),
    );
    let want = data(3 << 20);
    std::fs::write(&a, &want).unwrap();
    let o = copy(
        &s.socket,
        &[
            a.to_str().unwrap(),
            b.to_str().unwrap(),
            "--tenant",
            "files",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&b).unwrap() == want, "file copied whole");
    // stdin (a pipe) to stdout (a pipe): splice.
    let mut c = copy(&s.socket, &["-", "-", "--tenant", "pipes", "--len", "1M"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut inp = c.stdin.take().unwrap();
    let w = want.clone();
    let feeder = std::thread::spawn(move || {
        let _ = inp.write_all(&w);
    });
    let mut got = Vec::new();
    c.stdout.take().unwrap().read_to_end(&mut got).unwrap();
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(c.wait().unwrap().success(), "{err}");
    feeder.join().unwrap();
    assert!(got == want[..1 << 20], "exactly --len bytes, in order");
    assert!(err.contains("1048576 bytes moved with Splice"), "{err}");
    let st = s.status();
    let tenant = |n: &str| {
        st["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == n)
            .cloned()
            .unwrap()
    };
    assert_eq!(tenant("files")["bytes"], want.len() as u64);
    assert_eq!(tenant("pipes")["bytes"], 1u64 << 20);
    assert_eq!(st["totals"]["completed"], 2);
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
}

#[test]
fn a_client_killed_mid_transfer_has_it_cancelled_and_its_descriptors_closed() {
    let s = Serve::start("kill");
    let mut c = copy(&s.socket, &["-", "/dev/null", "--tenant", "victim"])
        .stdin(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut inp = c.stdin.take().unwrap();
    inp.write_all(&data(1 << 20)).unwrap();
    wait_until("the transfer waiting for more input", || {
        let st = s.status();
        st["parked"] == 1
    });
    c.kill().unwrap();
    c.wait().unwrap();
    // The service held the last reader of our pipe: once it lets go, a write breaks.
    let t = Instant::now();
    loop {
        match inp.write_all(b"more") {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => break,
            Err(e) => panic!("unexpected {e}"),
            Ok(()) => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the service still holds the pipe"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = s.status();
    assert_eq!(st["transfers"], 0);
    assert_eq!(st["totals"]["cancelled"], 1);
}

#[test]
fn sigterm_stops_the_service_and_removes_its_socket() {
    let mut s = Serve::start("term");
    let pid = s.child.id() as i32;
    let o = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(o.success());
    let t = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(!s.socket.exists(), "the socket is removed");
    let o = copy(&s.socket, &["/dev/null", "/dev/null"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no pipe service"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn memloop_status_shows_the_regions_pipe_service_and_its_tenants() {
    let region = format!("/dev/shm/memloop-pipe-status-{}", std::process::id());
    let run = |args: &[&str]| Command::new(BIN).args(args).output().unwrap();
    let o = run(&["region", "create", "--region", &region, "--size", "16M"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let socket = PathBuf::from(format!("{region}.wake/pipe"));
    let child = Command::new(BIN)
        .args(["pipe", "serve", "--region", &region])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s = Serve { child, socket };
    wait_until("the socket", || s.socket.exists());
    let o = copy(
        &s.socket,
        &["/dev/zero", "/dev/null", "--len", "2M", "--tenant", "zeros"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&["status", "--region", &region, "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let zeros = v["pipe"]["tenants"]
        .as_array()
        .expect("a pipe section with tenants")
        .iter()
        .find(|t| t["name"] == "zeros")
        .cloned()
        .expect("the tenant");
    assert_eq!(zeros["bytes"], 2u64 << 20);
    let o = run(&["status", "--region", &region]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("pipe service at") && text.contains("zeros"),
        "{text}"
    );
    drop(s);
    let o = run(&["status", "--region", &region, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["pipe"].is_null(), "no service, no section");
    let _ = run(&["region", "destroy", "--region", &region]);
}
