//! What the background services (`memloop link up`, `memloop blk export|attach`) share: where
//! their logs and state go, starting one in the background and waiting for its first line,
//! that line, finding a service by its command line, and stopping one.

use crate::error::{fail, CliResult, Context};
use memloop::{Region, RegionSpec};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The region `--region` names, else the environment's.
pub fn region_spec(region: Option<&str>) -> RegionSpec {
    match region {
        Some(r) => RegionSpec::parse(r),
        None => RegionSpec::from_env(),
    }
}

/// The network namespace of process `pid` ("self" for ours), as the kernel names it.
pub fn netns_of(pid: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()
}

/// Our network namespace's number (`net:[4026531840]` → `4026531840`), for file names.
pub fn netns_number() -> String {
    netns_of("self")
        .map(|p| {
            p.to_string_lossy()
                .replace(|c: char| !c.is_ascii_digit(), "")
        })
        .unwrap_or_default()
}

/// Where a service keeps its log and state: the region's wake directory, or the temporary
/// directory for a region without one (a device, as the ivshmem BAR in a guest).
pub fn state_dir(spec: &RegionSpec) -> PathBuf {
    let dir = memloop::region::wake_dir(&spec.path());
    match memloop::region::make_wake_dir(&dir) {
        Ok(()) => dir,
        Err(_) => std::env::temp_dir(),
    }
}

/// [`state_dir`] as a reader sees it (without creating anything): the wake directory if the
/// region has one, else the temporary directory.
pub fn state_dir_of(region: &Path) -> PathBuf {
    let dir = memloop::region::wake_dir(region);
    match dir.is_dir() {
        true => dir,
        false => std::env::temp_dir(),
    }
}

/// Runs `memloop ARGS` (which must start the service in the foreground) in the background,
/// in a process group of its own, its stderr in `log`; returns the first line it prints on
/// stdout (with `notify_env` set, the service prints it once it is ready: see
/// [`notify_ready`]). A service that ends before that is an error quoting its log.
pub fn start(
    spec: &RegionSpec,
    what: &str,
    args: &[OsString],
    log: &Path,
    notify_env: &str,
) -> CliResult<String> {
    Region::open(spec).context("opening the region")?;
    let log_file = std::fs::File::create(log).context(format!("creating {}", log.display()))?;
    let exe = std::env::current_exe().context("finding the memloop binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env(notify_env, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .context(format!("starting the {what} service"))?;
    let mut line = String::new();
    let out = child.stdout.take().expect("piped");
    BufReader::new(out).read_line(&mut line).ok();
    match line.trim() {
        "" => {
            let status = child.wait().ok();
            let text = std::fs::read_to_string(log).unwrap_or_default();
            Err(fail(format!(
                "the {what} service did not come up ({}): {}",
                status.map_or("?".into(), |s| s.to_string()),
                text.trim()
            )))
        }
        l => Ok(l.to_string()),
    }
}

/// The service's side of [`start`]: with `notify_env` set, prints `line` for the parent and
/// lets go of its pipe (so the parent's read ends); without it (run by hand in the
/// foreground), prints `line` only if `print_in_foreground`.
pub fn notify_ready(line: &str, notify_env: &str, print_in_foreground: bool) -> CliResult<()> {
    let notified = std::env::var_os(notify_env).is_some();
    if !notified && !print_in_foreground {
        return Ok(());
    }
    let mut out = std::io::stdout();
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .context("notifying")?;
    if notified {
        let null = std::fs::File::open("/dev/null").context("opening /dev/null")?;
        rustix::stdio::dup2_stdout(null.as_fd()).context("releasing stdout")?;
    }
    Ok(())
}

/// A flag that SIGINT and SIGTERM raise: the service's loop ends on it.
pub fn stop_flag() -> CliResult<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("handling signals")?;
    }
    Ok(stop)
}

/// The arguments of process `pid` (none if it is gone). A pid found in shared state may be
/// another pid namespace's: callers check the command line before they signal anything.
pub fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The process exists and is not a zombie waiting to be reaped.
pub fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// SIGTERM to the `what` service `pid`, then waits up to `limit` for it to be gone.
pub fn terminate(pid: u32, what: &str, limit: Duration) -> CliResult<()> {
    let p = rustix::process::Pid::from_raw(pid as i32).ok_or_else(|| fail("bad pid"))?;
    rustix::process::kill_process(p, rustix::process::Signal::TERM)
        .context(format!("stopping the {what} service (pid {pid})"))?;
    let deadline = Instant::now() + limit;
    while running(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    match running(pid) {
        true => Err(fail(format!(
            "the {what} service (pid {pid}) did not stop in {} s",
            limit.as_secs()
        ))),
        false => Ok(()),
    }
}
