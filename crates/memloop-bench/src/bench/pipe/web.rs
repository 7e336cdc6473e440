//! Figure 3: a static-file server. lighttpd or nginx, sendfile on, serves files of 1, 16 and
//! 64 MiB from RAM (/dev/shm) to a keep-alive HTTP/1.1 client in this process over loopback
//! TCP (one thread per connection, every body read; the first fetch of each file on a fresh
//! server checked byte by byte). Two paths:
//!
//! - `sendfile`: the server as it is (its own sendfile);
//! - `pipe-service`: the same server under `memloop run` with `MEMLOOP_PIPE_SENDFILE=1`, and a
//!   pipe service (`memloop pipe serve`) on the region's socket.
//!
//! Throughput, and the server's CPU per byte: utime + stime of every process of its process
//! group, before and after (schedstat, ns). On the service path the service's statistics must
//! show it moved the server's bytes: the first fetches are the probe, and if the service moved
//! none of them the path reports "not routed" and measures nothing — never a figure of a path
//! that did not take place.

use super::peer::{fill, Checker, BUF};
use super::svc::{self, Svc};
use super::Opts;
use crate::bench::native::OwnedRegion;
use crate::bench::report::Record;
use crate::bench::sys;
use crate::error::{fail, CliResult, Context};
use crate::units::fmt_size;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

pub const TEST: &str = "static-file";
/// The server's own sendfile.
pub const SENDFILE: &str = "sendfile";
pub const SERVICE: &str = "pipe-service";
pub const CPU_SERVER: &str = "server cpu ns/B";
pub const CPU_SERVICE: &str = "service cpu ns/B";
pub const CPU_TOTAL: &str = "server+service cpu ns/B";
/// Bytes the service moved for the server over the body bytes served.
pub const ROUTED: &str = "routed fraction";
/// The marker of a service path whose sendfile never reached the service (value 0).
pub const NOT_ROUTED: &str = "not routed";
/// The environment variable that asks the preload to route sendfile to the service.
pub const ROUTE_ENV: &str = "MEMLOOP_PIPE_SENDFILE";
const SIZES: [u64; 3] = [1 << 20, 16 << 20, 64 << 20];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Sendfile,
    Service,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Sendfile => SENDFILE,
            Path::Service => SERVICE,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Server {
    Lighttpd,
    Nginx,
}

/// The files, the server chosen, the region of the service path.
pub struct Setup {
    server: Server,
    version: String,
    dir: PathBuf,
    www: PathBuf,
    o: Opts,
    exe: PathBuf,
    /// Why the service path cannot run, if it cannot (no preload library).
    preload: Result<(), String>,
    // Last: the region goes once the servers are gone.
    region: Option<OwnedRegion>,
}

/// One path's run.
pub struct Measured {
    pub records: Vec<Record>,
    /// For the reader: why the path did not run or was not routed.
    pub note: Option<String>,
    /// Set when the service path was not routed: whether the preload claims to route.
    pub not_routed: Option<bool>,
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

impl Setup {
    pub fn new(o: &Opts) -> CliResult<Setup> {
        let server = match o.server.as_str() {
            "lighttpd" | "auto" if have("lighttpd") => Server::Lighttpd,
            "nginx" | "auto" if have("nginx") => Server::Nginx,
            s => {
                let what = match s {
                    "auto" => "neither lighttpd nor nginx is installed",
                    "lighttpd" => "lighttpd is not installed",
                    _ => "nginx is not installed",
                };
                return Err(fail(format!(
                    "unavailable: {what} (tests/programs/install-deps.sh installs lighttpd and \
                     nginx)"
                )));
            }
        };
        let (prog, flag) = match server {
            Server::Lighttpd => ("lighttpd", "-v"),
            Server::Nginx => ("nginx", "-v"),
        };
        let version = Command::new(prog)
            .arg(flag)
            .output()
            .map(|v| {
                let text = String::from_utf8_lossy(&v.stdout).to_string()
                    + &String::from_utf8_lossy(&v.stderr);
                let line = text.lines().next().unwrap_or(prog).trim();
                let line = line.strip_prefix("nginx version: ").unwrap_or(line);
                line.split(' ').next().unwrap_or(prog).to_string()
            })
            .unwrap_or_else(|_| prog.to_string());
        let base = match std::path::Path::new("/dev/shm").is_dir() {
            true => PathBuf::from("/dev/shm"),
            false => std::env::temp_dir(),
        };
        let dir = base.join(format!("memloop-bench-pipe-{}", std::process::id()));
        let www = dir.join("www");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tmp")).context(format!("creating {}", dir.display()))?;
        std::fs::create_dir_all(&www).context(format!("creating {}", www.display()))?;
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let mut s = Setup {
            server,
            version,
            dir,
            www,
            o: o.clone(),
            preload: crate::bench::tcp::preload_status(&exe),
            exe,
            region: None,
        };
        let mut buf = vec![0u8; BUF];
        for size in SIZES {
            let p = s.www.join(file_name(size));
            let mut f = std::fs::File::create(&p).context(format!("creating {}", p.display()))?;
            let mut off = 0;
            while off < size {
                let n = (size - off).min(BUF as u64) as usize;
                fill(&mut buf[..n], off);
                f.write_all(&buf[..n])
                    .context(format!("writing {}", p.display()))?;
                off += n as u64;
            }
        }
        if s.preload.is_ok() {
            s.region = Some(OwnedRegion::open(None)?);
        }
        Ok(s)
    }

    pub fn server_name(&self) -> &str {
        &self.version
    }

    /// What the figure ran, for the notes.
    pub fn describe(&self) -> String {
        let cfg = match self.server {
            Server::Lighttpd => "server.network-backend = \"sendfile\", one process",
            Server::Nginx => "sendfile on, tcp_nopush on, one worker",
        };
        format!(
            "static-file server: {} ({cfg}), files of {} in {}; client: {} keep-alive \
             connection(s) in this process (a thread each), every body read, the first fetch \
             of each file on each server checked byte by byte; service path: the server under \
             `memloop run` with {ROUTE_ENV}=1, the service on the region's socket",
            self.version,
            SIZES.map(fmt_size).join(", "),
            self.dir
                .parent()
                .map_or("?".into(), |d| d.display().to_string()),
            self.o.connections,
        )
    }

    pub fn measure(&self, p: Path) -> CliResult<Measured> {
        let region = match (&self.preload, &self.region) {
            (Err(e), _) if p == Path::Service => {
                return Ok(Measured {
                    records: Vec::new(),
                    note: Some(format!("static-file through the pipe service: {e}")),
                    not_routed: None,
                })
            }
            (_, r) => r.as_ref().map(|r| r.arg.clone()),
        };
        // The service where --service-cpu says (it inherits our pin), the server on one CPU,
        // the client's threads on the other.
        let svc_cpu = match (self.o.cpus, self.o.service_cpu.as_str()) {
            (Some((_, server)), "server") => Some(server),
            (Some((ends, _)), "ends") => Some(ends),
            _ => None,
        };
        let pin = super::PinGuard::to(svc_cpu)?;
        let mut svc = match (p, region.as_deref()) {
            (Path::Service, Some(r)) => Some(Svc::start(None, Some(r), self.o.workers)?),
            _ => None,
        };
        drop(pin);
        let pin = super::PinGuard::to(self.o.cpus.map(|c| c.1))?;
        let port = free_port()?;
        let conf = self.config(p, port)?;
        let mut argv: Vec<String> = Vec::new();
        if p == Path::Service {
            argv.extend([
                self.exe.display().to_string(),
                "run".into(),
                "--strict".into(),
            ]);
            argv.extend([
                "--region".into(),
                region.clone().unwrap_or_default(),
                "--".into(),
            ]);
        }
        argv.extend(self.argv(&conf));
        let log = self.dir.join(format!("server-{}.out", p.name()));
        let mut srv = ServerProc::spawn(&argv, p == Path::Service, log)?;
        drop(pin);
        srv.wait_listen(port)?;
        if p == Path::Service {
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", srv.pgid))
                .context("reading the server's mappings")?;
            if !maps.contains("/libmemloop") {
                return Err(fail(
                    "static-file through the pipe service: the preload library is not \
                     loaded in the server",
                ));
            }
        }
        // The probe (and warm-up): every file once on each connection, checked.
        let routed0 = routed(svc.as_mut())?;
        let client_cpu = self.o.cpus.map(|c| c.0);
        let _pin = super::PinGuard::to(client_cpu)?;
        let mut conns = connect(port, self.o.connections)?;
        let mut buf = vec![0u8; BUF];
        let mut probe_bytes = 0;
        for c in conns.iter_mut() {
            for size in SIZES {
                fetch(c, &mut buf, size, true).context(format!(
                    "fetching {} from {} ({})",
                    fmt_size(size),
                    self.version,
                    p.name()
                ))?;
                probe_bytes += size;
            }
        }
        if let Some(s) = svc.as_mut() {
            let moved = routed(Some(s))? - routed0;
            if moved == 0 {
                return Ok(self.not_routed(s, probe_bytes));
            }
        }
        let mut records = Vec::new();
        for size in SIZES {
            records.extend(self.one_size(p, size, &mut conns, &srv, svc.as_mut(), client_cpu)?);
        }
        if let Some(s) = svc.as_mut() {
            s.check()?;
        }
        drop(conns);
        srv.check()?;
        Ok(Measured {
            records,
            note: None,
            not_routed: None,
        })
    }

    /// The records of a service path whose sendfile never reached the service.
    fn not_routed(&self, s: &mut Svc, probe: u64) -> Measured {
        let claims = preload_claims_routing();
        let tenants: Vec<String> = s
            .stats()
            .map(|v| svc::tenants(&v))
            .unwrap_or_default()
            .into_iter()
            .map(|t| format!("{} {} B", t.0, t.2))
            .collect();
        let why = match claims {
            true => "the preload library knows MEMLOOP_PIPE_SENDFILE, yet did not route",
            false => "the preload library has no MEMLOOP_PIPE_SENDFILE routing (yet)",
        };
        let note = format!(
            "NOT ROUTED: the pipe service at {} moved 0 B of the {} the server sent ({} \
             under `memloop run` with {ROUTE_ENV}=1; service tenants: {}): {why}; no figures \
             for this path",
            s.socket.display(),
            fmt_size(probe),
            self.version,
            tenants.join(", ")
        );
        let records = SIZES
            .iter()
            .map(|&size| {
                let mut r = Record::new(TEST, SERVICE, size, NOT_ROUTED, 0.0);
                r.note = Some(note.clone());
                r
            })
            .collect();
        Measured {
            records,
            note: Some(format!("static-file through the pipe service: {note}")),
            not_routed: Some(claims),
        }
    }

    /// One file size: `o.bytes` of it fetched over the open connections.
    fn one_size(
        &self,
        p: Path,
        size: u64,
        conns: &mut Vec<TcpStream>,
        srv: &ServerProc,
        mut svc: Option<&mut Svc>,
        cpu: Option<usize>,
    ) -> CliResult<Vec<Record>> {
        let n = conns.len() as u64;
        let per_conn = self.o.bytes.div_ceil(size).div_ceil(n).max(1);
        let body = per_conn * n * size;
        let start = Arc::new(Barrier::new(conns.len() + 1));
        let threads: Vec<_> = conns
            .drain(..)
            .map(|mut c| {
                let start = start.clone();
                std::thread::spawn(move || -> CliResult<TcpStream> {
                    let _pin = super::PinGuard::to(cpu);
                    let mut buf = vec![0u8; BUF];
                    start.wait();
                    for _ in 0..per_conn {
                        fetch(&mut c, &mut buf, size, false)?;
                    }
                    Ok(c)
                })
            })
            .collect();
        let cpu0 = srv.cpu();
        let svc_cpu0 = svc.as_deref().map(Svc::cpu).transpose()?;
        let routed0 = routed(svc.as_deref_mut())?;
        let t0 = Instant::now();
        start.wait();
        let mut errors = Vec::new();
        for t in threads {
            match t.join() {
                Ok(Ok(c)) => conns.push(c),
                Ok(Err(e)) => errors.push(e.to_string()),
                Err(_) => errors.push("a client thread panicked".into()),
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        let cpu = srv.cpu() - cpu0;
        if !errors.is_empty() {
            return Err(fail(format!(
                "fetching {} from {} ({}): {}",
                fmt_size(size),
                self.version,
                p.name(),
                errors.join("; ")
            )));
        }
        let per_byte = |d: Duration| d.as_nanos() as f64 / body as f64;
        let name = p.name();
        let mut gbs = Record::new(TEST, name, size, "GB/s", body as f64 / wall / 1e9);
        gbs.note = Some(format!(
            "{}: {} requests on {n} connection(s), {} of bodies in {wall:.2} s",
            self.version,
            per_conn * n,
            fmt_size(body)
        ));
        let mut v = vec![
            gbs,
            Record::new(TEST, name, size, CPU_SERVER, per_byte(cpu)),
        ];
        if let (Some(s), Some(c0)) = (svc, svc_cpu0) {
            let s_cpu = s.cpu()? - c0;
            let moved = routed(Some(s))? - routed0;
            if moved == 0 {
                let mut r = Record::new(TEST, SERVICE, size, NOT_ROUTED, 0.0);
                r.note = Some(format!(
                    "NOT ROUTED: the service moved none of the {} served (after the probe \
                     had been routed)",
                    fmt_size(body)
                ));
                return Ok(vec![r]);
            }
            v.push(Record::new(TEST, name, size, CPU_SERVICE, per_byte(s_cpu)));
            v.push(Record::new(
                TEST,
                name,
                size,
                CPU_TOTAL,
                per_byte(cpu + s_cpu),
            ));
            v.push(Record::new(
                TEST,
                name,
                size,
                ROUTED,
                moved as f64 / body as f64,
            ));
        }
        Ok(v)
    }

    fn argv(&self, conf: &std::path::Path) -> Vec<String> {
        let c = conf.display().to_string();
        match self.server {
            Server::Lighttpd => vec!["lighttpd".into(), "-D".into(), "-f".into(), c],
            Server::Nginx => {
                let d = self.dir.display().to_string();
                let e = self.dir.join("nginx-error.log").display().to_string();
                ["nginx", "-c", &c, "-p", &d, "-e", &e]
                    .map(String::from)
                    .into()
            }
        }
    }

    /// The server's configuration for path `p`: sendfile on both paths.
    fn config(&self, p: Path, port: u16) -> CliResult<PathBuf> {
        let (www, d) = (self.www.display(), self.dir.display());
        let name = p.name();
        let (file, text) = match self.server {
            Server::Lighttpd => (
                format!("lighttpd-{name}.conf"),
                format!(
                    "server.document-root = \"{www}\"\nserver.bind = \"127.0.0.1\"\n\
                     server.port = {port}\nserver.errorlog = \"{d}/lighttpd-{name}.log\"\n\
                     server.network-backend = \"sendfile\"\n\
                     server.max-keep-alive-requests = 1000000\n\
                     server.max-keep-alive-idle = 300\n\
                     mimetype.assign = (\"\" => \"application/octet-stream\")\n"
                ),
            ),
            Server::Nginx => (
                format!("nginx-{name}.conf"),
                format!(
                    "daemon off;\nmaster_process on;\nworker_processes 1;\nuser root;\n\
                     pid {d}/nginx-{name}.pid;\nerror_log {d}/nginx-{name}.log info;\n\
                     events {{ worker_connections 256; }}\nhttp {{\naccess_log off;\n\
                     sendfile on;\ntcp_nopush on;\nclient_body_temp_path {d}/tmp/body;\n\
                     proxy_temp_path {d}/tmp/proxy;\nfastcgi_temp_path {d}/tmp/fastcgi;\n\
                     uwsgi_temp_path {d}/tmp/uwsgi;\nscgi_temp_path {d}/tmp/scgi;\n\
                     default_type application/octet-stream;\nkeepalive_requests 1000000;\n\
                     keepalive_timeout 300s;\n\
                     server {{ listen 127.0.0.1:{port}; root {www}; }}\n}}\n"
                ),
            ),
        };
        let path = self.dir.join(file);
        std::fs::write(&path, text).context(format!("writing {}", path.display()))?;
        Ok(path)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn file_name(size: u64) -> String {
    format!("f{size}")
}

/// Bytes the service moved for everyone but our watcher (0 without a service).
fn routed(svc: Option<&mut Svc>) -> CliResult<u64> {
    let Some(s) = svc else { return Ok(0) };
    let v = s.stats()?;
    Ok(svc::tenants(&v)
        .iter()
        .filter(|t| t.0 != svc::WATCHER)
        .map(|t| t.2)
        .sum())
}

/// Whether the preload library (the shim `memloop run` loads, or the engine beside it)
/// mentions MEMLOOP_PIPE_SENDFILE: then a service path that was not routed is a failure.
pub fn preload_claims_routing() -> bool {
    let Ok(lib) = memloop_cli::run::find_library() else {
        return false;
    };
    let engine = lib.with_file_name(memloop_cli::run::ENGINE_LIB);
    [lib, engine].iter().any(|p| {
        std::fs::read(p).is_ok_and(|b| {
            b.windows(ROUTE_ENV.len())
                .any(|w| w == ROUTE_ENV.as_bytes())
        })
    })
}

fn free_port() -> CliResult<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

fn connect(port: u16, n: usize) -> CliResult<Vec<TcpStream>> {
    (0..n)
        .map(|_| {
            let s = TcpStream::connect(("127.0.0.1", port)).context("connecting to the server")?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
            Ok(s)
        })
        .collect()
}

/// One GET of the file of `size` on a keep-alive connection: the whole body read, and checked
/// against the pattern if `check`.
fn fetch(s: &mut TcpStream, buf: &mut [u8], size: u64, check: bool) -> CliResult<()> {
    let req = format!(
        "GET /{} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        file_name(size)
    );
    s.write_all(req.as_bytes()).context("sending a request")?;
    let mut have = 0;
    let head_end = loop {
        let k = s.read(&mut buf[have..]).context("reading a response")?;
        if k == 0 {
            return Err(fail("the server closed the connection"));
        }
        have += k;
        if let Some(i) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if have > 16 << 10 {
            return Err(fail("no end of the response's headers in 16 KiB"));
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    if !head.starts_with("HTTP/1.1 200") {
        return Err(fail(format!(
            "the server answered {:?}",
            head.lines().next().unwrap_or("")
        )));
    }
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<u64>().ok())?
        })
        .ok_or_else(|| fail("a response without Content-Length"))?;
    if len != size {
        return Err(fail(format!("Content-Length {len}, want {size}")));
    }
    let mut checker = check.then(Checker::default);
    let mut got = (have - head_end) as u64;
    if let Some(c) = checker.as_mut() {
        c.feed(&buf[head_end..have]);
    }
    while got < size {
        let want = (size - got).min(buf.len() as u64) as usize;
        let k = s.read(&mut buf[..want]).context("reading a body")?;
        if k == 0 {
            return Err(fail(format!("the body ended at {got} of {size} bytes")));
        }
        if let Some(c) = checker.as_mut() {
            c.feed(&buf[..k]);
        }
        got += k as u64;
    }
    if got != size {
        return Err(fail(format!("{got} body bytes, want {size}")));
    }
    if let Some(c) = checker {
        match c.verdict() {
            Ok(n) if n == size => {}
            Ok(n) => return Err(fail(format!("checked {n} bytes of {size}"))),
            Err(why) => return Err(fail(format!("the body is not the file: {why}"))),
        }
    }
    Ok(())
}

/// The server, in a process group of its own (stopped, the whole group, on drop).
struct ServerProc {
    child: Child,
    pgid: u32,
    log: PathBuf,
}

impl ServerProc {
    fn spawn(argv: &[String], route: bool, log: PathBuf) -> CliResult<ServerProc> {
        let out = std::fs::File::create(&log).context(format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0);
        match route {
            true => cmd.env(ROUTE_ENV, "1"),
            false => cmd.env_remove(ROUTE_ENV),
        };
        // The service is the one on the region's socket (the preload's default).
        cmd.env_remove("MEMLOOP_PIPE_SOCKET");
        let child = cmd
            .spawn()
            .context(format!("starting {}", argv.join(" ")))?;
        Ok(ServerProc {
            pgid: child.id(),
            child,
            log,
        })
    }

    fn tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    fn check(&mut self) -> CliResult<()> {
        match self.child.try_wait()? {
            Some(st) => Err(fail(format!("the server exited ({st}): {}", self.tail()))),
            None => Ok(()),
        }
    }

    fn wait_listen(&mut self, port: u16) -> CliResult<()> {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(());
            }
            self.check()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(fail(format!(
            "the server does not listen on port {port} after 10 s: {}",
            self.tail()
        )))
    }

    /// CPU time of every process of the server's group (nginx: master and worker).
    fn cpu(&self) -> Duration {
        group_pids(self.pgid)
            .into_iter()
            .filter_map(|p| sys::cpu_time(p).ok())
            .sum()
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let Some(pg) = rustix::process::Pid::from_raw(self.pgid as i32) else {
            return;
        };
        let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::TERM);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            let _ = self.child.try_wait();
            if rustix::process::test_kill_process_group(pg).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The processes of process group `pgid`.
fn group_pids(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rfind(')')
                    .and_then(|i| s[i + 2..].split_whitespace().nth(2)?.parse::<u32>().ok())
                    == Some(pgid)
            })
        })
        .collect()
}
