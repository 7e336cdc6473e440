//! Process-wide calls: fork (`vfork`), the exec family, close_range/closefrom, the C
//! library's `syscall`, and the library's start-up (constructor and fork handlers).

use super::{contain, fail, hook, track};
use crate::forklock;
use crate::{dispatch, real, table};
use libc::{c_int, c_uint};
use memloop_shm::forkgate::ForkPlan;
use std::ffi::CStr;

/// `close_range` and `closefrom` close many fds at once: ours among them get the bookkeeping
/// of `close` first (a stale entry would later act on a reused fd number).
fn before_close_many(first: c_int, last: c_int) {
    for fd in table::tracked_in(first, last) {
        dispatch::before_close(fd);
    }
}

/// The fallback after a panic in [`before_close_many`]: forget the whole range.
fn forget_many(first: c_int, last: c_int) {
    track("forget", || {
        for fd in table::tracked_in(first, last) {
            table::remove(fd);
        }
    });
}

/// `close_range`'s bounds as fds, if it closes anything (`CLOEXEC` only marks).
fn closed_range(first: c_uint, last: c_uint, flags: c_int) -> Option<(c_int, c_int)> {
    let (lo, hi) = (
        first.min(c_int::MAX as u32) as c_int,
        last.min(c_int::MAX as u32) as c_int,
    );
    (flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && lo <= hi).then_some((lo, hi))
}

hook! {
    fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    real kernel = real::close_range;
    on_panic {
        if let Some((lo, hi)) = closed_range(first, last, flags) {
            forget_many(lo, hi);
        }
        kernel()
    };
    {
        if let Some((lo, hi)) = closed_range(first, last, flags) {
            before_close_many(lo, hi);
        }
        Ok(kernel())
    }
}

hook! {
    fn closefrom(first: c_int) -> ();
    real kernel = real::closefrom;
    on_panic {
        forget_many(first.max(0), c_int::MAX);
        kernel()
    };
    {
        before_close_many(first.max(0), c_int::MAX);
        kernel();
        Ok(())
    }
}

hook! {
    /// `vfork` becomes `fork`: a vforked child shares our memory and skips the fork handlers,
    /// so ring connections it inherits (and keeps across exec) would not be counted as held
    /// by it. A full fork is a valid implementation of vfork.
    fn vfork() -> libc::pid_t;
    on_panic fail(libc::EAGAIN);
    {
        // SAFETY: fork takes no arguments; our state is kept consistent by the fork handlers.
        Ok(unsafe { libc::fork() })
    }
}

// ---- exec -------------------------------------------------------------------------------------
// (`execl*` build their vector and call the C library's internal execve, out of our reach.)
// A panic before the exec still execs: the new image's library removes registrations left
// tagged in inherited epoll sets (and logs them).

type Argv = *const *const libc::c_char;

/// Runs an exec: inherited ring connections move to TCP unless the new image loads this
/// library, inherited epoll sets get the program's registrations back first, and ours again
/// if the exec fails (errno as the exec left it). A connection that cannot be handed on yet
/// (`dispatch::demote_inheritable`) fails the exec with `EBUSY` before it is tried.
fn exec_with(keeps_library: bool, exec: impl FnOnce() -> c_int) -> Result<c_int, c_int> {
    if let Some(Err(e)) = contain("exec", || dispatch::before_exec(keeps_library)) {
        return Err(e);
    }
    let r = exec();
    real::keeping_errno(|| track("exec", dispatch::after_failed_exec));
    Ok(r)
}

/// An exec's environment: `envp`, or ours when the call takes none.
///
/// # Safety
/// `envp` must be null or a null-terminated array of C strings.
unsafe fn env_of(envp: Argv) -> Vec<Vec<u8>> {
    if envp.is_null() {
        return crate::image::current_env();
    }
    let mut out = Vec::new();
    // SAFETY: the caller's contract: a null-terminated array of valid C strings.
    unsafe {
        let mut p = envp;
        while !(*p).is_null() {
            out.push(CStr::from_ptr(*p).to_bytes().to_vec());
            p = p.add(1);
        }
    }
    out
}

/// Whether exec'ing `file` with `envp` keeps the library loaded (a panic says no: the
/// connections then move to TCP, which is always safe).
///
/// # Safety
/// `file` must be null or a C string; `envp` as for [`env_of`].
unsafe fn keeps(file: *const libc::c_char, search: bool, envp: Argv) -> bool {
    if file.is_null() {
        return false;
    }
    // SAFETY: the caller's contract.
    let (file, env) = unsafe { (CStr::from_ptr(file), env_of(envp)) };
    let env: Vec<&[u8]> = env.iter().map(|v| v.as_slice()).collect();
    crate::hooks::contain("exec image", || {
        crate::image::keeps_library(file, search, &env)
    })
    .unwrap_or(false)
}

hook! {
    fn execve(path: *const libc::c_char, argv: Argv, envp: Argv) -> c_int;
    real kernel = real::execve;
    on_panic kernel();
    // SAFETY: execve's contract: a C string and a null-terminated environment.
    { exec_with(unsafe { keeps(path, false, envp) }, kernel) }
}

hook! {
    fn execv(path: *const libc::c_char, argv: Argv) -> c_int;
    real kernel = real::execv;
    on_panic kernel();
    // SAFETY: execv's contract: a C string; our own environment.
    { exec_with(unsafe { keeps(path, false, std::ptr::null()) }, kernel) }
}

hook! {
    fn execvp(file: *const libc::c_char, argv: Argv) -> c_int;
    real kernel = real::execvp;
    on_panic kernel();
    // SAFETY: execvp's contract: a C string; our own environment.
    { exec_with(unsafe { keeps(file, true, std::ptr::null()) }, kernel) }
}

hook! {
    fn execvpe(file: *const libc::c_char, argv: Argv, envp: Argv) -> c_int;
    real kernel = real::execvpe;
    on_panic kernel();
    // SAFETY: execvpe's contract: a C string and a null-terminated environment.
    { exec_with(unsafe { keeps(file, true, envp) }, kernel) }
}

hook! {
    fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int;
    real kernel = real::fexecve;
    on_panic kernel();
    {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap_or_default();
        // SAFETY: a C string of ours; fexecve's contract for the environment.
        exec_with(unsafe { keeps(path.as_ptr(), false, envp) }, kernel)
    }
}

hook! {
    /// `posix_spawn` runs no fork handlers and execs in the child where we cannot see it:
    /// inheritable ring connections move to TCP first (the child's image adopts nothing).
    fn posix_spawn(
        pid: *mut libc::pid_t,
        path: *const libc::c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut libc::c_char,
        envp: *const *mut libc::c_char,
    ) -> c_int;
    real kernel = real::posix_spawn;
    on_panic kernel();
    {
        if let Some(Err(e)) = contain("spawn", dispatch::before_spawn) {
            return Ok(e); // (posix_spawn returns its error number)
        }
        Ok(kernel())
    }
}

hook! {
    fn posix_spawnp(
        pid: *mut libc::pid_t,
        file: *const libc::c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut libc::c_char,
        envp: *const *mut libc::c_char,
    ) -> c_int;
    real kernel = real::posix_spawnp;
    on_panic kernel();
    {
        if let Some(Err(e)) = contain("spawn", dispatch::before_spawn) {
            return Ok(e); // (posix_spawn returns its error number)
        }
        Ok(kernel())
    }
}

// ---- raw system calls -------------------------------------------------------------------------

hook! {
    /// The C library's `syscall`: everything passes through, but `io_uring_setup` is noted (a
    /// process with io_uring may wait on or read sockets where memloop cannot see it) and
    /// `pidfd_getfd` is followed as by its own hook below (Python, and any program built
    /// before the C library had the wrapper, call it this way).
    /// `syscall` is variadic; on these targets variadic integer arguments travel exactly like
    /// fixed ones, so the six possible arguments are taken and handed on as they came.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn syscall(
        n: libc::c_long,
        a: libc::c_long,
        b: libc::c_long,
        c: libc::c_long,
        d: libc::c_long,
        e: libc::c_long,
        f: libc::c_long,
    ) -> libc::c_long;
    real kernel = real::syscall,
        pass if n != libc::SYS_io_uring_setup && n != libc::SYS_pidfd_getfd
            && !socket_call_on_ours(n, a);
    // (A panic outside our contained logic: before the real call, as the fd's number is
    // only known after it.)
    on_panic if n == libc::SYS_pidfd_getfd { fail(libc::EIO) } else { kernel() };
    {
        if let Some(r) = socket_call(n, [a, b, c, d, e, f]) {
            return Ok(r);
        }
        if n == libc::SYS_pidfd_getfd {
            let r = kernel();
            if r < 0 {
                return Ok(r); // the kernel's errno stands
            }
            return dispatch::after_getfd(r as c_int).map(libc::c_long::from);
        }
        dispatch::note_io_uring();
        Ok(kernel())
    }
}

/// A data system call (or `close`) made through `syscall` on an fd of ours — libuv sends and
/// receives datagrams and closes fds so: it must see our rings and records as the C
/// library's function would.
fn socket_call_on_ours(n: libc::c_long, fd: libc::c_long) -> bool {
    let data = matches!(
        n,
        libc::SYS_close
            | libc::SYS_sendmmsg
            | libc::SYS_recvmmsg
            | libc::SYS_sendmsg
            | libc::SYS_recvmsg
            | libc::SYS_sendto
            | libc::SYS_recvfrom
    );
    data && c_int::try_from(fd).is_ok_and(|fd| crate::table::kind(fd) != crate::table::K_NONE)
}

/// [`socket_call_on_ours`]'s calls, answered by our hooks of the same functions (which set
/// errno and return -1 on failure, as `syscall` does).
fn socket_call(n: libc::c_long, a: [libc::c_long; 6]) -> Option<libc::c_long> {
    if !socket_call_on_ours(n, a[0]) {
        return None;
    }
    let fd = a[0] as c_int;
    let p = |i: usize| a[i] as usize as *mut libc::c_void;
    // SAFETY: the caller's system call arguments, passed to the functions that take the
    // same ones (the kernel would have read them just so).
    let r = unsafe {
        match n {
            // (libuv closes fds so, to avoid a cancellation point: our record must go too.)
            libc::SYS_close => super::socket::close(fd) as isize,
            libc::SYS_sendmmsg => {
                super::data::sendmmsg(fd, p(1).cast(), a[2] as c_uint, a[3] as c_int) as isize
            }
            libc::SYS_recvmmsg => {
                super::data::recvmmsg(fd, p(1).cast(), a[2] as c_uint, a[3] as c_int, p(4).cast())
                    as isize
            }
            libc::SYS_sendmsg => super::data::sendmsg(fd, p(1).cast(), a[2] as c_int),
            libc::SYS_recvmsg => super::data::recvmsg(fd, p(1).cast(), a[2] as c_int),
            libc::SYS_sendto => super::data::sendto(
                fd,
                p(1),
                a[2] as usize,
                a[3] as c_int,
                p(4).cast(),
                a[5] as libc::socklen_t,
            ),
            _ => super::data::recvfrom(
                fd,
                p(1),
                a[2] as usize,
                a[3] as c_int,
                p(4).cast(),
                p(5).cast(),
            ),
        }
    };
    Some(r as libc::c_long)
}

hook! {
    /// `pidfd_getfd` (glibc 2.36): a dup of another process's fd, of which that process hears
    /// nothing. A ring connection's socket leaves its ring before the program gets it, and
    /// becomes ours on TCP (`conn/grab.rs`); if it cannot in time the call fails (`EAGAIN`,
    /// `EBUSY`, `EBADF`) and the fd is closed. Anything else passes through.
    fn pidfd_getfd(pidfd: c_int, targetfd: c_int, flags: c_uint) -> c_int;
    real kernel = real::pidfd_getfd;
    on_panic fail(libc::EIO);
    {
        let fd = kernel();
        if fd < 0 {
            return Err(real::errno());
        }
        dispatch::after_getfd(fd)
    }
}

// ---- start-up ---------------------------------------------------------------------------------
// Called by the C library, so a panic must not unwind out of them either; there is no error
// to return, so it is logged and the handler ends.

// A process that never took one of our locks skips them (`forklock::fork_plan`): each page
// they touch after the fork costs a copy-on-write or first-touch fault.
// They run inside `fork`, which leaves errno alone when it succeeds: so must they.
extern "C" fn at_fork_prepare() {
    real::keeping_errno(|| {
        // From the second fork on: a process that forks often resolves the C library's
        // functions once here rather than in every child.
        static FORKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        if FORKS.load(std::sync::atomic::Ordering::Relaxed) < 2
            && FORKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 1
        {
            real::resolve_all();
        }
        if forklock::fork_plan() == ForkPlan::Full {
            track("fork prepare", dispatch::fork_prepare);
        }
    });
}
extern "C" fn at_fork_parent() {
    real::keeping_errno(|| {
        if forklock::active() {
            track("fork parent", dispatch::fork_parent);
        } else {
            forklock::end_skipped_fork();
        }
    });
}
extern "C" fn at_fork_child() {
    if !forklock::active() {
        // Loads only (nothing here sets errno): each page this child touches costs it a
        // fault, and most children of such a process exit or exec at once.
        crate::real::forget_pid();
    } else {
        real::keeping_errno(|| track("fork child", dispatch::fork_child));
    }
    if real::under_shim() {
        // After the handler: the close goes through our hooks, which take the locks it frees.
        // (Preloaded ourselves, the lock's own handler does it, registered after ours.)
        real::keeping_errno(memloop_shm::member_lock::close_in_child);
    }
}

extern "C" fn at_exit() {
    crate::logging_off();
    if forklock::active() {
        track("exit", crate::late::at_exit);
        track("exit", crate::udp::deliver_pending);
    }
}

// Loaded by `libmemloop.so` (the shim), these run from the shim's handlers, which it
// registered when the process started: ours, registered now, would run after the program's
// (its child handler may already use a socket).
#[no_mangle]
pub extern "C" fn memloop_engine_fork_prepare() {
    at_fork_prepare();
}
#[no_mangle]
pub extern "C" fn memloop_engine_fork_parent() {
    at_fork_parent();
}
#[no_mangle]
pub extern "C" fn memloop_engine_fork_child() {
    at_fork_child();
}
#[no_mangle]
pub extern "C" fn memloop_engine_exit() {
    at_exit();
}
/// The fork child handler, put off by the shim until the child first needed the engine;
/// `closed`: the plain connections it closed meanwhile (`n` of them).
///
/// # Safety
/// `closed` points to `n` fds (or `n` is 0).
#[no_mangle]
pub unsafe extern "C" fn memloop_engine_fork_child_deferred(closed: *const c_int, n: c_int) {
    let closed = match (closed.is_null(), usize::try_from(n)) {
        (false, Ok(n)) if n > 0 => {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(closed, n) }
        }
        _ => &[],
    };
    real::keeping_errno(|| {
        track("fork child", || {
            crate::dispatch::deferred_fork_child(closed)
        })
    });
}
/// Our table's kinds, for the shim's gate in such a child (`*len` entries, one byte per fd,
/// 0 "not ours"; no fd past them is ours): asked at every fork.
///
/// # Safety
/// `len` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn memloop_engine_kinds(len: *mut usize) -> *const u8 {
    let (p, n) = crate::table::kinds();
    // SAFETY: the caller's contract.
    unsafe { *len = n };
    p
}

extern "C" fn on_load() {
    track("load", || {
        crate::init_logging();
        crate::engine::capture_settings();
    });
    if real::under_shim() {
        // The shim runs the lock fds' child work (it may put ours off; see `dispatch`).
        memloop_shm::member_lock::child_handled_by_caller();
    } else {
        register_handlers();
    }
    if real::may_have_inherited() {
        track("load", crate::inherit::adopt_inherited);
    }
    crate::testpoint::pause(crate::testpoint::Point::EngineLoad);
}

/// The fork and exit handlers, when we are preloaded ourselves (not loaded by the shim).
fn register_handlers() {
    // SAFETY: registers three plain functions with no preconditions; they touch only our own
    // state, under the locks they take and release.
    let r = unsafe {
        libc::pthread_atfork(
            Some(at_fork_prepare),
            Some(at_fork_parent),
            Some(at_fork_child),
        )
    };
    if r != 0 {
        tracing::warn!(
            errno = r,
            "pthread_atfork failed: forked children may inherit held locks"
        );
    }
    // SAFETY: registers a plain function with no preconditions (run by `exit`, which a
    // program may call from any thread: it takes only our own locks).
    if unsafe { libc::atexit(at_exit) } != 0 {
        tracing::warn!("atexit failed: a forked handler that exits may keep a decline marker");
    }
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;
