//! Arming, re-arming and disarming members for the sleepers of a set, and kicks: a
//! registration that briefly asks for `EPOLLOUT` so the kernel wakes the sleepers.

use super::*;

/// Arms an item for the sleepers of its set (a fired one-shot waits for its re-arm).
pub(super) fn arm(it: &mut Item) {
    if it.armed || it.disabled {
        return;
    }
    match &it.target {
        Target::Conn(c) if c.path() == Path::Ring => {
            c.enter_wait();
            let (r, w) = rules::wants(it.events);
            let target = (it.wake != 0).then_some(it.wake);
            it.targeted = [false; 2];
            if r {
                it.targeted[0] = c.arm_for(Dir::Read, target);
            }
            if w {
                it.targeted[1] = c.arm_for(Dir::Write, target);
            }
        }
        Target::Conn(_) => return,
        Target::Set(s) => drop(s.sleep_enter()),
        Target::Udp(u) => u.enter_sleep(),
    }
    (it.armed, it.lasting) = (true, false);
}

/// Arms a large set's member for good before it goes quiet (`index`), or makes the arm a
/// sleeper made lasting. Only where the peer wakes the set's socket, naming the channel: a
/// doorbell arm that no sleeper counts could have its byte read by another thread before
/// the set sees it. False if the item cannot be armed so.
pub(super) fn arm_lasting(it: &mut Item) -> bool {
    if it.disabled {
        return true;
    }
    let Target::Conn(c) = &it.target else {
        return false;
    };
    if it.wake == 0 || !c.wakes_by_name() || c.path() != Path::Ring {
        return false;
    }
    let (r, w) = rules::wants(it.events);
    if !it.armed {
        it.targeted = [false; 2];
        if r {
            it.targeted[0] = c.arm_for(Dir::Read, Some(it.wake));
        }
        if w {
            it.targeted[1] = c.arm_for(Dir::Write, Some(it.wake));
        }
        (it.armed, it.lasting) = (true, true);
    } else {
        if !it.lasting {
            // A sleeper's arm: it stays, no longer counted as a sleeper on the connection.
            c.leave_wait();
            it.lasting = true;
        }
        rearm(it);
    }
    (!r || it.targeted[0]) && (!w || it.targeted[1])
}

pub(super) fn rearm(it: &mut Item) {
    match &it.target {
        Target::Conn(c) => {
            let (r, w) = rules::wants(it.events);
            if r {
                c.rearm(Dir::Read);
            }
            if w {
                c.rearm(Dir::Write);
            }
        }
        Target::Set(s) => s.rearm_all(),
        Target::Udp(u) => u.rearm(),
    }
}

/// Disarms an item; true if the peer sent its wake-up to the set's wake socket meanwhile.
pub(super) fn disarm(it: &mut Item) -> bool {
    if !it.armed {
        return false;
    }
    it.armed = false;
    match &it.target {
        Target::Conn(c) => {
            let (r, w) = rules::wants(it.events);
            let mut woke = false;
            if r {
                woke |= c.disarm_for(Dir::Read, it.targeted[0]);
            }
            if w {
                woke |= c.disarm_for(Dir::Write, it.targeted[1]);
            }
            it.targeted = [false; 2];
            if !std::mem::take(&mut it.lasting) {
                c.leave_wait();
            }
            woke
        }
        Target::Set(s) => {
            s.sleep_leave();
            false
        }
        Target::Udp(u) => {
            // (Its wake socket is registered edge-triggered: a wake-up left unread never
            // wakes the set twice; the flag says when one was sent.)
            u.leave_sleep(false);
            false
        }
    }
}

impl EpollSet {
    /// A further sleeper of a containing set: refresh the arms of the members.
    pub(super) fn rearm_all(&self) {
        let mut st = self.st.lock();
        for it in st.items.values_mut() {
            if it.armed {
                rearm(it);
            } else {
                arm(it);
            }
        }
    }
}

/// Wakes the sleepers if `it` is ready now.
pub(super) fn kick_if_ready(epfd: c_int, id: u32, it: &mut Item) {
    if it.would_report() {
        kick(epfd, id, it);
    }
}

/// Makes the kernel report the item's registration at once (`EPOLLOUT` on a socket is
/// ready), so every thread asleep on the set wakes; [`unkick`] undoes it.
pub(super) fn kick(epfd: c_int, id: u32, it: &mut Item) {
    match &it.target {
        Target::Set(s) => s.kick_ready(),
        Target::Conn(_) | Target::Udp(_) if !it.fd_open || it.kicked => {}
        Target::Conn(_) | Target::Udp(_) => {
            let op = if it.reg == Reg::Dormant {
                it.reg = Reg::Ring;
                libc::EPOLL_CTL_ADD
            } else {
                libc::EPOLL_CTL_MOD
            };
            it.kicked = true;
            let kev = it.kernel_events().unwrap_or(IN | OUT);
            if kernel::ctl(epfd, op, it.fd, kev, kernel::tag(id)).is_err() {
                it.kicked = false;
            }
        }
    }
}

pub(super) fn unkick(epfd: c_int, id: u32, it: &mut Item) {
    it.kicked = false;
    if let (Some(kev), true) = (it.kernel_events(), it.fd_open) {
        kernel::ctl_or_log(
            "unkick",
            epfd,
            libc::EPOLL_CTL_MOD,
            it.fd,
            kev,
            kernel::tag(id),
        );
    }
}

/// A one-shot interest fired: quiet until the program re-arms it.
pub(super) fn disable(epfd: c_int, id: u32, it: &mut Item) {
    it.disabled = true;
    if it.reg == Reg::Set && it.fd_open {
        if let Some(kev) = it.kernel_events() {
            kernel::ctl_or_log(
                "one-shot fired",
                epfd,
                libc::EPOLL_CTL_MOD,
                it.fd,
                kev,
                kernel::tag(id),
            );
        }
    }
}
