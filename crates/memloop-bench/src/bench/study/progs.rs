//! Experiment 8: real programs (redis-benchmark against redis-server, pgbench against
//! PostgreSQL, ab against nginx) on three paths: memloop across the two domains (both ends under
//! `memloop run`), veth+bridge across the two domains, and both ends in one domain over loopback
//! (the "monolithic" reference). The programs are the Debian ones, unmodified and unpinned.

use super::lab::Lab;
use super::Rec;
use crate::bench::tcp::ring_bytes_while;
use crate::error::{fail, CliResult};
use indicatif::ProgressBar;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The paths of experiment 8.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Path8 {
    Memloop,
    Veth,
    Mono,
}

impl Path8 {
    pub const ALL: [Path8; 3] = [Path8::Veth, Path8::Memloop, Path8::Mono];

    pub fn name(self) -> &'static str {
        match self {
            Path8::Memloop => "memloop",
            Path8::Veth => "veth+bridge",
            Path8::Mono => "monolithic",
        }
    }
}

/// The programs: (name, steps of the progress bar).
pub const PROGRAMS: usize = 3;

pub fn steps(_: &Lab) -> u64 {
    (PROGRAMS * Path8::ALL.len()) as u64
}

/// A server in the background, in its own process group (stopped on drop).
struct Bg {
    child: Child,
    log: PathBuf,
}

impl Bg {
    fn spawn(argv: &[String], log: PathBuf) -> CliResult<Bg> {
        let out =
            std::fs::File::create(&log).map_err(|e| fail(format!("{}: {e}", log.display())))?;
        let err = out.try_clone().map_err(|e| fail(e.to_string()))?;
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| fail(format!("starting {}: {e}", argv.join(" "))))?;
        Ok(Bg { child, log })
    }

    fn tail(&self) -> String {
        tail(&self.log)
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        let pg = rustix::process::Pid::from_raw(self.child.id() as i32);
        if let Some(pg) = pg {
            // SIGINT: fast shutdown for postgres, redis and nginx alike.
            let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::INT);
            // Until the whole group is gone (the `domains exec` wrapper goes first).
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(5) {
                let _ = self.child.try_wait();
                if rustix::process::test_kill_process_group(pg).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            // What is left of the group (workers, backends).
            let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Runs `argv` in the foreground for at most `secs`; its stdout and stderr.
fn run_fg(argv: &[String], secs: u64, log: &Path) -> CliResult<String> {
    let mut bg = Bg::spawn(argv, log.to_path_buf())?;
    let t = Instant::now();
    let status = loop {
        if let Some(s) = bg
            .child
            .try_wait()
            .map_err(|e| fail(format!("waiting for {}: {e}", argv[0])))?
        {
            break s;
        }
        if t.elapsed() > Duration::from_secs(secs) {
            return Err(fail(format!(
                "{} timed out after {secs} s: {}",
                argv.join(" "),
                bg.tail()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(log).unwrap_or_default();
    if !status.success() {
        return Err(fail(format!(
            "{} exited with {status}: {}",
            argv.join(" "),
            bg.tail()
        )));
    }
    Ok(text)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The prefix running a command as the postgres user (the server refuses root).
pub(crate) const AS_POSTGRES: [&str; 5] = [
    "setpriv",
    "--reuid=postgres",
    "--regid=postgres",
    "--init-groups",
    "--",
];

/// The newest PostgreSQL server's bin directory under /usr/lib/postgresql.
pub(crate) fn pg_bin() -> Option<PathBuf> {
    let mut v: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((n, bin))
        })
        .collect();
    v.sort();
    v.pop().map(|x| x.1)
}

/// What is missing for each program (None: it can run).
fn missing() -> [(&'static str, Option<String>); PROGRAMS] {
    let need = |cmds: &[&str]| {
        let m: Vec<&str> = cmds.iter().copied().filter(|c| !have(c)).collect();
        (!m.is_empty()).then(|| format!("{} not installed", m.join(", ")))
    };
    let pg = need(&["pgbench", "setpriv", "ss"])
        .or_else(|| {
            pg_bin()
                .is_none()
                .then(|| "no server under /usr/lib/postgresql".into())
        })
        .or_else(|| {
            (!Command::new("id")
                .arg("postgres")
                .output()
                .is_ok_and(|o| o.status.success()))
            .then(|| "no user postgres".into())
        });
    [
        ("redis", need(&["redis-server", "redis-benchmark", "ss"])),
        ("pgbench", pg),
        ("nginx", need(&["nginx", "ab", "ss"])),
    ]
}

/// The run's state: the lab, a scratch directory and the records.
struct Ctx<'a> {
    l: &'a mut Lab,
    dir: PathBuf,
    bar: &'a ProgressBar,
}

impl Ctx<'_> {
    fn server_addr(&self, p: Path8) -> String {
        match p {
            Path8::Mono => "127.0.0.1".into(),
            _ => self.l.addr(0).to_string(),
        }
    }

    fn region(&self, p: Path8) -> Option<String> {
        (p == Path8::Memloop).then(|| self.l.prog.clone())
    }

    fn server(&self, p: Path8, name: &str, cmd: &[String]) -> CliResult<Bg> {
        let argv = self.l.in_domain(0, self.region(p).as_deref(), cmd);
        Bg::spawn(&argv, self.dir.join(format!("{name}-{}.log", p.name())))
    }

    /// Until something listens on `port` in domain 0.
    fn wait_listen(&self, bg: &mut Bg, port: u16, secs: u64) -> CliResult<()> {
        let argv = self
            .l
            .in_domain(0, None, &s(&["ss", "-Hltn", &format!("sport = :{port}")]));
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(secs) {
            let out = Command::new(&argv[0]).args(&argv[1..]).output();
            if out.is_ok_and(|o| !o.stdout.is_empty()) {
                return Ok(());
            }
            if let Ok(Some(st)) = bg.child.try_wait() {
                return Err(fail(format!(
                    "server exited ({st}) before listening on port {port}: {}",
                    bg.tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(fail(format!(
            "server not listening on port {port} after {secs} s: {}",
            bg.tail()
        )))
    }

    /// Runs a client on path `p` (domain 1, or domain 0 for the monolithic path); on the
    /// memloop path, also the bytes the region's rings carried meanwhile.
    fn client(&self, p: Path8, name: &str, cmd: &[String], secs: u64) -> CliResult<(String, u64)> {
        let domain = if p == Path8::Mono { 0 } else { 1 };
        let region = self.region(p);
        let argv = self.l.in_domain(domain, region.as_deref(), cmd);
        let log = self.dir.join(format!("{name}-{}.out", p.name()));
        let Some(region) = region else {
            return Ok((run_fg(&argv, secs, &log)?, 0));
        };
        let stop = Arc::new(AtomicBool::new(false));
        let watch = {
            let stop = stop.clone();
            std::thread::spawn(move || ring_bytes_while(&region, &stop))
        };
        let out = run_fg(&argv, secs, &log);
        stop.store(true, Ordering::Relaxed);
        let bytes = watch.join().unwrap_or(0);
        Ok((out?, bytes))
    }

    fn paths(&self) -> Vec<Path8> {
        Path8::ALL
            .into_iter()
            .filter(|p| *p != Path8::Memloop || self.l.preload.is_ok())
            .collect()
    }
}

/// Records a path's rate, with a note when the memloop path's bytes did not go through a ring.
fn record(out: &mut Vec<Rec>, test: &str, p: Path8, size: u64, unit: &str, v: f64, ring: u64) {
    let mut r = Rec::new(8, test, p.name(), size, unit, v);
    if p == Path8::Memloop {
        r.note = Some(if ring > 0 {
            format!("{} through the rings", crate::units::fmt_size(ring))
        } else {
            "no bytes went through a ring: the connections stayed on TCP".into()
        });
    }
    out.push(r);
}

/// The memloop/veth+bridge and memloop/monolithic ratios of each test.
fn ratios(out: &mut Vec<Rec>) {
    let mut add = Vec::new();
    let tests: Vec<String> = out
        .iter()
        .filter(|r| r.experiment == 8 && r.path == "memloop")
        .map(|r| r.test.clone())
        .collect();
    for t in tests {
        let get = |p: &str| {
            out.iter()
                .find(|r| r.experiment == 8 && r.test == t && r.path == p)
                .map(|r| (r.value, r.size))
        };
        let Some((m, size)) = get("memloop") else {
            continue;
        };
        for (base, label) in [
            ("veth+bridge", "memloop/veth+bridge"),
            ("monolithic", "memloop/monolithic"),
        ] {
            if let Some((b, _)) = get(base) {
                add.push(Rec::new(8, &t, label, size, "ratio", m / b));
            }
        }
    }
    out.extend(add);
}

pub fn exp8(l: &mut Lab, bar: &ProgressBar, out: &mut Vec<Rec>) -> CliResult<()> {
    let miss = missing();
    if miss.iter().all(|m| m.1.is_some()) {
        let why: Vec<String> = miss
            .iter()
            .map(|(n, w)| format!("{n}: {}", w.as_deref().unwrap_or("")))
            .collect();
        bar.inc(steps(l));
        return Err(fail(format!("unavailable: {}", why.join("; "))));
    }
    let dir = std::env::temp_dir().join(format!("memloop-study-{}-progs", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    // The postgres user reaches its directory through this one.
    let _ = Command::new("chmod").arg("755").arg(&dir).status();
    let mut c = Ctx { l, dir, bar };
    let mut errors = Vec::new();
    type Prog = fn(&mut Ctx, &mut Vec<Rec>) -> CliResult<()>;
    let progs: [Prog; PROGRAMS] = [redis, pgbench, nginx];
    for ((name, why), f) in miss.into_iter().zip(progs) {
        if let Some(why) = why {
            c.l.notes
                .push(("programs", format!("experiment 8: {name} skipped: {why}")));
            c.bar.inc(Path8::ALL.len() as u64);
            continue;
        }
        c.bar.set_message(format!("8. {name}"));
        if let Err(e) = f(&mut c, out) {
            errors.push(format!("{name}: {e}"));
        }
    }
    if c.l.preload.is_err() {
        c.l.notes.push((
            "programs",
            "experiment 8: memloop path skipped (no preload library)".into(),
        ));
    }
    let dir = c.dir.clone();
    drop(c);
    // Files of the postgres user included (we are root).
    let _ = std::fs::remove_dir_all(&dir);
    ratios(out);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(fail(errors.join("; ")))
    }
}

// ---------------------------------------------------------------------------------------------

const REDIS_PORT: u16 = 6379;

fn redis(c: &mut Ctx, out: &mut Vec<Rec>) -> CliResult<()> {
    let n = if c.l.quick { 20_000 } else { 200_000 };
    for p in c.paths() {
        let addr = c.server_addr(p);
        let port = REDIS_PORT.to_string();
        let dir = c.dir.to_string_lossy().into_owned();
        let cmd = s(&[
            "redis-server",
            "--bind",
            &addr,
            "--port",
            &port,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            &dir,
            "--logfile",
            "",
        ]);
        let mut srv = c.server(p, "redis", &cmd)?;
        c.wait_listen(&mut srv, REDIS_PORT, 20)?;
        let cmd = s(&[
            "redis-benchmark",
            "-h",
            &addr,
            "-p",
            &port,
            "-q",
            "-t",
            "set,get",
            "-c",
            "8",
            "-n",
            &n.to_string(),
            "--csv",
        ]);
        let (text, ring) = c.client(p, "redis-benchmark", &cmd, 120)?;
        let rates = parse_redis_csv(&text);
        for t in ["SET", "GET"] {
            let Some(v) = rates.iter().find(|r| r.0 == t).map(|r| r.1) else {
                return Err(fail(format!(
                    "redis-benchmark over {}: no {t} rate in {text:?}",
                    p.name()
                )));
            };
            record(out, &format!("redis {t}"), p, 3, "requests/s", v, ring);
        }
        drop(srv);
        c.bar.inc(1);
    }
    Ok(())
}

/// `"SET","41666.67",...` lines of `redis-benchmark --csv` (a header line first in newer ones).
fn parse_redis_csv(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(|x| x.trim().trim_matches('"'));
            let name = f.next()?.to_owned();
            let v = f.next()?.parse::<f64>().ok()?;
            (v > 0.0).then_some((name, v))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

const PG_PORT: u16 = 5432;

fn pgbench(c: &mut Ctx, out: &mut Vec<Rec>) -> CliResult<()> {
    let bin = pg_bin().ok_or_else(|| fail("no PostgreSQL server"))?;
    let bin_s = |x: &str| bin.join(x).to_string_lossy().into_owned();
    let pg = c.dir.join("pg");
    let (data, sock) = (pg.join("data"), pg.join("sock"));
    for d in [&pg, &sock] {
        let st = Command::new("install")
            .args(["-d", "-o", "postgres", "-g", "postgres", "-m", "700"])
            .arg(d)
            .status();
        if !st.is_ok_and(|s| s.success()) {
            return Err(fail(format!("creating {}", d.display())));
        }
    }
    let as_pg = |v: &[&str]| {
        let mut a = s(&AS_POSTGRES);
        a.extend(s(v));
        a
    };
    let data_s = data.to_string_lossy().into_owned();
    run_fg(
        &as_pg(&[
            &bin_s("initdb"),
            "-D",
            &data_s,
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]),
        120,
        &c.dir.join("initdb.log"),
    )?;
    let hba = data.join("pg_hba.conf");
    let mut conf = std::fs::read_to_string(&hba).unwrap_or_default();
    conf.push_str(&format!("host all all {}/24 trust\n", c.l.addr(0)));
    std::fs::write(&hba, conf).map_err(|e| fail(format!("{}: {e}", hba.display())))?;
    let secs = if c.l.quick { 2 } else { 10 };
    let port = PG_PORT.to_string();
    let mut initialised = false;
    for p in c.paths() {
        let addr = c.server_addr(p);
        let cmd = as_pg(&[
            &bin_s("postgres"),
            "-D",
            &data_s,
            "-p",
            &port,
            "-c",
            &format!("listen_addresses={addr}"),
            "-c",
            &format!("unix_socket_directories={}", sock.display()),
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=40",
            "-c",
            "shared_buffers=64MB",
            "-c",
            "logging_collector=off",
        ]);
        let mut srv = c.server(p, "postgres", &cmd)?;
        c.wait_listen(&mut srv, PG_PORT, 30)?;
        // Accepting connections (probed over the Unix socket: no TCP connection of our own).
        let ready = s(&[
            &bin_s("pg_isready"),
            "-q",
            "-h",
            &sock.to_string_lossy(),
            "-p",
            &port,
            "-U",
            "postgres",
        ]);
        let ready_argv = c.l.in_domain(0, None, &ready);
        let t = Instant::now();
        while !Command::new(&ready_argv[0])
            .args(&ready_argv[1..])
            .status()
            .is_ok_and(|s| s.success())
        {
            if t.elapsed() > Duration::from_secs(20) {
                return Err(fail(format!("postgres not ready: {}", srv.tail())));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let conn = ["-h", &addr, "-p", &port, "-U", "postgres"];
        if !initialised {
            let mut cmd = s(&["pgbench", "-i", "-s", "1", "-q"]);
            cmd.extend(s(&conn));
            cmd.push("postgres".into());
            c.client(p, "pgbench-init", &cmd, 120)?;
            initialised = true;
        }
        let mut cmd = s(&["pgbench", "-c", "4", "-j", "2", "-T", &secs.to_string()]);
        cmd.extend(s(&conn));
        cmd.push("postgres".into());
        let (text, ring) = c.client(p, "pgbench", &cmd, secs + 60)?;
        let tps = parse_pgbench(&text).ok_or_else(|| {
            fail(format!(
                "pgbench over {}: no tps in {:?}",
                p.name(),
                text.lines().rev().take(3).collect::<Vec<_>>()
            ))
        })?;
        record(out, "pgbench", p, 1, "transactions/s", tps, ring);
        // A fast shutdown, waited for: the next path's postmaster needs the data directory.
        let stop = as_pg(&[&bin_s("pg_ctl"), "-D", &data_s, "-m", "fast", "-w", "stop"]);
        let _ = run_fg(&stop, 30, &c.dir.join("pg_ctl.log"));
        drop(srv);
        c.bar.inc(1);
    }
    Ok(())
}

/// `tps = 1234.5 (without initial connection time)`.
pub(crate) fn parse_pgbench(text: &str) -> Option<f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("tps = "))
        .find(|l| l.contains("without initial connection time") || !l.contains("including"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
}

// ---------------------------------------------------------------------------------------------

const NGINX_PORT: u16 = 8080;
const PAGE: usize = 1024;

fn nginx(c: &mut Ctx, out: &mut Vec<Rec>) -> CliResult<()> {
    let n = if c.l.quick { 5000 } else { 100_000 };
    let d = c.dir.join("nginx");
    let www = d.join("www");
    std::fs::create_dir_all(d.join("tmp")).map_err(|e| fail(e.to_string()))?;
    std::fs::create_dir_all(&www).map_err(|e| fail(e.to_string()))?;
    std::fs::write(www.join("page"), vec![b'x'; PAGE]).map_err(|e| fail(e.to_string()))?;
    for p in c.paths() {
        let addr = c.server_addr(p);
        let conf = d.join(format!("nginx-{}.conf", p.name()));
        let ds = d.display();
        let text = format!(
            "daemon off;\nmaster_process on;\nworker_processes 2;\nuser root;\npid {ds}/nginx.pid;\n\
             error_log {ds}/error.log info;\nevents {{ worker_connections 256; }}\nhttp {{\n\
             access_log off;\nclient_body_temp_path {ds}/tmp/body;\nproxy_temp_path {ds}/tmp/proxy;\n\
             fastcgi_temp_path {ds}/tmp/fastcgi;\nuwsgi_temp_path {ds}/tmp/uwsgi;\n\
             scgi_temp_path {ds}/tmp/scgi;\ndefault_type application/octet-stream;\n\
             keepalive_requests 1000000;\nserver {{ listen {addr}:{NGINX_PORT}; root {}; }}\n}}\n",
            www.display()
        );
        std::fs::write(&conf, text).map_err(|e| fail(e.to_string()))?;
        let cmd = s(&[
            "nginx",
            "-c",
            &conf.to_string_lossy(),
            "-p",
            &d.to_string_lossy(),
            "-e",
            &d.join("error.log").to_string_lossy(),
        ]);
        let mut srv = c.server(p, "nginx", &cmd)?;
        c.wait_listen(&mut srv, NGINX_PORT, 20)?;
        let url = format!("http://{addr}:{NGINX_PORT}/page");
        let cmd = s(&["ab", "-q", "-k", "-c", "8", "-n", &n.to_string(), &url]);
        let (text, ring) = c.client(p, "ab", &cmd, 120)?;
        let (rate, failed) = parse_ab(&text);
        let rate =
            rate.ok_or_else(|| fail(format!("ab over {}: no rate in {text:?}", p.name())))?;
        if failed != Some(0) {
            return Err(fail(format!(
                "ab over {}: {failed:?} failed requests",
                p.name()
            )));
        }
        record(out, "nginx ab", p, PAGE as u64, "requests/s", rate, ring);
        drop(srv);
        c.bar.inc(1);
    }
    Ok(())
}

/// `Requests per second:    12345.67 [#/sec] (mean)` and `Failed requests:        0`.
fn parse_ab(text: &str) -> (Option<f64>, Option<u64>) {
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|l| l.split_whitespace().next().map(str::to_owned))
    };
    (
        field("Requests per second:").and_then(|v| v.parse().ok()),
        field("Failed requests:").and_then(|v| v.parse().ok()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_programs_output() {
        let r = parse_redis_csv(
            "\"test\",\"rps\",\"avg_latency_ms\"\n\"SET\",\"41666.67\",\"0.1\"\n\"GET\",\"50000.00\"\n",
        );
        assert_eq!(r, vec![("SET".into(), 41666.67), ("GET".into(), 50000.0)]);
        let pg = "latency average = 1.2 ms\ntps = 812.5 (without initial connection time)\n";
        assert_eq!(parse_pgbench(pg), Some(812.5));
        let ab = "Failed requests:        0\nRequests per second:    12345.67 [#/sec] (mean)\n";
        assert_eq!(parse_ab(ab), (Some(12345.67), Some(0)));
    }
}
