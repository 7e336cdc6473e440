//! The libc calls of `memloop bench process` that std does not make: `fork`, `exit` and `_exit`
//! in a child, `waitpid`. They must be libc's (not raw system calls), so that the preload
//! library's fork and exit handlers run as in any program.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

/// How a forked child ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChildExit {
    /// `exit(0)`: atexit handlers run (the library's among them), as in a real program's child.
    Exit,
    /// `_exit(0)`: straight to the kernel.
    RawExit,
}

/// Forks `n` times, one child at a time: the child ends at once (`how`), the parent waits for
/// it. Returns the mean µs per iteration.
pub fn fork_loop(n: u32, how: ChildExit) -> io::Result<f64> {
    let t0 = Instant::now();
    for _ in 0..n {
        // SAFETY: the child only calls exit or _exit.
        match unsafe { libc::fork() } {
            -1 => return Err(io::Error::last_os_error()),
            0 => end_child(how),
            pid => wait_child(pid)?,
        }
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6 / f64::from(n.max(1)))
}

fn end_child(how: ChildExit) -> ! {
    // SAFETY: ends the process; `exit` runs the atexit handlers as any program's exit does.
    unsafe {
        match how {
            ChildExit::Exit => libc::exit(0),
            ChildExit::RawExit => libc::_exit(0),
        }
    }
}

/// Waits for child `pid`, which must exit with status 0.
fn wait_child(pid: libc::pid_t) -> io::Result<()> {
    let mut status = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "a forked child ended with wait status {status:#x}"
        )))
    }
}

/// A fork-per-connection server's step: the child closes its copy of the listener, runs
/// `handle` on the connection, closes it and calls `exit(0)` (the library's atexit handlers
/// run, as in real servers); the parent closes its copy of the connection and reaps the
/// children that have ended so far.
pub fn fork_for<L: AsRawFd>(
    listener: &L,
    conn: std::net::TcpStream,
    handle: fn(&mut std::net::TcpStream),
) {
    // SAFETY: the child uses only the connection, then exits.
    match unsafe { libc::fork() } {
        -1 => eprintln!(
            "memloop-bench proc-peer: fork: {}",
            io::Error::last_os_error()
        ),
        0 => {
            // SAFETY: the listener's fd is ours (a copy in this child); nothing uses it after.
            unsafe { libc::close(listener.as_raw_fd()) };
            let mut conn = conn;
            handle(&mut conn);
            drop(conn);
            end_child(ChildExit::Exit)
        }
        _ => drop(conn),
    }
    reap();
}

/// Collects every child that has ended, without waiting.
fn reap() {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer.
        if unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } <= 0 {
            return;
        }
    }
}
