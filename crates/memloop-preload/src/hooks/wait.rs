//! Readiness: poll, ppoll, select, pselect and epoll. A wait that involves no ring
//! connection and no epoll set of ours goes to the kernel untouched.

use super::{fail, hook, ms_timeout, track, ts_timeout};
use crate::dispatch;
use crate::real;
use crate::table::{self, Entry};
use crate::{conn, pollsel};
use libc::{c_int, size_t};
use std::time::{Duration, Instant};

/// Whether `fd` is a ring connection (or undecided, or one that was ever on its ring: its
/// socket may hold doorbells, which the kernel would report as readable data), an epoll set
/// (whose ring members poll and select must see) or armed for a late ring (the poll counts
/// itself in flight).
fn watched(fd: c_int) -> bool {
    table::kind(fd) == table::K_OBJ
        && match table::get(fd).as_deref() {
            Some(e @ Entry::Conn(c)) => {
                c.path() != conn::Path::Tcp || c.was_ring() || crate::late::is_armed(e)
            }
            Some(Entry::Epoll(_) | Entry::Udp(_)) => true,
            Some(e @ Entry::Plain(_)) => crate::late::is_armed(e),
            _ => false,
        }
}

/// # Safety
/// `fds` must be null or point to `n` readable pollfds.
unsafe fn any_ring(fds: *const libc::pollfd, n: libc::nfds_t) -> bool {
    if fds.is_null() {
        return false;
    }
    // SAFETY: non-null and `n` pollfds, by the contract.
    unsafe { std::slice::from_raw_parts(fds, n as usize) }
        .iter()
        .any(|p| watched(p.fd))
}

/// # Safety
/// `fds` must point to `n` readable, writable pollfds (non-null: `any_ring` found one).
unsafe fn emulated_poll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Result<c_int, c_int> {
    // SAFETY: by the contract.
    let set = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    pollsel::poll(set, timeout, mask).map(|n| n as c_int)
}

hook! {
    fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int;
    real kernel = real::poll,
        // SAFETY: poll's contract: `fds` holds `n` pollfds.
        pass if !unsafe { any_ring(fds, n) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: poll's contract, and `fds` is non-null (it holds a ring fd).
        unsafe { emulated_poll(fds, n, ms_timeout(timeout), std::ptr::null()) }
    }
}

hook! {
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, _len: size_t)
        -> c_int;
    on_panic fail(libc::EIO);
    {
        // SAFETY: poll's contract, which the caller of the checked variant also keeps.
        Ok(unsafe { poll(fds, n, timeout) })
    }
}

hook! {
    fn ppoll(
        fds: *mut libc::pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int;
    real kernel = real::ppoll,
        // SAFETY: ppoll's contract: `fds` holds `n` pollfds.
        pass if !unsafe { any_ring(fds, n) };
    on_panic fail(libc::EIO);
    {
        // SAFETY: ppoll's contract: `ts` is null or a valid timespec.
        let timeout = unsafe { ts_timeout(ts) };
        // SAFETY: ppoll's contract, and `fds` is non-null (it holds a ring fd).
        unsafe { emulated_poll(fds, n, timeout, mask) }
    }
}

hook! {
    fn __ppoll_chk(
        fds: *mut libc::pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
        _len: size_t,
    ) -> c_int;
    on_panic fail(libc::EIO);
    {
        // SAFETY: ppoll's contract, which the caller of the checked variant also keeps.
        Ok(unsafe { ppoll(fds, n, ts, mask) })
    }
}

type FdSets = (*mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set);

/// The fd sets as a pollfd list, if any fd in them is a ring connection.
///
/// # Safety
/// Each set must be null or a readable `fd_set`.
unsafe fn select_to_poll(nfds: c_int, (r, w, e): FdSets) -> Option<Vec<libc::pollfd>> {
    let mut list = Vec::new();
    let mut ours = false;
    for fd in 0..nfds.clamp(0, libc::FD_SETSIZE as c_int) {
        let mut events = 0;
        // SAFETY: each set is null or readable, by the contract, and `fd` is below
        // FD_SETSIZE.
        if !r.is_null() && unsafe { libc::FD_ISSET(fd, r) } {
            events |= libc::POLLIN;
        }
        // SAFETY: as above.
        if !w.is_null() && unsafe { libc::FD_ISSET(fd, w) } {
            events |= libc::POLLOUT;
        }
        // SAFETY: as above.
        if !e.is_null() && unsafe { libc::FD_ISSET(fd, e) } {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            ours |= watched(fd);
            list.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    ours.then_some(list)
}

/// Writes poll's answer back into the fd sets; the count select returns.
///
/// # Safety
/// Each set must be null or a writable `fd_set`.
unsafe fn poll_to_select(list: &[libc::pollfd], (r, w, e): FdSets) -> c_int {
    for s in [r, w, e] {
        if !s.is_null() {
            // SAFETY: non-null and writable, by the contract.
            unsafe { libc::FD_ZERO(s) };
        }
    }
    let mut count = 0;
    for p in list {
        let rd = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
        let wr = libc::POLLOUT | libc::POLLERR;
        for (set, mask, asked) in [
            (r, rd, libc::POLLIN),
            (w, wr, libc::POLLOUT),
            (e, libc::POLLPRI, libc::POLLPRI),
        ] {
            if !set.is_null() && p.events & asked != 0 && p.revents & mask != 0 {
                // SAFETY: non-null and writable, by the contract; `p.fd` < FD_SETSIZE (it
                // came from `select_to_poll`).
                unsafe { libc::FD_SET(p.fd, set) };
                count += 1;
            }
        }
    }
    count
}

/// # Safety
/// Each set must be null or a readable, writable `fd_set`.
unsafe fn emulated_select(
    list: &mut [libc::pollfd],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
    sets: FdSets,
) -> Result<c_int, c_int> {
    pollsel::poll(list, timeout, mask)?;
    // SAFETY: by the contract.
    Ok(unsafe { poll_to_select(list, sets) })
}

hook! {
    fn select(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        tv: *mut libc::timeval,
    ) -> c_int;
    real kernel = real::select;
    on_panic fail(libc::EIO);
    {
        // SAFETY: select's contract: each set is null or a valid fd_set.
        let Some(mut list) = (unsafe { select_to_poll(nfds, (r, w, e)) }) else {
            return Ok(kernel());
        };
        // SAFETY: select's contract: `tv` is null or a valid timeval.
        let tv = unsafe { tv.as_mut() };
        let timeout = tv.as_ref().map(|t| {
            Duration::new(
                t.tv_sec.max(0) as u64,
                (t.tv_usec.clamp(0, 999_999) as u32) * 1000,
            )
        });
        let start = Instant::now();
        // SAFETY: select's contract, as above.
        let n = unsafe { emulated_select(&mut list, timeout, std::ptr::null(), (r, w, e)) };
        if let (Some(t), Some(tv)) = (timeout, tv) {
            // Linux reports the time left.
            let left = t.saturating_sub(start.elapsed());
            tv.tv_sec = left.as_secs() as libc::time_t;
            tv.tv_usec = left.subsec_micros() as libc::suseconds_t;
        }
        n
    }
}

hook! {
    fn pselect(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int;
    real kernel = real::pselect;
    on_panic fail(libc::EIO);
    {
        // SAFETY: pselect's contract: each set is null or a valid fd_set.
        let Some(mut list) = (unsafe { select_to_poll(nfds, (r, w, e)) }) else {
            return Ok(kernel());
        };
        // SAFETY: pselect's contract: `ts` is null or a valid timespec.
        let timeout = unsafe { ts_timeout(ts) };
        // SAFETY: pselect's contract, as above.
        unsafe { emulated_select(&mut list, timeout, mask, (r, w, e)) }
    }
}

// ---- epoll ------------------------------------------------------------------------------------

hook! {
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    real kernel = real::epoll_ctl, pass if table::kind(fd) == table::K_NONE;
    on_panic fail(libc::EIO);
    {
        // SAFETY: epoll_ctl's contract: `ev` is null (DEL) or a readable epoll_event.
        let want = unsafe { ev.as_ref() }.map(|e| (e.events, e.u64));
        if let Some(r) = dispatch::epoll_ctl(epfd, op, fd, want) {
            return r.map(|()| 0);
        }
        let r = kernel();
        if r == 0 {
            track("epoll_ctl", || dispatch::note_fresh_epoll(epfd, op, fd, want));
        }
        Ok(r)
    }
}

hook! {
    fn epoll_create(size: c_int) -> c_int;
    real kernel = real::epoll_create;
    on_panic kernel();
    {
        let fd = kernel();
        track("epoll_create", || dispatch::after_epoll_create(fd));
        Ok(fd)
    }
}

hook! {
    fn epoll_create1(flags: c_int) -> c_int;
    real kernel = real::epoll_create1;
    on_panic kernel();
    {
        let fd = kernel();
        track("epoll_create1", || dispatch::after_epoll_create(fd));
        Ok(fd)
    }
}

/// A wait on one of our epoll sets, or the kernel's own wait (`kernel`) for any other fd.
///
/// # Safety
/// `events` must point to `max` (> 0) writable epoll_events.
unsafe fn epoll_wait_on(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
    precise: bool,
    kernel: impl FnOnce() -> c_int,
) -> Result<c_int, c_int> {
    let Some(set) = dispatch::epoll_of(epfd) else {
        return Ok(kernel());
    };
    // SAFETY: by the contract.
    let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
    set.wait(epfd, out, timeout, mask, precise)
        .map(|n| n as c_int)
}

hook! {
    fn epoll_wait(epfd: c_int, events: *mut libc::epoll_event, max: c_int, timeout: c_int)
        -> c_int;
    real kernel = real::epoll_wait,
        pass if table::kind(epfd) != table::K_OBJ || events.is_null() || max <= 0;
    on_panic fail(libc::EIO);
    {
        let t = ms_timeout(timeout);
        // SAFETY: epoll_wait's contract: `events` has room for `max` (> 0 here) events.
        unsafe { epoll_wait_on(epfd, events, max, t, std::ptr::null(), false, kernel) }
    }
}

hook! {
    fn epoll_pwait(
        epfd: c_int,
        events: *mut libc::epoll_event,
        max: c_int,
        timeout: c_int,
        mask: *const libc::sigset_t,
    ) -> c_int;
    real kernel = real::epoll_pwait,
        pass if table::kind(epfd) != table::K_OBJ || events.is_null() || max <= 0;
    on_panic fail(libc::EIO);
    {
        let t = ms_timeout(timeout);
        // SAFETY: epoll_pwait's contract: `events` has room for `max` (> 0 here) events.
        unsafe { epoll_wait_on(epfd, events, max, t, mask, false, kernel) }
    }
}

hook! {
    fn epoll_pwait2(
        epfd: c_int,
        events: *mut libc::epoll_event,
        max: c_int,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int;
    real kernel = real::epoll_pwait2,
        pass if table::kind(epfd) != table::K_OBJ || events.is_null() || max <= 0;
    on_panic fail(libc::EIO);
    {
        // SAFETY: epoll_pwait2's contract: `ts` is null or a valid timespec.
        let t = unsafe { ts_timeout(ts) };
        // SAFETY: epoll_pwait2's contract: `events` has room for `max` (> 0 here) events.
        unsafe { epoll_wait_on(epfd, events, max, t, mask, true, kernel) }
    }
}
