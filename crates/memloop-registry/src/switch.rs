//! Live path switching in the registry: why a connection moved between its ring and its TCP
//! socket (each reason with a header counter), and the channel's switch word, through which a
//! side (or `memloop demote`) asks both sides to leave the ring.
//!
//! The switch word is one u64 of the channel slot ([`SwitchWord`]):
//! - bit 0 `REQUESTED`: a leave was asked for; set once, by CAS, by either side or an operator;
//! - bits 1, 2: the client's / the server's side has finished its move to TCP (discarded the
//!   peer's doorbells, re-sent what the peer never consumed), so every process holding that side
//!   may read TCP from now on;
//! - bits 8..16: the code of the first request's [`SwitchReason`];
//! - promotion (TCP → ring, both sides on TCP): bit 3 `PROMOTE` asks for it; bits 4, 5: the
//!   client's / server's side is *ready* (its stale ring bytes dropped, its leave record
//!   reset); bits 6, 7: the side *stopped* writing TCP (its TCP byte count is published in its
//!   `tcp_stop` word) and writes to its ring from then on. Once both stopped the word is
//!   zeroed by either side: the connection is an ordinary ring connection again.
//! - bit 16 `PINNED`: the connection's socket reached a program memloop cannot see (an exec
//!   into an image without the library, `posix_spawn`, an fd passed and never claimed). That
//!   program may write on the socket at any time, and a byte it writes after a promotion's
//!   stop would be taken for a doorbell: no promotion is asked or followed, for good.
//! - bits 17, 18 `KERNEL_COUNTS`: the client's / server's socket was taken by a process its
//!   holders were not told of (`pidfd_getfd`): their own counts of the TCP phase miss that
//!   process's bytes, so each holder of that side takes its counts from the kernel's stream
//!   positions before it gets ready for a promotion. Cleared with the rest of the word when
//!   a promotion completes (one process holds the side by then).
//! - bits 24..40: processes holding a side that its other holders were not told of (each
//!   took the socket with `pidfd_getfd`). While any is counted no side stops writing TCP: a
//!   stop is a count of the bytes *this* process sent, and the unseen process may write after
//!   it (its bytes would then read as doorbells). A grab is counted only while no side has
//!   stopped yet, so a promotion under way can always be called off then.
//!
//! The word is zeroed with the rest of the slot before an offer is published and is only ever
//! OR-ed into afterwards, so a late write after the slot was freed can only ask the slot's
//! next occupant to leave its ring — a cost, never a loss (the leave protocol is safe at any
//! moment).

use crate::error::RegistryError;
use crate::fallback::COUNTER_RING_BYTES;
use crate::header::NCOUNTERS;
use crate::key::ChannelId;
use crate::tables::channels::Side;
use crate::Registry;
use memloop_shm::sync::Ordering::{AcqRel, Acquire};
use memloop_shm::ShmU64;

/// Why a connection left its ring for TCP (or came back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SwitchReason {
    /// Its fd was sent to another process with `SCM_RIGHTS`.
    FdPassed,
    /// `exec` with the connection open and not close-on-exec.
    Exec,
    /// A process was started with the connection inherited by a path that runs no fork
    /// handlers (`posix_spawn`, `clone`).
    Spawn,
    /// An operation the ring does not carry (`MSG_OOB`).
    Oob,
    /// The peer asked (any reason of its own, seen from this side).
    Peer,
    /// `memloop demote`.
    Operator,
    /// The region is going away, or its member left it.
    Region,
    /// TCP → ring: the connection was promoted back onto a ring.
    Promoted,
    /// TCP → ring: a connection that fell back to TCP at connect (for a transient reason)
    /// came to a ring later (the "late ring").
    Late,
    /// Another process took the connection's socket with `pidfd_getfd` (a pure dup into the
    /// caller: the holders are not told), so both use it, on TCP.
    Pidfd,
}

/// Header counter of the first switch reason (the ones before are fallback reasons and the
/// ring totals).
pub const COUNTER_SWITCH_FIRST: usize = COUNTER_RING_BYTES + 1;

const _: () = assert!(COUNTER_SWITCH_FIRST + FIRST_SWITCH_REASONS <= NCOUNTERS);

impl SwitchReason {
    pub const ALL: [SwitchReason; 10] = [
        Self::FdPassed,
        Self::Exec,
        Self::Spawn,
        Self::Oob,
        Self::Peer,
        Self::Operator,
        Self::Region,
        Self::Promoted,
        Self::Late,
        Self::Pidfd,
    ];

    /// The stable code kept in the switch word (1-based; 0 is "no reason").
    pub fn as_code(self) -> u8 {
        Self::ALL.iter().position(|&r| r == self).unwrap_or(0) as u8 + 1
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    pub fn counter_index(self) -> usize {
        match self {
            // Added after the TCP byte counter: the counters before it keep their places.
            Self::Late => COUNTER_LATE,
            Self::Pidfd => COUNTER_PIDFD,
            _ => COUNTER_SWITCH_FIRST + self.as_code() as usize - 1,
        }
    }

    /// A short identifier, for JSON keys and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::FdPassed => "fd_passed",
            Self::Exec => "exec",
            Self::Spawn => "spawn",
            Self::Oob => "oob",
            Self::Peer => "peer",
            Self::Operator => "operator",
            Self::Region => "region",
            Self::Promoted => "promoted",
            Self::Late => "late",
            Self::Pidfd => "pidfd",
        }
    }
}

impl std::fmt::Display for SwitchReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Switch reasons with a counter right after [`COUNTER_SWITCH_FIRST`] (the first eight).
pub const FIRST_SWITCH_REASONS: usize = 8;

/// Header counter of late-ring promotions (after the TCP byte counter).
pub const COUNTER_LATE: usize = crate::tables::conns::COUNTER_TCP_BYTES + 1;

/// Header counter of late-ring attempts that failed (the connection stayed on TCP).
pub const COUNTER_LATE_FAILED: usize = COUNTER_LATE + 1;

const _: () = assert!(COUNTER_LATE_FAILED < NCOUNTERS);

/// Header counter of connections moved to TCP because another process took their socket
/// with `pidfd_getfd`.
pub const COUNTER_PIDFD: usize = COUNTER_LATE_FAILED + 1;

/// Header counter of `pidfd_getfd` calls refused because the connection could not leave its
/// ring in time (its holder or its peer did not follow the demote, or the peer was gone).
pub const COUNTER_PIDFD_FAILED: usize = COUNTER_PIDFD + 1;

const _: () = assert!(COUNTER_PIDFD_FAILED < NCOUNTERS);

/// Header counter of wake-ups that had to go over TCP (a doorbell byte) because the
/// sleeper's wake socket could not be reached (not shared with the waker, permissions).
pub const COUNTER_WAKE_FALLBACK: usize = COUNTER_PIDFD_FAILED + 1;

const _: () = assert!(COUNTER_WAKE_FALLBACK < NCOUNTERS);

/// Header counter of doorbell bytes sent over TCP to wake a sleeping peer (every wake-up
/// towards another kernel, the fallbacks above, and sleeps that need the socket: timed
/// blocking calls, sides shared between processes).
pub const COUNTER_DOORBELLS: usize = COUNTER_WAKE_FALLBACK + 1;

const _: () = assert!(COUNTER_DOORBELLS < NCOUNTERS);

/// Header counter of ring-heap segments whose memory was given back to the system after
/// they had been free a while (`Registry::trim_segments`).
pub const COUNTER_SEGMENTS_GIVEN_BACK: usize = COUNTER_DOORBELLS + 1;

const _: () = assert!(COUNTER_SEGMENTS_GIVEN_BACK < NCOUNTERS);

/// Header counters of the times a table was found full (members, endpoints, channels, ring
/// memory), in that order: what `region_full` fallbacks, and joins that failed, ran into.
pub const COUNTER_FULL_FIRST: usize = COUNTER_SEGMENTS_GIVEN_BACK + 1;
/// Header counters of stream-ring windows grown (a busy connection), shrunk (an idle one),
/// and not grown for want of memory in the file system behind the region.
pub const COUNTER_WINDOWS_GROWN: usize = COUNTER_FULL_FIRST + 4;
pub const COUNTER_WINDOWS_SHRUNK: usize = COUNTER_FULL_FIRST + 5;
pub const COUNTER_WINDOWS_NO_ROOM: usize = COUNTER_FULL_FIRST + 6;
/// The tables whose fullness is counted from [`COUNTER_FULL_FIRST`] on, as a
/// `RegistryError::RegionFull` names them.
pub(crate) const FULL_TABLES: [&str; 4] = ["members", "endpoints", "channels", "ring memory"];
/// Names of the counters from [`COUNTER_FULL_FIRST`] on.
pub(crate) const FULL_NAMES: [&str; 7] = [
    "members_full",
    "endpoints_full",
    "channels_full",
    "ring_memory_full",
    "windows_grown",
    "windows_shrunk",
    "windows_no_room",
];
const _: () = assert!(COUNTER_FULL_FIRST + FULL_NAMES.len() <= NCOUNTERS);

/// The name of header counter `i` if it counts switches (`switch_<reason>`).
pub(crate) fn switch_counter_name(i: usize) -> Option<&'static str> {
    match i {
        COUNTER_LATE => return Some("switch_late"),
        COUNTER_LATE_FAILED => return Some("late_failed"),
        COUNTER_PIDFD => return Some("switch_pidfd"),
        COUNTER_PIDFD_FAILED => return Some("pidfd_failed"),
        COUNTER_WAKE_FALLBACK => return Some("wake_fallback"),
        COUNTER_DOORBELLS => return Some("doorbells"),
        _ => {}
    }
    const NAMES: [&str; 8] = [
        "switch_fd_passed",
        "switch_exec",
        "switch_spawn",
        "switch_oob",
        "switch_peer",
        "switch_operator",
        "switch_region",
        "switch_promoted",
    ];
    NAMES.get(i.checked_sub(COUNTER_SWITCH_FIRST)?).copied()
}

pub const REQUESTED: u64 = 1;
const CLIENT_ON_TCP: u64 = 2;
const SERVER_ON_TCP: u64 = 4;
const REASON_SHIFT: u32 = 8;
const PINNED: u64 = 1 << 16;
const GRAB_SHIFT: u32 = 24;
const GRAB_ONE: u64 = 1 << GRAB_SHIFT;
const GRAB_MASK: u64 = 0xffff << GRAB_SHIFT;
const CLIENT_KERNEL_COUNTS: u64 = 1 << 17;
const SERVER_KERNEL_COUNTS: u64 = 1 << 18;

fn kernel_counts_bit(side: Side) -> u64 {
    match side {
        Side::Client => CLIENT_KERNEL_COUNTS,
        Side::Server => SERVER_KERNEL_COUNTS,
    }
}

/// A channel's switch word (see the module docs).
#[derive(Clone)]
pub struct SwitchWord(pub ShmU64);

fn on_tcp_bit(side: Side) -> u64 {
    match side {
        Side::Client => CLIENT_ON_TCP,
        Side::Server => SERVER_ON_TCP,
    }
}

const PROMOTE: u64 = 8;
const CLIENT_READY: u64 = 16;
const SERVER_READY: u64 = 32;
const CLIENT_STOPPED: u64 = 64;
const SERVER_STOPPED: u64 = 128;

fn ready_bit(side: Side) -> u64 {
    match side {
        Side::Client => CLIENT_READY,
        Side::Server => SERVER_READY,
    }
}

fn stopped_bit(side: Side) -> u64 {
    match side {
        Side::Client => CLIENT_STOPPED,
        Side::Server => SERVER_STOPPED,
    }
}

impl SwitchWord {
    /// The word of a late-ring offer (published with it): both sides switched to TCP for
    /// reason `late`, promotion asked — the state a demoted connection is in when `memloop
    /// promote` asks, so the promotion runs as for any other.
    pub const LATE_OFFER: u64 = REQUESTED
        | 9 << REASON_SHIFT // SwitchReason::Late's code (checked in the tests)
        | CLIENT_ON_TCP
        | SERVER_ON_TCP
        | PROMOTE;

    /// Whether anything happened at all (one load: the data calls' fast-path check).
    #[inline]
    pub fn quiet(&self) -> bool {
        self.0.load(Acquire) == 0
    }

    /// Asks both sides to leave the ring; true if this call made the request (the first
    /// reason is kept).
    pub fn request(&self, reason: SwitchReason) -> bool {
        let bits = REQUESTED | (reason.as_code() as u64) << REASON_SHIFT;
        let mut cur = self.0.load(Acquire);
        loop {
            // (During a promotion the word still holds the last demote's request.)
            if cur & (REQUESTED | PROMOTE) != 0 {
                return false;
            }
            match self.0.compare_exchange(cur, cur | bits, AcqRel, Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    pub fn requested(&self) -> bool {
        self.0.load(Acquire) & REQUESTED != 0
    }

    /// The reason of the request, if any (an unknown code reads as `None`).
    pub fn reason(&self) -> Option<SwitchReason> {
        SwitchReason::from_code((self.0.load(Acquire) >> REASON_SHIFT) as u8)
    }

    /// `side` finished its move to TCP.
    pub fn set_on_tcp(&self, side: Side) {
        self.0.fetch_or(on_tcp_bit(side), AcqRel);
    }

    pub fn on_tcp(&self, side: Side) -> bool {
        self.0.load(Acquire) & on_tcp_bit(side) != 0
    }

    /// Asks both sides, on TCP after a switch, to come back to their ring; true if this call
    /// asked (both sides must be on TCP, and no promotion asked already).
    pub fn request_promote(&self) -> bool {
        let both = CLIENT_ON_TCP | SERVER_ON_TCP;
        let cur = self.0.load(Acquire);
        cur & both == both
            && cur & (PROMOTE | PINNED) == 0
            && self
                .0
                .compare_exchange(cur, cur | PROMOTE, AcqRel, Acquire)
                .is_ok()
    }

    /// Keeps the connection on TCP for good (see the module docs). A promotion already asked
    /// is not called off here: every side that follows one checks [`SwitchWord::pinned`]
    /// before it gets ready, and a side holding the socket with an unseen program is not the
    /// only holder of its side until it pinned, so it cannot have stopped.
    pub fn pin(&self) {
        self.0.fetch_or(PINNED, AcqRel);
    }

    pub fn pinned(&self) -> bool {
        self.0.load(Acquire) & PINNED != 0
    }

    /// `side`'s socket is used by a process its holders were not told of: they count their
    /// TCP phase from the kernel's stream positions (see the module docs).
    pub fn set_kernel_counts(&self, side: Side) {
        self.0.fetch_or(kernel_counts_bit(side), AcqRel);
    }

    pub fn kernel_counts(&self, side: Side) -> bool {
        self.0.load(Acquire) & kernel_counts_bit(side) != 0
    }

    /// Counts one process holding a side unseen by its other holders (see the module docs);
    /// false, and nothing counted, if a side has stopped writing TCP already (a promotion
    /// past its point of no return: it must complete first) or the count is full.
    pub fn grab(&self) -> bool {
        self.0
            .fetch_update(AcqRel, Acquire, |cur| {
                let stopped = cur & (CLIENT_STOPPED | SERVER_STOPPED) != 0;
                (!stopped && cur & GRAB_MASK != GRAB_MASK).then_some(cur + GRAB_ONE)
            })
            .is_ok()
    }

    /// One unseen holder less (it closed, or it is its side's only holder now).
    pub fn ungrab(&self) {
        // (Already zero only if the slot was freed and reused: nothing to take then.)
        let _ = self.0.fetch_update(AcqRel, Acquire, |cur| {
            (cur & GRAB_MASK != 0).then_some(cur - GRAB_ONE)
        });
    }

    /// Some process holds a side unseen by its other holders: no side may stop.
    pub fn grabbed(&self) -> bool {
        self.0.load(Acquire) & GRAB_MASK != 0
    }

    pub fn promote_requested(&self) -> bool {
        self.0.load(Acquire) & PROMOTE != 0
    }

    /// `side` is ready — only if the promotion is still on: a mark left behind by a promotion
    /// called off meanwhile would let the side skip getting ready for the next one.
    pub fn set_ready(&self, side: Side) -> bool {
        self.0
            .fetch_update(AcqRel, Acquire, |cur| {
                (cur & PROMOTE != 0).then_some(cur | ready_bit(side))
            })
            .is_ok()
    }

    pub fn ready(&self, side: Side) -> bool {
        self.0.load(Acquire) & ready_bit(side) != 0
    }

    /// `side` stops writing TCP — only if the promotion is still on (not cancelled) and no
    /// unseen holder is counted ([`SwitchWord::grab`]).
    pub fn set_stopped(&self, side: Side) -> bool {
        let mut cur = self.0.load(Acquire);
        loop {
            if cur & PROMOTE == 0 || cur & GRAB_MASK != 0 {
                return false;
            }
            match self
                .0
                .compare_exchange(cur, cur | stopped_bit(side), AcqRel, Acquire)
            {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Calls a promotion off — only while neither side has stopped writing TCP (after that
    /// both must go through with it). True if no promotion is on any more.
    pub fn cancel_promotion(&self) -> bool {
        let mut cur = self.0.load(Acquire);
        loop {
            if cur & PROMOTE == 0 {
                return true;
            }
            if cur & (CLIENT_STOPPED | SERVER_STOPPED) != 0 {
                return false;
            }
            let new = cur & !(PROMOTE | CLIENT_READY | SERVER_READY);
            match self.0.compare_exchange(cur, new, AcqRel, Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    pub fn stopped(&self, side: Side) -> bool {
        self.0.load(Acquire) & stopped_bit(side) != 0
    }

    /// Both sides stopped writing TCP: the promotion is agreed, the word goes back to quiet
    /// (a later switch starts afresh). False if the word is not that state (any more).
    pub fn finish_promotion(&self) -> bool {
        let done = PROMOTE | CLIENT_STOPPED | SERVER_STOPPED;
        let mut cur = self.0.load(Acquire);
        while cur & done == done {
            match self.0.compare_exchange(cur, 0, AcqRel, Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
        false
    }
}

impl Registry {
    /// Asks both sides of channel `ch` (on TCP after a switch) to come back to its ring
    /// (`memloop promote`); true if this call asked. The `promoted` switch is counted when
    /// the promotion completes (a request may be called off).
    pub fn request_promote(&self, ch: ChannelId) -> Result<bool, RegistryError> {
        let state = self.state();
        if state != crate::RegionState::Open {
            return Err(RegistryError::wrong("an open region", state.name()));
        }
        let (slot, _) = self.channel_entry(ch)?;
        let w = SwitchWord(slot.switch_word()?);
        if !(w.on_tcp(Side::Client) && w.on_tcp(Side::Server)) {
            return Err(RegistryError::wrong(
                "both sides on TCP",
                "a connection on its ring",
            ));
        }
        if w.pinned() {
            return Err(RegistryError::wrong(
                "a connection only preloaded programs hold",
                "pinned to TCP (its socket reached a program without the library)",
            ));
        }
        Ok(w.request_promote())
    }

    /// Counts one switch of a connection for `reason`.
    pub fn count_switch(&self, reason: SwitchReason) {
        self.bump_counter(reason.counter_index());
    }

    /// Counts one late-ring attempt that left its connection on TCP.
    pub fn count_late_failed(&self) {
        self.bump_counter(COUNTER_LATE_FAILED);
    }

    /// Counts one `pidfd_getfd` refused because its connection could not leave its ring.
    pub fn count_pidfd_failed(&self) {
        self.bump_counter(COUNTER_PIDFD_FAILED);
    }

    /// The switch counters by reason.
    pub fn switch_counts(&self) -> Vec<(SwitchReason, u64)> {
        let c = self.counters();
        SwitchReason::ALL
            .iter()
            .map(|&r| (r, c.get(r.counter_index()).copied().unwrap_or(0)))
            .collect()
    }

    /// The switch word of an accepted channel.
    pub fn switch_word(&self, ch: ChannelId) -> Result<SwitchWord, RegistryError> {
        let (slot, _) = self.channel_entry(ch)?;
        slot.switch_word().map(SwitchWord)
    }

    /// Asks both sides of channel `ch` to leave its ring (`memloop demote`); true if this call
    /// made the request. Only an ACCEPTED channel has sides to ask.
    pub fn request_switch(
        &self,
        ch: ChannelId,
        reason: SwitchReason,
    ) -> Result<bool, RegistryError> {
        let (slot, w) = self.channel_entry(ch)?;
        if crate::tables::channels::c_phase(w) != crate::tables::channels::C_ACCEPTED {
            return Err(RegistryError::wrong(
                "ACCEPTED",
                crate::tables::channels::phase_name(crate::tables::channels::c_phase(w)),
            ));
        }
        let word = SwitchWord(slot.switch_word()?);
        if word.promote_requested() {
            return Err(RegistryError::wrong(
                "a connection not coming back to its ring",
                "a promotion under way",
            ));
        }
        let asked = word.request(reason);
        if asked {
            self.count_switch(reason); // once per connection, by whoever asked first
        }
        Ok(asked)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use memloop_shm::ShmSlice;

    #[test]
    fn a_late_offer_word_is_a_promotion_asked_after_a_late_switch() {
        let v = ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        w.0.store(SwitchWord::LATE_OFFER, memloop_shm::sync::Ordering::Release);
        assert_eq!(w.reason(), Some(SwitchReason::Late));
        assert!(w.on_tcp(Side::Client) && w.on_tcp(Side::Server));
        assert!(w.promote_requested() && !w.request(SwitchReason::Operator));
        let counters: Vec<usize> = SwitchReason::ALL
            .iter()
            .map(|r| r.counter_index())
            .collect();
        let mut unique = counters.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), counters.len());
        assert!(!counters.contains(&crate::tables::conns::COUNTER_TCP_BYTES));
        assert!(!counters.contains(&COUNTER_LATE_FAILED));
    }

    #[test]
    fn reasons_round_trip_and_have_their_own_counters() {
        for r in SwitchReason::ALL {
            assert_eq!(SwitchReason::from_code(r.as_code()), Some(r));
            assert_eq!(
                switch_counter_name(r.counter_index()),
                Some(format!("switch_{}", r.name()).as_str())
            );
            assert!(r.counter_index() < NCOUNTERS);
        }
        assert_eq!(SwitchReason::from_code(0), None);
        assert_eq!(switch_counter_name(COUNTER_RING_BYTES), None);
    }

    /// Both sides marked on TCP (switched, each for its own reason or the word's).
    fn both_on_tcp(w: &SwitchWord) {
        w.set_on_tcp(Side::Client);
        w.set_on_tcp(Side::Server);
    }

    /// An accepted channel and its switch word.
    fn accepted() -> (Registry, ChannelId, SwitchWord) {
        let (r, m) = crate::tables::members::test_registry_with_member("m");
        let ep = r
            .add_endpoint(m, &crate::EndpointKey::Native("x".into()))
            .unwrap();
        let ch = r.offer(m, ep, 4096, None).unwrap();
        r.accept(ch, m).unwrap();
        let w = r.switch_word(ch).unwrap();
        (r, ch, w)
    }

    #[test]
    fn no_promotion_is_asked_in_a_paused_region() {
        let (r, ch, w) = accepted();
        both_on_tcp(&w);
        r.set_state(crate::RegionState::Paused).unwrap();
        let e = r.request_promote(ch).unwrap_err();
        assert!(e.to_string().contains("paused"), "{e}");
        r.set_state(crate::RegionState::Open).unwrap();
        assert!(r.request_promote(ch).unwrap());
    }

    #[test]
    fn kernel_counts_are_marked_per_side_and_end_with_the_promotion() {
        let (_r, _ch, w) = accepted();
        assert!(w.request(SwitchReason::Pidfd));
        both_on_tcp(&w);
        w.set_kernel_counts(Side::Client);
        assert!(w.kernel_counts(Side::Client) && !w.kernel_counts(Side::Server));
        assert_eq!(
            w.reason(),
            Some(SwitchReason::Pidfd),
            "the mark keeps the reason"
        );
        assert!(w.request_promote());
        assert!(
            w.cancel_promotion() && w.kernel_counts(Side::Client),
            "kept when called off"
        );
        assert!(w.request_promote());
        assert!(w.set_stopped(Side::Client) && w.set_stopped(Side::Server));
        assert!(w.finish_promotion() && w.quiet() && !w.kernel_counts(Side::Client));
    }

    #[test]
    fn no_side_stops_while_a_grab_is_counted_and_no_grab_is_counted_past_a_stop() {
        let v = ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        assert!(w.request(SwitchReason::Pidfd));
        both_on_tcp(&w);
        assert!(w.request_promote());
        assert!(w.set_ready(Side::Client) && w.set_ready(Side::Server));
        assert!(w.grab() && w.grab() && w.grabbed());
        assert!(!w.set_stopped(Side::Client), "no stop while grabbed");
        assert!(w.cancel_promotion(), "nobody stopped: it can be called off");
        w.ungrab();
        assert!(w.grabbed(), "one grab is still counted");
        w.ungrab();
        w.ungrab(); // nothing left to take: no borrow into the bits below
        assert!(!w.grabbed() && w.on_tcp(Side::Client) && w.on_tcp(Side::Server));
        assert_eq!(w.reason(), Some(SwitchReason::Pidfd));
        assert!(w.request_promote());
        assert!(w.set_stopped(Side::Server));
        assert!(
            !w.grab() && !w.grabbed(),
            "past a stop the promotion completes first"
        );
        assert!(w.set_stopped(Side::Client) && w.finish_promotion() && w.quiet());
    }

    #[test]
    fn a_pinned_connection_is_never_asked_to_come_back() {
        let (r, ch, w) = accepted();
        assert!(w.request(SwitchReason::Exec));
        both_on_tcp(&w);
        w.pin();
        assert!(w.pinned() && !w.request_promote());
        let e = r.request_promote(ch).unwrap_err();
        assert!(e.to_string().contains("pinned"), "{e}");
        assert_eq!(
            w.reason(),
            Some(SwitchReason::Exec),
            "the pin keeps the reason"
        );
    }

    #[test]
    fn a_promotion_runs_its_steps_and_can_be_called_off_only_before_a_stop() {
        let v = ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        assert!(w.request(SwitchReason::Operator));
        assert!(!w.request_promote(), "not both on TCP yet");
        both_on_tcp(&w);
        assert!(w.request_promote() && !w.request_promote());
        assert!(w.set_ready(Side::Server));
        assert!(w.cancel_promotion() && !w.promote_requested() && !w.ready(Side::Server));
        assert!(
            !w.set_ready(Side::Server) && !w.ready(Side::Server),
            "no mark once called off"
        );
        assert!(!w.set_stopped(Side::Client), "no stop once called off");
        assert!(w.request_promote());
        assert!(w.set_stopped(Side::Server));
        assert!(
            !w.cancel_promotion(),
            "a side stopped: both go through with it"
        );
        assert!(!w.finish_promotion(), "the client has not stopped");
        assert!(w.set_stopped(Side::Client));
        assert!(w.finish_promotion() && w.quiet());
    }

    #[test]
    fn no_request_gets_into_a_running_promotion_and_the_finish_clears_everything() {
        let v = ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        // Both sides switched without a request of their own (e.g. each for its own reason
        // before the word was read): the word holds only their marks.
        both_on_tcp(&w);
        assert!(w.request_promote());
        assert!(
            !w.request(SwitchReason::Operator),
            "a demote asked during a promotion is refused"
        );
        assert!(w.set_stopped(Side::Server) && w.set_stopped(Side::Client));
        assert!(
            w.finish_promotion() && w.quiet(),
            "the finish leaves nothing behind"
        );
        assert!(
            w.request(SwitchReason::Operator),
            "after it, a demote is taken"
        );
    }

    #[test]
    fn the_first_request_wins_and_sides_are_marked_apart() {
        let v = ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        assert!(w.quiet() && !w.requested() && w.reason().is_none());
        assert!(w.request(SwitchReason::Exec));
        assert!(!w.request(SwitchReason::Operator));
        assert_eq!(w.reason(), Some(SwitchReason::Exec));
        assert!(!w.on_tcp(Side::Client));
        w.set_on_tcp(Side::Server);
        assert!(w.on_tcp(Side::Server) && !w.on_tcp(Side::Client));
        assert_eq!(
            w.reason(),
            Some(SwitchReason::Exec),
            "marks keep the reason"
        );
    }
}
