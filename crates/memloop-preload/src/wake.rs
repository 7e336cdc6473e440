//! Wake targets: how a peer wakes a poll, select or epoll sleeper of ours without the
//! network stack.
//!
//! A wait set that sleeps on ring connections (an epoll set, or one thread's poll/select
//! calls) owns a Unix datagram socket bound under the region's wake directory
//! (`<region file>.wake/<member>.<slot>`) and puts it in its own kernel wait beside the
//! connections' sockets. It arms its ring flags with the socket's *target* (member and slot,
//! 30 bits of the flag); the peer's publication that clears such a flag sends one datagram to
//! that path. The sockets stay in the sets, so the TCP doorbell still reaches every sleeper:
//! it is what a waker falls back to when the datagram cannot go (the directory is not shared
//! with it, permissions, the set is gone), counted as `wake_fallback`.
//!
//! Sleepers drain their socket *before* they look at their rings again, so a datagram drained
//! by one thread of a set never hides from that set what it announced.

use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use std::ffi::CString;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering::*};

const SLOT_BITS: u32 = 18;
const MEMBER_BITS: u32 = 12;

/// The target of member slot `member`'s wait set number `slot` (never 0).
fn target_of(member: u32, slot: u32) -> Option<u32> {
    (member < 1 << MEMBER_BITS && slot != 0 && slot < 1 << SLOT_BITS)
        .then_some(member << SLOT_BITS | slot)
}

/// The directory of a region's wake sockets, as text (socket paths are formatted into it).
fn dir_of(region: &std::path::Path) -> Option<String> {
    memloop::region::wake_dir(region)
        .into_os_string()
        .into_string()
        .ok()
}

fn path_of(dir: &str, target: u32) -> Option<CString> {
    let (member, slot) = (target >> SLOT_BITS, target & ((1 << SLOT_BITS) - 1));
    CString::new(format!("{dir}/{member}.{slot}")).ok()
}

/// This process's region's wake directory (looked up once: the region does not change).
fn wake_dir() -> Option<&'static str> {
    static DIR: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(d) = DIR.get() {
        return Some(d);
    }
    let e = crate::engine::get()?;
    Some(DIR.get_or_init(|| dir_of(e.node.region().path()).unwrap_or_default()))
        .filter(|d| !d.is_empty())
        .map(|d| d.as_str())
}

/// Makes the wake directory (once per region: usually it exists).
fn make_dir(dir: &str) {
    let _ = memloop::region::make_wake_dir(std::path::Path::new(dir));
}

/// Slots of this process's wake sockets (a fork child that creates its own gets new ones:
/// its member slot differs from the parent's).
static NEXT_SLOT: AtomicU32 = AtomicU32::new(1);

fn next_slot() -> u32 {
    loop {
        let s = NEXT_SLOT.fetch_add(1, Relaxed) & ((1 << SLOT_BITS) - 1);
        if s != 0 {
            return s;
        }
    }
}

/// A wait set's wake socket: unlinked and closed when the set goes (by the process that
/// made it; a fork child's copy leaves the name to its maker).
pub struct WakeSocket {
    fd: c_int,
    target: u32,
    path: CString,
    maker: u32,
}

impl WakeSocket {
    /// A new wake socket, or None where none can be made (no region, no writable wake
    /// directory): the set then arms doorbells as before.
    pub fn create() -> Option<Self> {
        let e = crate::engine::get()?;
        if !e.cfg.direct_wake || !e.node.region().futex_usable() {
            return None; // a device mapping: peers in other kernels share no socket name
        }
        let dir = wake_dir()?;
        let target = target_of(e.me().idx, next_slot())?;
        let path = path_of(dir, target)?;
        make_dir(dir);
        let fd = real::move_high(real::unix_dgram().ok()?, crate::table::MAX_FD);
        let bound = real::bind_unix(fd, &path).or_else(|e| {
            if e != libc::EADDRINUSE {
                return Err(e);
            }
            // A name left by a dead process that had our member slot.
            real::unlink_own(&path);
            real::bind_unix(fd, &path)
        });
        if let Err(e) = bound {
            tracing::debug!(errno = e, ?path, "no wake socket: doorbells instead");
            real::close_own(fd);
            return None;
        }
        crate::table::mark_own(fd);
        Some(WakeSocket {
            fd,
            target,
            path,
            maker: real::getpid(),
        })
    }

    /// Still ours: the program has not closed the number (`closefrom`, a `dup2` over it).
    /// Once it has, the library never touches that number again (it may be the program's).
    pub fn alive(&self) -> bool {
        crate::table::kind(self.fd) == crate::table::K_OWN
    }

    pub fn fd(&self) -> c_int {
        self.fd
    }

    /// The target its sleepers arm with, 0 once it is no longer ours.
    pub fn target(&self) -> u32 {
        if self.alive() {
            self.target
        } else {
            0
        }
    }

    /// Reads the wake-ups queued (call before looking at the rings again).
    pub fn drain(&self) {
        self.drain_names(|_| {});
    }

    /// [`Self::drain`], giving `each` every wake-up's name (`None`: a wake-up without one).
    pub fn drain_names(&self, each: impl FnMut(Option<u32>)) -> usize {
        match self.alive() {
            true => real::drain_words(self.fd, each),
            false => 0,
        }
    }
}

impl Drop for WakeSocket {
    fn drop(&mut self) {
        if real::getpid() == self.maker {
            real::unlink_own(&self.path);
        }
        if self.alive() {
            crate::table::unmark_own(self.fd);
            real::close_own(self.fd);
        }
    }
}

/// How many wake-ups a wake socket queues before a sender gets `EAGAIN`: the kernel's
/// `net.unix.max_dgram_qlen` of our network namespace (10 by default; the queue holds one
/// more). A drain that reads this many may have lost names.
pub fn queue_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/unix/max_dgram_qlen")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(10)
    })
}

/// Sockets connected to the targets woken most recently (most recent last): a send on one
/// skips the path lookup a send by name makes each time (a few % of a busy server's CPU).
static CONNECTED: ForkMutex<Vec<(u32, c_int)>> = ForkMutex::new(Vec::new());
/// How many targets keep a connected socket (each one fd of the library's, at a high number).
const CONNECTED_MAX: usize = 8;

/// Sends `name` on the connected socket kept for `target`, if there is one and it still works:
/// `Some(sent)`; `None` when there is none.
fn send_cached(target: u32, name: u32) -> Option<bool> {
    let mut list = CONNECTED.lock();
    // (A socket the program closed is forgotten, never closed: its number may be reused.)
    list.retain(|&(_, fd)| crate::table::kind(fd) == crate::table::K_OWN);
    let i = list.iter().position(|&(t, _)| t == target)?;
    let (t, fd) = list.remove(i);
    match real::send_word(fd, name) {
        Ok(()) => {
            list.push((t, fd));
            Some(true)
        }
        // A full socket: the sleeper is awake already (see `send`).
        Err(libc::EAGAIN) => {
            list.push((t, fd));
            Some(true)
        }
        // The target's socket is gone (its set closed, its name taken again).
        Err(_) => {
            close_connected(fd);
            None
        }
    }
}

/// Connects a socket to `target` at `path` (the least recently used one goes) and sends `name`
/// on it: `Some(sent)`; None if that cannot be done (the caller sends by path).
fn connect_and_send(target: u32, path: &std::ffi::CStr, name: u32) -> Option<bool> {
    let fd = real::move_high(real::unix_dgram().ok()?, crate::table::MAX_FD);
    crate::table::mark_own(fd);
    if real::connect_unix(fd, path).is_err() {
        close_connected(fd);
        return None;
    }
    let mut list = CONNECTED.lock();
    if list.len() >= CONNECTED_MAX {
        let (_, old) = list.remove(0);
        close_connected(old);
    }
    list.push((target, fd));
    match real::send_word(fd, name) {
        Ok(()) => Some(true),
        Err(libc::EAGAIN) => Some(true),
        Err(_) => None,
    }
}

fn close_connected(fd: c_int) {
    crate::table::unmark_own(fd);
    real::close_own(fd);
}

/// This process's socket for sending wake-ups by name (made once; a fork child shares it).
static SENDER: AtomicI32 = AtomicI32::new(-1);

fn sender() -> Option<c_int> {
    let fd = SENDER.load(Acquire);
    if fd >= 0 {
        return Some(fd);
    }
    let new = real::unix_dgram().ok()?;
    match SENDER.compare_exchange(-1, new, AcqRel, Acquire) {
        Ok(_) => Some(new),
        Err(other) => {
            real::close_own(new);
            Some(other)
        }
    }
}

/// Sends a wake-up naming `name` (the channel that fired: a set with thousands of members
/// looks only at those its wake-ups name) to `target`; false if it cannot go (the caller
/// rings the doorbell, whose kernel event names the connection too). A full socket
/// (`EAGAIN`) is a set awake already: the name is lost, but a set that reads a full queue
/// looks at all its members ([`queue_limit`]) — far cheaper than a TCP doorbell per lost
/// name when thousands of members wake at once.
pub fn send(target: u32, name: u32) -> bool {
    let sent = (|| {
        if let Some(sent) = send_cached(target, name) {
            return sent.then_some(());
        }
        let path = path_of(wake_dir()?, target)?;
        if let Some(sent) = connect_and_send(target, &path, name) {
            return sent.then_some(());
        }
        match real::send_unix(sender()?, &path, name) {
            Ok(()) => Some(()),
            Err(e) => {
                tracing::debug!(errno = e, ?path, "wake-up not sent: doorbell instead");
                None
            }
        }
    })()
    .is_some();
    if !sent {
        if let Some(e) = crate::engine::get() {
            e.registry()
                .bump_counter(memloop::registry::COUNTER_WAKE_FALLBACK);
        }
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_name_member_and_slot_and_never_zero() {
        assert_eq!(target_of(0, 0), None);
        assert_eq!(target_of(1 << MEMBER_BITS, 1), None);
        assert_eq!(target_of(0, 1 << SLOT_BITS), None);
        let t = target_of(5, 7).unwrap();
        assert_ne!(t, 0);
        assert!(t < 1 << 30, "a target fits the flag's 30 bits");
        assert_eq!(path_of("/d", t).unwrap().to_str().unwrap(), "/d/5.7");
    }
}
