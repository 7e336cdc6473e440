//! `memloop domains up | exec | down | list`: network-namespace "domains" joined by veth pairs
//! through a Linux bridge in the root namespace — the analogue of Xen's netfront → dom0 bridge →
//! netback path, used as a baseline and as a test bed. Everything runs `ip` (iproute2).

use crate::error::{fail, CliResult, Context};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Where `ip netns` keeps its namespaces (bind mounts of nsfs).
const NETNS_DIR: &str = "/run/netns";
/// Name of the domain's end of its veth pair, inside its namespace.
const GUEST_IF: &str = "eth0";
/// Linux interface names are at most IFNAMSIZ - 1 bytes.
const MAX_IFNAME: usize = 15;
/// Host part of the bridge's address; domains use .1 ..= .253.
const BRIDGE_HOST: u32 = 254;
/// The IPv6 /64 of a layout: a unique local prefix ("ml") whose last 32 bits are the IPv4
/// subnet's network address, so two layouts on one host never share it. Hosts as in IPv4.
const ULA_HIGH: u128 = 0xfd6d_6c00 << 96;
const V6_PREFIX_LEN: u8 = 64;

#[derive(clap::Args)]
pub struct PrefixArg {
    /// Name prefix: namespaces PREFIX-d0.., bridge PREFIX-br0, host veth ends PREFIX-v0..
    #[arg(long, default_value = "ml")]
    prefix: String,
}

#[derive(clap::Subcommand)]
pub enum DomainsCmd {
    /// Create N namespaces on one bridge (says so if they already exist with this layout).
    Up {
        /// Number of domains (1..=253).
        n: u32,
        #[command(flatten)]
        prefix: PrefixArg,
        /// IPv4 subnet: domain i gets host .(i+1), the bridge .254. Each domain also gets an
        /// IPv6 address in fd6d:6c00:XXXX:YYYY::/64 (XXXX:YYYY: the IPv4 network address),
        /// host ::(i+1), the bridge ::fe.
        #[arg(long, default_value = "10.77.0.0/24")]
        subnet: String,
    },
    /// Run CMD inside domain I: CMD replaces this process (signals reach it, its exit status
    /// is ours).
    Exec {
        /// Domain index.
        i: u32,
        #[command(flatten)]
        prefix: PrefixArg,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Remove the namespaces, veth pairs and bridge (nothing there is fine).
    Down(PrefixArg),
    /// Index, namespace, address and namespace inode of each domain.
    List {
        #[command(flatten)]
        prefix: PrefixArg,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: DomainsCmd) -> CliResult<()> {
    match cmd {
        DomainsCmd::Up { n, prefix, subnet } => up(&plan(n, &prefix.prefix, &subnet)?),
        DomainsCmd::Exec { i, prefix, cmd } => exec(&prefix.prefix, i, &cmd),
        DomainsCmd::Down(p) => down(&p.prefix),
        DomainsCmd::List { prefix, json } => list(&prefix.prefix, json),
    }
}

// ---------------------------------------------------------------------------------------------
// The plan: names and addresses, no I/O.

/// The layout of N domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub prefix: String,
    pub bridge: String,
    pub bridge_addr: Ipv4Addr,
    pub prefix_len: u8,
    pub bridge_addr6: Ipv6Addr,
    pub domains: Vec<DomainPlan>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainPlan {
    pub index: u32,
    /// Namespace name (`/run/netns/NAME`).
    pub netns: String,
    /// Root-namespace end of the veth pair, attached to the bridge.
    pub host_if: String,
    pub addr: Ipv4Addr,
    pub addr6: Ipv6Addr,
}

/// Names and addresses for `n` domains with this prefix in this subnet (`a.b.c.d/len`, len ≤ 24).
pub fn plan(n: u32, prefix: &str, subnet: &str) -> CliResult<Plan> {
    check_prefix(prefix)?;
    if !(1..BRIDGE_HOST).contains(&n) {
        return Err(fail(format!(
            "{n} domains: expected 1..={}",
            BRIDGE_HOST - 1
        )));
    }
    let (base, prefix_len) = parse_subnet(subnet)?;
    let domains = (0..n)
        .map(|i| DomainPlan {
            index: i,
            netns: netns_name(prefix, i),
            host_if: host_if_name(prefix, i),
            addr: Ipv4Addr::from(base + i + 1),
            addr6: ipv6_of(Ipv4Addr::from(base), i + 1),
        })
        .collect::<Vec<_>>();
    let bridge = bridge_name(prefix);
    for name in std::iter::once(&bridge).chain(domains.iter().map(|d| &d.host_if)) {
        check_ifname(name)?;
    }
    Ok(Plan {
        prefix: prefix.to_owned(),
        bridge,
        bridge_addr: Ipv4Addr::from(base + BRIDGE_HOST),
        prefix_len,
        bridge_addr6: ipv6_of(Ipv4Addr::from(base), BRIDGE_HOST),
        domains,
    })
}

/// How much IPv6 this host allows a layout: none (a kernel without it), the domains' own
/// addresses (IPv6 switched off in the root namespace: domains still reach each other over the
/// bridge, which needs no address), or also the bridge's address and the domains' routes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum V6 {
    Off,
    DomainsOnly,
    Full,
}

fn v6_here() -> V6 {
    if !Path::new("/proc/net/if_inet6").exists() {
        return V6::Off;
    }
    let off = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{f}/disable_ipv6"))
            .is_ok_and(|s| s.trim() == "1")
    };
    if off("all") || off("default") {
        V6::DomainsOnly
    } else {
        V6::Full
    }
}

/// Host `host`'s IPv6 address in the layout whose IPv4 network address is `net`.
pub fn ipv6_of(net: Ipv4Addr, host: u32) -> Ipv6Addr {
    Ipv6Addr::from(ULA_HIGH | (u128::from(u32::from(net)) << 64) | u128::from(host))
}

fn netns_name(prefix: &str, i: u32) -> String {
    format!("{prefix}-d{i}")
}

fn host_if_name(prefix: &str, i: u32) -> String {
    format!("{prefix}-v{i}")
}

fn bridge_name(prefix: &str) -> String {
    format!("{prefix}-br0")
}

/// The index in `name` if it is `PREFIX-<tag><digits>` (e.g. tag "d" for namespaces).
fn index_of(prefix: &str, tag: &str, name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix(prefix)?
        .strip_prefix('-')?
        .strip_prefix(tag)?;
    let canonical = !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
    canonical.then(|| rest.parse().ok())?
}

fn check_prefix(prefix: &str) -> CliResult<()> {
    let ok = !prefix.is_empty()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(fail(format!(
            "--prefix {prefix:?}: use letters, digits, '_' and '-' only"
        )))
    }
}

fn check_ifname(name: &str) -> CliResult<()> {
    if name.len() > MAX_IFNAME {
        return Err(fail(format!(
            "interface name {name:?} is longer than {MAX_IFNAME} bytes: use a shorter --prefix"
        )));
    }
    Ok(())
}

/// `a.b.c.d/len` → (network address as u32, len). Host bits are ignored.
fn parse_subnet(s: &str) -> CliResult<(u32, u8)> {
    let bad = |why: &str| fail(format!("--subnet {s:?}: {why}"));
    let (addr, len) = s
        .split_once('/')
        .ok_or_else(|| bad("expected a.b.c.d/len"))?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
    let len: u8 = len.parse().map_err(|_| bad("bad prefix length"))?;
    if !(1..=24).contains(&len) {
        return Err(bad("prefix length must be 1..=24 (room for .1 ..= .254)"));
    }
    let mask = u32::MAX << (32 - len);
    Ok((u32::from(addr) & mask, len))
}

// ---------------------------------------------------------------------------------------------
// Running `ip`.

/// Runs `ip ARGS`, returning its stdout; the error names the command and quotes its stderr.
fn ip(args: &[&str]) -> CliResult<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| ip_spawn_error(&e))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(fail(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            err.trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip -j ARGS`, parsing its output (empty output is an empty array).
fn ip_json(args: &[&str]) -> CliResult<Value> {
    let argv: Vec<&str> = std::iter::once("-j").chain(args.iter().copied()).collect();
    let text = ip(&argv)?;
    if text.trim().is_empty() {
        return Ok(Value::Array(Vec::new()));
    }
    serde_json::from_str(&text).context(format!("parsing `ip {}`", argv.join(" ")))
}

fn ip_spawn_error(e: &std::io::Error) -> crate::error::CliError {
    if e.kind() == std::io::ErrorKind::NotFound {
        fail("`ip` (iproute2) not found: install it, e.g. `apt-get install -y iproute2`")
    } else {
        fail(format!("running `ip`: {e}"))
    }
}

/// Root and `ip`: needed to create, enter or remove namespaces.
fn preflight(what: &str) -> CliResult<()> {
    if !rustix::process::geteuid().is_root() {
        return Err(fail(format!(
            "`memloop domains {what}` needs root (network namespaces and bridges): run it as root"
        )));
    }
    ip(&["-V"]).map(drop)
}

// ---------------------------------------------------------------------------------------------
// up

fn up(p: &Plan) -> CliResult<()> {
    preflight("up")?;
    // (Once: what this host allows does not change while we build.)
    let v6 = v6_here();
    if is_up(p, v6) {
        println!(
            "{} domain(s) {}-d0..{} already up on bridge {} ({}/{})",
            p.domains.len(),
            p.prefix,
            p.domains.len() - 1,
            p.bridge,
            p.bridge_addr,
            p.prefix_len
        );
        return Ok(());
    }
    // Whatever is there under this prefix is a leftover or another layout: start clean.
    let leftovers = remove_all(&p.prefix)?;
    if leftovers > 0 {
        println!(
            "removed {leftovers} leftover namespace(s)/interface(s) with prefix {}: rebuilding",
            p.prefix
        );
    }
    if let Err(e) = build(p, v6) {
        let _ = remove_all(&p.prefix);
        return Err(e);
    }
    let six = |a: Ipv6Addr, on: bool| {
        if on {
            format!("  {a}/{V6_PREFIX_LEN}")
        } else {
            String::new()
        }
    };
    for d in &p.domains {
        println!(
            "domain {}  {}  {}/{}{}",
            d.index,
            d.netns,
            d.addr,
            p.prefix_len,
            six(d.addr6, v6 != V6::Off)
        );
    }
    println!(
        "bridge    {}  {}/{}{}",
        p.bridge,
        p.bridge_addr,
        p.prefix_len,
        six(p.bridge_addr6, v6 == V6::Full)
    );
    if v6 == V6::Off {
        println!("(no IPv6 in this kernel: IPv4 only)");
    }
    Ok(())
}

fn build(p: &Plan, v6: V6) -> CliResult<()> {
    let br_addr = format!("{}/{}", p.bridge_addr, p.prefix_len);
    let br_addr6 = format!("{}/{V6_PREFIX_LEN}", p.bridge_addr6);
    ip(&["link", "add", &p.bridge, "type", "bridge"])?;
    ip(&["addr", "add", &br_addr, "dev", &p.bridge])?;
    if v6 == V6::Full {
        // (nodad: usable at once; the layout's addresses are unique by construction.)
        ip(&["-6", "addr", "add", &br_addr6, "dev", &p.bridge, "nodad"])?;
    }
    ip(&["link", "set", &p.bridge, "up"])?;
    p.domains.iter().try_for_each(|d| build_domain(p, d, v6))
}

fn build_domain(p: &Plan, d: &DomainPlan, v6: V6) -> CliResult<()> {
    let (ns, host) = (d.netns.as_str(), d.host_if.as_str());
    let addr = format!("{}/{}", d.addr, p.prefix_len);
    let addr6 = format!("{}/{V6_PREFIX_LEN}", d.addr6);
    let gw = p.bridge_addr.to_string();
    let gw6 = p.bridge_addr6.to_string();
    ip(&["netns", "add", ns])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    // Create the peer directly inside the namespace: the root namespace may have an eth0.
    ip(&[
        "link", "add", host, "type", "veth", "peer", "name", GUEST_IF, "netns", ns,
    ])?;
    ip(&["link", "set", host, "master", &p.bridge])?;
    ip(&["link", "set", host, "up"])?;
    ip(&["-n", ns, "addr", "add", &addr, "dev", GUEST_IF])?;
    if v6 != V6::Off {
        ip(&[
            "-n", ns, "-6", "addr", "add", &addr6, "dev", GUEST_IF, "nodad",
        ])?;
    }
    ip(&["-n", ns, "link", "set", GUEST_IF, "up"])?;
    ip(&["-n", ns, "route", "add", "default", "via", &gw])?;
    if v6 == V6::Full {
        ip(&["-n", ns, "-6", "route", "add", "default", "via", &gw6])?;
    }
    Ok(())
}

/// True if exactly the planned layout exists (any query failing means "no").
fn is_up(p: &Plan, v6: V6) -> bool {
    let want_ns: BTreeSet<String> = p.domains.iter().map(|d| d.netns.clone()).collect();
    let want_if: BTreeSet<String> = p.domains.iter().map(|d| d.host_if.clone()).collect();
    let same_sets = existing_netns(&p.prefix) == want_ns
        && existing_host_ifs(&p.prefix).is_ok_and(|s| s == want_if);
    same_sets && bridge_ok(p, v6).unwrap_or(false) && p.domains.iter().all(|d| domain_ok(p, d, v6))
}

fn bridge_ok(p: &Plan, v6: V6) -> CliResult<bool> {
    let br = first(ip_json(&["addr", "show", "dev", &p.bridge])?);
    Ok(is_if_up(&br)
        && has_addr(&br, p.bridge_addr.into(), p.prefix_len)
        && (v6 != V6::Full || has_addr(&br, p.bridge_addr6.into(), V6_PREFIX_LEN)))
}

fn domain_ok(p: &Plan, d: &DomainPlan, v6: V6) -> bool {
    let check = || -> CliResult<bool> {
        let ns = d.netns.as_str();
        let host = first(ip_json(&["link", "show", "dev", &d.host_if])?);
        let guest = first(ip_json(&["-n", ns, "addr", "show", "dev", GUEST_IF])?);
        let lo = first(ip_json(&["-n", ns, "link", "show", "dev", "lo"])?);
        let route = first(ip_json(&["-n", ns, "route", "show", "default"])?);
        Ok(is_if_up(&host)
            && host["master"] == p.bridge.as_str()
            // The guest end is the peer of this host end.
            && guest["link_index"] == host["ifindex"]
            && is_if_up(&guest)
            && has_addr(&guest, d.addr.into(), p.prefix_len)
            && (v6 == V6::Off || has_addr(&guest, d.addr6.into(), V6_PREFIX_LEN))
            && is_if_up(&lo)
            && route["gateway"] == p.bridge_addr.to_string().as_str())
    };
    check().unwrap_or(false)
}

fn first(v: Value) -> Value {
    v.get(0).cloned().unwrap_or(Value::Null)
}

fn is_if_up(link: &Value) -> bool {
    link["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "UP"))
}

fn has_addr(link: &Value, addr: std::net::IpAddr, len: u8) -> bool {
    link["addr_info"].as_array().is_some_and(|a| {
        a.iter()
            .any(|i| i["local"] == addr.to_string().as_str() && i["prefixlen"] == len)
    })
}

// ---------------------------------------------------------------------------------------------
// What exists under a prefix.

/// Namespace names `PREFIX-d<i>` in /run/netns.
fn existing_netns(prefix: &str) -> BTreeSet<String> {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else {
        return BTreeSet::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| index_of(prefix, "d", n).is_some())
        .collect()
}

/// Root-namespace links named `PREFIX-v<i>`.
fn existing_host_ifs(prefix: &str) -> CliResult<BTreeSet<String>> {
    let links = ip_json(&["link", "show"])?;
    let names = links.as_array().into_iter().flatten();
    Ok(names
        .filter_map(|l| l["ifname"].as_str())
        .filter(|n| index_of(prefix, "v", n).is_some())
        .map(str::to_owned)
        .collect())
}

fn link_exists(name: &str) -> bool {
    ip(&["link", "show", "dev", name]).is_ok()
}

// ---------------------------------------------------------------------------------------------
// down

fn down(prefix: &str) -> CliResult<()> {
    check_prefix(prefix)?;
    preflight("down")?;
    let removed = remove_all(prefix)?;
    if removed == 0 {
        println!("no domains with prefix {prefix}: nothing to remove");
    } else {
        println!("removed {removed} namespace(s)/interface(s) with prefix {prefix}");
    }
    Ok(())
}

/// Removes every host veth end, namespace and the bridge under `prefix`; returns how many.
fn remove_all(prefix: &str) -> CliResult<usize> {
    // Host ends first: deleting one end deletes the pair at once, whereas a deleted namespace's
    // interfaces go away asynchronously and could block re-creating the same names.
    let ifs = existing_host_ifs(prefix)?;
    for name in &ifs {
        ip(&["link", "del", "dev", name])?;
    }
    let namespaces = existing_netns(prefix);
    for ns in &namespaces {
        ip(&["netns", "del", ns])?;
    }
    let bridge = bridge_name(prefix);
    let had_bridge = link_exists(&bridge);
    if had_bridge {
        ip(&["link", "del", "dev", &bridge])?;
    }
    Ok(ifs.len() + namespaces.len() + usize::from(had_bridge))
}

// ---------------------------------------------------------------------------------------------
// exec

fn exec(prefix: &str, i: u32, cmd: &[String]) -> CliResult<()> {
    check_prefix(prefix)?;
    let ns = netns_name(prefix, i);
    if !Path::new(NETNS_DIR).join(&ns).exists() {
        return Err(fail(format!(
            "no domain {i} ({NETNS_DIR}/{ns}): create it with `memloop domains up N --prefix {prefix}`"
        )));
    }
    preflight("exec")?;
    // `ip netns exec` enters the namespace and execs CMD in its own place: with us replaced
    // too, CMD is this very process — a signal sent to it (a terminal's ^C, a supervisor's
    // TERM) reaches CMD, and its exit status is ours, with nothing in between to forward.
    let e = Command::new("ip")
        .args(["netns", "exec", &ns])
        .args(cmd)
        .exec();
    Err(ip_spawn_error(&e))
}

// ---------------------------------------------------------------------------------------------
// list

/// One existing domain as `list` shows it.
struct Listed {
    index: u32,
    netns: String,
    addr: Option<String>,
    addr6: Option<String>,
    inode: Option<u64>,
}

fn list(prefix: &str, as_json: bool) -> CliResult<()> {
    check_prefix(prefix)?;
    let mut domains: Vec<Listed> = existing_netns(prefix)
        .into_iter()
        .filter_map(|ns| Some(describe(index_of(prefix, "d", &ns)?, ns)))
        .collect();
    domains.sort_by_key(|d| d.index);
    if as_json {
        let ds: Vec<Value> = domains.iter().map(listed_json).collect();
        let v = json!({ "prefix": prefix, "bridge": bridge_name(prefix), "domains": ds });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if domains.is_empty() {
        println!("no domains with prefix {prefix} (create them with `memloop domains up N`)");
    }
    for d in &domains {
        let addr = d.addr.as_deref().unwrap_or("-");
        let addr6 = d.addr6.as_deref().unwrap_or("-");
        let inode = d.inode.map_or_else(|| "-".to_owned(), |i| i.to_string());
        println!(
            "{:<4} {:<16} {:<18} {:<28} netns inode {inode}",
            d.index, d.netns, addr, addr6
        );
    }
    Ok(())
}

fn describe(index: u32, netns: String) -> Listed {
    // The nsfs inode identifies the namespace (as in /proc/PID/ns/net).
    let inode = std::fs::metadata(Path::new(NETNS_DIR).join(&netns))
        .ok()
        .map(|m| m.ino());
    let link = ip_json(&["-n", &netns, "addr", "show", "dev", GUEST_IF])
        .ok()
        .map(first);
    let addr = link.as_ref().and_then(|l| guest_addr(l, "inet"));
    let addr6 = link.as_ref().and_then(|l| guest_addr(l, "inet6"));
    Listed {
        index,
        netns,
        addr,
        addr6,
        inode,
    }
}

/// `address/len` of the domain's eth0 in `family` (`inet`, or `inet6`: its global scope, not
/// the link-local one); None if it has none or we may not look (needs root).
fn guest_addr(link: &Value, family: &str) -> Option<String> {
    let info = link["addr_info"].as_array()?;
    let a = info
        .iter()
        .find(|i| i["family"] == family && i["scope"] == "global")?;
    Some(format!("{}/{}", a["local"].as_str()?, a["prefixlen"]))
}

fn listed_json(d: &Listed) -> Value {
    json!({
        "index": d.index,
        "netns": d.netns,
        "address": d.addr,
        "address6": d.addr6,
        "netns_inode": d.inode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_names_and_addresses() {
        let p = plan(3, "ml", "10.77.0.0/24").unwrap();
        assert_eq!(p.bridge, "ml-br0");
        assert_eq!(p.bridge_addr, Ipv4Addr::new(10, 77, 0, 254));
        assert_eq!(p.prefix_len, 24);
        let names: Vec<_> = p.domains.iter().map(|d| d.netns.as_str()).collect();
        assert_eq!(names, ["ml-d0", "ml-d1", "ml-d2"]);
        let hosts: Vec<_> = p.domains.iter().map(|d| d.host_if.as_str()).collect();
        assert_eq!(hosts, ["ml-v0", "ml-v1", "ml-v2"]);
        let addrs: Vec<_> = p.domains.iter().map(|d| d.addr.to_string()).collect();
        assert_eq!(addrs, ["10.77.0.1", "10.77.0.2", "10.77.0.3"]);
        let addrs6: Vec<_> = p.domains.iter().map(|d| d.addr6.to_string()).collect();
        assert_eq!(
            addrs6,
            ["fd6d:6c00:a4d::1", "fd6d:6c00:a4d::2", "fd6d:6c00:a4d::3"]
        );
        assert_eq!(p.bridge_addr6.to_string(), "fd6d:6c00:a4d::fe");
        // Another IPv4 subnet, another IPv6 prefix.
        let q = plan(1, "ml", "10.200.7.0/24").unwrap();
        assert_eq!(q.domains[0].addr6.to_string(), "fd6d:6c00:ac8:700::1");
        assert!(p
            .domains
            .iter()
            .enumerate()
            .all(|(i, d)| d.index as usize == i));
    }

    #[test]
    fn plan_masks_host_bits_and_allows_wider_subnets() {
        let p = plan(1, "x", "192.168.5.77/24").unwrap();
        assert_eq!(p.domains[0].addr, Ipv4Addr::new(192, 168, 5, 1));
        let p = plan(2, "x", "10.1.2.3/16").unwrap();
        assert_eq!(p.bridge_addr, Ipv4Addr::new(10, 1, 0, 254));
        assert_eq!(p.domains[1].addr, Ipv4Addr::new(10, 1, 0, 2));
        assert_eq!(p.prefix_len, 16);
    }

    #[test]
    fn plan_rejects_bad_input() {
        assert!(plan(0, "ml", "10.77.0.0/24").is_err());
        assert!(plan(254, "ml", "10.77.0.0/24").is_err());
        assert!(plan(253, "ml", "10.77.0.0/24").is_ok());
        assert!(plan(1, "ml", "10.77.0.0/25").is_err());
        assert!(plan(1, "ml", "10.77.0.0").is_err());
        assert!(plan(1, "ml", "10.77.0/24").is_err());
        assert!(plan(1, "", "10.77.0.0/24").is_err());
        assert!(plan(1, "a/b", "10.77.0.0/24").is_err());
        assert!(plan(1, "a b", "10.77.0.0/24").is_err());
    }

    #[test]
    fn plan_keeps_interface_names_short() {
        // "abcdefghij-v0" is 13 bytes, "abcdefghij-br0" 14: fine.
        assert!(plan(10, "abcdefghij", "10.77.0.0/24").is_ok());
        // "abcdefghijk-v100" is 16 bytes.
        let e = plan(101, "abcdefghijk", "10.77.0.0/24").unwrap_err();
        assert!(e.to_string().contains("--prefix"), "{e}");
        assert!(plan(1, "abcdefghijklm", "10.77.0.0/24").is_err());
    }

    #[test]
    fn index_of_accepts_only_canonical_names() {
        assert_eq!(index_of("ml", "d", "ml-d0"), Some(0));
        assert_eq!(index_of("ml", "d", "ml-d12"), Some(12));
        assert_eq!(index_of("ml", "v", "ml-v3"), Some(3));
        assert_eq!(index_of("ml", "d", "ml-d"), None);
        assert_eq!(index_of("ml", "d", "ml-dx"), None);
        assert_eq!(index_of("ml", "d", "ml-d1-d0"), None);
        assert_eq!(index_of("ml", "d", "mlx-d0"), None);
        assert_eq!(index_of("ml", "d", "ml-v0"), None);
        assert_eq!(index_of("ml", "v", "ml-br0"), None);
    }
}
