//! memloop's native API: byte-stream channels between co-resident processes (and VMs sharing an
//! ivshmem region), addressed by service name.
//!
//! ```no_run
//! use memloop::{Listener, Node, Stream};
//! let node = Node::join_default("server")?;
//! let listener = Listener::bind(&node, "echo")?;
//! let mut s = listener.accept()?;
//! let mut buf = [0u8; 64];
//! let n = s.recv(&mut buf)?;
//! s.send_all(&buf[..n])?;
//! # Ok::<(), memloop::Error>(())
//! ```
#![forbid(unsafe_code)]

pub mod channel;
pub mod datagram;
mod error;
pub mod identity;
pub mod ivshmem;
pub mod link;
mod listener;
pub mod liveness;
mod node;
pub mod region;
mod stream;
pub mod zerocopy;

pub use datagram::{DatagramSocket, Sent};
pub use error::Error;
pub use listener::Listener;
pub use memloop_registry::DEFAULT_RING_CAPACITY;
pub use node::{kick, vm_spin_from_env, Node};
pub use region::{CreateRegion, Region, RegionSpec};
pub use stream::{Stream, LIVENESS_SLICE, LIVENESS_SLICE_VM};

pub use memloop_registry as registry;
pub use memloop_ring as ring;
