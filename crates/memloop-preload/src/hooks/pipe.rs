//! The pipe service's C functions (`crates/memloop-preload/include/memloop_pipe.h`): `memloop_pipe`,
//! `memloop_pipe_submit`, `memloop_pipe_fd`, `memloop_pipe_complete`, `memloop_pipe_cancel`.
//! The shim (`libmemloop.so`) exports the same names and forwards them here, loading the
//! engine first; preloaded by itself, the engine's exports are the ones found.
//!
//! Each returns its result or `-errno`, never sets `errno` (it is left as the caller had it),
//! and runs under `catch_unwind`: a panic in our logic is logged once and returns `-EIO`.
//! With `MEMLOOP_DISABLE` set they return `-ENOSYS`, as the shim's do then.
//! Descriptors the program hands in are checked to be open (`F_GETFD`) before they are
//! borrowed, and ring connections among them leave their rings first (as for `SCM_RIGHTS`:
//! the service gets plain TCP sockets).

use super::Hook;
use crate::pipe;
use libc::c_int;
use std::os::fd::BorrowedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs one C function's logic: `Ok(v)` is returned, `Err(e)` becomes `err(e)`, a panic
/// `err(EIO)`; errno is left alone.
fn c_call<R>(hook: &Hook, f: impl FnOnce() -> Result<R, c_int>, err: impl Fn(c_int) -> R) -> R {
    if crate::engine::disabled() {
        // (As under the shim, which does not load the engine when MEMLOOP_DISABLE is set.)
        return err(libc::ENOSYS);
    }
    crate::cancel::enter();
    let r = crate::real::keeping_errno(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => err(e),
        Err(payload) => {
            hook.report(&*payload);
            err(libc::EIO)
        }
    });
    crate::cancel::exit(false);
    r
}

/// Runs `f` with the program's `src` and `dst` borrowed, after checking them (open; ring
/// connections demoted to TCP: `EBUSY` when one cannot leave its ring yet).
fn with_fds<R>(
    src: c_int,
    dst: c_int,
    f: impl FnOnce(BorrowedFd<'_>, BorrowedFd<'_>) -> Result<R, c_int>,
) -> Result<R, c_int> {
    for fd in [src, dst] {
        if fd < 0 || crate::real::fd_flags(fd) < 0 {
            return Err(libc::EBADF);
        }
    }
    crate::dispatch::before_passing(&[src, dst])?;
    // SAFETY: both numbers are open descriptors of this process (checked just above), and the
    // borrows do not outlive this call, during which the caller's contract keeps them open.
    // (A program closing one meanwhile makes our system calls on it fail with EBADF; the
    // borrows are only ever handed to system calls.)
    let (s, d) = unsafe { (BorrowedFd::borrow_raw(src), BorrowedFd::borrow_raw(dst)) };
    f(s, d)
}

fn neg(e: c_int) -> i64 {
    -(e.max(1) as i64)
}

/// Moves `len` bytes (0: until the source ends) from `src_fd` to `dst_fd` through the pipe
/// service and waits: the bytes moved, or `-errno`.
#[no_mangle]
pub extern "C" fn memloop_pipe(src_fd: c_int, dst_fd: c_int, len: u64) -> i64 {
    static HOOK: Hook = Hook::new("memloop_pipe");
    c_call(
        &HOOK,
        || with_fds(src_fd, dst_fd, |s, d| pipe::pipe(s, d, len)).map(|n| n as i64),
        neg,
    )
}

/// Starts a transfer: its id (> 0), or `-errno`.
#[no_mangle]
pub extern "C" fn memloop_pipe_submit(src_fd: c_int, dst_fd: c_int, len: u64) -> i64 {
    static HOOK: Hook = Hook::new("memloop_pipe_submit");
    c_call(
        &HOOK,
        || with_fds(src_fd, dst_fd, |s, d| pipe::submit(s, d, len)),
        neg,
    )
}

/// A descriptor that polls readable when a completion waits, or `-errno`.
#[no_mangle]
pub extern "C" fn memloop_pipe_fd() -> c_int {
    static HOOK: Hook = Hook::new("memloop_pipe_fd");
    c_call(&HOOK, pipe::notify_fd, |e| -e.max(1))
}

/// The next completion of a transfer started with `memloop_pipe_submit`: 0 with `*id`,
/// `*moved` and `*error` (0, or the transfer's errno) stored (each pointer may be null);
/// `-EAGAIN` when none is there yet (`wait == 0`); `-ENOENT` when none will come.
///
/// # Safety
/// Each pointer must be null or valid for a write of its type.
#[no_mangle]
pub unsafe extern "C" fn memloop_pipe_complete(
    id: *mut i64,
    moved: *mut u64,
    error: *mut c_int,
    wait: c_int,
) -> c_int {
    static HOOK: Hook = Hook::new("memloop_pipe_complete");
    c_call(
        &HOOK,
        || {
            let (i, d) = pipe::complete(wait != 0)?;
            // SAFETY: each is null or writable, by the contract.
            unsafe {
                if let Some(p) = id.as_mut() {
                    *p = i;
                }
                if let Some(p) = moved.as_mut() {
                    *p = d.moved;
                }
                if let Some(p) = error.as_mut() {
                    *p = d.errno;
                }
            }
            Ok(0)
        },
        |e| -e.max(1),
    )
}

/// Asks the service to stop transfer `id` (its completion still comes): 0 or `-errno`.
#[no_mangle]
pub extern "C" fn memloop_pipe_cancel(id: i64) -> c_int {
    static HOOK: Hook = Hook::new("memloop_pipe_cancel");
    c_call(&HOOK, || pipe::cancel(id).map(|()| 0), |e| -e.max(1))
}
