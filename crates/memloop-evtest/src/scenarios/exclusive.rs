//! `exclusive`: `EPOLLEXCLUSIVE` on connections.
//!
//! The kernel's rules (fs/eventpoll.c, `epoll_ctl`): EXCLUSIVE is accepted only by ADD, only
//! with `EPOLLIN|EPOLLOUT|EPOLLERR|EPOLLHUP|EPOLLWAKEUP|EPOLLET` beside it, and not for an
//! epoll fd; MOD with EXCLUSIVE, or MOD of an item added with EXCLUSIVE, is `EINVAL`.
//! Wake-ups: one connection in four sets (one waiter each), then in one set with four
//! waiters: every arrival wakes at least one waiter (none lost) and is read exactly once.

use super::multi_waiters::Stream;
use super::Set;
use crate::book::Seen;
use crate::ensure;
use crate::sys::{self, Errno, ET, EXCLUSIVE, IN, ONESHOT, OUT, RDHUP};
use crate::util::{self, evname, Ctx, Net, Opts, Res, Rng};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(3);

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let pairs = net.pairs(2)?;
    einval_rules(pairs[0].0.as_raw_fd())?;
    let s0 = Arc::new(stream(pairs[0].0.as_raw_fd(), o.seed * 7));
    let (mut sets, wakes) = four_sets(&s0)?;
    rounds(
        &s0,
        pairs[0].1.as_raw_fd(),
        &wakes,
        &mut rng,
        "one fd in four sets",
    )?;
    for s in sets.iter_mut() {
        s.finish()?;
    }
    let s1 = Arc::new(stream(pairs[1].0.as_raw_fd(), o.seed * 7 + 1));
    let (mut set, wakes) = one_set(&s1)?;
    rounds(
        &s1,
        pairs[1].1.as_raw_fd(),
        &wakes,
        &mut rng,
        "four waiters on one set",
    )?;
    set.finish()
}

fn stream(fd: RawFd, key: u64) -> Stream {
    Stream {
        fd,
        key,
        read: Mutex::new(0),
        sent: AtomicU64::new(0),
    }
}

fn want_err(r: Result<(), Errno>, errno: i32, what: &str) -> Res<()> {
    match r {
        Err(Errno(e)) if e == errno => Ok(()),
        Err(e) => Err(format!("{what}: got {e}, the kernel says {}", Errno(errno))),
        Ok(()) => Err(format!(
            "{what}: accepted, the kernel says {}",
            Errno(errno)
        )),
    }
}

/// The kernel's EINVAL cases for EXCLUSIVE, on a ring connection.
fn einval_rules(c: RawFd) -> Res<()> {
    let e1 = sys::epoll_create().ctx("epoll_create1")?;
    let e2 = sys::epoll_create().ctx("epoll_create1")?;
    let (a, b) = (e1.as_raw_fd(), e2.as_raw_fd());
    sys::ep_add(a, c, IN | EXCLUSIVE, 1).ctx("ADD IN|EXCLUSIVE")?;
    want_err(
        sys::ep_mod(a, c, IN, 2),
        libc::EINVAL,
        "MOD of an item added with EXCLUSIVE",
    )?;
    want_err(
        sys::ep_mod(a, c, IN | EXCLUSIVE, 2),
        libc::EINVAL,
        "MOD with EXCLUSIVE",
    )?;
    want_err(
        sys::ep_add(a, c, IN, 3),
        libc::EEXIST,
        "second ADD of the same fd",
    )?;
    want_err(
        sys::ep_add(b, c, IN | EXCLUSIVE | ONESHOT, 4),
        libc::EINVAL,
        "ADD EXCLUSIVE|ONESHOT",
    )?;
    want_err(
        sys::ep_add(b, c, IN | EXCLUSIVE | RDHUP, 5),
        libc::EINVAL,
        "ADD EXCLUSIVE|RDHUP",
    )?;
    want_err(
        sys::ep_add(b, a, IN | EXCLUSIVE, 6),
        libc::EINVAL,
        "ADD of an epoll fd with EXCLUSIVE",
    )?;
    sys::ep_add(b, c, IN | OUT | ET | EXCLUSIVE, 7).ctx("ADD IN|OUT|ET|EXCLUSIVE")?;
    sys::ep_del(a, c).ctx("DEL of an EXCLUSIVE item")?;
    sys::ep_add(a, c, IN, 8).ctx("ADD again without EXCLUSIVE")?;
    want_err(
        sys::ep_mod(a, c, IN | EXCLUSIVE, 9),
        libc::EINVAL,
        "MOD adding EXCLUSIVE",
    )?;
    sys::ep_mod(a, c, IN | OUT, 10).ctx("MOD of a plain item")?;
    let got = sys::ep_wait(a, 8, 0).ctx("epoll_wait")?;
    ensure!(
        got.len() == 1 && got[0].data == 10 && got[0].events == OUT,
        "after the MODs: {got:?}, want one OUT event with data 10"
    );
    Ok(())
}

/// Who woke for the current round.
type Wakes = Arc<Mutex<Vec<usize>>>;

fn reaction(
    s: &Arc<Stream>,
    wakes: &Wakes,
    log: &Arc<crate::book::Log>,
) -> Arc<dyn Fn(&Seen) + Send + Sync> {
    let (s, wakes, log) = (s.clone(), wakes.clone(), log.clone());
    Arc::new(move |e: &Seen| {
        if e.label == "stop" {
            return;
        }
        wakes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(e.waiter);
        if e.events & !IN != 0 {
            log.fail(format!("unexpected events {}", evname(e.events)));
        }
        if let Err(why) = s.consume(65536, true) {
            log.fail(why);
        }
    })
}

fn four_sets(s: &Arc<Stream>) -> Res<(Vec<Set>, Wakes)> {
    let wakes: Wakes = Arc::default();
    let mut sets = Vec::new();
    for i in 0..4 {
        let mut set = Set::new()?;
        set.add(s.fd, IN | EXCLUSIVE, 0xe0 + i, &format!("conn in set {i}"))?;
        let r = reaction(s, &wakes, &set.log);
        set.waiter(4, -1, r);
        sets.push(set);
    }
    Ok((sets, wakes))
}

fn one_set(s: &Arc<Stream>) -> Res<(Set, Wakes)> {
    let wakes: Wakes = Arc::default();
    let mut set = Set::new()?;
    set.add(s.fd, IN | EXCLUSIVE, 0xe1e1, "conn, four waiters")?;
    for _ in 0..4 {
        let r = reaction(s, &wakes, &set.log);
        set.waiter(1, -1, r);
    }
    Ok((set, wakes))
}

fn rounds(s: &Stream, server: RawFd, wakes: &Wakes, rng: &mut Rng, what: &str) -> Res<()> {
    let mut hist = [0usize; 5];
    for round in 0..200 {
        wakes.lock().unwrap_or_else(|e| e.into_inner()).clear();
        s.feed(server, rng.range(1, 2000) as usize)?;
        util::wait_until(
            LIMIT,
            &format!(
                "{what}, round {round}: lost wake-up: {} of {} bytes read",
                0, 0
            ),
            || Ok(s.done().then_some(())),
        )
        .map_err(|_| {
            format!(
                "{what}, round {round}: lost wake-up: {} of {} bytes read after {LIMIT:?}",
                *s.read.lock().unwrap_or_else(|e| e.into_inner()),
                s.sent.load(SeqCst)
            )
        })?;
        let n = wakes.lock().unwrap_or_else(|e| e.into_inner()).len();
        hist[n.min(4)] += 1;
    }
    util::info(&format!(
        "{what}: waiters reporting per arrival (0..=4+): {hist:?}"
    ));
    Ok(())
}
