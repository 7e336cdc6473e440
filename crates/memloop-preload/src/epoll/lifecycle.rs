//! A set across `fork` (its lock held by the atfork handlers) and `exec` (the program's own
//! registrations restored in the kernel for the new image, which takes the set over again).

use super::*;

impl EpollSet {
    /// Before `exec`, for a set the new image inherits: the kernel registrations get the
    /// program's own events and data back (the new image knows only those; its memloop, if
    /// any, takes them over again from `/proc/self/fdinfo`).
    pub fn prepare_exec(&self, epfd: c_int) {
        let mut st = self.st.lock();
        // (The new image knows nothing of registrations the program removed.)
        let parked: Vec<c_int> = st.parked.keys().copied().collect();
        parked
            .into_iter()
            .for_each(|fd| super::ctl::unpark(&mut st, epfd, fd));
        for it in st.items.values().filter(|it| it.fd_open) {
            let op = if it.reg == Reg::Dormant {
                libc::EPOLL_CTL_ADD
            } else {
                libc::EPOLL_CTL_MOD
            };
            let events = it.events & !EXCLUSIVE;
            kernel::ctl_or_log("give back for exec", epfd, op, it.fd, events, it.data);
        }
    }

    /// The exec failed: our own registrations again.
    pub fn restore_after_exec(&self, epfd: c_int) {
        let st = self.st.lock();
        for (id, it) in st.items.iter().filter(|(_, it)| it.fd_open) {
            match it.kernel_events() {
                Some(kev) => {
                    kernel::ctl_or_log(
                        "restore after exec",
                        epfd,
                        libc::EPOLL_CTL_MOD,
                        it.fd,
                        kev,
                        kernel::tag(*id),
                    );
                }
                None => {
                    kernel::ctl_or_log(
                        "restore after exec",
                        epfd,
                        libc::EPOLL_CTL_DEL,
                        it.fd,
                        0,
                        0,
                    );
                }
            }
        }
    }
}

/// Whether a data word found in a set inherited across exec is a tag of the previous image.
pub fn is_old_tag(data: u64) -> bool {
    kernel::looks_like_old_tag(data)
}

/// Removes a tagged registration inherited across exec (its program data is unknown: the
/// previous image exec'd without going through a hooked `exec` function).
pub fn forget_inherited(epfd: c_int, fd: c_int) {
    kernel::ctl_or_log("forget inherited", epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
}

/// Sets whose locks the atfork handlers hold across `fork`.
static HELD: ForkMutex<Vec<Arc<EpollSet>>> = ForkMutex::new(Vec::new());

/// atfork prepare: takes every set's lock, so the child never inherits one held by a thread
/// it does not have. All or none, retried: a thread holding a set may be waiting for a
/// nested set's lock, which we may hold.
pub fn hold_for_fork(sets: Vec<Arc<EpollSet>>) {
    loop {
        let taken = sets
            .iter()
            .take_while(|s| s.st.try_acquire_for_fork())
            .count();
        if taken == sets.len() {
            break;
        }
        sets[..taken].iter().for_each(|s| s.st.release_after_fork());
        std::thread::yield_now();
    }
    HELD.acquire_for_fork(|held| *held = sets);
}

/// atfork parent and child: releases what [`hold_for_fork`] took.
pub fn release_after_fork() {
    HELD.release_after_fork();
    let sets = std::mem::take(&mut *HELD.lock());
    sets.iter().for_each(|s| s.st.release_after_fork());
}
