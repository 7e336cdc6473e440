//! The one error type of the crate: what went wrong is either the peer (corrupt shared state,
//! closed), the caller (too large, bad configuration) or the view (out of bounds).

use memloop_shm::OutOfBounds;

#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// Something the peer wrote (an index, a length, a flag word) is impossible.
    #[error("corrupt ring: {what}: {detail}")]
    Corrupt { what: &'static str, detail: String },
    /// A shared-memory access was refused by the bounds-checked view.
    #[error(transparent)]
    Shm(#[from] OutOfBounds),
    /// The static header does not describe a ring of the expected kind that fits the view.
    #[error("bad ring header: {what}: {detail}")]
    BadHeader { what: &'static str, detail: String },
    /// A record longer than the ring can ever hold (records: `capacity/2 - 8`).
    #[error(
        "record of {len} bytes is too large: at most {max} bytes (capacity/2 - 8) fit this ring"
    )]
    TooLarge { len: u64, max: u64 },
    /// A slot ring was given a buffer that is not exactly one (or a whole number of) slot(s).
    #[error("slot ring: buffer of {len} bytes does not match the slot size of {slot_size} bytes")]
    SlotSize { len: u64, slot_size: u32 },
    /// A tail to carry in front of a stream ring's head is larger than the free space there
    /// (`leave`: the caller checks `carry_room` first).
    #[error("a carried tail of {len} bytes does not fit the {room} bytes free before the head")]
    NoRoom { len: u64, room: u64 },
    /// The other side closed: for producers the reader is gone (like `EPIPE`).
    #[error("ring closed by the peer")]
    Closed,
    /// `init_ring` was asked for an impossible geometry.
    #[error("invalid ring configuration: {0}")]
    Config(String),
}

impl RingError {
    pub(crate) fn corrupt(what: &'static str, detail: String) -> Self {
        tracing::warn!(what, %detail, "corrupt shared ring");
        RingError::Corrupt { what, detail }
    }
    pub(crate) fn bad_header(what: &'static str, detail: String) -> Self {
        RingError::BadHeader { what, detail }
    }
}
