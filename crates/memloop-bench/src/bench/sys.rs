//! CPU pinning, CPU time of a process, and the peer processes we start.

use crate::error::{fail, CliResult, Context};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The first two CPUs we may run on, if there are two.
pub fn two_cpus() -> Option<(usize, usize)> {
    let set = sched_getaffinity(None).ok()?;
    let mut cpus = (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c));
    Some((cpus.next()?, cpus.next()?))
}

/// Pins the calling thread (and threads it starts later) to `cpu`.
pub fn pin_to(cpu: usize) -> CliResult<()> {
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).context(format!("pinning to CPU {cpu}"))
}

/// CPU time `pid` has used so far, summed over its threads: nanoseconds from schedstat where
/// the kernel has it, else clock ticks from stat (10 ms resolution).
pub fn cpu_time(pid: u32) -> CliResult<Duration> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .context(format!("reading threads of {pid}"))?;
    let mut total = Duration::ZERO;
    for t in tasks.flatten() {
        let dir = t.path();
        // A thread may exit between listing and reading: skip it.
        if let Some(ns) = first_field(&dir.join("schedstat")) {
            total += Duration::from_nanos(ns);
        } else if let Some(ticks) = stat_ticks(&dir.join("stat")) {
            total += Duration::from_millis(ticks * 10);
        }
    }
    Ok(total)
}

fn first_field(p: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(p)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// utime + stime (fields 14 and 15) of a /proc stat file.
fn stat_ticks(p: &std::path::Path) -> Option<u64> {
    let s = std::fs::read_to_string(p).ok()?;
    let mut f = s[s.rfind(')')? + 2..].split_whitespace().skip(11);
    Some(f.next()?.parse::<u64>().ok()? + f.next()?.parse::<u64>().ok()?)
}

/// A peer process (this binary's hidden `peer`); killed if dropped before [`Self::finish`].
pub struct Peer {
    child: Option<Child>,
    what: String,
}

impl Peer {
    pub fn spawn(args: &[String]) -> CliResult<Peer> {
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let child = Command::new(exe)
            .arg("peer")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the benchmark peer")?;
        Ok(Peer {
            child: Some(child),
            what: args.join(" "),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Fails if the peer has already exited (it could not connect, or detected a mismatch).
    pub fn check_running(&mut self) -> CliResult<()> {
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        match c.try_wait()? {
            Some(st) => Err(fail(format!(
                "benchmark peer `{}` exited early ({st})",
                self.what
            ))),
            None => Ok(()),
        }
    }

    /// Waits (bounded) for the peer to exit and fails unless it exited cleanly.
    pub fn finish(mut self) -> CliResult<()> {
        let mut c = self.child.take().expect("finished once");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(st) = c.try_wait()? {
                return st
                    .success()
                    .then_some(())
                    .ok_or_else(|| fail(format!("peer `{}` failed: {st}", self.what)));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = c.kill();
        let _ = c.wait();
        Err(fail(format!("peer `{}` did not exit", self.what)))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Polls `f` until it yields a value, the peer dies, or 10 s pass.
pub fn wait_for<T>(
    peer: &mut Peer,
    what: &str,
    mut f: impl FnMut() -> CliResult<Option<T>>,
) -> CliResult<T> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        peer.check_running()?;
        if Instant::now() >= deadline {
            return Err(fail(format!("timed out waiting for {what}")));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What a bounded command did.
pub struct Ran {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `argv` to its end, killed (and an error) after `timeout`.
pub fn run_bounded(argv: &[String], timeout: Duration) -> CliResult<Ran> {
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context(format!("starting {}", argv.join(" ")))?;
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("piped stdout")));
    let err = reader(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "`{}` did not finish within {:.0} s",
                argv.join(" "),
                timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Ran {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_cpu_time() {
        // Spin until the clock-tick count moves (on a loaded machine 30 ms of wall time may
        // be less than one tick of ours); the bound only stops a broken reader.
        let t0 = cpu_time(std::process::id()).unwrap();
        let start = Instant::now();
        while cpu_time(std::process::id()).unwrap() <= t0
            && start.elapsed() < Duration::from_secs(10)
        {
            for _ in 0..100_000 {
                std::hint::spin_loop();
            }
        }
        assert!(cpu_time(std::process::id()).unwrap() > t0);
    }
}
