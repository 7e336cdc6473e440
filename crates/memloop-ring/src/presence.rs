//! Where each ring end's owner says whether it runs, and on which CPU, so that a waiter can
//! tell whether spinning can pay ([`crate::wait::spin_plan`]).
//!
//! One `u32` per ring end, on that end's own cache line (the producer's at offset 8 beside
//! the tail, the consumer's at 72 beside the head): written only by the end's owner, read by
//! the peer when it starts to wait. The owner writes it when it starts a wait (running, on
//! the CPU `sched_getcpu` says), when it goes to sleep in the kernel (asleep) and when it
//! wakes (running again) — and only when the value changes, so a busy pair does not bounce
//! the line. A side with two rings (a stream connection) writes its word in both.
//!
//! It is a hint: a stale or garbage word costs latency, never correctness (the wake-up
//! handshake does not read it). Anything that is not a valid encoding — unknown bits, a CPU
//! number out of range — decodes as [`Presence::Unknown`]; an old peer that never writes the
//! word leaves it 0, which is `Unknown` too, so the layout version did not change.

use crate::header::{OFF_CPRES, OFF_PPRES};
use memloop_shm::sync::{AtomicU32, Ordering::Relaxed};
use memloop_shm::ShmSlice;

/// What a ring end's owner last said about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Never written, written by an older build, or not a valid encoding.
    Unknown,
    /// Running (or spinning) on this CPU when it last started a wait or woke.
    Running { cpu: u32 },
    /// Asleep in the kernel (or about to be) waiting; `cpu` is where it last ran.
    Asleep { cpu: Option<u32> },
}

const RUNNING: u32 = 1 << 31;
const ASLEEP: u32 = 1 << 30;
const CPU_MASK: u32 = 0xffff;
/// "No CPU" in an asleep word; also the first CPU number that cannot be encoded.
const NO_CPU: u32 = CPU_MASK;

impl Presence {
    pub fn encode(self) -> u32 {
        match self {
            Presence::Running { cpu } if cpu < NO_CPU => RUNNING | cpu,
            Presence::Running { .. } | Presence::Unknown => 0,
            Presence::Asleep { cpu } => ASLEEP | cpu.filter(|c| *c < NO_CPU).unwrap_or(NO_CPU),
        }
    }

    /// Decodes a word a peer wrote: anything unexpected is `Unknown`.
    pub fn decode(w: u32) -> Self {
        let cpu = w & CPU_MASK;
        match w & !CPU_MASK {
            RUNNING if cpu != NO_CPU => Presence::Running { cpu },
            ASLEEP => Presence::Asleep {
                cpu: (cpu != NO_CPU).then_some(cpu),
            },
            _ => Presence::Unknown,
        }
    }

    /// Running on `cpu` if known, else unknown.
    pub fn running(cpu: Option<u32>) -> Self {
        cpu.map_or(Presence::Unknown, |cpu| Presence::Running { cpu })
    }
}

/// Which end of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Producer,
    Consumer,
}

impl End {
    pub(crate) fn offset(self) -> u64 {
        match self {
            End::Producer => OFF_PPRES,
            End::Consumer => OFF_CPRES,
        }
    }

    pub fn other(self) -> Self {
        match self {
            End::Producer => End::Consumer,
            End::Consumer => End::Producer,
        }
    }
}

/// Publishes `p` as `end`'s presence in the ring of `view` (a store only if it changed).
pub fn publish(view: &ShmSlice, end: End, p: Presence) {
    if let Ok(w) = view.atomic_u32(end.offset()) {
        publish_in(w, p);
    }
}

/// Stores `p` in a presence word, only if it changed (the line stays shared otherwise).
pub fn publish_in(word: &AtomicU32, p: Presence) {
    let v = p.encode();
    if word.load(Relaxed) != v {
        word.store(v, Relaxed);
    }
}

/// `end`'s presence in the ring of `view`, validated.
pub fn read(view: &ShmSlice, end: End) -> Presence {
    view.atomic_u32(end.offset())
        .map_or(Presence::Unknown, read_in)
}

/// A presence word's value, validated.
pub fn read_in(word: &AtomicU32) -> Presence {
    Presence::decode(word.load(Relaxed))
}

/// Whether `end`'s waiting flag in the ring of `view` is armed (a sleep announced that no
/// publication has answered yet). Garbage counts as armed: it only makes a waiter sleep.
pub fn waiting(view: &ShmSlice, end: End) -> bool {
    let off = match end {
        End::Producer => crate::header::OFF_PWAIT,
        End::Consumer => crate::header::OFF_CWAIT,
    };
    view.atomic_u32(off).is_ok_and(|w| w.load(Relaxed) != 0)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        for p in [
            Presence::Unknown,
            Presence::Running { cpu: 0 },
            Presence::Running { cpu: 4095 },
            Presence::Asleep { cpu: Some(1) },
            Presence::Asleep { cpu: None },
        ] {
            assert_eq!(Presence::decode(p.encode()), p);
        }
        // CPUs that cannot be encoded become "don't know".
        assert_eq!(Presence::Running { cpu: 1 << 20 }.encode(), 0);
        assert_eq!(
            Presence::decode(Presence::Asleep { cpu: Some(1 << 20) }.encode()),
            Presence::Asleep { cpu: None }
        );
    }

    #[test]
    fn garbage_is_unknown() {
        assert_eq!(Presence::decode(0), Presence::Unknown);
        assert_eq!(Presence::decode(RUNNING | ASLEEP | 3), Presence::Unknown);
        assert_eq!(Presence::decode(RUNNING | 1 << 16 | 3), Presence::Unknown);
        assert_eq!(Presence::decode(RUNNING | NO_CPU), Presence::Unknown);
        assert_eq!(Presence::decode(7), Presence::Unknown);
    }

    #[test]
    fn publishes_in_the_header() {
        let v = ShmSlice::new_heap(4096);
        crate::init_ring(&v, crate::RingKind::Stream, 1024, 0).unwrap();
        assert_eq!(read(&v, End::Producer), Presence::Unknown);
        publish(&v, End::Producer, Presence::Running { cpu: 1 });
        publish(&v, End::Consumer, Presence::Asleep { cpu: Some(0) });
        assert_eq!(read(&v, End::Producer), Presence::Running { cpu: 1 });
        assert_eq!(read(&v, End::Consumer), Presence::Asleep { cpu: Some(0) });
        assert!(!waiting(&v, End::Consumer));
    }

    proptest! {
        #[test]
        fn any_word_decodes_to_a_valid_cpu(w in any::<u32>()) {
            match Presence::decode(w) {
                Presence::Running { cpu } => prop_assert!(cpu < NO_CPU),
                Presence::Asleep { cpu } => prop_assert!(cpu.is_none_or(|c| c < NO_CPU)),
                Presence::Unknown => {}
            }
        }
    }
}
