//! poll/ppoll (and select/pselect, translated to poll by `ffi`) over a mix of ring
//! connections and kernel fds: rings answer from their state, kernel fds from the kernel, and
//! a blocking wait sleeps in the kernel on the kernel fds plus each ring's doorbell socket.

use crate::conn::{Conn, Dir, PENDING, RING};
use crate::real;
use crate::table;
use libc::{c_int, pollfd};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLICE: Duration = Duration::from_millis(200);

/// The ring connections among `fds` (index, connection), settling pending ones that can be.
pub fn ring_members(fds: &[pollfd]) -> Vec<(usize, Arc<Conn>)> {
    let mut out = Vec::new();
    for (i, p) in fds.iter().enumerate() {
        if table::kind(p.fd) != table::K_OBJ {
            continue;
        }
        if let Some(c) = table::conn(p.fd) {
            if c.resolve(false) == RING {
                out.push((i, c));
            } else if c.path() == PENDING {
                // The kernel's readiness stands for it until the decision; an event settles it.
                continue;
            }
        }
    }
    out
}

fn ring_revents(c: &Conn, events: i16) -> i16 {
    c.revents() & (events | libc::POLLHUP | libc::POLLERR)
}

/// One pass: ring states, then the kernel's view of the rest (timeout 0).
fn scan(fds: &mut [pollfd], rings: &[(usize, Arc<Conn>)]) -> Result<usize, c_int> {
    let mut kernel: Vec<pollfd> = Vec::new();
    let mut kidx = Vec::new();
    for (i, p) in fds.iter_mut().enumerate() {
        p.revents = 0;
        if !rings.iter().any(|(j, _)| *j == i) {
            kernel.push(*p);
            kidx.push(i);
        }
    }
    if !kernel.is_empty() {
        real::poll_now(&mut kernel)?;
        for (k, &i) in kidx.iter().enumerate() {
            fds[i].revents = kernel[k].revents;
        }
    }
    settle_pending(fds);
    for (i, c) in rings {
        fds[*i].revents = ring_revents(c, fds[*i].events);
    }
    Ok(fds.iter().filter(|p| p.revents != 0).count())
}

/// A pending connection the kernel reports ready gets its decision now.
fn settle_pending(fds: &mut [pollfd]) {
    for p in fds.iter_mut().filter(|p| p.revents != 0) {
        if table::kind(p.fd) == table::K_OBJ {
            if let Some(c) = table::conn(p.fd) {
                if c.path() == PENDING && c.resolve(true) == RING {
                    c.drain();
                    p.revents = ring_revents(&c, p.events);
                }
            }
        }
    }
}

/// poll over fds of which at least one is a ring connection.
pub fn poll(
    fds: &mut [pollfd],
    timeout: Option<Duration>,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut rings = ring_members(fds);
    let n = scan(fds, &rings)?;
    if n > 0 || timeout == Some(Duration::ZERO) {
        return Ok(n);
    }
    let mut found = 0;
    let mut i = 0u32;
    // The first ring's adaptive window stands for the whole set.
    if let Some((_, first)) = rings.first().cloned() {
        first.spin(|| {
            i += 1;
            found = if i % 8 == 0 {
                scan(fds, &rings).unwrap_or(0)
            } else {
                rings
                    .iter()
                    .filter(|(j, c)| ring_revents(c, fds[*j].events) != 0)
                    .count()
            };
            found > 0
        });
    }
    if found > 0 {
        return scan(fds, &rings);
    }
    loop {
        let left = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(l) if !l.is_zero() => l,
                _ => return Ok(0),
            },
            None => SLICE,
        };
        block(fds, &rings, left.min(SLICE), sigmask)?;
        rings = ring_members(fds);
        let n = scan(fds, &rings)?;
        if n > 0 {
            return Ok(n);
        }
        rings.iter().for_each(|(_, c)| c.watch_peer());
    }
}

/// Arms the rings, re-checks, and sleeps in the kernel on everything at once.
fn block(
    fds: &[pollfd],
    rings: &[(usize, Arc<Conn>)],
    left: Duration,
    sigmask: *const libc::sigset_t,
) -> Result<(), c_int> {
    let mut armed = Vec::new();
    for (i, c) in rings {
        if fds[*i].events & libc::POLLIN != 0 {
            c.arm(Dir::Read);
            armed.push((c.clone(), Dir::Read));
        }
        if fds[*i].events & libc::POLLOUT != 0 {
            c.arm(Dir::Write);
            armed.push((c.clone(), Dir::Write));
        }
    }
    let ready = rings
        .iter()
        .any(|(i, c)| ring_revents(c, fds[*i].events) != 0);
    let mut set: Vec<pollfd> = fds
        .iter()
        .enumerate()
        .map(|(i, p)| match rings.iter().find(|(j, _)| *j == i) {
            Some((_, c)) => pollfd {
                fd: c.kfd(),
                events: libc::POLLIN,
                revents: 0,
            },
            None => pollfd {
                fd: p.fd,
                events: p.events,
                revents: 0,
            },
        })
        .collect();
    let r = if ready {
        Ok(0)
    } else {
        real::ppoll_raw(&mut set, Some(left), sigmask)
    };
    for (c, d) in &armed {
        c.disarm(*d);
    }
    for (i, c) in rings {
        if set[*i].revents != 0 {
            c.drain();
        }
    }
    r.map(|_| ())
}
