//! A process's membership in a region.
//!
//! Joining registers our identity and takes our liveness lock (`memloop_shm::member_lock`),
//! which proves us alive to every process of our kernel. A background thread — the heartbeat:
//! a proof of life for other kernels, the region's sweep for the dead, and the transparent
//! layer's looks after its connections — starts only once we hold something it must look
//! after ([`Node::hold`]): a process that joined and holds nothing stays single-threaded (a
//! second thread makes every fd system call and every `fork` dearer). Dropping the last handle
//! leaves the region. Any member may reclaim the members it finds dead.

use crate::error::Error;
use crate::identity;
use crate::liveness::{Liveness, HEARTBEAT_PERIOD};
use crate::region::{CreateRegion, Region, RegionSpec};
use memloop_registry::{
    MemberId, MemberIdentity, Registry, RegistryError, ShmU32, BEAT_LOCKED, BEAT_NONE,
};
use memloop_ring::{WaitPolicy, WakeMode};
use memloop_shm::futex;
use memloop_shm::member_lock::{self, MemberLock};
use memloop_shm::sync::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A handle on our membership; cheap to clone.
#[derive(Clone)]
pub struct Node {
    pub(crate) inner: Arc<NodeInner>,
}

pub(crate) struct NodeInner {
    pub(crate) region: Region,
    pub(crate) id: MemberId,
    pub(crate) liveness: Liveness,
    /// Spin window towards peers in another kernel (see [`vm_spin_from_env`]).
    vm_spin: Duration,
    /// Run by the heartbeat thread on every beat (the transparent layer's sweep for
    /// connections asked to switch paths while their process is in no call of ours).
    on_beat: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// The heartbeat thread runs (or was asked to start).
    beating: AtomicBool,
    /// Our liveness lock (dropped after the leave: see `Drop`).
    lock: Option<MemberLock>,
    /// Our addresses are in our member slot (see [`Node::advertise`]).
    advertised: AtomicBool,
    /// Our network scope when we joined.
    net_scope: u64,
}

/// `MEMLOOP_HEARTBEAT=always`: every member starts its heartbeat thread when it joins (as
/// before the lazy start; for comparisons).
fn heartbeat_always() -> bool {
    std::env::var("MEMLOOP_HEARTBEAT").is_ok_and(|v| v == "always")
}

/// Our liveness lock on slot `idx`'s byte, if the region's file takes locks.
fn take_lock(region: &Region, idx: u32) -> Option<MemberLock> {
    region.lock_file()?;
    let floor = member_lock::private_fd_floor(1 << 16);
    match MemberLock::take(region.path(), u64::from(idx), floor) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::debug!(idx, "no liveness lock ({e}): the heartbeat proves us alive");
            None
        }
    }
}

/// How long a waiter spins before sleeping when its peer runs in another kernel:
/// `MEMLOOP_SPIN_VM_US`, 1000 µs by default. No cheap wake-up crosses kernels (a sleeping
/// poll, or a doorbell through the VMs' network, costs hundreds of µs), so spinning longer pays.
pub fn vm_spin_from_env() -> Duration {
    let us = std::env::var("MEMLOOP_SPIN_VM_US")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    Duration::from_micros(us)
}

impl Node {
    /// Joins `region` under `name` (empty: the process name).
    pub fn join(region: Region, name: &str) -> Result<Node, Error> {
        let ident = identity::current(name);
        let liveness = Liveness::for_member(&region, ident.pid_ns);
        let lazy = !heartbeat_always();
        let mut lock = None;
        let id = join_reclaiming(&region, &ident, &liveness, |idx| {
            lock = take_lock(&region, idx);
            match (&lock, lazy) {
                (Some(_), true) => BEAT_LOCKED | BEAT_NONE,
                (Some(_), false) => BEAT_LOCKED,
                (None, _) => 0,
            }
        })?;
        let beating = !lazy || lock.is_none();
        let inner = Arc::new(NodeInner {
            region,
            id,
            liveness,
            vm_spin: vm_spin_from_env(),
            on_beat: std::sync::OnceLock::new(),
            beating: AtomicBool::new(beating),
            lock,
            advertised: AtomicBool::new(false),
            net_scope: ident.net_scope(),
        });
        // No sweep for the dead here: it scans whole tables, and a process that only
        // connects should not pay for it. The heartbeat sweeps when it starts (a listener
        // restarted on the key of a dead one checks the key's holder itself).
        if beating {
            spawn_heartbeat(Arc::downgrade(&inner));
        }
        tracing::debug!(?id, beating, "joined region");
        let node = Node { inner };
        // Members of other kernels (VMs) die without anyone of theirs left to reclaim them,
        // and only a sweep of ours finds them dead (by their heartbeat): in a region they
        // share, we sweep even while we hold nothing.
        if node
            .region()
            .registry()
            .has_member_booted_elsewhere(&identity::boot_id())
        {
            node.hold();
        }
        Ok(node)
    }

    /// Joins the region named by `MEMLOOP_REGION` (default "default"), creating it if needed.
    pub fn join_default(name: &str) -> Result<Node, Error> {
        let region = Region::open_or_create(&RegionSpec::from_env(), &CreateRegion::default())?;
        Self::join(region, name)
    }

    pub fn id(&self) -> MemberId {
        self.inner.id
    }

    /// The network scope we joined from (see [`memloop_registry::net_scope`]).
    pub fn net_scope(&self) -> u64 {
        self.inner.net_scope
    }

    /// We hold something the heartbeat must look after (a channel, a connection the layer may
    /// switch): starts it if it is not running. One load once it runs.
    pub fn hold(&self) {
        let inner = &self.inner;
        if inner.beating.load(Ordering::Acquire) || inner.beating.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Err(e) = inner.region.registry().start_beating(inner.id) {
            tracing::debug!("cannot start beating: {e}");
        }
        spawn_heartbeat(Arc::downgrade(inner));
    }

    /// Puts the addresses of our network namespace into our member slot (once), so that
    /// others can tell which scope owns an address of ours. Needed before we publish an
    /// endpoint reachable by address or reach for a peer by a non-loopback address (its end
    /// looks us up by ours); a process that only talks over loopback never reads
    /// `/proc/net` for it.
    pub fn advertise(&self) {
        self.inner.advertise();
    }

    /// The fd of our liveness lock (the transparent layer keeps the program off it).
    pub fn liveness_fd(&self) -> Option<std::os::fd::RawFd> {
        self.inner.lock.as_ref()?.fd()
    }

    /// The program is closing our liveness lock's fd: from now on the heartbeat proves us
    /// alive (started first, so no judge sees us without either proof).
    pub fn liveness_fd_closing(&self) {
        self.hold();
        let _ = self.inner.region.registry().lock_given_up(self.inner.id);
    }

    /// Runs `f` on every heartbeat from now on (once per [`HEARTBEAT_PERIOD`], on the
    /// heartbeat thread); false if a hook was set already.
    pub fn on_heartbeat(&self, f: Box<dyn Fn() + Send + Sync>) -> bool {
        self.inner.on_beat.set(f).is_ok()
    }
    pub fn region(&self) -> &Region {
        &self.inner.region
    }
    /// Is `peer` alive (by /proc in our pid namespace, else by its heartbeat)? A dead peer is
    /// reclaimed on the spot, so its channels read as dead for everyone.
    pub fn peer_alive(&self, peer: MemberId) -> bool {
        self.inner.check_peer(peer)
    }

    /// Does `peer` run in our kernel (so the kernel can vouch for it and futexes reach it)?
    pub fn same_kernel(&self, peer: MemberId) -> bool {
        self.inner.same_kernel(peer)
    }

    /// Reclaims every member found dead; returns how many.
    pub fn reclaim_dead(&self) -> usize {
        self.inner.reclaim_dead()
    }
}

/// Joins; if the member table is full, reclaims the dead and tries once more.
fn join_reclaiming(
    region: &Region,
    ident: &MemberIdentity,
    live: &Liveness,
    mut prove: impl FnMut(u32) -> u64,
) -> Result<MemberId, Error> {
    match region.registry().join_with(ident, &mut prove) {
        Err(RegistryError::RegionFull { .. }) => {
            let reg = region.registry();
            // No member id of our own yet: each is reclaimed on behalf of the dead member
            // itself; then one sweep of what they left, for all of them.
            let dead = reg.members().into_iter().filter(|m| !live.is_alive(m));
            if dead
                .filter(|m| reg.reclaim_member(m.id, m.id).is_ok())
                .count()
                > 0
            {
                reg.sweep_leftovers();
            }
            Ok(reg.join_with(ident, prove)?)
        }
        other => Ok(other?),
    }
}

/// How often the region is swept for dead members (by one member on everyone's behalf).
const SWEEP_PERIOD: Duration = Duration::from_secs(1);

fn spawn_heartbeat(node: Weak<NodeInner>) {
    let spawned = std::thread::Builder::new()
        .name("memloop-heartbeat".into())
        .spawn(move || {
            let lane = node
                .upgrade()
                .and_then(|n| n.region.registry().kick_lane(n.id.idx));
            let mut next = Instant::now() + HEARTBEAT_PERIOD;
            let mut seen = lane.as_ref().map(|l| l.load(SeqCst));
            if let Some(n) = node.upgrade() {
                n.sweep_if_turn();
            }
            loop {
                sleep_until_kicked(lane.as_ref(), seen, next);
                // Read before the sweep: a kick during it cuts the next sleep short.
                seen = lane.as_ref().map(|l| l.load(SeqCst));
                let Some(n) = node.upgrade() else { return };
                if Instant::now() >= next {
                    next = Instant::now() + HEARTBEAT_PERIOD;
                    if !n.beat() {
                        return;
                    }
                }
                if let Some(f) = n.on_beat.get() {
                    f();
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start heartbeat thread: {e}");
    }
}

/// Sleeps until `until`, or until our kick lane moves off `seen` (a kick: the sweep runs
/// early). Without a futex on the region's memory (or a lane) only the time ends it.
fn sleep_until_kicked(lane: Option<&ShmU32>, seen: Option<u32>, until: Instant) {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match (lane, seen) {
            (Some(l), Some(v)) if l.load(SeqCst) != v => return,
            (Some(l), Some(v)) if futex::try_wait(l, v, left) => {}
            _ => return std::thread::sleep(left),
        }
    }
}

/// Wakes `member`'s heartbeat now, so its sweep acts on a switch asked of one of its
/// connections while it is in none of our calls. Only an optimisation: a member in another
/// kernel (or one whose lane cannot be futexed) sees the request at its next beat.
pub fn kick(reg: &Registry, member: MemberId) {
    if let Some(lane) = reg.kick_lane(member.idx) {
        futex::bump_and_wake(&lane);
    }
}

impl NodeInner {
    /// Proof of life; false once we are no member any more.
    fn beat(&self) -> bool {
        if self.region.registry().heartbeat(self.id).is_err() {
            return false;
        }
        // Members that die without leaving (SIGKILL, a powered-off VM) hold channels and ring
        // memory until someone reclaims them: one member a second looks, on everyone's behalf
        // (whoever's beat takes the turn), so that happens even when nobody joins; the same
        // sweep gives back the memory of rings freed a while ago.
        if self.sweep_if_turn() {
            self.region.registry().trim_segments(self.id);
        }
        true
    }

    /// Reclaims the dead unless another member swept less than [`SWEEP_PERIOD`] ago.
    fn sweep_if_turn(&self) -> bool {
        let turn = self.region.registry().take_sweep_turn(SWEEP_PERIOD);
        if turn {
            self.reclaim_dead();
        }
        turn
    }

    /// See [`Node::advertise`].
    pub(crate) fn advertise(&self) {
        if self.advertised.load(Ordering::Acquire) || self.advertised.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut addrs = identity::local_addresses();
        addrs.truncate(memloop_registry::MAX_ADDRESSES);
        if let Err(e) = self.region.registry().set_addresses(self.id, &addrs) {
            tracing::warn!("cannot advertise addresses: {e}");
        }
    }

    pub(crate) fn reclaim_dead(&self) -> usize {
        let reg = self.region.registry();
        let dead = reg
            .members()
            .into_iter()
            .filter(|m| m.id != self.id && !self.liveness.is_alive(m));
        let reclaimed = dead
            .filter(|m| reg.reclaim_member(m.id, self.id).is_ok())
            .count();
        // Once for all of them: it scans whole tables (the ring heap's owner tags among them).
        if reclaimed > 0 {
            reg.sweep_leftovers();
        }
        let now = std::time::Instant::now();
        let abandoned = reg
            .claims()
            .into_iter()
            .filter(|&(i, w)| self.liveness.claim_abandoned(i, w, now));
        reclaimed
            + abandoned
                .filter(|&(i, w)| reg.expire_claim(i, w).unwrap_or(false))
                .count()
    }

    /// Is `peer` alive? Reclaims it if not (so its channels are marked dead for everyone).
    pub(crate) fn check_peer(&self, peer: MemberId) -> bool {
        let reg = self.region.registry();
        match reg.member(peer) {
            Ok(info) if self.liveness.is_alive(&info) => true,
            Ok(info) => {
                tracing::debug!(
                    ?peer,
                    pid = info.identity.pid,
                    "peer found dead: reclaiming"
                );
                let _ = reg.reclaim(peer, self.id);
                false
            }
            Err(_) => false,
        }
    }

    /// Futex wake-ups only work with a peer in our kernel; otherwise poll with back-off.
    pub(crate) fn same_kernel(&self, peer: MemberId) -> bool {
        match self.region.registry().member_boot_id(peer) {
            Ok(boot) => boot == identity::boot_id(),
            Err(_) => true,
        }
    }

    pub(crate) fn wait_policy(&self, peer: MemberId) -> WaitPolicy {
        let same = self.same_kernel(peer);
        let mode = if same && self.region.futex_usable() {
            WakeMode::Futex
        } else {
            WakeMode::SleepPoll
        };
        let base = WaitPolicy::default();
        WaitPolicy {
            mode,
            spin: if same { base.spin } else { self.vm_spin },
            max_sleep: Duration::from_millis(if same { 100 } else { 5 }),
        }
    }
}

impl Drop for NodeInner {
    fn drop(&mut self) {
        let _ = self.region.registry().leave(self.id);
    }
}
