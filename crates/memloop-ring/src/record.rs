//! Record ring: datagrams with an 8-byte header (`u32 len`, `u32 flags`, little endian).
//!
//! Records are padded to 8 bytes and never wrap: a record that would cross the ring end is
//! preceded by a padding record that runs exactly to the end (XenLoop style), so the consumer
//! can hand out each record as one contiguous piece. The largest record is `capacity/2 - 8`,
//! which guarantees that any record fits once the ring has drained, whatever the alignment.

use crate::header::RingKind;
use crate::index::{ConsCore, ProdCore};
use crate::wait::WaitPolicy;
use crate::RingError;
use memloop_shm::ShmSlice;
use std::time::Duration;

/// Size of the per-record header.
pub const RECORD_HEADER_BYTES: u64 = 8;
/// Record flag: padding up to the ring end, to be skipped.
pub const RECORD_FLAG_PAD: u32 = 1;

/// What [`RecordConsumer::recv`] delivered: the record's full length and how much of it fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvInfo {
    pub len: u64,
    pub copied: usize,
}

fn pad8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

fn max_record(cap: u64) -> u64 {
    (cap / 2 - RECORD_HEADER_BYTES).min(u32::MAX as u64 & !7)
}

fn encode_hdr(len: u64, flags: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..].copy_from_slice(&flags.to_le_bytes());
    h
}

/// Sending end of a record ring.
pub struct RecordProducer {
    core: ProdCore,
    /// The ring, for taking back what a reader handed back ([`RecordProducer::take_back`]).
    view: ShmSlice,
}

impl std::fmt::Debug for RecordProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordProducer")
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}

impl RecordProducer {
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        Ok(RecordProducer {
            core: ProdCore::attach(&view, RingKind::Record, 8)?,
            view,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.core.cap()
    }

    /// Largest record this ring carries: `capacity/2 - 8`.
    pub fn max_record(&self) -> u64 {
        max_record(self.core.cap())
    }

    /// Ring bytes a record of `len` needs at the current tail, padding record included.
    fn need(&self, len: u64) -> u64 {
        let cap = self.core.cap();
        let to_end = cap - (self.core.tail & (cap - 1));
        let rec = RECORD_HEADER_BYTES + pad8(len);
        if rec > to_end {
            to_end + rec
        } else {
            rec
        }
    }

    /// Sends one record; `Ok(false)` if there is no room right now.
    pub fn send(&mut self, rec: &[u8]) -> Result<bool, RingError> {
        self.send_parts(&[rec])
    }

    /// Sends the concatenation of `parts` as one record.
    pub fn send_parts(&mut self, parts: &[&[u8]]) -> Result<bool, RingError> {
        self.core.check_open()?;
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if len > self.max_record() {
            return Err(RingError::TooLarge {
                len,
                max: self.max_record(),
            });
        }
        let need = self.need(len);
        if self.core.free_for(need)? < need {
            return Ok(false);
        }
        let (data, cap) = (&self.core.h.data, self.core.cap());
        let mut off = self.core.tail & (cap - 1);
        if need > RECORD_HEADER_BYTES + pad8(len) {
            data.write(
                off,
                &encode_hdr(cap - off - RECORD_HEADER_BYTES, RECORD_FLAG_PAD),
            )?;
            off = 0;
        }
        data.write(off, &encode_hdr(len, 0))?;
        let mut at = off + RECORD_HEADER_BYTES;
        for p in parts {
            data.write(at, p)?;
            at += p.len() as u64;
        }
        self.core.publish(need);
        Ok(true)
    }

    /// Room for one record of at most `max` bytes, to be written in place (by the kernel,
    /// say, reading a device straight into the ring) and then published with
    /// [`RecordProducer::commit`]; `Ok(None)` if it does not fit right now. Nothing is visible
    /// to the reader before the commit, and a reservation never committed costs nothing.
    pub fn reserve(&mut self, max: u64) -> Result<Option<Reservation>, RingError> {
        self.core.check_open()?;
        if max > self.max_record() {
            return Err(RingError::TooLarge {
                len: max,
                max: self.max_record(),
            });
        }
        let need = self.need(max);
        if self.core.free_for(need)? < need {
            return Ok(None);
        }
        let cap = self.core.cap();
        let mut off = self.core.tail & (cap - 1);
        let skip = if need > RECORD_HEADER_BYTES + pad8(max) {
            let skip = cap - off;
            self.core.h.data.write(
                off,
                &encode_hdr(skip - RECORD_HEADER_BYTES, RECORD_FLAG_PAD),
            )?;
            off = 0;
            skip
        } else {
            0
        };
        Ok(Some(Reservation {
            at: off + RECORD_HEADER_BYTES,
            max,
            skip,
        }))
    }

    /// The ring's data area, where a [`Reservation`] lies (`Reservation::at`).
    pub fn data(&self) -> &ShmSlice {
        &self.core.h.data
    }

    /// Publishes a reserved record whose first `len` bytes were written in place.
    pub fn commit(&mut self, r: Reservation, len: u64) -> Result<(), RingError> {
        if len > r.max {
            return Err(RingError::TooLarge { len, max: r.max });
        }
        self.core
            .h
            .data
            .write(r.at - RECORD_HEADER_BYTES, &encode_hdr(len, 0))?;
        self.core.publish(r.skip + RECORD_HEADER_BYTES + pad8(len));
        Ok(())
    }

    pub fn shutdown(&mut self) {
        self.core.shutdown();
    }

    pub fn reader_closed(&self) -> bool {
        self.core.reader_closed()
    }

    /// This end's presence word and the reader's ([`crate::presence`]).
    pub fn presence_words(&self) -> (&memloop_shm::ShmU32, &memloop_shm::ShmU32) {
        (&self.core.h.ppres, &self.core.h.cpres)
    }

    /// Ring bytes sent and not yet received (records with their headers and padding).
    /// Without a fresh look at the head when its last look already says at most `within`
    /// (a bound check costs no cache line of the reader's then).
    pub fn queued_bytes(&mut self, within: u64) -> Result<u64, RingError> {
        match self.core.used_cached() {
            q if q <= within => Ok(q),
            _ => self.core.used(),
        }
    }

    /// The records the reader handed back unread ([`RecordConsumer::hand_back`]), in order,
    /// taken off the ring; none while it reads (or if it just closed: those are discarded).
    /// Read as a consumer reads them, every header validated: a reader that has handed back
    /// never touches the ring again, so the head is ours to move.
    pub fn take_back(&mut self) -> Result<Vec<Vec<u8>>, RingError> {
        if !self.core.handed_back()? {
            return Ok(Vec::new());
        }
        read_all(RecordConsumer::attach(self.view.clone())?)
    }

    /// Copies of the records the reader has not received yet, in order, leaving them queued
    /// (the ring's head does not move): for a writer about to withdraw them (when it can
    /// make sure the reader never will read them, e.g. it never took the ring).
    pub fn unread(&self) -> Result<Vec<Vec<u8>>, RingError> {
        let mut c = RecordConsumer::attach(self.view.clone())?;
        c.core.detach();
        read_all(c)
    }

    /// Waits until a record of `len` bytes fits or the reader closed.
    pub fn wait_writable(
        &mut self,
        len: u64,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        if len > self.max_record() {
            return Err(RingError::TooLarge {
                len,
                max: self.max_record(),
            });
        }
        let need = self.need(len);
        self.core.wait_writable(need, policy, timeout)
    }
}

/// Room reserved by [`RecordProducer::reserve`]: `max` bytes at offset `at` of the data area.
#[derive(Debug)]
#[must_use = "a reservation is published only by commit"]
pub struct Reservation {
    pub at: u64,
    pub max: u64,
    /// Bytes of padding before the record (to the ring end), published with it.
    skip: u64,
}

/// Every record `c` has from its head on.
fn read_all(mut c: RecordConsumer) -> Result<Vec<Vec<u8>>, RingError> {
    let mut out = Vec::new();
    while let Some(len) = c.peek_len()? {
        let mut rec = vec![0u8; len as usize];
        c.recv(&mut rec)?;
        out.push(rec);
    }
    Ok(out)
}

/// Receiving end of a record ring.
#[derive(Debug)]
pub struct RecordConsumer {
    core: ConsCore,
}

impl RecordConsumer {
    pub fn attach(view: ShmSlice) -> Result<Self, RingError> {
        Ok(RecordConsumer {
            core: ConsCore::attach(&view, RingKind::Record, 8)?,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.core.cap()
    }

    pub fn max_record(&self) -> u64 {
        max_record(self.core.cap())
    }

    /// Reads and validates the header at `head`; `None` if the ring is empty.
    fn header(&mut self) -> Result<Option<(u64, u32)>, RingError> {
        let avail = self.core.avail_for(RECORD_HEADER_BYTES)?;
        if avail == 0 {
            return Ok(None);
        }
        let off = self.core.head & (self.core.cap() - 1);
        let mut h = [0u8; 8];
        self.core.h.data.read(off, &mut h)?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as u64;
        let flags = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let size = RECORD_HEADER_BYTES + pad8(len);
        let bad = if flags & !RECORD_FLAG_PAD != 0 {
            Some("unknown record flags")
        } else if size > avail {
            Some("record longer than the published data")
        } else if flags == RECORD_FLAG_PAD && (off == 0 || off + size != self.core.cap()) {
            Some("padding record does not end at the ring end")
        } else if flags == 0 && (len > self.max_record() || off + size > self.core.cap()) {
            Some("record too long or crossing the ring end")
        } else {
            None
        };
        match bad {
            Some(what) => Err(RingError::corrupt(
                what,
                format!("len {len} flags {flags:#x} at {off}, {avail} available"),
            )),
            None => Ok(Some((len, flags))),
        }
    }

    /// Length of the next record, skipping (and releasing) a padding record; `None` if empty.
    pub fn peek_len(&mut self) -> Result<Option<u64>, RingError> {
        let mut next = self.header()?;
        if let Some((len, RECORD_FLAG_PAD)) = next {
            self.core.consume(RECORD_HEADER_BYTES + pad8(len));
            next = self.header()?;
        }
        match next {
            // Unreachable with a sane peer: header() rejects a pad at offset 0.
            Some((_, RECORD_FLAG_PAD)) => {
                Err(RingError::corrupt("two padding records", String::new()))
            }
            other => Ok(other.map(|(l, _)| l)),
        }
    }

    /// Receives one record into `dst`: like UDP, copies what fits and reports the full length.
    pub fn recv(&mut self, dst: &mut [u8]) -> Result<Option<RecvInfo>, RingError> {
        let got = self.peek(dst)?;
        if let Some(info) = got {
            self.core.consume(RECORD_HEADER_BYTES + pad8(info.len));
        }
        Ok(got)
    }

    /// Copies the next record's head into `dst` without consuming it (`MSG_PEEK`).
    pub fn peek(&mut self, dst: &mut [u8]) -> Result<Option<RecvInfo>, RingError> {
        let Some(len) = self.peek_len()? else {
            return Ok(None);
        };
        let copied = dst.len().min(len as usize);
        let off = self.core.head & (self.core.cap() - 1);
        self.core
            .h
            .data
            .read(off + RECORD_HEADER_BYTES, &mut dst[..copied])?;
        Ok(Some(RecvInfo { len, copied }))
    }

    /// The next record where it lies in the data area ([`RecordConsumer::data`]): its offset
    /// and length, validated like every header. It stays queued until
    /// [`RecordConsumer::consume_peeked`], so it can be handed to the kernel in place.
    pub fn peek_in_place(&mut self) -> Result<Option<(u64, u64)>, RingError> {
        let Some(len) = self.peek_len()? else {
            return Ok(None);
        };
        let off = self.core.head & (self.core.cap() - 1);
        Ok(Some((off + RECORD_HEADER_BYTES, len)))
    }

    /// Releases the record [`RecordConsumer::peek_in_place`] returned (re-reading its
    /// validated header, so a caller cannot skip by a wrong length); false if there is none.
    pub fn consume_peeked(&mut self) -> Result<bool, RingError> {
        match self.peek_len()? {
            Some(len) => {
                self.core.consume(RECORD_HEADER_BYTES + pad8(len));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The ring's data area (read-only use: records found by `peek_in_place`).
    pub fn data(&self) -> &ShmSlice {
        &self.core.h.data
    }

    /// True when the writer shut down and every record has been received.
    pub fn is_eof(&mut self) -> Result<bool, RingError> {
        if !self.core.writer_shut()? {
            return Ok(false);
        }
        Ok(self.peek_len()?.is_none())
    }

    pub fn close(&mut self) {
        self.core.close();
    }

    /// This end's presence word and the writer's ([`crate::presence`]).
    pub fn presence_words(&self) -> (&memloop_shm::ShmU32, &memloop_shm::ShmU32) {
        (&self.core.h.cpres, &self.core.h.ppres)
    }

    /// Closes for good, leaving the records not read yet to the producer to deliver another
    /// way ([`RecordProducer::take_back`]). Nothing may be read after it.
    pub fn hand_back(&mut self) {
        self.core.hand_back();
    }

    /// Waits until a record is available or EOF.
    pub fn wait_readable(
        &mut self,
        policy: &WaitPolicy,
        timeout: Duration,
    ) -> Result<bool, RingError> {
        self.core.wait_readable(1, policy, timeout)
    }
}
