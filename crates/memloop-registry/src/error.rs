//! The one error type of the registry. Everything read from the region is untrusted, so most
//! read paths can fail with [`RegistryError::Corrupt`] instead of panicking.

use crate::kind::ChannelKind;
use memloop_shm::OutOfBounds;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("region is not initialised (magic is zero)")]
    NotInitialised,
    #[error("region has a bad magic number {found:#x}")]
    BadMagic { found: u64 },
    #[error(
        "region layout version {found}, this build understands {expected}: recreate the region \
         (`memloop region destroy`, then `memloop region create`)"
    )]
    BadVersion { found: u32, expected: u32 },
    #[error("region header says {header} bytes but the mapping has {actual}")]
    SizeMismatch { header: u64, actual: u64 },
    #[error("corrupt registry: {what}: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("region full: no free {what}")]
    RegionFull { what: &'static str },
    #[error("endpoint already registered")]
    AddrInUse,
    #[error("not found")]
    NotFound,
    #[error("stale id: the entry was freed or reused")]
    Stale,
    #[error("wrong state: expected {expected}, found {found}")]
    WrongState {
        expected: &'static str,
        found: &'static str,
    },
    /// A channel slot records a kind code this build does not know (a newer peer, or garbage).
    #[error("channel has unknown kind code {code}")]
    UnknownChannelKind { code: u32 },
    /// A known kind this build cannot create or use yet.
    #[error("channel kind {0} is not supported yet")]
    UnsupportedChannelKind(ChannelKind),
    /// The channel is of another kind than the caller attaches as.
    #[error("channel is a {found} channel, expected a {expected} channel")]
    ChannelKindMismatch {
        expected: ChannelKind,
        found: ChannelKind,
    },
    /// A ring of the channel has a header of another ring kind than its channel kind implies.
    #[error(
        "{ring} ring of a {channel} channel has ring kind code {found}, expected {expected:?}"
    )]
    RingKindMismatch {
        channel: ChannelKind,
        ring: &'static str,
        expected: memloop_ring::RingKind,
        found: u32,
    },
    #[error(transparent)]
    Shm(#[from] OutOfBounds),
    #[error(transparent)]
    Ring(#[from] memloop_ring::RingError),
    #[error("invalid parameters: {0}")]
    InvalidParams(String),
    /// A link name that is empty or longer than [`crate::MAX_LINK_NAME`] bytes.
    #[error("link name {name:?} has {len} bytes: a link name has 1 to {max} bytes of UTF-8")]
    BadLinkName {
        name: String,
        len: usize,
        max: usize,
    },
    /// Both sides of the link are held by live members.
    #[error("link {name:?} is busy: both of its sides are held by live members")]
    LinkBusy { name: String },
}

impl RegistryError {
    pub(crate) fn corrupt(what: &'static str, detail: impl Into<String>) -> Self {
        RegistryError::Corrupt {
            what,
            detail: detail.into(),
        }
    }
    pub(crate) fn wrong(expected: &'static str, found: &'static str) -> Self {
        RegistryError::WrongState { expected, found }
    }
}
