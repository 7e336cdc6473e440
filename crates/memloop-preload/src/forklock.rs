//! A small spin mutex that can be held across `fork`: the `atfork` prepare handler takes it
//! and the parent and child handlers release it, so the child never inherits a lock that a
//! vanished thread was holding. `std::sync::Mutex` cannot be released without its guard.
#![allow(unsafe_code)]

use memloop_shm::forkgate::{ForkGate, ForkPlan};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// Open once any of our locks has been taken in this process: until then the fork handlers
/// have nothing to release or reset, and skip (`memloop_shm::forkgate`).
static GATE: ForkGate = ForkGate::new();

/// A fork's prepare: whether its handlers run ([`ForkPlan::Full`]) or are skipped. Its parent
/// and child handlers tell which from [`active`] (it cannot change in between).
pub fn fork_plan() -> ForkPlan {
    // (The real getpid: the cached one is forgotten only by handlers that may be skipped.)
    // SAFETY: getpid has no preconditions.
    GATE.prepare(unsafe { libc::getpid() } as u32)
}

/// The parent handler of a skipped fork.
pub fn end_skipped_fork() {
    GATE.end_skip();
}

/// Whether this process ever took one of our locks (else the fork and exit handlers have
/// nothing to do).
pub fn active() -> bool {
    GATE.is_active()
}

#[inline]
fn open_gate() {
    if !GATE.is_active() {
        // SAFETY: getpid has no preconditions.
        GATE.activate(unsafe { libc::getpid() } as u32);
    }
}

pub struct ForkMutex<T> {
    locked: AtomicBool,
    /// Set while the lock is held for a fork (no guard, no reference to the value out): only
    /// then may [`Self::release_after_fork`] release it, so it can never free a guard's lock.
    for_fork: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: access to `value` is serialised by `locked` (acquire on lock, release on unlock).
unsafe impl<T: Send> Sync for ForkMutex<T> {}
// SAFETY: as above; the mutex owns its value.
unsafe impl<T: Send> Send for ForkMutex<T> {}

impl<T> ForkMutex<T> {
    pub const fn new(value: T) -> Self {
        ForkMutex {
            locked: AtomicBool::new(false),
            for_fork: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    pub fn lock(&self) -> ForkGuard<'_, T> {
        self.acquire();
        ForkGuard { m: self }
    }

    fn acquire(&self) {
        open_gate();
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The lock if it is free now.
    pub fn try_lock(&self) -> Option<ForkGuard<'_, T>> {
        open_gate();
        // (`then`, not `then_some`: a guard built and dropped on failure would unlock the
        // holder's lock.)
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then(|| ForkGuard { m: self })
    }

    /// Takes the lock without a guard (atfork prepare), runs `f` on the value while holding
    /// it, and keeps holding it; pair with [`Self::release_after_fork`].
    pub fn acquire_for_fork(&self, f: impl FnOnce(&mut T)) {
        self.acquire();
        // SAFETY: we hold the lock, just acquired; `for_fork` is still clear, so nothing can
        // release it before `f` returns and its borrow of the value ends.
        f(unsafe { &mut *self.value.get() });
        self.for_fork.store(true, Ordering::Release);
    }

    /// Like [`Self::acquire_for_fork`] without waiting: false if another thread holds it.
    pub fn try_acquire_for_fork(&self) -> bool {
        open_gate();
        let taken = self
            .locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok();
        if taken {
            self.for_fork.store(true, Ordering::Release);
        }
        taken
    }

    /// In a fork child, for a lock the fork's caller never holds at a fork: whoever holds it
    /// is a thread of the parent, which the child does not have, so nobody would release it.
    /// (Only for a lock whose holders keep nothing half-done in the value that the child
    /// could trip on: `()` locks, single words, state reloaded before use.)
    pub fn free_in_child(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// Releases a lock taken by [`Self::acquire_for_fork`] (atfork parent and child); does
    /// nothing if it is not held for a fork (a guard's lock is its guard's to release).
    pub fn release_after_fork(&self) {
        if self.for_fork.swap(false, Ordering::AcqRel) {
            self.locked.store(false, Ordering::Release);
        }
    }
}

pub struct ForkGuard<'a, T> {
    m: &'a ForkMutex<T>,
}

impl<T> Deref for ForkGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while this thread holds the lock.
        unsafe { &*self.m.value.get() }
    }
}

impl<T> DerefMut for ForkGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard exists only while this thread holds the lock, exclusively.
        unsafe { &mut *self.m.value.get() }
    }
}

impl<T> Drop for ForkGuard<'_, T> {
    fn drop(&mut self) {
        self.m.locked.store(false, Ordering::Release);
    }
}

impl<T: Default> Default for ForkMutex<T> {
    fn default() -> Self {
        ForkMutex::new(T::default())
    }
}

#[cfg(test)]
mod try_lock_tests {
    use super::ForkMutex;

    #[test]
    fn a_failed_try_lock_leaves_the_holder_holding() {
        let m = ForkMutex::new(());
        let held = m.lock();
        assert!(m.try_lock().is_none());
        assert!(m.try_lock().is_none(), "still held after a failed try");
        drop(held);
        assert!(m.try_lock().is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_after_fork_never_frees_a_guards_lock() {
        let m = ForkMutex::new(1);
        let g = m.lock();
        m.release_after_fork();
        assert!(!m.try_acquire_for_fork(), "a guard's lock was released");
        drop(g);
        m.acquire_for_fork(|v| *v += 1);
        assert!(!m.try_acquire_for_fork());
        m.release_after_fork();
        m.release_after_fork(); // a second release does nothing
        assert_eq!(*m.lock(), 2);
        assert!(m.try_acquire_for_fork());
        m.release_after_fork();
    }
}
