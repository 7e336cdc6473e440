//! Zero-copy messaging (Fido): a member loans a buffer from its own [`Pool`], fills it and
//! sends a 32-byte descriptor instead of the bytes; the receiver reads the buffer in place
//! through a read-only mapping, and may forward it — whole, a sub-range, or mixed with
//! buffers of its own — to the next stage without copying. The owner gets a buffer back when
//! the last holder in the whole pipeline has released it.
//!
//! ```no_run
//! use memloop::zerocopy::{Pool, ZcListener, ZcPort};
//! use memloop::Node;
//! let node = Node::join_default("sender")?;
//! let pool = Pool::create(&node, 1 << 20, 16)?;
//! let mut port = ZcPort::connect(&node, "frames")?;
//! let mut buf = pool.loan()?;
//! buf[..5].copy_from_slice(b"hello");
//! buf.truncate(5);
//! port.send(buf)?;
//! # Ok::<(), memloop::Error>(())
//! ```
//!
//! How the pieces hold together (the registry's `tables/pools.rs` has the argument): every
//! reference to a buffer is a slot of a descriptor ring of a live channel — unread, or read
//! and held until the [`Received`] is dropped — or a [`Loan`] of its owner. So a member's
//! crash loses no reference to undo: its channels go, and with them its holds. The owner
//! finds free buffers by scanning the descriptor rings when it runs out; a forward bumps the
//! pool's forwards word so that a scan racing it retries.

mod message;
mod pool;
mod port;

pub use message::Message;
pub use pool::{Loan, Pool};
pub use port::{Received, ZcListener, ZcPort};

/// Descriptor ring capacity per direction (bytes; 32 per descriptor): 512 descriptors.
pub const DEFAULT_DESC_RING: u64 = 16 << 10;
