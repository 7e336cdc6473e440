//! Leaving a pair of stream rings mid-stream, so the connection goes on over its kernel socket
//! (live path switching; the design is `docs/design/path-switching.md`).
//!
//! The kernel socket of a ring connection has carried doorbell bytes in both directions, and a
//! side's doorbells serve both of its ring ends, so a side leaves *both* rings at once:
//! 1. it stops publishing to its tx ring at `tail`, stops consuming its rx ring at `head`, stops
//!    reading doorbells, and publishes [`Left`] `{tail, head, doorbells sent}`;
//! 2. once the peer has left too, it discards the peer's doorbells it has not read
//!    ([`doorbells_to_discard`]), re-sends the bytes of its tx ring the peer never consumed
//!    ([`StreamProducer::unconsumed`] from the peer's `head`), and from then on both directions
//!    are plain TCP.
//!
//! Nothing goes on the socket as data before both sides have left: until then the peer may
//! still drain the socket, taking anything there for doorbells. Pure: the caller does the I/O.

use crate::stream::StreamProducer;
use crate::RingError;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, SeqCst};
use memloop_shm::{ShmSlice, ShmU64};

/// Where a side stopped: the end of what it published, the end of what it consumed, and how
/// many doorbell bytes it ever sent on the kernel socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Left {
    pub tail: u64,
    pub head: u64,
    pub doorbells: u64,
}

/// Bytes of shared memory a [`LeaveCell`] takes.
pub const LEAVE_CELL_BYTES: u64 = 32;

const ACTIVE: u64 = 0;
const LEFT: u64 = 1;

/// One side's leave record in shared memory: a state word, then the [`Left`] fields, written
/// before the state is set and read after it is seen.
pub struct LeaveCell {
    state: ShmU64,
    tail: ShmU64,
    head: ShmU64,
    doorbells: ShmU64,
}

impl LeaveCell {
    /// The cell at `off` in `view` (8-aligned, [`LEAVE_CELL_BYTES`] long).
    pub fn new(view: &ShmSlice, off: u64) -> Result<Self, RingError> {
        Ok(LeaveCell {
            state: view.u64_at(off)?,
            tail: view.u64_at(off + 8)?,
            head: view.u64_at(off + 16)?,
            doorbells: view.u64_at(off + 24)?,
        })
    }

    /// Publishes where this side stopped; false if it had already left (the first record
    /// stands).
    pub fn publish(&self, l: Left) -> bool {
        if self.state.load(SeqCst) != ACTIVE {
            return false;
        }
        self.tail.store(l.tail, Relaxed);
        self.head.store(l.head, Relaxed);
        self.doorbells.store(l.doorbells, Relaxed);
        self.state
            .compare_exchange(ACTIVE, LEFT, SeqCst, Relaxed)
            .is_ok()
    }

    /// Back to "active" for the next switch (the connection came back to its rings); false
    /// if the side had not left.
    pub fn reset(&self) -> bool {
        self.state
            .compare_exchange(LEFT, ACTIVE, SeqCst, Relaxed)
            .is_ok()
    }

    /// Where the side stopped, once it has left. Any state other than "active" or "left" was
    /// written by a buggy peer: [`RingError::Corrupt`].
    pub fn read(&self) -> Result<Option<Left>, RingError> {
        match self.state.load(Acquire) {
            ACTIVE => Ok(None),
            LEFT => Ok(Some(Left {
                tail: self.tail.load(Relaxed),
                head: self.head.load(Relaxed),
                doorbells: self.doorbells.load(Relaxed),
            })),
            s => Err(RingError::corrupt("leave state", s.to_string())),
        }
    }
}

/// Doorbell bytes still ahead of the peer's first data byte on the socket: what it sent in all
/// minus what we read. More read than sent means a doorbell count is wrong — the switch must
/// not guess.
pub fn doorbells_to_discard(peer: &Left, read: u64) -> Result<u64, RingError> {
    peer.doorbells.checked_sub(read).ok_or_else(|| {
        RingError::corrupt(
            "doorbell count",
            format!("read {read}, the peer says it sent {}", peer.doorbells),
        )
    })
}

impl StreamProducer {
    /// Copies the bytes published after index `from` (where the peer stopped consuming) into
    /// `out`. They are still in the ring: the consumer never released them. `from` comes
    /// from the peer and is checked: at most our tail, and no more than a ring behind it.
    pub fn unconsumed(&self, from: u64, out: &mut Vec<u8>) -> Result<(), RingError> {
        let tail = self.position();
        let n = tail.wrapping_sub(from);
        if n > self.capacity() {
            return Err(RingError::corrupt(
                "peer's stop position",
                format!("{from}, our tail is {tail}"),
            ));
        }
        let start = out.len();
        out.resize(start + n as usize, 0);
        self.copy_published(from, &mut out[start..])
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{init_ring, ring_bytes, RingKind, StreamConsumer};

    fn pair(cap: u64) -> (StreamProducer, StreamConsumer) {
        let v = ShmSlice::new_heap(ring_bytes(cap) as usize);
        init_ring(&v, RingKind::Stream, cap, 0).unwrap();
        (
            StreamProducer::attach(v.clone()).unwrap(),
            StreamConsumer::attach(v).unwrap(),
        )
    }

    #[test]
    fn a_cell_publishes_once_and_reads_back() {
        let v = ShmSlice::new_heap(64);
        let c = LeaveCell::new(&v, 0).unwrap();
        assert_eq!(c.read().unwrap(), None);
        let l = Left {
            tail: 10,
            head: 4,
            doorbells: 3,
        };
        assert!(c.publish(l));
        assert!(
            !c.publish(Left { tail: 99, ..l }),
            "the first record stands"
        );
        assert_eq!(c.read().unwrap(), Some(l));
        v.u64_at(0).unwrap().store(7, SeqCst);
        assert!(c.read().is_err(), "a garbage state is an error");
    }

    #[test]
    fn unconsumed_bytes_come_back_in_order_across_the_wrap() {
        let (mut p, mut c) = pair(64);
        let data: Vec<u8> = (0..60).collect();
        p.write(&data).unwrap();
        let mut b = [0u8; 50];
        assert_eq!(c.read(&mut b).unwrap(), 50);
        let more: Vec<u8> = (60..100).collect();
        assert_eq!(p.write(&more).unwrap(), 40); // wraps
        let mut out = Vec::new();
        p.unconsumed(c.position(), &mut out).unwrap();
        assert_eq!(out, (50..100).collect::<Vec<u8>>());
    }

    #[test]
    fn a_peer_position_out_of_range_is_corrupt() {
        let (mut p, _c) = pair(64);
        p.write(&[1; 10]).unwrap();
        let mut out = Vec::new();
        assert!(p.unconsumed(11, &mut out).is_err(), "ahead of our tail");
        p.write(&[1; 54]).unwrap();
        assert!(
            p.unconsumed(0, &mut out).is_ok(),
            "a whole ring behind is fine"
        );
        assert!(
            doorbells_to_discard(
                &Left {
                    tail: 0,
                    head: 0,
                    doorbells: 2
                },
                3
            )
            .is_err(),
            "more doorbells read than sent"
        );
    }
}
