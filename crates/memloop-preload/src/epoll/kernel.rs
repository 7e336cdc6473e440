//! The kernel side of an emulated epoll set: our own registrations carry a tagged data word
//! (`TAG | item id`) that [`untag`] recognises in every event the kernel returns, so none of
//! them can reach the program.

use crate::real;
use libc::{c_int, epoll_event};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// High half of our data words: "ML" and 16 bits drawn once per process (kept across fork,
/// new after exec), so a program that happens to use words of this shape is unlikely to
/// meet ours; the set also checks the id is one it issued.
static MAGIC: AtomicU64 = AtomicU64::new(0);
const MARK: u64 = 0x4d4c_0000_0000_0000;
const MARK_MASK: u64 = 0xffff_0000_0000_0000;
const HIGH: u64 = 0xffff_ffff_0000_0000;

fn magic() -> u64 {
    let m = MAGIC.load(Relaxed);
    if m != 0 {
        return m;
    }
    let r = RandomState::new().build_hasher().finish();
    let m = MARK | ((r & 0xffff).max(1) << 32);
    match MAGIC.compare_exchange(0, m, Relaxed, Relaxed) {
        Ok(_) => m,
        Err(other) => other,
    }
}

pub fn tag(id: u32) -> u64 {
    magic() | id as u64
}

/// The item id of what may be one of our registrations, or `None` for a word of the
/// program's own.
pub fn untag(data: u64) -> Option<u32> {
    (data & HIGH == magic()).then_some(data as u32)
}

/// Whether a data word found in a set inherited across exec looks like a tag of the previous
/// program image (whose 16 random bits are unknown).
pub fn looks_like_old_tag(data: u64) -> bool {
    data & MARK_MASK == MARK
}

pub fn ctl(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> Result<(), c_int> {
    let mut ev = epoll_event { events, u64: data };
    real::epoll_ctl_raw(epfd, op, fd, &mut ev)
}

/// [`ctl`] where a failure leaves nothing to undo: the fd was closed meanwhile by another
/// thread (EBADF; ENOENT: the kernel dropped the registration with the file), so it is only
/// logged, with what we were doing.
pub fn ctl_or_log(what: &'static str, epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) {
    if let Err(errno) = ctl(epfd, op, fd, events, data) {
        tracing::debug!(what, epfd, fd, op, errno, "epoll_ctl failed");
    }
}

/// One kernel wait. `precise`: the program asked with a nanosecond timeout (`epoll_pwait2`);
/// otherwise milliseconds, rounded up so a short wait never becomes a busy poll.
pub fn wait(
    epfd: c_int,
    buf: &mut [epoll_event],
    timeout: Option<Duration>,
    sigmask: *const libc::sigset_t,
    precise: bool,
) -> Result<usize, c_int> {
    if buf.is_empty() {
        return Ok(0);
    }
    if precise {
        return real::epoll_pwait2_raw(epfd, buf, timeout, sigmask);
    }
    let ms = match timeout {
        None => -1,
        Some(t) => {
            let ms = t.as_millis() + u128::from(t.subsec_nanos() % 1_000_000 != 0);
            ms.min(c_int::MAX as u128) as c_int
        }
    };
    real::epoll_wait_raw(epfd, buf, ms, sigmask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_program_words_pass() {
        assert_eq!(untag(tag(7)), Some(7));
        assert_eq!(untag(tag(u32::MAX)), Some(u32::MAX));
        for w in [0u64, 5, 0x7fff_1234_5678, u64::MAX, tag(3) ^ (1 << 32)] {
            assert_eq!(untag(w), None, "{w:#x}");
        }
        assert!(looks_like_old_tag(tag(9)));
        assert!(!looks_like_old_tag(0x7fff_1234_5678));
    }
}
