//! MMBlk (Fido's block device over shared memory): a storage domain exports a file or a block
//! device as the memloop service `blk/NAME` ([`BlkServer`]); a client domain attaches
//! ([`BlkClient`]) and submits tagged READ / WRITE / FLUSH / DISCARD requests, several in
//! flight, completed in any order.
//!
//! The data path is memloop's zero-copy channels (`memloop::zerocopy`):
//!
//! - **write**: the client writes the request header and the payload into a buffer of its own
//!   pool ([`WriteBuf`]) and sends a descriptor; the server reads the payload in place through
//!   its read-only view of the client's pool and `pwritev`s it to the backing file from there.
//!   No byte of the payload is copied between the domains: the one copy is the kernel's, pool
//!   → page cache.
//! - **read**: the server `pread`s into a buffer of its own pool, after the completion header,
//!   and sends a descriptor; the client reads the data in place ([`Completion::data`]) and
//!   releases the buffer by dropping the completion. One copy, the kernel's: page cache →
//!   pool.
//!
//! The client's kernel sees an attachment through [`fuse`]: a FUSE file (served on
//! `/dev/fuse` directly, each request read into a [`WriteBuf`]) under a loop device; `memloop
//! blk export|attach|detach` drive both ends.
//!
//! Choices:
//!
//! - **Two descriptor channels per attachment** (requests; completions), so that submitting
//!   and completing can run on two threads ([`BlkClient::split`]): a `ZcPort` sends and
//!   receives through `&mut self`, so one port would force a single thread polling both
//!   ways. The second channel names its session by a token from the first's `Info`.
//! - **Pools**: each side has a pool of `queue depth` buffers of `64 + max I/O` bytes (the
//!   client's also `headroom` more, where the FUSE frontend puts FUSE's own headers) and a
//!   pool of 64-byte buffers for messages without data. Memory is reserved when a client
//!   attaches: `2 × queue depth × max I/O` per client (64 MiB each side with the defaults, 1
//!   MiB × 64; a client may ask for less). A read's data held by the client counts against
//!   the queue depth ([`Submitter::outstanding`]), so the server never waits for a buffer.
//! - **FUA** is `pwritev2(RWF_DSYNC)`: durable before the completion, per write, without
//!   syncing the rest of the file as an `fdatasync` would, and without making every write
//!   synchronous as opening the file `O_DSYNC` would; where the kernel refuses the flag, the
//!   write is followed by `fdatasync`. **FLUSH** is `fdatasync`. **DISCARD** is
//!   `fallocate(PUNCH_HOLE | KEEP_SIZE)` on a regular file and a block device alike (on a
//!   device the kernel issues a write-zeroes that may unmap — not `BLKDISCARD`, whose data
//!   afterwards is undefined); it reads back as zeros, and a file system or device that
//!   cannot answers `EOPNOTSUPP`. (Block-device backing is untested here: no loop device
//!   in the tests.)
//! - **Validation**: every header is validated on receipt ([`proto`]), by the server (bad
//!   requests get an `EINVAL` completion and are counted, [`ServerStats::refused`]) and by
//!   the client (a completion that does not fit its request fails it with `EIO`); the client
//!   checks its own requests before sending them.
//! - **Faults**: a server that dies fails the client's requests with `EIO` within a liveness
//!   slice (200 ms); a client that dies is dropped by its session, and memloop reclaims its
//!   channels and the buffers either side held.
//! - **Threads**: a session's thread receives in batches and, by default, serves in arrival
//!   order; [`ExportOptions::workers`] gives a session I/O threads for slow storage.
#![forbid(unsafe_code)]

mod attach;
pub mod client;
pub mod error;
pub mod fuse;
pub mod nbd;
pub mod proto;
pub mod server;

pub use client::{
    BlkClient, ClientOptions, ClientStats, Completer, Completion, ReadData, SessionWatch,
    Submitter, WriteBuf,
};
pub use error::BlkError;
pub use proto::{ExportInfo, Op};
pub use server::{BlkServer, ExportOptions, ServerStats};
