//! Errors of the block server and its clients, and the errno each gives the kernel.

use crate::proto::{errno, Invalid};
use std::io;

#[derive(Debug, thiserror::Error)]
pub enum BlkError {
    /// The export completed the request with this errno (`EIO`, `EROFS`, `EINVAL`, …).
    #[error("the export answered: {}", io::Error::from_raw_os_error(*.0))]
    Status(i32),
    /// A request the client refuses to send (the server would refuse it too).
    #[error("invalid request: {0}")]
    Invalid(#[from] Invalid),
    /// The storage server is gone (died, or stopped exporting): every request in flight
    /// completes with `EIO`, and new ones fail at once.
    #[error("the storage server is gone")]
    Disconnected,
    /// As many requests in flight as the session's queue depth.
    #[error("queue full: {0} requests in flight")]
    QueueFull(u32),
    #[error("tag {0} is already in flight")]
    DuplicateTag(u64),
    #[error("timed out")]
    TimedOut,
    /// The server would not attach us (errno: `ENOSPC` for no room for the session's
    /// buffers, `EPROTO` for a hello it did not understand…).
    #[error("the server refused the attachment: {}", io::Error::from_raw_os_error(*.0))]
    Refused(i32),
    /// The peer sent something that is not this protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// An export name memloop cannot carry (1..=60 bytes).
    #[error("export name {0:?}: must be 1..=60 bytes")]
    BadName(String),
    #[error(transparent)]
    Memloop(#[from] memloop::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl BlkError {
    /// The errno the kernel (a FUSE reply, a ublk completion) should see.
    pub fn errno(&self) -> i32 {
        match self {
            BlkError::Status(e) => *e,
            BlkError::Invalid(_) | BlkError::DuplicateTag(_) | BlkError::BadName(_) => {
                errno::EINVAL
            }
            BlkError::Memloop(memloop::Error::NoService(_)) => errno::ENOENT,
            BlkError::Disconnected | BlkError::Memloop(_) => errno::EIO,
            BlkError::QueueFull(_) => errno::EAGAIN,
            BlkError::TimedOut => errno::ETIMEDOUT,
            BlkError::Refused(e) => *e,
            BlkError::Protocol(_) => errno::EPROTO,
            BlkError::Io(e) => e.raw_os_error().unwrap_or(errno::EIO),
        }
    }
}

impl From<rustix::io::Errno> for BlkError {
    fn from(e: rustix::io::Errno) -> Self {
        BlkError::Io(e.into())
    }
}
