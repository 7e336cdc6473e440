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
//!
//! **Carrying a tail.** A side coming back from TCP (a promotion) may still have the peer's
//! last TCP bytes — its *tail* — unread in its socket, in front of the doorbells the peer rang
//! since. Such a side cannot simply leave: its discard would eat the tail, and the peer's
//! re-send would come after it. It *carries* the tail instead:
//! 1. it announces [`CARRYING`](LeaveState::Carrying) ([`begin_carry`]) and goes on as it was
//!    (reads from the socket, writes to its ring) until the peer has left;
//! 2. with the peer's `Left` seen, the peer's tx ring — our rx ring — is frozen at the peer's
//!    final tail. If the tail fits in the ring's free space ([`StreamConsumer::carry_room`]),
//!    the side reads the tail out of its socket, writes it into the ring just before its head
//!    ([`StreamConsumer::carry`]) and publishes its `Left` with the head moved back by the
//!    tail's length: the peer's ordinary re-send from that head delivers tail, then ring bytes,
//!    in order, to whoever holds the socket next, and the discard in front of it is exact
//!    again (only doorbells are left before the re-send). If it does not fit, nothing is
//!    changed: the tail must reach the program from the socket first, and then the side leaves
//!    as any side does (its record may stay `CARRYING` until then: the peer has left, and waits
//!    for our `Left` whatever the record says).
//!
//! The carrier publishes its `Left` only after it saw the peer's: before that the peer may
//! still write into the space the tail goes to. A side that sees the peer `CARRYING` too
//! withdraws: the announcement and the look at the peer are sequentially consistent (a Dekker
//! pair), so of two carriers at least one sees the other, and never do both wait for each
//! other's `Left`. `CARRYING` promises nothing else, so withdrawing is always safe.
//! `tests/loom_carry.rs` checks all of this.

use crate::stream::{StreamConsumer, StreamProducer};
use crate::RingError;
use memloop_shm::sync::Ordering::{Relaxed, SeqCst};
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
const CARRYING: u64 = 2;

/// A side's leave record as read: still on its rings, announced to carry a tail (still on its
/// rings until the peer has left, see the module docs), or left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaveState {
    Active,
    Carrying,
    Left(Left),
}

/// One side's leave record in shared memory: a state word, then the [`Left`] fields, written
/// before the state is set and read after it is seen.
#[derive(Clone)]
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

    /// Publishes where this side stopped (from "active", or "carrying" once the peer has
    /// left); false if it had already left (the first record stands).
    pub fn publish(&self, l: Left) -> bool {
        let cur = self.state.load(SeqCst);
        if cur != ACTIVE && cur != CARRYING {
            return false;
        }
        self.tail.store(l.tail, Relaxed);
        self.head.store(l.head, Relaxed);
        self.doorbells.store(l.doorbells, Relaxed);
        self.state
            .compare_exchange(cur, LEFT, SeqCst, Relaxed)
            .is_ok()
    }

    /// Back to "active" for the next switch (the connection came back to its rings, or a
    /// carry was withdrawn); false if the side had not left or announced a carry.
    pub fn reset(&self) -> bool {
        [LEFT, CARRYING].into_iter().any(|from| {
            self.state
                .compare_exchange(from, ACTIVE, SeqCst, Relaxed)
                .is_ok()
        })
    }

    /// Announces a carry (see the module docs): true if the side is "carrying" now (also if it
    /// already was), false if it has left.
    pub fn announce_carry(&self) -> bool {
        match self
            .state
            .compare_exchange(ACTIVE, CARRYING, SeqCst, SeqCst)
        {
            Ok(_) => true,
            Err(cur) => cur == CARRYING,
        }
    }

    /// Withdraws a carry: "carrying" → "active"; false if the side was not carrying.
    pub fn withdraw_carry(&self) -> bool {
        self.state
            .compare_exchange(CARRYING, ACTIVE, SeqCst, Relaxed)
            .is_ok()
    }

    /// The record's state. Any state other than active, carrying or left was written by a
    /// buggy peer: [`RingError::Corrupt`].
    pub fn state(&self) -> Result<LeaveState, RingError> {
        match self.state.load(SeqCst) {
            ACTIVE => Ok(LeaveState::Active),
            CARRYING => Ok(LeaveState::Carrying),
            LEFT => Ok(LeaveState::Left(Left {
                tail: self.tail.load(Relaxed),
                head: self.head.load(Relaxed),
                doorbells: self.doorbells.load(Relaxed),
            })),
            s => Err(RingError::corrupt("leave state", s.to_string())),
        }
    }

    /// Where the side stopped, once it has left ("carrying" has not left yet). Garbage in the
    /// state word is [`RingError::Corrupt`].
    pub fn read(&self) -> Result<Option<Left>, RingError> {
        Ok(match self.state()? {
            LeaveState::Left(l) => Some(l),
            LeaveState::Active | LeaveState::Carrying => None,
        })
    }
}

/// What a side that would carry a tail does next ([`begin_carry`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CarryStep {
    /// The peer has left (here is where): carry now.
    Carry(Left),
    /// The peer is still on its rings: go on as before and look again later.
    Wait,
    /// The peer announced a carry too: ours is withdrawn (the tail must reach the program
    /// from the socket).
    Withdrawn,
}

/// Announces (or keeps up) a carry in `me`, then looks at `peer`. The announcement is made
/// before the look, both sequentially consistent: of two sides that both announce, at least
/// one sees the other's announcement and withdraws. `Err` for a corrupt peer record, or if
/// `me` has left already (a carry comes too late then).
pub fn begin_carry(me: &LeaveCell, peer: &LeaveCell) -> Result<CarryStep, RingError> {
    if !me.announce_carry() {
        return Err(RingError::corrupt(
            "leave state",
            "this side left already: no tail can be carried".to_string(),
        ));
    }
    match peer.state()? {
        LeaveState::Left(l) => Ok(CarryStep::Carry(l)),
        LeaveState::Active => Ok(CarryStep::Wait),
        LeaveState::Carrying => {
            me.withdraw_carry();
            Ok(CarryStep::Withdrawn)
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
        // (The window as the ring holds it now: a carrying consumer may have widened it.)
        if n > self.mapping_now()?.window {
            return Err(RingError::corrupt(
                "peer's stop position",
                format!("{from}, our tail is {tail}"),
            ));
        }
        let start = out.len();
        out.resize(start + n as usize, 0);
        // With the mapping as the ring holds it now: a consumer that carried our peer's
        // last TCP bytes may have widened it after we left.
        self.copy_published(from, &mut out[start..])
    }
}

impl StreamConsumer {
    /// How many bytes can be carried in front of our head once the producer has left at
    /// `peer_tail` (its `Left`): the ring's free space, which nobody writes any more. The
    /// producer's final tail is checked against the ring (it must be where the producer
    /// stopped publishing, no more than a ring ahead of our head).
    pub fn carry_room(&self, peer_tail: u64) -> Result<u64, RingError> {
        let head = self.position();
        let published = self.published_tail();
        let used = peer_tail.wrapping_sub(head);
        // The window the producer left under (ours may be older: it changes while empty).
        let window = self.mapping_now()?.window;
        if used > window || published != peer_tail {
            return Err(RingError::corrupt(
                "peer's leave position",
                format!("tail {peer_tail}, published {published}, our head is {head}"),
            ));
        }
        Ok(window - used)
    }

    /// Makes room for carrying `n` bytes once the producer has left at `peer_tail`: widens
    /// the window if needed (memory for it reserved first), which nobody else changes any
    /// more. False, with nothing changed, if the ring cannot hold `n` more bytes.
    pub fn make_carry_room(&mut self, n: u64, peer_tail: u64) -> Result<bool, RingError> {
        let room = self.carry_room(peer_tail)?;
        if n <= room {
            return Ok(true);
        }
        let m = self.mapping_now()?;
        let used = m.window - room;
        let Some(to) = (used + n).checked_next_power_of_two() else {
            return Ok(false);
        };
        if to > self.max_capacity() {
            return Ok(false);
        }
        self.widen(m, to, used)
    }

    /// Writes `tail` into the ring just before our head, once the producer has left at
    /// `peer_tail`, and returns the head to publish in our `Left` (ours minus the tail's
    /// length): the producer's re-send from there ([`StreamProducer::unconsumed`]) delivers
    /// `tail`, then what we never consumed, in order. Neither index in the ring moves; the
    /// bytes go to space the producer freed and, having left, never writes again. Fails
    /// with nothing written if the tail does not fit ([`StreamConsumer::carry_room`]).
    pub fn carry(&self, tail: &[u8], peer_tail: u64) -> Result<u64, RingError> {
        let room = self.carry_room(peer_tail)?;
        let n = tail.len() as u64;
        if n > room {
            return Err(RingError::NoRoom { len: n, room });
        }
        let from = self.position().wrapping_sub(n);
        self.write_at(from, tail)?;
        Ok(from)
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

    #[test]
    fn a_carried_tail_comes_back_in_front_of_the_unconsumed_bytes() {
        let (mut p, mut c) = pair(64);
        // 40 bytes consumed (stale space), then 20 published and not consumed.
        p.write(&[0xee; 40]).unwrap();
        let mut b = [0u8; 40];
        assert_eq!(c.read(&mut b).unwrap(), 40);
        let ring: Vec<u8> = (100..120).collect();
        p.write(&ring).unwrap();
        let tail_at = p.position();
        assert_eq!(c.carry_room(tail_at).unwrap(), 44);
        let tail: Vec<u8> = (1..=30).collect();
        let head = c.carry(&tail, tail_at).unwrap();
        assert_eq!(head, c.position() - 30, "the head moves back by the tail");
        let mut out = Vec::new();
        p.unconsumed(head, &mut out).unwrap();
        let want: Vec<u8> = tail.iter().chain(&ring).copied().collect();
        assert_eq!(out, want, "tail, then the ring's bytes, across the wrap");
        assert_eq!(c.position(), 40, "our index in the ring did not move");
    }

    #[test]
    fn a_tail_that_does_not_fit_is_refused_and_nothing_is_written() {
        let (mut p, mut c) = pair(64);
        p.write(&[7; 60]).unwrap();
        let t = p.position();
        assert_eq!(c.carry_room(t).unwrap(), 4);
        assert!(matches!(
            c.carry(&[1; 5], t),
            Err(RingError::NoRoom { len: 5, room: 4 })
        ));
        let mut out = Vec::new();
        p.unconsumed(c.position(), &mut out).unwrap();
        assert_eq!(out, vec![7; 60]);
        assert!(
            c.carry_room(t + 1).is_err(),
            "a tail the ring does not hold"
        );
        let mut b = [0u8; 10];
        c.read(&mut b).unwrap();
        assert!(c.carry_room(t).is_ok());
        assert!(
            c.carry_room(c.position() - 1).is_err(),
            "a tail behind our head"
        );
    }

    #[test]
    fn a_carrier_waits_for_the_peer_and_two_carriers_never_wait_for_each_other() {
        let v = ShmSlice::new_heap(64);
        let (x, y) = (
            LeaveCell::new(&v, 0).unwrap(),
            LeaveCell::new(&v, 32).unwrap(),
        );
        assert_eq!(begin_carry(&x, &y).unwrap(), CarryStep::Wait);
        assert_eq!(y.read().unwrap(), None);
        assert_eq!(x.state().unwrap(), LeaveState::Carrying);
        assert_eq!(x.read().unwrap(), None, "carrying has not left");
        assert_eq!(begin_carry(&y, &x).unwrap(), CarryStep::Withdrawn);
        assert_eq!(y.state().unwrap(), LeaveState::Active);
        let l = Left {
            tail: 5,
            head: 3,
            doorbells: 1,
        };
        assert!(y.publish(l));
        assert_eq!(begin_carry(&x, &y).unwrap(), CarryStep::Carry(l));
        assert!(x.publish(Left { head: 1, ..l }), "from carrying to left");
        assert!(begin_carry(&x, &y).is_err(), "too late once left");
        assert!(x.reset() && x.state().unwrap() == LeaveState::Active);
        assert!(
            x.announce_carry() && x.reset(),
            "a reset withdraws a carry too"
        );
    }
}
