//! Zero-copy descriptors: 32 bytes naming bytes of a buffer pool by (pool, offset, len), not by
//! pointer.
//!
//! A pool id plus offset means the same thing in every member of a region (Fido's pseudo
//! global address), so a descriptor can be forwarded through a pipeline without copying data.
//! Encoding (little endian): pool slot `u32` @0, flags `u32` @4, offset in the pool's data
//! `u64` @8, len `u32` @16, the pool owner's member tag `u32` @20, the pool's generation `u32`
//! @24, a word for the application `u32` @28. Flag bits outside [`Descriptor::FLAGS_MASK`] are
//! rejected by [`Descriptor::decode`]; [`FLAG_RELEASED`] is the ring's own (see `held.rs`).

use crate::RingError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Descriptor {
    pub pool: u32,
    pub flags: u32,
    pub offset: u64,
    pub len: u32,
    /// The pool owner's member tag: a descriptor naming a pool under another owner is forged.
    pub owner: u32,
    /// The pool's generation: a descriptor of a pool since freed (and perhaps reused) is stale.
    pub pool_gen: u32,
    /// The application's own word (a message type, a sequence number).
    pub user: u32,
}

/// Set in place by a descriptor ring's reader when it lets go of a slot it holds: the slot no
/// longer references its buffer, though the ring's head may not have passed it yet.
pub const FLAG_RELEASED: u32 = 1 << 16;

impl Descriptor {
    /// Encoded size: one slot of a descriptor ring.
    pub const SIZE: usize = 32;
    /// Flag bits available to protocols above (the upper 16 bits are the ring's).
    pub const FLAGS_MASK: u32 = 0xffff;
    /// More descriptors of the same message follow (scatter-gather).
    pub const FLAG_MORE: u32 = 1;
    /// Offset of the flags word in an encoded descriptor.
    pub const FLAGS_AT: u64 = 4;

    pub fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&self.pool.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b[20..24].copy_from_slice(&self.owner.to_le_bytes());
        b[24..28].copy_from_slice(&self.pool_gen.to_le_bytes());
        b[28..32].copy_from_slice(&self.user.to_le_bytes());
        b
    }

    /// Decodes a descriptor read from shared memory; rejects flag bits outside the mask.
    pub fn decode(b: &[u8; 32]) -> Result<Self, RingError> {
        let d = Self::decode_any(b);
        if d.flags & !Self::FLAGS_MASK != 0 {
            let detail = format!("flags {:#x}", d.flags);
            return Err(RingError::corrupt("descriptor reserved bits set", detail));
        }
        Ok(d)
    }

    /// The fields as they are, ring bits included (a scan of what a ring holds).
    pub(crate) fn decode_any(b: &[u8; 32]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| (u32_at(o) as u64) | ((u32_at(o + 4) as u64) << 32);
        Descriptor {
            pool: u32_at(0),
            flags: u32_at(4),
            offset: u64_at(8),
            len: u32_at(16),
            owner: u32_at(20),
            pool_gen: u32_at(24),
            user: u32_at(28),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_reserved_bits() {
        let d = Descriptor {
            pool: 7,
            flags: Descriptor::FLAG_MORE,
            offset: 1 << 40,
            len: 4096,
            owner: 0x12_3456,
            pool_gen: u32::MAX,
            user: 9,
        };
        assert_eq!(Descriptor::decode(&d.encode()).unwrap(), d);
        for flags in [1 << 20, FLAG_RELEASED] {
            let bad = Descriptor { flags, ..d };
            assert!(matches!(
                Descriptor::decode(&bad.encode()),
                Err(RingError::Corrupt { .. })
            ));
        }
    }
}
