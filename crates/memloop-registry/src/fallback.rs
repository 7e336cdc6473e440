//! Why a connection took the plain-TCP path instead of a ring.
//!
//! Each reason has a stable code (stored in connection records; never reuse one) and one of the
//! header's global counters, so `memloop status` can say how often each reason occurred even
//! after the connections are gone.

use crate::header::NCOUNTERS;
use crate::Registry;

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
    /// The peer process does not run the transparent layer.
    PeerNotPreloaded,
    /// Any other error on the way to a ring.
    Error,
}

/// Header counter bumped when [`Registry::record_conn`] finds the record table full.
pub const COUNTER_CONNS_DROPPED: usize = FallbackReason::ALL.len();

impl FallbackReason {
    /// Every reason, in code order.
    pub const ALL: [FallbackReason; 13] = [
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
            Self::PeerNotPreloaded => "peer not preloaded",
            Self::Error => "error",
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
        None => None,
    }
}

/// Header counter: transparent connections that took a ring (bumped by the accepting server).
pub const COUNTER_RING_CONNS: usize = COUNTER_CONNS_DROPPED + 1;
/// Header counter: bytes that crossed transparent rings (each side adds what it sent, at close).
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
        assert_eq!(FallbackReason::from_code(14), None);
        assert_eq!(counter_name(COUNTER_RING_CONNS), Some("ring_connections"));
        assert_eq!(counter_name(COUNTER_RING_BYTES), Some("ring_bytes"));
        assert_eq!(counter_name(NCOUNTERS), None);
    }
}
