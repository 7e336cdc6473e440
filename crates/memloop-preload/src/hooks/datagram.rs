//! The data calls of published UDP sockets (`crate::udp`): a receive serves the socket's
//! rings, then its kernel socket (non-blocking), then waits on both; a send to a member's
//! socket goes into its ring, anything else to the kernel. Each helper answers `None` when
//! the call is simply the kernel's.

use super::{slice_mut, IoSliceMut};
use crate::real::{self, errno};
use crate::table;
use crate::udp::UdpSock;
use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use memloop::datagram::WAKE_LEN;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// Flags whose meaning only the kernel has (error queue, urgent data).
const KERNEL_ONLY_RECV: c_int = libc::MSG_ERRQUEUE | libc::MSG_OOB;
/// Send flags the ring cannot honour: the datagram goes by the kernel (and its destination
/// stays there).
const KERNEL_ONLY_SEND: c_int = libc::MSG_OOB | libc::MSG_MORE | libc::MSG_DONTROUTE;

/// What a ring receive delivered, for the caller to report.
pub(super) struct Delivered {
    pub len: u64,
    pub copied: usize,
    pub from: SocketAddr,
}

/// The published UDP socket behind `fd`, if it is one.
pub(super) fn udp(fd: c_int) -> Option<Arc<UdpSock>> {
    if table::kind(fd) != table::K_OBJ {
        return None;
    }
    table::udp(fd)
}

/// A receive on an fd that is not a published UDP socket, by `call` into `buf` (`n` bytes,
/// `flags`): a wake datagram there was meant for a ring the socket had before it passed to
/// this process or image (a fork, an exec) and is swallowed — the datagrams it announced
/// come by the kernel too (handed back). One comparison unless 16 bytes came.
///
/// # Safety
/// `buf` writable for `n` bytes, as the receive's contract says.
pub(super) unsafe fn without_stale_wakes(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    call: impl Fn() -> ssize_t,
) -> ssize_t {
    loop {
        let r = call();
        if r != WAKE_LEN as ssize_t || n < WAKE_LEN || buf.is_null() {
            return r;
        }
        // SAFETY: the kernel wrote `r` (16) bytes at `buf`.
        let head = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), WAKE_LEN) };
        let dgram =
            || real::sockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_DGRAM);
        if !memloop::datagram::looks_like_wake(head) || !dgram() {
            return r;
        }
        if flags & libc::MSG_PEEK != 0 {
            real::drop_datagram(fd);
        }
    }
}

/// [`without_stale_wakes`] for a `recvmsg` (its first buffer looked at).
///
/// # Safety
/// `msg` null or a valid msghdr whose iovecs are writable, as recvmsg's contract says.
pub(super) unsafe fn msg_without_stale_wakes(
    fd: c_int,
    msg: *mut libc::msghdr,
    flags: c_int,
    call: impl Fn() -> ssize_t,
) -> ssize_t {
    // SAFETY: the caller's promise.
    let first = unsafe { msg.as_ref() }
        .filter(|m| m.msg_iovlen > 0 && !m.msg_iov.is_null())
        // SAFETY: `msg_iov` holds `msg_iovlen` (> 0) iovecs.
        .map(|m| unsafe { *m.msg_iov });
    let (buf, n) = first.map_or((std::ptr::null_mut(), 0), |v| (v.iov_base, v.iov_len));
    // SAFETY: the first iovec is writable for its length.
    unsafe { without_stale_wakes(fd, buf, n, flags, call) }
}

/// The caller's buffers, for a receive: their room, and the head of what the kernel put there
/// (to recognise a wake datagram).
pub(super) struct Room<H: FnMut() -> [u8; WAKE_LEN]> {
    pub bytes: usize,
    pub head: H,
}

/// A receive on `u`: `ring(peek)` tries the rings (into the caller's buffers), `kernel(f)`
/// makes the program's call with flags `f`. A socket without ring peers sleeps in that call
/// itself (exactly the kernel's waiting: timeouts, signals); one with ring peers sleeps on
/// both, and asks the kernel with `MSG_DONTWAIT`. Wake datagrams (a new peer's) are
/// swallowed.
pub(super) fn recv<H: FnMut() -> [u8; WAKE_LEN]>(
    u: &UdpSock,
    fd: c_int,
    flags: c_int,
    mut ring: impl FnMut(bool) -> Result<Option<Delivered>, c_int>,
    mut kernel: impl FnMut(c_int) -> ssize_t,
    mut room: Room<H>,
) -> Result<Result<Delivered, ssize_t>, c_int> {
    let peek = flags & libc::MSG_PEEK != 0;
    let nowait =
        flags & libc::MSG_DONTWAIT != 0 || u.nonblock.load(std::sync::atomic::Ordering::Relaxed);
    let mut deadline: Option<Option<Instant>> = None;
    // Whether the kernel socket may hold a datagram: a blocking receive asks the kernel only
    // once its wait says so (a failed non-blocking receive first would be one more system
    // call per datagram).
    let mut kernel_due = nowait;
    let mut spun = nowait;
    let mut withdrawal = None;
    loop {
        if let Some(d) = ring(peek)? {
            return Ok(Ok(d));
        }
        // A blocking receive with ring peers spins first: a request/response partner answers
        // within the window.
        if !std::mem::replace(&mut spun, true) && u.spin_for_data(fd) {
            kernel_due = true;
            continue;
        }
        // (A buffer too small to tell a wake datagram from the program's: never blocks there.)
        let in_kernel = !nowait && !u.has_ring_peers() && room.bytes >= WAKE_LEN;
        if kernel_due || in_kernel {
            let f = if in_kernel {
                flags
            } else {
                flags | libc::MSG_DONTWAIT
            };
            if room.bytes < WAKE_LEN && swallow_small_wake(u, fd) {
                continue;
            }
            let r = kernel(f);
            if r >= 0 {
                let whole = r as usize == WAKE_LEN && room.bytes >= WAKE_LEN;
                if whole && u.is_wake(&(room.head)()) {
                    if peek {
                        real::drop_datagram(fd);
                    }
                    continue;
                }
                return Ok(Err(r));
            }
            let e = errno();
            if e == libc::EAGAIN && nowait && u.await_withdrawal(fd, &mut withdrawal) {
                continue;
            }
            if e != libc::EAGAIN || nowait || in_kernel {
                return Err(e);
            }
        }
        let until = *deadline.get_or_insert_with(|| u.rcvtimeo().map(|t| Instant::now() + t));
        kernel_due = u.wait(fd, until)?;
    }
}

/// Before a receive into a buffer smaller than a wake datagram: drops a wake datagram at the
/// head of the kernel's queue (true: the caller looks again).
fn swallow_small_wake(u: &UdpSock, fd: c_int) -> bool {
    match real::peek_datagram(fd) {
        Some((WAKE_LEN, head)) if u.is_wake(&head) => {
            real::drop_datagram(fd);
            true
        }
        _ => false,
    }
}

/// The return value of a receive that delivered `d` (`MSG_TRUNC`: the datagram's length).
pub(super) fn returned(d: &Delivered, flags: c_int) -> ssize_t {
    match flags & libc::MSG_TRUNC != 0 {
        true => d.len as ssize_t,
        false => d.copied as ssize_t,
    }
}

/// A single-buffer receive on a published UDP socket; `None`: not one (or the kernel's).
///
/// # Safety
/// `buf` writable for `n` bytes; `addr`/`alen` as `recvfrom` documents them (or null).
pub(super) unsafe fn recv_one(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    (addr, alen): (*mut sockaddr, *mut socklen_t),
) -> Option<Result<ssize_t, c_int>> {
    let u = udp(fd)?;
    if flags & KERNEL_ONLY_RECV != 0 {
        return None;
    }
    let ring = |peek| {
        // SAFETY: the caller's contract.
        let b = unsafe { slice_mut(buf, n) };
        Ok(u.try_ring(b, peek)?.map(|(info, from)| Delivered {
            len: info.len,
            copied: info.copied,
            from,
        }))
    };
    // SAFETY: the caller's arguments, to the real recvfrom.
    let kernel = |f| unsafe { real::recvfrom()(fd, buf, n, f, addr, alen) };
    let room = Room {
        bytes: n,
        head: || {
            let mut h = [0u8; WAKE_LEN];
            // SAFETY: the caller's contract (and the kernel just wrote `n` >= 16 bytes there).
            let b = unsafe { slice_mut(buf, n) };
            let k = b.len().min(WAKE_LEN);
            h[..k].copy_from_slice(&b[..k]);
            h
        },
    };
    Some(recv(&u, fd, flags, ring, kernel, room).map(|r| match r {
        Ok(d) => {
            // SAFETY: the caller's contract for `addr`/`alen`.
            unsafe { real::write_sockaddr(addr, alen, d.from, u.family()) };
            returned(&d, flags)
        }
        Err(n) => n,
    }))
}

thread_local! {
    /// A datagram received for scattering over several buffers.
    static SCATTER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A ring receive into several buffers (through one staging copy when there are several).
fn ring_into(
    u: &UdpSock,
    bufs: &mut [IoSliceMut<'_>],
    peek: bool,
) -> Result<Option<Delivered>, c_int> {
    if let [one] = bufs {
        return Ok(u.try_ring(one, peek)?.map(|(i, from)| Delivered {
            len: i.len,
            copied: i.copied,
            from,
        }));
    }
    let room: usize = bufs.iter().map(|b| b.len()).sum();
    SCATTER.with(|s| {
        let mut s = s.borrow_mut();
        s.resize(room.min(1 << 17), 0);
        let Some((info, from)) = u.try_ring(&mut s, peek)? else {
            return Ok(None);
        };
        let mut at = 0;
        for b in bufs.iter_mut() {
            let k = b.len().min(info.copied - at);
            b[..k].copy_from_slice(&s[at..at + k]);
            at += k;
        }
        Ok(Some(Delivered {
            len: info.len,
            copied: info.copied,
            from,
        }))
    })
}

/// `recvmsg` on a published UDP socket (no control data is ever delivered from a ring: a
/// socket that asks for any leaves its ring).
///
/// # Safety
/// `msg` as `recvmsg` documents it.
pub(super) unsafe fn recvmsg(
    fd: c_int,
    msg: *mut libc::msghdr,
    flags: c_int,
) -> Option<Result<ssize_t, c_int>> {
    let u = udp(fd)?;
    if flags & KERNEL_ONLY_RECV != 0 {
        return None;
    }
    // SAFETY: recvmsg's contract: a valid msghdr.
    let Some(m) = (unsafe { msg.as_mut() }) else {
        return Some(Err(libc::EFAULT));
    };
    let (iov, iovlen) = (m.msg_iov, m.msg_iovlen as c_int);
    let ring = |peek| {
        // SAFETY: recvmsg's contract: `msg_iov` holds `msg_iovlen` writable iovecs.
        let mut bufs = unsafe { super::iovecs_mut(iov, iovlen) };
        ring_into(&u, &mut bufs, peek)
    };
    // SAFETY: the caller's header, to the real recvmsg.
    let kernel = |f| unsafe { real::recvmsg()(fd, msg, f) };
    // SAFETY: recvmsg's contract: `msg_iov` holds `msg_iovlen` writable iovecs.
    let bytes = unsafe { super::iovecs_mut(iov, iovlen) }
        .iter()
        .map(|b| b.len())
        .sum();
    let head = || {
        let mut h = [0u8; WAKE_LEN];
        let mut at = 0;
        // SAFETY: as above.
        for b in unsafe { super::iovecs_mut(iov, iovlen) }.iter() {
            let k = b.len().min(WAKE_LEN - at);
            h[at..at + k].copy_from_slice(&b[..k]);
            at += k;
            if at == WAKE_LEN {
                break;
            }
        }
        h
    };
    let room = Room { bytes, head };
    Some(recv(&u, fd, flags, ring, kernel, room).map(|r| match r {
        Ok(d) => {
            // SAFETY: the caller's header: name buffer of `msg_namelen` bytes (or null).
            let m = unsafe { &mut *msg };
            // SAFETY: as above.
            unsafe {
                real::write_sockaddr(m.msg_name.cast(), &mut m.msg_namelen, d.from, u.family())
            };
            m.msg_controllen = 0;
            m.msg_flags = if (d.copied as u64) < d.len {
                libc::MSG_TRUNC
            } else {
                0
            };
            returned(&d, flags)
        }
        Err(n) => n,
    }))
}

/// `read`/`readv` on a published UDP socket: a receive without flags or source.
///
/// # Safety
/// `iov` holds `n` writable iovecs.
pub(super) unsafe fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> Option<ssize_t> {
    let mut m: libc::msghdr = unsafe_zeroed_msghdr();
    m.msg_iov = iov.cast_mut();
    m.msg_iovlen = n.max(0) as _;
    // SAFETY: a header over the caller's iovecs, no name or control.
    match unsafe { recvmsg(fd, &mut m, 0) }? {
        Ok(r) => Some(r),
        Err(e) => {
            real::set_errno(e);
            Some(-1)
        }
    }
}

fn unsafe_zeroed_msghdr() -> libc::msghdr {
    // SAFETY: all-zero is a valid msghdr (null pointers, zero lengths).
    unsafe { std::mem::zeroed() }
}

/// Whether `fd` is a UDP socket of ours, published or not (its sends are [`send`]'s).
pub(super) fn may_send(fd: c_int) -> bool {
    table::kind(fd) == table::K_UDP || udp(fd).is_some()
}

/// The published UDP socket to send from, publishing a candidate whose destination is a
/// member's socket; `None`: the kernel's send.
fn sender(fd: c_int, dst: Option<SocketAddr>) -> Option<(Arc<UdpSock>, SocketAddr)> {
    match table::kind(fd) {
        table::K_OBJ => {
            let u = table::udp(fd)?;
            let dst = dst.or_else(|| u.connected())?;
            Some((u, dst))
        }
        table::K_UDP => {
            let dst = dst.or_else(|| real::peer_addr(fd))?;
            let u = crate::udp::before_first_send(fd, dst)?;
            Some((u, dst))
        }
        _ => None,
    }
}

/// A send of the datagram `parts` on `fd` to `dst` (the connected peer if `None`):
/// `None` when the kernel must make the call.
pub(super) fn send(
    fd: c_int,
    parts: &[&[u8]],
    flags: c_int,
    dst: Option<SocketAddr>,
) -> Option<ssize_t> {
    let (u, to) = sender(fd, dst)?;
    if flags & KERNEL_ONLY_SEND != 0 {
        u.sent_by_kernel(Some(to));
        return None;
    }
    u.send(fd, parts, to).map(|n| n as ssize_t)
}

/// The destination in a `sendmsg` header (none: the connected peer's).
///
/// # Safety
/// `m`'s name buffer valid for `msg_namelen` bytes (or null).
pub(super) unsafe fn msg_dst(m: &libc::msghdr) -> Option<SocketAddr> {
    // SAFETY: the caller's contract.
    unsafe { real::decode_sockaddr(m.msg_name.cast(), m.msg_namelen) }
}
