#![cfg(loom)]
//! Loom model of two sides leaving their rings mid-stream (`memloop_ring::leave`): each side
//! writes to its ring and rings doorbells on a model TCP stream, may drain doorbells, leaves at
//! an arbitrary point of the other's progress, then discards the peer's unread doorbells,
//! re-sends what the peer never consumed and goes on over TCP. Each side must receive exactly
//! the peer's bytes, in order: nothing lost, duplicated, reordered, and no doorbell delivered
//! as data. A control model without the discard shows the check can fail.
//! Run: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_leave
mod loom_pair;

use loom::thread;
use loom_pair::{pair, Side, DB};
use memloop_ring::leave::{doorbells_to_discard, Left};

impl Side {
    /// One side's life: `pre` over the ring, a drain, a leave, `post` over TCP. Returns what it
    /// received from the peer (`expect` bytes).
    fn run(mut self, pre: &[u8], post: &[u8], expect: usize, discard: bool) -> Vec<u8> {
        let mut got = Vec::new();
        assert_eq!(self.tx.write(pre).unwrap(), pre.len());
        self.doorbell();
        // A drain while on the ring: everything on the wire is a doorbell now.
        let drained = self.inq.lock().unwrap().drain(..).count();
        self.read += drained as u64;
        let mut b = [0u8; 8];
        let n = self.rx.read(&mut b).unwrap();
        got.extend_from_slice(&b[..n]);
        // Leave: wake the peer (counted), then publish where we stopped.
        self.doorbell();
        assert!(self.me.publish(Left {
            tail: self.tx.position(),
            head: self.rx.position(),
            doorbells: self.sent,
        }));
        let peer = self.await_peer();
        if discard {
            let n = doorbells_to_discard(&peer, self.read).unwrap() as usize;
            let skip = self.pop(n);
            assert!(skip.iter().all(|&b| b == DB), "discarded data: {skip:?}");
        }
        let mut resend = Vec::new();
        self.tx.unconsumed(peer.head, &mut resend).unwrap();
        {
            let mut w = self.out.lock().unwrap();
            w.extend(resend);
            w.extend(post.iter().copied());
        }
        got.extend(self.pop(expect - got.len()));
        got
    }
}

fn model(discard: bool) {
    loom::model(move || {
        let (x, y) = pair();
        let ty = thread::spawn(move || y.run(&[9], &[8, 7], 3, discard));
        let got_x = x.run(&[1, 2], &[3], 3, discard);
        let got_y = ty.join().unwrap();
        assert_eq!(got_x, [9, 8, 7], "x received");
        assert_eq!(got_y, [1, 2, 3], "y received");
    });
}

#[test]
fn both_sides_leave_and_every_byte_arrives_once_in_order() {
    model(true);
}

/// Without discarding the peer's unread doorbells, some run delivers one as data.
#[test]
#[should_panic(expected = "received")]
fn without_the_discard_a_doorbell_is_delivered_as_data() {
    model(false);
}
