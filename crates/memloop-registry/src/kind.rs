//! Channel kinds: what a channel's two rings are, recorded in its slot when it is offered and
//! checked when either side attaches, so a peer built for another kind (or a corrupt slot) is
//! refused with a typed error instead of being read as the wrong ring type.

use crate::error::RegistryError;
use memloop_ring::RingKind;

/// What a channel carries. The codes are stored in the region: never reuse one.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    /// Two byte-stream rings, client→server and server→client (TCP, native streams).
    StreamPair = 1,
    /// Two record rings (datagrams): one sender socket and one receiver socket, replies on
    /// the same pair.
    DatagramPair = 2,
    /// Two descriptor rings of 32-byte slots (zero-copy), one each way. A reader holds the
    /// slots it took until it releases them (`memloop_ring::held`): a release is the
    /// completion, so no completion ring is needed — and a buffer forwarded through a
    /// pipeline returns to its owner when the *last* holder releases it, whom the owner may
    /// share no channel with.
    DescriptorPair = 3,
    /// Two record rings carrying network frames (`memloop link`): a virtio-net header and an
    /// IP packet per record. A kind of its own so that a UDP socket never takes a link's
    /// offer, nor a link a datagram socket's.
    LinkPair = 4,
}

impl ChannelKind {
    pub const ALL: [ChannelKind; 4] = [
        Self::StreamPair,
        Self::DatagramPair,
        Self::DescriptorPair,
        Self::LinkPair,
    ];

    pub fn code(self) -> u16 {
        self as u16
    }

    /// The kind stored as `code`; `UnknownChannelKind` for anything else (0 included: only
    /// decline markers, which have no rings, carry 0).
    pub fn from_code(code: u32) -> Result<Self, RegistryError> {
        Self::ALL
            .into_iter()
            .find(|k| k.code() as u32 == code)
            .ok_or(RegistryError::UnknownChannelKind { code })
    }

    /// The ring kinds of the (c2s, s2c) rings.
    pub fn ring_kinds(self) -> (RingKind, RingKind) {
        match self {
            Self::StreamPair => (RingKind::Stream, RingKind::Stream),
            Self::DatagramPair | Self::LinkPair => (RingKind::Record, RingKind::Record),
            Self::DescriptorPair => (RingKind::Slots, RingKind::Slots),
        }
    }

    /// Whether this build can create and attach channels of this kind.
    pub fn supported(self) -> bool {
        matches!(
            self,
            Self::StreamPair | Self::DatagramPair | Self::DescriptorPair | Self::LinkPair
        )
    }

    /// `Ok(self)` if supported, else `UnsupportedChannelKind`.
    pub(crate) fn require_supported(self) -> Result<Self, RegistryError> {
        match self.supported() {
            true => Ok(self),
            false => Err(RegistryError::UnsupportedChannelKind(self)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::StreamPair => "stream pair",
            Self::DatagramPair => "datagram pair",
            Self::DescriptorPair => "descriptor pair",
            Self::LinkPair => "link pair",
        }
    }
}

impl std::fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_typed_errors() {
        for k in ChannelKind::ALL {
            assert_eq!(ChannelKind::from_code(k.code() as u32).unwrap(), k);
        }
        for code in [0, 5, 0xffff, u32::MAX] {
            assert!(matches!(
                ChannelKind::from_code(code),
                Err(RegistryError::UnknownChannelKind { code: c }) if c == code
            ));
        }
    }

    #[test]
    fn every_kind_is_supported_today() {
        for k in ChannelKind::ALL {
            assert!(k.require_supported().is_ok(), "{k}");
        }
        assert_eq!(
            ChannelKind::StreamPair.ring_kinds(),
            (RingKind::Stream, RingKind::Stream)
        );
        assert_eq!(
            ChannelKind::DatagramPair.ring_kinds(),
            (RingKind::Record, RingKind::Record)
        );
    }
}
