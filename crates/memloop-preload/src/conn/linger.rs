//! The real close of a ring connection whose peer began closing first, put off until the
//! peer's FIN has come.
//!
//! On TCP the side that closes first sends the first FIN and keeps TIME_WAIT. On a ring the
//! peer's EOF comes before its FIN (the ring is shut first, the kernel socket closed after),
//! so a program that closes on EOF would otherwise send its FIN first and keep TIME_WAIT on
//! its side — on a server, on its listening port, which a restarted server without
//! `SO_REUSEADDR` then cannot bind. Waiting in `close` for the peer's FIN costs the time the
//! peer takes to finish its close (~20 µs here); instead the program's fd closes at once and
//! a duplicate of ours keeps the socket open until the FIN is there, or [`HOLD_AT_MOST`]. They
//! are looked at by the next close of this process and by its heartbeat.

use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::time::{Duration, Instant};

/// The longest a socket is held for its peer's FIN (then it closes anyway).
const HOLD_AT_MOST: Duration = Duration::from_millis(200);

static HELD: ForkMutex<Vec<(c_int, Instant)>> = ForkMutex::new(Vec::new());
static ANY: AtomicBool = AtomicBool::new(false);

/// Whether the peer's FIN (or a reset) has reached `fd`, without waiting.
fn fin_came(fd: c_int) -> bool {
    let ends = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL;
    real::wait_fd(fd, ends, Some(Duration::ZERO)).map_or(true, |ev| ev & ends != 0)
}

/// Before the program's real close of `fd`, whose peer began closing first: keeps the socket
/// open (a private duplicate) until the peer's FIN, unless it came already.
pub fn hold_for_peer_fin(fd: c_int) {
    if fin_came(fd) {
        return;
    }
    let Some(dup) = real::dup_high(fd, crate::table::MAX_FD) else {
        return; // (no fd to spare: the close goes as it is)
    };
    // (Ours: a program that closes it — `closefrom` — is heard of, see `program_closes`.)
    crate::table::mark_own(dup);
    HELD.lock().push((dup, Instant::now() + HOLD_AT_MOST));
    ANY.store(true, Release);
}

/// The program closes `fd`, one of ours (`closefrom`, `close_range`, `dup2` over it): if it
/// is a held socket, it is the program's close now, and never ours (its number may be the
/// program's next fd).
pub fn program_closes(fd: c_int) {
    if ANY.load(Acquire) {
        HELD.lock().retain(|&(held, _)| held != fd);
    }
}

/// Closes the held sockets whose peer's FIN came (or that were held long enough). One load
/// when none is held.
pub fn release_done() {
    if !ANY.load(Acquire) {
        return;
    }
    let Some(mut held) = HELD.try_lock() else {
        return; // (another thread is at it)
    };
    let now = Instant::now();
    held.retain(|&(fd, until)| {
        let done = now >= until || fin_came(fd);
        if done {
            crate::table::unmark_own(fd);
            real::close_own(fd);
        }
        !done
    });
    ANY.store(!held.is_empty(), Release);
}

pub fn lock_for_fork() {
    HELD.acquire_for_fork(|h| {
        if !h.is_empty() {
            crate::dispatch::child_needs_engine();
        }
    });
}

pub fn release_after_fork() {
    HELD.release_after_fork();
}

/// In a fork child: its copies of the held sockets would keep them open (no FIN) while it
/// lives. Closed by system call (the C library's `close` is our own hook).
pub fn forget_in_child() {
    let mut held = HELD.lock();
    for (fd, _) in held.drain(..) {
        crate::table::unmark_own(fd);
        real::close_by_syscall(fd);
    }
    ANY.store(false, Release);
}
