//! Deciding whether another member is still alive.
//!
//! Same kernel and pid namespace: the OS proves it — the pid must exist, not be a zombie, and
//! have the start time the member registered (so a recycled pid is not mistaken for it).
//! Same kernel, another pid namespace (a container): the member's lock on its byte of the
//! region file (`memloop_shm::member_lock`) must be held. Anything else (a VM), or a member
//! without a lock: its heartbeat counter must have moved within [`HEARTBEAT_TIMEOUT`] (we
//! remember when we last saw each counter change) — unless it runs no heartbeat, which only its
//! own kernel can judge: then it counts as alive here.

use crate::identity::{self, proc_start_time};
use crate::region::Region;
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
    /// The region whose file carries the members' locks (none: locks prove nothing).
    region: Option<Region>,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            boot_id: identity::boot_id(),
            pid_ns: identity::namespace_inode("pid"),
            seen: Mutex::default(),
            claims: Mutex::default(),
            region: None,
        }
    }
}

impl Liveness {
    /// A judge of `region`'s members that also asks their locks.
    pub fn for_region(region: &Region) -> Self {
        Self::for_member(region, identity::namespace_inode("pid"))
    }

    /// [`Liveness::for_region`] for a member whose pid namespace is known already (one look
    /// at /proc less on a join).
    pub fn for_member(region: &Region, pid_ns: u64) -> Self {
        Self {
            boot_id: identity::boot_id(),
            pid_ns,
            seen: Mutex::default(),
            claims: Mutex::default(),
            region: Some(region.clone()),
        }
    }

    /// Whether `m`'s lock is held (`None`: no lock to ask, or the question failed).
    fn lock_held(&self, m: &MemberInfo) -> Option<bool> {
        if !m.locked() || !self.same_kernel(&m.identity) {
            return None;
        }
        let file = self.region.as_ref()?.lock_file()?;
        memloop_shm::member_lock::held(file, u64::from(m.id.idx)).ok()
    }

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
                // lock or the heartbeat decides then.)
                None if !std::path::Path::new(&format!("/proc/{}", m.identity.pid)).exists() => {
                    return false
                }
                None => {}
            }
        }
        if let Some(held) = self.lock_held(m) {
            return held;
        }
        m.beatless() || self.heartbeat_fresh(m.id, m.heartbeat, Instant::now())
    }

    /// Can we judge `m` at once (by `/proc` or its lock), without watching its heartbeat?
    pub fn judges_at_once(&self, m: &MemberInfo) -> bool {
        self.same_pid_space(&m.identity) || m.beatless() || self.lock_held(m).is_some()
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
