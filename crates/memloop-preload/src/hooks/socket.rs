//! Socket lifecycle and control: socket, connect, listen, accept, close, dup, fcntl, ioctl,
//! socket options, shutdown.

use super::{fail, forget, hook, track};
use crate::conn::Conn;
use crate::dispatch::{self, Route};
use crate::real::{self, set_errno};
use crate::table;
use libc::{c_int, c_ulong, c_void, sockaddr, socklen_t};
use std::sync::Arc;

hook! {
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    real kernel = real::socket;
    on_panic kernel();
    {
        let fd = kernel();
        track("socket", || dispatch::on_socket(fd, domain, ty, proto));
        Ok(fd)
    }
}

hook! {
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    real kernel = real::connect, pass if table::kind(fd) == table::K_NONE;
    on_panic fail(libc::EIO);
    {
        // SAFETY: connect's contract: `addr` is readable for `len` bytes.
        let dst = unsafe { real::decode_sockaddr(addr, len) };
        if let Some(r) = crate::udp::connect(fd, dst, kernel) {
            return Ok(r);
        }
        let found = dispatch::before_connect(fd, dst);
        let r = kernel();
        let err = real::errno();
        if let Some(c) = found {
            if r == 0 || err == libc::EINPROGRESS {
                dispatch::after_connect(fd, c);
            } else {
                drop(c);
            }
            set_errno(err);
        }
        Ok(r)
    }
}

hook! {
    fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    real kernel = real::bind, pass if table::kind(fd) != table::K_UDP;
    on_panic kernel();
    {
        let r = kernel();
        if r == 0 {
            let err = real::errno();
            // SAFETY: bind's contract: `addr` readable for `len` bytes.
            let asked = unsafe { real::decode_sockaddr(addr, len) };
            track("bind", || crate::udp::after_bind(fd, asked));
            set_errno(err);
        }
        Ok(r)
    }
}

hook! {
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    real kernel = real::listen;
    on_panic kernel();
    {
        let r = kernel();
        if r == 0 && table::kind(fd) != table::K_NONE {
            let err = real::errno();
            track("listen", || dispatch::after_listen(fd));
            set_errno(err);
        }
        Ok(r)
    }
}

/// After the real accept on our listener `lfd`: the agreement for `nfd`. If that panicked,
/// the connection may be half-agreed (a ring at the client, TCP here), so the program never
/// sees it: closed, and `ECONNABORTED`, which servers retry.
fn settle_accepted(lfd: c_int, nfd: c_int) -> Result<c_int, c_int> {
    if nfd < 0 || table::kind(lfd) != table::K_OBJ {
        return Ok(nfd);
    }
    if super::contain("accept", || dispatch::after_accept(lfd, nfd)).is_some() {
        return Ok(nfd);
    }
    forget(nfd);
    // SAFETY: `nfd` is the socket the real accept just returned; the program never saw it.
    if unsafe { real::close()(nfd) } != 0 {
        tracing::debug!(
            nfd,
            errno = real::errno(),
            "close of an aborted accept failed"
        );
    }
    Err(libc::ECONNABORTED)
}

hook! {
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    real kernel = real::accept;
    on_panic kernel();
    {
        track("accept", || dispatch::before_accept(fd));
        settle_accepted(fd, kernel())
    }
}

hook! {
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    real kernel = real::accept4;
    on_panic kernel();
    {
        track("accept4", || dispatch::before_accept(fd));
        settle_accepted(fd, kernel())
    }
}

hook! {
    fn close(fd: c_int) -> c_int;
    real kernel = real::close, pass if table::kind(fd) == table::K_NONE;
    on_panic {
        forget(fd);
        kernel()
    };
    {
        dispatch::before_close(fd);
        Ok(kernel())
    }
}

hook! {
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    real kernel = real::shutdown, pass if table::kind(fd) != table::K_OBJ;
    on_panic fail(libc::EIO);
    {
        let mut route = dispatch::route(fd);
        if let Route::Busy = route {
            // Mid-switch on a non-blocking socket: a shutdown waits for the switch to end.
            if let Some(c) = crate::table::conn(fd) {
                c.settle_switch();
            }
            route = dispatch::route(fd);
        }
        match route {
            Route::Ring(c) | Route::Switched(c) => shutdown_ours(&c, how, kernel),
            Route::Counted(p) => {
                crate::late::taint(fd, "shut down");
                // The FIN goes after the bytes a switch still re-sends.
                if how != libc::SHUT_RD {
                    p.before_send();
                }
                Ok(kernel())
            }
            Route::Real | Route::Busy => Ok(kernel()),
        }
    }
}

/// `shutdown` on a connection of ours: on its ring (or coming back to it) the ring's; on TCP
/// after a switch the kernel's, pinned there (the FIN cannot be counted into a promotion) —
/// unless a promotion is past its point of no return: then it completes first. The path is
/// looked at again after each step: it may move meanwhile.
fn shutdown_ours(
    c: &Arc<Conn>,
    how: c_int,
    kernel: impl FnOnce() -> c_int,
) -> Result<c_int, c_int> {
    use crate::conn::{Path, SWITCHED};
    loop {
        match c.path() {
            Path::Ring | Path::Joining => {
                let r = c.shutdown(how).map(|_| 0);
                dispatch::poke(c);
                if r != Err(SWITCHED) {
                    return r; // (else it left its ring meanwhile: again, on TCP)
                }
            }
            Path::Tcp if c.pin_to_tcp("shutdown on TCP") => {
                if c.path() != Path::Tcp {
                    continue; // a promotion completed just before the pin
                }
                if how != libc::SHUT_RD {
                    if let Some(p) = c.plain() {
                        p.before_send(); // the FIN goes after the bytes a switch re-sends
                    }
                }
                return Ok(kernel());
            }
            Path::Tcp => c.complete_promotion(),
            _ => {
                c.settle_switch();
                std::thread::yield_now();
            }
        }
    }
}

// ---- fd control -------------------------------------------------------------------------------
// Variadic `fcntl`/`ioctl` are declared with one `unsigned long` argument: on the x86-64 and
// AArch64 C ABIs a variadic integer or pointer argument travels exactly like a fixed one.

/// After a successful fcntl on one of our fds.
fn after_fcntl(fd: c_int, cmd: c_int, arg: c_ulong, r: c_int) {
    if r < 0 {
        return;
    }
    track("fcntl", || match cmd {
        libc::F_SETFL => dispatch::set_nonblock(fd, arg as c_int & libc::O_NONBLOCK != 0),
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => dispatch::after_dup(fd, r),
        _ => {}
    });
}

hook! {
    fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    real kernel = real::fcntl, pass if table::kind(fd) == table::K_NONE;
    on_panic kernel();
    {
        let r = kernel();
        after_fcntl(fd, cmd, arg, r);
        Ok(r)
    }
}

hook! {
    fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int;
    real kernel = real::fcntl64, pass if table::kind(fd) == table::K_NONE;
    on_panic kernel();
    {
        let r = kernel();
        after_fcntl(fd, cmd, arg, r);
        Ok(r)
    }
}

hook! {
    fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int;
    real kernel = real::ioctl, pass if table::kind(fd) != table::K_OBJ;
    on_panic fail(libc::EIO);
    {
        // Only the queue sizes depend on the ring (and so on the connection's decision);
        // anything else (FIONBIO right after connect, say) must not wait for the server.
        let queue = req == libc::FIONREAD || req == libc::TIOCOUTQ;
        if req == libc::FIONREAD && arg != 0 {
            if let Some(len) = table::udp(fd).and_then(|u| u.next_len()) {
                // SAFETY: FIONREAD's argument points to an int (`arg` is non-null).
                unsafe { *(arg as *mut c_int) = len.min(c_int::MAX as u64) as c_int };
                return Ok(0);
            }
        }
        if queue && arg != 0 {
            if let Route::Ring(c) = dispatch::route(fd) {
                // FIONREAD = SIOCINQ; TIOCOUTQ = SIOCOUTQ: bytes sent the peer has not read.
                let v = match req {
                    libc::FIONREAD => c.readable_bytes(),
                    _ => c.unread_by_peer(),
                };
                // SAFETY: both requests take a pointer to an int, non-null here.
                unsafe { *(arg as *mut c_int) = v.min(c_int::MAX as usize) as c_int };
                return Ok(0);
            }
        }
        let r = kernel();
        if r == 0 && req == libc::FIONBIO && arg != 0 {
            // SAFETY: FIONBIO takes a pointer to an int, non-null and read by the kernel.
            let on = unsafe { *(arg as *const c_int) } != 0;
            track("ioctl", || dispatch::set_nonblock(fd, on));
        }
        Ok(r)
    }
}

/// A ring (or undecided) connection's record, for options answered without the kernel.
fn ring_conn(fd: c_int) -> Option<std::sync::Arc<crate::conn::Conn>> {
    table::conn(fd).filter(|c| c.path() != crate::conn::Path::Tcp)
}

hook! {
    fn setsockopt(fd: c_int, level: c_int, opt: c_int, val: *const c_void, len: socklen_t)
        -> c_int;
    real kernel = real::setsockopt,
        pass if !matches!(table::kind(fd), table::K_OBJ | table::K_UDP);
    on_panic fail(libc::EIO);
    {
        if crate::udp::kernel_only_option(level, opt) {
            track("setsockopt", || {
                let why = format!("socket option {level}/{opt}: not one the ring can honour");
                crate::udp::kernel_only(fd, &why, memloop::registry::FallbackReason::Unsupported)
            });
        }
        let nodelay = level == libc::IPPROTO_TCP && opt == libc::TCP_NODELAY;
        if nodelay && !val.is_null() && len as usize >= 4 {
            if let Some(c) = ring_conn(fd) {
                // SAFETY: TCP_NODELAY's value is an int; `val` is non-null and `len` >= 4.
                let on = unsafe { *(val as *const c_int) } != 0;
                // Remembered for getsockopt (and restored if the connection ends up on TCP);
                // the kernel socket keeps it on for the doorbells.
                c.set_app_nodelay(on as c_int);
                return Ok(0);
            }
        }
        let r = kernel();
        let timeo = opt == libc::SO_RCVTIMEO || opt == libc::SO_SNDTIMEO;
        if r == 0 && level == libc::SOL_SOCKET && timeo {
            if let Some(c) = table::conn(fd) {
                track("setsockopt", || c.refresh_timeout(fd, opt));
            } else if let Some(u) = table::udp(fd) {
                track("setsockopt", || u.refresh_timeout(fd));
            }
        }
        let rcvbuf = opt == libc::SO_RCVBUF || opt == libc::SO_RCVBUFFORCE;
        if r == 0 && level == libc::SOL_SOCKET && rcvbuf {
            if let Some(u) = table::udp(fd) {
                track("setsockopt", || u.refresh_rcvbuf(fd));
            }
        }
        Ok(r)
    }
}

hook! {
    fn getsockopt(fd: c_int, level: c_int, opt: c_int, val: *mut c_void, len: *mut socklen_t)
        -> c_int;
    real kernel = real::getsockopt, pass if table::kind(fd) != table::K_OBJ;
    on_panic fail(libc::EIO);
    {
        let nodelay = level == libc::IPPROTO_TCP && opt == libc::TCP_NODELAY;
        if nodelay && !val.is_null() && !len.is_null() {
            // SAFETY: getsockopt's contract: a non-null `len` is a readable, writable socklen_t.
            let room = unsafe { &mut *len };
            if *room >= 4 {
                if let Some(c) = ring_conn(fd) {
                    // SAFETY: `val` is non-null and, by `*len` >= 4, has room for an int.
                    unsafe { *(val as *mut c_int) = c.app_nodelay() };
                    *room = 4;
                    return Ok(0);
                }
            }
        }
        Ok(kernel())
    }
}

hook! {
    fn dup(fd: c_int) -> c_int;
    real kernel = real::dup, pass if table::kind(fd) == table::K_NONE;
    on_panic kernel();
    {
        let r = kernel();
        if r >= 0 {
            track("dup", || dispatch::after_dup(fd, r));
        }
        Ok(r)
    }
}

/// dup2/dup3 close `new` first if it is open: ours gets `close`'s bookkeeping (only if `old`
/// is valid, or the kernel fails the call and `new` stays open).
fn before_dup_over(old: c_int, new: c_int) {
    if old != new && table::kind(new) != table::K_NONE && real::status_flags(old) >= 0 {
        dispatch::before_close(new);
    }
}

hook! {
    fn dup2(old: c_int, new: c_int) -> c_int;
    real kernel = real::dup2,
        pass if table::kind(old) == table::K_NONE && table::kind(new) == table::K_NONE;
    on_panic {
        forget(new);
        kernel()
    };
    {
        before_dup_over(old, new);
        let r = kernel();
        if r >= 0 && old != new && table::kind(old) != table::K_NONE {
            track("dup2", || dispatch::after_dup(old, r));
        }
        Ok(r)
    }
}

hook! {
    fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int;
    real kernel = real::dup3,
        pass if table::kind(old) == table::K_NONE && table::kind(new) == table::K_NONE;
    on_panic {
        forget(new);
        kernel()
    };
    {
        before_dup_over(old, new);
        let r = kernel();
        if r >= 0 && table::kind(old) != table::K_NONE {
            track("dup3", || dispatch::after_dup(old, r));
        }
        Ok(r)
    }
}
