//! What the kernel's epoll answers, as pure functions over plain values: the argument checks
//! of `epoll_ctl`, the event bits a ring connection reports, and edge-triggered bookkeeping.
//! No I/O here, so every rule is unit-tested against the kernel's documented behaviour.

use libc::c_int;

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;
const ERR: u32 = libc::EPOLLERR as u32;
const HUP: u32 = libc::EPOLLHUP as u32;
pub const ET: u32 = libc::EPOLLET as u32;
pub const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
pub const EXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;
const WAKEUP: u32 = libc::EPOLLWAKEUP as u32;

/// The only bits `EPOLLEXCLUSIVE` may be combined with (fs/eventpoll.c).
const EXCLUSIVE_OK: u32 = IN | OUT | ERR | HUP | WAKEUP | ET | EXCLUSIVE;

/// The kernel's `EINVAL` rules for `EPOLLEXCLUSIVE`: only with `EPOLL_CTL_ADD`, never on an
/// epoll fd, never with other bits than [`EXCLUSIVE_OK`]; and a registration made exclusive
/// cannot be modified. `existing`: whether the fd is registered, and if so exclusively.
pub fn check_ctl(
    op: c_int,
    events: Option<u32>,
    target_is_epoll: bool,
    existing: Option<bool>,
) -> Result<(), c_int> {
    let has_event = op == libc::EPOLL_CTL_ADD || op == libc::EPOLL_CTL_MOD;
    if has_event && events.is_none() {
        return Err(libc::EFAULT);
    }
    if !matches!(
        op,
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD | libc::EPOLL_CTL_DEL
    ) {
        return Err(libc::EINVAL);
    }
    let ev = events.unwrap_or(0);
    let exclusive = has_event && ev & EXCLUSIVE != 0;
    if exclusive && (op == libc::EPOLL_CTL_MOD || target_is_epoll || ev & !EXCLUSIVE_OK != 0) {
        return Err(libc::EINVAL);
    }
    match (op, existing) {
        (libc::EPOLL_CTL_ADD, Some(_)) => Err(libc::EEXIST),
        (libc::EPOLL_CTL_MOD | libc::EPOLL_CTL_DEL, None) => Err(libc::ENOENT),
        (libc::EPOLL_CTL_MOD, Some(true)) => Err(libc::EINVAL),
        _ => Ok(()),
    }
}

/// `poll` revents → epoll event bits.
pub fn poll_to_epoll(ev: i16) -> u32 {
    let mut e = 0u32;
    for (p, q) in [
        (libc::POLLIN, libc::EPOLLIN),
        (libc::POLLOUT, libc::EPOLLOUT),
        (libc::POLLRDHUP, libc::EPOLLRDHUP),
        (libc::POLLHUP, libc::EPOLLHUP),
        (libc::POLLERR, libc::EPOLLERR),
    ] {
        if ev & p != 0 {
            e |= q as u32;
        }
    }
    e
}

/// An epoll interest's read and write bits as `poll` events.
pub fn poll_events(events: u32) -> i16 {
    let mut p = 0;
    if events & IN != 0 {
        p |= libc::POLLIN;
    }
    if events & OUT != 0 {
        p |= libc::POLLOUT;
    }
    if events & libc::EPOLLRDHUP as u32 != 0 {
        p |= libc::POLLRDHUP;
    }
    p
}

/// What an interest in `events` reports of a target whose ready bits are `ready`: the bits
/// asked for, plus hang-up and error, which the kernel always reports.
pub fn report(ready: u32, events: u32) -> u32 {
    ready & (events | ERR | HUP)
}

/// Whether an interest wants to be woken for data (read doorbell) or space (write doorbell).
pub fn wants(events: u32) -> (bool, bool) {
    (events & IN != 0, events & OUT != 0)
}

/// Edge-triggered bookkeeping: a signature of what an interest last reported. A ring's
/// signature is (data ever published, space ever freed, reported bits): it changes exactly
/// when the kernel would queue a new edge (new data, freed space, a new condition).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Edge(Option<(u64, u64, u32)>);

impl Edge {
    /// Whether `now` is a new edge; records it if so.
    pub fn fire(&mut self, now: (u64, u64, u32)) -> bool {
        if self.0 == Some(now) {
            return false;
        }
        self.0 = Some(now);
        true
    }

    /// Whether `now` would be a new edge (no change recorded).
    pub fn would_fire(&self, now: (u64, u64, u32)) -> bool {
        self.0 != Some(now)
    }

    /// Nothing is ready: the next readiness is an edge again.
    pub fn reset(&mut self) {
        self.0 = None;
    }
}

/// Signature bit for "the peer's end of the stream arrived" (never an epoll event bit).
const FIN: u32 = 1 << 31;

/// The signature an edge-triggered interest compares: only the progress it watches counts,
/// and the stream's end is an edge even when the reported bits stay the same (data was
/// readable before, the end is readable now).
pub fn edge_signature(events: u32, progress: (u64, u64, bool), report: u32) -> (u64, u64, u32) {
    let (r, w) = wants(events);
    let fin = if r && progress.2 { FIN } else { 0 };
    (
        if r { progress.0 } else { 0 },
        if w { progress.1 } else { 0 },
        report | fin,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::{EPOLL_CTL_ADD as ADD, EPOLL_CTL_DEL as DEL, EPOLL_CTL_MOD as MOD};

    #[test]
    fn exclusive_only_with_add_and_plain_bits() {
        assert_eq!(check_ctl(ADD, Some(IN | EXCLUSIVE), false, None), Ok(()));
        assert_eq!(
            check_ctl(ADD, Some(IN | ET | EXCLUSIVE), false, None),
            Ok(())
        );
        assert_eq!(
            check_ctl(ADD, Some(IN | ONESHOT | EXCLUSIVE), false, None),
            Err(libc::EINVAL)
        );
        let rdhup = libc::EPOLLRDHUP as u32;
        assert_eq!(
            check_ctl(ADD, Some(IN | rdhup | EXCLUSIVE), false, None),
            Err(libc::EINVAL)
        );
        assert_eq!(
            check_ctl(ADD, Some(IN | EXCLUSIVE), true, None),
            Err(libc::EINVAL)
        );
        assert_eq!(
            check_ctl(MOD, Some(IN | EXCLUSIVE), false, Some(false)),
            Err(libc::EINVAL)
        );
        assert_eq!(
            check_ctl(MOD, Some(IN), false, Some(true)),
            Err(libc::EINVAL)
        );
        assert_eq!(check_ctl(DEL, None, false, Some(true)), Ok(()));
    }

    #[test]
    fn existence_and_faults() {
        assert_eq!(
            check_ctl(ADD, Some(IN), false, Some(false)),
            Err(libc::EEXIST)
        );
        assert_eq!(check_ctl(MOD, Some(IN), false, None), Err(libc::ENOENT));
        assert_eq!(check_ctl(DEL, None, false, None), Err(libc::ENOENT));
        assert_eq!(check_ctl(ADD, None, false, None), Err(libc::EFAULT));
        assert_eq!(check_ctl(42, Some(IN), false, None), Err(libc::EINVAL));
    }

    #[test]
    fn report_keeps_hup_and_err() {
        assert_eq!(report(IN | OUT | HUP, IN), IN | HUP);
        assert_eq!(report(OUT, IN), 0);
        assert_eq!(report(ERR, 0), ERR);
    }

    #[test]
    fn edges_fire_once_per_change() {
        let mut e = Edge::default();
        let ev = IN | ET;
        let s1 = edge_signature(ev, (10, 7, false), IN);
        assert!(e.fire(s1));
        assert!(!e.fire(s1));
        // Space freed does not matter to a read-only interest.
        assert!(!e.fire(edge_signature(ev, (10, 99, false), IN)));
        assert!(e.would_fire(edge_signature(ev, (11, 7, false), IN)));
        assert!(e.fire(edge_signature(ev, (11, 7, false), IN)));
        // The peer's shutdown is an edge although no byte came and IN stays reported.
        assert!(e.fire(edge_signature(ev, (11, 7, true), IN)));
        assert!(!e.fire(edge_signature(ev, (11, 7, true), IN)));
        e.reset();
        assert!(e.fire(edge_signature(ev, (11, 7, true), IN)));
    }
}
