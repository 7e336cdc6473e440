#![cfg(loom)]
//! Loom model of the leave's wake-up (`memloop_ring::leave`, `conn/switch.rs` `leave`): a side
//! leaving its rings rings its last doorbell only if the peer is armed on one of them (asleep
//! on its socket for data or for room), as a publication would. The peer's sleeper arms first,
//! then re-checks the switch request, then sleeps until a byte reaches its socket; the leaver
//! sets the request, then looks at the arms. Either the sleeper sees the request, or the leaver
//! sees the arm: a sleeper is never left asleep. The follower's own leave finds the initiator
//! waiting on the switch bell, not on its socket: no doorbell. Then both take over (discard the
//! peer's unread doorbells, re-send what it never consumed) and every byte arrives once, in
//! order. A control model that never rings the leave's doorbell strands the sleeper.
//! Run: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_leave_wake
mod loom_pair;

use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;
use loom_pair::{pair, Side, DB};
use memloop_ring::leave::{doorbells_to_discard, Left};

/// Executions in which the follower slept and the leave's doorbell woke it (the model must
/// reach that case, not only the ones where the follower saw the request in time).
static LEAVE_WAKES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What both sides share besides rings and wires: the channel's switch request, and (model
/// only) "the initiator's leave has looked at the arms".
#[derive(Clone, Default)]
struct Shared {
    requested: Arc<AtomicBool>,
    looked: Arc<AtomicBool>,
}

impl Side {
    /// The leave: a doorbell only for a peer armed on either ring (`ring` false: the control,
    /// which rings none), then our `Left`.
    fn leave(&mut self, ring: bool) {
        if ring && (self.tx.wake_reader() | self.rx.wake_writer()) != 0 {
            self.doorbell();
        }
        assert!(self.me.publish(Left {
            tail: self.tx.position(),
            head: self.rx.position(),
            doorbells: self.sent,
        }));
    }

    /// Discards the peer's unread doorbells, re-sends what it never consumed, then `post`;
    /// returns the `n` bytes that follow on the wire.
    fn take_over(&mut self, peer: Left, post: &[u8], n: usize) -> Vec<u8> {
        let skip = doorbells_to_discard(&peer, self.read).unwrap() as usize;
        let mut got = self.pop(skip);
        assert!(got.iter().all(|&b| b == DB), "discarded data: {got:?}");
        let mut resend = Vec::new();
        self.tx.unconsumed(peer.head, &mut resend).unwrap();
        {
            let mut w = self.out.lock().unwrap();
            w.extend(resend);
            w.extend(post.iter().copied());
        }
        got = self.pop(n);
        got
    }

    /// The initiator: writes `pre` to its ring (a doorbell if the peer armed for it), asks
    /// for the switch, leaves, waits for the peer, takes over.
    fn initiate(mut self, s: Shared, pre: &[u8], ring: bool) -> Vec<u8> {
        assert_eq!(self.tx.write(pre).unwrap(), pre.len());
        if self.tx.take_wake() != 0 {
            self.doorbell();
        }
        s.requested.store(true, SeqCst);
        self.leave(ring);
        s.looked.store(true, SeqCst);
        let peer = self.await_peer();
        self.take_over(peer, &[3], 1)
    }

    /// The follower: a reader that finds nothing in its ring arms, re-checks the ring and
    /// the request, and sleeps on its socket until a byte comes (then drains: on the ring
    /// everything there is a doorbell). Once it sees the request it leaves and takes over.
    fn follow(mut self, s: Shared) -> Vec<u8> {
        let mut got = Vec::new();
        let mut b = [0u8; 8];
        loop {
            self.rx.arm_doorbell();
            let n = self.rx.read(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
            if s.requested.load(SeqCst) {
                break;
            }
            if n == 0 {
                self.sleep(&s);
                if s.looked.load(SeqCst) {
                    LEAVE_WAKES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            self.rx.disarm();
            self.drain();
        }
        self.rx.disarm();
        self.drain();
        let n = self.rx.read(&mut b).unwrap();
        got.extend_from_slice(&b[..n]);
        self.leave(true);
        let peer = self.await_peer();
        let rest = self.take_over(peer, &[8], 3 - got.len());
        got.extend(rest);
        got
    }

    /// Asleep on the socket: only a byte there wakes us. Once the initiator's leave has
    /// looked at the arms, no byte will come before our own leave.
    fn sleep(&self, s: &Shared) {
        let queued = || !self.inq.lock().unwrap().is_empty();
        while !queued() {
            assert!(
                !s.looked.load(SeqCst) || queued(),
                "a sleeping peer was never woken by the leave"
            );
            thread::yield_now();
        }
    }

    fn drain(&mut self) {
        let drained = self.inq.lock().unwrap().drain(..).count();
        self.read += drained as u64;
    }
}

fn model(ring_the_leave: bool) {
    loom::model(move || {
        let (x, y) = pair();
        let s = Shared::default();
        let sy = s.clone();
        let ty = thread::spawn(move || y.follow(sy));
        let got_x = x.initiate(s, &[1, 2], ring_the_leave);
        let got_y = ty.join().unwrap();
        assert_eq!(got_x, [8], "x received");
        assert_eq!(got_y, [1, 2, 3], "y received");
    });
}

#[test]
fn a_leave_rings_only_for_an_armed_peer_and_never_strands_a_sleeper() {
    model(true);
    let wakes = LEAVE_WAKES.load(std::sync::atomic::Ordering::Relaxed);
    assert!(wakes > 0, "no execution had the leave wake a sleeper");
}

/// A leave that never rings its doorbell leaves a sleeping peer asleep.
#[test]
#[should_panic(expected = "never woken")]
fn without_the_leave_doorbell_a_sleeper_is_stranded() {
    model(false);
}
