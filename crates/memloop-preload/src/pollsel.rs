//! poll/ppoll (and select/pselect, translated to poll by `hooks`) over a mix of ring
//! connections, epoll sets and kernel fds: rings answer from their state, kernel fds from the
//! kernel, an epoll set from both (its ring members may be ready without any doorbell); a
//! blocking wait sleeps in the kernel on the kernel fds, each ring's doorbell socket and each
//! epoll fd, with every ring — and every ring member of those sets — armed. A connection of
//! ours off its ring (switching, or on TCP after a switch) is the kernel's, filtered: its
//! socket may hold doorbells, which are never readable data.

use crate::conn::{Conn, Dir, Path};
use crate::epoll::EpollSet;
use crate::real;
use crate::table::{self, Entry};
use libc::{c_int, pollfd};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLICE: Duration = Duration::from_millis(200);

/// The longest sleep while a watched connection is in the middle of a switch: its readiness
/// then changes without anything the kernel would report (the peer's leave or stop records,
/// our own promotion finishing on another thread). Epoll's sleeps too.
pub(crate) const IN_FLIGHT: Duration = Duration::from_millis(1);

/// An fd poll must look at beyond the kernel.
enum Watch {
    Ring(Arc<Conn>),
    /// Ours, but off its ring: the kernel answers for its socket, through
    /// [`Conn::off_ring_revents`].
    OffRing(Arc<Conn>),
    Set(Arc<EpollSet>),
    /// Armed for a late ring: no conversion while this poll is in flight.
    Late(#[allow(dead_code)] crate::late::Held),
    /// A UDP socket of ours: the kernel answers for its socket, its rings add `POLLIN`.
    Udp(Arc<crate::udp::UdpSock>),
}

/// The ring connections and epoll sets among `fds` (index, what), settling pending
/// connections that can be.
fn members(fds: &[pollfd]) -> Vec<(usize, Watch)> {
    let mut out = Vec::new();
    for (i, p) in fds.iter().enumerate() {
        if table::kind(p.fd) != table::K_OBJ {
            continue;
        }
        let Some(mut e) = table::get(p.fd) else {
            continue;
        };
        // A late ring never moves a socket a poll sleeps on (its conversion waits for it).
        loop {
            match crate::late::hold(&e) {
                crate::late::Hold::No => break,
                crate::late::Hold::Held(h) => {
                    out.push((i, Watch::Late(h)));
                    break;
                }
                crate::late::Hold::Changed => match table::get(p.fd) {
                    Some(now) => e = now,
                    None => break,
                },
            }
        }
        match &*e {
            Entry::Conn(c) => match settled(c) {
                Path::Ring => out.push((i, Watch::Ring(c.clone()))),
                // Pending: the kernel's readiness stands for it until the decision; a
                // connection that fell back at connect is plain TCP.
                Path::Pending => {}
                _ if c.was_ring() => out.push((i, Watch::OffRing(c.clone()))),
                _ => {}
            },
            Entry::Epoll(s) => out.push((i, Watch::Set(s.clone()))),
            Entry::Udp(u) => out.push((i, Watch::Udp(u.clone()))),
            _ => {}
        }
    }
    out
}

/// The connection's path after dealing with a switch asked of it.
fn settled(c: &Conn) -> Path {
    if !c.switch_quiet() {
        c.settle_switch_nowait();
    }
    match c.resolve(false) {
        // Sleeping in the kernel on it: the server must ring when it accepts — unless it
        // decided already, and then no doorbell comes: the decision is taken now.
        Path::Pending if !c.expect_accept_bell() => c.resolve(true),
        p => p,
    }
}

/// A ring member that has a switch to deal with, or left its ring meanwhile, or one off its
/// ring that is back on it: the members must be looked at again.
fn stale(members: &[(usize, Watch)]) -> bool {
    members.iter().any(|(_, w)| match w {
        Watch::Ring(c) => c.switch_pending() || c.path() != Path::Ring,
        Watch::OffRing(c) => c.path() == Path::Ring,
        Watch::Set(_) | Watch::Late(_) | Watch::Udp(_) => false,
    })
}

fn ring_revents(c: &Conn, events: i16) -> i16 {
    c.revents() & (events | libc::POLLHUP | libc::POLLERR)
}

/// What a member reports from its own state (a set: readable if a ring member is ready).
fn own_revents(w: &Watch, events: i16) -> i16 {
    match w {
        Watch::Ring(c) if c.path() != Path::Ring || c.switch_pending() => 0,
        Watch::Ring(c) => ring_revents(c, events),
        // Not without the kernel's answer for its socket (`scan`).
        Watch::OffRing(_) | Watch::Late(_) => 0,
        Watch::Set(s) if s.peek().is_some() => events & libc::POLLIN,
        Watch::Set(_) => 0,
        Watch::Udp(u) if u.ring_readable() => events & (libc::POLLIN | libc::POLLRDNORM),
        Watch::Udp(_) => 0,
    }
}

fn is_ring(members: &[(usize, Watch)], i: usize) -> bool {
    members
        .iter()
        .any(|(j, w)| *j == i && matches!(w, Watch::Ring(c) if c.path() == Path::Ring))
}

/// One pass: the kernel's view of everything but rings (timeout 0), then our own states.
fn scan(fds: &mut [pollfd], members: &[(usize, Watch)]) -> Result<usize, c_int> {
    for (_, w) in members {
        if let Watch::Set(s) = w {
            s.drain_owed();
        }
    }
    let mut kernel: Vec<pollfd> = Vec::new();
    let mut kidx = Vec::new();
    for (i, p) in fds.iter_mut().enumerate() {
        p.revents = 0;
        if !is_ring(members, i) {
            kernel.push(*p);
            kidx.push(i);
        }
    }
    // Before the kernel looks: the TCP phase of each connection off its ring.
    let phases: Vec<Option<u64>> = members
        .iter()
        .map(|(_, w)| match w {
            Watch::OffRing(c) => c.tcp_phase(),
            _ => None,
        })
        .collect();
    if !kernel.is_empty() {
        real::poll_now(&mut kernel)?;
        for (k, &i) in kidx.iter().enumerate() {
            fds[i].revents = kernel[k].revents;
        }
    }
    settle_pending(fds);
    for ((i, w), phase) in members.iter().zip(phases) {
        let own = own_revents(w, fds[*i].events);
        let p = &mut fds[*i];
        match w {
            Watch::Ring(_) => p.revents = own,
            Watch::OffRing(c) => {
                let ev = c.off_ring_revents(p.revents, phase);
                p.revents = ev & (p.events | libc::POLLHUP | libc::POLLERR);
            }
            Watch::Set(s) => {
                let readable = libc::POLLIN | libc::POLLRDNORM;
                if own == 0 && p.revents & readable != 0 && !s.still_readable(p.fd) {
                    p.revents &= !readable;
                }
                p.revents |= own;
            }
            // The kernel's answer stands.
            Watch::Late(_) => {}
            Watch::Udp(_) => p.revents |= own,
        }
    }
    Ok(fds.iter().filter(|p| p.revents != 0).count())
}

/// A pending connection the kernel reports ready gets its decision now.
fn settle_pending(fds: &mut [pollfd]) {
    for p in fds.iter_mut().filter(|p| p.revents != 0) {
        if let Some(c) = table::conn(p.fd) {
            if c.path() == Path::Pending && c.resolve(true) == Path::Ring {
                c.drain();
                p.revents = ring_revents(&c, p.events);
            }
        }
    }
}

fn any_own(fds: &[pollfd], members: &[(usize, Watch)]) -> usize {
    members
        .iter()
        .filter(|(j, w)| own_revents(w, fds[*j].events) != 0)
        .count()
}

/// poll over fds of which at least one is a ring connection or an epoll set.
pub fn poll(
    fds: &mut [pollfd],
    timeout: Option<Duration>,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    crate::engine::ensure_heartbeat();
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut members = members(fds);
    let n = scan(fds, &members)?;
    if n > 0 || timeout == Some(Duration::ZERO) {
        return Ok(n);
    }
    if spin(fds, &members) {
        members = self::members(fds);
        let n = scan(fds, &members)?;
        if n > 0 {
            return Ok(n);
        }
    }
    loop {
        let left = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(l) if !l.is_zero() => l,
                _ => return Ok(0),
            },
            None => SLICE,
        };
        // A VM's death shows only as a silent heartbeat (1.5 s): look at it twice as often
        // then, so the program hears of it within 2 s.
        let elsewhere = members
            .iter()
            .any(|(_, w)| matches!(w, Watch::Ring(c) if c.peer_elsewhere()));
        let slice = match elsewhere {
            true => memloop::LIVENESS_SLICE_VM,
            false => SLICE,
        };
        block(fds, &members, left.min(slice), sigmask)?;
        if crate::cancel::asked_here() {
            return Err(libc::EINTR);
        }
        members = self::members(fds);
        let n = scan(fds, &members)?;
        if n > 0 {
            return Ok(n);
        }
        for (_, w) in &members {
            if let Watch::Ring(c) = w {
                c.watch_peer();
            }
        }
    }
}

/// Spins with the first ring's adaptive window (it stands for the whole set).
fn spin(fds: &mut [pollfd], members: &[(usize, Watch)]) -> bool {
    let first = members.iter().find_map(|(_, w)| match w {
        Watch::Ring(c) => Some(c.clone()),
        Watch::OffRing(_) | Watch::Set(_) | Watch::Late(_) | Watch::Udp(_) => None,
    });
    let Some(first) = first else {
        return spin_udp(fds, members);
    };
    let rings: Vec<&Conn> = members
        .iter()
        .filter_map(|(_, w)| match w {
            Watch::Ring(c) => Some(&**c),
            _ => None,
        })
        .collect();
    let mut i = 0u32;
    first.spin(&rings, || {
        i += 1;
        let found = if i % 8 == 0 {
            scan(fds, members).unwrap_or(0)
        } else {
            any_own(fds, members)
        };
        found > 0 || stale(members)
    })
}

/// A set with UDP sockets of ours but no ring connection spins in the first one's window.
fn spin_udp(fds: &mut [pollfd], members: &[(usize, Watch)]) -> bool {
    let Some(first) = members.iter().find_map(|(_, w)| match w {
        Watch::Udp(u) => Some(u.clone()),
        _ => None,
    }) else {
        return false;
    };
    let mut i = 0u32;
    first.spin(|| {
        i += 1;
        let found = if i % 8 == 0 {
            scan(fds, members).unwrap_or(0)
        } else {
            any_own(fds, members)
        };
        found > 0
    })
}

/// The directions a poll interest sleeps for.
fn dirs(events: i16) -> impl Iterator<Item = Dir> {
    let r = (events & libc::POLLIN != 0).then_some(Dir::Read);
    let w = (events & libc::POLLOUT != 0).then_some(Dir::Write);
    r.into_iter().chain(w)
}

/// Arms the members for a sleep that also listens on wake target `target`; returns which
/// ring arms named it (per member and direction, for [`leave`]).
fn enter(fds: &[pollfd], members: &[(usize, Watch)], target: Option<u32>) -> Vec<bool> {
    let mut targeted = Vec::new();
    for (i, w) in members {
        match w {
            Watch::Ring(c) => {
                c.enter_wait();
                dirs(fds[*i].events).for_each(|d| targeted.push(c.arm_for(d, target)));
            }
            Watch::OffRing(_) | Watch::Late(_) => {}
            // (A nested set's members with a switch asked are dealt with by its own waits
            // and the heartbeat's sweep.)
            Watch::Set(s) => drop(s.sleep_enter()),
            Watch::Udp(u) => u.enter_sleep(),
        }
    }
    targeted
}

/// `udp_saw`: for each UDP member in order, whether its wake socket was readable.
fn leave(fds: &[pollfd], members: &[(usize, Watch)], targeted: &[bool], udp_saw: &[bool]) {
    let mut t = targeted.iter();
    let mut saw = udp_saw.iter();
    for (i, w) in members {
        match w {
            Watch::Ring(c) => {
                for d in dirs(fds[*i].events) {
                    c.disarm_for(d, t.next().copied().unwrap_or(false));
                }
                c.leave_wait();
            }
            Watch::OffRing(_) | Watch::Late(_) => {}
            Watch::Set(s) => s.sleep_leave(),
            Watch::Udp(u) => u.leave_sleep(saw.next().copied().unwrap_or(true)),
        }
    }
}

thread_local! {
    /// This thread's wake socket for its poll and select sleeps (made at its first sleep on
    /// a ring; none where it cannot be). A fork child makes its own: its parent's threads
    /// may sleep on the inherited one.
    static WAKE: std::cell::RefCell<Option<(u32, Option<crate::wake::WakeSocket>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's wake socket's fd and target, if it has one.
fn with_wake<R>(f: impl FnOnce(Option<(c_int, u32)>) -> R) -> R {
    let me = real::getpid();
    let got = WAKE.try_with(|w| {
        let mut w = w.borrow_mut();
        let usable = |s: &Option<crate::wake::WakeSocket>| s.as_ref().map_or(true, |s| s.alive());
        if !matches!(&*w, Some((pid, s)) if *pid == me && usable(s)) {
            // (A parent's socket: our copy of its fd closes, its name stays the parent's.)
            drop(w.take());
            *w = Some((me, crate::wake::WakeSocket::create()));
        }
        w.as_ref()
            .and_then(|(_, s)| s.as_ref())
            .map(|s| (s.fd(), s.target()))
    });
    f(got.ok().flatten())
}

/// Arms the rings and sets, re-checks, and sleeps in the kernel on everything at once.
fn block(
    fds: &[pollfd],
    members: &[(usize, Watch)],
    left: Duration,
    sigmask: *const libc::sigset_t,
) -> Result<(), c_int> {
    let rings = members.iter().any(|(_, w)| matches!(w, Watch::Ring(_)));
    if !rings {
        return block_with(fds, members, left, sigmask, None);
    }
    with_wake(|wake| block_with(fds, members, left, sigmask, wake))
}

/// [`block`], listening on the wake socket `wake` (fd, target) too, if any.
fn block_with(
    fds: &[pollfd],
    members: &[(usize, Watch)],
    left: Duration,
    sigmask: *const libc::sigset_t,
    wake: Option<(c_int, u32)>,
) -> Result<(), c_int> {
    let targeted = enter(fds, members, wake.map(|(_, t)| t));
    let ready = any_own(fds, members) > 0 || stale(members);
    let mut left = left;
    if members
        .iter()
        .any(|(_, w)| matches!(w, Watch::Set(s) if s.in_flight()))
    {
        left = left.min(IN_FLIGHT);
    }
    let mut set: Vec<pollfd> = fds
        .iter()
        .enumerate()
        .map(|(i, p)| match members.iter().find(|(j, _)| *j == i) {
            Some((_, Watch::Ring(c))) => pollfd {
                fd: c.kfd(),
                events: libc::POLLIN,
                revents: 0,
            },
            Some((_, Watch::OffRing(c))) => {
                let (events, in_flight) = c.off_ring_sleep(p.events);
                if in_flight {
                    left = left.min(IN_FLIGHT);
                }
                pollfd {
                    fd: p.fd,
                    events,
                    revents: 0,
                }
            }
            _ => pollfd {
                fd: p.fd,
                events: p.events,
                revents: 0,
            },
        })
        .collect();
    // Each UDP socket's own wake socket: its senders' wake-ups (read by its last sleeper out).
    let mut udp_at = Vec::new();
    for (_, w) in members {
        if let Watch::Udp(u) = w {
            udp_at.push(set.len());
            set.push(pollfd {
                fd: u.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
    }
    if let Some((fd, _)) = wake {
        set.push(pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    let r = if ready {
        Ok(0)
    } else {
        real::ppoll_raw(&mut set, Some(left), sigmask)
    };
    if let (Some((fd, _)), Some(p)) = (wake, set.last()) {
        if p.revents != 0 {
            real::drain_own(fd); // (the caller's scan of the rings comes after)
        }
    }

    // A ring's socket the kernel found readable holds a doorbell or the peer's FIN: read by
    // the last sleeper out (`leave_wait`).
    for (i, w) in members {
        if let (Watch::Ring(c), Some(p)) = (w, set.get(*i)) {
            if p.revents != 0 {
                c.note_socket_ready();
            }
        }
    }
    let udp_saw: Vec<bool> = udp_at.iter().map(|&k| set[k].revents != 0).collect();
    leave(fds, members, &targeted, &udp_saw);
    r.map(|_| ())
}
