//! What the preload's process-level suites share (`semantics.rs`, `runtimes.rs`): where the
//! library and the CLI are, scratch directories and fresh regions removed by guards, child
//! processes that are killed when a test fails, bounded waits, and the outcome of a server and
//! a client run together with a readable report.
//!
//! Each test binary uses its own subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use memloop::{CreateRegion, Region, RegionSpec};
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A number unique within this test process (names of scratch directories and regions).
pub fn unique() -> u32 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The profile directory this test binary was built into (`target/<profile>`).
pub fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

/// Where a build artifact is: `$var`, else the file next to this profile, else in
/// `target/release`; `None` when none of them exists.
pub fn find_artifact(var: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let candidates = [
        profile_dir().map(|d| d.join(name)),
        Some(workspace().join("target/release").join(name)),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|c| c.exists())
        .map(|c| c.canonicalize().unwrap_or(c))
}

/// A build artifact (see [`find_artifact`]); panics with the command that builds it.
pub fn artifact(var: &str, name: &str, build: &str) -> PathBuf {
    find_artifact(var, name)
        .unwrap_or_else(|| panic!("{name} not found: build it first (`{build}`) or set {var}"))
}

pub fn preload_lib() -> PathBuf {
    artifact(
        "MEMLOOP_PRELOAD_LIB",
        "libmemloop.so",
        "cargo build --release -p memloop-preload",
    )
}

/// `timeout -k 5 LIMIT env -u LD_PRELOAD -u MEMLOOP_REGION [PYTHON…]`, then — under the preload
/// (`region` given) — the library, the region, debug logging and a server wait long enough that
/// a loaded machine does not turn a test's connection into a (correct but useless) TCP one.
/// The program's own command line follows.
pub fn env_prefix(limit: u64, region: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = ["timeout", "-k", "5", &limit.to_string(), "env"]
        .iter()
        .chain(&["-u", "LD_PRELOAD", "-u", "MEMLOOP_REGION"])
        .chain(&["PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"])
        .map(|s| s.to_string())
        .collect();
    if let Some(r) = region {
        v.push(format!("LD_PRELOAD={}", preload_lib().display()));
        v.push(format!("MEMLOOP_REGION={r}"));
        // (MEMLOOP_TEST_LOG overrides the filter, e.g. to trace one module.)
        let log = std::env::var("MEMLOOP_TEST_LOG").unwrap_or_else(|_| "debug".into());
        v.push(format!("MEMLOOP_LOG={log}"));
        v.push("MEMLOOP_SERVER_WAIT_US=100000".into());
    }
    v
}

pub fn memloop_bin() -> PathBuf {
    artifact(
        "MEMLOOP_BIN",
        "memloop",
        "cargo build --release -p memloop-cli",
    )
}

// ---- guards -----------------------------------------------------------------------------------

/// A scratch directory `$TMPDIR/memloop-<suite>-<pid>-<tag>-<n>`, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(suite: &str, tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!(
            "memloop-{suite}-{}-{tag}-{}",
            std::process::id(),
            unique()
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("create scratch dir");
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A fresh region `<prefix>-<pid>-<tag>-<n>` of `size` bytes, destroyed on drop.
pub struct RegionGuard(pub String);

impl RegionGuard {
    /// A region of `size` bytes, its tables in proportion.
    pub fn new(prefix: &str, tag: &str, size: usize) -> RegionGuard {
        let params = memloop::registry::RegionParams::for_size(size as _);
        Self::with_params(prefix, tag, params)
    }

    pub fn with_params(
        prefix: &str,
        tag: &str,
        params: memloop::registry::RegionParams,
    ) -> RegionGuard {
        let name = format!("{prefix}-{}-{tag}-{}", std::process::id(), unique());
        let spec = RegionSpec::parse(&name);
        let _ = Region::destroy(&spec);
        let opts = CreateRegion {
            params,
            ..CreateRegion::default()
        };
        drop(Region::open_or_create(&spec, &opts).expect("create region"));
        RegionGuard(name)
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        let _ = Region::destroy(&RegionSpec::parse(&self.0));
    }
}

/// A child process killed (by its process-group-less pid) if still running on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts `cmd[0] cmd[1..]` with no stdin and its output in the two files.
pub fn spawn(cmd: &[String], out: &Path, err: &Path) -> Proc {
    let c = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(fs::File::create(out).expect("stdout file"))
        .stderr(fs::File::create(err).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    Proc(c)
}

/// Waits for the process, killing it after `limit`.
pub fn wait_bounded(p: &mut Proc, limit: Duration) -> ExitStatus {
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = p.0.try_wait().expect("wait") {
            return st;
        }
        if Instant::now() > end {
            let _ = p.0.kill();
            return p.0.wait().expect("wait after kill");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The port a server wrote to `file` (a decimal number), or `None` when the server exited or
/// `limit` passed first.
pub fn wait_for_port(server: &mut Proc, file: &Path, limit: Duration) -> Option<u16> {
    let end = Instant::now() + limit;
    loop {
        if let Ok(p) = fs::read_to_string(file) {
            if let Ok(p) = p.trim().parse::<u16>() {
                return Some(p);
            }
        }
        if Instant::now() > end || server.0.try_wait().ok().flatten().is_some() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The status of a process that never ran (no port, so no client).
pub fn not_started() -> ExitStatus {
    ExitStatus::from_raw(255 << 8)
}

/// Killed by SIGKILL (directly, or as reported by `timeout`).
pub fn killed(st: &ExitStatus) -> bool {
    st.signal() == Some(9) || st.code() == Some(137)
}

/// The signal that ended the process: its own, or the one `timeout` reports as 128 + n.
pub fn death_signal(st: &ExitStatus) -> Option<i32> {
    st.signal().or_else(|| {
        st.code()
            .filter(|c| (129..=128 + 64).contains(c))
            .map(|c| c - 128)
    })
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGINT => "SIGINT",
        _ => "signal",
    }
}

/// "exit 0", "exit 1", "killed by SIGSEGV (11)", "timed out (124)".
pub fn describe(st: &ExitStatus) -> String {
    if st.code() == Some(124) {
        return "timed out (timeout's 124)".into();
    }
    match death_signal(st) {
        Some(sig) => format!("killed by {} ({sig})", signal_name(sig)),
        None => format!("exit {}", st.code().unwrap_or(-1)),
    }
}

// ---- outcome ------------------------------------------------------------------------------------

/// A server and a client run together: how each ended and what each printed.
pub struct Outcome {
    pub server: ExitStatus,
    pub client: ExitStatus,
    pub server_out: String,
    pub server_err: String,
    pub client_out: String,
    pub client_err: String,
}

/// The last `lines` lines of `s`.
pub fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

impl Outcome {
    pub fn report(&self, what: &str) -> String {
        let kept = self.keep_logs();
        format!(
            "{what}{kept}\n--- server ({}) stdout:\n{}\n--- server stderr:\n{}\n--- client ({}) stdout:\n{}\n--- client stderr:\n{}",
            self.server,
            tail(&self.server_out, 20),
            tail(&self.server_err, 60),
            self.client,
            tail(&self.client_out, 20),
            tail(&self.client_err, 60),
        )
    }

    /// With `MEMLOOP_TEST_LOGS=DIR`, a failure's whole stderr logs go to a fresh directory
    /// under DIR (the report shows their tails only).
    fn keep_logs(&self) -> String {
        let Some(dir) = std::env::var_os("MEMLOOP_TEST_LOGS") else {
            return String::new();
        };
        let d = PathBuf::from(dir).join(format!("{}-{}", std::process::id(), unique()));
        let written = fs::create_dir_all(&d).and_then(|_| {
            fs::write(d.join("server.err"), &self.server_err)?;
            fs::write(d.join("client.err"), &self.client_err)
        });
        match written {
            Ok(()) => format!(" (whole logs in {})", d.display()),
            Err(e) => format!(" (logs not kept in {}: {e})", d.display()),
        }
    }
}

/// Builds the C program `src` into `exe` (gcc, warnings as errors).
pub fn gcc(src: &Path, exe: &Path) {
    let built = Command::new("gcc")
        .args([
            "-std=gnu11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
            "-o",
        ])
        .arg(exe)
        .arg(src)
        .status()
        .expect("gcc (apt-get install gcc)");
    assert!(built.success(), "gcc failed on {}", src.display());
}
