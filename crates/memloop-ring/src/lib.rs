//! Lock-free single-producer/single-consumer rings living in shared memory.
//!
//! Three flavours share one 256-byte header layout ([`header`]) and one index discipline
//! (free-running `u64` indices, power-of-two capacity, each side authoritative for its own index
//! and caching the peer's):
//! - [`stream`]: a byte stream (what a TCP connection becomes);
//! - [`record`]: length-prefixed records (datagrams), never split across the ring end;
//! - [`slots`]: fixed-size slots, e.g. 32-byte [`Descriptor`]s for zero-copy rings;
//!   [`held`]: the zero-copy reader, which holds the slots it took until it releases them.
//!
//! Everything the peer writes is untrusted (brief §4): indices, lengths and flags are validated
//! and a violation yields [`RingError::Corrupt`], never a panic, hang or out-of-bounds access.
//! Waiting ([`wait`]) spins for a bounded, adaptive window and then sleeps; the peer only pays
//! for a wake-up when the waiter asked for one.
#![forbid(unsafe_code)]

pub mod descriptor;
mod error;
pub mod header;
pub mod held;
mod index;
pub mod leave;
pub mod presence;
pub mod record;
pub mod slots;
pub mod stream;
pub mod wait;

pub use descriptor::Descriptor;
pub use error::RingError;
pub use header::{init_ring, init_ring_windowed, ring_bytes, RingKind, RING_HEADER_BYTES};
pub use held::{note_forward, scan_held, scan_stable, HeldConsumer, HeldReleaser};
pub use presence::Presence;
pub use record::{RecordConsumer, RecordProducer, RecvInfo, Reservation};
pub use slots::{SlotConsumer, SlotProducer};
pub use stream::{StreamConsumer, StreamProducer};
pub use wait::{
    park_until, spin_plan, Park, SpinInputs, SpinPlan, Spinner, WaitCell, WaitPolicy, WakeMode,
};
