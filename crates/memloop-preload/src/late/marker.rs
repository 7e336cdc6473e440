//! The server's hold on its decline marker, and a server that forks while it waits for a late
//! ring (postgres forks per accepted connection and closes its own copy).
//!
//! The marker is how the client finds the server's connection and signals its late offer
//! (bit 0 of the marker's switch word), so it must live as long as any process that may take
//! the offer holds the connection. Each such process holds the marker: the fork's prepare
//! handler counts the child in the marker's hold count ([`Registry::hold_marker`]) for every
//! armed server connection, and the last holder to let go frees the marker. A process lets go
//! when its connection converts, is disarmed, closes, or the process exits.
//!
//! A conversion needs the connection to itself (the calls in flight that it waits for are
//! this process's only): it is made only while the count says one holder. A holder that
//! disarms while it keeps the socket (it hands it on where we cannot follow — exec,
//! `SCM_RIGHTS`, dup, a fork not counted — or simply gives up waiting) pins the marker first,
//! so no other holder converts ever after: its own calls on the socket are not counted
//! anywhere. Only a holder that stops holding (close, exit) lets go without a pin.
//!
//! Every write to the marker (signal cleared, pin, count) is made under [`MarkerHold::held`]
//! while it is true: this process's hold is counted, so the slot is still the marker.

use super::{Late, Role, ARMED, CONVERTING, IDLE};
use crate::forklock::ForkMutex;
use memloop::registry::{ChannelId, Registry, SwitchWord};
use memloop_shm::{ShmU32, ShmU64};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Arc;

pub(super) struct MarkerHold {
    pub(super) id: ChannelId,
    /// The marker's switch word: bit 0 is the client's signal, bit 16 the pin.
    pub(super) signal: ShmU64,
    holders: ShmU32,
    /// This process's hold is counted and not let go yet.
    pub(super) held: ForkMutex<bool>,
    /// Counted for the fork under way (prepare handler → parent and child handlers).
    for_fork: AtomicBool,
}

impl MarkerHold {
    pub(super) fn new(reg: &Registry, id: ChannelId) -> Option<MarkerHold> {
        Some(MarkerHold {
            id,
            signal: reg.switch_word(id).ok()?.0,
            holders: reg.marker_holders(id).ok()?,
            held: ForkMutex::new(true),
            for_fork: AtomicBool::new(false),
        })
    }

    /// Other processes hold the connection too (a read: it may be stale by the time it is
    /// used, so a conversion asks again under [`Self::held`]).
    pub(super) fn shared(&self) -> bool {
        self.holders.load(Acquire) > 0
    }

    /// Lets go of our hold (the last holder frees the marker); `pin` first if the socket
    /// goes where no holder could follow a conversion.
    pub(super) fn let_go(&self, reg: &Registry, owner: memloop::registry::MemberId, pin: bool) {
        let mut held = self.held.lock();
        if !std::mem::replace(&mut *held, false) {
            return;
        }
        if pin {
            SwitchWord(self.signal.clone()).pin();
        }
        match reg.release_marker(self.id, owner, &self.holders) {
            Ok(freed) => tracing::debug!(marker = ?self.id, freed, "decline marker let go"),
            Err(e) => tracing::debug!(marker = ?self.id, %e, "decline marker not freed"),
        }
    }
}

/// Armed server connections held across the fork under way (strong: none may be dropped
/// while its hold lock is held for the fork).
static FORKING: ForkMutex<Vec<Arc<Late>>> = ForkMutex::new(Vec::new());

fn marker_of(l: &Late) -> Option<&MarkerHold> {
    match &l.role {
        Role::Server { marker, .. } => Some(marker),
        Role::Client => None,
    }
}

/// Prepare handler (after `ARMED` is taken): each armed server connection's hold lock is
/// taken — a conversion under way finishes first, one about to start waits until after the
/// fork and then sees the child counted — and the child is counted as a holder of every
/// marker it may follow: still held, no conversion done, no epoll registration of the socket
/// (an epoll set is shared with the child: neither could move it alone).
pub(super) fn prepare_fork(armed: &[std::sync::Weak<Late>]) {
    let mut forking = FORKING.lock();
    for l in armed.iter().filter_map(std::sync::Weak::upgrade) {
        let Some(m) = marker_of(&l) else { continue };
        let reg = l.engine.registry();
        let no_epoll = l.epolls.try_lock().is_some_and(|e| e.is_empty());
        m.held.acquire_for_fork(|held| {
            let state = l.state.load(Acquire);
            if *held && matches!(state, IDLE | CONVERTING) && no_epoll {
                reg.hold_marker(&m.holders);
                m.for_fork.store(true, Release);
            }
        });
        forking.push(l);
    }
}

/// Parent handler: connections counted for the child stay armed (a conversion waits until
/// one process holds them); the others are disarmed, their markers pinned (the child holds
/// the socket unseen).
pub(super) fn after_fork_in_parent() {
    let kept = counted_for_child(release_forking());
    for l in super::armed() {
        if !kept.iter().any(|k| Arc::ptr_eq(k, &l)) {
            l.disarm("fork");
        }
    }
}

/// Those of `forking` the child was counted for.
fn counted_for_child(forking: Vec<Arc<Late>>) -> Vec<Arc<Late>> {
    forking
        .into_iter()
        .filter(|l| marker_of(l).is_some_and(|m| m.for_fork.swap(false, AcqRel)))
        .collect()
}

/// Child handler: connections counted for us stay armed here (with nothing in flight: the
/// parent's threads are not here, nor a conversion one of them had begun); the rest are
/// the parent's.
pub(super) fn after_fork_in_child() {
    let kept = counted_for_child(release_forking());
    for l in super::armed() {
        if let (Some(m), false) = (marker_of(&l), kept.iter().any(|k| Arc::ptr_eq(k, &l))) {
            *m.held.lock() = false; // the parent's hold, not ours
        }
    }
    super::forget_in_child(&kept);
    for l in kept {
        l.inflight.store(0, Release);
        l.polls.store(0, Release);
        let _ = l.state.compare_exchange(CONVERTING, IDLE, AcqRel, Acquire);
        tracing::debug!(tuple = ?l.tuple, "forked: the child follows the late ring");
        ARMED.lock().push(Arc::downgrade(&l));
    }
}

/// Releases the hold locks taken for the fork; the connections held across it.
fn release_forking() -> Vec<Arc<Late>> {
    let forking = std::mem::take(&mut *FORKING.lock());
    for l in &forking {
        if let Some(m) = marker_of(l) {
            m.held.release_after_fork();
        }
    }
    forking
}

/// Whether this process follows any armed connection (a fork child then needs a heartbeat).
pub fn any_armed() -> bool {
    !super::armed().is_empty()
}

/// At exit (the kernel closes the fds, no `close` runs here): every hold is let go, so a
/// forked handler that exits does not keep its parent's marker.
pub fn at_exit() {
    for l in super::armed() {
        l.disarm_leaving("exit");
    }
}
