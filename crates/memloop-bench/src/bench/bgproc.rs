//! A helper process of a benchmark, started in a domain: its stdin kept (closing it stops the
//! services started with the bench's stop-on-EOF), its stderr logged, its first line awaited;
//! checked, stopped and reaped. Shared by `bench blk` and `bench link`.

use crate::error::{fail, CliResult, Context};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A process started in a domain: its stdin kept (closing it stops some), its stderr logged.
pub struct BgProcess {
    what: String,
    /// How long a drop waits for the process to end (after closing its stdin) before it
    /// kills it.
    grace: Duration,
    child: Child,
    stdin: Option<ChildStdin>,
    log: PathBuf,
}

impl BgProcess {
    /// Starts `argv` and, if `first_line`, waits (20 s) for its first line on stdout. Its
    /// stderr goes to `memloop-bench-TAG-PID-….log` in the temporary directory.
    pub fn start(
        tag: &str,
        what: &str,
        argv: &[String],
        env: &[(&str, &str)],
        first_line: bool,
    ) -> CliResult<(BgProcess, String)> {
        let log = std::env::temp_dir().join(format!(
            "memloop-bench-{tag}-{}-{}.log",
            std::process::id(),
            what.split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| !w.is_empty())
                .collect::<Vec<_>>()
                .join("-")
        ));
        let err = std::fs::File::create(&log).context(format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().context(format!("starting {what}"))?;
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("piped stdout");
        let mut svc = BgProcess {
            what: what.into(),
            grace: Duration::ZERO,
            child,
            stdin,
            log,
        };
        if !first_line {
            return Ok((svc, String::new()));
        }
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            // Keep reading (and dropping) what else it says, so it never blocks on us.
            let _ = std::io::copy(&mut r, &mut std::io::sink());
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default();
        if line.trim().is_empty() {
            svc.check()?;
            return Err(fail(format!(
                "{what} did not come up within 20 s: {}",
                svc.log_tail()
            )));
        }
        Ok((svc, line.trim().to_string()))
    }

    /// How long a drop waits for the process to end before it kills it (default: none).
    pub fn set_grace(&mut self, grace: Duration) {
        self.grace = grace;
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(4).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    pub fn check(&mut self) -> CliResult<()> {
        match self.child.try_wait()? {
            Some(st) => Err(fail(format!(
                "{} exited ({st}): {}",
                self.what,
                self.log_tail()
            ))),
            None => Ok(()),
        }
    }

    pub fn wait_exit(&mut self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        loop {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn term(&self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }

    /// Closes stdin, SIGTERM if `term`, waits up to `d`, then kills.
    pub fn stop(&mut self, term: bool, d: Duration) {
        drop(self.stdin.take());
        if term {
            self.term();
        }
        if !self.wait_exit(d) {
            eprintln!(
                "memloop bench: {} did not stop in {:.0} s: killed",
                self.what,
                d.as_secs_f64()
            );
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Until the process (in its domain) listens on TCP `port`.
    pub fn wait_listen(&mut self, port: u16) -> CliResult<()> {
        let (pid, what) = (self.child.id(), self.what.clone());
        wait_listening(pid, port, &what, || self.check())
    }
}

/// Until process `pid` (in its domain: its own `/proc/PID/net/tcp`) listens on TCP `port`,
/// at most 10 s; `alive` fails the wait if the process went meanwhile.
pub fn wait_listening(
    pid: u32,
    port: u16,
    what: &str,
    mut alive: impl FnMut() -> CliResult<()>,
) -> CliResult<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let file = format!("/proc/{pid}/net/tcp");
    let want = format!(":{port:04X}");
    loop {
        let table = std::fs::read_to_string(&file).unwrap_or_default();
        let listening = table.lines().skip(1).any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&want) && f[3] == "0A"
        });
        if listening {
            return Ok(());
        }
        alive()?;
        if Instant::now() >= deadline {
            return Err(fail(format!(
                "{what} not listening on port {port} after 10 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for BgProcess {
    /// Closes stdin (which stops the services started with the bench's stop-on-EOF), waits
    /// up to the grace for the end, then kills what still runs.
    fn drop(&mut self) {
        drop(self.stdin.take());
        if !self.wait_exit(self.grace) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
