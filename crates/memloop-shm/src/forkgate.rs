//! Lets a process skip its `fork` handlers while it has no state they look after.
//!
//! Every page a fork handler writes costs a copy-on-write fault in the parent and in the
//! child, and every page of handler code the child runs costs it a fault too: ~15 faults, a
//! quarter of a bare `fork` + `exit` on this kind of machine. A process that has the library
//! loaded but has never taken one of its locks (no socket it tracks, no region joined) holds
//! nothing a handler must release or reset, so its handlers can do nothing.
//!
//! The handshake, a Dekker pair: a thread about to take the process's first lock *activates*
//! the gate (stores `pending`, then waits for skipping forks to end, then stores `active`); a
//! fork's prepare counts itself as skipping, then looks at `pending`. In the single order of
//! the two stores and two loads, either the fork sees `pending` (it waits for `active`, and
//! runs its handlers in full) or the activator sees the fork (it waits until the fork's parent
//! handler ends it) — so no lock is ever taken between a skipping fork's prepare and its end,
//! and the child inherits none held. `active` therefore never changes between a fork's
//! prepare and its handlers, which read it to know what the prepare decided (no per-thread
//! record: writing one after the fork would cost a fault).
//!
//! The skipping count is tagged with the pid of the process it counts for: a fork child
//! inherits its parent's count, which its own activation must ignore (the forks it counts
//! are not the child's to wait for), and ignoring it by its tag spares the child a write.

use crate::sync::{fence, yield_now, AtomicU64, Ordering::SeqCst};

/// Low bits of the skipping word: the count; high bits: the pid it counts for.
const COUNT_BITS: u32 = 32;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

pub struct ForkGate {
    /// 0 until an activation begins, then the pid of the process activating (a fork child
    /// may inherit its parent's activation under way: that one is not the child's).
    pending: AtomicU64,
    /// 0 until an activation ends, then 1 for good.
    active: AtomicU64,
    /// Forks of this process under way that skipped their handlers (`pid << 32 | count`).
    skipping: AtomicU64,
}

/// What a fork's prepare decided; its parent handler must be given it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum ForkPlan {
    /// The process has state: run the handlers in full.
    Full,
    /// Nothing to do in the handlers; end the skip in the parent ([`ForkGate::end_skip`]).
    Skip,
}

impl ForkGate {
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        ForkGate {
            pending: AtomicU64::new(0),
            active: AtomicU64::new(0),
            skipping: AtomicU64::new(0),
        }
    }

    #[cfg(loom)]
    pub fn new() -> Self {
        ForkGate {
            pending: AtomicU64::new(0),
            active: AtomicU64::new(0),
            skipping: AtomicU64::new(0),
        }
    }

    /// Whether the process has activated the gate: its forks run their handlers in full. In a
    /// fork's handlers: what its prepare decided.
    #[inline]
    pub fn is_active(&self) -> bool {
        self.active.load(SeqCst) != 0
    }

    /// Before the process's first lock (`pid`: this process): from now on every fork runs
    /// its handlers; returns once no fork of this process that skipped them is under way.
    pub fn activate(&self, pid: u32) {
        self.pending.store(u64::from(pid), SeqCst);
        // (The fences make the Dekker pair hold in the memory model loom checks, where
        // SeqCst accesses alone do not order a store before a later load.)
        fence(SeqCst);
        loop {
            let w = self.skipping.load(SeqCst);
            if w >> COUNT_BITS != u64::from(pid) || w & COUNT_MASK == 0 {
                break;
            }
            yield_now();
        }
        self.active.store(1, SeqCst);
    }

    /// A fork's prepare (`pid`: the forking process).
    pub fn prepare(&self, pid: u32) -> ForkPlan {
        if self.is_active() {
            return ForkPlan::Full;
        }
        let tag = u64::from(pid) << COUNT_BITS;
        let _ = self.skipping.fetch_update(SeqCst, SeqCst, |w| {
            Some(if w >> COUNT_BITS == u64::from(pid) {
                w + 1
            } else {
                tag | 1
            })
        });
        fence(SeqCst);
        if self.pending.load(SeqCst) != u64::from(pid) {
            return ForkPlan::Skip;
        }
        // An activation is under way: it may be waiting for our count, and must end before
        // this fork (its thread may take a lock at once).
        self.end_skip();
        while !self.is_active() {
            yield_now();
        }
        ForkPlan::Full
    }

    /// The parent handler of a fork whose prepare returned [`ForkPlan::Skip`] (the child's
    /// copy needs nothing: its own activation ignores a count tagged with another pid).
    pub fn end_skip(&self) {
        self.skipping.fetch_sub(1, SeqCst);
    }
}

#[cfg(not(loom))]
impl Default for ForkGate {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_inactive_process_skips_and_an_active_one_does_not() {
        let g = ForkGate::new();
        assert_eq!(g.prepare(7), ForkPlan::Skip);
        g.end_skip();
        g.activate(7);
        assert_eq!(g.prepare(7), ForkPlan::Full);
    }

    #[test]
    fn a_child_ignores_the_skips_it_inherited() {
        let g = ForkGate::new();
        assert_eq!(g.prepare(7), ForkPlan::Skip);
        // The child (pid 8) has the parent's count in its copy: activating must not wait.
        g.activate(8);
        assert!(g.is_active());
    }

    #[test]
    fn a_child_ignores_an_activation_it_inherited_half_done() {
        let g = ForkGate::new();
        g.pending.store(7, SeqCst); // the parent's activation, begun before the fork
        assert_eq!(g.prepare(8), ForkPlan::Skip); // the child's own fork does not wait for it
        g.end_skip();
        g.activate(8);
        assert_eq!(g.prepare(8), ForkPlan::Full);
    }

    #[test]
    fn a_skip_counted_for_another_pid_restarts_the_count() {
        let g = ForkGate::new();
        assert_eq!(g.prepare(7), ForkPlan::Skip);
        // In the child (pid 8), never ended there: its own fork starts a count of its own.
        assert_eq!(g.prepare(8), ForkPlan::Skip);
        g.end_skip();
        g.activate(8);
    }
}
