//! The kernel side of an emulated epoll set: our own registrations carry a tagged data word
//! (`TAG | item id`) that [`untag`] recognises in every event the kernel returns, so none of
//! them can reach the program.

use crate::real;
use libc::{c_int, epoll_event};
use std::time::Duration;

const TAG: u64 = 0x4d4c_7470_0000_0000;
const TAG_MASK: u64 = 0xffff_ffff_0000_0000;

pub fn tag(id: u32) -> u64 {
    TAG | id as u64
}

/// The item id of one of our registrations, or `None` for the program's own data word.
pub fn untag(data: u64) -> Option<u32> {
    (data & TAG_MASK == TAG).then_some(data as u32)
}

pub fn ctl(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> Result<(), c_int> {
    let mut ev = epoll_event { events, u64: data };
    real::epoll_ctl_raw(epfd, op, fd, &mut ev)
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
        for w in [0u64, 5, 0x7fff_1234_5678, u64::MAX, 0x4d4c_7471_0000_0001] {
            assert_eq!(untag(w), None, "{w:#x}");
        }
    }
}
