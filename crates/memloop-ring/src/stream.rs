//! Byte-stream ring: what a TCP connection becomes between co-resident peers.
//!
//! Bytes are copied in at `tail`, out at `head`, wrapping freely at the ring end. A write
//! publishes once however many slices it copied (batching); the consumer's reads likewise.
//! `shutdown` is the FIN (EOF after draining), `close` by the reader is the RST/EPIPE.

use crate::header::{Mapping, RingKind};
use crate::index::{copy_in, copy_out, grown_mapping, ConsCore, ProdCore};
use crate::wait::{WaitCell, WaitPolicy};
use crate::RingError;
use memloop_shm::ShmSlice;
use std::io::{IoSlice, IoSliceMut};
use std::time::Duration;

/// Writing end of a byte-stream ring.
#[derive(Debug)]
pub struct StreamProducer {
    core: ProdCore,
    written: u64,
    elastic: Elastic,
}

/// When the producer grows or shrinks its window (see [`crate::header`]'s module text).
#[derive(Debug, Default)]
struct Elastic {
    /// A grow found no memory to reserve: no more tries until the window shrinks.
    no_room: bool,
    /// `written` when the producer was last looked at while idle, and how many looks in a
    /// row found it unchanged.
    idle_mark: u64,
    idle_looks: u32,
    grown: u64,
    shrunk: u64,
    /// Grows refused for want of memory to reserve.
    refused: u64,
}

/// Each grow multiplies the window by this much (up to the capacity).
const GROW_FACTOR: u64 = 4;

impl StreamProducer {
    /// Attaches to an initialised stream ring; validates the header against `view`.
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        Ok(StreamProducer {
            core: ProdCore::attach(&view, RingKind::Stream, 1)?,
            written: 0,
            elastic: Elastic::default(),
        })
    }

    /// The window in force: what the ring holds at most right now.
    pub fn capacity(&self) -> u64 {
        self.core.cap()
    }

    /// The most the window can grow to (the data area reserved for the ring).
    pub fn max_capacity(&self) -> u64 {
        self.core.cap_max()
    }

    /// How many times the window grew, shrank, and could not grow for want of memory.
    pub fn resizes(&self) -> (u64, u64, u64) {
        let e = &self.elastic;
        (e.grown, e.shrunk, e.refused)
    }

    /// Grows the window (×4, up to the capacity) for a write that does not fit, as TCP
    /// buffers what the peer has not read yet; false if it is as large as it gets, or no
    /// memory could be reserved for it (then no grow is tried again until it shrinks).
    fn try_grow(&mut self) -> Result<bool, RingError> {
        let (w, max) = (self.core.cap(), self.core.cap_max());
        if self.elastic.no_room || w >= max {
            return Ok(false);
        }
        let grown = self.resize((w * GROW_FACTOR).min(max))?;
        self.elastic.grown += grown as u64;
        Ok(grown)
    }

    /// Puts window `to` (a power of two, 64 ≤ `to` ≤ [`max_capacity`](Self::max_capacity))
    /// in force: a larger one at any time (memory for it reserved first), a smaller one only
    /// while the ring is empty (false otherwise; memory beyond it goes back to the system).
    /// False too if memory for a larger window cannot be reserved (then no grow is tried again
    /// until it shrinks). The header's module text says why no reader loses a byte.
    pub fn resize(&mut self, to: u64) -> Result<bool, RingError> {
        let w = self.core.cap();
        if !to.is_power_of_two()
            || !(crate::header::MIN_CAPACITY..=self.core.cap_max()).contains(&to)
        {
            return Err(RingError::Config(format!(
                "window {to} for a ring of capacity {}",
                self.core.cap_max()
            )));
        }
        let used = self.core.used()?;
        if to == w || (to < w && used > 0) {
            return Ok(false);
        }
        if to > w && self.core.h.data.commit(w, to - w).is_err() {
            self.elastic.no_room = true;
            self.elastic.refused += 1;
            return Ok(false);
        }
        if used > 0 {
            self.grow_holding(to, used)?;
            return Ok(true);
        }
        // Empty: the tail goes to the new window's offset 0.
        let base = self.core.tail;
        self.core.set_mapping(Mapping { window: to, base }, None);
        if to < w {
            // Nobody reads or writes beyond the window any more (the ring is empty, and the
            // consumer takes the new mapping with the next tail).
            let _ = self.core.h.data.release(to, w - to);
            self.elastic.no_room = false;
        }
        Ok(true)
    }

    /// Grows the window to `to` over `used` unconsumed bytes, each staying where a reader
    /// with either mapping finds it: the head keeps its offset; a part wrapped around the old
    /// window's end is copied to just past it, and nothing is written over the original
    /// until the head has passed it (the hazard).
    fn grow_holding(&mut self, to: u64, used: u64) -> Result<(), RingError> {
        let (m, head) = (self.core.map, self.core.head());
        let (grown, copied) = grown_mapping(&self.core.h.data, m, head, used, to)?;
        let hazard = copied.then_some(self.core.tail);
        self.core.set_mapping(grown, hazard);
        Ok(())
    }

    /// One look from an idle-time sweep: once `looks` looks in a row found nothing written
    /// and the ring empty, the window goes back to `to` and the memory beyond it is given
    /// back to the system. Returns whether it shrank.
    pub fn shrink_if_idle(&mut self, to: u64, looks: u32) -> Result<bool, RingError> {
        let e = &mut self.elastic;
        if self.written != e.idle_mark {
            (e.idle_mark, e.idle_looks) = (self.written, 0);
            return Ok(false);
        }
        e.idle_looks = e.idle_looks.saturating_add(1);
        let w = self.core.cap();
        let to = to.clamp(crate::header::MIN_CAPACITY, w).next_power_of_two();
        if e.idle_looks < looks || w <= to || !self.resize(to)? {
            return Ok(false);
        }
        self.elastic.idle_looks = 0;
        self.elastic.shrunk += 1;
        Ok(true)
    }

    /// Free bytes right now (always re-reads the consumer's index).
    pub fn free_space(&mut self) -> Result<u64, RingError> {
        self.core.refresh()
    }

    /// Copies as much of `src` as fits and publishes it. `Ok(0)` if the ring is full (or `src`
    /// empty), `Err(Closed)` if the reader closed.
    pub fn write(&mut self, src: &[u8]) -> Result<usize, RingError> {
        self.write_vectored(&[IoSlice::new(src)])
    }

    /// Like [`write`](Self::write) for several slices, with a single publication.
    pub fn write_vectored(&mut self, srcs: &[IoSlice<'_>]) -> Result<usize, RingError> {
        self.core.check_open()?;
        let want: u64 = srcs.iter().map(|s| s.len() as u64).sum();
        let mut room = self.core.free_for(want)?.min(want);
        while room < want && self.try_grow()? {
            room = self.core.free_for(want)?.min(want);
        }
        let mut idx = self.core.tail;
        for s in srcs {
            let n = (s.len() as u64).min(room);
            let at = self.core.map.at(idx);
            copy_in(&self.core.h.data, self.core.cap(), at, &s[..n as usize])?;
            idx = idx.wrapping_add(n);
            room -= n;
        }
        let n = idx.wrapping_sub(self.core.tail);
        if n > 0 {
            self.core.publish(n);
            self.written += n;
        }
        Ok(n as usize)
    }

    /// Writer side done: the consumer reads EOF once it has drained the ring.
    pub fn shutdown(&mut self) {
        self.core.shutdown();
    }

    /// Writer aborts: the consumer reads what was published, then sees the reset
    /// ([`crate::header::Probe::writer_reset`]).
    pub fn reset(&mut self) {
        self.core.reset();
    }

    /// Whether the reader closed (garbage in its flag word counts as closed).
    pub fn reader_closed(&self) -> bool {
        self.core.reader_closed()
    }

    pub fn total_written(&self) -> u64 {
        self.written
    }

    /// The ring index after the last byte this end published (its tail).
    pub fn position(&self) -> u64 {
        self.core.tail
    }

    /// The mapping as the ring holds it now (a consumer carrying after we left may widen it).
    pub(crate) fn mapping_now(&self) -> Result<Mapping, RingError> {
        self.core.h.load_mapping()
    }

    /// Copies published bytes starting at ring index `from` into `dst` (the caller checked
    /// that they are still in the ring), with the mapping as the ring holds it now.
    pub(crate) fn copy_published(&self, from: u64, dst: &mut [u8]) -> Result<(), RingError> {
        let m = self.mapping_now()?;
        copy_out(&self.core.h.data, m.window, m.at(from), dst)
    }

    /// Announces that this writer is about to sleep outside the ring (poll/epoll) until the
    /// reader frees space; the reader's next release then reports a doorbell request
    /// ([`StreamConsumer::take_doorbell`]). Re-check the free space after arming.
    pub fn arm_doorbell(&self) {
        self.core.h.prod.arm_doorbell();
    }

    pub fn disarm(&self) {
        self.core.h.prod.disarm();
    }

    /// See [`crate::wait`]: re-arms; true if a doorbell was rung since the last arm.
    pub fn rearm_doorbell(&self) -> bool {
        self.core.h.prod.rearm_doorbell()
    }

    /// Disarms; true if a doorbell was rung since the last arm.
    pub fn disarm_doorbell(&self) -> bool {
        self.core.h.prod.disarm_doorbell()
    }

    /// This end's waiting flag and futex word (a writer waiting for room sleeps on it).
    pub fn wait_cell(&self) -> &WaitCell {
        &self.core.h.prod
    }

    /// What the publications since the last call found the reader asleep behind (a
    /// doorbell and/or a wake target: [`crate::wait::WaitCell::notify`]), 0 for nothing.
    pub fn take_wake(&mut self) -> u32 {
        self.core.take_wake()
    }

    /// Wakes a reader asleep on this ring as a publication would (a reader that re-checks
    /// after arming sees what the caller published before this call); true if it sleeps
    /// behind a doorbell or a wake target, which the caller must then ring (non-zero).
    pub fn wake_reader(&self) -> u32 {
        self.core.h.cons.notify()
    }

    /// Reloads the indices from shared memory (another process shares this end).
    pub fn resync(&mut self) -> Result<(), RingError> {
        self.core.resync()
    }

    /// Waits until at least `min` bytes (clamped to the capacity) are free or the reader closed.
    pub fn wait_writable(
        &mut self,
        min: u64,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        let min = min.clamp(1, self.capacity());
        self.core.wait_writable(min, policy, timeout)
    }
}

/// Reading end of a byte-stream ring.
#[derive(Debug)]
pub struct StreamConsumer {
    core: ConsCore,
    read: u64,
}

impl StreamConsumer {
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        Ok(StreamConsumer {
            core: ConsCore::attach(&view, RingKind::Stream, 1)?,
            read: 0,
        })
    }

    /// The window the bytes in the ring were written under.
    pub fn capacity(&self) -> u64 {
        self.core.cap()
    }

    /// The whole data area (the most the producer's window can grow to).
    pub fn max_capacity(&self) -> u64 {
        self.core.h.cap
    }

    /// Bytes readable right now (always re-reads the producer's index).
    pub fn available(&mut self) -> Result<u64, RingError> {
        self.core.refresh()
    }

    /// Copies up to `dst.len()` bytes out and consumes them. `Ok(0)` when nothing is available
    /// (see [`is_eof`](Self::is_eof)).
    pub fn read(&mut self, dst: &mut [u8]) -> Result<usize, RingError> {
        self.read_vectored(&mut [IoSliceMut::new(dst)])
    }

    /// Like [`read`](Self::read) into several buffers, releasing the space once.
    pub fn read_vectored(&mut self, dsts: &mut [IoSliceMut<'_>]) -> Result<usize, RingError> {
        let n = self.copy_out(dsts)?;
        if n > 0 {
            self.core.consume(n);
            self.read += n;
        }
        Ok(n as usize)
    }

    /// Consumes everything published so far without copying it out (bytes known to be
    /// stale); returns how many.
    pub fn skip_all(&mut self) -> Result<u64, RingError> {
        let n = self.core.refresh()?;
        if n > 0 {
            self.core.consume(n);
            self.read += n;
        }
        Ok(n)
    }

    /// Like [`read`](Self::read) but leaves the bytes in the ring (`MSG_PEEK`).
    pub fn peek(&mut self, dst: &mut [u8]) -> Result<usize, RingError> {
        Ok(self.copy_out(&mut [IoSliceMut::new(dst)])? as usize)
    }

    fn copy_out(&mut self, dsts: &mut [IoSliceMut<'_>]) -> Result<u64, RingError> {
        let want: u64 = dsts.iter().map(|d| d.len() as u64).sum();
        let mut left = self.core.avail_for(want)?.min(want);
        let mut idx = self.core.head;
        for d in dsts.iter_mut() {
            let n = (d.len() as u64).min(left);
            let at = self.core.map.at(idx);
            copy_out(&self.core.h.data, self.core.cap(), at, &mut d[..n as usize])?;
            idx = idx.wrapping_add(n);
            left -= n;
        }
        Ok(idx.wrapping_sub(self.core.head))
    }

    /// True when the writer shut down and every byte has been consumed.
    pub fn is_eof(&mut self) -> Result<bool, RingError> {
        self.core.is_eof()
    }

    /// Reader gone: the producer's next write fails with [`RingError::Closed`].
    pub fn close(&mut self) {
        self.core.close();
    }

    pub fn total_read(&self) -> u64 {
        self.read
    }

    /// The ring index after the last byte this end consumed (its head).
    pub fn position(&self) -> u64 {
        self.core.head
    }

    /// The producer's tail as the ring holds it now (unvalidated: the caller compares it).
    pub(crate) fn published_tail(&self) -> u64 {
        self.core.h.tail.load(memloop_shm::sync::Ordering::Acquire)
    }

    /// Copies `src` into the data area at ring index `at` (the caller checked that the
    /// producer can no longer write there).
    pub(crate) fn write_at(&self, at: u64, src: &[u8]) -> Result<(), RingError> {
        let m = self.mapping_now()?;
        copy_in(&self.core.h.data, m.window, m.at(at), src)
    }

    /// Widens mapping `m` (the producer has left) to window `to` over `used` unconsumed bytes
    /// from our head: as the producer's grow does (header module text), without a hazard —
    /// we are the only reader, and we read with the new mapping from now on.
    pub(crate) fn widen(&mut self, m: Mapping, to: u64, used: u64) -> Result<bool, RingError> {
        let w = m.window;
        if self.core.h.data.commit(w, to - w).is_err() {
            return Ok(false);
        }
        let (new, _) = grown_mapping(&self.core.h.data, m, self.core.head, used, to)?;
        self.core
            .h
            .mapping
            .store(new.word(), memloop_shm::sync::Ordering::Release);
        self.core.map = new;
        Ok(true)
    }

    /// The producer's mapping as the ring holds it now (once the producer left, the one
    /// it left with).
    pub(crate) fn mapping_now(&self) -> Result<Mapping, RingError> {
        self.core.h.load_mapping()
    }

    /// Whether the writer shut down (data may still be waiting to be read).
    pub fn writer_shut(&self) -> Result<bool, RingError> {
        self.core.writer_shut()
    }

    /// See [`StreamProducer::arm_doorbell`]: the reader is about to sleep until data arrives.
    pub fn arm_doorbell(&self) {
        self.core.h.cons.arm_doorbell();
    }

    pub fn disarm(&self) {
        self.core.h.cons.disarm();
    }

    /// See [`StreamProducer::rearm_doorbell`].
    pub fn rearm_doorbell(&self) -> bool {
        self.core.h.cons.rearm_doorbell()
    }

    /// See [`StreamProducer::disarm_doorbell`].
    pub fn disarm_doorbell(&self) -> bool {
        self.core.h.cons.disarm_doorbell()
    }

    /// This end's waiting flag and futex word (a reader waiting for data sleeps on it).
    pub fn wait_cell(&self) -> &WaitCell {
        &self.core.h.cons
    }

    /// What the releases since the last call found the writer asleep behind, 0 for nothing.
    pub fn take_wake(&mut self) -> u32 {
        self.core.take_wake()
    }

    /// Wakes a writer asleep on this ring (waiting for room) as a release would; true if it
    /// sleeps behind a doorbell or a wake target, which the caller must then ring.
    pub fn wake_writer(&self) -> u32 {
        self.core.h.prod.notify()
    }

    /// Reloads the indices from shared memory (another process shares this end).
    pub fn resync(&mut self) -> Result<(), RingError> {
        self.core.resync()
    }

    /// Waits until data is available or EOF.
    pub fn wait_readable(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        self.core.wait_readable(1, policy, timeout)
    }
}
