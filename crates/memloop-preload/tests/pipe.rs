//! The pipe service from programs under `memloop run` (issue 20): the C API of the preload
//! library (`include/memloop_pipe.h`) driven by `examples/c/pipe_copy.c`, and `sendfile`
//! calls of a real program (python3) routed to the service with `MEMLOOP_PIPE_SENDFILE=1` —
//! or, with no service, made by the kernel as before. Each test starts its own
//! `memloop pipe serve` and reads what it charged to the program's tenant from
//! `memloop pipe status --json`.
//!
//! Needs the release build of the library and the CLI:
//!
//! ```sh
//! cargo build --release -p memloop-preload -p memloop-cli
//! cargo test --release -p memloop-preload --test pipe
//! ```

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{gcc, memloop_bin, spawn, Proc, RegionGuard, Scratch};

fn main() -> std::process::ExitCode {
    use memloop_testkit::{test, tool};
    memloop_testkit::run(vec![
        test!(the_c_api_moves_files_to_sockets_and_pipes_blocking_and_not)
            .needs(tool("gcc", &["--version"])),
        test!(sendfile_of_a_real_program_goes_through_the_service)
            .needs(tool("python3", &["--version"])),
        test!(sendfile_without_a_service_is_the_kernels).needs(tool("python3", &["--version"])),
    ])
}

/// `memloop pipe serve` on a socket of its own or the region's, killed on drop.
struct Serve {
    _proc: Proc,
    at: Vec<String>,
}

impl Serve {
    fn start(at: &[&str], dir: &Scratch, expect: &Path) -> Serve {
        let mut cmd = vec![
            memloop_bin().display().to_string(),
            "pipe".into(),
            "serve".into(),
        ];
        let at: Vec<String> = at.iter().map(|s| s.to_string()).collect();
        cmd.extend(at.iter().cloned());
        let mut proc = spawn(&cmd, &dir.0.join("serve.out"), &dir.0.join("serve.err"));
        let t = Instant::now();
        while !expect.exists() {
            if let Ok(Some(st)) = proc.0.try_wait() {
                panic!(
                    "memloop pipe serve exited ({st}): {}",
                    std::fs::read_to_string(dir.0.join("serve.err")).unwrap_or_default()
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "no socket at {}",
                expect.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Serve { _proc: proc, at }
    }

    fn status(&self) -> serde_json::Value {
        let o = Command::new(memloop_bin())
            .args(["pipe", "status", "--json"])
            .args(&self.at)
            .output()
            .expect("memloop pipe status");
        assert!(
            o.status.success(),
            "memloop pipe status: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice(&o.stdout).expect("status JSON")
    }

    /// The statistics of tenant `name` (panics with the whole status if there is none).
    fn tenant(&self, name: &str) -> serde_json::Value {
        let st = self.status();
        st["tenants"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no tenant {name:?} in the service's status: {st}"))
    }
}

/// `memloop run --region REGION -- CMD…` with `env` added, bounded by `timeout`: (exit code,
/// stdout, stderr).
fn memloop_run(
    region: &str,
    env: &[(&str, String)],
    cmd: &[String],
) -> (Option<i32>, String, String) {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", "120"])
        .arg(memloop_bin())
        .args(["run", "--region", region, "--"])
        .args(cmd)
        .env_remove("LD_PRELOAD")
        .env_remove("MEMLOOP_REGION")
        .stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().expect("memloop run");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A file of `n` pseudo-random bytes.
fn random_file(path: &Path, n: usize) {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ n as u64;
    let bytes: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(path, bytes).expect("write the data file");
}

fn log_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `examples/c/pipe_copy.c` built with gcc against `include/memloop_pipe.h`.
fn build_example(dir: &Scratch) -> PathBuf {
    let exe = dir.0.join("pipe_copy");
    gcc(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/c/pipe_copy.c"),
        &exe,
    );
    exe
}

/// The C example under `memloop run`, the service on a socket of its own
/// (`MEMLOOP_PIPE_SOCKET`): `memloop_pipe` from a file to a Unix socket and to a TCP
/// connection (a ring connection, which leaves its ring), two transfers at once through
/// `memloop_pipe_submit`/`memloop_pipe_fd`/`memloop_pipe_complete`, a cancelled one, one in a
/// fork child and one in the parent after it — every byte checked by the program — and the
/// service charged the tenant and weight the environment named with exactly the bytes moved,
/// the child through a connection of its own. Without the preload the program finds no
/// functions (exit 2).
fn the_c_api_moves_files_to_sockets_and_pipes_blocking_and_not() {
    let dir = Scratch::new("pipe", "capi");
    let exe = build_example(&dir);
    let data = dir.0.join("data");
    const SIZE: usize = 5 * 1024 * 1024 + 777;
    random_file(&data, SIZE);
    let socket = dir.0.join("pipe.sock");
    let serve = Serve::start(&["--socket", socket.to_str().unwrap()], &dir, &socket);
    let region = RegionGuard::new("pipe", "capi", 64 << 20);
    let log = dir.0.join("engine.log");
    let env = [
        ("MEMLOOP_PIPE_SOCKET", socket.display().to_string()),
        ("MEMLOOP_PIPE_TENANT", "c-example".to_string()),
        ("MEMLOOP_PIPE_WEIGHT", "3".to_string()),
        ("MEMLOOP_LOG", "debug".to_string()),
        ("MEMLOOP_LOG_FILE", log.display().to_string()),
    ];
    let args = [
        exe.display().to_string(),
        data.display().to_string(),
        dir.0.display().to_string(),
    ];
    let (code, out, err) = memloop_run(&region.0, &env, &args);
    assert_eq!(
        code,
        Some(0),
        "pipe_copy under memloop run:\n{out}\n{err}\n--- engine log (tail):\n{}",
        support::tail(&log_of(&log), 40)
    );
    assert!(out.starts_with("ok "), "{out}");
    let t = serve.tenant("c-example");
    // Two blocking transfers and two concurrent ones of the whole file, one in the fork child
    // and one in the parent after it; the cancelled one moved nothing.
    assert_eq!(t["bytes"], 6 * SIZE as u64, "bytes charged: {t}");
    assert_eq!(t["weight"], 3, "{t}");
    let log = log_of(&log);
    let connected: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pipe service connected"))
        .collect();
    assert_eq!(
        connected.len(),
        2,
        "one connection for the parent, one for its fork child:\n{}",
        support::tail(&log, 40)
    );
    let st = serve.status();
    assert_eq!(st["totals"]["completed"], 6, "{st}");
    assert_eq!(st["totals"]["cancelled"], 1, "{st}");
    assert_eq!(st["transfers"], 0, "{st}");

    // Not under the preload: the weak functions are not there.
    let o = Command::new(&exe)
        .arg(&data)
        .arg(&dir.0)
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run pipe_copy");
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Runs `tests/pipe_sendfile.py` under `memloop run` with `MEMLOOP_PIPE_SENDFILE=1`: its JSON
/// report, and the engine's debug log.
fn run_sendfile_script(
    region: &str,
    dir: &Scratch,
    extra: &[(&str, String)],
) -> (serde_json::Value, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pipe_sendfile.py");
    let log = dir.0.join("engine.log");
    let _ = std::fs::remove_file(&log);
    let mut env = vec![
        ("MEMLOOP_PIPE_SENDFILE", "1".to_string()),
        ("MEMLOOP_PIPE_TENANT", "py-sendfile".to_string()),
        ("MEMLOOP_LOG", "debug".to_string()),
        ("MEMLOOP_LOG_FILE", log.display().to_string()),
        ("PYTHONDONTWRITEBYTECODE", "1".to_string()),
    ];
    env.extend(extra.iter().cloned());
    let args = [
        "python3".to_string(),
        script.display().to_string(),
        dir.0.display().to_string(),
    ];
    let (code, out, err) = memloop_run(region, &env, &args);
    let log = log_of(&log);
    assert_eq!(
        code,
        Some(0),
        "pipe_sendfile.py under memloop run:\n{out}\n{err}\n--- engine log (tail):\n{}",
        support::tail(&log, 40)
    );
    let report = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("the script's report ({e}): {out}\n{err}"));
    (report, log)
}

/// python3's `socket.sendfile` and `os.sendfile` (with an offset, without one, and on a
/// non-blocking socket) under `memloop run` with `MEMLOOP_PIPE_SENDFILE=1` and the service on
/// the region's own socket (`<region>.wake/pipe`, found by the rule alone): the bytes and
/// offsets are the kernel's (the script checks them), and the service charged the program's
/// tenant with every byte of the blocking calls (and some or all of the non-blocking ones).
fn sendfile_of_a_real_program_goes_through_the_service() {
    let dir = Scratch::new("pipe", "sendfile");
    let region = RegionGuard::new("pipe", "sendfile", 64 << 20);
    let spec = memloop::RegionSpec::parse(&region.0);
    let socket = memloop::region::wake_dir(&spec.path()).join("pipe");
    let serve = Serve::start(&["--region", &region.0], &dir, &socket);
    let (r, log) = run_sendfile_script(&region.0, &dir, &[]);
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
    let blocking = n("a") + n("b") + n("c");
    let t = serve.tenant("py-sendfile");
    let bytes = t["bytes"].as_u64().unwrap();
    // (A non-blocking call the service could not start within MEMLOOP_PIPE_NONBLOCK_WAIT_US
    // is the kernel's: those bytes may or may not be the service's.)
    assert!(
        bytes >= blocking && bytes <= blocking + n("d"),
        "the service moved {bytes} bytes for the program; its blocking calls moved {blocking}, \
         the non-blocking ones {}: {t}\n--- engine log (tail):\n{}",
        n("d"),
        support::tail(&log, 40)
    );
    assert!(
        log.contains("sendfile through the pipe service"),
        "{}",
        support::tail(&log, 40)
    );
    let st = serve.status();
    assert_eq!(st["transfers"], 0, "nothing left in flight: {st}");
}

/// The same program with no service at the socket: every call is the kernel's (the script
/// checks every byte and offset), each counted as a fallback in the debug log.
fn sendfile_without_a_service_is_the_kernels() {
    let dir = Scratch::new("pipe", "nosvc");
    let region = RegionGuard::new("pipe", "nosvc", 64 << 20);
    let nowhere = dir.0.join("no-service-here");
    let (r, log) = run_sendfile_script(
        &region.0,
        &dir,
        &[("MEMLOOP_PIPE_SOCKET", nowhere.display().to_string())],
    );
    assert!(r["d"].as_u64().is_some(), "{r}");
    assert!(
        log.contains("no pipe service") && log.contains("pipe service fallback"),
        "no fallback in the log:\n{}",
        support::tail(&log, 40)
    );
    assert!(
        !log.contains("sendfile through the pipe service"),
        "{}",
        support::tail(&log, 40)
    );
}
