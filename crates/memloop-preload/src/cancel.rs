//! Thread cancellation (`pthread_cancel`) through our hooks.
//!
//! The C library acts on a cancellation inside its cancellation points (`recv`, `poll`,
//! `epoll_wait`, …) by unwinding the thread's stack. Were that to happen inside our logic, the
//! unwind would reach the `catch_unwind` of `hooks::guard`, which cannot pass it on: the process
//! aborts ("FATAL: exception not rethrown"). And the C library signals a thread only while it
//! sits in one of *its* cancellation points, so a thread asleep in one of ours (a futex sleep on
//! a ring) would never notice. So:
//! - our own waits on the kernel are raw system calls, no cancellation points;
//! - our export of `pthread_cancel` notes the thread ([`asked_here`]) and wakes this process's
//!   futex sleepers; waits on the kernel look at it after each slice (at most 200 ms);
//! - a wait that finds its thread asked disables cancellation for the rest of our logic
//!   ([`hold`]) and ends with `EINTR`; at the hook's exit the program's state is restored and
//!   the cancellation acts ([`exit`]), where no frame of ours is left to unwind;
//! - a cancellation pending when a hook starts acts there ([`enter`]), as at the start of the
//!   C library's call.
//!
//! A hook's `kernel()` (the C library's own function for the program: `accept`, `connect`,
//! I/O on a socket that is not a ring) stays a cancellation point as it was. Left open: a
//! cancellation asked while a thread runs our logic (not asleep) can still act in one of the
//! C library's calls we make on the way (a doorbell's `send`), until that logic next looks; and
//! a thread asleep in the socket sleep of a ring (shared ring ends, or futexes refused: a raw
//! blocking peek, with no slices to look between) is not woken by the cancellation.

#![allow(unsafe_code)]

use libc::c_int;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;

/// The program has called `pthread_cancel` at least once.
static SEEN: AtomicBool = AtomicBool::new(false);
/// Threads the program asked to cancel that have not been cancelled by a hook's exit yet.
static ASKED: Mutex<Vec<libc::pthread_t>> = Mutex::new(Vec::new());

thread_local! {
    /// Hooks running on this thread (a signal handler may call one inside another), and the
    /// cancellation state the outermost one found, while we keep cancellation disabled.
    static HELD: Held = const { Held(Cell::new((0, None))) };
}

struct Held(Cell<(u32, Option<c_int>)>);

impl std::ops::Deref for Held {
    type Target = Cell<(u32, Option<c_int>)>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Held {
    /// The thread ends (cancelled where the C library acted itself, in a hook's `kernel()`,
    /// or otherwise): a new thread may get its `pthread_t`, and must not find it asked.
    fn drop(&mut self) {
        if SEEN.load(Relaxed) {
            take_asked();
        }
    }
}

/// Our export of `pthread_cancel`: notes that cancellation is in use, then cancels.
///
/// # Safety
/// As for the C library's `pthread_cancel`.
#[no_mangle]
pub unsafe extern "C" fn pthread_cancel(thread: libc::pthread_t) -> c_int {
    // The C library loads the unwinder first thing in its `pthread_cancel`, before it marks
    // the thread. The engine does not load it (`shim/unwind_forward.c`), and a load takes
    // ~140 µs here: a waiter that saw our note in that window found no cancellation to act on
    // and returned EINTR (3 runs of 6 of the cancellation test). Loaded first, the mark follows
    // the note within the C library's call. (Noted after, the note could outlive a thread
    // the mark had already ended and meet the next one with its `pthread_t`.)
    // SAFETY: loads a library; no preconditions.
    unsafe { memloop_unwinder_load() };
    SEEN.store(true, Relaxed);
    crate::real::keeping_errno(|| {
        crate::hooks::track("pthread_cancel", || {
            let mut asked = asked();
            if !asked.contains(&thread) {
                asked.push(thread);
            }
        });
        // SAFETY: the caller's own argument to the C library's function.
        let r = unsafe { crate::real::pthread_cancel()(thread) };
        // A thread asleep in one of our waits is no cancellation point: it is woken to look
        // ([`asked_here`]). Sleeps on the kernel end at their next slice, futex sleeps now.
        crate::hooks::track("pthread_cancel", crate::conn::wake_futex_sleepers);
        r
    })
}

fn asked() -> std::sync::MutexGuard<'static, Vec<libc::pthread_t>> {
    ASKED.lock().unwrap_or_else(|p| p.into_inner())
}

fn me() -> libc::pthread_t {
    // SAFETY: no preconditions.
    unsafe { libc::pthread_self() }
}

/// Whether the program asked to cancel this thread (our waits then end with `EINTR`, and
/// the hook's exit lets the cancellation act).
pub fn asked_here() -> bool {
    if !SEEN.load(Relaxed) {
        return false;
    }
    let asked = asked().contains(&me());
    if asked {
        // Our logic goes on until the hook's exit: no cancellation point may act in it.
        hold();
    }
    asked
}

/// A hook starts: a pending cancellation acts now, and none acts until [`exit`].
pub fn enter() {
    let seen = SEEN.load(Relaxed);
    if seen && HELD.try_with(|h| h.get().0 == 0) == Ok(true) {
        // SAFETY: no frame of ours is unwound but the hook's own, which has no destructors
        // yet (as when the C library's call acts at its entry).
        unsafe { pthread_testcancel() };
    }
    let _ = HELD.try_with(|h| {
        let (depth, old) = h.get();
        h.set((depth + 1, old));
    });
}

/// Keeps cancellation disabled until the outermost hook exits (once the program uses it).
pub fn hold() {
    if !SEEN.load(Relaxed) {
        return;
    }
    let _ = HELD.try_with(|h| {
        let (depth, old) = h.get();
        if old.is_none() && depth > 0 {
            let mut was = 0;
            // SAFETY: valid out-pointer; changing our own thread's state only.
            unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut was) };
            h.set((depth, Some(was)));
        }
    });
}

/// A hook ends (`interrupted`: with `EINTR`): the outermost one restores the program's
/// cancellation state and, after a wait that ended for a cancellation, lets it act.
pub fn exit(interrupted: bool) {
    let outermost = HELD.try_with(|h| {
        let (depth, old) = h.get();
        let depth = depth.saturating_sub(1);
        if depth > 0 {
            h.set((depth, old));
            return false;
        }
        h.set((0, None));
        if let Some(was) = old {
            let mut ignored = 0;
            // SAFETY: valid out-pointer; restores the state `hold` found.
            unsafe { pthread_setcancelstate(was, &mut ignored) };
        }
        true
    });
    if outermost == Ok(true) && interrupted && SEEN.load(Relaxed) && take_asked() {
        // Called here, not from a closure: the unwind must meet no frame of ours that is not
        // this hook's own (which frames get landing pads depends on inlining).
        let e = crate::real::errno();
        // SAFETY: as in `enter`; if the program disabled cancellation it returns.
        unsafe { pthread_testcancel() };
        crate::real::set_errno(e);
    }
}

/// Whether this thread was asked to be cancelled; forgets it.
fn take_asked() -> bool {
    let me = me();
    let mut asked = asked();
    let before = asked.len();
    asked.retain(|&t| t != me);
    asked.len() != before
}

/// glibc's value (not in the `libc` crate).
const PTHREAD_CANCEL_DISABLE: c_int = 1;

extern "C" {
    /// `shim/unwind_forward.c`: loads libgcc_s (the unwinder our panics and the C library's
    /// cancellations use) if it is not loaded yet.
    fn memloop_unwinder_load() -> *mut libc::c_void;
    fn pthread_testcancel();
    fn pthread_setcancelstate(state: c_int, old: *mut c_int) -> c_int;
}
