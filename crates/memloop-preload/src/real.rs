//! The C library's own functions, found with `dlsym(RTLD_NEXT)`, and safe wrappers for the few
//! system calls the rest of the crate makes on kernel sockets.
//!
//! This module and `hooks` are the crate's C ABI boundary and the only places with `unsafe`;
//! shared memory is still only touched through `memloop-shm`.
#![allow(unsafe_code)]

use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Declares `pub fn NAME() -> fn-pointer`, resolved once with `dlsym(RTLD_NEXT, "NAME")`.
macro_rules! real_fns {
    ($( $name:ident : fn($($arg:ty),*) -> $ret:ty; )*) => {
        $(
            #[allow(non_snake_case)]
            pub fn $name() -> unsafe extern "C" fn($($arg),*) -> $ret {
                static ADDR: AtomicUsize = AtomicUsize::new(0);
                let mut a = ADDR.load(Ordering::Relaxed);
                if a == 0 {
                    a = resolve(concat!(stringify!($name), "\0"));
                    ADDR.store(a, Ordering::Relaxed);
                }
                // SAFETY: `a` is the address dlsym returned for this libc symbol, whose C
                // prototype is the one declared here.
                unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(a) }
            }
        )*

        /// Resolves every function now. A fork child that resolves one itself pays `dlsym`'s
        /// lookup and a fault on each page of the loader it touches, in every child: a server
        /// that forks per connection resolves them once in the parent instead.
        pub fn resolve_all() {
            $( let _ = $name(); )*
        }
    };
}

type ShimNext = unsafe extern "C" fn(*const libc::c_char) -> *mut c_void;
type ShimEnv = unsafe extern "C" fn(*const libc::c_char) -> *const libc::c_char;

/// A function of `libmemloop.so` (the shim that loaded us), if it did.
fn shim_fn(name: &std::ffi::CStr) -> Option<usize> {
    // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the global scope, where the
    // preloaded shim is (we are not: it loaded us with RTLD_LOCAL).
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p as usize)
}

/// `name` of the shim, looked up once into `slot` (0: not loaded by the shim).
fn shim_cached(slot: &AtomicUsize, name: &std::ffi::CStr) -> usize {
    let mut a = slot.load(Ordering::Relaxed);
    if a == usize::MAX {
        a = shim_fn(name).unwrap_or(0);
        slot.store(a, Ordering::Relaxed);
    }
    a
}

/// The shim's `memloop_shim_next` (`None`: loaded as a preload ourselves).
fn shim_next() -> Option<ShimNext> {
    static NEXT: AtomicUsize = AtomicUsize::new(usize::MAX);
    let a = shim_cached(&NEXT, c"memloop_shim_next");
    // SAFETY: the shim exports `memloop_shim_next` with this prototype.
    (a != 0).then(|| unsafe { std::mem::transmute::<usize, ShimNext>(a) })
}

/// Whether the shim loaded us (it then runs the fork and exit handlers and keeps the settings
/// the process started with).
pub fn under_shim() -> bool {
    shim_next().is_some()
}

/// Whether fds inherited at exec may need adopting: false only when the shim that loaded us
/// looked at start (or was told by the exec hint) and found no inet socket or epoll set.
pub fn may_have_inherited() -> bool {
    static F: AtomicUsize = AtomicUsize::new(usize::MAX);
    let a = shim_cached(&F, c"memloop_shim_inherited");
    if a == 0 {
        return true;
    }
    // SAFETY: the shim exports `memloop_shim_inherited` as `int (void)`; it only reads a static.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn() -> libc::c_int>(a)() != 0 }
}

type ShimPlan = unsafe extern "C" fn(
    defer: libc::c_int,
    plain: *const libc::c_int,
    nplain: libc::c_int,
    listeners: *const libc::c_int,
    nlisteners: libc::c_int,
    locks: *const libc::c_int,
    nlocks: libc::c_int,
);

/// Tells the shim that loaded us what the coming fork child needs: `Some((plain,
/// listeners))`, the child may put our child handler off while it only uses these plain
/// connections (and fds that are not ours) and closes these listeners; `locks`, our lock fds,
/// which it closes in the child at once.
pub fn offer_child_plan(plan: Option<(&[libc::c_int], &[libc::c_int])>, locks: &[libc::c_int]) {
    static F: AtomicUsize = AtomicUsize::new(usize::MAX);
    let a = shim_cached(&F, c"memloop_shim_fork_plan");
    if a == 0 {
        return;
    }
    let (defer, (plain, listeners)) = match plan {
        Some(p) => (1, p),
        None => (0, (&[][..], &[][..])),
    };
    let len = |v: &[libc::c_int]| v.len() as libc::c_int;
    // SAFETY: the shim exports `memloop_shim_fork_plan` with this prototype; it copies the
    // arrays (bounded by the counts) before returning.
    unsafe {
        std::mem::transmute::<usize, ShimPlan>(a)(
            defer,
            plain.as_ptr(),
            len(plain),
            listeners.as_ptr(),
            len(listeners),
            locks.as_ptr(),
            len(locks),
        )
    }
}

/// A `MEMLOOP_*` setting: as the process started with it when the shim loaded us (the program
/// may have changed its environment since), else from the environment now.
pub fn setting(name: &str) -> Option<String> {
    static ENV: AtomicUsize = AtomicUsize::new(usize::MAX);
    let a = shim_cached(&ENV, c"memloop_shim_env");
    if a == 0 {
        return std::env::var(name).ok();
    }
    let key = std::ffi::CString::new(name).ok()?;
    // SAFETY: the shim exports `memloop_shim_env` with this prototype; it returns null or a
    // NUL-terminated string it keeps for the life of the process.
    unsafe {
        let get = std::mem::transmute::<usize, ShimEnv>(a);
        let v = get(key.as_ptr());
        (!v.is_null()).then(|| std::ffi::CStr::from_ptr(v).to_string_lossy().into_owned())
    }
}

fn resolve(name: &str) -> usize {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT finds the next definition after ours, and
    // the shim's `memloop_shim_next` the next after the shim (which exports the same names).
    let p = unsafe {
        match shim_next() {
            Some(next) => next(name.as_ptr().cast()),
            None => libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()),
        }
    };
    if p.is_null() {
        // Without the real function nothing can work; say which one and stop.
        let msg = format!(
            "memloop preload: cannot resolve {}\n",
            name.trim_end_matches('\0')
        );
        // SAFETY: writing a valid buffer to stderr with the raw syscall.
        unsafe { libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len()) };
        std::process::abort();
    }
    p as usize
}

real_fns! {
    socket: fn(c_int, c_int, c_int) -> c_int;
    connect: fn(c_int, *const sockaddr, socklen_t) -> c_int;
    bind: fn(c_int, *const sockaddr, socklen_t) -> c_int;
    listen: fn(c_int, c_int) -> c_int;
    accept: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
    close: fn(c_int) -> c_int;
    shutdown: fn(c_int, c_int) -> c_int;
    read: fn(c_int, *mut c_void, size_t) -> ssize_t;
    write: fn(c_int, *const c_void, size_t) -> ssize_t;
    readv: fn(c_int, *const libc::iovec, c_int) -> ssize_t;
    writev: fn(c_int, *const libc::iovec, c_int) -> ssize_t;
    recv: fn(c_int, *mut c_void, size_t, c_int) -> ssize_t;
    send: fn(c_int, *const c_void, size_t, c_int) -> ssize_t;
    recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t;
    sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t;
    recvmsg: fn(c_int, *mut libc::msghdr, c_int) -> ssize_t;
    sendmsg: fn(c_int, *const libc::msghdr, c_int) -> ssize_t;
    poll: fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;
    ppoll: fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int;
    select: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int;
    pselect: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int;
    epoll_ctl: fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int;
    epoll_wait: fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int;
    epoll_pwait: fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int;
    epoll_pwait2: fn(c_int, *mut libc::epoll_event, c_int, *const libc::timespec, *const libc::sigset_t) -> c_int;
    epoll_create: fn(c_int) -> c_int;
    close_range: fn(libc::c_uint, libc::c_uint, c_int) -> c_int;
    closefrom: fn(c_int) -> ();
    execve: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    execv: fn(*const libc::c_char, *const *const libc::c_char) -> c_int;
    execvp: fn(*const libc::c_char, *const *const libc::c_char) -> c_int;
    execvpe: fn(*const libc::c_char, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    fexecve: fn(c_int, *const *const libc::c_char, *const *const libc::c_char) -> c_int;
    posix_spawn: fn(*mut libc::pid_t, *const libc::c_char, *const libc::posix_spawn_file_actions_t, *const libc::posix_spawnattr_t, *const *mut libc::c_char, *const *mut libc::c_char) -> c_int;
    posix_spawnp: fn(*mut libc::pid_t, *const libc::c_char, *const libc::posix_spawn_file_actions_t, *const libc::posix_spawnattr_t, *const *mut libc::c_char, *const *mut libc::c_char) -> c_int;
    syscall: fn(libc::c_long, libc::c_long, libc::c_long, libc::c_long, libc::c_long, libc::c_long, libc::c_long) -> libc::c_long;
    epoll_create1: fn(c_int) -> c_int;
    fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int;
    fcntl64: fn(c_int, c_int, libc::c_ulong) -> c_int;
    ioctl: fn(c_int, libc::c_ulong, libc::c_ulong) -> c_int;
    dup: fn(c_int) -> c_int;
    dup2: fn(c_int, c_int) -> c_int;
    dup3: fn(c_int, c_int, c_int) -> c_int;
    getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
    setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
    sendfile: fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t;
    sendfile64: fn(c_int, c_int, *mut libc::off64_t, size_t) -> ssize_t;
    splice: fn(c_int, *mut libc::loff_t, c_int, *mut libc::loff_t, size_t, libc::c_uint) -> ssize_t;
    sendmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int) -> c_int;
    recvmmsg: fn(c_int, *mut libc::mmsghdr, libc::c_uint, c_int, *mut libc::timespec) -> c_int;
    pthread_cancel: fn(libc::pthread_t) -> c_int;
}

/// `pidfd_getfd` by its system call (the C library's wrapper exists from glibc 2.36 on only;
/// the call is the same).
pub fn pidfd_getfd() -> unsafe extern "C" fn(c_int, c_int, libc::c_uint) -> c_int {
    unsafe extern "C" fn call(pidfd: c_int, targetfd: c_int, flags: libc::c_uint) -> c_int {
        // SAFETY: pidfd_getfd takes no pointers; the C library's `syscall` sets errno.
        let r = unsafe {
            syscall()(
                libc::SYS_pidfd_getfd,
                pidfd.into(),
                targetfd.into(),
                flags.into(),
                0,
                0,
                0,
            )
        };
        r as c_int
    }
    call
}

pub fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

/// Runs `f` and leaves errno as it was (code that runs inside a call the program sees
/// succeed: fork handlers, our `pthread_cancel`).
pub fn keeping_errno<R>(f: impl FnOnce() -> R) -> R {
    let e = errno();
    let r = f();
    // (Written only if changed: in a fork handler an unneeded write is a copy-on-write fault.)
    if errno() != e {
        set_errno(e);
    }
    r
}

pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Result of a raw call: `Ok(value)` or `Err(errno)`.
fn check(r: isize) -> Result<usize, c_int> {
    if r < 0 {
        Err(errno())
    } else {
        Ok(r as usize)
    }
}

/// One doorbell byte to the peer; true if it was sent (live path switching counts them). A
/// failure is only logged (the peer also wakes on its own bounded sleep and on the connection
/// closing; a full socket buffer already holds bytes that will wake it).
pub fn ring_doorbell(fd: c_int) -> bool {
    let b = [1u8];
    // SAFETY: valid one-byte buffer.
    let r = unsafe {
        send()(
            fd,
            b.as_ptr().cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if r < 0 {
        let e = errno();
        if e != libc::EAGAIN {
            tracing::debug!(fd, errno = e, "doorbell not sent");
        }
    }
    r == 1
}

/// Writes to fd 2 with no lock of ours or std's (for log lines).
pub fn write_stderr(b: &[u8]) -> Result<usize, c_int> {
    // SAFETY: a valid buffer of `b.len()` bytes.
    check(unsafe { write()(2, b.as_ptr().cast(), b.len()) })
}

/// Appends `b` to the file at `path` (created if missing) with one `write`; the file is open
/// only for the call, so no fd of ours can be closed or reused under the program.
pub fn append_to(path: &std::ffi::CStr, b: &[u8]) -> Result<usize, c_int> {
    let flags = libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC;
    // SAFETY: a NUL-terminated path; the mode argument is read for O_CREAT.
    let fd = unsafe { libc::open(path.as_ptr(), flags, 0o644 as libc::c_uint) };
    check(fd as isize)?;
    // SAFETY: a valid buffer of `b.len()` bytes, on the fd just opened.
    let r = check(unsafe { write()(fd, b.as_ptr().cast(), b.len()) });
    close_own(fd);
    r
}

/// Outcome of draining doorbells from the kernel socket.
#[derive(Debug, PartialEq, Eq)]
pub enum Drain {
    /// Nothing (more) to read: the connection is up.
    Open,
    /// The peer's socket is gone (EOF): every process on that side closed it.
    Closed,
    /// The connection was reset (the peer closed abortively, or with data unread).
    Reset,
}

/// Errors that say nothing about the peer: no data yet, or our own fd is gone or not a
/// socket (closed by another thread meanwhile). Taking them for a closed peer would release
/// the peer's side of a channel it still uses.
pub fn not_about_the_peer(e: c_int) -> bool {
    matches!(
        e,
        libc::EAGAIN | libc::EBADF | libc::ENOTSOCK | libc::EFAULT | libc::EINVAL
    )
}

/// Bytes consumed as doorbells that are not doorbells: a count gone wrong, data lost. Never
/// expected; always reported.
fn not_doorbells(what: &str, bytes: &[u8]) {
    if let Some(at) = bytes.iter().position(|&b| b != 1) {
        tracing::error!(
            at,
            of = bytes.len(),
            bytes = ?&bytes[at..bytes.len().min(at + 8)],
            "data {what} as doorbells"
        );
    }
}

/// Reads and discards everything queued on the kernel socket (doorbell bytes); also says how
/// many bytes it read.
pub fn drain_doorbells(fd: c_int) -> (Drain, usize) {
    let mut buf = [0u8; 256];
    let mut read = 0usize;
    loop {
        // SAFETY: valid buffer of the given length.
        let r = unsafe { recv()(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        let state = match check(r) {
            Ok(0) => Drain::Closed,
            Ok(n) => {
                not_doorbells("drained", &buf[..n]);
                read += n;
                continue;
            }
            Err(libc::EINTR) => continue,
            Err(e) if not_about_the_peer(e) => Drain::Open,
            Err(libc::ECONNRESET) | Err(libc::EPIPE) => Drain::Reset,
            Err(_) => Drain::Closed,
        };
        return (state, read);
    }
}

fn timespec(d: std::time::Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

/// Waits on one kernel fd with a nanosecond timeout (`None` = forever). `Ok(revents)`,
/// `Ok(0)` on timeout, `Err(EINTR)` when a signal interrupted the wait.
pub fn wait_fd(fd: c_int, events: i16, timeout: Option<std::time::Duration>) -> Result<i16, c_int> {
    let mut p = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    ppoll_raw(&mut p, timeout, std::ptr::null()).map(|n| if n == 0 { 0 } else { p[0].revents })
}

/// Kernel-side poll of several fds without blocking (timeout 0).
pub fn poll_now(fds: &mut [libc::pollfd]) -> Result<usize, c_int> {
    ppoll_raw(fds, Some(std::time::Duration::ZERO), std::ptr::null())
}

fn sockaddr_of(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match storage.ss_family as c_int {
        libc::AF_INET => {
            // SAFETY: family says this is a sockaddr_in, which fits in sockaddr_storage.
            let a = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: family says this is a sockaddr_in6, which fits in sockaddr_storage.
            let a = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Decodes a caller's `sockaddr` of `len` bytes (inet families only).
///
/// # Safety
/// `addr` must be null or point to at least `len` readable bytes.
pub unsafe fn decode_sockaddr(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: all-zero bytes are a valid sockaddr_storage (plain integers).
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let n = (len as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: `addr` is readable for `len` >= `n` bytes (the contract), `st` has room for `n`,
    // and the caller's buffer cannot overlap our local.
    unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), &mut st as *mut _ as *mut u8, n) };
    let need = match st.ss_family as c_int {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return None,
    };
    (n >= need).then(|| sockaddr_of(&st)).flatten()
}

type NameFn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;

fn name_of(fd: c_int, f: NameFn) -> Option<SocketAddr> {
    // SAFETY: zeroed sockaddr_storage is a valid value.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: buffer and length describe `st`.
    let r = unsafe {
        f(
            fd,
            (&mut st as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    (r == 0).then(|| sockaddr_of(&st)).flatten()
}

pub fn local_addr(fd: c_int) -> Option<SocketAddr> {
    name_of(fd, libc::getsockname)
}

pub fn peer_addr(fd: c_int) -> Option<SocketAddr> {
    name_of(fd, libc::getpeername)
}

/// `getsockopt` for an int-valued option.
pub fn sockopt_int(fd: c_int, level: c_int, opt: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: buffer and length describe `v`.
    let r = unsafe { getsockopt()(fd, level, opt, (&mut v as *mut c_int).cast(), &mut len) };
    (r == 0).then_some(v)
}

/// `setsockopt` of an int-valued option; best effort for its callers, so a failure is only
/// logged.
pub fn set_sockopt_int(fd: c_int, level: c_int, opt: c_int, v: c_int) {
    // SAFETY: buffer and length describe `v`.
    let r = unsafe {
        setsockopt()(
            fd,
            level,
            opt,
            (&v as *const c_int).cast(),
            std::mem::size_of::<c_int>() as socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(fd, level, opt, v, errno = errno(), "setsockopt failed");
    }
}

/// Free space of a pipe (capacity minus queued bytes); `None` if `fd` is not a pipe.
pub fn pipe_room(fd: c_int) -> Option<usize> {
    // SAFETY: F_GETPIPE_SZ takes no argument.
    let cap = unsafe { fcntl()(fd, libc::F_GETPIPE_SZ, 0) };
    if cap <= 0 {
        return None;
    }
    let mut used: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe {
        ioctl()(
            fd,
            libc::FIONREAD,
            (&mut used as *mut c_int) as libc::c_ulong,
        )
    };
    (r == 0).then(|| (cap - used).max(0) as usize)
}

/// Whether SO_LINGER is {on, 0 s}: close resets the connection.
pub fn linger_zero(fd: c_int) -> bool {
    // SAFETY: zeroed linger is valid.
    let mut l: libc::linger = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::linger>() as socklen_t;
    // SAFETY: buffer and length describe `l`.
    let r = unsafe {
        getsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&mut l as *mut libc::linger).cast(),
            &mut len,
        )
    };
    r == 0 && l.l_onoff != 0 && l.l_linger == 0
}

/// Makes the coming close send a reset.
pub fn set_linger_zero(fd: c_int) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: buffer and length describe `l`.
    let r = unsafe {
        setsockopt()(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as socklen_t,
        )
    };
    if r != 0 {
        // The close then ends with a FIN, not a reset; the ring's RESET flag still tells.
        tracing::debug!(fd, errno = errno(), "SO_LINGER {{1, 0}} not set");
    }
}

/// A `timeval`-valued socket option (SO_RCVTIMEO / SO_SNDTIMEO); `None` = no timeout.
pub fn sockopt_timeout(fd: c_int, opt: c_int) -> Option<std::time::Duration> {
    // SAFETY: zeroed timeval is valid.
    let mut tv: libc::timeval = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
    // SAFETY: buffer and length describe `tv`.
    let r = unsafe {
        getsockopt()(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut tv as *mut libc::timeval).cast(),
            &mut len,
        )
    };
    if r != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) {
        return None;
    }
    Some(std::time::Duration::new(
        tv.tv_sec.max(0) as u64,
        (tv.tv_usec.max(0) as u32) * 1000,
    ))
}

/// The open-file status flags (for O_NONBLOCK).
pub fn status_flags(fd: c_int) -> c_int {
    // SAFETY: F_GETFL takes no argument.
    unsafe { fcntl()(fd, libc::F_GETFL, 0) }
}

/// `F_GETFD` (close-on-exec); -1 on error.
pub fn fd_flags(fd: c_int) -> c_int {
    // SAFETY: F_GETFD takes no argument.
    unsafe { fcntl()(fd, libc::F_GETFD, 0) }
}

/// `st_mode` of an open fd.
pub fn fstat_mode(fd: c_int) -> Option<u32> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is a writable stat buffer; on success the kernel filled it in. A closed or
    // reused number gives EBADF or another file's status, which the caller treats as not ours.
    let r = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    // SAFETY: fstat returned 0: `st` is initialised.
    (r == 0).then(|| unsafe { st.assume_init() }.st_mode)
}

pub fn raise_sigpipe() {
    // SAFETY: raising a signal in the calling thread.
    unsafe { libc::raise(libc::SIGPIPE) };
}

static PID: AtomicUsize = AtomicUsize::new(0);

/// Our pid, cached (glibc no longer caches it, and the shared-ring lock needs it per call);
/// the fork child handler calls [`forget_pid`].
pub fn getpid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => {
            let p = std::process::id();
            PID.store(p as usize, Ordering::Relaxed);
            p
        }
        p => p as u32,
    }
}

#[inline]
pub fn forget_pid() {
    // (Read first: a write the child can spare spares it a copy-on-write fault.)
    if PID.load(Ordering::Relaxed) != 0 {
        PID.store(0, Ordering::Relaxed);
    }
}

/// A blocking `MSG_PEEK` receive: sleeps until a doorbell, FIN or signal. The kernel applies
/// `SO_RCVTIMEO` (→ `EAGAIN`) and `SA_RESTART` to it as to any receive.
pub fn peek_blocking(fd: c_int, b: &mut [u8]) -> Result<usize, c_int> {
    // By raw system call: no cancellation point inside our logic (`crate::cancel`); the
    // kernel's restart rules are the same.
    // SAFETY: valid buffer of the given length; no address wanted.
    // (Through the C library's `syscall`, not `libc::syscall`, which would resolve to our own
    // export: it hands data calls on our fds to our hooks, and this is one — it would recurse.)
    let r = unsafe {
        syscall()(
            libc::SYS_recvfrom,
            fd as libc::c_long,
            b.as_mut_ptr() as libc::c_long,
            b.len() as libc::c_long,
            libc::MSG_PEEK as libc::c_long,
            0,
            0,
        )
    };
    interruptible(r)
}

pub fn epoll_ctl_raw(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: &mut libc::epoll_event,
) -> Result<(), c_int> {
    // SAFETY: `ev` is a valid epoll_event (ignored for DEL).
    let r = unsafe { epoll_ctl()(epfd, op, fd, ev) };
    check(r as isize).map(|_| ())
}

/// `epoll_pwait` into `buf`; `sigmask` may be null.
pub fn epoll_wait_raw(
    epfd: c_int,
    buf: &mut [libc::epoll_event],
    timeout_ms: c_int,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    let max = buf.len().min(c_int::MAX as usize) as c_int;
    // SAFETY: `buf` has room for `max` events; `sigmask` is null or the caller's valid mask,
    // of which the kernel reads its `SIGSET_BYTES`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait,
            epfd,
            buf.as_mut_ptr(),
            max,
            timeout_ms,
            sigmask,
            SIGSET_BYTES,
        )
    };
    interruptible(r)
}

/// The kernel's signal set size (64 signals), what the C library passes for a `sigset_t`.
const SIGSET_BYTES: usize = 8;

/// The result of one of our kernel waits, made by raw system call so that it is no
/// cancellation point (`crate::cancel`): a cancellation asked meanwhile must not act until
/// our logic is left.
fn interruptible(r: libc::c_long) -> Result<usize, c_int> {
    // (A cancellation asked while we slept must not act in what follows: this holds it.)
    crate::cancel::asked_here();
    check(r as isize)
}

/// `epoll_pwait2` into `buf` (nanosecond timeout, `None` = forever); `sigmask` may be null.
/// Only called when the program itself called `epoll_pwait2`, so its kernel has it.
pub fn epoll_pwait2_raw(
    epfd: c_int,
    buf: &mut [libc::epoll_event],
    timeout: Option<std::time::Duration>,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    let max = buf.len().min(c_int::MAX as usize) as c_int;
    let ts = timeout.map(timespec);
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `buf` has room for `max` events; `tsp` null or live; `sigmask` null or valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait2,
            epfd,
            buf.as_mut_ptr(),
            max,
            tsp,
            sigmask,
            SIGSET_BYTES,
        )
    };
    interruptible(r)
}

/// `ppoll` over `fds` with an optional timeout and signal mask (null: unchanged).
pub fn ppoll_raw(
    fds: &mut [libc::pollfd],
    timeout: Option<std::time::Duration>,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    let mut ts = timeout.map(timespec);
    let tsp = ts
        .as_mut()
        .map_or(std::ptr::null_mut(), |t| t as *mut libc::timespec);
    // SAFETY: `fds` is a valid array; `tsp` null or live; `sigmask` null or the caller's mask.
    // (The kernel writes the time left into `tsp`: our own copy.)
    let r = unsafe {
        libc::syscall(
            libc::SYS_ppoll,
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            tsp,
            sigmask,
            SIGSET_BYTES,
        )
    };
    interruptible(r)
}

// ---- live path switching: raw socket I/O of a switch ------------------------------------------

/// Reads and throws away exactly `n` bytes (the peer's unread doorbells), waiting for them if
/// needed; stops early at EOF or an error of the connection. Returns how many it discarded.
pub fn discard_exact(fd: c_int, mut n: u64) -> Result<u64, c_int> {
    let mut buf = [0u8; 256];
    let mut done = 0;
    while n > 0 {
        let want = (n as usize).min(buf.len());
        // SAFETY: valid buffer of at least `want` bytes.
        let r = unsafe { recv()(fd, buf.as_mut_ptr().cast(), want, libc::MSG_DONTWAIT) };
        match check(r) {
            Ok(0) => return Ok(done),
            Ok(k) => {
                not_doorbells("discarded", &buf[..k]);
                done += k as u64;
                n -= k as u64;
            }
            Err(libc::EINTR) => {}
            Err(libc::EAGAIN) => {
                wait_fd(
                    fd,
                    libc::POLLIN,
                    Some(std::time::Duration::from_millis(100)),
                )?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Reads exactly `buf.len()` bytes from the socket, waiting for them (the peer sent them
/// already); how many it got — fewer only at EOF or an error, which is returned with them.
pub fn recv_exact(fd: c_int, buf: &mut [u8]) -> (usize, Option<c_int>) {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: valid buffer of `rest.len()` bytes.
        let r = unsafe { recv()(fd, rest.as_mut_ptr().cast(), rest.len(), libc::MSG_DONTWAIT) };
        match check(r) {
            Ok(0) => return (done, None),
            Ok(k) => done += k,
            Err(libc::EINTR) => {}
            Err(libc::EAGAIN) => {
                let wait = Some(std::time::Duration::from_millis(100));
                if let Err(e) = wait_fd(fd, libc::POLLIN, wait) {
                    return (done, Some(e));
                }
            }
            Err(e) => return (done, Some(e)),
        }
    }
    (done, None)
}

/// Sends as much of `bytes` as the socket takes without blocking; how much that was.
pub fn send_now(fd: c_int, bytes: &[u8]) -> Result<usize, c_int> {
    let mut sent = 0;
    while sent < bytes.len() {
        let rest = &bytes[sent..];
        // SAFETY: valid buffer of `rest.len()` bytes.
        let r = unsafe {
            send()(
                fd,
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match check(r) {
            Ok(k) => sent += k,
            Err(libc::EINTR) => {}
            Err(libc::EAGAIN) => return Ok(sent),
            Err(e) => return Err(e),
        }
    }
    Ok(sent)
}

/// Sends all of `bytes`, waiting for room as long as it takes.
pub fn send_all(fd: c_int, bytes: &[u8]) -> Result<(), c_int> {
    let mut sent = 0;
    while sent < bytes.len() {
        sent += send_now(fd, &bytes[sent..])?;
        if sent < bytes.len() {
            wait_fd(
                fd,
                libc::POLLOUT,
                Some(std::time::Duration::from_millis(100)),
            )?;
        }
    }
    Ok(())
}

/// The kernel's shutdown of a socket of ours (a failure only means it is gone already).
pub fn shutdown_now(fd: c_int, how: c_int) {
    // SAFETY: shutdown takes no pointers.
    if unsafe { shutdown()(fd, how) } < 0 {
        tracing::debug!(fd, how, errno = errno(), "shutdown after a switch");
    }
}

/// A close-on-exec duplicate of `fd`.
pub fn dup_cloexec(fd: c_int) -> Result<c_int, c_int> {
    // SAFETY: F_DUPFD_CLOEXEC takes an integer argument.
    let r = unsafe { fcntl()(fd, libc::F_DUPFD_CLOEXEC, 0) };
    check(r as isize).map(|_| r)
}

/// Closes an fd of our own (not the program's: no bookkeeping).
pub fn close_own(fd: c_int) {
    // SAFETY: closing an fd this crate opened and nobody else uses.
    unsafe { close()(fd) };
}

/// `recvmsg` into `bufs` with `flags`, no address or control data (a switched connection's
/// receive, made by the library on the program's behalf).
pub fn recv_vectored(
    fd: c_int,
    bufs: &mut [std::io::IoSliceMut<'_>],
    flags: c_int,
) -> Result<usize, c_int> {
    // SAFETY: an all-zero msghdr is valid (no name, no control).
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = bufs.as_mut_ptr().cast();
    m.msg_iovlen = bufs.len() as _;
    // SAFETY: IoSliceMut is ABI-compatible with iovec; the buffers are valid and writable.
    check(unsafe { recvmsg()(fd, &mut m, flags) })
}

/// `sendmsg` of `bufs` with `flags`.
pub fn send_vectored(
    fd: c_int,
    bufs: &[std::io::IoSlice<'_>],
    flags: c_int,
) -> Result<usize, c_int> {
    // SAFETY: an all-zero msghdr is valid (no name, no control).
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    m.msg_iovlen = bufs.len() as _;
    // SAFETY: IoSlice is ABI-compatible with iovec; the kernel only reads the buffers.
    check(unsafe { sendmsg()(fd, &m, flags) })
}

/// Bytes queued for reading on a socket (the kernel's FIONREAD).
pub fn queued(fd: c_int) -> Option<usize> {
    let mut n: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe { ioctl()(fd, libc::FIONREAD, (&mut n as *mut c_int) as libc::c_ulong) };
    (r == 0).then_some(n.max(0) as usize)
}

/// Bytes queued for sending (unsent plus unacknowledged), by `SIOCOUTQ`.
fn outq(fd: c_int) -> Option<u64> {
    let mut n: c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int.
    let r = unsafe { ioctl()(fd, libc::TIOCOUTQ, (&mut n as *mut c_int) as libc::c_ulong) };
    (r == 0).then_some(n.max(0) as u64)
}

/// The kernel's `TCP_INFO` for `fd`.
fn tcp_info(fd: c_int) -> Option<libc::tcp_info> {
    // SAFETY: tcp_info is plain data; zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as socklen_t;
    // SAFETY: buffer and length describe `info`.
    let r = unsafe {
        getsockopt()(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // An old kernel fills less: the byte counters are then missing.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + 8;
    (r == 0 && len as usize >= needed).then_some(info)
}

/// How far the program side of a TCP socket got in each direction: bytes ever written to it
/// (acknowledged by the peer + still queued) and bytes ever read from it (received − still
/// queued), each up to a constant offset fixed at connect. Only differences are meaningful.
/// The two kernel reads of each sum must see the same acknowledgement / arrival state, so
/// they are repeated until a counter stands still around them; no other thread of ours may
/// write or read the socket meanwhile. `None` if the kernel cannot tell.
pub fn tcp_positions(fd: c_int) -> Option<(u64, u64)> {
    let counters = |i: &libc::tcp_info| (i.tcpi_bytes_acked, i.tcpi_bytes_received);
    // The queues read while neither counter moved (one pair of `TCP_INFO` for both).
    for _ in 0..1000 {
        let before = counters(&tcp_info(fd)?);
        let unacked = outq(fd)?;
        let unread = queued(fd)? as u64;
        if counters(&tcp_info(fd)?) == before {
            let (acked, received) = before;
            return Some((acked + unacked, received.checked_sub(unread)?));
        }
        std::thread::yield_now();
    }
    None
}

/// A `sockaddr_un` for `path` (None if it does not fit).
fn unix_addr(path: &std::ffi::CStr) -> Option<(libc::sockaddr_un, socklen_t)> {
    // SAFETY: all-zero bytes are a valid sockaddr_un.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.to_bytes();
    if bytes.len() >= a.sun_path.len() {
        return None;
    }
    for (d, s) in a.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Some((a, len as socklen_t))
}

/// A non-blocking, close-on-exec Unix datagram socket of the library's own.
pub fn unix_dgram() -> Result<c_int, c_int> {
    let ty = libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket creation.
    check(unsafe { socket()(libc::AF_UNIX, ty, 0) } as isize).map(|fd| fd as c_int)
}

/// Moves a library fd out of the way of the program's numbers (which come lowest-first): to
/// `memloop_shm::member_lock::private_fd_floor` or above, close-on-exec. The fd itself if it
/// cannot move.
pub fn move_high(fd: c_int, max: usize) -> c_int {
    let Some(moved) = dup_high(fd, max) else {
        return fd;
    };
    close_own(fd);
    moved
}

/// A close-on-exec duplicate of `fd` out of the way of the program's numbers (see
/// [`move_high`]); `None` if there is no fd to spare.
pub fn dup_high(fd: c_int, max: usize) -> Option<c_int> {
    let floor = memloop_shm::member_lock::private_fd_floor(max) as libc::c_ulong;
    // SAFETY: F_DUPFD_CLOEXEC on an open fd; the duplicate is the caller's to close.
    let dup = unsafe { fcntl()(fd, libc::F_DUPFD_CLOEXEC, floor) };
    (dup >= 0).then_some(dup)
}

/// Closes an fd of the library's own by system call, never through the C library's `close`
/// (our own hook): for fork children, where the program's view of its fds must not move.
pub fn close_by_syscall(fd: c_int) {
    // SAFETY: closing an fd only this library knows of.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

/// Binds `fd` to `path`, readable and writable by every user (a waker may run as another).
pub fn bind_unix(fd: c_int, path: &std::ffi::CStr) -> Result<(), c_int> {
    let (a, len) = unix_addr(path).ok_or(libc::ENAMETOOLONG)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    check(unsafe { bind()(fd, (&a as *const libc::sockaddr_un).cast(), len) } as isize)?;
    // SAFETY: a NUL-terminated path. (A failure leaves the umask's mode: senders may fail.)
    unsafe { libc::chmod(path.as_ptr(), 0o666) };
    Ok(())
}

/// Connects a datagram socket of the library's own to the socket bound at `path`.
pub fn connect_unix(fd: c_int, path: &std::ffi::CStr) -> Result<(), c_int> {
    let (a, len) = unix_addr(path).ok_or(libc::ENAMETOOLONG)?;
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    check(unsafe { connect()(fd, (&a as *const libc::sockaddr_un).cast(), len) } as isize)
        .map(|_| ())
}

/// Sends a 4-byte word (a wake-up's name) on a connected socket of the library's own, never
/// blocking or raising SIGPIPE.
pub fn send_word(fd: c_int, word: u32) -> Result<(), c_int> {
    let b = word.to_le_bytes();
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: a 4-byte buffer.
    check(unsafe { send()(fd, b.as_ptr().cast(), b.len(), flags) }).map(|_| ())
}

/// Sends a 4-byte word to the datagram socket bound at `path`, never blocking or raising
/// SIGPIPE.
pub fn send_unix(fd: c_int, path: &std::ffi::CStr, word: u32) -> Result<(), c_int> {
    let (a, len) = unix_addr(path).ok_or(libc::ENAMETOOLONG)?;
    check(send_nowait(fd, &word.to_le_bytes(), &a, len)).map(|_| ())
}

/// `sendto` of `b` to the address `to` (`len` bytes of it), never blocking or raising
/// SIGPIPE: the kernel's result.
fn send_nowait<A>(fd: c_int, b: &[u8], to: &A, len: socklen_t) -> isize {
    debug_assert!(len as usize <= std::mem::size_of::<A>());
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: `b` is a live buffer; `to` a valid socket address of at least `len` bytes (the
    // callers' encodings say so).
    unsafe {
        sendto()(
            fd,
            b.as_ptr().cast(),
            b.len(),
            flags,
            (to as *const A).cast(),
            len,
        )
    }
}

/// Reads every datagram queued on a non-blocking socket of the library's own; the datagrams
/// read.
pub fn drain_own(fd: c_int) -> usize {
    drain_words(fd, |_| {})
}

/// [`drain_own`], giving `each` the 4-byte word of every datagram (`None`: it held no word),
/// up to 64 per system call (usually one call: another only after a full batch).
pub fn drain_words(fd: c_int, mut each: impl FnMut(Option<u32>)) -> usize {
    const BATCH: usize = 64;
    let mut bufs = [[0u8; 8]; BATCH];
    let mut n = 0;
    loop {
        let mut iov: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: all-zero bytes are valid mmsghdrs; each gets one valid iovec below.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: `msgs` holds BATCH headers, each pointing at a live buffer.
        let r = unsafe {
            recvmmsg()(
                fd,
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        match check(r as isize) {
            Ok(k) => {
                for (m, b) in msgs.iter().zip(bufs.iter()).take(k) {
                    let word =
                        (m.msg_len == 4).then(|| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                    each(word);
                }
                n += k;
                if k < BATCH {
                    return n;
                }
            }
            Err(libc::EINTR) => {}
            Err(_) => return n,
        }
    }
}

/// Removes a file of the library's own (a wake socket's name); a missing one is fine.
pub fn unlink_own(path: &std::ffi::CStr) {
    // SAFETY: a NUL-terminated path.
    unsafe { libc::unlink(path.as_ptr()) };
}

// ---- UDP ----------------------------------------------------------------------------------------

/// `a` as a `sockaddr` of `family` (an IPv4 address as IPv4-mapped for an `AF_INET6` socket,
/// as the kernel reports it), in storage, with its length.
fn encode_sockaddr(a: SocketAddr, family: c_int) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage (plain integers).
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let v6 = match (a, family) {
        (SocketAddr::V4(v4), libc::AF_INET) => {
            // SAFETY: sockaddr_in fits in sockaddr_storage and has its alignment.
            let sin = unsafe { &mut *(&mut st as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            return (st, std::mem::size_of::<libc::sockaddr_in>() as socklen_t);
        }
        (SocketAddr::V4(v4), _) => SocketAddrV6::new(v4.ip().to_ipv6_mapped(), v4.port(), 0, 0),
        (SocketAddr::V6(v6), _) => v6,
    };
    // SAFETY: sockaddr_in6 fits in sockaddr_storage and has its alignment.
    let sin6 = unsafe { &mut *(&mut st as *mut _ as *mut libc::sockaddr_in6) };
    sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sin6.sin6_port = v6.port().to_be();
    sin6.sin6_addr.s6_addr = v6.ip().octets();
    sin6.sin6_flowinfo = v6.flowinfo();
    sin6.sin6_scope_id = v6.scope_id();
    (st, std::mem::size_of::<libc::sockaddr_in6>() as socklen_t)
}

/// Writes a datagram's source into a caller's (`addr`, `alen`) as `recvfrom` does: as much
/// as fits, and the full length into `*alen`.
///
/// # Safety
/// `addr` must be null or writable for `*alen` bytes; `alen` null or a writable socklen_t.
pub unsafe fn write_sockaddr(
    addr: *mut sockaddr,
    alen: *mut socklen_t,
    a: SocketAddr,
    family: c_int,
) {
    // SAFETY: the caller's contract.
    let Some(alen) = (unsafe { alen.as_mut() }) else {
        return;
    };
    let (st, len) = encode_sockaddr(a, family);
    if !addr.is_null() {
        let n = (*alen).min(len) as usize;
        // SAFETY: `addr` has room for `*alen` >= `n` bytes; `st` holds `len` >= `n`.
        unsafe { std::ptr::copy_nonoverlapping(&st as *const _ as *const u8, addr.cast(), n) };
    }
    *alen = len;
}

/// Sends `b` as one datagram from `fd` to `dst` (never blocking, no SIGPIPE); the kernel's
/// result, errors ignored by the caller (a wake datagram is a hint).
pub fn send_datagram(fd: c_int, b: &[u8], dst: SocketAddr, family: c_int) -> bool {
    let (st, len) = encode_sockaddr(dst, family);
    send_nowait(fd, b, &st, len) >= 0
}

/// The head (up to 16 bytes) of `fd`'s next datagram, never blocking, with `flags` added:
/// its length (with `MSG_TRUNC`, the whole datagram's) and the bytes, `None` if there is none.
fn datagram_head(fd: c_int, flags: c_int) -> Option<(usize, [u8; 16])> {
    let mut b = [0u8; 16];
    // SAFETY: a 16-byte local buffer; no address wanted.
    let r = unsafe {
        recvfrom()(
            fd,
            b.as_mut_ptr().cast(),
            b.len(),
            flags | libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    (r >= 0).then_some((r as usize, b))
}

/// Reads and drops the next datagram of `fd` (a wake datagram a peek found), never blocking.
pub fn drop_datagram(fd: c_int) {
    datagram_head(fd, 0);
}

/// The head of `fd`'s next datagram, without taking it: its length in the queue and its first
/// 16 bytes, or `None` if there is none now.
pub fn peek_datagram(fd: c_int) -> Option<(usize, [u8; 16])> {
    datagram_head(fd, libc::MSG_PEEK | libc::MSG_TRUNC)
}

/// Binds an inet socket to its family's wildcard address and a port the kernel picks (what
/// the kernel does by itself at a UDP socket's first send).
pub fn bind_any(fd: c_int, family: c_int) -> Result<(), c_int> {
    let any = match family {
        libc::AF_INET6 => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
        _ => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
    };
    let (st, len) = encode_sockaddr(any, family);
    // SAFETY: `st` is a valid sockaddr of `len` bytes.
    check(unsafe { bind()(fd, (&st as *const libc::sockaddr_storage).cast(), len) } as isize)
        .map(|_| ())
}

/// The source address the kernel's routing picks for datagrams to `dst` (asked of a
/// throw-away socket of the library's own, connected there).
pub fn route_source(dst: SocketAddr, family: c_int) -> Option<std::net::IpAddr> {
    let ty = libc::SOCK_DGRAM | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket creation.
    let fd = unsafe { socket()(family, ty, 0) };
    if fd < 0 {
        return None;
    }
    let (st, len) = encode_sockaddr(dst, family);
    // SAFETY: `st` is a valid sockaddr of `len` bytes.
    let ok = unsafe { connect()(fd, (&st as *const libc::sockaddr_storage).cast(), len) } == 0;
    let src = ok.then(|| local_addr(fd)).flatten();
    close_own(fd);
    src.map(|a| a.ip().to_canonical())
}

/// Whether an interrupted untimed socket wait would be restarted by the kernel: every signal
/// handler installed was installed with `SA_RESTART` (which signal came is not known).
pub fn signals_restart() -> bool {
    (1..=libc::SIGRTMAX()).all(|sig| {
        // SAFETY: all-zero is a valid sigaction to fill; a null new action only queries.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying the disposition of `sig`.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return true;
        }
        let handled = old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN;
        !handled || old.sa_flags & libc::SA_RESTART != 0
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    /// Differences of the positions are exactly the bytes the program wrote and read, with
    /// some still unacknowledged or unread in the kernel's queues.
    #[test]
    fn tcp_positions_follow_what_the_program_wrote_and_read() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let (w0, r0) = super::tcp_positions(a.as_raw_fd()).unwrap();
        let (bw0, br0) = super::tcp_positions(b.as_raw_fd()).unwrap();
        a.write_all(&[1; 100_000]).unwrap();
        let mut buf = vec![0; 30_000];
        b.read_exact(&mut buf).unwrap();
        b.write_all(&[2; 777]).unwrap();
        let (w1, r1) = super::tcp_positions(a.as_raw_fd()).unwrap();
        let (bw1, br1) = super::tcp_positions(b.as_raw_fd()).unwrap();
        assert_eq!((w1 - w0, r1 - r0), (100_000, 0));
        assert_eq!((bw1 - bw0, br1 - br0), (777, 30_000));
        a.read_exact(&mut buf[..700]).unwrap();
        assert_eq!(super::tcp_positions(a.as_raw_fd()).unwrap().1 - r0, 700);
    }
}
