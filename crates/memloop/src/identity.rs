//! Who we are: the identity a member advertises in the registry, read from /proc.
//!
//! The kernel is identified by its boot id, the pid namespace and network namespace by their
//! inode numbers. Two members with the same boot id and pid namespace can prove each other's
//! liveness through /proc; any other pair falls back to heartbeats.

use memloop_registry::MemberIdentity;
use std::fs;
use std::os::unix::fs::MetadataExt;

/// Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), and whether it is
/// a zombie. `None` if there is no such process.
pub fn proc_start_time(pid: u32) -> Option<(u64, bool)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((start, state == "Z" || state == "X"))
}

/// The running kernel's boot id (16 bytes), or zeros if unavailable.
pub fn boot_id() -> [u8; 16] {
    let mut out = [0u8; 16];
    if let Ok(s) = fs::read_to_string("/proc/sys/kernel/random/boot_id") {
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

fn process_name() -> String {
    fs::read_to_string("/proc/self/comm")
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
    fn truncates_on_char_boundary() {
        assert_eq!(truncate_utf8("ééé", 3), "é");
    }
}
