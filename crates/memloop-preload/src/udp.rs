//! Transparent UDP: a UDP socket of the program, published as a datagram endpoint once it is
//! bound, sends to member sockets through datagram pairs (`memloop::datagram`) and receives
//! from its pairs and from its kernel socket (non-members, broadcast, multicast) at once.
//!
//! - **Order.** A receive serves the rings before the kernel socket, so a peer that moved
//!   from its ring to the kernel path (the receiver left the ring, a datagram too large for
//!   the ring) never has a later datagram overtake an earlier one.
//! - **Never blocking a sender.** A full receiver drops the datagram and counts it (the send
//!   succeeds, as UDP's does); a receiver that closed or left the ring gets it by the kernel.
//! - **Waking.** Every socket has a wake socket of its own (`wake.rs`): its sleepers — a
//!   blocking receive, `poll`/`select` — sleep in the kernel on the UDP socket and the wake
//!   socket at once, with the socket's doorbell armed with the wake socket's target; a
//!   sender's datagram into an empty ring sends one wake-up. One target per socket means any
//!   number of threads may sleep on it.
//! - **The kernel path, for good** (counted `unsupported`): a socket put into an epoll set,
//!   shared with another process (fork, exec, `SCM_RIGHTS`), with `SO_REUSEPORT`, or asking
//!   for ancillary data (`IP_PKTINFO`…) leaves its ring: its endpoint goes, its peers' next
//!   datagrams go by the kernel, and what its rings still hold is received first.

use crate::engine::{self, Engine};
use crate::real;
use crate::wake::WakeSocket;
use libc::c_int;
use memloop::datagram::{canonical, DatagramSocket, ScopedAddr, Sent, WAKE_LEN};
use memloop::registry::FallbackReason;
use memloop::ring::RecvInfo;
use memloop::Error;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest sleep of a receive before it looks at its rings again without a wake-up (a
/// wake-up cannot be lost, but a sender in another kernel sends none).
const SLICE: Duration = Duration::from_millis(200);
/// Destinations whose path a socket remembers (beyond this the memory starts over).
const MAX_PATHS: usize = 4096;

/// How datagrams to one destination travel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PeerPath {
    /// A member socket's address in this scope.
    Ring(u64),
    /// The kernel's: no member there, or the ring cannot carry what we sent it.
    Kernel,
}

/// The paths of a socket's destinations, the last one used first (a socket usually sends to
/// the same peer again: no hashing then).
#[derive(Default)]
struct Paths {
    last: Option<(SocketAddr, PeerPath)>,
    map: HashMap<SocketAddr, PeerPath>,
}

impl Paths {
    fn get(&mut self, dst: SocketAddr) -> Option<PeerPath> {
        match self.last {
            Some((d, p)) if d == dst => Some(p),
            _ => {
                let p = *self.map.get(&dst)?;
                self.last = Some((dst, p));
                Some(p)
            }
        }
    }

    fn remember(&mut self, dst: SocketAddr, p: PeerPath) {
        if self.map.len() >= MAX_PATHS {
            self.map.clear();
        }
        self.map.insert(dst, p);
        self.last = Some((dst, p));
    }
}

pub struct UdpSock {
    engine: Arc<Engine>,
    family: c_int,
    core: DatagramSocket,
    wake: WakeSocket,
    /// Threads (and polls) asleep on this socket; the doorbell is armed while there are any.
    sleepers: Mutex<u32>,
    /// The adaptive spin window of waits on this socket (a blocking receive, a poll).
    spinner: crate::conn::Spinner,
    /// The peer of a connected socket (canonical): the default destination and the only
    /// source received from.
    connected: Mutex<Option<SocketAddr>>,
    paths: Mutex<Paths>,
    /// For a wildcard bind: the source address the kernel's route picks, per destination.
    routes: Mutex<HashMap<IpAddr, IpAddr>>,
    pub(crate) nonblock: AtomicBool,
    /// `SO_RCVTIMEO` in µs (0: none), kept as the program sets it.
    rcvtimeo_us: AtomicU64,
    /// Left the ring for good (see the module text).
    off: AtomicBool,
    pub(crate) ring_sent: AtomicU64,
    pub(crate) ring_received: AtomicU64,
    pub(crate) kernel_sent: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A datagram socket created under the library: a candidate until it is published.
pub fn is_udp(domain: c_int, ty: c_int, proto: c_int) -> bool {
    let inet = domain == libc::AF_INET || domain == libc::AF_INET6;
    inet && ty & 0xf == libc::SOCK_DGRAM && (proto == 0 || proto == libc::IPPROTO_UDP)
}

/// Sends the wake-up a sleeper outside the ring asked for (the flag's target).
fn wake_target(flag: u32) {
    let t = memloop::ring::wait::flag_target(flag);
    if t != 0 {
        crate::wake::send(t, 0);
    }
}

impl UdpSock {
    /// Publishes the bound socket `fd`; `Err` with the reason it stays on the kernel path.
    /// `chosen`: the kernel picked the port (a bind to port 0, or the first send's): no
    /// other socket can share it, whatever `SO_REUSEPORT` says.
    pub fn publish(fd: c_int, chosen: bool) -> Result<Arc<UdpSock>, FallbackReason> {
        let engine = engine::get().ok_or(FallbackReason::Disabled)?;
        if crate::dispatch::io_uring_used() {
            return Err(FallbackReason::Unsupported);
        }
        let reuseport = real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT) == Some(1);
        if reuseport && !chosen {
            return Err(FallbackReason::Unsupported); // a group: the kernel's hash picks
        }
        let local = real::local_addr(fd).ok_or(FallbackReason::Error)?;
        let family = match local {
            SocketAddr::V4(_) => libc::AF_INET,
            SocketAddr::V6(_) => libc::AF_INET6,
        };
        // An IPv6-only wildcard socket must not be found by IPv4 senders: not ours.
        let v6only = real::sockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) == Some(1);
        if family == libc::AF_INET6 && v6only && local.ip().is_unspecified() {
            return Err(FallbackReason::Unsupported);
        }
        let wake = WakeSocket::create().ok_or(FallbackReason::Unsupported)?;
        let me = ScopedAddr {
            scope: engine.scope,
            addr: canonical(local),
        };
        let mut core = DatagramSocket::publish(&engine.node, me).map_err(|e| {
            tracing::debug!(fd, %local, "UDP socket not published: {e}");
            e.fallback_reason()
        })?;
        core.set_waker(wake_target);
        // (The system's default is no limit of ours: the ring holds a little more, and
        // checking a limit on every datagram costs a look at the receiver's index.)
        core.set_recv_buffer(
            Some(rcvbuf(fd))
                .filter(|&b| b != default_rcvbuf())
                .unwrap_or(0),
        );
        tracing::debug!(fd, %local, "UDP socket published");
        let spinner = crate::conn::Spinner::new(udp_spin(&engine));
        Ok(Arc::new(UdpSock {
            engine,
            family,
            core,
            wake,
            sleepers: Mutex::new(0),
            spinner,
            connected: Mutex::new(real::peer_addr(fd).map(canonical)),
            paths: Mutex::new(Paths::default()),
            routes: Mutex::new(HashMap::new()),
            nonblock: AtomicBool::new(real::status_flags(fd) & libc::O_NONBLOCK != 0),
            rcvtimeo_us: AtomicU64::new(rcvtimeo_us(fd)),
            off: AtomicBool::new(false),
            ring_sent: AtomicU64::new(0),
            ring_received: AtomicU64::new(0),
            kernel_sent: AtomicU64::new(0),
        }))
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.core.local_addr()
    }

    pub fn on_ring(&self) -> bool {
        !self.off.load(Relaxed)
    }

    /// Leaves the ring for good (counted once): the endpoint goes and every pair is closed,
    /// so peers send by the kernel from their next datagram; queued datagrams stay readable.
    pub fn leave(&self, why: &str, reason: FallbackReason) {
        if self.off.swap(true, Relaxed) {
            return;
        }
        tracing::debug!(addr = %self.local_addr(), "UDP socket leaves its ring: {why}");
        self.core.retire();
        self.flush_returned(None);
        self.engine.registry().count_fallback(reason);
    }

    /// The program set `SO_RCVBUF` (or `SO_RCVBUFFORCE`) on `fd`: senders' new pairs and
    /// their drops follow what the kernel made of it.
    pub fn refresh_rcvbuf(&self, fd: c_int) {
        self.core.set_recv_buffer(rcvbuf(fd));
    }

    /// The program set `SO_RCVTIMEO` on `fd`.
    pub fn refresh_timeout(&self, fd: c_int) {
        self.rcvtimeo_us.store(rcvtimeo_us(fd), Relaxed);
    }

    pub fn rcvtimeo(&self) -> Option<Duration> {
        match self.rcvtimeo_us.load(Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    pub fn set_connected(&self, peer: Option<SocketAddr>) {
        *lock(&self.connected) = peer.map(canonical);
    }

    pub fn connected(&self) -> Option<SocketAddr> {
        *lock(&self.connected)
    }

    // ---- sending ----------------------------------------------------------------------------

    /// Sends the datagram `parts` to `dst` by the ring if a member socket is bound there:
    /// `Some(len)` if the ring took it (or dropped it, as a full UDP receiver would), `None`
    /// if the kernel must send it (counted, and the destination kept on the kernel path).
    pub fn send(&self, fd: c_int, parts: &[&[u8]], dst: SocketAddr) -> Option<usize> {
        self.flush_returned(Some(fd));
        if !self.on_ring() {
            return self.by_kernel(dst);
        }
        let dst = canonical(dst);
        let PeerPath::Ring(scope) = self.path_to(dst) else {
            self.kernel_sent.fetch_add(1, Relaxed); // (remembered there already)
            return None;
        };
        let Some(src) = self.source_for(dst) else {
            return self.by_kernel(dst);
        };
        let len = parts.iter().map(|p| p.len()).sum();
        match self
            .core
            .send_parts_to(parts, src, ScopedAddr { scope, addr: dst })
        {
            Ok(Sent::Delivered) => {
                self.ring_sent.fetch_add(1, Relaxed);
                for ch in self.core.take_opened() {
                    // A receiver that had no pair may be blocked in the kernel: wake it there.
                    let wake = memloop::datagram::wake_payload(ch);
                    real::send_datagram(fd, &wake, dst, self.family);
                }
                Some(len)
            }
            Ok(Sent::Dropped(memloop::datagram::DropReason::Full)) => Some(len),
            // The receiver closed or left its ring: the kernel delivers it (or says why not),
            // after what the receiver handed back.
            Ok(Sent::Dropped(_)) | Err(Error::NoService(_)) => {
                self.flush_returned(Some(fd));
                self.by_kernel(dst)
            }
            Err(e) => {
                // Too large for this pair's ring, or a ring error: the kernel path from now
                // on for this destination (after what the ring holds: no reordering).
                tracing::debug!(%dst, "UDP datagram to the kernel path: {e}");
                self.by_kernel(dst)
            }
        }
    }

    /// The datagram to `dst` goes by the kernel: counted, and `dst` stays there.
    fn by_kernel(&self, dst: SocketAddr) -> Option<usize> {
        self.sent_by_kernel(Some(dst));
        None
    }

    /// Sends by the kernel what receivers handed back to us unread (they left their rings),
    /// in order, so that whoever holds their sockets now gets it. From `fd`, or any fd of
    /// ours for this socket. One load when there is nothing.
    pub fn flush_returned(&self, fd: Option<c_int>) {
        let back = self.core.take_returned();
        if back.is_empty() {
            return;
        }
        let Some(fd) = fd.or_else(|| self.some_fd()) else {
            tracing::debug!(
                n = back.len(),
                "handed-back datagrams lost: the socket is closed"
            );
            return;
        };
        for (dst, d) in back {
            if !real::send_datagram(fd, &d, dst, self.family) {
                tracing::debug!(%dst, "a handed-back datagram refused by the kernel: dropped");
            }
            self.sent_by_kernel(Some(dst));
        }
        self.core.withdrawal_sent();
    }

    /// The socket's last fd `fd` closes (or the process exits): what the rings cannot deliver
    /// any more goes by the kernel now — datagrams in pairs their receivers have not taken yet
    /// (their offers withdrawn) and what receivers handed back.
    pub fn before_close(&self, fd: c_int) {
        for (dst, d) in self.core.withdraw_untaken() {
            if !real::send_datagram(fd, &d, dst, self.family) {
                tracing::debug!(%dst, "a withdrawn datagram refused by the kernel: dropped");
            }
        }
        self.flush_returned(Some(fd));
        self.core.withdrawal_sent();
    }

    /// An fd of this process naming this socket.
    fn some_fd(&self) -> Option<c_int> {
        crate::table::all()
            .into_iter()
            .find_map(|(fd, e)| match &*e {
                crate::table::Entry::Udp(u) if std::ptr::eq(Arc::as_ptr(u), self) => Some(fd),
                _ => None,
            })
    }

    fn remember(&self, dst: SocketAddr, p: PeerPath) {
        lock(&self.paths).remember(dst, p);
    }

    /// The path to `dst`, looked up once: a member's socket address on the ring. A
    /// destination once sent to by the kernel stays there (its datagrams may still be in
    /// the receiver's kernel queue, where a ring datagram would overtake them).
    fn path_to(&self, dst: SocketAddr) -> PeerPath {
        if let Some(p) = lock(&self.paths).get(dst) {
            return p;
        }
        let p = match member_path(&self.engine, dst) {
            Ok(scope) => PeerPath::Ring(scope),
            Err(reason) => {
                tracing::debug!(%dst, %reason, "UDP datagrams to the kernel path");
                self.engine.registry().count_fallback(reason);
                PeerPath::Kernel
            }
        };
        self.remember(dst, p);
        p
    }

    /// Our address as the receiver must see it: the bound one, or the route's for a
    /// wildcard bind.
    fn source_for(&self, dst: SocketAddr) -> Option<SocketAddr> {
        let me = self.local_addr();
        if !me.ip().is_unspecified() {
            return Some(me);
        }
        if let Some(&ip) = lock(&self.routes).get(&dst.ip()) {
            return Some(SocketAddr::new(ip, me.port()));
        }
        let ip = real::route_source(dst, self.family)?;
        let mut routes = lock(&self.routes);
        if routes.len() >= MAX_PATHS {
            routes.clear();
        }
        routes.insert(dst.ip(), ip);
        Some(SocketAddr::new(ip, me.port()))
    }

    /// A datagram we sent by the kernel to `dst`: that destination stays there.
    pub fn sent_by_kernel(&self, dst: Option<SocketAddr>) {
        self.kernel_sent.fetch_add(1, Relaxed);
        if let Some(d) = dst.map(canonical) {
            let mut paths = lock(&self.paths);
            if paths.get(d) != Some(PeerPath::Kernel) {
                paths.remember(d, PeerPath::Kernel);
            }
        }
    }

    // ---- receiving --------------------------------------------------------------------------

    /// The next datagram from the rings, without waiting (connected: only from the peer).
    pub fn try_ring(
        &self,
        buf: &mut [u8],
        peek: bool,
    ) -> Result<Option<(RecvInfo, SocketAddr)>, c_int> {
        let got = self
            .core
            .try_recv_from(buf, peek, self.connected())
            .map_err(|e| {
                tracing::debug!("UDP ring receive: {e}");
                libc::EIO
            })?;
        self.flush_returned(None);
        if got.is_some() && !peek {
            self.ring_received.fetch_add(1, Relaxed);
        }
        Ok(got)
    }

    /// Length of the next ring datagram (`FIONREAD`).
    pub fn next_len(&self) -> Option<u64> {
        let n = self.core.next_len().ok().flatten();
        self.flush_returned(None);
        n
    }

    pub fn ring_readable(&self) -> bool {
        self.next_len().is_some()
    }

    /// Whether the socket has ring peers: without any, a blocking receive sleeps in the
    /// kernel (a new peer's first datagram comes with a wake datagram there).
    pub fn has_ring_peers(&self) -> bool {
        self.core.has_pairs()
    }

    /// Whether `b`, received from the kernel, is a wake datagram (swallowed: see
    /// [`memloop::datagram::WAKE_MAGIC`]).
    pub fn is_wake(&self, b: &[u8]) -> bool {
        self.core.is_wake(b)
    }

    /// Waits until the rings or the kernel socket `fd` may have a datagram (`Ok(true)`: the
    /// kernel's), or `deadline` passes (`Err(EAGAIN)`), or a signal (`Err(EINTR)`, or a
    /// restart as the kernel would).
    pub fn wait(&self, fd: c_int, deadline: Option<Instant>) -> Result<bool, c_int> {
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Err(libc::EAGAIN);
            }
            match self.sleep(fd, libc::POLLIN, left.map_or(SLICE, |l| l.min(SLICE))) {
                Ok(Some(kernel)) => return Ok(kernel),
                Ok(None) => {}
                Err(libc::EINTR) if deadline.is_none() && real::signals_restart() => {}
                Err(e) => return Err(e),
            }
            if crate::cancel::asked_here() {
                return Err(libc::EINTR);
            }
        }
    }

    /// A receive that found nothing, with a sender withdrawing its offer to us (it closed
    /// before we took it, and sends its datagrams by the kernel instead): waits a moment on
    /// `fd` for them and says so (true: look again), up to [`WITHDRAWAL_WAIT`] in all from
    /// the first call (`since`). The kernel had queued them at the send, so a receiver told
    /// by other means that they were sent must find them.
    pub fn await_withdrawal(&self, fd: c_int, since: &mut Option<Instant>) -> bool {
        if !self.core.withdrawal_pending() {
            return false;
        }
        let start = *since.get_or_insert_with(Instant::now);
        if start.elapsed() >= WITHDRAWAL_WAIT {
            tracing::debug!("a withdrawal outlasted its wait: the receive goes on without it");
            return false;
        }
        let _ = real::wait_fd(fd, libc::POLLIN, Some(Duration::from_millis(1)));
        true
    }

    /// Spins (while spinning can pay, in the socket's adaptive window) until `ready`. Only a
    /// socket with ring peers spins: for the kernel's datagrams a sleep costs what it did.
    pub fn spin(&self, ready: impl FnMut() -> bool) -> bool {
        self.core.has_pairs()
            && self
                .spinner
                .spin_with(udp_spin(&self.engine), || self.core.spin_inputs(), ready)
    }

    /// [`Self::spin`] until a ring datagram is there, or the kernel socket `fd` is readable
    /// (looked at now and then: a system call costs as much as many looks at the rings).
    pub fn spin_for_data(&self, fd: c_int) -> bool {
        let mut n = 0u32;
        self.spin(|| {
            n = n.wrapping_add(1);
            self.ring_readable() || (n % 128 == 0 && kernel_readable(fd))
        })
    }

    /// One sleep in the kernel on `fd` (for `events`) and our wake socket, the doorbell
    /// armed: `Ok(Some(kernel))` if something may be ready (`kernel`: on `fd`), `Ok(None)` if
    /// the time ran out.
    fn sleep(&self, fd: c_int, events: i16, left: Duration) -> Result<Option<bool>, c_int> {
        self.enter_sleep();
        if self.ring_readable() {
            self.leave_sleep(false);
            return Ok(Some(false));
        }
        let mut set = [
            libc::pollfd {
                fd,
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let r = real::ppoll_raw(&mut set, Some(left), std::ptr::null());
        self.leave_sleep(set[1].revents != 0);
        r.map(|n| (n > 0).then_some(set[0].revents != 0))
    }

    /// Arms the doorbell with our wake socket's target for one more sleeper.
    pub fn enter_sleep(&self) {
        let mut n = lock(&self.sleepers);
        *n += 1;
        let t = self.wake.target();
        if t != 0 {
            self.core
                .bell()
                .set_flag(memloop::ring::wait::target_bits(t));
        }
    }

    /// Sets the doorbell again for the sleepers there are (a sender's wake-up cleared it).
    pub fn rearm(&self) {
        let n = lock(&self.sleepers);
        let t = self.wake.target();
        if *n > 0 && t != 0 {
            self.core
                .bell()
                .set_flag(memloop::ring::wait::target_bits(t));
        }
    }

    /// Datagrams the program received from the rings so far (part of an epoll edge
    /// signature).
    pub fn ring_received(&self) -> u64 {
        self.ring_received.load(Relaxed)
    }

    /// The spin window of waits on this socket (none without ring peers).
    pub fn spin_window(&self) -> Duration {
        match self.core.has_pairs() {
            true => udp_spin(&self.engine),
            false => Duration::ZERO,
        }
    }

    /// One sleeper less; the last one out disarms and reads the wake-ups (never earlier:
    /// a wake-up read while another thread sleeps could be the one that thread needed) —
    /// only if one can be there: a sender cleared the flag, or a sleeper saw the socket
    /// readable (`saw`).
    pub fn leave_sleep(&self, saw: bool) {
        let mut n = lock(&self.sleepers);
        *n = n.saturating_sub(1);
        if *n == 0 {
            let cleared = self.core.bell().set_flag(0) == 0;
            if cleared || saw {
                self.wake.drain();
            }
        }
    }

    /// Our wake socket's fd (a poll sleeping on this socket listens on it too).
    pub fn wake_fd(&self) -> c_int {
        self.wake.fd()
    }

    pub fn family(&self) -> c_int {
        self.family
    }
}

/// A UDP wait's longest spin: four times a connection's. Its window shrinks to a quarter of
/// this after misses, and must stay above what waking a sleeping peer costs (its wake socket,
/// then its whole turn): below, two peers exchanging 16 KB datagrams settle into both
/// sleeping at every exchange (35 µs round trips instead of 5).
fn udp_spin(engine: &Engine) -> Duration {
    engine.cfg.spin * 4
}

/// A new socket's receive buffer (`net.core.rmem_default`), read once.
fn default_rcvbuf() -> u64 {
    static DEFAULT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *DEFAULT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/core/rmem_default")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(212_992)
    })
}

/// `fd`'s receive buffer as the kernel reports it (doubled for its bookkeeping, clamped to
/// `rmem_max`): the bytes our rings to it may queue. 0: unknown.
fn rcvbuf(fd: c_int) -> u64 {
    real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF).map_or(0, |b| b.max(0) as u64)
}

fn rcvtimeo_us(fd: c_int) -> u64 {
    real::sockopt_timeout(fd, libc::SO_RCVTIMEO).map_or(0, |t| (t.as_micros() as u64).max(1))
}

/// How long a receive waits at most for a sender's withdrawn datagrams (a sender re-sends a
/// full ring by the kernel in milliseconds; one killed mid-way is reclaimed by a sweep).
const WITHDRAWAL_WAIT: Duration = Duration::from_millis(250);

fn kernel_readable(fd: c_int) -> bool {
    matches!(real::wait_fd(fd, libc::POLLIN, Some(Duration::ZERO)), Ok(ev) if ev != 0)
}

/// After a successful `bind` of a candidate to `asked` (its port 0: the kernel's choice):
/// publish it (or leave it to the kernel, counted).
pub fn after_bind(fd: c_int, asked: Option<SocketAddr>) {
    let chosen = asked.map_or(true, |a| a.port() == 0);
    match UdpSock::publish(fd, chosen) {
        Ok(u) => {
            crate::table::insert(fd, crate::table::Entry::Udp(u));
        }
        Err(reason) => {
            tracing::debug!(fd, %reason, "UDP socket stays on the kernel path");
            if let Some(e) = engine::get() {
                e.registry().count_fallback(reason);
            }
            crate::table::remove(fd);
        }
    }
}

/// The scope of the member socket bound at `dst`, or why datagrams to it take the kernel
/// path (no member owns the address, or none of its sockets is bound there).
/// Sockets in another kernel (a VM) stay on the kernel path: their sleepers cannot be woken
/// by our wake sockets, only polled.
fn member_path(engine: &Engine, dst: SocketAddr) -> Result<u64, FallbackReason> {
    let scope = crate::agree::scope_of(engine, dst.ip())?;
    let at = ScopedAddr { scope, addr: dst };
    match memloop::datagram::member_socket_owner(engine.registry(), at) {
        Some(owner) if engine.node.same_kernel(owner) => Ok(scope),
        Some(_) => Err(FallbackReason::Unsupported),
        None => Err(FallbackReason::NoListener),
    }
}

/// A few destinations this thread found no member socket at, with the registry's endpoints
/// epoch of that moment: the answer stands while it has not moved, so a socket sending to a
/// non-member (a DNS client) pays one load a datagram, not a lookup of three keys. Plain
/// `Copy` data: no destructor to register for the thread.
type KernelDest = Option<(SocketAddr, u64)>;
thread_local! {
    static KERNEL_DESTS: std::cell::Cell<([KernelDest; 4], usize)> =
        const { std::cell::Cell::new(([None; 4], 0)) };
}

fn known_kernel(dst: SocketAddr, epoch: u64) -> bool {
    KERNEL_DESTS.with(|c| c.get().0.contains(&Some((dst, epoch))))
}

fn remember_kernel(dst: SocketAddr, epoch: u64) {
    KERNEL_DESTS.with(|c| {
        let (mut v, next) = c.get();
        v[next] = Some((dst, epoch));
        c.set((v, (next + 1) % v.len()));
    });
}

/// Destinations of sockets not published whose kernel path was counted already (a socket
/// without state of its own sends there on every datagram: counted once per destination).
static COUNTED: crate::forklock::ForkMutex<Vec<SocketAddr>> =
    crate::forklock::ForkMutex::new(Vec::new());

fn count_once(engine: &Engine, dst: SocketAddr, reason: FallbackReason) {
    let mut seen = COUNTED.lock();
    if seen.contains(&dst) {
        return;
    }
    if seen.len() >= 256 {
        seen.clear();
    }
    seen.push(dst);
    engine.registry().count_fallback(reason);
}

/// Before a send on a candidate that is not published: if `dst` is a member's socket,
/// bind it as the kernel would (wildcard, a free port) and publish it.
pub fn before_first_send(fd: c_int, dst: SocketAddr) -> Option<Arc<UdpSock>> {
    let engine = engine::get()?;
    let dst = canonical(dst);
    // (Read before the lookup: an endpoint added meanwhile moves it.)
    let epoch = engine.registry().endpoints_epoch();
    if known_kernel(dst, epoch) {
        return None;
    }
    if let Err(reason) = member_path(&engine, dst) {
        count_once(&engine, dst, reason);
        remember_kernel(dst, epoch);
        return None;
    }
    let bound = real::local_addr(fd).is_some_and(|a| a.port() != 0);
    if !bound {
        let family = match real::local_addr(fd) {
            Some(SocketAddr::V6(_)) => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        real::bind_any(fd, family).ok()?;
    }
    after_bind(fd, None);
    crate::table::udp(fd)
}

/// `connect` on a UDP socket of ours (`None`: not one): the kernel's connect, then the
/// connected peer recorded (`AF_UNSPEC`: none); a candidate connecting to a member's socket
/// is published (the kernel bound it).
pub fn connect(
    fd: c_int,
    dst: Option<SocketAddr>,
    kernel: impl FnOnce() -> c_int,
) -> Option<c_int> {
    let u = match crate::table::kind(fd) {
        crate::table::K_UDP => None,
        crate::table::K_OBJ => Some(crate::table::udp(fd)?),
        _ => return None,
    };
    let r = kernel();
    if r != 0 {
        return Some(r);
    }
    let err = real::errno();
    match (u, dst) {
        (Some(u), d) => u.set_connected(d),
        (None, Some(d)) => {
            if let Some(u) = before_first_send(fd, d) {
                u.set_connected(Some(d));
            }
        }
        (None, None) => {}
    }
    real::set_errno(err);
    Some(r)
}

/// Socket options whose effect the ring cannot reproduce: ancillary data on receive,
/// `SO_REUSEPORT` groups, segmentation offload, corking.
pub fn kernel_only_option(level: c_int, opt: c_int) -> bool {
    match level {
        // (SO_REUSEPORT counts at bind: `UdpSock::publish`.)
        libc::SOL_SOCKET => matches!(
            opt,
            libc::SO_TIMESTAMP
                | libc::SO_TIMESTAMPNS
                | libc::SO_TIMESTAMPING
                | libc::SO_RXQ_OVFL
                | libc::SO_BINDTODEVICE
        ),
        libc::IPPROTO_IP => matches!(
            opt,
            libc::IP_PKTINFO
                | libc::IP_RECVTOS
                | libc::IP_RECVTTL
                | libc::IP_RECVERR
                | libc::IP_RECVOPTS
                | libc::IP_RETOPTS
                | libc::IP_RECVORIGDSTADDR
                | libc::IP_TRANSPARENT
        ),
        libc::IPPROTO_IPV6 => matches!(
            opt,
            libc::IPV6_RECVPKTINFO
                | libc::IPV6_RECVHOPLIMIT
                | libc::IPV6_RECVTCLASS
                | libc::IPV6_RECVERR
                | libc::IPV6_RECVPATHMTU
                | libc::IPV6_RECVORIGDSTADDR
        ),
        libc::IPPROTO_UDP => matches!(opt, libc::UDP_CORK | libc::UDP_SEGMENT | libc::UDP_GRO),
        _ => false,
    }
}

/// The UDP socket `fd` takes the kernel path for good (`why` logged, counted once under
/// `reason`).
pub fn kernel_only(fd: c_int, why: &str, reason: FallbackReason) {
    match crate::table::kind(fd) {
        crate::table::K_UDP => {
            tracing::debug!(fd, "UDP socket stays on the kernel path: {why}");
            if let Some(e) = engine::get() {
                e.registry().count_fallback(reason);
            }
            crate::table::remove(fd);
        }
        crate::table::K_OBJ => {
            if let Some(u) = crate::table::udp(fd) {
                u.leave(why, reason);
            }
        }
        _ => {}
    }
}

/// At `exit`: every socket's ring datagrams that nobody could deliver after it go by the
/// kernel (see [`UdpSock::before_close`]), as the kernel delivers what a process
/// sent before it exited.
pub fn deliver_pending() {
    crate::table::each(|fd, e| {
        if let crate::table::Entry::Udp(u) = e {
            u.before_close(fd);
        }
    });
}

/// Every UDP socket of ours that another process may now hold (fork, exec, fds passed)
/// leaves its ring: two processes must not read one socket's rings.
pub fn leave_all(why: &str) {
    for u in crate::table::udps() {
        u.leave(why, FallbackReason::ForkOrExec);
    }
}

/// In a fork child: the parent's UDP sockets are the parent's to carry (it left their rings
/// in its own handler); ours become plain kernel sockets, forgotten without touching the
/// region (dropping them would remove the parent's endpoints).
pub fn forget_in_child() {
    let mut ours = Vec::new();
    crate::table::each(|fd, e| {
        if let crate::table::Entry::Udp(_) = e {
            ours.push(fd);
        }
    });
    for fd in ours {
        if let Some(e) = crate::table::remove(fd) {
            std::mem::forget(e);
        }
    }
}

/// Before an exec into an image without the library: the wake datagrams at the head of
/// every inheritable UDP socket's queue are dropped (that image would read them as data; one
/// with the library swallows them itself). The datagrams they announced were handed back and
/// come by the kernel.
pub fn drop_stale_wakes_before_exec() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<c_int>().ok()));
    for fd in fds {
        let dgram =
            real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_DGRAM);
        if !dgram || real::fd_flags(fd) & libc::FD_CLOEXEC != 0 {
            continue;
        }
        while let Some((WAKE_LEN, head)) = real::peek_datagram(fd) {
            if !memloop::datagram::looks_like_wake(&head) {
                break;
            }
            real::drop_datagram(fd);
        }
    }
}

/// [`leave_all`] for the sockets a spawned child inherits (no close-on-exec).
pub fn leave_inheritable(why: &str) {
    for (fd, e) in crate::table::all() {
        if let crate::table::Entry::Udp(u) = &*e {
            if real::fd_flags(fd) & libc::FD_CLOEXEC == 0 {
                u.leave(why, FallbackReason::ForkOrExec);
            }
        }
    }
}
