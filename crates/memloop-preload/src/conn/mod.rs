//! One TCP connection that reached a co-resident peer: a ring in each direction, plus the real
//! kernel socket, which stays open as the liveness proof (the peer's kernel closes it when the
//! last process holding it is gone) and carries one doorbell byte whenever a peer that sleeps
//! in `poll`/`epoll`/`recv` must be woken.
//!
//! A client connection starts `Pending` (offer published, server undecided) and becomes
//! `Ring` or `Tcp`; a server connection is born decided. The concerns live apart:
//! - [`path`]: which path the connection takes (the decision, and the fallback to TCP);
//! - [`io`]: the data calls on the rings;
//! - [`waiting`]: readiness, doorbells and sleeping on the kernel socket;
//! - [`share`]: a ring end shared by several processes after fork, and the release of our side;
//! - [`peer`]: what we know of the peer (closed, reset, alive).
//!
//! Attaching the rings and judging the peer's liveness are `memloop::channel`'s, shared with
//! the native API; spinning and the arm/re-check/sleep loop are `memloop_ring::wait`'s.

mod grab;
pub mod handoff;
mod io;
pub mod linger;
mod path;
mod peer;
mod promote;
mod share;
mod switch;
mod waiting;

pub use grab::after_getfd;
pub use handoff::{
    adopt_after_exec, adopt_received, expire_handoffs, hand_off, hand_to_next_image,
    take_back_exec_holds,
};
pub use memloop_ring::Spinner;
pub use path::Path;
pub use switch::{sweep as sweep_switches, wake_futex_sleepers, SWITCHED};
pub use waiting::spin_inputs_of;

use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::real;
use io::Rings;
use libc::c_int;
use memloop::channel::{PeerWatch, StreamEnds};
use memloop::registry::{ChannelId, ConnTuple, FallbackReason, Side};
use path::Decision;
use peer::PeerState;
use share::Sharing;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use switch::Switching;
use waiting::Sleepers;

/// The log targets of a path switch's milestones — a demote's "left the ring" and "switched
/// to TCP", a promotion's "promoted: back on the ring": `memloop bench switch` times switches
/// by them and logs nothing else (another line on the way would be timed too).
/// `memloop_preload::switch=debug` shows both.
pub const DEMOTE_EVENTS: &str = "memloop_preload::switch::demote";
pub const PROMOTE_EVENTS: &str = "memloop_preload::switch::promote";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    Read,
    Write,
}

pub struct Conn {
    pub engine: Arc<Engine>,
    pub ch: ChannelId,
    pub side: Side,
    pub tuple: ConnTuple,
    /// This process's fds for the connection's kernel socket.
    fds: ForkMutex<Vec<c_int>>,
    pub nonblock: AtomicBool,
    /// SO_RCVTIMEO / SO_SNDTIMEO in µs (0 = none), kept current by the setsockopt hook so a
    /// blocking call costs no getsockopt.
    rcvtimeo_us: AtomicU64,
    sndtimeo_us: AtomicU64,
    shut_rd: AtomicBool,
    shut_wr: AtomicBool,
    decision: Decision,
    rings: Rings,
    share: Sharing,
    sleepers: Sleepers,
    peer: PeerState,
    switching: Switching,
    tcp: promote::TcpPhase,
}

/// What creating a connection needs.
pub struct ConnParts {
    pub engine: Arc<Engine>,
    pub ch: ChannelId,
    pub side: Side,
    pub tuple: ConnTuple,
    pub fd: c_int,
    pub path: Path,
    pub same_kernel: bool,
    /// How long a pending client waits for the server's decision.
    pub decide_wait: Duration,
}

impl ConnParts {
    /// A connection found again by its socket (inherited across exec, or received with
    /// `SCM_RIGHTS`): decided, with its channel's rings.
    pub fn found(
        engine: &Arc<Engine>,
        ch: ChannelId,
        side: Side,
        tuple: ConnTuple,
        fd: c_int,
    ) -> Self {
        ConnParts {
            engine: engine.clone(),
            ch,
            side,
            tuple,
            fd,
            path: Path::Ring,
            same_kernel: PeerWatch::new(&engine.node, ch, side).same_kernel(),
            decide_wait: Duration::ZERO,
        }
    }
}

/// Which open side of channel `c` a socket with these (canonical) addresses is.
pub fn side_of_socket(
    c: &memloop::registry::ChannelInfo,
    local: std::net::SocketAddr,
    peer: std::net::SocketAddr,
) -> Option<Side> {
    let t = c.tuple?;
    if t.client == local && t.server == peer && !c.client_closed {
        Some(Side::Client)
    } else if t.client == peer && t.server == local && !c.server_closed {
        Some(Side::Server)
    } else {
        None
    }
}

impl Conn {
    pub fn new(p: ConnParts) -> Result<Arc<Conn>, FallbackReason> {
        // Doorbells are single bytes the peer never answers on TCP: with Nagle on, the second
        // one would wait for the delayed ACK of the first (~40 ms).
        let nodelay = real::sockopt_int(p.fd, libc::IPPROTO_TCP, libc::TCP_NODELAY).unwrap_or(0);
        real::set_sockopt_int(p.fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
        let reg = p.engine.registry();
        let mut ends = StreamEnds::attach(reg, p.ch, p.side).map_err(|e| {
            tracing::warn!(ch = ?p.ch, "cannot attach the channel's rings: {e}");
            e.fallback_reason()
        })?;
        if let Some(w) = p.engine.cfg.ring_window {
            // (Only while the ring is empty: a connection adopted mid-stream keeps its own.)
            let w = w.min(ends.tx.max_capacity());
            let _ = ends.tx.resize(w);
        }
        let side_words = match reg.side_words(p.ch, p.side) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::debug!(ch = ?p.ch, "no side words (fork sharing unavailable): {e}");
                None
            }
        };
        let peer_words = side_words
            .as_ref()
            .and_then(|_| reg.side_words(p.ch, switch::other(p.side)).ok());
        let nonblock = real::status_flags(p.fd) & libc::O_NONBLOCK != 0;
        let spin = p.engine.cfg.spin_for(p.same_kernel);
        let watch = PeerWatch::new(&p.engine.node, p.ch, p.side);
        Ok(Arc::new(Conn {
            fds: ForkMutex::new(vec![p.fd]),
            nonblock: AtomicBool::new(nonblock),
            rcvtimeo_us: AtomicU64::new(timeout_us(p.fd, libc::SO_RCVTIMEO)),
            sndtimeo_us: AtomicU64::new(timeout_us(p.fd, libc::SO_SNDTIMEO)),
            shut_rd: AtomicBool::new(false),
            shut_wr: AtomicBool::new(false),
            decision: Decision::new(p.path, p.decide_wait, nodelay),
            rings: Rings::new(ends),
            share: Sharing::new(side_words),
            sleepers: Sleepers::new(spin),
            peer: PeerState::new(watch, p.same_kernel),
            switching: Switching::new(peer_words),
            tcp: promote::TcpPhase::default(),
            engine: p.engine,
            ch: p.ch,
            side: p.side,
            tuple: p.tuple,
        }))
    }

    /// The kernel socket (any of our fds for it).
    pub fn kfd(&self) -> c_int {
        self.fds.lock().first().copied().unwrap_or(-1)
    }

    pub fn add_fd(&self, fd: c_int) {
        self.fds.lock().push(fd);
    }

    /// `fd` is being closed; true if it is this process's last fd for the connection (the
    /// fd stays usable for the doorbell until [`Conn::release_with`] returns).
    pub fn close_fd(&self, fd: c_int) -> bool {
        let mut fds = self.fds.lock();
        if fds.len() > 1 {
            fds.retain(|&f| f != fd);
            return false;
        }
        true
    }

    /// The program changed SO_RCVTIMEO or SO_SNDTIMEO: re-read it from the kernel.
    pub fn refresh_timeout(&self, fd: c_int, opt: c_int) {
        let v = timeout_us(fd, opt);
        match opt {
            libc::SO_RCVTIMEO => self.rcvtimeo_us.store(v, Relaxed),
            libc::SO_SNDTIMEO => self.sndtimeo_us.store(v, Relaxed),
            _ => {}
        }
    }
}

fn timeout_us(fd: c_int, opt: c_int) -> u64 {
    real::sockopt_timeout(fd, opt).map_or(0, |d| d.as_micros().clamp(1, u64::MAX as u128) as u64)
}

/// When a blocking call with socket timeout `timeout_us` (0 = none) gives up; `None` for a
/// call that does not wait at all or waits for ever.
fn deadline(dontwait: bool, timeout_us: &AtomicU64) -> Option<Instant> {
    match timeout_us.load(Relaxed) {
        _ if dontwait => None,
        0 => None,
        n => Some(Instant::now() + Duration::from_micros(n)),
    }
}
