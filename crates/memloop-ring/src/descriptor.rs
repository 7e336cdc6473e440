//! Zero-copy descriptors: 32 bytes naming a buffer by (pool, offset, len), not by pointer.
//!
//! A pool id plus offset means the same thing in every member of a region (Fido's pseudo
//! global address), so a descriptor can be forwarded through a pipeline without copying data.
//! Encoding (little endian): pool `u32` @0, flags `u32` @4, offset `u64` @8, len `u32` @16,
//! reserved `u32` @20 (zero), cookie `u64` @24. Flag bits outside [`Descriptor::FLAGS_MASK`] and
//! a non-zero reserved word are rejected by [`Descriptor::decode`].

use crate::RingError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Descriptor {
    pub pool: u32,
    pub flags: u32,
    pub offset: u64,
    pub len: u32,
    pub cookie: u64,
}

impl Descriptor {
    /// Encoded size: one slot of a descriptor ring.
    pub const SIZE: usize = 32;
    /// Flag bits available to protocols above (the upper 16 bits are reserved).
    pub const FLAGS_MASK: u32 = 0xffff;
    /// Suggested flag: more descriptors of the same message follow (scatter-gather).
    pub const FLAG_MORE: u32 = 1;

    pub fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&self.pool.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.cookie.to_le_bytes());
        b
    }

    /// Decodes a descriptor read from shared memory; rejects reserved bits.
    pub fn decode(b: &[u8; 32]) -> Result<Self, RingError> {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| (u32_at(o) as u64) | ((u32_at(o + 4) as u64) << 32);
        let d = Descriptor {
            pool: u32_at(0),
            flags: u32_at(4),
            offset: u64_at(8),
            len: u32_at(16),
            cookie: u64_at(24),
        };
        let reserved = u32_at(20);
        if d.flags & !Self::FLAGS_MASK != 0 || reserved != 0 {
            let detail = format!("flags {:#x}, reserved word {reserved:#x}", d.flags);
            return Err(RingError::corrupt("descriptor reserved bits set", detail));
        }
        Ok(d)
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
            cookie: u64::MAX,
        };
        assert_eq!(Descriptor::decode(&d.encode()).unwrap(), d);
        let mut b = d.encode();
        b[22] = 1;
        assert!(matches!(
            Descriptor::decode(&b),
            Err(RingError::Corrupt { .. })
        ));
        let bad = Descriptor {
            flags: 1 << 20,
            ..d
        };
        assert!(matches!(
            Descriptor::decode(&bad.encode()),
            Err(RingError::Corrupt { .. })
        ));
    }
}
