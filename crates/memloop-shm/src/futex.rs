//! Blocking on a word in shared memory.
//!
//! Futexes only work between processes of one kernel; memloop uses them as an optimisation and
//! always bounds the wait, so a missed wake-up costs latency, never liveness.

use crate::sync::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, for at most `timeout`. Returns early on a wake-up, a
/// signal, a spurious wake-up or if the word already differs: callers re-check their condition.
#[cfg(not(loom))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    if !try_wait(word, expected, timeout) {
        // The kernel cannot futex on this memory (a device mapping such as an ivshmem BAR is
        // not page-backed: EFAULT): sleep a little instead, so no caller turns into a busy loop.
        std::thread::sleep(timeout.min(FALLBACK_SLEEP));
    }
}

/// [`wait`] without its fallback: false (at once) if the kernel cannot futex on this memory,
/// so a caller that sleeps long anyway can sleep its own way.
#[cfg(not(loom))]
pub fn try_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    use rustix::thread::futex;
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // The value changed, a signal, or the time is up: the caller re-checks.
    matches!(
        futex::wait(word, futex::Flags::empty(), expected, Some(&ts)),
        Ok(_)
            | Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR | rustix::io::Errno::TIMEDOUT)
    )
}

/// How an untimed futex sleep ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woken {
    /// Woken, or the word had already moved (or a spurious wake-up): re-check.
    Woken,
    /// A signal handler ran and the kernel did not restart the sleep (no `SA_RESTART`).
    Interrupted,
    /// The kernel cannot futex on this memory (a device mapping): sleep some other way.
    Unsupported,
}

/// Sleeps while `*word == expected`, with no time limit. Without a timeout the kernel
/// restarts the sleep after a handler installed with `SA_RESTART` (and reports `EINTR`
/// otherwise), as it does for a blocking socket call.
#[cfg(not(loom))]
pub fn wait_untimed(word: &AtomicU32, expected: u32) -> Woken {
    use rustix::thread::futex;
    match futex::wait(word, futex::Flags::empty(), expected, None) {
        Err(rustix::io::Errno::INTR) => Woken::Interrupted,
        Err(rustix::io::Errno::FAULT | rustix::io::Errno::NOSYS | rustix::io::Errno::INVAL) => {
            Woken::Unsupported
        }
        _ => Woken::Woken,
    }
}

#[cfg(loom)]
pub fn wait_untimed(_word: &AtomicU32, _expected: u32) -> Woken {
    loom::thread::yield_now();
    Woken::Woken
}

/// The sleep that stands in for a futex wait the kernel refused.
#[cfg(not(loom))]
const FALLBACK_SLEEP: Duration = Duration::from_millis(1);

/// Wakes up to `n` waiters on `word` (shared, not process-private: waiters are other processes).
#[cfg(not(loom))]
pub fn wake(word: &AtomicU32, n: u32) {
    use rustix::thread::futex;
    // A refusal (EFAULT on a device mapping) has no remedy here: such waiters sleep in short
    // slices (`wait`'s fallback) and see the change on their next look.
    let _ = futex::wake(word, futex::Flags::empty(), n);
}

/// Moves `word` on (a new value for waiters to compare against) and wakes every waiter on it:
/// a bell rung by one side and slept on by any number of others.
pub fn bump_and_wake(word: &AtomicU32) {
    word.fetch_add(1, crate::sync::Ordering::SeqCst);
    wake(word, i32::MAX as u32);
}

#[cfg(loom)]
pub fn wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) {
    loom::thread::yield_now();
}

#[cfg(loom)]
pub fn try_wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) -> bool {
    loom::thread::yield_now();
    true
}

#[cfg(loom)]
pub fn wake(_word: &AtomicU32, _n: u32) {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::Ordering::SeqCst;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn wait_times_out_and_wake_releases() {
        let w = Arc::new(AtomicU32::new(0));
        let t = Instant::now();
        wait(&w, 0, Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(10));
        let w2 = w.clone();
        let h = std::thread::spawn(move || {
            while w2.load(SeqCst) == 0 {
                wait(&w2, 0, Duration::from_secs(5));
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        w.store(1, SeqCst);
        wake(&w, 1);
        h.join().unwrap();
    }
}
