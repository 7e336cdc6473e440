//! The processes and namespaces of a `memloop bench tcp` run, and their clean-up in all cases:
//! peers are stopped on drop (and exit by themselves when we vanish, since we hold their stdin),
//! the testbed removes its domains and regions on drop, and a janitor process in its own process
//! group does the same if we die without dropping anything (Ctrl-C, SIGKILL).

use super::wire::{Reply, Request};
use crate::error::{fail, CliResult, Context};
use memloop::{CreateRegion, Region, RegionSpec};
use serde_json::Value;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How many of a peer's last stderr lines we keep to explain a failure.
const DIAG_LINES: usize = 8;

/// One end of a path: `memloop-bench domains exec … tcp-peer …`, talking JSON lines.
pub struct Proc {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    diag: Arc<Mutex<VecDeque<String>>>,
    /// The peer's own pid (the child is the `memloop domains exec` wrapper).
    pid: Option<u32>,
    /// Stderr lines kept apart (see [`Self::spawn_with`]), oldest first.
    kept: Arc<Mutex<Vec<String>>>,
    /// A log file the peer appends to (its `MEMLOOP_LOG_FILE`), with the bytes read so far.
    log_file: Option<(PathBuf, Mutex<u64>)>,
}

impl Proc {
    pub fn spawn(what: String, argv: &[String]) -> CliResult<Proc> {
        Self::spawn_with(what, argv, &[], None)
    }

    /// As [`Self::spawn`], with `env` added to the environment; stderr lines containing `keep`
    /// are kept apart from the diagnostics, for [`Self::take_kept`].
    pub fn spawn_with(
        what: String,
        argv: &[String],
        env: &[(&str, &str)],
        keep: Option<&'static str>,
    ) -> CliResult<Proc> {
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context(format!("starting {what}"))?;
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(l) = line else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let diag = Arc::new(Mutex::new(VecDeque::new()));
        let kept = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().expect("piped stderr");
        let (d, k) = (diag.clone(), kept.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(l) = line else { break };
                match keep {
                    Some(pat) if l.contains(pat) => {
                        k.lock().unwrap_or_else(|e| e.into_inner()).push(l)
                    }
                    _ => push_diag(&d, l),
                }
            }
        });
        Ok(Proc {
            what,
            stdin: child.stdin.take(),
            child,
            lines,
            diag,
            pid: None,
            kept,
            log_file: None,
        })
    }

    /// The peer logs to `path` (its `MEMLOOP_LOG_FILE`): [`Self::take_kept`] reads it too.
    pub fn with_log_file(mut self, path: PathBuf) -> Proc {
        self.log_file = Some((path, Mutex::new(0)));
        self
    }

    /// The stderr lines kept apart since the last call, and the log file's new whole lines.
    pub fn take_kept(&self) -> Vec<String> {
        let mut lines = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some((path, read)) = &self.log_file {
            let mut read = read.lock().unwrap_or_else(|e| e.into_inner());
            let text = std::fs::read(path).unwrap_or_default();
            let new = text.get(*read as usize..).unwrap_or_default();
            // Only whole lines: the peer may be writing the next one.
            let whole = new.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            lines.extend(
                String::from_utf8_lossy(&new[..whole])
                    .lines()
                    .map(String::from),
            );
            *read += whole as u64;
        }
        lines
    }

    pub fn what(&self) -> &str {
        &self.what
    }

    /// The peer's own pid, once it said it is ready.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Waits for the peer's `ready` line.
    pub fn ready(&mut self) -> CliResult<Value> {
        let v = self.next_json(Duration::from_secs(15))?;
        if v["ready"] != true {
            return Err(fail(format!("{}: unexpected first line {v}", self.what)));
        }
        self.pid = v["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
        Ok(v)
    }

    /// Sends a request to a client peer and waits (bounded) for its reply.
    pub fn ask(&mut self, req: &Request, timeout: Duration) -> CliResult<Reply> {
        let v = self.ask_json(req, timeout)?;
        let r: Reply = serde_json::from_value(v).context(format!("{}: bad reply", self.what))?;
        match &r.error {
            Some(e) => Err(fail(format!("{}: {e}{}", self.what, self.diag()))),
            None => Ok(r),
        }
    }

    /// Sends any request as a JSON line and waits (bounded) for the next JSON object; a reply
    /// with an `error` field is an error.
    pub fn ask_json(&mut self, req: &impl serde::Serialize, timeout: Duration) -> CliResult<Value> {
        let line = serde_json::to_string(req)? + "\n";
        let stdin = self.stdin.as_mut().ok_or_else(|| fail("peer stopped"))?;
        if let Err(e) = stdin
            .write_all(line.as_bytes())
            .and_then(|()| stdin.flush())
        {
            return Err(fail(format!("{}: {e}{}", self.what, self.diag())));
        }
        let v = self.next_json(timeout)?;
        match v["error"].as_str() {
            Some(e) => Err(fail(format!("{}: {e}{}", self.what, self.diag()))),
            None => Ok(v),
        }
    }

    /// The next JSON object the peer prints; other output is kept for diagnostics.
    fn next_json(&mut self, timeout: Duration) -> CliResult<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => match serde_json::from_str::<Value>(&l) {
                    Ok(v) if v.is_object() => return Ok(v),
                    _ => push_diag(&self.diag, format!("stdout: {l}")),
                },
                Err(RecvTimeoutError::Timeout) => {
                    return Err(fail(format!(
                        "{}: no answer within {:.0} s{}",
                        self.what,
                        timeout.as_secs_f64(),
                        self.diag()
                    )))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Let the stderr reader catch up and the wrapper finish.
                    let status = self.wait_exit(Duration::from_millis(500));
                    let how =
                        status.map_or("closed its output".into(), |s| format!("exited ({s})"));
                    return Err(fail(format!("{} {how}{}", self.what, self.diag())));
                }
            }
        }
    }

    fn wait_exit(&mut self, d: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + d;
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) => return Some(s),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => return None,
            }
        }
    }

    /// The peer's last stderr lines, for an error message.
    fn diag(&self) -> String {
        let d = self.diag.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_empty() {
            return String::new();
        }
        let lines: Vec<&str> = d.iter().map(String::as_str).collect();
        format!(" [its stderr: {}]", lines.join(" | "))
    }
}

fn push_diag(d: &Mutex<VecDeque<String>>, line: String) {
    let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
    if d.len() == DIAG_LINES {
        d.pop_front();
    }
    d.push_back(line);
}

impl Drop for Proc {
    /// Closing stdin makes the peer exit; a peer that does not is killed by its pid.
    fn drop(&mut self) {
        drop(self.stdin.take());
        if self.wait_exit(Duration::from_secs(3)).is_none() {
            if let Some(pid) = self
                .pid
                .and_then(|p| rustix::process::Pid::from_raw(p as i32))
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // (Once it exited: a line it wrote later would make the file again.)
        if let Some((path, _)) = &self.log_file {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Two domains under a prefix of our own, the bench regions, and the janitor.
pub struct Testbed {
    exe: PathBuf,
    prefix: String,
    net: [u8; 3],
    regions: Vec<String>,
    janitor: Option<(Child, ChildStdin)>,
    taskset: bool,
}

impl Testbed {
    /// Creates the domains; `regions` are the region names this run may create.
    pub fn up(regions: &[String]) -> CliResult<Testbed> {
        Self::up_named(&format!("mlb{}", std::process::id()), regions)
    }

    /// As [`Self::up`], the domains under `prefix` (a run beside another testbed of ours, as
    /// `bench link` within the study, needs a prefix of its own; the subnet is always free).
    pub fn up_named(prefix: &str, regions: &[String]) -> CliResult<Testbed> {
        if !rustix::process::geteuid().is_root() {
            return Err(fail(
                "`memloop bench tcp` needs root: it creates network namespaces (domains)",
            ));
        }
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let pid = std::process::id();
        let net = free_subnet(pid)?;
        let prefix = prefix.to_owned();
        // From here on, dropping `bed` (on any error) removes whatever was created.
        let bed = Testbed {
            janitor: Some(spawn_janitor(&exe, &prefix, regions)?),
            exe,
            prefix,
            net,
            regions: Vec::new(),
            taskset: Command::new("taskset")
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success()),
        };
        let subnet = format!("{}.{}.{}.0/24", net[0], net[1], net[2]);
        let out = Command::new(&bed.exe)
            .args(["domains", "up", "2", "--prefix", &bed.prefix])
            .args(["--subnet", &subnet])
            .output()
            .context("running `memloop domains up`")?;
        if !out.status.success() {
            return Err(fail(format!(
                "`memloop domains up 2 --prefix {} --subnet {subnet}` failed: {}",
                bed.prefix,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(bed)
    }

    pub fn exe(&self) -> &std::path::Path {
        &self.exe
    }

    /// Domain `i`'s address on the bridge.
    pub fn addr(&self, i: u8) -> Ipv4Addr {
        let [a, b, c] = self.net;
        Ipv4Addr::new(a, b, c, i + 1)
    }

    /// Domain `i`'s IPv6 address (as `memloop domains up` gives it).
    pub fn addr6(&self, i: u8) -> std::net::Ipv6Addr {
        let [a, b, c] = self.net;
        memloop_cli::domains::ipv6_of(Ipv4Addr::new(a, b, c, 0), u32::from(i) + 1)
    }

    /// Creates a region for this run (removed on drop).
    pub fn create_region(&mut self, name: &str) -> CliResult<()> {
        self.create_region_with(name, &CreateRegion::default())
    }

    /// Creates a region for this run with the given parameters (removed on drop).
    pub fn create_region_with(&mut self, name: &str, opts: &CreateRegion) -> CliResult<()> {
        let spec = RegionSpec::parse(name);
        Region::open_or_create(&spec, opts)
            .context(format!("creating region {}", spec.path().display()))?;
        self.regions.push(name.to_owned());
        Ok(())
    }

    pub fn pinning(&self) -> &'static str {
        if self.taskset {
            "taskset"
        } else {
            "sched_setaffinity in the peer"
        }
    }

    /// The command line of a peer in domain `domain`, pinned to `cpu`, under
    /// `memloop run --region R` if `region` is given.
    pub fn peer_command(
        &self,
        domain: u8,
        cpu: Option<usize>,
        region: Option<&str>,
        peer_args: &[String],
    ) -> Vec<String> {
        self.command_of("tcp-peer", domain, cpu, region, peer_args)
    }

    /// As [`Self::peer_command`], for the hidden command `sub` of this binary.
    pub fn command_of(
        &self,
        sub: &str,
        domain: u8,
        cpu: Option<usize>,
        region: Option<&str>,
        peer_args: &[String],
    ) -> Vec<String> {
        let exe = self.exe.to_string_lossy().into_owned();
        let mut v: Vec<String> = vec![exe.clone(), "domains".into(), "exec".into()];
        v.extend([domain.to_string(), "--prefix".into(), self.prefix.clone()]);
        v.push("--".into());
        if let (Some(c), true) = (cpu, self.taskset) {
            v.extend(["taskset".into(), "-c".into(), c.to_string()]);
        }
        if let Some(r) = region {
            v.extend([
                exe.clone(),
                "run".into(),
                "--strict".into(),
                "--region".into(),
                r.into(),
                "--".into(),
            ]);
        }
        v.extend([exe, sub.into()]);
        v.extend_from_slice(peer_args);
        if let (Some(c), false) = (cpu, self.taskset) {
            v.extend(["--cpu".into(), c.to_string()]);
        }
        v
    }
}

/// A 10.a.b.0/24 no interface uses yet, derived from `pid` (a = 200..249; the domains tests
/// use 100..199).
fn free_subnet(pid: u32) -> CliResult<[u8; 3]> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .context("running `ip` (iproute2)")?;
    let used = String::from_utf8_lossy(&out.stdout);
    (0..500)
        .map(|k| {
            let x = pid + k;
            [10, 200 + (x % 50) as u8, ((x / 50) % 256) as u8]
        })
        .find(|[a, b, c]| !used.contains(&format!(" {a}.{b}.{c}.")))
        .ok_or_else(|| fail("no free 10.x.y.0/24 subnet for the domains"))
}

fn spawn_janitor(
    exe: &std::path::Path,
    prefix: &str,
    regions: &[String],
) -> CliResult<(Child, ChildStdin)> {
    let mut cmd = Command::new(exe);
    cmd.args(["tcp-peer", "--role", "janitor", "--prefix", prefix]);
    for r in regions {
        cmd.args(["--region", r]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Out of our process group, so a Ctrl-C meant for us does not reach it.
        .process_group(0)
        .spawn()
        .context("starting the clean-up process")?;
    let stdin = child.stdin.take().expect("piped stdin");
    Ok((child, stdin))
}

impl Drop for Testbed {
    fn drop(&mut self) {
        let out = Command::new(&self.exe)
            .args(["domains", "down", "--prefix", &self.prefix])
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "memloop: removing domains {}: {}",
                self.prefix,
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!("memloop: removing domains {}: {e}", self.prefix),
        }
        for r in &self.regions {
            if let Err(e) = Region::destroy(&RegionSpec::parse(r)) {
                eprintln!("memloop: removing region {r}: {e}");
            }
        }
        if let Some((mut child, mut stdin)) = self.janitor.take() {
            let _ = stdin.write_all(b"done\n");
            drop(stdin);
            let _ = child.wait();
        }
    }
}
