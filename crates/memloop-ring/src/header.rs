//! The 256-byte ring header: producer line, consumer line, static line, then data.
//!
//! Producer and consumer state sit on separate 64-byte cache lines so that publishing an index
//! only invalidates the line the peer polls. The "waiting" and "closed/shutdown" flags, which the
//! *other* side reads on every operation, have a line of their own: they change only when a side
//! sleeps or closes, so that line stays shared in both caches and checking it costs no transfer. The static line is written once by [`init_ring`]
//! (magic last, with release) and validated by every `attach`.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | tail `u64` (producer index) |
//! | 8 | producer presence `u32` ([`crate::presence`]: running on CPU k / asleep) |
//! | 16 | producer futex seq `u32` |
//! | 24 | mapping `u64`: the window in use and its base (see below; 0: all of it, base 0) |
//! | 32 | hazard `u64`: the tail when a grow last copied bytes (0: none; see below) |
//! | 64 | head `u64` (consumer index) |
//! | 72 | consumer presence `u32` |
//! | 80 | consumer futex seq `u32` |
//! | 128 | magic `u64`, 136 kind `u32`, 140 slot size `u32`, 144 capacity `u64` |
//! | 192 | producer-waiting `u32`, 196 consumer-waiting `u32` |
//! | 200 | writer flags `u32` ([`WFLAG_SHUTDOWN`]), 204 reader flags `u32` ([`RFLAG_CLOSED`], [`RFLAG_RETURNED`]) |
//! | 256 | data (`capacity` bytes) |
//!
//! **Window.** A stream ring's data area is reserved at its full `capacity` but only its first
//! `window` bytes are used (a power of two, 64 ≤ window ≤ capacity), from a *base*: index `p`
//! lives at offset `(p - base) mod window`. Only the producer changes the mapping (one word:
//! window and base mod window, stored with release *after* anything it copied); the consumer
//! loads it with acquire after the tail. A change keeps every unconsumed byte where a reader
//! with either mapping finds it:
//! - while the ring is empty, anything goes (the base is set so that the tail is at offset 0);
//! - a grow while bytes are in the ring keeps their offsets: when they do not wrap around the
//!   old window's end the new base simply names the same offsets; when they do, the producer
//!   first copies the wrapped part (`[0, x)`) to just past the old window's end, where the new
//!   mapping puts it — and since a reader with the old mapping may still be copying from
//!   `[0, x)`, the producer writes nothing there (it does not wrap) until the head has passed
//!   the tail of that moment (the *hazard*, in the header for another process sharing the
//!   producer).
//!
//! So a connection's ring grows the moment a write does not fit (as TCP buffers what the peer
//! has not read) and shrinks when idle, its memory reserved and given back with it, without a
//! byte lost or reordered.

use crate::wait::WaitCell;
use crate::RingError;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, Release};
use memloop_shm::{ShmSlice, ShmU32, ShmU64};

/// Bytes of header in front of the data area.
pub const RING_HEADER_BYTES: u64 = 256;
/// Marks an initialised ring header ("MLRING01").
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"MLRING01");
/// Writer flag: the producer is done; the consumer sees EOF once it has drained the ring.
pub const WFLAG_SHUTDOWN: u32 = 1;
/// Writer flag: the writer aborted (a TCP reset): the reader gets what was published, then an
/// error instead of EOF.
pub const WFLAG_RESET: u32 = 2;
/// Every writer flag a valid header may carry.
pub const WFLAGS_KNOWN: u32 = WFLAG_SHUTDOWN | WFLAG_RESET;
/// Reader flag: the consumer is gone; the producer gets [`RingError::Closed`].
pub const RFLAG_CLOSED: u32 = 1;
/// Reader flag (with [`RFLAG_CLOSED`]): the consumer left *handing back* what it had not
/// read: it will never read again, and the producer may take the records from the head
/// ([`crate::RecordProducer::take_back`]) to deliver them another way.
pub const RFLAG_RETURNED: u32 = 2;
/// Every reader flag a valid header may carry.
pub const RFLAGS_KNOWN: u32 = RFLAG_CLOSED | RFLAG_RETURNED;
/// Smallest allowed capacity.
pub const MIN_CAPACITY: u64 = 64;

/// Field offsets inside the header (see the table above).
pub const OFF_TAIL: u64 = 0;
pub const OFF_WFLAGS: u64 = 200;
pub const OFF_PWAIT: u64 = 192;
pub const OFF_PSEQ: u64 = 16;
pub const OFF_HEAD: u64 = 64;
pub const OFF_RFLAGS: u64 = 204;
pub const OFF_CWAIT: u64 = 196;
pub const OFF_CSEQ: u64 = 80;
pub const OFF_MAGIC: u64 = 128;
pub const OFF_KIND: u64 = 136;
pub const OFF_SLOT: u64 = 140;
pub const OFF_CAP: u64 = 144;
/// Presence words (hints, see [`crate::presence`]): each on its owner's index line.
pub const OFF_PPRES: u64 = 8;
pub const OFF_CPRES: u64 = 72;
/// The producer's mapping and hazard words (see the module text), on its index line.
pub const OFF_MAPPING: u64 = 24;
pub const OFF_HAZARD: u64 = 32;

/// Where the data of a stream ring lives: index `p` at offset `(p - base) mod window`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub window: u64,
    /// Only its value mod `window` matters.
    pub base: u64,
}

impl Mapping {
    /// The whole ring from index 0 (also what a mapping word of 0 means).
    pub fn whole(capacity: u64) -> Self {
        Mapping {
            window: capacity,
            base: 0,
        }
    }

    /// The index to give `copy_in`/`copy_out` (which reduce mod the window) for index `p`.
    pub fn at(&self, p: u64) -> u64 {
        p.wrapping_sub(self.base)
    }

    /// The header word: log2(window) in the low byte, base mod window above it.
    pub fn word(&self) -> u64 {
        (self.base & (self.window - 1)) << 8 | u64::from(self.window.trailing_zeros())
    }

    /// A header word for a ring of `capacity`; `None` if it names no valid mapping.
    pub fn of_word(word: u64, capacity: u64) -> Option<Self> {
        if word == 0 {
            return Some(Self::whole(capacity));
        }
        let log = word & 0xff;
        let window = 1u64.checked_shl(u32::try_from(log).ok()?)?;
        let base = word >> 8;
        let ok = (MIN_CAPACITY..=capacity).contains(&window) && base < window;
        ok.then_some(Mapping { window, base })
    }
}

/// Total bytes a ring of `capacity` data bytes occupies (saturating on absurd capacities).
pub fn ring_bytes(capacity: u64) -> u64 {
    RING_HEADER_BYTES.saturating_add(capacity)
}

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingKind {
    Stream = 1,
    Record = 2,
    Slots = 3,
}

impl RingKind {
    fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(RingKind::Stream),
            2 => Some(RingKind::Record),
            3 => Some(RingKind::Slots),
            _ => None,
        }
    }
}

/// Checks capacity and slot size; `None` if fine, else what is wrong.
fn geometry_problem(
    kind: RingKind,
    capacity: u64,
    slot_size: u32,
    view_len: u64,
) -> Option<String> {
    if !capacity.is_power_of_two() || capacity < MIN_CAPACITY {
        return Some(format!(
            "capacity {capacity} is not a power of two >= {MIN_CAPACITY}"
        ));
    }
    if ring_bytes(capacity) > view_len {
        return Some(format!(
            "ring of {} bytes does not fit a view of {view_len} bytes",
            ring_bytes(capacity)
        ));
    }
    let s = slot_size as u64;
    let slot_ok = match kind {
        RingKind::Slots => s.is_power_of_two() && s <= capacity,
        _ => s == 0,
    };
    (!slot_ok).then(|| {
        format!("slot size {slot_size} is invalid for a {kind:?} ring of capacity {capacity}")
    })
}

/// Initialises a ring header in `view` (which must hold at least `ring_bytes(capacity)` bytes).
/// `capacity` must be a power of two >= 64; for [`RingKind::Slots`] `slot_size` must be a power
/// of two dividing it, for the other kinds 0. Not to be called while a peer is attached.
pub fn init_ring(
    view: &ShmSlice,
    kind: RingKind,
    capacity: u64,
    slot_size: u32,
) -> Result<(), RingError> {
    init_ring_windowed(view, kind, capacity, slot_size, capacity)
}

/// [`init_ring`] with only the first `window` bytes of the data area in use (stream rings;
/// the others use all of it).
pub fn init_ring_windowed(
    view: &ShmSlice,
    kind: RingKind,
    capacity: u64,
    slot_size: u32,
    window: u64,
) -> Result<(), RingError> {
    if let Some(p) = geometry_problem(kind, capacity, slot_size, view.len() as u64) {
        return Err(RingError::Config(p));
    }
    let valid = window.is_power_of_two() && (MIN_CAPACITY..=capacity).contains(&window);
    if !valid || (kind != RingKind::Stream && window != capacity) {
        let p = format!("window {window} for a {kind:?} ring of capacity {capacity}");
        return Err(RingError::Config(p));
    }
    // Every field is stored explicitly (no bulk fill: under loom each byte is a modelled access).
    view.u64_at(OFF_MAGIC)?.store(0, Release);
    for off in [
        OFF_WFLAGS, OFF_PWAIT, OFF_PSEQ, OFF_RFLAGS, OFF_CWAIT, OFF_CSEQ, OFF_PPRES, OFF_CPRES,
    ] {
        view.u32_at(off)?.store(0, Relaxed);
    }
    view.u64_at(OFF_TAIL)?.store(0, Relaxed);
    view.u64_at(OFF_HEAD)?.store(0, Relaxed);
    view.u32_at(OFF_KIND)?.store(kind as u32, Relaxed);
    view.u32_at(OFF_SLOT)?.store(slot_size, Relaxed);
    view.u64_at(OFF_CAP)?.store(capacity, Relaxed);
    let mapping = Mapping { window, base: 0 };
    view.u64_at(OFF_MAPPING)?.store(mapping.word(), Relaxed);
    view.u64_at(OFF_HAZARD)?.store(0, Relaxed);
    view.u64_at(OFF_MAGIC)?.store(RING_MAGIC, Release);
    Ok(())
}

/// Handles to every shared field of one ring, validated once at attach.
pub(crate) struct Header {
    pub tail: ShmU64,
    pub wflags: ShmU32,
    pub head: ShmU64,
    pub rflags: ShmU32,
    /// The producer sleeps here (waiting for space); the consumer wakes it.
    pub prod: WaitCell,
    /// The consumer sleeps here (waiting for data); the producer wakes it.
    pub cons: WaitCell,
    /// Presence words ([`crate::presence`]) of the producer and the consumer.
    pub ppres: ShmU32,
    pub cpres: ShmU32,
    /// The producer's mapping and hazard words (see the module text).
    pub mapping: ShmU64,
    pub hazard: ShmU64,
    pub data: ShmSlice,
    pub cap: u64,
    pub slot_size: u32,
}

impl Header {
    /// The mapping in force (acquire: with what the producer copied before storing it;
    /// validated against the capacity, a bad word is corruption).
    pub fn load_mapping(&self) -> Result<Mapping, RingError> {
        let w = self.mapping.load(Acquire);
        Mapping::of_word(w, self.cap).ok_or_else(|| {
            RingError::corrupt("mapping", format!("{w:#x} for a capacity of {}", self.cap))
        })
    }

    /// Validates the static line of `view` against `kind` and the view's size.
    pub fn attach(view: &ShmSlice, kind: RingKind) -> Result<Self, RingError> {
        let magic = view.u64_at(OFF_MAGIC)?.load(Acquire);
        if magic != RING_MAGIC {
            return Err(RingError::bad_header(
                "magic",
                format!("{magic:#x}, expected {RING_MAGIC:#x}"),
            ));
        }
        let raw_kind = view.u32_at(OFF_KIND)?.load(Relaxed);
        if RingKind::from_u32(raw_kind) != Some(kind) {
            return Err(RingError::bad_header(
                "kind",
                format!("{raw_kind}, expected {kind:?} ({})", kind as u32),
            ));
        }
        let cap = view.u64_at(OFF_CAP)?.load(Relaxed);
        let slot_size = view.u32_at(OFF_SLOT)?.load(Relaxed);
        if let Some(p) = geometry_problem(kind, cap, slot_size, view.len() as u64) {
            return Err(RingError::bad_header("geometry", p));
        }
        Ok(Header {
            tail: view.u64_at(OFF_TAIL)?,
            wflags: view.u32_at(OFF_WFLAGS)?,
            head: view.u64_at(OFF_HEAD)?,
            rflags: view.u32_at(OFF_RFLAGS)?,
            prod: WaitCell::new(view.u32_at(OFF_PWAIT)?, view.u32_at(OFF_PSEQ)?),
            cons: WaitCell::new(view.u32_at(OFF_CWAIT)?, view.u32_at(OFF_CSEQ)?),
            ppres: view.u32_at(OFF_PPRES)?,
            cpres: view.u32_at(OFF_CPRES)?,
            mapping: view.u64_at(OFF_MAPPING)?,
            hazard: view.u64_at(OFF_HAZARD)?,
            data: view.slice(RING_HEADER_BYTES, cap)?,
            cap,
            slot_size,
        })
    }
}

/// The raw kind code in a ring's static line (compare with `RingKind as u32`), for a caller
/// that must say which kind it found rather than only that [`Header::attach`] refused it.
pub fn kind_code(view: &ShmSlice) -> Result<u32, RingError> {
    Ok(view.atomic_u32(OFF_KIND)?.load(Relaxed))
}

/// Bytes (tail, head) that have passed through a ring so far, for observers such as
/// `memloop status`: read-only, and `None` if `view` holds no initialised ring.
pub fn totals(view: &ShmSlice) -> Option<(u64, u64)> {
    if view.atomic_u64(OFF_MAGIC).ok()?.load(Acquire) != RING_MAGIC {
        return None;
    }
    let tail = view.atomic_u64(OFF_TAIL).ok()?.load(Acquire);
    Some((tail, view.atomic_u64(OFF_HEAD).ok()?.load(Acquire)))
}

/// A lock-free snapshot of a ring's state for readiness checks (poll/epoll) by either side,
/// taken without the producer or consumer object (another thread may hold those).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Bytes published and not yet consumed.
    pub used: u64,
    pub capacity: u64,
    /// The part of the capacity in use.
    pub window: u64,
    /// What a write could take now: the window's free bytes (fewer while a copying grow's
    /// hazard keeps writes from wrapping: header module text) — or, when they are none and
    /// the window can grow, what a write that grows it could take.
    pub room: u64,
    pub writer_shut: bool,
    pub writer_reset: bool,
    pub reader_closed: bool,
}

impl Probe {
    pub fn free(&self) -> u64 {
        self.room
    }
}

/// [`probe`] held against the capacity validated when the ring was attached: a capacity word
/// a buggy peer changed since reads as corruption instead of skewing `used` and `free`.
pub fn probe_attached(view: &ShmSlice, capacity: u64) -> Option<Probe> {
    probe(view).filter(|p| p.capacity == capacity)
}

/// Whether a reader has bytes to read, from three words only (the flags, then both indices):
/// `Some(true)` while bytes wait and the writer has neither shut down nor reset — the look an
/// epoll set of thousands of readers makes most — `None` otherwise, for a full
/// [`probe_attached`] (an empty ring, a shutdown, or indices out of range).
pub fn has_unread(view: &ShmSlice, capacity: u64) -> Option<bool> {
    // Flags first (acquire), as in `probe`.
    let wflags = view.atomic_u32(OFF_WFLAGS).ok()?.load(Acquire);
    if wflags != 0 {
        return None;
    }
    let head = view.atomic_u64(OFF_HEAD).ok()?.load(Acquire);
    let tail = view.atomic_u64(OFF_TAIL).ok()?.load(Acquire);
    let used = tail.wrapping_sub(head);
    (used > 0 && used <= capacity).then_some(true)
}

/// Reads a [`Probe`]; `None` if the header or indices are not a valid ring (corruption).
/// Readers that attached the ring should use [`probe_attached`].
pub fn probe(view: &ShmSlice) -> Option<Probe> {
    if view.atomic_u64(OFF_MAGIC).ok()?.load(Acquire) != RING_MAGIC {
        return None;
    }
    let capacity = view.atomic_u64(OFF_CAP).ok()?.load(Relaxed);
    let map = Mapping::of_word(view.atomic_u64(OFF_MAPPING).ok()?.load(Acquire), capacity)?;
    let hazard = view.atomic_u64(OFF_HAZARD).ok()?.load(Acquire);
    // Flags first (acquire): bytes published before a shutdown are then visible below.
    let wflags = view.atomic_u32(OFF_WFLAGS).ok()?.load(Acquire);
    let rflags = view.atomic_u32(OFF_RFLAGS).ok()?.load(Acquire);
    // Both indices may move between the two loads; a torn pair looks out of range, so retry
    // a few times before calling it corrupt.
    for _ in 0..8 {
        let head = view.atomic_u64(OFF_HEAD).ok()?.load(Acquire);
        let tail = view.atomic_u64(OFF_TAIL).ok()?.load(Acquire);
        let used = tail.wrapping_sub(head);
        if used <= capacity {
            let window = map.window;
            let mut room = window.saturating_sub(used);
            if hazard != 0 && head.wrapping_sub(hazard) > u64::MAX / 2 {
                let at = map.at(tail) & (window - 1);
                room = room.min(if at == 0 { 0 } else { window - at });
            }
            if room == 0 && window < capacity {
                room = capacity - used;
            }
            return Some(Probe {
                used,
                capacity,
                window,
                room,
                writer_shut: wflags & WFLAG_SHUTDOWN != 0,
                writer_reset: wflags & WFLAG_RESET != 0,
                reader_closed: rflags & RFLAG_CLOSED != 0,
            });
        }
    }
    None
}
