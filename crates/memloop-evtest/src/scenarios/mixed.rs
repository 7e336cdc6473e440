//! `mixed_fds`: a signalfd, a timerfd, an eventfd, a pipe and two ring connections in one
//! level-triggered set.
//!
//! One source at a time (seeded order): exactly that source is reported, and nothing once it
//! is consumed. All at once: every source is reported within a few calls. With maxevents 1
//! and everything ready, repeated calls report every source (the kernel requeues a reported
//! level-triggered item at the tail: strict round robin; we allow 4 rounds).

use crate::ensure;
use crate::sys::{self, IN};
use crate::util::{self, Ctx, Net, Opts, Res, Rng};
use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

const NAMES: [&str; 6] = ["signalfd", "timerfd", "eventfd", "pipe", "ring 1", "ring 2"];

struct Sources {
    sig: OwnedFd,
    timer: OwnedFd,
    ev: OwnedFd,
    pipe: (OwnedFd, OwnedFd),
    rings: Vec<(OwnedFd, OwnedFd)>,
}

fn word(i: usize) -> u64 {
    0x3117_0000_0000_0000 | (i as u64) << 8 | 0x42
}

impl Sources {
    fn fd(&self, i: usize) -> RawFd {
        match i {
            0 => self.sig.as_raw_fd(),
            1 => self.timer.as_raw_fd(),
            2 => self.ev.as_raw_fd(),
            3 => self.pipe.0.as_raw_fd(),
            r => self.rings[r - 4].0.as_raw_fd(),
        }
    }

    fn trigger(&self, i: usize) -> Res<()> {
        match i {
            0 => sys::kill_self(libc::SIGUSR1).ctx("kill SIGUSR1"),
            1 => sys::timerfd_once(self.timer.as_raw_fd(), Duration::from_millis(1))
                .ctx("timerfd_settime"),
            2 => sys::eventfd_add(self.ev.as_raw_fd(), 1).ctx("eventfd write"),
            3 => sys::write(self.pipe.1.as_raw_fd(), b"p")
                .map(drop)
                .ctx("pipe write"),
            r => sys::send_all(self.rings[r - 4].1.as_raw_fd(), b"ring").ctx("send"),
        }
    }

    fn consume(&self, i: usize) -> Res<()> {
        let fd = self.fd(i);
        match i {
            0 => {
                let sig = sys::signalfd_take(fd).ctx("read signalfd")?;
                ensure!(sig == libc::SIGUSR1 as u32, "signalfd gave signal {sig}");
            }
            1 | 2 => {
                let n = sys::eventfd_take(fd).ctx("read counter")?;
                ensure!(n >= 1, "{} counter {n}", NAMES[i]);
            }
            3 => {
                let mut b = [0u8; 64];
                sys::read(fd, &mut b).ctx("read pipe")?;
            }
            _ => {
                let b = util::read_exact(fd, 4, Duration::from_secs(1))?;
                ensure!(b == b"ring", "{} read {b:?}", NAMES[i]);
            }
        }
        Ok(())
    }
}

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let src = Sources {
        sig: sys::signalfd(&[libc::SIGUSR1]).ctx("signalfd")?,
        timer: sys::timerfd().ctx("timerfd_create")?,
        ev: sys::eventfd(libc::EFD_NONBLOCK).ctx("eventfd")?,
        pipe: sys::pipe().ctx("pipe")?,
        rings: net.pairs(2)?,
    };
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    let ep = ep.as_raw_fd();
    for (i, name) in NAMES.iter().enumerate() {
        sys::ep_add(ep, src.fd(i), IN, word(i)).ctx(&format!("ADD {name}"))?;
    }
    for step in 0..60 {
        let i = rng.below(NAMES.len() as u64) as usize;
        one_source(ep, &src, i, step)?;
    }
    for round in 0..5 {
        all_at_once(ep, &src, round)?;
    }
    round_robin(ep, &src)
}

/// Reported words within `limit`, over as many calls as it takes to see all of `want`.
fn collect(
    ep: RawFd,
    max: usize,
    want: &BTreeSet<u64>,
    limit: Duration,
) -> Res<(BTreeSet<u64>, usize)> {
    let end = Instant::now() + limit;
    let mut seen = BTreeSet::new();
    let mut calls = 0;
    while !want.is_subset(&seen) && Instant::now() < end {
        let left = end.saturating_duration_since(Instant::now());
        calls += 1;
        for e in sys::ep_wait(ep, max, left.as_millis().max(1) as i32).ctx("epoll_wait")? {
            ensure!(
                e.events == IN,
                "{:#x}: events {:#x}, want IN",
                e.data,
                e.events
            );
            ensure!(
                (0..NAMES.len()).any(|i| word(i) == e.data),
                "unknown data word {:#x}{}",
                e.data,
                if util::looks_like_memloop_tag(e.data) {
                    " (memloop's internal tag leaked)"
                } else {
                    ""
                }
            );
            seen.insert(e.data);
        }
    }
    Ok((seen, calls))
}

fn name_of(w: u64) -> &'static str {
    (0..NAMES.len())
        .find(|i| word(*i) == w)
        .map_or("?", |i| NAMES[i])
}

fn names(s: &BTreeSet<u64>) -> String {
    s.iter().map(|w| name_of(*w)).collect::<Vec<_>>().join(", ")
}

fn one_source(ep: RawFd, src: &Sources, i: usize, step: usize) -> Res<()> {
    src.trigger(i)?;
    let want = BTreeSet::from([word(i)]);
    let (seen, _) = collect(ep, 16, &want, Duration::from_secs(2))?;
    ensure!(
        seen == want,
        "step {step}: after triggering the {} the set reported [{}]",
        NAMES[i],
        names(&seen)
    );
    src.consume(i)?;
    let left = sys::ep_wait(ep, 16, 0).ctx("epoll_wait")?;
    ensure!(
        left.is_empty(),
        "step {step}: {} consumed, still reported: {left:x?}",
        NAMES[i]
    );
    Ok(())
}

fn all_at_once(ep: RawFd, src: &Sources, round: usize) -> Res<()> {
    for i in 0..NAMES.len() {
        src.trigger(i)?;
    }
    std::thread::sleep(Duration::from_millis(3));
    let want: BTreeSet<u64> = (0..NAMES.len()).map(word).collect();
    let (seen, calls) = collect(ep, 16, &want, Duration::from_secs(2))?;
    ensure!(
        seen == want && calls <= 8,
        "all six ready (round {round}): [{}] reported in {calls} call(s)",
        names(&seen)
    );
    for i in 0..NAMES.len() {
        src.consume(i)?;
    }
    Ok(())
}

fn round_robin(ep: RawFd, src: &Sources) -> Res<()> {
    for i in 0..NAMES.len() {
        src.trigger(i)?;
    }
    std::thread::sleep(Duration::from_millis(3));
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for _ in 0..4 * NAMES.len() {
        for e in sys::ep_wait(ep, 1, 1000).ctx("epoll_wait")? {
            seen.insert(e.data);
            order.push(name_of(e.data));
        }
    }
    let all: BTreeSet<u64> = (0..NAMES.len()).map(word).collect();
    ensure!(
        seen == all,
        "maxevents 1, all six ready: {} calls reported only [{}] (order: {})",
        4 * NAMES.len(),
        names(&seen),
        order.join(" ")
    );
    for i in 0..NAMES.len() {
        src.consume(i)?;
    }
    Ok(())
}
