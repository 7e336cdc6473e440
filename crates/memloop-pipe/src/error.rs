//! Errors of the pipe service and its clients.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum PipeError {
    /// A descriptor the service cannot move bytes from or to (a directory, a listening
    /// socket, an fd opened for the wrong direction…).
    #[error("{which} descriptor: {why}")]
    BadFd { which: &'static str, why: String },
    /// A length the service refuses (zero is not one: it means "until end of input").
    #[error("bad length {0}")]
    BadLength(u64),
    /// A peer sent something that is not a message of this protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The service refused the client (a version it does not speak, too many clients…).
    #[error("refused by the pipe service: {0}")]
    Refused(String),
    /// The transfer was cancelled (by its client, or because its client went away).
    #[error("transfer cancelled")]
    Cancelled,
    /// No pipe service listens at the socket.
    #[error("no pipe service at {path}: {source} (start one with `memloop pipe serve`)")]
    NoService { path: String, source: io::Error },
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<rustix::io::Errno> for PipeError {
    fn from(e: rustix::io::Errno) -> Self {
        PipeError::Io(e.into())
    }
}

impl PipeError {
    /// The `errno` a C caller sees for this error.
    pub fn errno(&self) -> i32 {
        match self {
            PipeError::BadFd { .. } => rustix::io::Errno::BADF.raw_os_error(),
            PipeError::BadLength(_) => rustix::io::Errno::INVAL.raw_os_error(),
            PipeError::Protocol(_) => rustix::io::Errno::PROTO.raw_os_error(),
            PipeError::Refused(_) => rustix::io::Errno::CONNREFUSED.raw_os_error(),
            PipeError::Cancelled => rustix::io::Errno::CANCELED.raw_os_error(),
            PipeError::NoService { .. } => rustix::io::Errno::NOENT.raw_os_error(),
            PipeError::Io(e) => e
                .raw_os_error()
                .unwrap_or(rustix::io::Errno::IO.raw_os_error()),
        }
    }
}
