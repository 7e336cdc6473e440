//! `memloop demote` / `memloop promote`: live path switching by hand (issue 12).
//!
//! `demote` sets the REQUESTED bit of each selected channel's switch word
//! ([`Registry::request_switch`] with [`SwitchReason::Operator`]). The preloaded processes
//! holding the channel notice it on their next call on the connection, or within one heartbeat,
//! and both sides leave the ring; the connection goes on over TCP (recorded with its switch),
//! keeping its channel until it closes. `promote` sets `PROMOTE` on channels with both sides
//! on TCP ([`Registry::request_promote`]): both sides come back to the ring at an agreed
//! stream position. The tool only asks: it holds no end of the connection. With `--wait`, it
//! then watches each channel until it is done (or freed).

use crate::error::{fail, CliResult};
use crate::region_cmd::{self, RegionArg};
use memloop::registry::{
    ChannelId, ChannelInfo, ChannelState, MemberId, Registry, RegistryError, Side, SwitchReason,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Which channels: exactly one of `--all`, `--pid`, `--conn`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("select").required(true).args(["all", "pid", "conn"])))]
pub struct SwitchArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Every accepted channel of the region.
    #[arg(long)]
    all: bool,
    /// The channels of which either side is held by the member with this pid.
    #[arg(long, value_name = "PID")]
    pid: Option<u32>,
    /// One channel, by the id `memloop status` prints (IDX.GEN; a bare IDX names the slot's
    /// current channel).
    #[arg(long, value_name = "ID")]
    conn: Option<String>,
    /// Seconds to wait for the channels to finish their move (0: only ask).
    #[arg(long, value_name = "SECS", default_value = "2")]
    wait: f64,
}

/// How often `--wait` looks at the channels.
const POLL: Duration = Duration::from_millis(2);

/// A channel id as `memloop status` prints it: `IDX.GEN`, or a bare `IDX`.
pub fn parse_channel_id(s: &str) -> Option<(u32, Option<u32>)> {
    let s = s.trim();
    match s.split_once('.') {
        Some((idx, gen)) => Some((idx.parse().ok()?, Some(gen.parse().ok()?))),
        None => Some((s.parse().ok()?, None)),
    }
}

fn id_str(id: ChannelId) -> String {
    format!("{}.{}", id.idx, id.gen)
}

fn state_str(s: ChannelState) -> String {
    format!("{s:?}").to_lowercase()
}

/// The channels `a` selects. `--conn` must name an accepted channel of a TCP connection; the
/// other selectors pick among those there are (none is fine). Native streams (`memloop cat`,
/// the native API; no 4-tuple) have no kernel socket to move to and are never selected.
fn select(reg: &Registry, a: &SwitchArgs, verb: &str) -> CliResult<Vec<ChannelId>> {
    let chans: Vec<ChannelInfo> = reg.channels().into_iter().filter(|c| !c.marker).collect();
    let accepted = |c: &&ChannelInfo| c.state == ChannelState::Accepted && c.tuple.is_some();
    if let Some(spec) = &a.conn {
        let (idx, gen) = parse_channel_id(spec).ok_or_else(|| {
            fail(format!(
                "--conn {spec:?}: not a channel id (IDX.GEN, as `memloop status` prints it)"
            ))
        })?;
        let c = chans
            .iter()
            .find(|c| c.id.idx == idx && gen.is_none_or(|g| c.id.gen == g))
            .ok_or_else(|| fail(format!("{verb}: no channel {spec} in this region")))?;
        if c.state != ChannelState::Accepted {
            return Err(fail(format!(
                "{verb}: channel {} is {}, not accepted: it has no connection to move",
                id_str(c.id),
                state_str(c.state)
            )));
        }
        if c.tuple.is_none() {
            return Err(fail(format!(
                "{verb}: channel {} is a native stream: it has no TCP socket to move to",
                id_str(c.id)
            )));
        }
        return Ok(vec![c.id]);
    }
    if let Some(pid) = a.pid {
        let pids: HashMap<MemberId, u32> = reg
            .members()
            .into_iter()
            .map(|m| (m.id, m.identity.pid))
            .collect();
        let held = |m: Option<MemberId>| m.and_then(|m| pids.get(&m)) == Some(&pid);
        return Ok(chans
            .iter()
            .filter(accepted)
            .filter(|c| held(Some(c.client)) || held(c.server))
            .map(|c| c.id)
            .collect());
    }
    Ok(all_tcp(reg))
}

/// Whether a demoted channel is done: freed (the slot no longer holds it) or both sides on TCP.
fn finished(reg: &Registry, ch: ChannelId) -> bool {
    match reg.switch_word(ch) {
        Ok(w) => w.on_tcp(Side::Client) && w.on_tcp(Side::Server),
        Err(RegistryError::Stale | RegistryError::NotFound) => true,
        Err(_) => false,
    }
}

/// Whether a promoted channel is done: back on its ring (its switch word quiet again) or
/// freed.
fn promoted(reg: &Registry, ch: ChannelId) -> bool {
    match reg.switch_word(ch) {
        Ok(w) => w.quiet(),
        Err(RegistryError::Stale | RegistryError::NotFound) => true,
        Err(_) => false,
    }
}

pub fn demote(a: &SwitchArgs) -> CliResult<()> {
    let ask = |reg: &Registry, ch| reg.request_switch(ch, SwitchReason::Operator);
    switch(a, Verb::Demote, ask, finished)
}

/// TCP → ring: connections that switched to TCP (both sides there) come back to their rings —
/// unless a process opted out (`MEMLOOP_PROMOTE=0` in its environment: it calls the request
/// off and `--wait` reports it unfinished).
pub fn promote(a: &SwitchArgs) -> CliResult<()> {
    // Only a connection with both sides on TCP can come back; others are left alone.
    let ask = |reg: &Registry, ch| reg.request_promote(ch);
    switch(a, Verb::Promote, ask, promoted)
}

#[derive(Clone, Copy)]
enum Verb {
    Demote,
    Promote,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Demote => "demote",
            Verb::Promote => "promote",
        }
    }
    fn goal(self) -> &'static str {
        match self {
            Verb::Demote => "to leave the ring",
            Verb::Promote => "to come back to the ring",
        }
    }
    fn done(self) -> &'static str {
        match self {
            Verb::Demote => "on TCP or closed",
            Verb::Promote => "on the ring or closed",
        }
    }
}

/// Asks each selected channel, then (with `--wait`) watches until `done` says each is.
fn switch(
    a: &SwitchArgs,
    verb: Verb,
    ask: impl Fn(&Registry, ChannelId) -> Result<bool, RegistryError>,
    done: impl Fn(&Registry, ChannelId) -> bool,
) -> CliResult<()> {
    let region = region_cmd::open(&a.region.spec())?;
    let reg = region.registry();
    let chans = select(reg, a, verb.name())?;
    ask_and_wait(reg, verb, chans, a.conn.is_some(), a.wait, ask, done)
}

/// Every accepted channel of a TCP connection (what `--all` selects).
fn all_tcp(reg: &Registry) -> Vec<ChannelId> {
    reg.channels()
        .into_iter()
        .filter(|c| !c.marker && c.state == ChannelState::Accepted && c.tuple.is_some())
        .map(|c| c.id)
        .collect()
}

/// `memloop region pause` / `destroy`: every ring connection of the region is asked to move
/// to TCP (the processes' heartbeats also demote any that got onto a ring meanwhile).
pub fn demote_all_for_region(reg: &Registry, wait: f64) -> CliResult<()> {
    let ask = |reg: &Registry, ch| reg.request_switch(ch, SwitchReason::Region);
    let chans = all_tcp(reg);
    ask_and_wait(reg, Verb::Demote, chans, false, wait, ask, finished)
}

/// `memloop region resume`: the connections the pause moved to TCP come back to their rings.
pub fn promote_paused(reg: &Registry, wait: f64) -> CliResult<()> {
    let paused = |ch: &ChannelId| {
        reg.switch_word(*ch).is_ok_and(|w| {
            w.reason() == Some(SwitchReason::Region)
                && w.on_tcp(Side::Client)
                && w.on_tcp(Side::Server)
        })
    };
    let chans = all_tcp(reg).into_iter().filter(paused).collect();
    let ask = |reg: &Registry, ch| reg.request_promote(ch);
    ask_and_wait(reg, Verb::Promote, chans, false, wait, ask, promoted)
}

/// Asks each of `chans`, then (with `wait` > 0 s) watches until `done` says each is. With
/// `strict` a channel that cannot be asked is an error, else it is skipped (it closed or
/// changed since it was listed).
fn ask_and_wait(
    reg: &Registry,
    verb: Verb,
    chans: Vec<ChannelId>,
    strict: bool,
    wait: f64,
    ask: impl Fn(&Registry, ChannelId) -> Result<bool, RegistryError>,
    done: impl Fn(&Registry, ChannelId) -> bool,
) -> CliResult<()> {
    let name = verb.name();
    if !(wait.is_finite() && wait >= 0.0) {
        return Err(fail(format!("--wait {wait}: not a number of seconds")));
    }
    let mut asked = Vec::new();
    let mut already = 0;
    for ch in chans {
        match ask(reg, ch) {
            Ok(made) => {
                if made {
                    // Processes in none of our calls act on it now, not at their heartbeat.
                    memloop::channel::kick_sides(reg, ch);
                }
                already += usize::from(!made);
                asked.push(ch);
            }
            Err(_) if !strict => {}
            Err(e) => return Err(fail(format!("{name}: channel {}: {e}", id_str(ch)))),
        }
    }
    let s = |n: usize| if n == 1 { "" } else { "s" };
    print!(
        "{name}: asked {} channel{} {}",
        asked.len(),
        s(asked.len()),
        verb.goal()
    );
    if already > 0 {
        print!(" ({already} already asked before)");
    }
    println!();
    if asked.is_empty() || wait == 0.0 {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    let mut pending = asked.clone();
    loop {
        pending.retain(|&ch| !done(reg, ch));
        if pending.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    let finished = asked.len() - pending.len();
    println!(
        "{name}: {finished} of {} finished ({}) within {}s",
        asked.len(),
        verb.done(),
        wait
    );
    if pending.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = pending.iter().map(|&c| id_str(c)).collect();
    Err(fail(format!(
        "{name}: {} channel{} not finished after {}s: {} (the processes holding them \
         notice the request on their next call or heartbeat)",
        pending.len(),
        s(pending.len()),
        wait,
        ids.join(", ")
    )))
}
