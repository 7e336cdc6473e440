//! `memloop pipe`: the pipe service (vPipe) and a client for it. `serve` runs the service on
//! the region's socket (`<region>.wake/pipe`, which containers of the region already see);
//! `copy` hands it a transfer between two files or stdin/stdout; `status` prints its
//! per-tenant accounting.

use crate::error::{fail, CliResult, Context};
use crate::units::parse_size;
use memloop_pipe::client::Client;
use memloop_pipe::service::{Config, Service};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Subcommand)]
pub enum PipeCmd {
    /// Run the pipe service until SIGINT or SIGTERM.
    Serve(ServeArgs),
    /// Move bytes from SRC to DST through the service (`-`: stdin / stdout).
    Copy(CopyArgs),
    /// The service's transfers and per-tenant bytes, CPU and waiting time.
    Status(StatusArgs),
}

#[derive(clap::Args)]
pub struct Where {
    /// The region whose socket to use (default: MEMLOOP_REGION, else "default").
    #[arg(long)]
    region: Option<String>,
    /// The service's socket, instead of the region's.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    at: Where,
    /// Threads moving bytes (default: one per CPU).
    #[arg(long)]
    workers: Option<usize>,
    /// Bytes moved for one tenant per turn.
    #[arg(long, default_value = "256K", value_name = "SIZE")]
    chunk: String,
    /// A tenant's weight, over what its clients ask for (repeatable).
    #[arg(long = "weight", value_name = "TENANT=WEIGHT")]
    weights: Vec<String>,
    /// Transfers one client may have in flight before its submissions wait.
    #[arg(long, default_value_t = 64)]
    max_inflight: usize,
}

#[derive(clap::Args)]
pub struct CopyArgs {
    #[command(flatten)]
    at: Where,
    src: String,
    dst: String,
    /// Bytes to move (default: until SRC ends).
    #[arg(long, value_name = "SIZE")]
    len: Option<String>,
    /// The tenant to charge (default: the service names it after our control group).
    #[arg(long)]
    tenant: Option<String>,
    /// The weight to ask for.
    #[arg(long, default_value_t = 1)]
    weight: u16,
}

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    at: Where,
    /// Print the JSON the service reports.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: PipeCmd) -> CliResult<()> {
    match cmd {
        PipeCmd::Serve(a) => serve(&a),
        PipeCmd::Copy(a) => copy(&a),
        PipeCmd::Status(a) => status(&a),
    }
}

/// The service socket of the region named by `region` (or the environment's).
pub fn socket_of(region: Option<&str>) -> PathBuf {
    let spec = match region {
        Some(r) => memloop::RegionSpec::parse(r),
        None => memloop::RegionSpec::from_env(),
    };
    memloop::region::wake_dir(&spec.path()).join("pipe")
}

fn socket(at: &Where) -> PathBuf {
    at.socket
        .clone()
        .unwrap_or_else(|| socket_of(at.region.as_deref()))
}

fn serve(a: &ServeArgs) -> CliResult<()> {
    let path = socket(&a.at);
    if let Some(dir) = path.parent() {
        memloop::region::make_wake_dir(dir).context(format!("creating {}", dir.display()))?;
    }
    let mut cfg = Config::new(path.clone());
    if let Some(w) = a.workers {
        cfg.workers = w.clamp(1, 256);
    }
    cfg.chunk = parse_size(&a.chunk)?.clamp(4096, 64 << 20) as usize;
    cfg.max_inflight = a.max_inflight.max(1);
    for w in &a.weights {
        let (name, weight) = w
            .split_once('=')
            .ok_or_else(|| fail(format!("--weight {w:?}: want TENANT=WEIGHT")))?;
        let weight: u32 = weight
            .parse()
            .ok()
            .filter(|w| (1..=1000).contains(w))
            .ok_or_else(|| fail(format!("--weight {w:?}: a weight from 1 to 1000")))?;
        cfg.weights.insert(name.to_string(), weight);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("handling signals")?;
    }
    let svc =
        Service::start(cfg).context(format!("starting the pipe service at {}", path.display()))?;
    eprintln!("memloop pipe: serving at {}", path.display());
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    eprintln!("memloop pipe: stopping");
    svc.stop();
    Ok(())
}

fn copy(a: &CopyArgs) -> CliResult<()> {
    let path = socket(&a.at);
    let len = a.len.as_deref().map(parse_size).transpose()?;
    let src = open_end(&a.src, false)?;
    let dst = open_end(&a.dst, true)?;
    let mut c = Client::connect(&path, a.tenant.as_deref(), a.weight)?;
    let id = c.submit(src.as_fd(), dst.as_fd(), len)?;
    let done = c.wait_for(id)?;
    let how = done
        .primitive
        .map_or("nothing".into(), |p| format!("{p:?}"));
    eprintln!(
        "memloop pipe: {} bytes moved with {how} (tenant {})",
        done.moved,
        c.tenant().0
    );
    done.result.context("the transfer")
}

/// `-`: our stdin or stdout (a duplicate: the service gets its own descriptor); else a file.
fn open_end(name: &str, write: bool) -> CliResult<OwnedFd> {
    if name == "-" {
        let fd = match write {
            true => std::io::stdout().as_fd().try_clone_to_owned(),
            false => std::io::stdin().as_fd().try_clone_to_owned(),
        };
        return fd.context("duplicating a standard descriptor");
    }
    let f = match write {
        true => std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(name),
        false => std::fs::File::open(name),
    };
    Ok(f.context(format!("opening {name}"))?.into())
}

fn status(a: &StatusArgs) -> CliResult<()> {
    let path = socket(&a.at);
    let mut c = Client::connect(&path, Some("memloop-status"), 1)?;
    let json = c.stats()?;
    if a.json {
        println!("{json}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(&json).context("the service's statistics")?;
    print!("{}", render(&v));
    Ok(())
}

/// The statistics as a table: one row per tenant.
pub fn render(v: &serde_json::Value) -> String {
    let mut out = String::new();
    let t = &v["totals"];
    out += &format!(
        "pipe service at {}: {} workers, {} clients, {} transfers ({} waiting for I/O); done {}, failed {}, cancelled {}, refused {}\n",
        v["socket"].as_str().unwrap_or("?"),
        v["workers"],
        v["clients"],
        v["transfers"],
        v["parked"],
        t["completed"],
        t["failed"],
        t["cancelled"],
        t["refused"],
    );
    out += &format!(
        "{:<32} {:>6} {:>14} {:>10} {:>10} {:>8}\n",
        "tenant", "weight", "bytes", "cpu ms", "wait ms", "chunks"
    );
    for x in v["tenants"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<32} {:>6} {:>14} {:>10.1} {:>10.1} {:>8}\n",
            x["name"].as_str().unwrap_or("?"),
            x["weight"],
            x["bytes"],
            x["cpu_ns"].as_f64().unwrap_or(0.0) / 1e6,
            x["wait_ns"].as_f64().unwrap_or(0.0) / 1e6,
            x["chunks"],
        );
    }
    out
}
