//! Raw shared memory for memloop.
//!
//! This is the only crate in the workspace that contains `unsafe`. It offers:
//! - [`Mapping`]: a file (in /dev/shm, on hugetlbfs, or a device such as an ivshmem BAR) mapped
//!   shared and read-write;
//! - [`ShmSlice`]: a bounds-checked view into a mapping. Every access checks offset, length and
//!   alignment, so code above this crate can follow offsets it read from a peer without risk of
//!   touching memory outside the region;
//! - [`PoolMapping`]: a zero-copy buffer pool mapped on its own, read-only for readers, with
//!   one exclusive [`BufMut`] per buffer for its owner;
//! - [`futex`]: wait/wake on a 32-bit word in shared memory (same kernel only: an optimisation);
//! - [`sched`]: scheduler hints for waiters (our CPU, runnable threads vs CPUs);
//! - [`forkgate`]: lets a process with no state skip its fork handlers;
//! - [`fault_probe`]: a write into a read-only view, for tests that show the MMU refuses it;
//! - [`member_lock`]: a member's proof of life without a thread (an OFD lock on the region file);
//! - [`tun`]: a Linux TUN device, the kernel's end of a point-to-point link whose frames go
//!   through shared memory (with [`ShmSlice::read_from_fd`] / [`ShmSlice::write_to_fd`], the
//!   kernel copies them straight between the device and the region);
//! - [`sync`]: the atomics facade that swaps std for loom under `cfg(loom)`.
//!
//! Under `cfg(loom)` the mapping is replaced by a heap model ([`ShmSlice::new_model`]) so that
//! the algorithms built on it can be model-checked.

#[cfg(not(loom))]
pub mod fault_probe;
pub mod forkgate;
pub mod futex;
#[cfg(not(loom))]
mod mapping;
#[cfg(not(loom))]
pub mod member_lock;
#[cfg(all(target_os = "linux", not(loom)))]
pub mod mountns;
#[cfg(all(target_os = "linux", not(loom)))]
pub mod nbd;
#[cfg(not(loom))]
mod pool_map;
pub mod sched;
pub mod sync;
#[cfg(all(target_os = "linux", not(loom)))]
pub mod tun;
mod view;

#[cfg(not(loom))]
pub use mapping::{Backend, CreateOptions, Mapping, MappingError};
#[cfg(not(loom))]
pub use pool_map::{BufMut, PoolMapping};
pub use view::{CommitError, NoRoom, OutOfBounds, ShmSlice, ShmU32, ShmU64};

/// Cache line size used to separate producer and consumer state.
pub const CACHE_LINE: usize = 64;
