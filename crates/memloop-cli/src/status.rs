//! `memloop status`: who is in a region, what they listen on, which connections it carries —
//! accelerated ones (channels on rings) and those the transparent layer left on TCP (connection
//! records, with the reason) — how many bytes went each way, and the fallback counters.
//! Live path switching shows as well: the switch counters by reason, each channel's pending
//! switch request, and for each record of a connection that switched from its ring to TCP, why,
//! how often, and what it carried on the ring before.
//!
//! A region may hold thousands of members and tens of thousands of connections, so the text
//! leads with a summary (counts by state and path, ring memory by ring size, the ring heap, the
//! counters, the top talkers) and prints a list in full only when it is short or asked for
//! (`--all`, `--list`). `--json` is always complete; its `summary` object holds the same figures.
//! Everything is read once into a [`Snapshot`] that every output renders.

use crate::error::CliResult;
use crate::region_cmd::{self, RegionArg};
use crate::units::fmt_size;
use memloop::liveness::{Liveness, HEARTBEAT_PERIOD};
use memloop::registry::{
    counter_name, ChannelInfo, ChannelState, ConnRecord, ConnTuple, EndpointInfo, EndpointKey,
    FallbackReason, MemberId, MemberInfo, MemberState, Proto, RegionParams, Registry, Side,
    SwitchReason, Usage, COUNTER_CONNS_DROPPED, COUNTER_DOORBELLS, COUNTER_FULL_FIRST,
    COUNTER_LATE_FAILED, COUNTER_PIDFD_FAILED, COUNTER_RING_BYTES, COUNTER_RING_CONNS,
    COUNTER_SEGMENTS_GIVEN_BACK, COUNTER_TCP_BYTES, COUNTER_WAKE_FALLBACK, COUNTER_WINDOWS_GROWN,
    COUNTER_WINDOWS_NO_ROOM, COUNTER_WINDOWS_SHRUNK,
};
use memloop::ring::header::{ring_bytes as ring_footprint, totals};
use memloop::Region;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};
use std::sync::atomic::Ordering::Relaxed;

/// A list of at most this many entries is printed by default; a longer one only when asked.
pub const SHORT_LIST: usize = 20;

const STATUS_HELP: &str = "\
Text output: the summary first (members by state, endpoints, channels by state, connections by \
path, ring memory by ring size, the ring heap, the fallback and switch counters, the top \
talkers), then the lists of members, endpoints, channels and connections.

A list of at most 20 entries is printed in full; a longer one is only counted (--list KIND or \
--all prints it). --list prints exactly the lists it names, --summary none.

--json and --format prometheus are always complete: they ignore --all, --list and --summary \
(--top sets the top talkers of the JSON's \"summary\" object).";

#[derive(clap::Args)]
#[command(after_help = STATUS_HELP)]
pub struct StatusArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Print one JSON object (the same as `--format json`).
    #[arg(long)]
    json: bool,
    /// Output format: text (default), json, or prometheus (text exposition format).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Text: print every list in full, however long.
    #[arg(long, conflicts_with_all = ["list", "summary"])]
    all: bool,
    /// Text: print these lists in full, however long, and no other (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST,...")]
    list: Vec<List>,
    /// Text: the summary alone, no list (not even a short one).
    #[arg(long, conflicts_with = "list")]
    summary: bool,
    /// Top talkers the summary names: connections by bytes, members by connections (0: none).
    #[arg(long, value_name = "N", default_value_t = 10)]
    top: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Prometheus,
}

/// The lists of the text output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum List {
    Members,
    Endpoints,
    Channels,
    #[value(alias = "conns")]
    Connections,
}

impl StatusArgs {
    /// Does the text output print the list `kind`, which has `n` entries?
    fn lists(&self, kind: List, n: usize) -> bool {
        if self.all {
            true
        } else if self.summary {
            false
        } else if !self.list.is_empty() {
            self.list.contains(&kind)
        } else {
            n <= SHORT_LIST
        }
    }

    /// Does the text output say how to print the lists it leaves out? (Only by default: one
    /// who chose lists or the summary knows.)
    fn hints(&self) -> bool {
        !self.all && !self.summary && self.list.is_empty()
    }
}

/// A member as shown: what the registry says plus what we can tell about its liveness.
struct Member {
    info: MemberInfo,
    same_kernel: bool,
    alive: bool,
    /// The container it runs in (podman, docker, CRI-O id, 12 characters), if another pid
    /// namespace of our kernel.
    container: Option<String>,
}

/// A channel's switch word as read once.
#[derive(Clone, Copy)]
struct Switch {
    requested: bool,
    /// The first reason asked.
    reason: Option<SwitchReason>,
    client_tcp: bool,
    server_tcp: bool,
    /// Kept on TCP for good: its socket reached a program without the library.
    pinned: bool,
    /// A process that took the socket with `pidfd_getfd` holds it too: no promotion until it
    /// lets go (or holds it alone).
    grabbed: bool,
}

/// A channel as shown: its entry plus what its rings and switch word say.
struct Chan {
    info: ChannelInfo,
    /// (client→server, server→client) bytes written, if the rings are readable.
    bytes: Option<(u64, u64)>,
    /// `None` for a decline marker or a channel gone since it was listed.
    sw: Option<Switch>,
}

impl Chan {
    fn read(reg: &Registry, info: ChannelInfo) -> Chan {
        let (bytes, sw) = if info.marker {
            (None, None)
        } else {
            (channel_bytes(reg, &info), switch_of(reg, &info))
        };
        Chan { info, bytes, sw }
    }

    /// A switched connection keeps its channel (and rings) until it closes: its bytes go by
    /// TCP meanwhile.
    fn path(&self) -> &'static str {
        match self.sw {
            Some(Switch {
                requested: true,
                client_tcp: true,
                server_tcp: true,
                ..
            }) => "tcp",
            _ => "ring",
        }
    }

    fn pinned(&self) -> bool {
        self.sw.is_some_and(|s| s.pinned)
    }

    fn total_bytes(&self) -> u64 {
        self.bytes.map_or(0, |(a, b)| a.saturating_add(b))
    }
}

/// Everything `status` shows, read once from the registry.
struct Snapshot<'r> {
    reg: &'r Registry,
    members: Vec<Member>,
    /// Index in `members` by id.
    by_id: HashMap<MemberId, usize>,
    endpoints: Vec<EndpointInfo>,
    channels: Vec<Chan>,
    conns: Vec<ConnRecord>,
    usage: Usage,
    params: RegionParams,
    counters: Vec<u64>,
}

impl<'r> Snapshot<'r> {
    fn read(region: &'r Region) -> Self {
        let reg = region.registry();
        let members = members(region);
        let by_id = members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.info.id, i))
            .collect();
        let channels = reg
            .channels()
            .into_iter()
            .map(|c| Chan::read(reg, c))
            .collect();
        Snapshot {
            reg,
            members,
            by_id,
            endpoints: reg.endpoints(),
            channels,
            conns: reg.conns(),
            usage: reg.usage(),
            params: reg.params(),
            counters: reg.counters(),
        }
    }

    fn member(&self, id: MemberId) -> Option<&Member> {
        self.by_id.get(&id).map(|&i| &self.members[i])
    }

    fn member_name(&self, id: MemberId) -> String {
        match self.member(id) {
            Some(m) => format!(
                "{} ({} pid {})",
                id_str(id.idx, id.gen),
                m.info.identity.name,
                m.info.identity.pid
            ),
            None => format!("{} (gone)", id_str(id.idx, id.gen)),
        }
    }

    fn member_pid(&self, id: MemberId) -> String {
        self.member(id)
            .map_or("?".into(), |m| m.info.identity.pid.to_string())
    }

    /// Channels that carry a connection (decline markers left out).
    fn connections(&self) -> impl Iterator<Item = &Chan> {
        self.channels.iter().filter(|c| !c.info.marker)
    }

    fn ring_bytes(&self) -> u64 {
        ring_bytes(self.reg, &self.counters)
    }
}

pub fn run(a: &StatusArgs) -> CliResult<()> {
    let region = region_cmd::open(&a.region.spec())?;
    let snap = Snapshot::read(&region);
    let format = if a.json { Format::Json } else { a.format };
    let mut out = io::BufWriter::new(io::stdout().lock());
    let written = match format {
        Format::Text => text(&mut out, &region, &snap, a),
        Format::Json => write_json(
            &mut out,
            json_head(&region, &snap, a.top),
            json_lists(&snap),
        ),
        Format::Prometheus => {
            let v = status_json(&region, &snap, a.top);
            out.write_all(crate::prometheus::render(&v).as_bytes())
        }
    };
    match written.and_then(|()| out.flush()) {
        // `memloop status | head`: the reader has all it wanted.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Same-kernel members are checked through /proc or their lock at once; for the others (VMs)
/// we can only watch their heartbeat move, which takes a little over one heartbeat period.
fn members(region: &Region) -> Vec<Member> {
    let reg = region.registry();
    let live = Liveness::for_region(region);
    let first = reg.members();
    let remote: HashSet<MemberId> = first
        .iter()
        .filter(|m| !live.judges_at_once(m))
        .map(|m| m.id)
        .collect();
    let now = if remote.is_empty() {
        first.clone()
    } else {
        std::thread::sleep(HEARTBEAT_PERIOD + HEARTBEAT_PERIOD / 2);
        reg.members()
    };
    let beats: HashMap<MemberId, u64> = first.iter().map(|m| (m.id, m.heartbeat)).collect();
    let mut containers = crate::container::Containers::default();
    now.into_iter()
        .map(|info| {
            let alive = match beats.get(&info.id) {
                Some(&old) if remote.contains(&info.id) => old != info.heartbeat,
                _ => live.is_alive(&info),
            };
            let same_kernel = live.same_kernel(&info.identity);
            let container = (same_kernel && !live.same_pid_space(&info.identity))
                .then(|| containers.of_pid_ns(info.identity.pid_ns))
                .flatten();
            Member {
                same_kernel,
                alive,
                container,
                info,
            }
        })
        .collect()
}

fn id_str(idx: u32, gen: u32) -> String {
    format!("{idx}.{gen}")
}

fn tuple_str(t: Option<&ConnTuple>) -> String {
    t.map_or("-".into(), |t| format!("{} → {}", t.client, t.server))
}

fn proto_str(p: Proto) -> &'static str {
    match p {
        Proto::Tcp => "tcp",
        Proto::Udp => "udp",
    }
}

/// A state's name as shown (`accepted`, `live`, …).
fn state_name(s: impl std::fmt::Debug) -> String {
    format!("{s:?}").to_lowercase()
}

/// (client→server, server→client) bytes written, if the rings are readable.
fn channel_bytes(reg: &Registry, c: &ChannelInfo) -> Option<(u64, u64)> {
    let rings = reg.rings(c.id).ok()?;
    Some((totals(&rings.c2s)?.0, totals(&rings.s2c)?.0))
}

fn switch_of(reg: &Registry, c: &ChannelInfo) -> Option<Switch> {
    let w = reg.switch_word(c.id).ok()?;
    Some(Switch {
        requested: w.requested(),
        reason: w.reason(),
        client_tcp: w.on_tcp(Side::Client),
        server_tcp: w.on_tcp(Side::Server),
        pinned: w.pinned(),
        grabbed: w.grabbed(),
    })
}

/// Bytes as "1 MiB" when exact, else with one decimal ("1.4 GiB"), or plain bytes.
fn fmt_amount(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift {
            if n.trailing_zeros() >= shift {
                return format!("{} {unit}", n >> shift);
            }
            return format!("{:.1} {unit}", n as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{n} B")
}

/// `part` as a percentage of `whole`, one decimal.
fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

// ---- the summary ----

/// States in the order of their state machines (every one listed in JSON, zeros included).
const MEMBER_STATES: [MemberState; 3] = [
    MemberState::Live,
    MemberState::Claiming,
    MemberState::Reclaiming,
];
const CHANNEL_STATES: [ChannelState; 5] = [
    ChannelState::Offered,
    ChannelState::Accepted,
    ChannelState::Cancelled,
    ChannelState::Declined,
    ChannelState::Reserved,
];
const ENDPOINT_KINDS: [&str; 3] = ["tcp", "udp", "native"];

fn endpoint_kind(e: &EndpointInfo) -> &'static str {
    match &e.key {
        EndpointKey::Native(_) => "native",
        EndpointKey::Socket { proto, .. } => proto_str(*proto),
    }
}

/// How many of `items` are each of `all`, by name, in the order of `all`.
fn tally<T: PartialEq>(
    all: &[T],
    name: impl Fn(&T) -> String,
    items: impl Iterator<Item = T>,
) -> Vec<(String, u64)> {
    let mut n = vec![0u64; all.len()];
    for it in items {
        if let Some(i) = all.iter().position(|a| *a == it) {
            n[i] += 1;
        }
    }
    all.iter().map(name).zip(n).collect()
}

/// Ring memory of one channel: its two rings (header and data, 64-byte aligned) in one
/// allocation of whole ring-heap segments (as `Registry::offer` makes it).
fn ring_memory(capacity: u64, segment: u64) -> u64 {
    let stride = ring_footprint(capacity).div_ceil(64) * 64;
    (2 * stride).div_ceil(segment.max(1)) * segment
}

/// Ring memory by ring size.
#[derive(Default)]
struct RingGroup {
    channels: u64,
    bytes: u64,
}

/// The figures the summary shows, counted from a [`Snapshot`].
struct Summary {
    member_states: Vec<(String, u64)>,
    members_alive: u64,
    members_other_kernel: u64,
    members_in_containers: u64,
    endpoint_kinds: Vec<(String, u64)>,
    channel_states: Vec<(String, u64)>,
    markers: u64,
    /// Connections: channels whose bytes go by their rings, channels switched to TCP, records
    /// of connections that fell back, records of connections that switched.
    on_ring: u64,
    switched_channels: u64,
    fallback_records: u64,
    switched_records: u64,
    /// By ring size, largest first.
    rings: Vec<(u64, RingGroup)>,
}

impl Summary {
    fn of(s: &Snapshot) -> Summary {
        let count = |f: &dyn Fn(&Member) -> bool| s.members.iter().filter(|m| f(m)).count() as u64;
        let on = |path| s.connections().filter(|c| c.path() == path).count() as u64;
        let switched_records = s.conns.iter().filter(|r| r.switched().is_some()).count() as u64;
        Summary {
            member_states: tally(
                &MEMBER_STATES,
                |s| state_name(s),
                s.members.iter().map(|m| m.info.state),
            ),
            members_alive: count(&|m| m.alive),
            members_other_kernel: count(&|m| !m.same_kernel),
            members_in_containers: count(&|m| m.container.is_some()),
            endpoint_kinds: tally(
                &ENDPOINT_KINDS,
                |k| k.to_string(),
                s.endpoints.iter().map(endpoint_kind),
            ),
            channel_states: tally(
                &CHANNEL_STATES,
                |s| state_name(s),
                s.connections().map(|c| c.info.state),
            ),
            markers: (s.channels.len() - s.connections().count()) as u64,
            on_ring: on("ring"),
            switched_channels: on("tcp"),
            fallback_records: s.conns.len() as u64 - switched_records,
            switched_records,
            rings: ring_groups(s),
        }
    }

    fn ring_total(&self) -> u64 {
        self.rings.iter().map(|(_, g)| g.bytes).sum()
    }
}

fn ring_groups(s: &Snapshot) -> Vec<(u64, RingGroup)> {
    let mut groups: BTreeMap<u64, RingGroup> = BTreeMap::new();
    for c in s.connections() {
        let cap = c.info.ring_capacity;
        let g = groups.entry(cap).or_default();
        g.channels += 1;
        g.bytes += ring_memory(cap, s.params.segment_size);
    }
    groups.into_iter().rev().collect()
}

/// "10 accepted, 2 offered" (zeros left out), or "none".
fn counts_line(counts: &[(String, u64)]) -> String {
    let parts: Vec<String> = counts
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

fn write_summary(out: &mut dyn Write, s: &Snapshot, sum: &Summary) -> io::Result<()> {
    writeln!(out, "\nSUMMARY")?;
    let rows = vec![
        vec!["members".into(), members_line(s, sum)],
        vec!["endpoints".into(), endpoints_line(s, sum)],
        vec!["channels".into(), channels_line(s, sum)],
        vec!["connections".into(), connections_line(s, sum)],
        vec!["ring memory".into(), ring_memory_line(sum)],
        vec!["ring heap".into(), heap_line(s)],
        vec!["pools".into(), pools_line(s)],
    ];
    print_rows(out, &rows)
}

fn members_line(s: &Snapshot, sum: &Summary) -> String {
    let total = s.members.len() as u64;
    let mut line = format!("{total}: {}", counts_line(&sum.member_states));
    if sum.members_alive < total {
        line += &format!("; {} NOT alive", total - sum.members_alive);
    } else if total > 0 {
        line += "; all alive";
    }
    if sum.members_other_kernel > 0 {
        line += &format!("; {} in other kernels", sum.members_other_kernel);
    }
    if sum.members_in_containers > 0 {
        line += &format!("; {} in containers", sum.members_in_containers);
    }
    line
}

fn endpoints_line(s: &Snapshot, sum: &Summary) -> String {
    format!(
        "{}: {}",
        s.endpoints.len(),
        counts_line(&sum.endpoint_kinds)
    )
}

fn channels_line(s: &Snapshot, sum: &Summary) -> String {
    format!(
        "{}: {}; {} decline markers",
        s.channels.len(),
        counts_line(&sum.channel_states),
        sum.markers
    )
}

fn connections_line(s: &Snapshot, sum: &Summary) -> String {
    let total = sum.on_ring + sum.switched_channels + s.conns.len() as u64;
    format!(
        "{total}: {} on rings, {} switched to TCP (channel kept), {} TCP fallback records, \
         {} records of switched connections",
        sum.on_ring, sum.switched_channels, sum.fallback_records, sum.switched_records
    )
}

fn ring_memory_line(sum: &Summary) -> String {
    if sum.rings.is_empty() {
        return "none".into();
    }
    let groups: Vec<String> = sum
        .rings
        .iter()
        .map(|(cap, g)| {
            format!(
                "{} × {} ({})",
                fmt_size(*cap),
                g.channels,
                fmt_amount(g.bytes)
            )
        })
        .collect();
    format!(
        "{}; {} in all (ring size × channels)",
        groups.join(", "),
        fmt_amount(sum.ring_total())
    )
}

/// Zero-copy pools: how many, their memory, and how many are closing (held after their
/// owner let go).
fn pools_line(s: &Snapshot) -> String {
    let pools = s.reg.pools();
    if pools.is_empty() {
        return "none".into();
    }
    let bytes: u64 = pools.iter().map(|p| p.data_len).sum();
    let closing = pools.iter().filter(|p| p.closing).count();
    let loans: u64 = pools.iter().map(|p| p.loans).sum();
    format!(
        "{} ({} closing), {} of buffers, {loans} loans so far",
        pools.len(),
        closing,
        fmt_amount(bytes)
    )
}

fn pools_json(s: &Snapshot) -> Value {
    let pools: Vec<Value> = s
        .reg
        .pools()
        .iter()
        .map(|p| {
            json!({ "idx": p.id.idx, "gen": p.id.gen,
                    "owner": id_str(p.owner.idx, p.owner.gen),
                    "buffer_size": p.buf_size, "buffers": p.buffers, "bytes": p.data_len,
                    "closing": p.closing, "loans": p.loans, "scans": p.scans })
        })
        .collect();
    json!(pools)
}

fn heap_line(s: &Snapshot) -> String {
    let (u, seg) = (&s.usage, s.params.segment_size);
    let (used, total) = (u.segments_used * seg, u.segments_total * seg);
    format!(
        "{} of {} in use ({}), {}/{} segments of {}",
        fmt_amount(used),
        fmt_amount(total),
        percent(used, total),
        u.segments_used,
        u.segments_total,
        fmt_size(seg)
    )
}

// ---- top talkers ----

/// A connection among the top talkers: a channel (bytes from its rings) or a record (over TCP).
#[derive(Clone, Copy)]
enum Talker<'s> {
    Chan(&'s Chan),
    Record(&'s ConnRecord),
}

impl Talker<'_> {
    /// (sent, received): a channel's from its client's view, a record's from its process's.
    fn bytes(&self) -> (u64, u64) {
        match self {
            Talker::Chan(c) => c.bytes.unwrap_or((0, 0)),
            Talker::Record(r) => (r.bytes_sent, r.bytes_received),
        }
    }

    fn total(&self) -> u64 {
        let (sent, received) = self.bytes();
        sent.saturating_add(received)
    }

    fn tuple(&self) -> Option<&ConnTuple> {
        match self {
            Talker::Chan(c) => c.info.tuple.as_ref(),
            Talker::Record(r) => Some(&r.tuple),
        }
    }
}

/// The `n` connections that carried the most bytes, most first.
fn top_connections<'s>(s: &'s Snapshot, n: usize) -> Vec<Talker<'s>> {
    let chans = s.connections().map(Talker::Chan);
    let mut all: Vec<Talker> = chans.chain(s.conns.iter().map(Talker::Record)).collect();
    all.sort_by_key(|t| std::cmp::Reverse(t.total()));
    all.truncate(n);
    all
}

/// A member's connections: channel ends it holds, records it made, and their bytes.
#[derive(Default)]
struct Load {
    ring: u64,
    tcp: u64,
    bytes: u64,
}

/// The `n` members with the most connections, most first (ties: more bytes first).
fn top_members(s: &Snapshot, n: usize) -> Vec<(MemberId, Load)> {
    let mut load: HashMap<MemberId, Load> = HashMap::new();
    for c in s.connections() {
        let ends = [
            Some(c.info.client),
            c.info.server.filter(|&m| m != c.info.client),
        ];
        for m in ends.into_iter().flatten() {
            let l = load.entry(m).or_default();
            l.ring += 1;
            l.bytes = l.bytes.saturating_add(c.total_bytes());
        }
    }
    for r in &s.conns {
        let l = load.entry(r.owner).or_default();
        l.tcp += 1;
        l.bytes = l
            .bytes
            .saturating_add(r.bytes_sent.saturating_add(r.bytes_received));
    }
    let mut all: Vec<(MemberId, Load)> = load.into_iter().collect();
    all.sort_by_key(|(id, l)| (std::cmp::Reverse((l.ring + l.tcp, l.bytes)), id.idx));
    all.truncate(n);
    all
}

fn write_top(out: &mut dyn Write, s: &Snapshot, n: usize) -> io::Result<()> {
    let total = s.connections().count() + s.conns.len();
    if n == 0 || total == 0 {
        return Ok(());
    }
    let top = top_connections(s, n);
    writeln!(out, "\nTOP CONNECTIONS by bytes ({} of {total})", top.len())?;
    let mut rows = vec![row(&["path", "tuple", "pid", "sent", "received", "total"])];
    rows.extend(top.iter().map(|t| talker_row(s, t)));
    print_rows(out, &rows)?;
    let members = top_members(s, n);
    writeln!(
        out,
        "\nTOP MEMBERS by connections ({} of {})",
        members.len(),
        s.members.len()
    )?;
    let mut rows = vec![row(&[
        "member",
        "connections",
        "on rings",
        "on tcp",
        "bytes",
    ])];
    rows.extend(members.iter().map(|(id, l)| {
        vec![
            s.member_name(*id),
            (l.ring + l.tcp).to_string(),
            l.ring.to_string(),
            l.tcp.to_string(),
            fmt_amount(l.bytes),
        ]
    }));
    print_rows(out, &rows)
}

fn talker_row(s: &Snapshot, t: &Talker) -> Vec<String> {
    let (path, pid) = match t {
        Talker::Chan(c) => {
            let server = c.info.server.map_or("-".into(), |m| s.member_pid(m));
            let path = if c.path() == "tcp" {
                "ring→tcp"
            } else {
                "ring"
            };
            (path, format!("{}/{server}", s.member_pid(c.info.client)))
        }
        Talker::Record(r) => (proto_str(r.proto), r.pid.to_string()),
    };
    let (sent, received) = t.bytes();
    vec![
        path.into(),
        tuple_str(t.tuple()),
        pid,
        fmt_amount(sent),
        fmt_amount(received),
        fmt_amount(t.total()),
    ]
}

// ---- the text output ----

fn text(out: &mut dyn Write, region: &Region, s: &Snapshot, a: &StatusArgs) -> io::Result<()> {
    let reg = s.reg;
    writeln!(
        out,
        "region {} ({}), generation {}, {}",
        region.path().display(),
        fmt_size(region.size()),
        reg.generation(),
        reg.state().name()
    )?;
    writeln!(
        out,
        "usage: {}",
        region_cmd::usage_line(&s.usage, &s.params)
    )?;
    writeln!(
        out,
        "connection records: {}/{}",
        s.usage.conns, s.params.max_conns
    )?;
    write_summary(out, s, &Summary::of(s))?;
    write_counters(out, &s.counters)?;
    write_switches(out, &s.counters)?;
    writeln!(
        out,
        "\nRING BYTES carried by every channel so far: {}",
        s.ring_bytes()
    )?;
    write_top(out, s, a.top)?;
    if let Some(v) = pipe_service(region) {
        write!(out, "\n{}", crate::pipe_cmd::render(&v))?;
    }
    write_links(out, reg)?;
    crate::blk_cmd::write_blk(out, region.path())?;
    write_lists(out, s, a)
}

/// Links (`memloop link`): each side's device, carrier and counters.
fn write_links(out: &mut dyn Write, reg: &Registry) -> io::Result<()> {
    let rows = crate::link_cmd::links_rows(reg);
    if rows.is_empty() {
        return Ok(());
    }
    writeln!(out, "\nLINKS ({})", rows.len().div_ceil(2))?;
    let mut all = vec![row(&crate::link_cmd::LINK_COLUMNS)];
    all.extend(rows);
    print_rows(out, &all)
}

/// The statistics of the region's pipe service, if one serves (`memloop pipe serve`).
fn pipe_service(region: &Region) -> Option<Value> {
    let socket = memloop::region::wake_dir(region.path()).join("pipe");
    if !socket.exists() {
        return None;
    }
    let mut c = memloop_pipe::client::Client::connect(&socket, Some("memloop-status"), 1).ok()?;
    c.set_timeout(Some(std::time::Duration::from_secs(2)))
        .ok()?;
    serde_json::from_str(&c.stats().ok()?).ok()
}

fn write_lists(out: &mut dyn Write, s: &Snapshot, a: &StatusArgs) -> io::Result<()> {
    let n_conns = s.connections().count() + s.conns.len();
    let lists: [(List, &str, usize, ListFn); 4] = [
        (List::Members, "MEMBERS", s.members.len(), write_members),
        (
            List::Endpoints,
            "ENDPOINTS",
            s.endpoints.len(),
            write_endpoints,
        ),
        (List::Channels, "CHANNELS", s.channels.len(), write_channels),
        (List::Connections, "CONNECTIONS", n_conns, write_connections),
    ];
    for (kind, title, n, write) in lists {
        if a.lists(kind, n) {
            writeln!(out, "\n{title} ({n})")?;
            write(out, s)?;
        } else if a.hints() {
            let name = format!("{kind:?}").to_lowercase();
            writeln!(
                out,
                "\n{title} ({n}): not listed (more than {SHORT_LIST}; --list {name} or --all)"
            )?;
        }
    }
    Ok(())
}

type ListFn = fn(&mut dyn Write, &Snapshot) -> io::Result<()>;

fn write_members(out: &mut dyn Write, s: &Snapshot) -> io::Result<()> {
    let mut rows = vec![row(&[
        "id",
        "pid",
        "name",
        "container",
        "kernel",
        "alive",
        "heartbeat",
        "state",
    ])];
    rows.extend(s.members.iter().map(|m| {
        let i = &m.info;
        vec![
            id_str(i.id.idx, i.id.gen),
            i.identity.pid.to_string(),
            i.identity.name.clone(),
            m.container.clone().unwrap_or_else(|| "-".into()),
            (if m.same_kernel { "same" } else { "other" }).into(),
            (if m.alive { "yes" } else { "NO" }).into(),
            match (i.beatless(), i.locked()) {
                (true, _) => "none (lock)".into(),
                (false, true) => format!("{} (+ lock)", i.beats()),
                (false, false) => i.beats().to_string(),
            },
            state_name(i.state),
        ]
    }));
    print_rows(out, &rows)
}

fn write_endpoints(out: &mut dyn Write, s: &Snapshot) -> io::Result<()> {
    let mut rows = vec![row(&["id", "key", "owner", "dropped"])];
    rows.extend(s.endpoints.iter().map(|e| {
        vec![
            id_str(e.id.idx, e.id.gen),
            e.key.to_string(),
            s.member_name(e.owner),
            dropped_at(s.reg, e).map_or("-".into(), |n| n.to_string()),
        ]
    }));
    print_rows(out, &rows)
}

/// Datagrams dropped at a UDP endpoint because its ring was full (`None` for other kinds).
fn dropped_at(reg: &Registry, e: &EndpointInfo) -> Option<u32> {
    let udp = matches!(
        e.key,
        memloop::registry::EndpointKey::Socket {
            proto: memloop::registry::Proto::Udp,
            ..
        }
    );
    udp.then(|| reg.endpoint_dropped(e.id).ok())
        .flatten()
        .map(|w| w.load(std::sync::atomic::Ordering::Relaxed))
}

fn bytes_cells(c: &Chan) -> (String, String) {
    c.bytes.map_or(("-".into(), "-".into()), |(a, b)| {
        (a.to_string(), b.to_string())
    })
}

fn write_channels(out: &mut dyn Write, s: &Snapshot) -> io::Result<()> {
    let mut rows = vec![row(&[
        "id",
        "state",
        "kind",
        "client",
        "server",
        "ring",
        "bytes c→s",
        "bytes s→c",
        "flags",
    ])];
    rows.extend(s.channels.iter().map(|c| {
        let (i, (up, down)) = (&c.info, bytes_cells(c));
        vec![
            id_str(i.id.idx, i.id.gen),
            state_name(i.state),
            i.kind.map_or("-".into(), |k| k.to_string()),
            s.member_name(i.client),
            i.server.map_or("-".into(), |m| s.member_name(m)),
            if i.marker {
                "-".into()
            } else {
                fmt_size(i.ring_capacity)
            },
            up,
            down,
            flags(c),
        ]
    }));
    print_rows(out, &rows)
}

/// Every connection: accelerated ones (channels, bytes from the client's view) and those left on
/// the kernel's path (records, bytes from the recording process's view).
fn write_connections(out: &mut dyn Write, s: &Snapshot) -> io::Result<()> {
    let mut rows = vec![row(&[
        "path",
        "tuple",
        "pid",
        "sent",
        "received",
        "ring bytes before switch",
        "state / reason",
    ])];
    rows.extend(s.connections().map(|c| ring_conn_row(s, c)));
    rows.extend(s.conns.iter().map(record_row));
    print_rows(out, &rows)
}

fn ring_conn_row(s: &Snapshot, c: &Chan) -> Vec<String> {
    let (up, down) = bytes_cells(c);
    let server = c.info.server.map_or("-".into(), |m| s.member_pid(m));
    let mut state = state_name(c.info.state);
    if let Some(Switch {
        requested: true,
        reason,
        ..
    }) = c.sw
    {
        state += &format!(
            ", switch requested ({})",
            reason.map_or("unknown reason", |r| r.name())
        );
    }
    vec![
        "ring".into(),
        tuple_str(c.info.tuple.as_ref()),
        format!("{}/{}", s.member_pid(c.info.client), server),
        up,
        down,
        "-".into(),
        state,
    ]
}

fn record_row(r: &ConnRecord) -> Vec<String> {
    let (ring, reason) = match r.switched() {
        Some(_) => (
            r.ring_bytes.to_string(),
            format!(
                "{}, {} switch{}",
                r.reason,
                r.switches,
                if r.switches == 1 { "" } else { "es" }
            ),
        ),
        None => ("-".into(), r.reason.to_string()),
    };
    vec![
        proto_str(r.proto).into(),
        tuple_str(Some(&r.tuple)),
        r.pid.to_string(),
        r.bytes_sent.to_string(),
        r.bytes_received.to_string(),
        ring,
        reason,
    ]
}

fn flags(c: &Chan) -> String {
    let (i, sw) = (&c.info, c.sw);
    let f = [
        (i.marker, "decline-marker"),
        (i.client_closed, "client-closed"),
        (i.server_closed, "server-closed"),
        (i.client_dead, "client-dead"),
        (i.server_dead, "server-dead"),
        (sw.is_some_and(|s| s.requested), "switch-requested"),
        (sw.is_some_and(|s| s.client_tcp), "client-on-tcp"),
        (sw.is_some_and(|s| s.server_tcp), "server-on-tcp"),
        (c.pinned(), "pinned-to-tcp"),
        (sw.is_some_and(|s| s.grabbed), "held-by-pidfd-getfd"),
    ];
    let set: Vec<&str> = f.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect();
    if set.is_empty() {
        "-".into()
    } else {
        set.join(",")
    }
}

fn write_counters(out: &mut dyn Write, counters: &[u64]) -> io::Result<()> {
    writeln!(
        out,
        "\nFALLBACKS (connections left on TCP since the region was created; zeros omitted)"
    )?;
    // (Switches, refused grabs and doorbells have their own lines; ring and TCP totals and the
    // segments given back are no fallbacks.)
    let not_fallbacks: HashSet<usize> = SwitchReason::ALL
        .iter()
        .map(|r| r.counter_index())
        .chain([
            COUNTER_TCP_BYTES,
            COUNTER_PIDFD_FAILED,
            COUNTER_WAKE_FALLBACK,
            COUNTER_DOORBELLS,
            COUNTER_LATE_FAILED,
            COUNTER_SEGMENTS_GIVEN_BACK,
            COUNTER_RING_CONNS,
            COUNTER_RING_BYTES,
        ])
        .chain(COUNTER_FULL_FIRST..=COUNTER_WINDOWS_NO_ROOM)
        .collect();
    let nonzero: Vec<String> = counters
        .iter()
        .enumerate()
        .filter(|(i, v)| **v > 0 && !not_fallbacks.contains(i))
        .map(|(i, v)| format!("  {}: {v}", counter_label(i)))
        .collect();
    if nonzero.is_empty() {
        writeln!(out, "  none")?;
    }
    for line in nonzero {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// One line of switch counts by reason, only when a connection ever switched path; then the
/// other event counters that are not zero.
fn write_switches(out: &mut dyn Write, counters: &[u64]) -> io::Result<()> {
    let nonzero: Vec<String> = SwitchReason::ALL
        .iter()
        .filter_map(|r| {
            let n = counters.get(r.counter_index()).copied().unwrap_or(0);
            (n > 0).then(|| format!("{}: {n}", r.name()))
        })
        .collect();
    if !nonzero.is_empty() {
        writeln!(
            out,
            "\nSWITCHES (connections that changed path, by reason): {}",
            nonzero.join(", ")
        )?;
    }
    for (i, what) in [
        (COUNTER_LATE_FAILED, "late-ring attempts that stayed on TCP"),
        (
            COUNTER_PIDFD_FAILED,
            "pidfd_getfd calls refused (the connection could not leave its ring)",
        ),
        (COUNTER_RING_CONNS, "connections that took a ring"),
        (
            COUNTER_DOORBELLS,
            "doorbells sent over TCP to wake sleeping peers",
        ),
        (
            COUNTER_WAKE_FALLBACK,
            "wake-ups sent over TCP (the sleeper's wake socket was out of reach)",
        ),
        (COUNTER_FULL_FIRST, "times the member table was full"),
        (COUNTER_FULL_FIRST + 1, "times the endpoint table was full"),
        (COUNTER_FULL_FIRST + 2, "times the channel table was full"),
        (COUNTER_FULL_FIRST + 3, "times the ring heap was full"),
        (
            COUNTER_WINDOWS_GROWN,
            "ring windows grown (busy connections)",
        ),
        (
            COUNTER_WINDOWS_SHRUNK,
            "ring windows shrunk (idle connections)",
        ),
        (
            COUNTER_WINDOWS_NO_ROOM,
            "ring windows not grown (no memory in the file system behind the region)",
        ),
        (
            COUNTER_SEGMENTS_GIVEN_BACK,
            "ring-heap segments whose memory went back to the system",
        ),
    ] {
        if let Some(&n @ 1..) = counters.get(i) {
            writeln!(out, "{what}: {n}")?;
        }
    }
    Ok(())
}

/// A reason's name and phrase, another named counter's name, or the bare index.
fn counter_label(i: usize) -> String {
    match (FallbackReason::ALL.get(i), counter_name(i)) {
        (Some(r), _) => format!("{} ({r})", r.name()),
        (None, Some(name)) => name.to_string(),
        (None, None) => format!("#{i}"),
    }
}

fn row(cells: &[&str]) -> Vec<String> {
    cells.iter().map(|s| s.to_string()).collect()
}

fn print_rows(out: &mut dyn Write, rows: &[Vec<String>]) -> io::Result<()> {
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len))
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut line = String::new();
    for r in rows {
        line.clear();
        for (s, w) in r.iter().zip(&widths) {
            line += &format!("{s:<w$}  ");
        }
        writeln!(out, "  {}", line.trim_end())?;
    }
    Ok(())
}

// ---- JSON (and through it, Prometheus) ----

/// The lists of the JSON object, each entry made when it is written.
type Lists<'s> = Vec<(&'static str, Box<dyn Iterator<Item = Value> + 's>)>;

fn json_lists<'s>(s: &'s Snapshot) -> Lists<'s> {
    let reg = s.reg;
    vec![
        ("members", Box::new(s.members.iter().map(member_json))),
        (
            "endpoints",
            Box::new(s.endpoints.iter().map(move |e| endpoint_json(reg, e))),
        ),
        (
            "channels",
            Box::new(s.channels.iter().map(move |c| channel_json(reg, c))),
        ),
        ("connections", Box::new(s.conns.iter().map(conn_json))),
    ]
}

/// The whole JSON object (what the Prometheus exposition is rendered from).
fn status_json(region: &Region, s: &Snapshot, top: usize) -> Value {
    let mut head = json_head(region, s, top);
    for (key, items) in json_lists(s) {
        head.insert(key.into(), items.collect());
    }
    Value::Object(head)
}

/// The JSON object but its lists.
fn json_head(region: &Region, s: &Snapshot, top: usize) -> Map<String, Value> {
    let (reg, c) = (s.reg, &s.counters);
    let (mut params_j, mut usage_j) = (
        region_cmd::params_json(&s.params),
        region_cmd::usage_json(&s.usage),
    );
    params_j["max_conns"] = s.params.max_conns.into();
    usage_j["conns"] = s.usage.conns.into();
    let mut head = json!({
        "region": { "path": region.path(), "size": region.size(), "generation": reg.generation(),
                    "state": reg.state().name(), "params": params_j },
        "usage": usage_j,
        "summary": summary_json(s, top),
        // The region's pipe service (issue 20): per-tenant bytes, CPU and waiting time.
        "pipe": pipe_service(region),
        // Links (issue 18): both halves of each, with their devices and counters.
        "links": crate::link_cmd::links_json(reg),
        // Block exports and attachments (MMBlk): their services' stats files.
        "blk": crate::blk_cmd::blk_json(region.path()),
        "fallbacks": fallbacks_json(c),
        "switches": switches_json(c),
        // Late-ring attempts that left their connection on TCP.
        "late_failed": counter(c, COUNTER_LATE_FAILED),
        // pidfd_getfd calls refused: the connection could not leave its ring in time.
        "pidfd_failed": counter(c, COUNTER_PIDFD_FAILED),
        // Wake-ups that went over TCP: the sleeper's wake socket was out of reach.
        "wake_fallback": counter(c, COUNTER_WAKE_FALLBACK),
        // Doorbell bytes sent over TCP to wake sleeping peers.
        "doorbells": counter(c, COUNTER_DOORBELLS),
        "conn_records_dropped": counter(c, COUNTER_CONNS_DROPPED),
        // Times a table was found full (a join, a listen, an offer that could not be made).
        "tables_full": {
            "members": counter(c, COUNTER_FULL_FIRST),
            "endpoints": counter(c, COUNTER_FULL_FIRST + 1),
            "channels": counter(c, COUNTER_FULL_FIRST + 2),
            "ring_memory": counter(c, COUNTER_FULL_FIRST + 3),
        },
        // Stream-ring windows: grown while busy, shrunk when idle, not grown for want of
        // memory; and ring-heap segments whose memory went back to the system.
        "windows": {
            "grown": counter(c, COUNTER_WINDOWS_GROWN),
            "shrunk": counter(c, COUNTER_WINDOWS_SHRUNK),
            "no_room": counter(c, COUNTER_WINDOWS_NO_ROOM),
        },
        "segments_given_back": counter(c, COUNTER_SEGMENTS_GIVEN_BACK),
        "ring_connections": counter(c, COUNTER_RING_CONNS),
        "ring_bytes": s.ring_bytes(),
        // TCP bytes of recorded connections, live and closed (killed ones too).
        "tcp_bytes": reg.tcp_bytes(),
    });
    head.as_object_mut().map(std::mem::take).unwrap_or_default()
}

/// `--json`: what `serde_json::to_writer_pretty` writes for the whole object, but each list
/// entry is made, written and freed in turn: with thousands of entries, a tree of them all
/// cost more to build and free than to print.
fn write_json(out: &mut dyn Write, mut head: Map<String, Value>, lists: Lists) -> io::Result<()> {
    let mut lists: HashMap<&str, _> = lists.into_iter().collect();
    for key in lists.keys() {
        head.insert(key.to_string(), Value::Null); // keeps the keys' order
    }
    let mut buf = Vec::new();
    for (i, (key, v)) in head.iter().enumerate() {
        out.write_all(if i == 0 { b"{\n  " } else { b",\n  " })?;
        serde_json::to_writer(&mut *out, key)?;
        out.write_all(b": ")?;
        match lists.remove(key.as_str()) {
            Some(items) => write_array(out, items, &mut buf)?,
            None => write_nested(out, v, 1, &mut buf)?,
        }
    }
    out.write_all(if head.is_empty() { b"{}\n" } else { b"\n}\n" })
}

/// A list as the value of a top-level key.
fn write_array(
    out: &mut dyn Write,
    items: impl Iterator<Item = Value>,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    let mut empty = true;
    for v in items {
        out.write_all(if empty { b"[\n    " } else { b",\n    " })?;
        write_nested(out, &v, 2, buf)?;
        empty = false;
    }
    out.write_all(if empty { &b"[]"[..] } else { &b"\n  ]"[..] })
}

const PAD: &[u8] = b"        ";

/// `v` pretty-printed `depth` levels deep: its lines after the first indented.
fn write_nested(out: &mut dyn Write, v: &Value, depth: usize, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.clear();
    serde_json::to_writer_pretty(&mut *buf, v)?;
    for (i, line) in buf.split(|&b| b == b'\n').enumerate() {
        if i > 0 {
            out.write_all(b"\n")?;
            out.write_all(&PAD[..(2 * depth).min(PAD.len())])?;
        }
        out.write_all(line)?;
    }
    Ok(())
}

fn counter(counters: &[u64], i: usize) -> u64 {
    counters.get(i).copied().unwrap_or(0)
}

fn idgen(idx: u32, gen: u32) -> Value {
    json!({ "idx": idx, "gen": gen })
}

/// Counts by name, every name present (zeros included: stable keys for scripts).
fn counts_json(counts: &[(String, u64)]) -> Value {
    Value::Object(
        counts
            .iter()
            .map(|(k, n)| (k.clone(), (*n).into()))
            .collect(),
    )
}

/// The figures of the text summary.
fn summary_json(s: &Snapshot, top: usize) -> Value {
    let sum = Summary::of(s);
    let total = s.members.len() as u64;
    json!({
        "members": { "total": total, "by_state": counts_json(&sum.member_states),
                     "alive": sum.members_alive, "not_alive": total - sum.members_alive,
                     "other_kernel": sum.members_other_kernel,
                     "in_containers": sum.members_in_containers },
        "endpoints": { "total": s.endpoints.len(), "by_kind": counts_json(&sum.endpoint_kinds) },
        // `by_state`: channels that carry a connection; decline markers apart.
        "channels": { "total": s.channels.len(), "by_state": counts_json(&sum.channel_states),
                      "decline_markers": sum.markers },
        "connections": { "total": sum.on_ring + sum.switched_channels + s.conns.len() as u64,
                         "ring": sum.on_ring, "switched_to_tcp": sum.switched_channels,
                         "fallback_records": sum.fallback_records,
                         "switched_records": sum.switched_records },
        "ring_memory": ring_memory_json(&sum),
        "heap": heap_json(s),
        "pools": pools_json(s),
        "top_connections": top_connections(s, top).iter().map(talker_json).collect::<Vec<_>>(),
        "top_members": top_members(s, top).iter().map(load_json).collect::<Vec<_>>(),
    })
}

fn ring_memory_json(sum: &Summary) -> Value {
    let groups: Vec<Value> = sum
        .rings
        .iter()
        .map(|(cap, g)| json!({ "ring_size": cap, "channels": g.channels, "bytes": g.bytes }))
        .collect();
    json!({ "by_ring_size": groups, "total": sum.ring_total() })
}

fn heap_json(s: &Snapshot) -> Value {
    let (u, seg) = (&s.usage, s.params.segment_size);
    json!({ "used": u.segments_used * seg, "total": u.segments_total * seg,
            "segment_size": seg, "segments_used": u.segments_used,
            "segments_total": u.segments_total })
}

/// A top talker: which entry (`channel` or `connection` record, by idx/gen), path and bytes.
fn talker_json(t: &Talker) -> Value {
    let (entry, idx, gen, path) = match t {
        Talker::Chan(c) => ("channel", c.info.id.idx, c.info.id.gen, c.path()),
        Talker::Record(r) => ("connection", r.id.idx, r.id.gen, proto_str(r.proto)),
    };
    let (sent, received) = t.bytes();
    json!({ "entry": entry, "idx": idx, "gen": gen, "path": path,
            "tuple": t.tuple().map(tuple_json), "sent": sent, "received": received,
            "bytes": t.total() })
}

fn load_json((id, l): &(MemberId, Load)) -> Value {
    json!({ "idx": id.idx, "gen": id.gen, "connections": l.ring + l.tcp, "ring": l.ring,
            "tcp": l.tcp, "bytes": l.bytes })
}

fn member_json(m: &Member) -> Value {
    let i = &m.info;
    json!({
        "idx": i.id.idx, "gen": i.id.gen, "pid": i.identity.pid, "name": i.identity.name,
        "container": m.container,
        "same_kernel": m.same_kernel, "alive": m.alive, "heartbeat": i.beats(),
        "beating": !i.beatless(), "lock": i.locked(),
        "state": state_name(i.state),
        "addresses": i.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    })
}

fn endpoint_json(reg: &Registry, e: &EndpointInfo) -> Value {
    json!({ "idx": e.id.idx, "gen": e.id.gen, "key": e.key.to_string(),
            "owner": idgen(e.owner.idx, e.owner.gen), "dropped": dropped_at(reg, e) })
}

fn channel_json(reg: &Registry, ch: &Chan) -> Value {
    let (c, bytes, sw) = (&ch.info, ch.bytes, ch.sw);
    json!({
        "idx": c.id.idx, "gen": c.id.gen, "state": state_name(c.state),
        "client": idgen(c.client.idx, c.client.gen),
        "server": c.server.map(|s| idgen(s.idx, s.gen)),
        "kind": c.kind.map(|k| k.name()), "kind_code": c.kind.map(|k| k.code()),
        "ring_capacity": c.ring_capacity,
        "bytes_c2s": bytes.map(|b| b.0), "bytes_s2c": bytes.map(|b| b.1),
        "client_closed": c.client_closed, "server_closed": c.server_closed,
        "client_dead": c.client_dead, "server_dead": c.server_dead,
        "path": ch.path(), "marker": c.marker, "tuple": c.tuple.as_ref().map(tuple_json),
        "doorbells": doorbells_json(reg, c),
        "switch_requested": sw.map(|s| s.requested),
        "switch_reason": sw.and_then(|s| s.reason).map(|r| r.name()),
        "on_tcp": sw.map(|s| json!({ "client": s.client_tcp, "server": s.server_tcp })),
        "pinned": ch.pinned(),
    })
}

/// Doorbell bytes each side sent and read on its kernel socket (what live path switching will
/// reconcile); null for a channel without side words (a marker, or one being torn down).
fn doorbells_json(reg: &Registry, c: &ChannelInfo) -> Value {
    if c.marker {
        return Value::Null;
    }
    let side = |s: Side| {
        let w = reg.side_words(c.id, s).ok()?;
        Some(json!({
            "sent": w.doorbells_sent.load(Relaxed),
            "read": w.doorbells_read.load(Relaxed),
        }))
    };
    match (side(Side::Client), side(Side::Server)) {
        (Some(client), Some(server)) => json!({ "client": client, "server": server }),
        _ => Value::Null,
    }
}

fn tuple_json(t: &ConnTuple) -> Value {
    json!({ "client": t.client.to_string(), "server": t.server.to_string() })
}

fn conn_json(r: &ConnRecord) -> Value {
    json!({
        "idx": r.id.idx, "gen": r.id.gen, "path": proto_str(r.proto), "tuple": tuple_json(&r.tuple),
        "pid": r.pid, "owner": idgen(r.owner.idx, r.owner.gen),
        "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
        "reason": r.reason.name(), "reason_text": r.reason.to_string(),
        "reason_code": r.fallback().map(|f| f.as_code()),
        "fallback": r.fallback().map(|f| f.name()),
        "switched": r.switched().map(|s| s.name()),
        "switches": r.switches, "ring_bytes": r.ring_bytes,
        "tcp_bytes_sent": r.bytes_sent, "tcp_bytes_received": r.bytes_received,
    })
}

/// Every switch reason by name, zeros included (like `fallbacks`).
fn switches_json(counters: &[u64]) -> Value {
    by_name(
        counters,
        SwitchReason::ALL
            .iter()
            .map(|r| (r.name(), r.counter_index())),
    )
}

/// Every fallback reason by name, zeros included (a stable set of keys for scripts).
fn fallbacks_json(counters: &[u64]) -> Value {
    by_name(
        counters,
        FallbackReason::ALL
            .iter()
            .map(|r| (r.name(), r.counter_index())),
    )
}

/// A JSON object of header counters by name.
fn by_name<'a>(counters: &[u64], names: impl Iterator<Item = (&'a str, usize)>) -> Value {
    let m: serde_json::Map<String, Value> = names
        .map(|(name, i)| (name.to_string(), counter(counters, i).into()))
        .collect();
    Value::Object(m)
}

/// Bytes the region's rings have carried: freed channels (the counter, added once when a
/// channel is freed, even if its processes died without closing) plus the channels still
/// allocated, read from their rings — so the figure is current while connections live.
fn ring_bytes(reg: &Registry, counters: &[u64]) -> u64 {
    counter(counters, COUNTER_RING_BYTES).saturating_add(reg.live_ring_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        status: StatusArgs,
    }

    fn args(argv: &[&str]) -> Result<StatusArgs, clap::Error> {
        let argv = std::iter::once("status").chain(argv.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.status)
    }

    #[test]
    fn short_lists_by_default_long_ones_when_asked() {
        let a = args(&[]).unwrap();
        assert!(a.lists(List::Members, SHORT_LIST));
        assert!(!a.lists(List::Channels, SHORT_LIST + 1));
        let a = args(&["--all"]).unwrap();
        assert!(a.lists(List::Channels, 100_000));
        let a = args(&["--list", "channels,conns"]).unwrap();
        assert!(a.lists(List::Channels, 100_000) && a.lists(List::Connections, 100_000));
        assert!(
            !a.lists(List::Members, 1),
            "--list names exactly the lists it prints"
        );
        let a = args(&["--summary"]).unwrap();
        assert!(!a.lists(List::Members, 1));
        assert!(args(&["--all", "--list", "members"]).is_err());
        assert!(args(&["--summary", "--list", "members"]).is_err());
        assert!(args(&["--list", "bogus"]).is_err());
    }

    #[test]
    fn the_help_names_the_short_list_length() {
        assert!(STATUS_HELP.contains(&format!("at most {SHORT_LIST} entries")));
    }

    #[test]
    fn amounts_and_ring_memory() {
        assert_eq!(fmt_amount(1 << 20), "1 MiB");
        assert_eq!(fmt_amount(3 << 29), "1.5 GiB");
        assert_eq!(fmt_amount(100), "100 B");
        assert_eq!(percent(1, 4), "25.0%");
        assert_eq!(percent(1, 0), "-");
        // Two rings of 64 KiB plus their 256-byte headers, in 4 KiB segments: 33 segments.
        assert_eq!(ring_memory(64 << 10, 4096), 33 * 4096);
        // In 64 KiB segments: 3.
        assert_eq!(ring_memory(64 << 10, 64 << 10), 3 * (64 << 10));
    }

    #[test]
    fn tallies_keep_every_name_in_order() {
        let t = tally(
            &CHANNEL_STATES,
            |s| state_name(s),
            [
                ChannelState::Accepted,
                ChannelState::Accepted,
                ChannelState::Offered,
            ]
            .into_iter(),
        );
        assert_eq!(t[0], ("offered".into(), 1));
        assert_eq!(t[1], ("accepted".into(), 2));
        assert_eq!(t.len(), CHANNEL_STATES.len());
        assert_eq!(counts_line(&t), "1 offered, 2 accepted");
        assert_eq!(counts_line(&[]), "none");
    }

    #[test]
    fn streamed_json_is_what_the_whole_tree_prints() {
        let head = json!({ "b": { "x": [1, 2], "y": {} }, "z": "q\nr", "a": [] });
        let lists = || -> Lists<'static> {
            vec![
                (
                    "c",
                    Box::new((0..3).map(|i| json!({ "i": i, "n": [i, { "m": null }] }))),
                ),
                ("e", Box::new(std::iter::empty())),
            ]
        };
        let mut whole = head.as_object().unwrap().clone();
        for (k, items) in lists() {
            whole.insert(k.into(), items.collect());
        }
        let mut out = Vec::new();
        write_json(&mut out, head.as_object().unwrap().clone(), lists()).unwrap();
        let want = serde_json::to_string_pretty(&Value::Object(whole)).unwrap() + "\n";
        assert_eq!(String::from_utf8(out).unwrap(), want);
        let mut out = Vec::new();
        write_json(&mut out, Map::new(), Vec::new()).unwrap();
        assert_eq!(out, b"{}\n");
    }

    #[test]
    fn rows_are_aligned_and_trimmed() {
        let mut out = Vec::new();
        print_rows(&mut out, &[row(&["a", "bb"]), row(&["ccc", "d"])]).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "  a    bb\n  ccc  d\n");
    }
}
