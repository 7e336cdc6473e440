//! Why a connection took the plain-TCP path instead of a ring.
//!
//! Each reason has a stable code (stored in connection records; never reuse one) and one of the
//! header's global counters, so `memloop status` can say how often each reason occurred even
//! after the connections are gone.
//!
//! Errors keep their cause: [`FallbackReason::from_registry`] and [`FallbackReason::from_ring`]
//! turn an error on the way to a ring into the most specific reason (full, corrupt registry,
//! corrupt ring, channel kind, region layout, stale entry), so a caller's `map_err` is one line
//! and `memloop status` can tell a full region from a corrupt one.

use crate::error::RegistryError;
use crate::header::NCOUNTERS;
use crate::Registry;
use memloop_ring::RingError;

/// Why a connection the transparent layer saw stayed on TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// No co-resident listener is registered for the destination.
    NoListener,
    /// The peer's address is not owned by any member.
    NotMember,
    /// The address is owned by members in several network namespaces.
    Ambiguous,
    /// The server found no offer in time and published a decline marker.
    NoOffer,
    /// The server declined the offer.
    Declined,
    /// The client gave up waiting for the server to accept.
    Cancelled,
    /// The two sides see different 4-tuples (NAT, port mapping).
    TupleMismatch,
    /// No free channel slot or ring memory.
    RegionFull,
    /// Disabled by `MEMLOOP_DISABLE`.
    Disabled,
    /// A socket option or flag the ring path cannot emulate.
    Unsupported,
    /// The socket was shared across fork or exec in a way the ring path cannot follow.
    ForkOrExec,
    /// The peer process does not run the transparent layer here: no library, or a member of
    /// another region (a server that sees no member client announced or looking for a marker).
    PeerNotPreloaded,
    /// Any other error on the way to a ring.
    Error,
    /// A registry entry failed validation (or pointed outside the region).
    RegistryCorrupt,
    /// A ring failed validation at attach (header, indices, kind inconsistent with the channel).
    RingCorrupt,
    /// The channel is of a kind this side does not expect or cannot use.
    ChannelKind,
    /// The region's layout is not one this build understands (version, magic, size).
    Layout,
    /// An entry on the way (listener, peer, channel) went away or changed meanwhile.
    Stale,
    /// The region is paused, or being destroyed, by its operator.
    Paused,
}

/// Header counter bumped when [`Registry::record_conn`] finds the record table full.
pub const COUNTER_CONNS_DROPPED: usize = FallbackReason::ALL.len();

impl FallbackReason {
    /// Every reason, in code order.
    pub const ALL: [FallbackReason; 19] = [
        Self::NoListener,
        Self::NotMember,
        Self::Ambiguous,
        Self::NoOffer,
        Self::Declined,
        Self::Cancelled,
        Self::TupleMismatch,
        Self::RegionFull,
        Self::Disabled,
        Self::Unsupported,
        Self::ForkOrExec,
        Self::PeerNotPreloaded,
        Self::Error,
        Self::RegistryCorrupt,
        Self::RingCorrupt,
        Self::ChannelKind,
        Self::Layout,
        Self::Stale,
        Self::Paused,
    ];

    /// The stable code stored in the region (1-based; 0 is never a reason).
    pub fn as_code(self) -> u32 {
        Self::ALL.iter().position(|&r| r == self).unwrap_or(0) as u32 + 1
    }

    pub fn from_code(code: u32) -> Option<Self> {
        Self::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    /// The header counter of this reason (see [`Registry::counters`]).
    pub fn counter_index(self) -> usize {
        self.as_code() as usize - 1
    }

    /// A short identifier, for JSON keys and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoListener => "no_listener",
            Self::NotMember => "not_member",
            Self::Ambiguous => "ambiguous",
            Self::NoOffer => "no_offer",
            Self::Declined => "declined",
            Self::Cancelled => "cancelled",
            Self::TupleMismatch => "tuple_mismatch",
            Self::RegionFull => "region_full",
            Self::Disabled => "disabled",
            Self::Unsupported => "unsupported",
            Self::ForkOrExec => "fork_or_exec",
            Self::PeerNotPreloaded => "peer_not_preloaded",
            Self::Error => "error",
            Self::RegistryCorrupt => "registry_corrupt",
            Self::RingCorrupt => "ring_corrupt",
            Self::ChannelKind => "channel_kind",
            Self::Layout => "layout",
            Self::Stale => "stale",
            Self::Paused => "paused",
        }
    }

    /// The reason for a connection that stays on TCP because of `e`.
    pub fn from_registry(e: &RegistryError) -> Self {
        use RegistryError as E;
        match e {
            E::RegionFull { .. } => Self::RegionFull,
            E::Corrupt { .. } | E::Shm(_) => Self::RegistryCorrupt,
            E::Ring(r) => Self::from_ring(r),
            E::RingKindMismatch { .. } => Self::RingCorrupt,
            E::UnknownChannelKind { .. }
            | E::UnsupportedChannelKind(_)
            | E::ChannelKindMismatch { .. } => Self::ChannelKind,
            E::NotInitialised
            | E::BadMagic { .. }
            | E::BadVersion { .. }
            | E::SizeMismatch { .. } => Self::Layout,
            E::Stale | E::NotFound | E::WrongState { .. } => Self::Stale,
            E::AddrInUse | E::InvalidParams(_) | E::BadLinkName { .. } | E::LinkBusy { .. } => {
                Self::Error
            }
        }
    }

    /// The reason for a connection that stays on TCP because a ring refused to attach.
    pub fn from_ring(e: &RingError) -> Self {
        match e {
            RingError::Corrupt { .. } | RingError::BadHeader { .. } | RingError::Shm(_) => {
                Self::RingCorrupt
            }
            _ => Self::Error,
        }
    }

    fn phrase(self) -> &'static str {
        match self {
            Self::NoListener => "no co-resident listener",
            Self::NotMember => "peer address not owned by a member",
            Self::Ambiguous => "address owned by members in several namespaces",
            Self::NoOffer => "server found no offer in time",
            Self::Declined => "server declined",
            Self::Cancelled => "client timed out waiting for accept",
            Self::TupleMismatch => "addresses translated (NAT or port mapping)",
            Self::RegionFull => "no free channel or ring memory",
            Self::Disabled => "disabled by MEMLOOP_DISABLE",
            Self::Unsupported => "socket option or flag not emulated",
            Self::ForkOrExec => "shared across fork or exec",
            Self::PeerNotPreloaded => "peer not preloaded, or in another region",
            Self::Error => "error",
            Self::RegistryCorrupt => "corrupt registry entry",
            Self::RingCorrupt => "corrupt ring",
            Self::ChannelKind => "channel of an unexpected or unsupported kind",
            Self::Layout => "region layout not understood",
            Self::Stale => "listener, peer or channel went away meanwhile",
            Self::Paused => "region paused or being destroyed",
        }
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.phrase())
    }
}

/// The name of header counter `i`, if it has one (fallback reasons, dropped records).
pub fn counter_name(i: usize) -> Option<&'static str> {
    match FallbackReason::ALL.get(i) {
        Some(r) => Some(r.name()),
        None if i == COUNTER_CONNS_DROPPED => Some("conn_records_dropped"),
        None if i == COUNTER_RING_CONNS => Some("ring_connections"),
        None if i == COUNTER_RING_BYTES => Some("ring_bytes"),
        None if i == crate::tables::conns::COUNTER_TCP_BYTES => Some("tcp_bytes"),
        None if i == crate::switch::COUNTER_SEGMENTS_GIVEN_BACK => Some("segments_given_back"),
        None if i >= crate::switch::COUNTER_FULL_FIRST => crate::switch::FULL_NAMES
            .get(i - crate::switch::COUNTER_FULL_FIRST)
            .copied(),
        None => crate::switch::switch_counter_name(i),
    }
}

/// Header counter: transparent connections that took a ring (bumped by the accepting server).
pub const COUNTER_RING_CONNS: usize = COUNTER_CONNS_DROPPED + 1;
/// Header counter: bytes carried by the rings of channels already freed (both directions,
/// added once when the channel is freed, whoever frees it). `Registry::live_ring_bytes` adds
/// the channels still allocated.
pub const COUNTER_RING_BYTES: usize = COUNTER_CONNS_DROPPED + 2;

const _: () = assert!(COUNTER_RING_BYTES < NCOUNTERS);

impl Registry {
    /// Counts one connection that fell back to TCP for `reason` (a header counter).
    pub fn count_fallback(&self, reason: FallbackReason) {
        self.bump_counter(reason.counter_index());
    }

    /// The fallback counters by reason.
    pub fn fallback_counts(&self) -> Vec<(FallbackReason, u64)> {
        let c = self.counters();
        FallbackReason::ALL
            .iter()
            .map(|&r| (r, c.get(r.counter_index()).copied().unwrap_or(0)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_counters_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for r in FallbackReason::ALL {
            assert_eq!(FallbackReason::from_code(r.as_code()), Some(r));
            assert!(seen.insert(r.counter_index()));
            assert_eq!(counter_name(r.counter_index()), Some(r.name()));
            assert!(!r.to_string().is_empty());
        }
        assert!(!seen.contains(&COUNTER_CONNS_DROPPED));
        assert_eq!(FallbackReason::from_code(0), None);
        assert_eq!(FallbackReason::from_code(20), None);
        assert_eq!(counter_name(COUNTER_RING_CONNS), Some("ring_connections"));
        assert_eq!(counter_name(COUNTER_RING_BYTES), Some("ring_bytes"));
        assert_eq!(counter_name(NCOUNTERS), None);
    }
}

#[cfg(test)]
mod cause_tests {
    use super::*;
    use crate::ChannelKind;

    #[test]
    fn errors_map_to_their_cause() {
        let corrupt = RegistryError::corrupt("channel rings", "overlap");
        let ring = RingError::Corrupt {
            what: "tail",
            detail: "moved back".into(),
        };
        let cases = [
            (
                RegistryError::RegionFull { what: "channels" },
                FallbackReason::RegionFull,
            ),
            (corrupt, FallbackReason::RegistryCorrupt),
            (RegistryError::Ring(ring), FallbackReason::RingCorrupt),
            (
                RegistryError::UnknownChannelKind { code: 9 },
                FallbackReason::ChannelKind,
            ),
            (
                RegistryError::ChannelKindMismatch {
                    expected: ChannelKind::StreamPair,
                    found: ChannelKind::DatagramPair,
                },
                FallbackReason::ChannelKind,
            ),
            (
                RegistryError::BadVersion {
                    found: 2,
                    expected: 3,
                },
                FallbackReason::Layout,
            ),
            (RegistryError::Stale, FallbackReason::Stale),
            (RegistryError::NotFound, FallbackReason::Stale),
            (RegistryError::AddrInUse, FallbackReason::Error),
        ];
        for (e, want) in cases {
            assert_eq!(FallbackReason::from_registry(&e), want, "{e}");
        }
        assert_eq!(
            FallbackReason::from_ring(&RingError::Closed),
            FallbackReason::Error
        );
    }

    #[test]
    fn existing_reason_names_and_codes_are_stable() {
        let names: Vec<_> = FallbackReason::ALL[..13].iter().map(|r| r.name()).collect();
        assert_eq!(
            names,
            [
                "no_listener",
                "not_member",
                "ambiguous",
                "no_offer",
                "declined",
                "cancelled",
                "tuple_mismatch",
                "region_full",
                "disabled",
                "unsupported",
                "fork_or_exec",
                "peer_not_preloaded",
                "error"
            ]
        );
        assert_eq!(FallbackReason::Error.as_code(), 13);
    }
}
