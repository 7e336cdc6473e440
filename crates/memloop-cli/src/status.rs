//! `memloop status`: who is in a region, what they listen on, which connections it carries —
//! accelerated ones (channels on rings) and those the transparent layer left on TCP (connection
//! records, with the reason) — how many bytes went each way, and the fallback counters.
//! Live path switching shows as well: the switch counters by reason, each channel's pending
//! switch request, and for each record of a connection that switched from its ring to TCP, why,
//! how often, and what it carried on the ring before.

use crate::error::CliResult;
use crate::region_cmd::{self, RegionArg};
use crate::units::fmt_size;
use memloop::liveness::{Liveness, HEARTBEAT_PERIOD};
use memloop::registry::{
    counter_name, ChannelInfo, ConnRecord, ConnTuple, EndpointInfo, FallbackReason, MemberId,
    MemberInfo, Proto, Registry, Side, SwitchReason, COUNTER_CONNS_DROPPED, COUNTER_DOORBELLS,
    COUNTER_LATE_FAILED, COUNTER_PIDFD_FAILED, COUNTER_RING_BYTES, COUNTER_RING_CONNS,
    COUNTER_TCP_BYTES, COUNTER_WAKE_FALLBACK, HEAP_RESERVED_MARK,
};
use memloop::ring::header::totals;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    region: RegionArg,
    /// Print one JSON object (the same as `--format json`).
    #[arg(long)]
    json: bool,
    /// Output format: text (default), json, or prometheus (text exposition format).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Prometheus,
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

pub fn run(a: &StatusArgs) -> CliResult<()> {
    let region = region_cmd::open(&a.region.spec())?;
    let reg = region.registry();
    let members = members(reg);
    let (endpoints, channels, conns) = (reg.endpoints(), reg.channels(), reg.conns());
    let (usage, params, counters) = (reg.usage(), reg.params(), reg.counters());
    let format = if a.json { Format::Json } else { a.format };
    if format != Format::Text {
        let (mut params_j, mut usage_j) = (
            region_cmd::params_json(&params),
            region_cmd::usage_json(&usage),
        );
        params_j["max_conns"] = params.max_conns.into();
        usage_j["conns"] = usage.conns.into();
        let v = json!({
            "region": { "path": region.path(), "size": region.size(), "generation": reg.generation(),
                        "state": reg.state().name(), "params": params_j },
            "usage": usage_j,
            "members": members.iter().map(member_json).collect::<Vec<_>>(),
            "endpoints": endpoints.iter().map(endpoint_json).collect::<Vec<_>>(),
            "channels": channels.iter().map(|c| channel_json(reg, c)).collect::<Vec<_>>(),
            "connections": conns.iter().map(conn_json).collect::<Vec<_>>(),
            "fallbacks": fallbacks_json(&counters),
            "switches": switches_json(&counters),
            // Late-ring attempts that left their connection on TCP.
            "late_failed": counters.get(COUNTER_LATE_FAILED),
            // pidfd_getfd calls refused: the connection could not leave its ring in time.
            "pidfd_failed": counters.get(COUNTER_PIDFD_FAILED),
            // Wake-ups that went over TCP: the sleeper's wake socket was out of reach.
            "wake_fallback": counters.get(COUNTER_WAKE_FALLBACK),
            // Doorbell bytes sent over TCP to wake sleeping peers.
            "doorbells": counters.get(COUNTER_DOORBELLS),
            "conn_records_dropped": counters.get(COUNTER_CONNS_DROPPED),
            "ring_connections": counters.get(COUNTER_RING_CONNS),
            "ring_bytes": ring_bytes(reg, &counters),
            // TCP bytes of recorded connections, live and closed (killed ones too).
            "tcp_bytes": reg.tcp_bytes(),
        });
        match format {
            Format::Prometheus => print!("{}", crate::prometheus::render(&v)),
            _ => println!("{}", serde_json::to_string_pretty(&v)?),
        }
        return Ok(());
    }
    println!(
        "region {} ({}), generation {}, {}",
        region.path().display(),
        fmt_size(region.size()),
        reg.generation(),
        reg.state().name()
    );
    println!("usage: {}", region_cmd::usage_line(&usage, &params));
    println!("connection records: {}/{}", usage.conns, params.max_conns);
    print_members(&members);
    print_endpoints(&endpoints, &members);
    print_channels(reg, &channels, &members);
    print_connections(reg, &channels, &conns, &members);
    print_counters(&counters);
    print_switches(&counters);
    println!(
        "\nRING BYTES carried by every channel so far: {}",
        ring_bytes(reg, &counters)
    );
    Ok(())
}

/// Same-kernel members are checked through /proc at once; for the others (VMs) we can only
/// watch their heartbeat move, which takes a little over one heartbeat period.
fn members(reg: &Registry) -> Vec<Member> {
    let live = Liveness::default();
    let first = reg.members();
    let remote: HashSet<MemberId> = first
        .iter()
        .filter(|m| !live.same_pid_space(&m.identity))
        .map(|m| m.id)
        .collect();
    let now = if remote.is_empty() {
        first.clone()
    } else {
        std::thread::sleep(HEARTBEAT_PERIOD + HEARTBEAT_PERIOD / 2);
        reg.members()
    };
    let mut containers = crate::container::Containers::default();
    now.into_iter()
        .map(|info| {
            let alive = match first.iter().find(|m| m.id == info.id) {
                Some(old) if remote.contains(&info.id) => old.heartbeat != info.heartbeat,
                _ => live.is_alive(&info),
            };
            let same_kernel = live.same_kernel(&info.identity);
            let container = (same_kernel && remote.contains(&info.id))
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

fn member_name(members: &[Member], id: MemberId) -> String {
    match members.iter().find(|m| m.info.id == id) {
        Some(m) => format!(
            "{} ({} pid {})",
            id_str(id.idx, id.gen),
            m.info.identity.name,
            m.info.identity.pid
        ),
        None => format!("{} (gone)", id_str(id.idx, id.gen)),
    }
}

fn member_pid(members: &[Member], id: MemberId) -> String {
    members
        .iter()
        .find(|m| m.info.id == id)
        .map_or("?".into(), |m| m.info.identity.pid.to_string())
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

/// (client→server, server→client) bytes written, if the rings are readable.
fn channel_bytes(reg: &Registry, c: &ChannelInfo) -> Option<(u64, u64)> {
    let rings = reg.rings(c.id).ok()?;
    Some((totals(&rings.c2s)?.0, totals(&rings.s2c)?.0))
}

fn print_members(members: &[Member]) {
    println!("\nMEMBERS ({})", members.len());
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
    for m in members {
        let i = &m.info;
        rows.push(vec![
            id_str(i.id.idx, i.id.gen),
            i.identity.pid.to_string(),
            i.identity.name.clone(),
            m.container.clone().unwrap_or_else(|| "-".into()),
            (if m.same_kernel { "same" } else { "other" }).into(),
            (if m.alive { "yes" } else { "NO" }).into(),
            i.heartbeat.to_string(),
            format!("{:?}", i.state).to_lowercase(),
        ]);
    }
    print_rows(&rows);
}

fn print_endpoints(eps: &[EndpointInfo], members: &[Member]) {
    println!("\nENDPOINTS ({})", eps.len());
    let mut rows = vec![row(&["id", "key", "owner"])];
    for e in eps {
        rows.push(vec![
            id_str(e.id.idx, e.id.gen),
            e.key.to_string(),
            member_name(members, e.owner),
        ]);
    }
    print_rows(&rows);
}

fn print_channels(reg: &Registry, chans: &[ChannelInfo], members: &[Member]) {
    println!("\nCHANNELS ({})", chans.len());
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
    for c in chans {
        let (up, down) = channel_bytes(reg, c).map_or(("-".into(), "-".into()), |(a, b)| {
            (a.to_string(), b.to_string())
        });
        rows.push(vec![
            id_str(c.id.idx, c.id.gen),
            format!("{:?}", c.state).to_lowercase(),
            c.kind.map_or("-".into(), |k| k.to_string()),
            member_name(members, c.client),
            c.server.map_or("-".into(), |s| member_name(members, s)),
            if c.marker {
                "-".into()
            } else {
                fmt_size(c.ring_capacity)
            },
            up,
            down,
            flags(reg, c),
        ]);
    }
    print_rows(&rows);
}

/// A channel's switch word as shown: (requested, first reason, client on TCP, server on TCP);
/// `None` for a decline marker or a channel gone since it was listed.
fn switch_state(
    reg: &Registry,
    c: &ChannelInfo,
) -> Option<(bool, Option<SwitchReason>, bool, bool)> {
    if c.marker {
        return None;
    }
    let w = reg.switch_word(c.id).ok()?;
    Some((
        w.requested(),
        w.reason(),
        w.on_tcp(Side::Client),
        w.on_tcp(Side::Server),
    ))
}

/// Every connection: accelerated ones (channels, bytes from the client's view) and those left on
/// the kernel's path (records, bytes from the recording process's view).
fn print_connections(
    reg: &Registry,
    chans: &[ChannelInfo],
    conns: &[ConnRecord],
    members: &[Member],
) {
    let ring: Vec<&ChannelInfo> = chans.iter().filter(|c| !c.marker).collect();
    println!("\nCONNECTIONS ({})", ring.len() + conns.len());
    let mut rows = vec![row(&[
        "path",
        "tuple",
        "pid",
        "sent",
        "received",
        "ring bytes before switch",
        "state / reason",
    ])];
    for c in ring {
        let (up, down) = channel_bytes(reg, c).map_or(("-".into(), "-".into()), |(a, b)| {
            (a.to_string(), b.to_string())
        });
        let server = c.server.map_or("-".into(), |s| member_pid(members, s));
        let mut state = format!("{:?}", c.state).to_lowercase();
        if let Some((true, reason, _, _)) = switch_state(reg, c) {
            state += &format!(
                ", switch requested ({})",
                reason.map_or("unknown reason", |r| r.name())
            );
        }
        rows.push(vec![
            "ring".into(),
            tuple_str(c.tuple.as_ref()),
            format!("{}/{}", member_pid(members, c.client), server),
            up,
            down,
            "-".into(),
            state,
        ]);
    }
    for r in conns {
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
        rows.push(vec![
            proto_str(r.proto).into(),
            tuple_str(Some(&r.tuple)),
            r.pid.to_string(),
            r.bytes_sent.to_string(),
            r.bytes_received.to_string(),
            ring,
            reason,
        ]);
    }
    print_rows(&rows);
}

/// Kept on TCP for good: its socket reached a program without the library.
fn pinned(reg: &Registry, c: &ChannelInfo) -> bool {
    !c.marker && reg.switch_word(c.id).is_ok_and(|w| w.pinned())
}

/// A process that took the socket with `pidfd_getfd` holds it too: no promotion until it lets
/// go (or holds it alone).
fn grabbed(reg: &Registry, c: &ChannelInfo) -> bool {
    !c.marker && reg.switch_word(c.id).is_ok_and(|w| w.grabbed())
}

fn flags(reg: &Registry, c: &ChannelInfo) -> String {
    let (requested, _, client_tcp, server_tcp) =
        switch_state(reg, c).unwrap_or((false, None, false, false));
    let f = [
        (c.marker, "decline-marker"),
        (c.client_closed, "client-closed"),
        (c.server_closed, "server-closed"),
        (c.client_dead, "client-dead"),
        (c.server_dead, "server-dead"),
        (requested, "switch-requested"),
        (client_tcp, "client-on-tcp"),
        (server_tcp, "server-on-tcp"),
        (pinned(reg, c), "pinned-to-tcp"),
        (grabbed(reg, c), "held-by-pidfd-getfd"),
    ];
    let set: Vec<&str> = f.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect();
    if set.is_empty() {
        "-".into()
    } else {
        set.join(",")
    }
}

fn print_counters(counters: &[u64]) {
    println!("\nFALLBACKS (connections left on TCP since the region was created; zeros omitted)");
    // (Switches, refused grabs and doorbells have their own lines; ring and TCP totals and the
    // heap's reservation mark are no fallbacks.)
    let not_fallbacks: HashSet<usize> = SwitchReason::ALL
        .iter()
        .map(|r| r.counter_index())
        .chain([
            COUNTER_TCP_BYTES,
            COUNTER_PIDFD_FAILED,
            COUNTER_WAKE_FALLBACK,
            COUNTER_DOORBELLS,
            COUNTER_LATE_FAILED,
            HEAP_RESERVED_MARK,
            COUNTER_RING_CONNS,
            COUNTER_RING_BYTES,
        ])
        .collect();
    let nonzero: Vec<String> = counters
        .iter()
        .enumerate()
        .filter(|(i, v)| **v > 0 && !not_fallbacks.contains(i))
        .map(|(i, v)| format!("  {}: {v}", counter_label(i)))
        .collect();
    if nonzero.is_empty() {
        println!("  none");
    }
    for line in nonzero {
        println!("{line}");
    }
}

/// One line of switch counts by reason, only when a connection ever switched path.
fn print_switches(counters: &[u64]) {
    let nonzero: Vec<String> = SwitchReason::ALL
        .iter()
        .filter_map(|r| {
            let n = counters.get(r.counter_index()).copied().unwrap_or(0);
            (n > 0).then(|| format!("{}: {n}", r.name()))
        })
        .collect();
    if !nonzero.is_empty() {
        println!(
            "\nSWITCHES (connections that changed path, by reason): {}",
            nonzero.join(", ")
        );
    }
    if let Some(&n @ 1..) = counters.get(COUNTER_LATE_FAILED) {
        println!("late-ring attempts that stayed on TCP: {n}");
    }
    if let Some(&n @ 1..) = counters.get(COUNTER_PIDFD_FAILED) {
        println!("pidfd_getfd calls refused (the connection could not leave its ring): {n}");
    }
    if let Some(&n @ 1..) = counters.get(COUNTER_RING_CONNS) {
        println!("connections that took a ring: {n}");
    }
    if let Some(&n @ 1..) = counters.get(COUNTER_DOORBELLS) {
        println!("doorbells sent over TCP to wake sleeping peers: {n}");
    }
    if let Some(&n @ 1..) = counters.get(COUNTER_WAKE_FALLBACK) {
        println!("wake-ups sent over TCP (the sleeper's wake socket was out of reach): {n}");
    }
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

fn print_rows(rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(s, w)| format!("{s:<w$}"))
            .collect();
        println!("  {}", cells.join("  ").trim_end());
    }
}

fn member_json(m: &Member) -> Value {
    let i = &m.info;
    json!({
        "idx": i.id.idx, "gen": i.id.gen, "pid": i.identity.pid, "name": i.identity.name,
        "container": m.container,
        "same_kernel": m.same_kernel, "alive": m.alive, "heartbeat": i.heartbeat,
        "state": format!("{:?}", i.state).to_lowercase(),
        "addresses": i.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    })
}

fn endpoint_json(e: &EndpointInfo) -> Value {
    json!({ "idx": e.id.idx, "gen": e.id.gen, "key": e.key.to_string(),
            "owner": { "idx": e.owner.idx, "gen": e.owner.gen } })
}

fn channel_json(reg: &Registry, c: &ChannelInfo) -> Value {
    let bytes = channel_bytes(reg, c);
    let sw = switch_state(reg, c);
    // A switched connection keeps its channel (and rings) until it closes: its bytes go by
    // TCP meanwhile.
    let path = match sw {
        Some((true, _, true, true)) => "tcp",
        _ => "ring",
    };
    json!({
        "idx": c.id.idx, "gen": c.id.gen, "state": format!("{:?}", c.state).to_lowercase(),
        "client": { "idx": c.client.idx, "gen": c.client.gen },
        "server": c.server.map(|s| json!({ "idx": s.idx, "gen": s.gen })),
        "kind": c.kind.map(|k| k.name()), "kind_code": c.kind.map(|k| k.code()),
        "ring_capacity": c.ring_capacity,
        "bytes_c2s": bytes.map(|b| b.0), "bytes_s2c": bytes.map(|b| b.1),
        "client_closed": c.client_closed, "server_closed": c.server_closed,
        "client_dead": c.client_dead, "server_dead": c.server_dead,
        "path": path, "marker": c.marker, "tuple": c.tuple.as_ref().map(tuple_json),
        "doorbells": doorbells_json(reg, c),
        "switch_requested": sw.map(|s| s.0),
        "switch_reason": sw.and_then(|s| s.1).map(|r| r.name()),
        "on_tcp": sw.map(|s| json!({ "client": s.2, "server": s.3 })),
        "pinned": pinned(reg, c),
    })
}

/// Doorbell bytes each side sent and read on its kernel socket (what live path switching will
/// reconcile); null for a channel without side words (a marker, or one being torn down).
fn doorbells_json(reg: &Registry, c: &ChannelInfo) -> Value {
    use memloop::registry::Side;
    let side = |s: Side| {
        let w = reg.side_words(c.id, s).ok()?;
        Some(json!({
            "sent": w.doorbells_sent.load(Relaxed),
            "read": w.doorbells_read.load(Relaxed),
        }))
    };
    match (c.marker, side(Side::Client), side(Side::Server)) {
        (false, Some(client), Some(server)) => json!({ "client": client, "server": server }),
        _ => Value::Null,
    }
}

fn tuple_json(t: &ConnTuple) -> Value {
    json!({ "client": t.client.to_string(), "server": t.server.to_string() })
}

fn conn_json(r: &ConnRecord) -> Value {
    json!({
        "idx": r.id.idx, "gen": r.id.gen, "path": proto_str(r.proto), "tuple": tuple_json(&r.tuple),
        "pid": r.pid, "owner": { "idx": r.owner.idx, "gen": r.owner.gen },
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
        .map(|(name, i)| {
            (
                name.to_string(),
                counters.get(i).copied().unwrap_or(0).into(),
            )
        })
        .collect();
    Value::Object(m)
}

/// Bytes the region's rings have carried: freed channels (the counter, added once when a
/// channel is freed, even if its processes died without closing) plus the channels still
/// allocated, read from their rings — so the figure is current while connections live.
fn ring_bytes(reg: &Registry, counters: &[u64]) -> u64 {
    let freed = counters.get(COUNTER_RING_BYTES).copied().unwrap_or(0);
    freed.saturating_add(reg.live_ring_bytes())
}
