//! Per-process state: our membership in the region, found lazily on the first socket call
//! that could use it. With no region (or `MEMLOOP_DISABLE=1`) the library stays dormant.

use crate::forklock::ForkMutex;
use memloop::registry::{MemberId, Registry};
use memloop::{Node, Region, RegionSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tunables, from the environment at first use.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long a server waits at accept for the client's offer to appear.
    pub server_wait: Duration,
    /// Longer bound while a client has announced a connect whose offer is still coming.
    pub server_wait_max: Duration,
    /// The same for a client in another kernel (a VM): its offer can trail its connect by
    /// milliseconds under emulation.
    pub server_wait_vm: Duration,
    /// How long a client waits for the server's decision before cancelling its offer (only
    /// spent when the server program is slow to call accept, or never does).
    pub decide_wait: Duration,
    /// The same when the listener is our own process's: a program that connects to itself
    /// may not accept before it writes (with TCP the write would just be buffered).
    pub decide_wait_self: Duration,
    /// Spin window before a waiter arms its doorbell and sleeps.
    pub spin: Duration,
    /// The same towards a peer in another kernel (a VM), whose doorbell crosses a network.
    pub spin_vm: Duration,
    /// Capacity of each direction's ring.
    pub ring_capacity: u64,
    /// `MEMLOOP_RING_WINDOW`: the window our tx rings are set to at the start instead of the
    /// elastic 16 KiB (`max`: the whole ring, i.e. fixed rings as before elastic windows).
    pub ring_window: Option<u64>,
    /// Follow promotion requests (TCP → ring). On by default; `MEMLOOP_PROMOTE=0` keeps every
    /// connection that left its ring on TCP (a request is then called off).
    pub promote: bool,
    /// How long `pidfd_getfd` of a ring connection's socket waits for the connection to
    /// leave its ring before it fails (`EAGAIN`).
    pub pidfd_wait: Duration,
    /// Wake-ups skip the network stack where they can (peer in our kernel): a thread blocked
    /// alone on a ring connection sleeps on the ring's futex, a poll or epoll sleeper is woken
    /// through its wake socket (`crate::wake`). `MEMLOOP_WAKE=doorbell` sends every wake-up
    /// as a doorbell byte over TCP instead (the previous behaviour, for comparisons).
    pub direct_wake: bool,
    /// `MEMLOOP_EPOLL_INDEX_AT`: ring members from which an epoll set looks only at the
    /// members its wake-ups name (`crate::epoll` "index"); 1 puts every set in that mode
    /// (the event-loop tests run both ways).
    pub epoll_index_at: usize,
}

/// A tunable from the environment: unset means the default; a value that does not parse is
/// said once in the log and also means the default.
fn env_parsed<T: std::str::FromStr>(name: &str) -> Option<T> {
    // Unset (or not Unicode) is the usual case, not an error.
    let s = crate::real::setting(name)?;
    match s.parse() {
        Ok(v) => Some(v),
        Err(_) => {
            tracing::warn!(name, value = %s, "ignoring a tunable that does not parse");
            None
        }
    }
}

fn env_us(name: &str, default: u64) -> Duration {
    Duration::from_micros(env_parsed(name).unwrap_or(default))
}

/// `MEMLOOP_RING_WINDOW`: a power of two ≥ 64, or `max`.
fn ring_window_from_env() -> Option<u64> {
    let v = crate::real::setting("MEMLOOP_RING_WINDOW")?;
    if v == "max" {
        return Some(u64::MAX);
    }
    let w = v
        .parse::<u64>()
        .ok()
        .filter(|w| w.is_power_of_two() && *w >= 64);
    if w.is_none() {
        tracing::warn!(
            v,
            "MEMLOOP_RING_WINDOW must be a power of two >= 64, or max"
        );
    }
    w
}

impl Config {
    /// The longest spin before sleeping towards a peer in our kernel or in another one.
    pub fn spin_for(&self, same_kernel: bool) -> Duration {
        if same_kernel {
            self.spin
        } else {
            self.spin_vm
        }
    }

    fn from_env() -> Self {
        let ring = env_parsed::<u64>("MEMLOOP_RING_BYTES")
            .filter(|v| {
                let ok = v.is_power_of_two() && *v >= 4096;
                if !ok {
                    tracing::warn!(v, "MEMLOOP_RING_BYTES must be a power of two >= 4096");
                }
                ok
            })
            .unwrap_or(memloop::DEFAULT_RING_CAPACITY);
        Config {
            server_wait: env_us("MEMLOOP_SERVER_WAIT_US", 50),
            server_wait_max: env_us("MEMLOOP_SERVER_WAIT_MAX_US", 2_000),
            server_wait_vm: env_us("MEMLOOP_SERVER_WAIT_VM_US", 200_000),
            decide_wait: env_us("MEMLOOP_DECIDE_WAIT_US", 500_000),
            decide_wait_self: env_us("MEMLOOP_DECIDE_WAIT_SELF_US", 5_000),
            spin: env_us("MEMLOOP_SPIN_US", 50),
            spin_vm: memloop::vm_spin_from_env(),
            ring_capacity: ring,
            ring_window: ring_window_from_env(),
            promote: env_parsed::<u32>("MEMLOOP_PROMOTE") != Some(0),
            pidfd_wait: env_us("MEMLOOP_PIDFD_WAIT_US", 2_000_000),
            direct_wake: crate::real::setting("MEMLOOP_WAKE").map_or(true, |v| v != "doorbell"),
            epoll_index_at: env_parsed::<usize>("MEMLOOP_EPOLL_INDEX_AT")
                .filter(|n| *n >= 1)
                .unwrap_or(crate::epoll::INDEX_AT),
        }
    }
}

pub struct Engine {
    pub node: Node,
    /// Our network namespace in this kernel (see `memloop::registry::net_scope`).
    pub scope: u64,
    /// Our kernel's boot id: members with another one are in another kernel.
    pub boot_id: [u8; 16],
    pub cfg: Config,
}

impl Engine {
    pub fn registry(&self) -> &Registry {
        self.node.region().registry()
    }
    pub fn me(&self) -> MemberId {
        self.node.id()
    }
}

enum Slot {
    Unknown,
    /// No region (or disabled); retried at most once per `RETRY`, so a region created later
    /// is picked up without restarting the program.
    Absent(Instant),
    Ready(Arc<Engine>),
}

const RETRY: Duration = Duration::from_secs(1);
static ENGINE: ForkMutex<Slot> = ForkMutex::new(Slot::Unknown);

/// The environment as it was when the library was loaded: some servers (nginx) give their
/// workers a scrubbed environment, but the workers still run our code.
struct Settings {
    disabled: bool,
    region: RegionSpec,
    cfg: Config,
}

static SETTINGS: std::sync::OnceLock<Settings> = std::sync::OnceLock::new();

fn settings() -> &'static Settings {
    SETTINGS.get_or_init(|| Settings {
        disabled: crate::real::setting("MEMLOOP_DISABLE")
            .is_some_and(|v| v != "0" && !v.is_empty()),
        // (The crate's own unit tests run its hooks in the test binary: they must never join
        // a region this machine happens to have, which would put their sockets on rings.)
        region: match cfg!(test) {
            true => RegionSpec::Named("memloop-preload-unit-tests-join-no-region".into()),
            false => crate::real::setting("MEMLOOP_REGION")
                .map_or_else(RegionSpec::from_env, |v| RegionSpec::parse(&v)),
        },
        cfg: Config::from_env(),
    })
}

/// Reads the settings now (called from the library's constructor).
pub fn capture_settings() {
    settings();
    crate::pipe::settings();
    crate::testpoint::capture();
}

pub fn disabled() -> bool {
    settings().disabled
}

/// The region the library joins (`MEMLOOP_REGION` as the process started, else the default).
pub fn region() -> RegionSpec {
    settings().region.clone()
}

/// The engine, joining the region on first use; `None` while dormant.
pub fn get() -> Option<Arc<Engine>> {
    let mut slot = ENGINE.lock();
    match &*slot {
        Slot::Ready(e) => return Some(e.clone()),
        Slot::Absent(at) if at.elapsed() < RETRY => return None,
        _ => {}
    }
    match start() {
        Some(e) => {
            *slot = Slot::Ready(e.clone());
            Some(e)
        }
        None => {
            *slot = Slot::Absent(Instant::now());
            None
        }
    }
}

/// Says once why the library stays dormant (it retries about once a second: a server that
/// never gets a region would otherwise log it forever); again only if the reason changes.
fn dormant(why: String) {
    static SAID: ForkMutex<Option<String>> = ForkMutex::new(None);
    let mut said = SAID.lock();
    if said.as_deref() != Some(why.as_str()) {
        tracing::info!("memloop dormant (the program runs on the kernel path): {why}");
        *said = Some(why);
    }
}

fn start() -> Option<Arc<Engine>> {
    if disabled() {
        return None;
    }
    let region = match Region::open(&settings().region) {
        Ok(r) => r,
        Err(e) => {
            dormant(format!("{e}"));
            return None;
        }
    };
    let node = match Node::join(region, "") {
        Ok(n) => n,
        Err(e) => {
            dormant(format!("cannot join the region: {e}"));
            return None;
        }
    };
    let scope = node.net_scope();
    tracing::debug!(member = ?node.id(), scope, "memloop transparent layer active");
    if let Some(fd) = node.liveness_fd() {
        // The program may close it (`closefrom`): `own_fd_closing` hears of it.
        crate::table::mark_own(fd);
        LOCK_FD.store(fd, std::sync::atomic::Ordering::Relaxed);
    }
    // Connections asked to switch paths while the program is in none of our calls.
    node.on_heartbeat(Box::new(|| {
        crate::hooks::track("switch sweep", crate::conn::sweep_switches);
        crate::hooks::track("late ring", crate::late::tick);
        crate::hooks::track("held sockets", crate::conn::linger::release_done);
    }));
    Some(Arc::new(Engine {
        node,
        scope,
        boot_id: memloop::identity::boot_id(),
        cfg: settings().cfg.clone(),
    }))
}

pub fn lock_for_fork() {
    ENGINE.acquire_for_fork(|_| {});
}

pub fn release_after_fork() {
    ENGINE.release_after_fork();
}

/// Set in a fork child that inherited connections: it has no heartbeat (the parent's thread
/// is not copied), so nothing would notice a switch asked of them while the child waits
/// somewhere. Its next call joins the region, which starts one.
static CHILD_NEEDS_HEARTBEAT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

pub fn child_needs_heartbeat() {
    CHILD_NEEDS_HEARTBEAT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Starts the heartbeat of a fork child that needs one (one load otherwise).
#[inline]
pub fn ensure_heartbeat() {
    if CHILD_NEEDS_HEARTBEAT.load(std::sync::atomic::Ordering::Relaxed)
        && CHILD_NEEDS_HEARTBEAT.swap(false, std::sync::atomic::Ordering::AcqRel)
    {
        if let Some(e) = get() {
            e.node.hold();
        }
    }
}

/// The fd of our member's liveness lock (-1: none), marked the library's own.
static LOCK_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// The program closes `fd`, one of the library's own: if it is our liveness lock, the
/// heartbeat takes over proving us alive before the lock goes.
pub fn own_fd_closing(fd: libc::c_int) {
    use std::sync::atomic::Ordering::Relaxed;
    if fd < 0 || LOCK_FD.compare_exchange(fd, -1, Relaxed, Relaxed).is_err() {
        return;
    }
    if let Slot::Ready(e) = &*ENGINE.lock() {
        tracing::debug!(fd, "the program closes our liveness lock: beating instead");
        e.node.liveness_fd_closing();
    }
}

/// In a fork child: the parent's membership (and its heartbeat thread) belong to the parent;
/// forget it without leaving the region, and join afresh on next use. (Its liveness lock's fd
/// was closed here by `memloop_shm::member_lock`.)
pub fn reset_in_child() {
    let mut slot = ENGINE.lock();
    if let Slot::Ready(e) = std::mem::replace(&mut *slot, Slot::Unknown) {
        std::mem::forget(e);
    }
    let fd = LOCK_FD.swap(-1, std::sync::atomic::Ordering::Relaxed);
    if fd >= 0 {
        crate::table::unmark_own(fd);
    }
}
