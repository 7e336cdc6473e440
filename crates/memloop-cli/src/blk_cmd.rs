//! `memloop blk`: a block device over the region (MMBlk). `export` serves a file or a block
//! device as `blk/NAME` from the storage domain; `attach` in a client domain mounts a FUSE
//! file system whose one file, `disk`, is the export (`memloop_blk::fuse`), puts a loop
//! device on it (`losetup --direct-io=on`) and prints the device's path. Both run as
//! background services (`--foreground` to keep them here), log in the region's wake
//! directory, and publish their counters there in a small JSON file refreshed every second,
//! which `memloop status` reads (a file works across network namespaces that share the
//! file system, as the domains do).
//!
//! The attach service owns its mount and its loop device: `detach` signals it, and it
//! detaches the loop device and unmounts in its own mount namespace (`ip netns exec` gives
//! each domain command one of its own).

use crate::error::{fail, CliResult, Context};
use crate::service;
use memloop::{Node, Region, RegionSpec};
use memloop_blk::fuse::{Frontend, FrontendOptions, FrontendStats};
use memloop_blk::nbd::NbdFrontend;
use memloop_blk::{BlkServer, ExportOptions};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Subcommand)]
pub enum BlkCmd {
    /// Export a file or block device as NAME (in the storage domain).
    Export(ExportArgs),
    /// Stop this domain's export NAME (its clients' I/O fails with EIO until a new export).
    Unexport(NameArgs),
    /// Attach export NAME as a block device here: prints its path (e.g. /dev/loop3).
    Attach(AttachArgs),
    /// Detach NAME here: the loop device, the FUSE mount and the service.
    Detach(NameArgs),
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The export's name (letters, digits, '.', '_', '-'; at most 48 bytes).
    name: String,
    /// The backing store: a regular file or a block device.
    #[arg(long)]
    file: PathBuf,
    /// Refuse writes (EROFS).
    #[arg(long)]
    read_only: bool,
    /// Logical block size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// The region (default: MEMLOOP_REGION, else "default").
    #[arg(long)]
    region: Option<String>,
    /// Run the service in the foreground.
    #[arg(long)]
    foreground: bool,
}

#[derive(clap::Args)]
pub struct AttachArgs {
    name: String,
    #[arg(long)]
    region: Option<String>,
    /// Where to mount the FUSE file system (default: a directory in the region's wake
    /// directory, else /run/memloop/blk/NAME).
    #[arg(long)]
    mountpoint: Option<PathBuf>,
    /// Seconds a request may go unanswered by a storage side that is alive (stopped, hung on
    /// its own storage) before the I/O in flight fails with EIO and the attach starts over,
    /// as after the storage side's death; 0: wait for ever.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    io_timeout: f64,
    /// What the kernel is given: `fuse` (a loop device on a FUSE file), `nbd` (an NBD device,
    /// needs the nbd module), or `auto`: fuse where /dev/fuse is, else nbd. (FUSE measured
    /// faster in the QEMU guests, where both work: VM run 7.)
    #[arg(long, value_enum, default_value_t = FrontendKind::Auto)]
    frontend: FrontendKind,
    /// Run the service in the foreground.
    #[arg(long)]
    foreground: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FrontendKind {
    Auto,
    Fuse,
    Nbd,
}

#[derive(clap::Args)]
pub struct NameArgs {
    name: String,
    #[arg(long)]
    region: Option<String>,
}

pub fn run(cmd: BlkCmd) -> CliResult<()> {
    match cmd {
        BlkCmd::Export(a) => {
            check_name(&a.name)?;
            if a.foreground {
                serve_export(&a)
            } else {
                let mut args: Vec<String> = vec!["export".into(), a.name.clone(), "--file".into()];
                args.push(a.file.to_string_lossy().into());
                if a.read_only {
                    args.push("--read-only".into());
                }
                args.extend(["--block-size".into(), a.block_size.to_string()]);
                start(a.region.as_deref(), &format!("export-{}", a.name), args).map(|_| ())
            }
        }
        BlkCmd::Attach(a) => {
            check_name(&a.name)?;
            if !(a.io_timeout.is_finite() && (0.0..=86400.0).contains(&a.io_timeout)) {
                return Err(fail(format!(
                    "--io-timeout {}: seconds from 0 (never) to 86400",
                    a.io_timeout
                )));
            }
            if a.foreground {
                serve_attach(&a)
            } else {
                let mut args: Vec<String> = vec!["attach".into(), a.name.clone()];
                if let Some(m) = &a.mountpoint {
                    args.extend(["--mountpoint".into(), m.to_string_lossy().into()]);
                }
                args.extend(["--io-timeout".into(), a.io_timeout.to_string()]);
                let kind = clap::ValueEnum::to_possible_value(&a.frontend)
                    .map_or("auto".into(), |v| v.get_name().to_string());
                args.extend(["--frontend".into(), kind]);
                let dev = start(a.region.as_deref(), &format!("attach-{}", a.name), args)?;
                println!("{dev}");
                Ok(())
            }
        }
        BlkCmd::Detach(a) => stop(&a, "attach"),
        BlkCmd::Unexport(a) => stop(&a, "export"),
    }
}

fn check_name(name: &str) -> CliResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with('.');
    match ok {
        true => Ok(()),
        false => Err(fail(format!(
            "{name:?}: an export name is 1 to 48 letters, digits, '.', '_' or '-'"
        ))),
    }
}

/// The stats file of a service: exports are the region's (one per name), attachments the
/// network namespace's.
fn stats_path(spec: &RegionSpec, what: &str, name: &str) -> PathBuf {
    let file = match what {
        "export" => format!("blk-export-{name}.json"),
        _ => format!("blk-attach-{name}-net{}.json", service::netns_number()),
    };
    service::state_dir(spec).join(file)
}

/// Starts `memloop blk ARGS --foreground` in the background; its first line on stdout once
/// it is ready.
fn start(region: Option<&str>, label: &str, mut args: Vec<String>) -> CliResult<String> {
    let spec = service::region_spec(region);
    let log =
        service::state_dir(&spec).join(format!("blk-{label}-net{}.log", service::netns_number()));
    args.extend(["--foreground".into(), "--region".into()]);
    args.push(spec.path().to_string_lossy().into());
    let argv: Vec<OsString> = std::iter::once("blk".into())
        .chain(args.into_iter().map(OsString::from))
        .collect();
    service::start(&spec, "blk", &argv, &log, NOTIFY)
}

/// Set for a service started by `blk export|attach`: it prints its first line when ready.
const NOTIFY: &str = "MEMLOOP_BLK_NOTIFY";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes `v` to `path` whole (a reader never sees half of it).
fn publish(path: &Path, v: &Value) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, v.to_string()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

fn serve_export(a: &ExportArgs) -> CliResult<()> {
    let spec = service::region_spec(a.region.as_deref());
    let region = Region::open(&spec).context("opening the region")?;
    let node = Node::join(region, "blk-export").context("joining the region")?;
    let opts = ExportOptions {
        read_only: a.read_only,
        block_size: a.block_size,
        ..ExportOptions::default()
    };
    let server = BlkServer::export_with(&node, &a.name, &a.file, opts)
        .context(format!("exporting {}", a.file.display()))?;
    let stop = service::stop_flag()?;
    let info = server.info();
    let path = stats_path(&spec, "export", &a.name);
    let file = std::fs::canonicalize(&a.file).unwrap_or_else(|_| a.file.clone());
    let report = |server: &BlkServer| {
        let s = server.stats();
        json!({
            "name": a.name, "pid": std::process::id(), "updated": now(),
            "file": file, "size": info.size, "block_size": info.block_size,
            "read_only": info.read_only(), "clients": s.sessions_active,
            "sessions": s.sessions_opened, "requests": s.requests, "reads": s.reads,
            "writes": s.writes, "flushes": s.flushes, "discards": s.discards,
            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
            "errors": s.errors, "refused": s.refused,
        })
    };
    publish(&path, &report(&server));
    eprintln!(
        "memloop blk {}: exporting {} ({} bytes{})",
        a.name,
        file.display(),
        info.size,
        if info.read_only() { ", read-only" } else { "" }
    );
    service::notify_ready(&info.size.to_string(), NOTIFY, true)?;
    let mut last = Instant::now();
    while !stop.load(Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() >= Duration::from_secs(1) {
            last = Instant::now();
            publish(&path, &report(&server));
        }
    }
    eprintln!("memloop blk {}: unexporting", a.name);
    drop(server);
    let _ = std::fs::remove_file(&path);
    Ok(())
}

fn losetup(args: &[&str]) -> CliResult<String> {
    let out = Command::new("losetup")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running losetup (util-linux)")?;
    if !out.status.success() {
        return Err(fail(format!(
            "losetup {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn serve_attach(a: &AttachArgs) -> CliResult<()> {
    // First, while we are one thread: our own mount namespace, so that we never hold (and,
    // exiting last, tear down) the namespace where the device's users mount its file system
    // (see `memloop_shm::mountns`). Our FUSE mount and loop device need nobody else to see
    // the mount; losetup runs as our child.
    if let Err(e) = memloop_shm::mountns::enter_private() {
        tracing::warn!("blk attach {}: no mount namespace of its own: {e}", a.name);
    }
    let spec = service::region_spec(a.region.as_deref());
    let region = Region::open(&spec).context("opening the region")?;
    let node = Node::join(region, "blk-attach").context("joining the region")?;
    let fo = FrontendOptions {
        io_timeout: (a.io_timeout > 0.0).then(|| Duration::from_secs_f64(a.io_timeout)),
    };
    let nbd = match a.frontend {
        FrontendKind::Nbd => true,
        FrontendKind::Fuse => false,
        FrontendKind::Auto => !Path::new("/dev/fuse").exists() && NbdFrontend::available(),
    };
    let att = if nbd {
        let fe = NbdFrontend::start(&node, &a.name, fo)
            .context(format!("attaching {} as an NBD device", a.name))?;
        eprintln!(
            "memloop blk {}: {} (NBD, {} bytes)",
            a.name,
            fe.device().display(),
            fe.info().size
        );
        Attached::Nbd(fe)
    } else {
        attach_fuse(a, &spec, &node, fo)?
    };
    let stop = service::stop_flag()?;
    let path = stats_path(&spec, "attach", &a.name);
    let dev = att.device();
    let report = |att: &Attached| {
        let (s, info) = att.stats();
        json!({
            "name": a.name, "pid": std::process::id(), "updated": now(),
            "device": dev, "frontend": att.kind(), "mountpoint": att.mountpoint(),
            "size": info.size, "read_only": info.read_only(), "connected": s.connected,
            "requests": s.requests, "reads": s.reads, "writes": s.writes,
            "flushes": s.flushes, "discards": s.discards,
            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
            "errors": s.errors, "failed_disconnected": s.failed_disconnected,
            "refused": s.refused, "reattached": s.reattached, "timed_out": s.timed_out,
        })
    };
    publish(&path, &report(&att));
    service::notify_ready(&dev, NOTIFY, true)?;
    let mut last = Instant::now();
    while !stop.load(Relaxed) && !att.ended() {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() >= Duration::from_secs(1) {
            last = Instant::now();
            publish(&path, &report(&att));
        }
    }
    eprintln!("memloop blk {}: detaching {dev}", a.name);
    let _ = std::fs::remove_file(&path);
    att.detach(&a.name);
    // The frontend's threads are done (joined, bounded): the session's buffers and channels
    // went back to the region; now our membership. (Exiting closes /dev/fuse, which ends the
    // FUSE connection if something still holds it.)
    drop(node);
    std::process::exit(0);
}

/// An attachment as the kernel sees it.
enum Attached {
    /// A loop device on the FUSE file.
    Fuse {
        fe: Frontend,
        dev: String,
        mountpoint: PathBuf,
    },
    Nbd(NbdFrontend),
}

impl Attached {
    fn device(&self) -> String {
        match self {
            Attached::Fuse { dev, .. } => dev.clone(),
            Attached::Nbd(fe) => fe.device().to_string_lossy().into_owned(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Attached::Fuse { .. } => "fuse",
            Attached::Nbd(_) => "nbd",
        }
    }

    fn mountpoint(&self) -> Option<&Path> {
        match self {
            Attached::Fuse { mountpoint, .. } => Some(mountpoint),
            Attached::Nbd(_) => None,
        }
    }

    fn stats(&self) -> (FrontendStats, memloop_blk::ExportInfo) {
        match self {
            Attached::Fuse { fe, .. } => (fe.stats(), fe.info()),
            Attached::Nbd(fe) => (fe.stats(), fe.info()),
        }
    }

    /// The kernel let go of the device (an NBD device disconnected by someone else).
    fn ended(&self) -> bool {
        match self {
            Attached::Fuse { .. } => false,
            Attached::Nbd(fe) => fe.ended(),
        }
    }

    fn detach(self, name: &str) {
        match self {
            Attached::Fuse {
                fe,
                dev,
                mountpoint,
            } => {
                if let Err(e) = losetup(&["--detach", &dev]) {
                    eprintln!("memloop blk {name}: {e}");
                }
                drop(fe);
                let _ = std::fs::remove_dir(&mountpoint);
            }
            Attached::Nbd(fe) => drop(fe),
        }
    }
}

/// The FUSE frontend, mounted, and a loop device with direct I/O on its file.
fn attach_fuse(
    a: &AttachArgs,
    spec: &RegionSpec,
    node: &Node,
    fo: FrontendOptions,
) -> CliResult<Attached> {
    let mountpoint = match &a.mountpoint {
        Some(m) => m.clone(),
        None => {
            let wake = memloop::region::wake_dir(&spec.path());
            match memloop::region::make_wake_dir(&wake) {
                Ok(()) => wake.join(format!("blk-{}-net{}", a.name, service::netns_number())),
                Err(_) => PathBuf::from("/run/memloop/blk").join(&a.name),
            }
        }
    };
    std::fs::create_dir_all(&mountpoint).context(format!("creating {}", mountpoint.display()))?;
    let fe = Frontend::start_with(node, &a.name, &mountpoint, fo).context(format!(
        "attaching {} at {}",
        a.name,
        mountpoint.display()
    ))?;
    let info = fe.info();
    let disk = fe.disk_path();
    let disk_s = disk.to_string_lossy().to_string();
    let bs = info.block_size.to_string();
    let mut args = vec!["--direct-io=on", "--find", "--show", "--sector-size", &bs];
    if info.read_only() {
        args.push("--read-only");
    }
    args.push(&disk_s);
    let dev = match losetup(&args) {
        Ok(d) => d,
        Err(e) => {
            drop(fe);
            let _ = std::fs::remove_dir(&mountpoint);
            return Err(e);
        }
    };
    let dio = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/dio",
        dev.trim_start_matches("/dev/")
    ))
    .unwrap_or_default();
    eprintln!(
        "memloop blk {}: {} on {} ({} bytes, direct I/O {})",
        a.name,
        dev,
        disk.display(),
        info.size,
        dio.trim()
    );
    Ok(Attached::Fuse {
        fe,
        dev,
        mountpoint,
    })
}

/// Stops this domain's `what` service (export / attach) of NAME and waits until it is gone.
fn stop(a: &NameArgs, what: &str) -> CliResult<()> {
    let spec = service::region_spec(a.region.as_deref());
    let path = stats_path(&spec, what, &a.name);
    let v: Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| fail(format!("no {what} of {} here", a.name)))?;
    let pid = v["pid"].as_u64().unwrap_or(0) as u32;
    if pid == 0 || !serves(pid, what, &a.name) {
        // The service died: what it left.
        if let Some(dev) = v["device"].as_str() {
            let _ = losetup(&["--detach", dev]);
        }
        if let Some(m) = v["mountpoint"].as_str() {
            let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
        }
        let _ = std::fs::remove_file(&path);
        return Ok(());
    }
    service::terminate(pid, "blk", Duration::from_secs(15))
}

/// Process `pid` is this `what` (export / attach) service of `name`.
fn serves(pid: u32, what: &str, name: &str) -> bool {
    let args = service::cmdline(pid);
    let has = |w: &str| args.iter().any(|a| a == w);
    has("blk") && has(what) && has(name) && has("--foreground")
}

// ---- `memloop status` ----

/// The live stats files (refreshed in the last 5 s) of kind `export` / `attach`.
fn live(region: &Path, kind: &str) -> Vec<Value> {
    let dir = service::state_dir_of(region);
    let prefix = format!("blk-{kind}-");
    let mut out: Vec<Value> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.starts_with(&prefix) && n.ends_with(".json")
        })
        .filter_map(|e| serde_json::from_str(&std::fs::read_to_string(e.path()).ok()?).ok())
        .filter(|v: &Value| v["updated"].as_u64().unwrap_or(0) + 5 >= now())
        .collect();
    out.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    out
}

/// `status --json`: `{ "exports": [...], "attachments": [...] }`.
pub fn blk_json(region: &Path) -> Value {
    json!({ "exports": live(region, "export"), "attachments": live(region, "attach") })
}

fn n(v: &Value, k: &str) -> String {
    v[k].as_u64().map_or("-".into(), |x| x.to_string())
}
fn sz(v: &Value, k: &str) -> String {
    v[k].as_u64().map_or("-".into(), crate::units::fmt_size)
}

/// `status` text: the exports and the attachments (nothing without any).
pub fn write_blk(out: &mut dyn Write, region: &Path) -> std::io::Result<()> {
    let exports = live(region, "export");
    let attached = live(region, "attach");
    if exports.is_empty() && attached.is_empty() {
        return Ok(());
    }
    let mut rows: Vec<Vec<String>> = vec![[
        "name", "file", "size", "ro", "clients", "requests", "read", "written", "errors", "refused",
    ]
    .map(String::from)
    .to_vec()];
    for e in &exports {
        rows.push(vec![
            e["name"].as_str().unwrap_or("?").into(),
            e["file"].as_str().unwrap_or("?").into(),
            sz(e, "size"),
            if e["read_only"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
            .into(),
            n(e, "clients"),
            n(e, "requests"),
            sz(e, "bytes_read"),
            sz(e, "bytes_written"),
            n(e, "errors"),
            n(e, "refused"),
        ]);
    }
    writeln!(out, "\nBLK EXPORTS ({})", exports.len())?;
    table(out, &rows)?;
    let mut rows: Vec<Vec<String>> = vec![[
        "name",
        "device",
        "pid",
        "connected",
        "requests",
        "read",
        "written",
        "errors",
        "eio (gone)",
        "timed out",
        "reattached",
    ]
    .map(String::from)
    .to_vec()];
    for e in &attached {
        rows.push(vec![
            e["name"].as_str().unwrap_or("?").into(),
            e["device"].as_str().unwrap_or("?").into(),
            n(e, "pid"),
            if e["connected"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
            .into(),
            n(e, "requests"),
            sz(e, "bytes_read"),
            sz(e, "bytes_written"),
            n(e, "errors"),
            n(e, "failed_disconnected"),
            n(e, "timed_out"),
            n(e, "reattached"),
        ]);
    }
    writeln!(out, "\nBLK ATTACHMENTS ({})", attached.len())?;
    table(out, &rows)
}

fn table(out: &mut dyn Write, rows: &[Vec<String>]) -> std::io::Result<()> {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let w: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<width$}", width = w[i]))
            .collect();
        writeln!(out, "  {}", line.join("  ").trim_end())?;
    }
    Ok(())
}
