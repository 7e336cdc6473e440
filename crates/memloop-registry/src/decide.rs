//! The decision word of a TCP channel: how a client waiting for the server to take its offer
//! hears that it did.
//!
//! A client sleeps for the decision either in the kernel, on its socket (`poll`, `select`,
//! `epoll`: the program's own waits), or on this word (a futex: our own blocking wait for the
//! decision). The server rings a doorbell byte over TCP only for the first kind, and wakes the
//! futex only for the second: most clients, waiting in their first `send` or `recv`, so cost
//! the server one futex wake instead of a TCP send, and themselves no doorbell to read.
//!
//! One word, one total order: a sleeper sets its bit (`KERNEL_WAIT`, `FUTEX_WAIT`) and looks
//! at what was there before; the server sets `DONE` — with `RANG` if `KERNEL_WAIT` was there —
//! before its accept becomes visible. So a sleeper either set its bit first (and the server
//! sees it) or finds `DONE` (and must look at the channel's state instead of sleeping), and a
//! client that sees the channel accepted knows from `RANG` whether a doorbell byte is its to
//! read.

use memloop_shm::sync::Ordering::SeqCst;
use memloop_shm::ShmU32;

const KERNEL_WAIT: u32 = 1;
const FUTEX_WAIT: u32 = 2;
const DONE: u32 = 4;
const RANG: u32 = 8;

/// A channel's decision word (`SideWords::decide`).
#[derive(Clone)]
pub struct DecideWord(pub ShmU32);

impl DecideWord {
    /// Server, before its accept becomes visible: decided. True if a client sleeper in the
    /// kernel asked for a doorbell byte (the server must ring it).
    pub fn decide(&self) -> bool {
        let mut cur = self.0.load(SeqCst);
        loop {
            let rang = if cur & KERNEL_WAIT != 0 { RANG } else { 0 };
            match self
                .0
                .compare_exchange(cur, cur | DONE | rang, SeqCst, SeqCst)
            {
                Ok(_) => return rang != 0,
                Err(now) => cur = now,
            }
        }
    }

    /// Server, after accepting: whether a client sleeps on the word (to wake).
    pub fn futex_sleepers(&self) -> bool {
        self.0.load(SeqCst) & FUTEX_WAIT != 0
    }

    /// Client, before sleeping in the kernel on its socket for the decision: true if the
    /// server will ring a doorbell byte when it accepts; false if it decided already (look
    /// at the channel's state instead of sleeping: no byte comes for this sleep).
    pub fn expect_doorbell(&self) -> bool {
        self.0.fetch_or(KERNEL_WAIT, SeqCst) & DONE == 0
    }

    /// Client, before a futex sleep on the word: the value to sleep on, or `None` if the
    /// server decided already.
    pub fn arm_futex(&self) -> Option<u32> {
        let old = self.0.fetch_or(FUTEX_WAIT, SeqCst);
        (old & DONE == 0).then_some(old | FUTEX_WAIT)
    }

    /// Client, having seen the channel accepted: whether the server rang a doorbell byte.
    pub fn rang(&self) -> bool {
        self.0.load(SeqCst) & RANG != 0
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::{AtomicBool, AtomicU32};
    use loom::sync::Arc;
    use memloop_shm::ShmSlice;

    /// A kernel sleeper, a futex sleeper and the server's accept. Each sleeper either finds
    /// the decision made (and sleeps not) or is woken by the server's action for its kind;
    /// and the byte a client expects is the byte the server rang.
    fn accept_race(decide: fn(&DecideWord) -> bool) {
        loom::model(move || {
            let word = Arc::new(DecideWord(ShmSlice::new_model(8).u32_at(0).unwrap()));
            let rung = Arc::new(AtomicU32::new(0));
            let futex_woken = Arc::new(AtomicBool::new(false));
            let server = {
                let (w, rung, woken) = (word.clone(), rung.clone(), futex_woken.clone());
                loom::thread::spawn(move || {
                    if decide(&w) {
                        rung.fetch_add(1, SeqCst);
                    }
                    if w.futex_sleepers() {
                        woken.store(true, SeqCst);
                    }
                })
            };
            let futex = {
                let w = word.clone();
                loom::thread::spawn(move || w.arm_futex().is_some())
            };
            let kernel_expects = word.expect_doorbell();
            let futex_slept = futex.join().unwrap();
            server.join().unwrap();
            if kernel_expects {
                assert_eq!(rung.load(SeqCst), 1, "a kernel sleeper lost its doorbell");
            }
            if futex_slept {
                assert!(futex_woken.load(SeqCst), "a futex sleeper was never woken");
            }
            assert_eq!(
                word.rang(),
                rung.load(SeqCst) == 1,
                "the byte owed is the byte rung"
            );
        });
    }

    #[test]
    fn every_sleeper_for_the_decision_is_woken() {
        accept_race(DecideWord::decide);
    }

    /// Control: a server that reads the sleepers' bits, then marks the decision in a separate
    /// step, lets a sleeper arm in between and sleep with nobody to wake it.
    #[test]
    #[should_panic(expected = "lost its doorbell")]
    fn deciding_in_two_steps_loses_a_doorbell() {
        accept_race(|w| {
            let asked = w.0.load(SeqCst) & KERNEL_WAIT != 0;
            let rang = if asked { RANG } else { 0 };
            w.0.fetch_or(DONE | rang, SeqCst);
            asked
        });
    }
}
