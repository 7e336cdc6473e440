//! `pwait2`: `epoll_pwait2` (glibc ≥ 2.35; this machine's libc.so.6 exports
//! `epoll_pwait2@@GLIBC_2.35`) with a timespec timeout over a ring connection: timeouts
//! (milliseconds and sub-millisecond), data arriving during the wait, data already there,
//! no timeout at all, and its signal mask (a signal blocked outside the call interrupts it).

use crate::ensure;
use crate::sys::{self, Errno, Ev, IN};
use crate::util::{self, ms, Ctx, Net, Opts, Res};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const W: u64 = 0x9a17_2000_0000_0001;

pub fn run(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let pairs = net.pairs(1)?;
    let (c, s) = (pairs[0].0.as_raw_fd(), pairs[0].1.as_raw_fd());
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    let ep = ep.as_raw_fd();
    sys::ep_add(ep, c, IN, W).ctx("ADD")?;
    timeouts(ep)?;
    for round in 0..20 {
        arrival(ep, c, s, Some(Duration::from_secs(5)), round)?;
    }
    arrival(ep, c, s, None, 20)?;
    already_there(ep, c, s)?;
    sigmask(ep)
}

fn pwait2(ep: RawFd, t: Option<Duration>, mask: Option<&libc::sigset_t>) -> Res<Vec<Ev>> {
    sys::ep_pwait2(ep, 8, t, mask).map_err(|e| match e {
        Errno(libc::ENOSYS) => "epoll_pwait2: ENOSYS (the kernel lacks it)".to_string(),
        e => format!("epoll_pwait2: {e}"),
    })
}

fn timeouts(ep: RawFd) -> Res<()> {
    for (t, lo, hi) in [
        (Duration::from_millis(50), 45.0, 1000.0),
        (Duration::from_micros(300), 0.0, 50.0),
        (Duration::ZERO, 0.0, 50.0),
    ] {
        let t0 = Instant::now();
        let got = pwait2(ep, Some(t), None)?;
        let took = ms(t0.elapsed());
        ensure!(
            got.is_empty(),
            "pwait2 {t:?} on an idle connection: {got:?}"
        );
        ensure!(
            (lo..hi).contains(&took),
            "pwait2 with a {t:?} timeout returned after {took:.2} ms"
        );
    }
    Ok(())
}

/// The peer sends while we wait.
fn arrival(ep: RawFd, c: RawFd, s: RawFd, t: Option<Duration>, round: usize) -> Res<()> {
    let delay = Duration::from_millis(if round % 4 == 0 { 30 } else { 1 });
    let t0 = Instant::now();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(delay);
        sys::send_all(s, b"ring data")
    });
    let got = pwait2(ep, t, None)?;
    let took = t0.elapsed();
    sender.join().map_err(|_| "sender panicked")?.ctx("send")?;
    ensure!(
        got == [Ev {
            data: W,
            events: IN
        }],
        "round {round}: pwait2 ({t:?}) returned {got:?} after {:.1} ms, want one IN event with \
         data {W:#x}{}",
        ms(took),
        leak_hint(&got)
    );
    ensure!(
        took < Duration::from_secs(2),
        "round {round}: the event came after {:.1} ms",
        ms(took)
    );
    let b = util::read_exact(c, 9, Duration::from_secs(2))?;
    ensure!(b == b"ring data", "round {round}: read {b:?}");
    Ok(())
}

fn leak_hint(got: &[Ev]) -> &'static str {
    if got.iter().any(|e| util::looks_like_memloop_tag(e.data)) {
        " (memloop's internal tag leaked: epoll_pwait2 is not emulated)"
    } else {
        ""
    }
}

fn already_there(ep: RawFd, c: RawFd, s: RawFd) -> Res<()> {
    sys::send_all(s, b"early").ctx("send")?;
    std::thread::sleep(Duration::from_millis(5));
    let got = pwait2(ep, Some(Duration::ZERO), None)?;
    ensure!(
        got == [Ev {
            data: W,
            events: IN
        }],
        "data already there, zero timeout: {got:?}{}",
        leak_hint(&got)
    );
    util::read_exact(c, 5, Duration::from_secs(2))?;
    let got = pwait2(ep, Some(Duration::from_millis(5)), None)?;
    ensure!(got.is_empty(), "after reading everything: {got:?}");
    Ok(())
}

/// SIGUSR2 blocked in this thread, unblocked by the call's mask: a SIGUSR2 sent during the
/// wait interrupts it with EINTR.
fn sigmask(ep: RawFd) -> Res<()> {
    sys::ignore_with_handler(libc::SIGUSR2).ctx("sigaction")?;
    sys::block_signals(&[libc::SIGUSR2]).ctx("block SIGUSR2")?;
    let me = sys::gettid();
    let kicker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        sys::tgkill(me, libc::SIGUSR2)
    });
    let empty = sys::sigset(&[libc::SIGUSR1]);
    let t0 = Instant::now();
    let r = sys::ep_pwait2(ep, 8, Some(Duration::from_secs(5)), Some(&empty));
    kicker
        .join()
        .map_err(|_| "kicker panicked")?
        .ctx("tgkill")?;
    ensure!(
        r == Err(Errno(libc::EINTR)),
        "pwait2 with a mask unblocking SIGUSR2: {r:?} after {:.1} ms, want EINTR",
        ms(t0.elapsed())
    );
    Ok(())
}
