//! Thin wrappers over the C library's functions (never raw system calls: `LD_PRELOAD` only
//! sees calls into libc). Every `unsafe` block of the program is here.

use libc::{c_int, epoll_event};
use std::fmt;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An `errno` value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    fn last() -> Errno {
        Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            libc::EAGAIN => "EAGAIN",
            libc::EBADF => "EBADF",
            libc::EEXIST => "EEXIST",
            libc::EINVAL => "EINVAL",
            libc::ENOENT => "ENOENT",
            libc::EINTR => "EINTR",
            libc::EINPROGRESS => "EINPROGRESS",
            libc::ECONNRESET => "ECONNRESET",
            libc::EPIPE => "EPIPE",
            libc::ENOSYS => "ENOSYS",
            _ => "errno",
        };
        write!(f, "{name} ({})", self.0)
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

pub type SysResult<T> = Result<T, Errno>;

fn cvt(r: c_int) -> SysResult<c_int> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: isize) -> SysResult<usize> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r as usize)
    }
}

fn owned(fd: c_int) -> SysResult<OwnedFd> {
    let fd = cvt(fd)?;
    // SAFETY: `fd` was just returned by the C library as a new descriptor that nothing else
    // owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---- epoll --------------------------------------------------------------------------------------

pub const IN: u32 = libc::EPOLLIN as u32;
pub const OUT: u32 = libc::EPOLLOUT as u32;
pub const RDHUP: u32 = libc::EPOLLRDHUP as u32;
pub const HUP: u32 = libc::EPOLLHUP as u32;
pub const ERR: u32 = libc::EPOLLERR as u32;
pub const ET: u32 = libc::EPOLLET as u32;
pub const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
pub const EXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;

pub fn epoll_create() -> SysResult<OwnedFd> {
    // SAFETY: no pointers; the result is checked.
    owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })
}

fn ctl(epfd: RawFd, op: c_int, fd: RawFd, ev: Option<(u32, u64)>) -> SysResult<()> {
    let mut e = ev.map(|(events, u64)| epoll_event { events, u64 });
    let p = e
        .as_mut()
        .map_or(std::ptr::null_mut(), |e| e as *mut epoll_event);
    // SAFETY: `p` is null or points to an event that lives across the call.
    cvt(unsafe { libc::epoll_ctl(epfd, op, fd, p) }).map(drop)
}

pub fn ep_add(epfd: RawFd, fd: RawFd, events: u32, data: u64) -> SysResult<()> {
    ctl(epfd, libc::EPOLL_CTL_ADD, fd, Some((events, data)))
}

pub fn ep_mod(epfd: RawFd, fd: RawFd, events: u32, data: u64) -> SysResult<()> {
    ctl(epfd, libc::EPOLL_CTL_MOD, fd, Some((events, data)))
}

pub fn ep_del(epfd: RawFd, fd: RawFd) -> SysResult<()> {
    ctl(epfd, libc::EPOLL_CTL_DEL, fd, None)
}

/// An event as the program sees it: (data word, events).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Ev {
    pub data: u64,
    pub events: u32,
}

impl fmt::Debug for Ev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}:{}", self.data, crate::util::evname(self.events))
    }
}

pub fn zeroed_events(n: usize) -> Vec<epoll_event> {
    vec![epoll_event { events: 0, u64: 0 }; n]
}

fn to_evs(buf: &[epoll_event], n: usize) -> Vec<Ev> {
    buf[..n]
        .iter()
        .map(|e| Ev {
            data: e.u64,
            events: e.events,
        })
        .collect()
}

/// `epoll_wait` with room for `max` events; `timeout_ms` as the C call (-1: forever).
pub fn ep_wait(epfd: RawFd, max: usize, timeout_ms: i32) -> SysResult<Vec<Ev>> {
    let mut buf = zeroed_events(max.max(1));
    // SAFETY: `buf` has room for `buf.len()` events.
    let n =
        cvt(unsafe { libc::epoll_wait(epfd, buf.as_mut_ptr(), buf.len() as c_int, timeout_ms) })?;
    Ok(to_evs(&buf, n as usize))
}

/// `epoll_pwait2` (glibc ≥ 2.35): `None` waits forever; `mask` replaces the signal mask.
pub fn ep_pwait2(
    epfd: RawFd,
    max: usize,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
) -> SysResult<Vec<Ev>> {
    let mut buf = zeroed_events(max.max(1));
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
    let mp = mask.map_or(std::ptr::null(), |m| m as *const _);
    // SAFETY: `buf` has room for `buf.len()` events; `tsp` and `mp` are null or point to
    // values that live across the call.
    let n =
        cvt(unsafe { libc::epoll_pwait2(epfd, buf.as_mut_ptr(), buf.len() as c_int, tsp, mp) })?;
    Ok(to_evs(&buf, n as usize))
}

// ---- poll and select ----------------------------------------------------------------------------

/// `poll` on one fd: its revents (0 on timeout).
pub fn poll1(fd: RawFd, events: i16, timeout_ms: i32) -> SysResult<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    cvt(unsafe { libc::poll(&mut p, 1, timeout_ms) })?;
    Ok(p.revents)
}

/// `select` for readability of one fd.
pub fn select_readable(fd: RawFd, timeout: Duration) -> SysResult<bool> {
    assert!(
        (fd as usize) < libc::FD_SETSIZE,
        "fd {fd} too large for select"
    );
    // SAFETY: an all-zero fd_set is a valid empty set; FD_SET/FD_ISSET stay within it
    // (checked above).
    unsafe {
        let mut r: libc::fd_set = std::mem::zeroed();
        libc::FD_ZERO(&mut r);
        libc::FD_SET(fd, &mut r);
        let mut tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        let n = cvt(libc::select(
            fd + 1,
            &mut r,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut tv,
        ))?;
        Ok(n > 0 && libc::FD_ISSET(fd, &r))
    }
}

// ---- data ---------------------------------------------------------------------------------------

pub fn read(fd: RawFd, buf: &mut [u8]) -> SysResult<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    cvt_size(unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) })
}

pub fn write(fd: RawFd, buf: &[u8]) -> SysResult<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    cvt_size(unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) })
}

pub fn recv(fd: RawFd, buf: &mut [u8], flags: c_int) -> SysResult<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    cvt_size(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) })
}

pub fn send(fd: RawFd, buf: &[u8], flags: c_int) -> SysResult<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    cvt_size(unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            flags | libc::MSG_NOSIGNAL,
        )
    })
}

/// Sends all of `buf` (blocking fd, or retrying on EAGAIN after a short sleep).
pub fn send_all(fd: RawFd, mut buf: &[u8]) -> SysResult<()> {
    while !buf.is_empty() {
        match send(fd, buf, 0) {
            Ok(n) => buf = &buf[n..],
            Err(Errno(libc::EAGAIN)) | Err(Errno(libc::EINTR)) => {
                std::thread::sleep(Duration::from_micros(200))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Bytes waiting to be read (`FIONREAD`).
pub fn fionread(fd: RawFd) -> SysResult<usize> {
    let mut n: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    cvt(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) })?;
    Ok(n as usize)
}

// ---- descriptors ---------------------------------------------------------------------------

pub fn eventfd(flags: c_int) -> SysResult<OwnedFd> {
    // SAFETY: no pointers.
    owned(unsafe { libc::eventfd(0, flags | libc::EFD_CLOEXEC) })
}

pub fn eventfd_add(fd: RawFd, v: u64) -> SysResult<()> {
    write(fd, &v.to_ne_bytes()).map(drop)
}

pub fn eventfd_take(fd: RawFd) -> SysResult<u64> {
    let mut b = [0u8; 8];
    read(fd, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

pub fn pipe() -> SysResult<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: `fds` has room for two descriptors.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) })?;
    // SAFETY: both are new descriptors owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn timerfd() -> SysResult<OwnedFd> {
    // SAFETY: no pointers.
    owned(unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
        )
    })
}

/// Arms a one-shot timer `after` from now.
pub fn timerfd_once(fd: RawFd, after: Duration) -> SysResult<()> {
    let its = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: after.as_secs() as libc::time_t,
            tv_nsec: after.subsec_nanos().max(1) as libc::c_long,
        },
    };
    // SAFETY: `its` is valid for the call; the old value is not wanted.
    cvt(unsafe { libc::timerfd_settime(fd, 0, &its, std::ptr::null_mut()) }).map(drop)
}

pub fn sigset(sigs: &[c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset uses it.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        for &sig in sigs {
            libc::sigaddset(&mut s, sig);
        }
        s
    }
}

/// Blocks `sigs` in the calling thread (threads spawned later inherit the mask).
pub fn block_signals(sigs: &[c_int]) -> SysResult<()> {
    let s = sigset(sigs);
    // SAFETY: `s` is initialised; the old mask is not wanted.
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &s, std::ptr::null_mut()) };
    if r != 0 {
        return Err(Errno(r));
    }
    Ok(())
}

pub fn signalfd(sigs: &[c_int]) -> SysResult<OwnedFd> {
    let s = sigset(sigs);
    // SAFETY: `s` is initialised and lives across the call.
    owned(unsafe { libc::signalfd(-1, &s, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) })
}

/// Reads one `signalfd_siginfo`: the signal number.
pub fn signalfd_take(fd: RawFd) -> SysResult<u32> {
    let mut b = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
    read(fd, &mut b)?;
    Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

pub fn kill_self(sig: c_int) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::kill(libc::getpid(), sig) }).map(drop)
}

pub fn gettid() -> i32 {
    // SAFETY: no pointers.
    unsafe { libc::gettid() }
}

pub fn dup(fd: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: no pointers.
    owned(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })
}

/// Closes a descriptor the caller owns by number.
pub fn close(fd: RawFd) -> SysResult<()> {
    // SAFETY: the caller owns `fd` and forgets it.
    cvt(unsafe { libc::close(fd) }).map(drop)
}

pub fn set_nonblock(fd: RawFd, on: bool) -> SysResult<()> {
    // SAFETY: no pointers.
    let fl = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let fl = if on {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    // SAFETY: no pointers.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, fl) }).map(drop)
}

pub fn set_cloexec(fd: RawFd, on: bool) -> SysResult<()> {
    let fl = if on { libc::FD_CLOEXEC } else { 0 };
    // SAFETY: no pointers.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, fl) }).map(drop)
}

// ---- sockets ------------------------------------------------------------------------------------

pub fn tcp_socket(nonblock: bool) -> SysResult<OwnedFd> {
    let nb = if nonblock { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: no pointers.
    owned(unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | nb,
            0,
        )
    })
}

/// `connect`; a non-blocking socket reports `EINPROGRESS` as `Ok(false)`.
pub fn connect(fd: RawFd, to: SocketAddrV4) -> SysResult<bool> {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*to.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `sa` is a valid sockaddr_in of `len` bytes.
    match cvt(unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), len) }) {
        Ok(_) => Ok(true),
        Err(Errno(libc::EINPROGRESS)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `SO_LINGER {1, 0}`: the next close sends a reset.
pub fn linger0(fd: RawFd) -> SysResult<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
    // SAFETY: `l` is a valid linger of `len` bytes.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            len,
        )
    })
    .map(drop)
}

/// Closes `fd` with a reset instead of a FIN.
pub fn abort(fd: OwnedFd) -> SysResult<()> {
    linger0(fd.as_raw_fd())?;
    drop(fd);
    Ok(())
}

pub fn shutdown(fd: RawFd, how: c_int) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::shutdown(fd, how) }).map(drop)
}

// ---- processes ----------------------------------------------------------------------------

/// `fork`: `Ok(0)` in the child.
pub fn fork() -> SysResult<i32> {
    // SAFETY: the child only calls async-signal-safe-enough code of this program (its own
    // functions, the C library, and new threads), as any forking test does.
    cvt(unsafe { libc::fork() })
}

/// Waits for `pid`: its exit code, or 128 + the signal that killed it.
pub fn wait_child(pid: i32) -> SysResult<i32> {
    let mut st: c_int = 0;
    loop {
        // SAFETY: `st` receives the status.
        match cvt(unsafe { libc::waitpid(pid, &mut st, 0) }) {
            Ok(_) => break,
            Err(Errno(libc::EINTR)) => continue,
            Err(e) => return Err(e),
        }
    }
    if libc::WIFSIGNALED(st) {
        return Ok(128 + libc::WTERMSIG(st));
    }
    Ok(libc::WEXITSTATUS(st))
}

/// Non-blocking `waitpid`: `None` while the child runs.
pub fn try_wait_child(pid: i32) -> SysResult<Option<i32>> {
    let mut st: c_int = 0;
    // SAFETY: `st` receives the status.
    let r = cvt(unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) })?;
    if r == 0 {
        return Ok(None);
    }
    if libc::WIFSIGNALED(st) {
        return Ok(Some(128 + libc::WTERMSIG(st)));
    }
    Ok(Some(libc::WEXITSTATUS(st)))
}

/// Exits at once, without running destructors or flushing anything but what was flushed.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and takes no pointers.
    unsafe { libc::_exit(code) }
}

/// `execv(path, args)`; returns only on failure.
pub fn execv(path: &std::ffi::CStr, args: &[std::ffi::CString]) -> Errno {
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: `path` and every argument are NUL-terminated strings that live across the
    // call; `argv` ends with a null pointer.
    unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) };
    Errno::last()
}

/// Sends `sig` to thread `tid` of this process.
pub fn tgkill(tid: i32, sig: c_int) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::tgkill(libc::getpid(), tid, sig) }).map(drop)
}

/// Installs an empty handler for `sig` (without SA_RESTART).
pub fn ignore_with_handler(sig: c_int) -> SysResult<()> {
    extern "C" fn nothing(_: c_int) {}
    // SAFETY: an all-zero sigaction is valid; the handler is a plain function that does
    // nothing, which is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = nothing as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        cvt(libc::sigaction(sig, &sa, std::ptr::null_mut())).map(drop)
    }
}

/// The port of `fd`'s own (`peer` false) or its peer's address (IPv4).
pub fn sock_port(fd: RawFd, peer: bool) -> SysResult<u16> {
    // SAFETY: an all-zero sockaddr_in is valid; `len` tells the call its size.
    unsafe {
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let p = (&mut sa as *mut libc::sockaddr_in).cast();
        if peer {
            cvt(libc::getpeername(fd, p, &mut len))?;
        } else {
            cvt(libc::getsockname(fd, p, &mut len))?;
        }
        Ok(u16::from_be(sa.sin_port))
    }
}

pub fn kill(pid: i32, sig: c_int) -> SysResult<()> {
    // SAFETY: no pointers.
    cvt(unsafe { libc::kill(pid, sig) }).map(drop)
}

/// `poll` on several fds: how many have events.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> SysResult<usize> {
    // SAFETY: `fds` is a valid array of `fds.len()` pollfds.
    cvt(unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) })
        .map(|n| n as usize)
}
