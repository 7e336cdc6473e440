//! What the loom models of a leave share: two sides of a connection, each with its two real
//! stream rings' ends, its leave record and the peer's, and a model byte queue per TCP
//! direction on which doorbells and data look alike.
use loom::sync::{Arc, Mutex};
use loom::thread;
use memloop_ring::leave::{LeaveCell, Left, LEAVE_CELL_BYTES};
use memloop_ring::{init_ring, ring_bytes, RingKind, StreamConsumer, StreamProducer};
use memloop_shm::ShmSlice;
use std::collections::VecDeque;

/// A doorbell byte: on the wire it is indistinguishable from data; only the counts tell.
pub const DB: u8 = 0xdb;

pub type Wire = Arc<Mutex<VecDeque<u8>>>;

pub struct Side {
    pub tx: StreamProducer,
    pub rx: StreamConsumer,
    pub me: LeaveCell,
    pub peer: LeaveCell,
    pub out: Wire,
    pub inq: Wire,
    /// Doorbells sent, and read (drained) from `inq`.
    pub sent: u64,
    pub read: u64,
}

impl Side {
    pub fn doorbell(&mut self) {
        self.out.lock().unwrap().push_back(DB);
        self.sent += 1;
    }

    /// Pops `n` bytes from the wire, waiting for them.
    pub fn pop(&self, n: usize) -> Vec<u8> {
        let mut into = Vec::new();
        while into.len() < n {
            let b = self.inq.lock().unwrap().pop_front();
            match b {
                Some(b) => into.push(b),
                None => thread::yield_now(),
            }
        }
        into
    }

    /// The peer's `Left`, waiting for it.
    pub fn await_peer(&self) -> Left {
        loop {
            if let Some(p) = self.peer.read().unwrap() {
                return p;
            }
            thread::yield_now();
        }
    }
}

/// A ring of 64 bytes in model memory.
pub fn ring() -> ShmSlice {
    let v = ShmSlice::new_model(ring_bytes(64) as usize);
    init_ring(&v, RingKind::Stream, 64, 0).unwrap();
    v
}

/// The two sides of one connection: x's tx ring is y's rx ring and the other way round.
pub fn pair() -> (Side, Side) {
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
    (x, y)
}
