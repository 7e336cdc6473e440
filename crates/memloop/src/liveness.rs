//! Deciding whether another member is still alive.
//!
//! Same kernel and pid namespace: the OS proves it — the pid must exist, not be a zombie, and
//! have the start time the member registered (so a recycled pid is not mistaken for it).
//! Anything else (a VM, another pid namespace): the member's heartbeat counter must have moved
//! within [`HEARTBEAT_TIMEOUT`]; we remember when we last saw each counter change.

use crate::identity::{self, proc_start_time};
use memloop_registry::{MemberId, MemberIdentity, MemberInfo};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often members bump their heartbeat.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_millis(200);
/// A heartbeat that has not moved for this long means the member is dead.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(1500);
/// A join that has not completed for this long was abandoned (its process died mid-join).
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Liveness {
    boot_id: [u8; 16],
    pid_ns: u64,
    seen: Mutex<HashMap<MemberId, (u64, Instant)>>,
    claims: Mutex<HashMap<(u32, u64), Instant>>,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            boot_id: identity::boot_id(),
            pid_ns: identity::namespace_inode("pid"),
            seen: Mutex::default(),
            claims: Mutex::default(),
        }
    }
}

impl Liveness {
    /// True if `/proc` can vouch for `other` (same kernel, same pid namespace).
    pub fn same_pid_space(&self, other: &MemberIdentity) -> bool {
        other.boot_id == self.boot_id && other.pid_ns == self.pid_ns && self.pid_ns != 0
    }

    /// True if `other` runs on our kernel (futexes can wake it).
    pub fn same_kernel(&self, other: &MemberIdentity) -> bool {
        other.boot_id == self.boot_id
    }

    pub fn is_alive(&self, m: &MemberInfo) -> bool {
        if self.same_pid_space(&m.identity) {
            match proc_start_time(m.identity.pid) {
                Some((t, zombie)) => return t == m.identity.start_time && !zombie,
                // Gone. (A `/proc` we could not read — out of fds, say — proves nothing: the
                // heartbeat decides then.)
                None if !std::path::Path::new(&format!("/proc/{}", m.identity.pid)).exists() => {
                    return false
                }
                None => {}
            }
        }
        self.heartbeat_fresh(m.id, m.heartbeat, Instant::now())
    }

    /// Has the join claim (slot `idx`, state word `word`) stood unchanged for [`CLAIM_TIMEOUT`]?
    pub fn claim_abandoned(&self, idx: u32, word: u64, now: Instant) -> bool {
        let mut claims = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        let first = *claims.entry((idx, word)).or_insert(now);
        now.duration_since(first) >= CLAIM_TIMEOUT
    }

    fn heartbeat_fresh(&self, id: MemberId, beat: u64, now: Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let entry = seen.entry(id).or_insert((beat, now));
        if entry.0 != beat {
            *entry = (beat, now);
        }
        now.duration_since(entry.1) < HEARTBEAT_TIMEOUT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_goes_stale_only_without_change() {
        let l = Liveness::default();
        let id = MemberId { idx: 1, gen: 1 };
        let t0 = Instant::now();
        assert!(l.heartbeat_fresh(id, 5, t0));
        assert!(l.heartbeat_fresh(id, 5, t0 + HEARTBEAT_TIMEOUT / 2));
        assert!(l.heartbeat_fresh(id, 6, t0 + HEARTBEAT_TIMEOUT * 2));
        assert!(!l.heartbeat_fresh(id, 6, t0 + HEARTBEAT_TIMEOUT * 4));
    }
}
