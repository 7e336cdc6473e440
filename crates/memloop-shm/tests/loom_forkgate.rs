//! Loom model of the fork gate (`forkgate.rs`): a fork that skips its handlers never happens
//! while another thread holds a lock its child would inherit held.
#![cfg(loom)]

use loom::sync::atomic::{AtomicU32, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;
use memloop_shm::forkgate::{ForkGate, ForkPlan};

const PID: u32 = 41;

#[test]
fn a_skipping_fork_never_sees_a_lock_held() {
    loom::model(|| {
        let gate = Arc::new(ForkGate::new());
        let locked = Arc::new(AtomicU32::new(0));
        let (g, l) = (gate.clone(), locked.clone());
        let locker = thread::spawn(move || {
            g.activate(PID);
            l.store(1, SeqCst); // the process's first lock …
            l.store(0, SeqCst); // … and its release
        });
        match gate.prepare(PID) {
            ForkPlan::Skip => {
                // The fork itself: the child copies memory now, with no handler to free a lock.
                assert_eq!(locked.load(SeqCst), 0, "a lock held across a skipping fork");
                // The handlers tell the plan from `is_active`.
                assert!(!gate.is_active(), "activated under a skipping fork");
                gate.end_skip();
            }
            ForkPlan::Full => assert!(gate.is_active()),
        }
        locker.join().unwrap();
    });
}
