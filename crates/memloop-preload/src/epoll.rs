//! epoll over a mix of ring connections and kernel fds.
//!
//! A ring connection is registered in the kernel's epoll set for `EPOLLIN` only, tagged, so
//! its doorbell byte (or FIN) wakes the set; the program's own interest (events, data, `ET`,
//! `ONESHOT`) is kept here and answered from the rings' state. Kernel fds are untouched.

use crate::conn::{Conn, Dir, Spinner, PENDING, RING, TCP};
use crate::forklock::ForkMutex;
use crate::real;
use libc::{c_int, epoll_event};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// High bits of the data word of our own registrations (low 32 bits: the fd).
const TAG: u64 = 0x4d4c_7470_0000_0000;
const TAG_MASK: u64 = 0xffff_ffff_0000_0000;
const SLICE: Duration = Duration::from_millis(200);
/// While rings keep the set busy, the kernel's own fds are polled on one call in this many.
const KERNEL_EVERY: u32 = 4;
/// Most kernel events fetched per call (the rest wait for the next call, as with the kernel).
const MAX_KERNEL_BATCH: usize = 1024;

thread_local! {
    static TMP: std::cell::RefCell<Vec<epoll_event>> = const { std::cell::RefCell::new(Vec::new()) };
}

struct Interest {
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    /// The path our kernel registration was made for.
    registered: u8,
    /// Edge-triggered: what was last reported (progress, events).
    last: Option<((u64, u64), u32)>,
    /// One-shot interest that already fired.
    disabled: bool,
}

pub struct EpollSet {
    epfd: c_int,
    calls: AtomicU32,
    spinner: Spinner,
    items: ForkMutex<BTreeMap<c_int, Interest>>,
}

fn kernel_events(path: u8, events: u32) -> u32 {
    let base = libc::EPOLLIN as u32;
    if path == PENDING {
        // Undecided: the kernel's own readiness (connect completion) plus the accept doorbell.
        base | (events & (libc::EPOLLOUT | libc::EPOLLRDHUP) as u32)
    } else {
        base
    }
}

fn poll_to_epoll(ev: i16) -> u32 {
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

impl EpollSet {
    pub fn new(epfd: c_int) -> Arc<EpollSet> {
        Arc::new(EpollSet {
            epfd,
            calls: AtomicU32::new(0),
            spinner: Spinner::new(Duration::from_micros(50)),
            items: ForkMutex::new(BTreeMap::new()),
        })
    }

    /// `epoll_ctl` for a connection of ours.
    pub fn ctl(
        &self,
        op: c_int,
        fd: c_int,
        conn: &Arc<Conn>,
        ev: Option<(u32, u64)>,
    ) -> Result<(), c_int> {
        let mut items = self.items.lock();
        match op {
            libc::EPOLL_CTL_ADD => {
                if items.contains_key(&fd) {
                    return Err(libc::EEXIST);
                }
                let (events, data) = ev.ok_or(libc::EFAULT)?;
                let path = conn.path();
                kernel_ctl(
                    self.epfd,
                    libc::EPOLL_CTL_ADD,
                    fd,
                    kernel_events(path, events),
                    TAG | fd as u32 as u64,
                )?;
                items.insert(
                    fd,
                    Interest {
                        conn: conn.clone(),
                        events,
                        data,
                        registered: path,
                        last: None,
                        disabled: false,
                    },
                );
            }
            libc::EPOLL_CTL_MOD => {
                let (events, data) = ev.ok_or(libc::EFAULT)?;
                let it = items.get_mut(&fd).ok_or(libc::ENOENT)?;
                let path = it.conn.path();
                kernel_ctl(
                    self.epfd,
                    libc::EPOLL_CTL_MOD,
                    fd,
                    kernel_events(path, events),
                    TAG | fd as u32 as u64,
                )?;
                *it = Interest {
                    conn: it.conn.clone(),
                    events,
                    data,
                    registered: path,
                    last: None,
                    disabled: false,
                };
            }
            libc::EPOLL_CTL_DEL => {
                items.remove(&fd).ok_or(libc::ENOENT)?;
                kernel_ctl(self.epfd, libc::EPOLL_CTL_DEL, fd, 0, 0)?;
            }
            _ => return Err(libc::EINVAL),
        }
        Ok(())
    }

    /// Takes over a registration the program made in the kernel before `fd` became ours.
    pub fn adopt(&self, fd: c_int, conn: &Arc<Conn>, events: u32, data: u64) -> Result<(), c_int> {
        let path = conn.path();
        kernel_ctl(
            self.epfd,
            libc::EPOLL_CTL_MOD,
            fd,
            kernel_events(path, events),
            TAG | fd as u32 as u64,
        )?;
        let it = Interest {
            conn: conn.clone(),
            events,
            data,
            registered: path,
            last: None,
            disabled: false,
        };
        self.items.lock().insert(fd, it);
        Ok(())
    }

    /// The fd was closed: the kernel dropped its registration, we drop ours.
    pub fn forget(&self, fd: c_int) {
        self.items.lock().remove(&fd);
    }

    /// `epoll_wait`/`epoll_pwait`.
    pub fn wait(
        &self,
        out: &mut [epoll_event],
        timeout: Option<Duration>,
        sigmask: *const libc::sigset_t,
    ) -> Result<usize, c_int> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // The program may offer room for thousands of events (redis: its whole fd limit): take
        // at most MAX_KERNEL_BATCH from the kernel per call, in a buffer kept per thread.
        let room = out.len().min(MAX_KERNEL_BATCH);
        TMP.with(|t| {
            let mut tmp = t.borrow_mut();
            if tmp.len() < room {
                tmp.resize(room, epoll_event { events: 0, u64: 0 });
            }
            self.wait_with(out, &mut tmp[..room], timeout, deadline, sigmask)
        })
    }

    fn wait_with(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        timeout: Option<Duration>,
        deadline: Option<Instant>,
        sigmask: *const libc::sigset_t,
    ) -> Result<usize, c_int> {
        let mut spun = false;
        loop {
            let n = self.harvest(out, tmp)?;
            if n > 0 || timeout == Some(Duration::ZERO) {
                return Ok(n);
            }
            if !spun {
                spun = true;
                let spin = self.spin_window();
                let mut i = 0u32;
                let mut got = 0;
                self.spinner.spin(spin, || {
                    i += 1;
                    got = if i % 8 == 0 {
                        self.harvest(out, tmp).unwrap_or(0)
                    } else {
                        self.collect(out)
                    };
                    got > 0
                });
                if got > 0 {
                    return Ok(got);
                }
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => l,
                    _ => return Ok(0),
                },
                None => SLICE,
            };
            let n = self.block(out, tmp, left.min(SLICE), sigmask)?;
            if n > 0 {
                return Ok(n);
            }
            self.watch_peers();
        }
    }

    /// Across kernels nothing closes a vanished VM's socket: look at the peers' heartbeats.
    fn watch_peers(&self) {
        let conns: Vec<_> = self.items.lock().values().map(|i| i.conn.clone()).collect();
        conns.iter().for_each(|c| c.watch_peer());
    }

    fn spin_window(&self) -> Duration {
        self.items
            .lock()
            .values()
            .next()
            .map_or(Duration::ZERO, |i| i.conn.spin_window())
    }

    /// Ring readiness plus a non-blocking look at the kernel set.
    fn harvest(&self, out: &mut [epoll_event], tmp: &mut [epoll_event]) -> Result<usize, c_int> {
        let mut reported = Vec::new();
        let n = self.collect_except(out, &mut reported);
        // With rings ready, look at the kernel's fds only every few calls: the system call
        // costs as much as a ring round trip, and a kernel fd still waits at most a few calls.
        let turn = self.calls.fetch_add(1, Relaxed);
        if n == out.len() || (n > 0 && turn % KERNEL_EVERY != 0) {
            return Ok(n);
        }
        let want = (out.len() - n).min(tmp.len());
        let k = real_wait(self.epfd, &mut tmp[..want], 0, std::ptr::null())?;
        let extra = self.translate(&tmp[..k], &mut out[n..]);
        // Doorbells may have made more rings readable: look again (not at those already
        // reported) if there is room.
        let m = n + extra;
        if extra == 0 || m == out.len() {
            return Ok(m);
        }
        Ok(m + self.collect_except(&mut out[m..], &mut reported))
    }

    /// Arms every ring interest, re-checks, then sleeps in the kernel.
    fn block(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        left: Duration,
        sigmask: *const libc::sigset_t,
    ) -> Result<usize, c_int> {
        let armed = self.arm();
        let n = self.collect(out);
        let r = if n > 0 {
            Ok(0)
        } else {
            real_wait(
                self.epfd,
                tmp,
                left.as_millis().max(1).min(i32::MAX as u128) as c_int,
                sigmask,
            )
        };
        for (c, d) in &armed {
            c.disarm(*d);
        }
        if n > 0 {
            return Ok(n);
        }
        let k = r?;
        let m = self.translate(&tmp[..k], out);
        Ok(m + self.collect(&mut out[m..]))
    }

    fn arm(&self) -> Vec<(Arc<Conn>, Dir)> {
        let items = self.items.lock();
        let mut armed = Vec::new();
        for it in items
            .values()
            .filter(|i| !i.disabled && i.conn.path() == RING)
        {
            if it.events & libc::EPOLLIN as u32 != 0 {
                it.conn.arm(Dir::Read);
                armed.push((it.conn.clone(), Dir::Read));
            }
            if it.events & libc::EPOLLOUT as u32 != 0 {
                it.conn.arm(Dir::Write);
                armed.push((it.conn.clone(), Dir::Write));
            }
        }
        armed
    }

    /// Ready ring interests → program events.
    fn collect(&self, out: &mut [epoll_event]) -> usize {
        self.collect_except(out, &mut Vec::new())
    }

    /// Like [`Self::collect`], skipping the fds in `reported` and adding those it reports.
    fn collect_except(&self, out: &mut [epoll_event], reported: &mut Vec<c_int>) -> usize {
        if out.is_empty() {
            return 0;
        }
        let mut items = self.items.lock();
        let mut n = 0;
        for (fd, it) in items.iter_mut() {
            if n == out.len() {
                break;
            }
            if it.disabled || it.conn.path() != RING || reported.contains(fd) {
                continue;
            }
            let ready = poll_to_epoll(it.conn.revents());
            let report = ready & (it.events | (libc::EPOLLHUP | libc::EPOLLERR) as u32);
            if report == 0 {
                it.last = None;
                continue;
            }
            if it.events & libc::EPOLLET as u32 != 0 {
                // Edge: report again only when something this interest watches moved (new
                // data for EPOLLIN, freed space for EPOLLOUT) or the ready set changed.
                let (rx_tail, tx_head) = it.conn.progress();
                let rx = if it.events & libc::EPOLLIN as u32 != 0 {
                    rx_tail
                } else {
                    0
                };
                let tx = if it.events & libc::EPOLLOUT as u32 != 0 {
                    tx_head
                } else {
                    0
                };
                let now = ((rx, tx), report);
                if it.last == Some(now) {
                    continue;
                }
                it.last = Some(now);
            }
            if it.events & libc::EPOLLONESHOT as u32 != 0 {
                it.disabled = true;
            }
            out[n] = epoll_event {
                events: report,
                u64: it.data,
            };
            reported.push(*fd);
            n += 1;
        }
        n
    }

    /// Kernel events → program events: our tagged registrations are doorbells (drained) or
    /// pending connections (settled); everything else is the program's own.
    fn translate(&self, got: &[epoll_event], out: &mut [epoll_event]) -> usize {
        let mut n = 0;
        for ev in got {
            let data = ev.u64;
            if data & TAG_MASK != TAG {
                out[n] = epoll_event {
                    events: ev.events,
                    u64: data,
                };
                n += 1;
                continue;
            }
            let fd = (data & 0xffff_ffff) as c_int;
            if let Some(e) = self.settle(fd, ev.events) {
                out[n] = e;
                n += 1;
            }
        }
        n
    }

    /// Handles a kernel event on one of our registrations.
    fn settle(&self, fd: c_int, kernel_ev: u32) -> Option<epoll_event> {
        let conn = self.items.lock().get(&fd)?.conn.clone();
        let path = match conn.path() {
            PENDING => conn.resolve(true),
            p => p,
        };
        if path == RING {
            conn.drain();
        }
        let mut items = self.items.lock();
        let it = items.get_mut(&fd)?;
        if it.registered != path {
            it.registered = path;
            let (ev, data) = if path == TCP {
                (it.events, it.data)
            } else {
                (kernel_events(path, it.events), TAG | fd as u32 as u64)
            };
            let _ = kernel_ctl(self.epfd, libc::EPOLL_CTL_MOD, fd, ev, data);
        }
        if path == TCP {
            // From now on a kernel fd like any other: hand the program its event and stop
            // tracking the interest.
            let it = items.remove(&fd)?;
            let report = kernel_ev & (it.events | (libc::EPOLLHUP | libc::EPOLLERR) as u32);
            return (report != 0).then_some(epoll_event {
                events: report,
                u64: it.data,
            });
        }
        None
    }
}

fn kernel_ctl(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> Result<(), c_int> {
    let mut ev = epoll_event { events, u64: data };
    real::epoll_ctl_raw(epfd, op, fd, &mut ev)
}

fn real_wait(
    epfd: c_int,
    buf: &mut [epoll_event],
    timeout_ms: c_int,
    sigmask: *const libc::sigset_t,
) -> Result<usize, c_int> {
    if buf.is_empty() {
        return Ok(0);
    }
    real::epoll_wait_raw(epfd, buf, timeout_ms, sigmask)
}
