//! Who we are: the identity a member advertises in the registry, read from /proc.
//!
//! The kernel is identified by its boot id, the pid namespace and network namespace by their
//! inode numbers. Two members with the same boot id and pid namespace can prove each other's
//! liveness through /proc; any other pair falls back to heartbeats.

use memloop_registry::MemberIdentity;
use std::fs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt;

/// Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), and whether it is
/// a zombie. `None` if there is no such process.
pub fn proc_start_time(pid: u32) -> Option<(u64, bool)> {
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces and parentheses: fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((start, state == "Z" || state == "X"))
}

/// A small file of /proc, read whole: one read into a page-sized buffer (the generic readers
/// ask for the size first, which /proc does not know, then read 32 bytes at a time and grow —
/// a dozen system calls where two do, on every join and liveness check).
fn read_proc(path: &str) -> Option<String> {
    use std::io::Read;
    let mut f = fs::File::open(path).ok()?;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).ok()
}

/// The running kernel's boot id (16 bytes), or zeros if unavailable. Read once per process.
pub fn boot_id() -> [u8; 16] {
    static ID: std::sync::OnceLock<[u8; 16]> = std::sync::OnceLock::new();
    *ID.get_or_init(read_boot_id)
}

fn read_boot_id() -> [u8; 16] {
    let mut out = [0u8; 16];
    if let Some(s) = read_proc("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let txt = std::str::from_utf8(pair).unwrap_or("0");
            out[i] = u8::from_str_radix(txt, 16).unwrap_or(0);
        }
    }
    out
}

/// Inode of one of our namespaces (`"pid"`, `"net"`), 0 if unknown.
pub fn namespace_inode(kind: &str) -> u64 {
    fs::metadata(format!("/proc/self/ns/{kind}"))
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// Our network namespace in this kernel, as [`memloop_registry::net_scope`] names it.
pub fn net_scope() -> u64 {
    memloop_registry::net_scope(&boot_id(), namespace_inode("net"))
}

/// The identity of the calling process.
pub fn current(name: &str) -> MemberIdentity {
    let pid = std::process::id();
    let start_time = proc_start_time(pid).map(|(t, _)| t).unwrap_or(0);
    let name = if name.is_empty() {
        process_name()
    } else {
        name.to_string()
    };
    MemberIdentity {
        pid,
        start_time,
        boot_id: boot_id(),
        pid_ns: namespace_inode("pid"),
        net_ns: namespace_inode("net"),
        name: truncate_utf8(&name, 31).to_string(),
    }
}

/// The addresses this network namespace owns: IPv4 "/32 host LOCAL" entries of
/// /proc/net/fib_trie and the IPv6 addresses of /proc/net/if_inet6 (the kernel's own view, no
/// netlink needed). Duplicates removed, order stable.
pub fn local_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    if let Some(trie) = read_proc("/proc/net/fib_trie") {
        out.extend(parse_fib_trie_locals(&trie));
    }
    if let Some(v6) = read_proc("/proc/net/if_inet6") {
        out.extend(v6.lines().filter_map(parse_if_inet6_line));
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|a| seen.insert(*a));
    out
}

fn parse_fib_trie_locals(trie: &str) -> Vec<IpAddr> {
    let mut last: Option<Ipv4Addr> = None;
    let mut out = Vec::new();
    for line in trie.lines().map(str::trim) {
        if let Some(a) = line.strip_prefix("|-- ") {
            last = a.parse().ok();
        } else if line.starts_with("/32 host LOCAL") {
            out.extend(last.take().map(IpAddr::V4));
        }
    }
    out
}

fn parse_if_inet6_line(line: &str) -> Option<IpAddr> {
    let hex = line.split_ascii_whitespace().next()?;
    let bits = u128::from_str_radix(hex, 16).ok()?;
    (hex.len() == 32).then_some(IpAddr::V6(Ipv6Addr::from(bits)))
}

fn process_name() -> String {
    // On the main thread its name is the process's (one system call, no /proc file); another
    // thread may have a name of its own.
    let main = rustix::thread::gettid() == rustix::process::getpid();
    if let Some(n) = main.then(rustix::thread::name).and_then(Result::ok) {
        return n.to_string_lossy().into_owned();
    }
    read_proc("/proc/self/comm")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_identity() {
        let me = current("");
        assert_eq!(me.pid, std::process::id());
        assert!(me.start_time > 0);
        assert_ne!(me.boot_id, [0; 16]);
        assert_ne!(me.net_ns, 0);
        assert_eq!(proc_start_time(me.pid), Some((me.start_time, false)));
        assert!(!me.name.is_empty());
    }

    #[test]
    fn parses_kernel_address_tables() {
        let trie = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 127.0.0.1\n        /32 host LOCAL\n     |-- 10.0.0.255\n        /32 link BROADCAST\n     |-- 10.0.0.7\n        /32 host LOCAL\n";
        let v4: Vec<IpAddr> = ["127.0.0.1", "10.0.0.7"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(parse_fib_trie_locals(trie), v4);
        let line = "fd000000000000000000000000000002 04 40 00 82     eth0";
        assert_eq!(parse_if_inet6_line(line), Some("fd00::2".parse().unwrap()));
        assert_eq!(parse_if_inet6_line("zz 01"), None);
        assert!(local_addresses().contains(&"127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn truncates_on_char_boundary() {
        assert_eq!(truncate_utf8("ééé", 3), "é");
    }
}
