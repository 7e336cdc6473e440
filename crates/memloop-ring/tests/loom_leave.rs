#![cfg(loom)]
//! Loom model of two sides leaving their rings mid-stream (`memloop_ring::leave`): each side
//! writes to its ring and rings doorbells on a model TCP stream, may drain doorbells, leaves at
//! an arbitrary point of the other's progress, then discards the peer's unread doorbells,
//! re-sends what the peer never consumed and goes on over TCP. Each side must receive exactly
//! the peer's bytes, in order: nothing lost, duplicated, reordered, and no doorbell delivered
//! as data. A control model without the discard shows the check can fail.
//! Run: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_leave
use loom::sync::{Arc, Mutex};
use loom::thread;
use memloop_ring::leave::{doorbells_to_discard, LeaveCell, Left, LEAVE_CELL_BYTES};
use memloop_ring::{init_ring, ring_bytes, RingKind, StreamConsumer, StreamProducer};
use memloop_shm::ShmSlice;
use std::collections::VecDeque;

/// A doorbell byte: on the wire it is indistinguishable from data; only the counts tell.
const DB: u8 = 0xdb;

type Wire = Arc<Mutex<VecDeque<u8>>>;

struct Side {
    tx: StreamProducer,
    rx: StreamConsumer,
    me: LeaveCell,
    peer: LeaveCell,
    out: Wire,
    inq: Wire,
    sent: u64,
    read: u64,
}

impl Side {
    fn doorbell(&mut self) {
        self.out.lock().unwrap().push_back(DB);
        self.sent += 1;
    }

    /// Pops `n` bytes from the wire, waiting for them.
    fn pop(&self, n: usize, into: &mut Vec<u8>) {
        while into.len() < n {
            let b = self.inq.lock().unwrap().pop_front();
            match b {
                Some(b) => into.push(b),
                None => thread::yield_now(),
            }
        }
    }

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
        let peer = loop {
            if let Some(p) = self.peer.read().unwrap() {
                break p;
            }
            thread::yield_now();
        };
        if discard {
            let n = doorbells_to_discard(&peer, self.read).unwrap() as usize;
            let mut skip = Vec::new();
            self.pop(n, &mut skip);
            assert!(skip.iter().all(|&b| b == DB), "discarded data: {skip:?}");
        }
        let mut resend = Vec::new();
        self.tx.unconsumed(peer.head, &mut resend).unwrap();
        {
            let mut w = self.out.lock().unwrap();
            w.extend(resend);
            w.extend(post.iter().copied());
        }
        let mut rest = Vec::new();
        self.pop(expect - got.len(), &mut rest);
        got.extend(rest);
        got
    }
}

fn ring() -> ShmSlice {
    let v = ShmSlice::new_model(ring_bytes(64) as usize);
    init_ring(&v, RingKind::Stream, 64, 0).unwrap();
    v
}

fn model(discard: bool) {
    loom::model(move || {
        let (xy, yx) = (ring(), ring());
        let cells = ShmSlice::new_model(2 * LEAVE_CELL_BYTES as usize);
        let cell = |i: u64| LeaveCell::new(&cells, i * LEAVE_CELL_BYTES).unwrap();
        let (w_xy, w_yx): (Wire, Wire) = Default::default();
        let x = Side {
            tx: StreamProducer::attach(xy.clone()).unwrap(),
            rx: StreamConsumer::attach(yx.clone()).unwrap(),
            me: cell(0),
            peer: cell(1),
            out: w_xy.clone(),
            inq: w_yx.clone(),
            sent: 0,
            read: 0,
        };
        let y = Side {
            tx: StreamProducer::attach(yx).unwrap(),
            rx: StreamConsumer::attach(xy).unwrap(),
            me: cell(1),
            peer: cell(0),
            out: w_yx,
            inq: w_xy,
            sent: 0,
            read: 0,
        };
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
