//! `memloop region create | inspect | destroy`.

use crate::error::{fail, CliError, CliResult, Context};
use crate::switch_cmd;
use crate::units::{fmt_size, parse_size};
use memloop::registry::{RegionParams, RegionState};
use memloop::{CreateRegion, Error, Region, RegionSpec};
use serde_json::json;

#[derive(clap::Args)]
pub struct RegionArg {
    /// Region name (/dev/shm/memloop-NAME) or path; default: $MEMLOOP_REGION, else "default".
    #[arg(long)]
    pub region: Option<String>,
}

impl RegionArg {
    pub fn spec(&self) -> RegionSpec {
        self.region
            .as_deref()
            .map_or_else(RegionSpec::from_env, RegionSpec::parse)
    }
}

#[derive(clap::Subcommand)]
pub enum RegionCmd {
    /// Create a region (fails if it already exists).
    Create(CreateArgs),
    /// Show a region's header: path, size, generation, parameters, usage.
    Inspect {
        #[command(flatten)]
        region: RegionArg,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Remove a region. Its live connections are first moved to TCP (new ones stay there);
    /// members that have it mapped keep their mapping until they exit.
    Destroy(StateArgs),
    /// Stop taking ring connections: live ones move to TCP mid-stream, new ones stay on TCP.
    Pause(StateArgs),
    /// Take ring connections again; those the pause moved to TCP come back to their rings
    /// (in processes that follow promotions).
    Resume(StateArgs),
    /// Reclaim dead members now (their endpoints, channels and ring memory). Members in other
    /// kernels (VMs) are judged by their heartbeat, which takes watching for 1.5 s.
    Reclaim(RegionArg),
}

#[derive(clap::Args)]
pub struct StateArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Seconds to wait for the connections to finish their move (0: only ask).
    #[arg(long, value_name = "SECS", default_value = "5")]
    wait: f64,
}

#[derive(clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Total size, e.g. 64M or 1G (a sparse file: memory is taken as rings are used). The
    /// tables follow the size (a channel per 128 KiB, up to 16,384) unless given below.
    #[arg(long, default_value = "2G")]
    size: String,
    /// File permissions, octal.
    #[arg(long, default_value = "660")]
    mode: String,
    /// Group owning the region file (numeric id or name): the trust group.
    #[arg(long)]
    group: Option<String>,
    /// Maximum members.
    #[arg(long)]
    members: Option<u32>,
    /// Maximum endpoints (listening services and sockets).
    #[arg(long)]
    endpoints: Option<u32>,
    /// Maximum channels.
    #[arg(long)]
    channels: Option<u32>,
}

pub fn run(cmd: RegionCmd) -> CliResult<()> {
    match cmd {
        RegionCmd::Create(a) => create(&a),
        RegionCmd::Inspect { region, json } => inspect(&region.spec(), json),
        RegionCmd::Destroy(a) => destroy(&a),
        RegionCmd::Pause(a) => pause(&a),
        RegionCmd::Resume(a) => resume(&a),
        RegionCmd::Reclaim(r) => reclaim(&r.spec()),
    }
}

fn reclaim(spec: &RegionSpec) -> CliResult<()> {
    let region = open(spec)?;
    let before = region.registry().members().len();
    // Those /proc or their lock proves dead go now; a heartbeat must stand still for its
    // timeout.
    let node = memloop::Node::join(region, "reclaim").context("joining the region")?;
    node.reclaim_dead();
    let reg = node.region().registry();
    let remote = reg
        .members()
        .iter()
        .any(|m| m.id != node.id() && !node.same_kernel(m.id));
    if remote {
        std::thread::sleep(memloop::liveness::HEARTBEAT_TIMEOUT + HEARTBEAT_SLACK);
        node.reclaim_dead();
    }
    let after = reg.members().len() - 1; // not counting ourselves
    println!(
        "{} dead member(s) reclaimed, {after} live",
        before - after.min(before)
    );
    Ok(())
}

/// Beyond the heartbeat timeout, so the last look falls after it.
const HEARTBEAT_SLACK: std::time::Duration = std::time::Duration::from_millis(100);

/// Opens an existing region, explaining how to create one if there is none.
pub fn open(spec: &RegionSpec) -> CliResult<Region> {
    Region::open(spec).map_err(|e| explain(spec, e))
}

fn explain(spec: &RegionSpec, e: Error) -> CliError {
    match e {
        Error::NoRegion(path) => {
            let arg = match spec {
                RegionSpec::Named(n) if n == "default" => String::new(),
                RegionSpec::Named(n) => format!(" --region {n}"),
                other => format!(" --region {}", other.path().display()),
            };
            fail(format!(
                "no memloop region at {}: create one with `memloop region create{arg}`",
                path.display()
            ))
        }
        other => fail(format!("region {}: {other}", spec.path().display())),
    }
}

fn create(a: &CreateArgs) -> CliResult<()> {
    let spec = a.region.spec();
    let opts = create_options(a)?;
    // `open_or_create` would quietly attach to an existing region; creating must not.
    if !matches!(spec, RegionSpec::Device(_)) && spec.path().exists() {
        return Err(fail(format!(
            "a region already exists at {} (inspect it with `memloop region inspect`, or destroy it first)",
            spec.path().display()
        )));
    }
    let region = Region::open_or_create(&spec, &opts)
        .context(format!("creating region {}", spec.path().display()))?;
    println!(
        "created region at {} ({})",
        region.path().display(),
        fmt_size(region.size())
    );
    Ok(())
}

fn create_options(a: &CreateArgs) -> CliResult<CreateRegion> {
    let d = RegionParams::for_size(parse_size(&a.size)?);
    let params = RegionParams {
        max_members: a.members.unwrap_or(d.max_members),
        max_endpoints: a.endpoints.unwrap_or(d.max_endpoints),
        max_channels: a.channels.unwrap_or(d.max_channels),
        ..d
    };
    params.validate().context("region parameters")?;
    let mode = u32::from_str_radix(&a.mode, 8)
        .map_err(|_| fail(format!("--mode {:?}: expected octal, e.g. 660", a.mode)))?;
    if mode > 0o7777 {
        return Err(fail(format!("--mode {:o}: not a permission mode", mode)));
    }
    let gid = a.group.as_deref().map(group_id).transpose()?;
    Ok(CreateRegion { params, mode, gid })
}

/// A numeric gid, or a group name looked up in /etc/group.
fn group_id(g: &str) -> CliResult<u32> {
    if let Ok(n) = g.parse() {
        return Ok(n);
    }
    let groups = std::fs::read_to_string("/etc/group").context("reading /etc/group")?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            (name == g).then(|| f.nth(1)?.parse().ok())?
        })
        .next()
        .ok_or_else(|| fail(format!("no such group: {g}")))
}

fn inspect(spec: &RegionSpec, as_json: bool) -> CliResult<()> {
    let region = open(spec)?;
    let reg = region.registry();
    let (p, u) = (reg.params(), reg.usage());
    if as_json {
        let v = json!({
            "path": region.path(), "size": region.size(), "generation": reg.generation(),
            "state": reg.state().name(),
            "params": params_json(&p), "usage": usage_json(&u),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("path        {}", region.path().display());
    println!(
        "size        {} ({} bytes)",
        fmt_size(region.size()),
        region.size()
    );
    println!("generation  {}", reg.generation());
    println!("state       {}", reg.state().name());
    println!(
        "params      members {}, endpoints {}, channels {}, segment {}",
        p.max_members,
        p.max_endpoints,
        p.max_channels,
        fmt_size(p.segment_size)
    );
    println!("usage       {}", usage_line(&u, &p));
    Ok(())
}

pub fn params_json(p: &RegionParams) -> serde_json::Value {
    json!({ "size": p.size, "max_members": p.max_members, "max_endpoints": p.max_endpoints,
            "max_channels": p.max_channels, "segment_size": p.segment_size })
}

pub fn usage_json(u: &memloop::registry::Usage) -> serde_json::Value {
    json!({ "members": u.members, "endpoints": u.endpoints, "channels": u.channels,
            "segments_used": u.segments_used, "segments_total": u.segments_total })
}

pub fn usage_line(u: &memloop::registry::Usage, p: &RegionParams) -> String {
    format!(
        "members {}/{}, endpoints {}/{}, channels {}/{}, ring segments {}/{}",
        u.members,
        p.max_members,
        u.endpoints,
        p.max_endpoints,
        u.channels,
        p.max_channels,
        u.segments_used,
        u.segments_total
    )
}

fn destroy(a: &StateArgs) -> CliResult<()> {
    let spec = a.region.spec();
    // Best effort: say who still has it mapped (they keep working on their mapping).
    let live = match Region::open(&spec) {
        Ok(r) => {
            let reg = r.registry();
            reg.set_state(RegionState::Destroying)
                .context("marking the region as being destroyed")?;
            if let Err(e) = switch_cmd::demote_all_for_region(reg, a.wait) {
                // Still destroyed: a connection left on its ring keeps the mapping it has.
                eprintln!("warning: {e}");
            }
            reg.usage().members
        }
        Err(_) => 0,
    };
    Region::destroy(&spec).map_err(|e| explain(&spec, e))?;
    println!("destroyed region at {}", spec.path().display());
    if live > 0 {
        println!("note: {live} member(s) still have it mapped and keep it until they exit");
    }
    Ok(())
}

fn pause(a: &StateArgs) -> CliResult<()> {
    set_state(a, RegionState::Paused, switch_cmd::demote_all_for_region)
}

fn resume(a: &StateArgs) -> CliResult<()> {
    set_state(a, RegionState::Open, switch_cmd::promote_paused)
}

/// Sets the region's state, then moves its connections with `then` (waiting `--wait` s).
fn set_state(
    a: &StateArgs,
    state: RegionState,
    then: fn(&memloop::registry::Registry, f64) -> CliResult<()>,
) -> CliResult<()> {
    let region = open(&a.region.spec())?;
    let reg = region.registry();
    let was = reg
        .set_state(state)
        .context(format!("setting the region {}", state.name()))?;
    println!(
        "region {} {} (was {})",
        region.path().display(),
        state.name(),
        was.name()
    );
    then(reg, a.wait)
}
