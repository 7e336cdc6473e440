//! The pipe service as a process of its own: `memloop pipe serve` (this binary's hidden
//! `pipe-service serve`), so that its CPU time is counted apart from the programs it serves.

use crate::bench::sys;
use crate::error::{fail, CliResult, Context};
use memloop_pipe::client::Client;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Our own tenant: the statistics are read through it, and it never moves a byte.
pub const WATCHER: &str = "memloop-bench-watch";

pub struct Svc {
    child: Child,
    pub socket: PathBuf,
    log: PathBuf,
    /// A client for the statistics.
    watch: Client,
}

impl Svc {
    /// Starts a service on `socket`, or on the socket of region `region` (where programs run
    /// under `memloop run --region` look for it), and waits until it takes clients.
    pub fn start(
        socket: Option<&Path>,
        region: Option<&str>,
        workers: Option<usize>,
    ) -> CliResult<Svc> {
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let (arg, path) = match (socket, region) {
            (Some(s), _) => (
                ["--socket".to_string(), s.display().to_string()],
                s.to_path_buf(),
            ),
            (None, Some(r)) => (
                ["--region".to_string(), r.to_string()],
                memloop_cli::pipe_cmd::socket_of(Some(r)),
            ),
            (None, None) => return Err(fail("a pipe service needs a socket or a region")),
        };
        let log = std::env::temp_dir().join(format!(
            "memloop-bench-pipe-svc-{}-{}.log",
            std::process::id(),
            unique()
        ));
        let mut cmd = Command::new(exe);
        cmd.args(["pipe-service", "serve"]).args(&arg);
        if let Some(w) = workers {
            cmd.args(["--workers", &w.to_string()]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).context("creating the service's log")?)
            .spawn()
            .context("starting the pipe service")?;
        let mut child = Some(child);
        let t = Instant::now();
        let watch = loop {
            match Client::connect(&path, Some(WATCHER), 1) {
                Ok(c) => break c,
                Err(e) => {
                    let c = child.as_mut().expect("running");
                    let exited = c.try_wait().ok().flatten();
                    if exited.is_some() || t.elapsed() > Duration::from_secs(10) {
                        let mut c = child.take().expect("running");
                        let _ = c.kill();
                        let _ = c.wait();
                        let tail = std::fs::read_to_string(&log).unwrap_or_default();
                        let _ = std::fs::remove_file(&log);
                        return Err(fail(format!(
                            "the pipe service at {} did not come up ({e}): {}",
                            path.display(),
                            tail.trim()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        Ok(Svc {
            child: child.take().expect("running"),
            socket: path,
            log,
            watch,
        })
    }

    /// CPU time the service has used so far (all its threads).
    pub fn cpu(&self) -> CliResult<Duration> {
        sys::cpu_time(self.child.id())
    }

    /// The service's statistics (`memloop pipe status --json`).
    pub fn stats(&mut self) -> CliResult<serde_json::Value> {
        let s = self
            .watch
            .stats()
            .context("the pipe service's statistics")?;
        Ok(serde_json::from_str(&s)?)
    }

    /// A client of the service as `tenant`, asking for `weight`.
    pub fn client(&self, tenant: &str, weight: u16) -> CliResult<Client> {
        Client::connect(&self.socket, Some(tenant), weight)
            .context(format!("connecting to the pipe service as {tenant}"))
    }

    /// Fails if the service has exited.
    pub fn check(&mut self) -> CliResult<()> {
        match self.child.try_wait()? {
            Some(st) => Err(fail(format!(
                "the pipe service exited ({st}): {}",
                std::fs::read_to_string(&self.log)
                    .unwrap_or_default()
                    .trim()
            ))),
            None => Ok(()),
        }
    }
}

/// Bytes moved per tenant, from statistics: (name, weight, bytes, cpu ns).
pub fn tenants(stats: &serde_json::Value) -> Vec<(String, u32, u64, u64)> {
    stats["tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            (
                t["name"].as_str().unwrap_or_default().to_string(),
                t["weight"].as_u64().unwrap_or(0) as u32,
                t["bytes"].as_u64().unwrap_or(0),
                t["cpu_ns"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

impl Drop for Svc {
    fn drop(&mut self) {
        // SIGTERM: `serve` stops its threads and removes its socket.
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                let _ = std::fs::remove_file(&self.log);
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.log);
    }
}

pub fn unique() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}
