//! Figure 1: a socket → socket relay (a proxy). A source process sends N bytes over loopback
//! TCP to this process, which forwards them over loopback TCP to a sink process. The relay is a
//! user-space copy loop (read/write, 256 KiB), or hands both sockets to the pipe service and
//! waits for the completion; a third path, splice through a pipe in the relay itself, shows
//! what the service's primitive costs without the service.
//!
//! The timed run's ends copy nothing (the source sendfiles a RAM file over and over, the sink
//! splices to /dev/null), so what differs between the paths is the relay; a pass of up to
//! 64 MiB before it has the source write the pattern and the sink check every byte. Timed from
//! the relay's "go" to the source to the sink's report of the last byte. CPU: this process (the
//! relay) and the service's process, per byte moved. Pinned (by default): the relay and its
//! service on one CPU, source and sink on the other.

use super::peer::BUF;
use super::svc::{self, Svc};
use super::Opts;
use crate::bench::report::Record;
use crate::bench::sys;
use crate::error::{fail, CliResult, Context};
use crate::units::fmt_size;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const TEST: &str = "relay";
pub const COPY: &str = "copy-loop";
pub const SERVICE: &str = "pipe-service";
/// The service's primitive without the service: splice through a pipe in the relay itself.
pub const SPLICE: &str = "splice-loop";
pub const CPU_RELAY: &str = "relay cpu ns/B";
pub const CPU_SERVICE: &str = "service cpu ns/B";
pub const CPU_TOTAL: &str = "relay+service cpu ns/B";

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// read/write through a 256 KiB buffer.
    Copy,
    /// Both sockets handed to the pipe service.
    Service,
    /// socket → pipe → socket with splice, in the relay (a reference: the kernel's part).
    Splice,
}

pub const PATHS: [Path; 3] = [Path::Copy, Path::Service, Path::Splice];

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Copy => COPY,
            Path::Service => SERVICE,
            Path::Splice => SPLICE,
        }
    }
}

/// A `pipe-peer` process, its stdout read line by line; killed if dropped unfinished.
struct PeerProc {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    what: &'static str,
}

impl PeerProc {
    fn spawn(what: &'static str, args: &[String]) -> CliResult<PeerProc> {
        let exe = std::env::current_exe().context("locating the memloop-bench binary")?;
        let mut child = Command::new(exe)
            .arg("pipe-peer")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context(format!("starting the relay's {what}"))?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        Ok(PeerProc { child, out, what })
    }

    fn line(&mut self) -> CliResult<String> {
        let mut l = String::new();
        self.out
            .read_line(&mut l)
            .context(format!("the relay's {}", self.what))?;
        if l.is_empty() {
            let st = self.child.wait()?;
            return Err(fail(format!(
                "the relay's {} ended early ({st})",
                self.what
            )));
        }
        Ok(l.trim().to_string())
    }

    fn finish(mut self) -> CliResult<()> {
        let st = self.child.wait()?;
        match st.success() {
            true => Ok(()),
            false => Err(fail(format!("the relay's {} failed: {st}", self.what))),
        }
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Bytes of the checked pass (at most).
const CHECKED: u64 = 64 << 20;
/// The file the timed pass's source sends over and over.
const SOURCE_FILE: u64 = 8 << 20;

/// The relay's two ends.
enum Ends<'a> {
    /// The source writes the pattern, the sink reads and checks every byte: correctness.
    Checked,
    /// The source sendfiles this file (over and over), the sink splices to /dev/null: ends that
    /// copy nothing, so that the relay's own cost is what the figure shows.
    Cheap(&'a std::path::Path),
}

/// One relay, as measured.
struct Run {
    moved: u64,
    wall: Duration,
    /// This process's CPU time (the relay's).
    cpu: Duration,
    svc_cpu: Option<Duration>,
    how: String,
}

/// `o.bytes` relayed on path `p` between ends that copy nothing (after a checked pass of up
/// to 64 MiB): its records.
pub fn measure(o: &Opts, p: Path) -> CliResult<Vec<Record>> {
    let n = o.bytes;
    // The relay (this thread) and the service it starts on one CPU, the ends on the other.
    let _pin = super::PinGuard::to(o.cpus.map(|c| c.1))?;
    let ends_cpu = o.cpus.map(|c| c.0);
    let mut svc = match p {
        Path::Service => {
            let sock = std::env::temp_dir().join(format!(
                "memloop-bench-pipe-relay-{}-{}",
                std::process::id(),
                svc::unique()
            ));
            Some(Svc::start(Some(&sock), None, o.workers)?)
        }
        Path::Copy | Path::Splice => None,
    };
    let checked = n.min(CHECKED);
    relay(p, svc.as_ref(), &Ends::Checked, checked, ends_cpu)?;
    let base = match std::path::Path::new("/dev/shm").is_dir() {
        true => PathBuf::from("/dev/shm"),
        false => std::env::temp_dir(),
    };
    let file = base.join(format!(
        "memloop-bench-pipe-src-{}-{}",
        std::process::id(),
        svc::unique()
    ));
    let run =
        write_source(&file).and_then(|()| relay(p, svc.as_ref(), &Ends::Cheap(&file), n, ends_cpu));
    let _ = std::fs::remove_file(&file);
    let run = run?;
    if let Some(s) = svc.as_mut() {
        s.check()?;
    }
    let per_byte = |d: Duration| d.as_nanos() as f64 / n as f64;
    let name = p.name();
    let mut gbs = Record::new(
        TEST,
        name,
        n,
        "GB/s",
        n as f64 / run.wall.as_secs_f64() / 1e9,
    );
    gbs.note = Some(format!(
        "{}; source: sendfile of a {} RAM file, sink: splice to /dev/null (ends that copy \
         nothing); a {} pass before it with every byte checked by the sink",
        run.how,
        fmt_size(SOURCE_FILE),
        fmt_size(checked)
    ));
    let mut v = vec![
        gbs,
        Record::new(TEST, name, n, CPU_RELAY, per_byte(run.cpu)),
    ];
    if let Some(s) = run.svc_cpu {
        v.push(Record::new(TEST, name, n, CPU_SERVICE, per_byte(s)));
    }
    let total = run.cpu + run.svc_cpu.unwrap_or_default();
    v.push(Record::new(TEST, name, n, CPU_TOTAL, per_byte(total)));
    debug_assert_eq!(run.moved, n);
    Ok(v)
}

fn write_source(file: &std::path::Path) -> CliResult<()> {
    let mut buf = vec![0u8; SOURCE_FILE as usize];
    super::peer::fill(&mut buf, 0);
    std::fs::write(file, &buf).context(format!("writing {}", file.display()))
}

/// One relay of `n` bytes between fresh ends.
fn relay(p: Path, svc: Option<&Svc>, ends: &Ends, n: u64, cpu: Option<usize>) -> CliResult<Run> {
    let mut sink_args = vec!["--role".to_string(), "sink".into()];
    let mut source_args: Vec<String> = vec!["--bytes".into(), n.to_string()];
    if let Some(c) = cpu {
        for a in [&mut sink_args, &mut source_args] {
            a.extend(["--cpu".to_string(), c.to_string()]);
        }
    }
    if let Ends::Cheap(f) = ends {
        sink_args.push("--drain".into());
        source_args.extend(["--file".into(), f.display().to_string()]);
    }
    let mut sink = PeerProc::spawn("sink", &sink_args)?;
    let port: u16 = sink
        .line()?
        .strip_prefix("port ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| fail("the relay's sink did not say its port"))?;
    let l = TcpListener::bind("127.0.0.1:0").context("the relay's listener")?;
    let addr = l.local_addr()?.to_string();
    source_args.extend(["--role", "source", "--addr", &addr].map(String::from));
    let source = PeerProc::spawn("source", &source_args)?;
    let (mut from, _) = l.accept().context("accepting the source")?;
    let mut to = TcpStream::connect(("127.0.0.1", port)).context("connecting to the sink")?;
    let mut client = match svc {
        Some(s) => Some(s.client("relay", 1)?),
        None => None,
    };
    let me = std::process::id();
    let cpu0 = sys::cpu_time(me)?;
    let svc0 = svc.map(Svc::cpu).transpose()?;
    let t0 = Instant::now();
    from.write_all(&[1]).context("telling the source to go")?;
    let (moved, how) = match client.as_mut() {
        None if p == Path::Splice => (
            splice_loop(&from, &to)?,
            "splice through a 1 MiB pipe, blocking".to_string(),
        ),
        None => (
            copy(&mut from, &mut to)?,
            "read/write, 256 KiB buffer".to_string(),
        ),
        Some(c) => {
            let id = c
                .submit(from.as_fd(), to.as_fd(), None)
                .context("handing the relay to the service")?;
            let done = c.wait_for(id).context("waiting for the relay")?;
            done.result.context("the service's relay")?;
            let prim = done.primitive.map_or("none".into(), |p| format!("{p:?}"));
            (done.moved, format!("primitive {prim}"))
        }
    };
    to.shutdown(Shutdown::Write)
        .context("ending the sink's stream")?;
    let said = sink.line()?;
    let wall = t0.elapsed();
    let cpu = sys::cpu_time(me)? - cpu0;
    let svc_cpu = match (svc, svc0) {
        (Some(s), Some(c0)) => Some(s.cpu()? - c0),
        _ => None,
    };
    source.finish()?;
    sink.finish()?;
    let want = match ends {
        Ends::Checked => format!("done {n} ok"),
        Ends::Cheap(_) => format!("done {n} drained"),
    };
    if said != want || moved != n {
        return Err(fail(format!(
            "relay through {}: moved {moved} of {n} bytes; the sink says {said:?}",
            p.name()
        )));
    }
    Ok(Run {
        moved,
        wall,
        cpu,
        svc_cpu,
        how,
    })
}

/// The user-space relay: read, then write, through one buffer, until the source ends.
fn copy(from: &mut TcpStream, to: &mut TcpStream) -> CliResult<u64> {
    let mut buf = vec![0u8; BUF];
    let mut moved = 0u64;
    loop {
        let k = match from.read(&mut buf) {
            Ok(0) => return Ok(moved),
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(format!("relay: reading: {e}"))),
        };
        to.write_all(&buf[..k]).context("relay: writing")?;
        moved += k as u64;
    }
}

/// The kernel's relay without the service: socket → pipe → socket, blocking splices.
fn splice_loop(from: &TcpStream, to: &TcpStream) -> CliResult<u64> {
    use rustix::pipe::{splice, SpliceFlags};
    let (r, w) = rustix::pipe::pipe().context("a pipe")?;
    let cap = rustix::pipe::fcntl_setpipe_size(&w, 1 << 20).unwrap_or(64 << 10);
    let mut moved = 0u64;
    loop {
        let n = match splice(from, None, &w, None, cap, SpliceFlags::MOVE) {
            Ok(0) => return Ok(moved),
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(fail(format!("relay: splice from the source: {e}"))),
        };
        let mut left = n;
        while left > 0 {
            match splice(&r, None, to, None, left, SpliceFlags::MOVE) {
                Ok(0) => return Err(fail("relay: the sink took nothing")),
                Ok(k) => left -= k,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(fail(format!("relay: splice to the sink: {e}"))),
            }
        }
        moved += n as u64;
    }
}
