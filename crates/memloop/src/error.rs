//! The native API's error type.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no memloop region at {0} (create one with `memloop region create`)")]
    NoRegion(PathBuf),
    #[error("{0}")]
    NoDevice(String),
    #[error("region mapping: {0}")]
    Mapping(#[from] memloop_shm::MappingError),
    #[error("region registry: {0}")]
    Registry(#[from] memloop_registry::RegistryError),
    #[error("shared memory access: {0}")]
    Shm(#[from] memloop_shm::OutOfBounds),
    #[error("channel ring: {0}")]
    Ring(#[from] memloop_ring::RingError),
    #[error("no memloop service named {0:?}")]
    NoService(String),
    #[error("service {0:?} is already bound")]
    AddrInUse(String),
    #[error("the peer did not accept the channel in time")]
    ConnectTimeout,
    #[error("the peer process is gone (it died or its region membership was reclaimed)")]
    PeerDead,
    #[error("the operation would block")]
    WouldBlock,
    #[error("timed out")]
    TimedOut,
    #[error("the stream was shut down for writing")]
    WriteShutdown,
    #[error("the peer closed its reading side")]
    BrokenPipe,
    #[error("a zero-copy descriptor that names no buffer it may: {0}")]
    Forged(&'static str),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// The reason a transparent connection that met this error stays on TCP: the registry's
    /// or the ring's own cause where there is one.
    pub fn fallback_reason(&self) -> memloop_registry::FallbackReason {
        use memloop_registry::FallbackReason;
        match self {
            Error::Registry(e) => FallbackReason::from_registry(e),
            Error::Ring(e) => FallbackReason::from_ring(e),
            Error::Shm(_) => FallbackReason::RegistryCorrupt,
            _ => FallbackReason::Error,
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match &e {
            Error::WouldBlock => io::ErrorKind::WouldBlock,
            Error::TimedOut | Error::ConnectTimeout => io::ErrorKind::TimedOut,
            Error::PeerDead => io::ErrorKind::ConnectionReset,
            Error::BrokenPipe | Error::WriteShutdown => io::ErrorKind::BrokenPipe,
            Error::NoService(_) | Error::NoRegion(_) => io::ErrorKind::ConnectionRefused,
            Error::AddrInUse(_) => io::ErrorKind::AddrInUse,
            Error::Io(inner) => inner.kind(),
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}
