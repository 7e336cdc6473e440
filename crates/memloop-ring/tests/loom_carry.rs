#![cfg(loom)]
//! Loom models of a side that leaves its rings with a *tail*: the peer's last TCP bytes of a
//! promotion, still unread in its socket in front of the doorbells the peer rang after its
//! stop (`memloop_ring::leave`, "Carrying a tail"; the design is
//! `docs/design/path-switching.md`). Such a side announces `CARRYING`, waits for the peer's
//! `Left`, then either carries the tail into its rx ring in front of its head and publishes
//! its `Left` with the head moved back (the peer's ordinary re-send delivers tail + ring
//! bytes), or — no room, or the peer carries too — reads the tail first, as the program
//! would, then leaves like any side. Both sides leave concurrently; each must receive
//! the peer's bytes exactly once, in order, and no doorbell as data.
//!
//! - `a_side_with_a_tail_carries_it_while_both_leave`: one carrier, room in the ring;
//! - `a_tail_that_may_not_fit_is_carried_or_read_first`: the peer's ring nearly full, and a
//!   write of the peer's program racing its leave decides whether the tail still fits;
//! - `two_carriers_never_wait_for_each_other`: both sides with a tail, both announcing;
//! - controls: leaving with a tail as a ring side does loses it (the discard takes data), and
//!   carrying before the peer's `Left` lets the peer's writes run into the carried bytes.
//!
//! Run: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!      cargo test -p memloop-ring --release --test loom_carry
use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};
use loom::sync::{Arc, Mutex};
use loom::thread;
use memloop_ring::leave::{
    begin_carry, doorbells_to_discard, CarryStep, LeaveCell, Left, LEAVE_CELL_BYTES,
};
use memloop_ring::{init_ring, ring_bytes, RingKind, StreamConsumer, StreamProducer};
use memloop_shm::ShmSlice;
use std::collections::VecDeque;

/// A doorbell byte: on the wire it looks like data; only the counts tell them apart. (No
/// data byte in these models has this value.)
const DB: u8 = 0xdb;

type Wire = Arc<Mutex<VecDeque<u8>>>;

/// Takes exactly `n` bytes off `w`, waiting for them.
fn pop(w: &Wire, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        {
            let mut q = w.lock().unwrap();
            while out.len() < n {
                match q.pop_front() {
                    Some(b) => out.push(b),
                    None => break,
                }
            }
        }
        if out.len() < n {
            thread::yield_now();
        }
    }
    out
}

/// How a side with a tail leaves.
#[derive(Clone, Copy, PartialEq)]
enum Carry {
    /// As designed: announce, wait for the peer's `Left`, carry if it fits, else read first.
    Designed,
    /// Control: leave as a ring side does (the tail stays in the socket).
    Never,
    /// Control: carry at once, against the ring's tail of the moment, without waiting.
    Early,
}

struct Side {
    name: &'static str,
    /// Our tx ring's producer (shared with a thread playing the program's writes, if any).
    tx: Arc<Mutex<StreamProducer>>,
    rx: StreamConsumer,
    me: LeaveCell,
    peer: LeaveCell,
    out: Wire,
    inq: Wire,
    sent: u64,
    read: u64,
    /// The peer's TCP bytes still in our socket ahead of its doorbells (our tail).
    tail: usize,
    /// What the program received.
    got: Vec<u8>,
}

impl Side {
    fn doorbell(&mut self) {
        self.out.lock().unwrap().push_back(DB);
        self.sent += 1;
    }

    /// A side on its ring reads the doorbells queued on its socket (all of it is doorbells
    /// while the peer has not taken over) and some of its rx ring.
    fn drain_and_read(&mut self) {
        let drained: Vec<u8> = self.inq.lock().unwrap().drain(..).collect();
        assert!(
            drained.iter().all(|&b| b == DB),
            "{}: data drained as doorbells",
            self.name
        );
        self.read += drained.len() as u64;
        let mut b = [0u8; 8];
        let n = self.rx.read(&mut b).unwrap();
        self.got.extend_from_slice(&b[..n]);
    }

    /// Leaves as a side on its ring does: a last doorbell, then `Left` where it stopped.
    fn leave(&mut self) {
        let tx = self.tx.clone();
        let tx = tx.lock().unwrap();
        self.doorbell();
        assert!(self.me.publish(Left {
            tail: tx.position(),
            head: self.rx.position(),
            doorbells: self.sent,
        }));
    }

    fn await_peer(&self) -> Left {
        loop {
            if let Some(l) = self.peer.read().unwrap() {
                return l;
            }
            thread::yield_now();
        }
    }

    /// The program reads the rest of the tail from the socket (the bounded wait of a side
    /// that cannot carry), then the side is on its ring and leaves as any side does.
    fn read_tail_then_leave(&mut self) -> Left {
        let t = pop(&self.inq, self.tail);
        self.got.extend(t);
        self.tail = 0;
        self.leave();
        self.await_peer()
    }

    /// A demote while this side has a tail.
    fn leave_with_tail(&mut self, how: Carry) -> Left {
        self.doorbell(); // the request wakes a peer asleep on its socket (counted)
        match how {
            Carry::Never => {
                self.leave();
                return self.await_peer();
            }
            Carry::Early => {
                let live = self.rx.position() + self.rx.available().unwrap();
                if self
                    .rx
                    .carry_room(live)
                    .is_ok_and(|r| r >= self.tail as u64)
                {
                    let t = pop(&self.inq, self.tail);
                    let head = self.rx.carry(&t, live).unwrap();
                    self.tail = 0;
                    let tx = self.tx.lock().unwrap().position();
                    assert!(self.me.publish(Left {
                        tail: tx,
                        head,
                        doorbells: self.sent,
                    }));
                    return self.await_peer();
                }
                return self.read_tail_then_leave();
            }
            Carry::Designed => {}
        }
        loop {
            match begin_carry(&self.me, &self.peer).unwrap() {
                CarryStep::Carry(peer) => {
                    let room = self.rx.carry_room(peer.tail).unwrap();
                    if self.tail as u64 > room {
                        // (The record stays "carrying", as in the preload: the peer has left
                        // and waits for our `Left` whatever it says.)
                        return self.read_tail_then_leave();
                    }
                    let t = pop(&self.inq, self.tail);
                    assert!(
                        t.iter().all(|&b| b != DB),
                        "{}: a doorbell in the tail",
                        self.name
                    );
                    let head = self.rx.carry(&t, peer.tail).unwrap();
                    self.tail = 0;
                    let tx = self.tx.lock().unwrap().position();
                    assert!(self.me.publish(Left {
                        tail: tx,
                        head,
                        doorbells: self.sent,
                    }));
                    return peer;
                }
                CarryStep::Wait => thread::yield_now(),
                CarryStep::Withdrawn => return self.read_tail_then_leave(),
            }
        }
    }

    /// Both have left: the peer's unread doorbells go, then what the peer never consumed is
    /// re-sent, then `post` (new writes, on TCP).
    fn take_over(&mut self, peer: Left, post: &[u8]) {
        let n = doorbells_to_discard(&peer, self.read).unwrap() as usize;
        let skipped = pop(&self.inq, n);
        assert!(
            skipped.iter().all(|&b| b == DB),
            "{}: data discarded as doorbells: {skipped:?}",
            self.name
        );
        let mut resend = Vec::new();
        self.tx
            .lock()
            .unwrap()
            .unconsumed(peer.head, &mut resend)
            .unwrap_or_else(|e| panic!("{}: cannot re-send from the peer's head: {e}", self.name));
        let mut w = self.out.lock().unwrap();
        w.extend(resend);
        w.extend(post.iter().copied());
    }

    fn receive(mut self, total: usize) -> Vec<u8> {
        let rest = pop(&self.inq, total - self.got.len());
        self.got.extend(rest);
        self.got
    }
}

fn ring() -> ShmSlice {
    let v = ShmSlice::new_model(ring_bytes(64) as usize);
    init_ring(&v, RingKind::Stream, 64, 0).unwrap();
    v
}

/// Two sides over two rings and two wires. `x_tail` / `y_tail`: each side's TCP bytes still
/// in the other's socket, followed there by the sender's stop doorbell (counted); `y_ring`:
/// what Y wrote to its ring before the model starts (X, coming back from TCP, has not read
/// any of it).
fn sides(x_tail: &[u8], y_tail: &[u8], y_ring: &[u8]) -> (Side, Side) {
    let (xy, yx) = (ring(), ring());
    let cells = ShmSlice::new_model(2 * LEAVE_CELL_BYTES as usize);
    let cell = |i: u64| LeaveCell::new(&cells, i * LEAVE_CELL_BYTES).unwrap();
    let wire = |tail: &[u8]| -> Wire {
        let mut q: VecDeque<u8> = tail.iter().copied().collect();
        q.push_back(DB);
        Arc::new(Mutex::new(q))
    };
    let (w_xy, w_yx) = (wire(x_tail), wire(y_tail));
    let mut ytx = StreamProducer::attach(yx.clone()).unwrap();
    assert_eq!(ytx.write(y_ring).unwrap(), y_ring.len());
    let x = Side {
        name: "x",
        tx: Arc::new(Mutex::new(StreamProducer::attach(xy.clone()).unwrap())),
        rx: StreamConsumer::attach(yx).unwrap(),
        me: cell(0),
        peer: cell(1),
        out: w_xy.clone(),
        inq: w_yx.clone(),
        sent: 1,
        read: 0,
        tail: y_tail.len(),
        got: Vec::new(),
    };
    let y = Side {
        name: "y",
        tx: Arc::new(Mutex::new(ytx)),
        rx: StreamConsumer::attach(xy).unwrap(),
        me: cell(1),
        peer: cell(0),
        out: w_yx,
        inq: w_xy,
        sent: 1,
        read: 0,
        tail: x_tail.len(),
        got: Vec::new(),
    };
    (x, y)
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// X comes back from TCP with Y's last two TCP bytes unread (it read the one before them);
/// Y finished the promotion and is on its ring. A demote: X carries, Y leaves whenever it
/// notices, both write on their rings meanwhile.
fn one_carrier(how: Carry) {
    loom::model(move || {
        let (mut x, mut y) = sides(&[], &[0x4f, 0x50, 0x51], &[]);
        let ty = thread::spawn(move || {
            assert_eq!(y.tx.lock().unwrap().write(&[9]).unwrap(), 1);
            y.drain_and_read();
            y.leave();
            let peer = y.await_peer();
            y.take_over(peer, &[8, 7]);
            y.receive(2)
        });
        x.got = pop(&x.inq, 1); // what the program read of the tail before the demote
        x.tail = 2;
        assert_eq!(x.tx.lock().unwrap().write(&[1]).unwrap(), 1);
        let peer = x.leave_with_tail(how);
        x.take_over(peer, &[3]);
        let got_x = x.receive(6);
        let got_y = ty.join().unwrap();
        assert_eq!(got_x, [0x4f, 0x50, 0x51, 9, 8, 7], "x received");
        assert_eq!(got_y, [1, 3], "y received");
    });
}

#[test]
fn a_side_with_a_tail_carries_it_while_both_leave() {
    one_carrier(Carry::Designed);
}

/// Leaving with a tail as a side on its ring does: the discard takes the tail for doorbells.
#[test]
#[should_panic(expected = "data discarded as doorbells")]
fn without_the_carry_the_tail_is_lost() {
    one_carrier(Carry::Never);
}

/// Y's ring holds 59 bytes X never read (capacity 64) and X's tail is 2 bytes: it fits,
/// unless Y's program writes 4 more on the ring before Y leaves (a thread of its own racing
/// Y's leave for the ring end). Whichever happens, X receives tail, ring bytes, the 4 bytes
/// (on the ring or, written after the leave, over TCP) and Y's last byte, in order.
fn full_ring(how: Carry) {
    loom::model(move || {
        let pre: Vec<u8> = (0x10..0x10 + 59).collect();
        let extra = [0x60, 0x61, 0x62, 0x63];
        let tail = [0x50, 0x51];
        let (mut x, mut y) = sides(&[], &tail, &pre);
        let on_ring = Arc::new(AtomicBool::new(false));
        let writer = {
            let (tx, me, on_ring) = (y.tx.clone(), y.me.clone(), on_ring.clone());
            thread::spawn(move || {
                let mut tx = tx.lock().unwrap();
                if me.read().unwrap().is_none() {
                    assert_eq!(tx.write(&extra).unwrap(), extra.len());
                    on_ring.store(true, SeqCst);
                }
            })
        };
        let ty = thread::spawn(move || {
            y.leave();
            let peer = y.await_peer();
            writer.join().unwrap();
            // Written after the leave: the program's write goes to TCP, after the re-send.
            let late: &[u8] = if on_ring.load(SeqCst) { &[] } else { &extra };
            y.take_over(peer, &cat(&[late, &[8]]));
            y.receive(1)
        });
        let peer = x.leave_with_tail(how);
        x.take_over(peer, &[3]);
        let got_x = x.receive(2 + 59 + 4 + 1);
        assert_eq!(got_x, cat(&[&tail, &pre, &extra, &[8]]), "x received");
        assert_eq!(ty.join().unwrap(), [3], "y received");
    });
}

#[test]
fn a_tail_that_may_not_fit_is_carried_or_read_first() {
    full_ring(Carry::Designed);
}

/// Carrying before the peer has left: the peer's program may still write into the space the
/// tail went to, and the re-send from the moved head no longer fits a ring.
#[test]
#[should_panic(expected = "cannot re-send from the peer's head")]
fn carrying_before_the_peer_left_runs_into_its_writes() {
    full_ring(Carry::Early);
}

/// Both sides come back from TCP with a tail (the preload's switch word rules this out: a
/// demote is asked only once one side finished the promotion; the protocol does not rely on
/// it). Both announce; at least one withdraws and reads its tail first; nobody waits for
/// good, every byte arrives once, in order.
#[test]
fn two_carriers_never_wait_for_each_other() {
    loom::model(|| {
        let (mut x, mut y) = sides(&[0x30], &[0x50, 0x51], &[]);
        let ty = thread::spawn(move || {
            assert_eq!(y.tx.lock().unwrap().write(&[9]).unwrap(), 1);
            let peer = y.leave_with_tail(Carry::Designed);
            y.take_over(peer, &[8]);
            y.receive(3)
        });
        assert_eq!(x.tx.lock().unwrap().write(&[1]).unwrap(), 1);
        let peer = x.leave_with_tail(Carry::Designed);
        x.take_over(peer, &[3]);
        let got_x = x.receive(4);
        let got_y = ty.join().unwrap();
        assert_eq!(got_x, [0x50, 0x51, 9, 8], "x received");
        assert_eq!(got_y, [0x30, 1, 3], "y received");
    });
}
