//! `close_with_dup`: closing a registered fd while a `dup` of it is open.
//!
//! Kernel facts (an epoll item is keyed by (file, fd number) and lives until the *file* is
//! released): after `close(fd)` with a dup open, events keep arriving with the old data word;
//! `EPOLL_CTL_DEL`/`MOD` through the dup's number is `ENOENT`, through the closed number
//! `EBADF`; the closed number may be reused and ADDed as a new item; closing the last copy
//! ends the registration. An fd and its dup may both be registered (two items): closing one
//! of them keeps both items until the dup is closed too.

use crate::ensure;
use crate::sys::{self, Errno, Ev, IN};
use crate::util::{self, Ctx, Net, Opts, Res};
use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const D: u64 = 0xd0d0_0000_0000_0001;
const P: u64 = 0xd0d0_0000_0000_0002;
const W3: u64 = 0xd0d0_0000_0000_0003;
const W3D: u64 = 0xd0d0_0000_0000_0004;

pub fn run(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let mut pairs = net.pairs(2)?;
    let (c3, s3) = pairs.pop().expect("pair");
    let (c, s) = pairs.pop().expect("pair");
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    let ep = ep.as_raw_fd();
    single(ep, c, s.as_raw_fd())?;
    both_registered(ep, c3, s3.as_raw_fd())
}

/// Collects events until each word of `want` was seen (with IN) within 2 s; any other word
/// fails.
fn expect_words(ep: RawFd, want: &[u64], what: &str) -> Res<()> {
    let end = Instant::now() + Duration::from_secs(2);
    let mut seen = BTreeSet::new();
    while seen.len() < want.len() {
        let left = end.saturating_duration_since(Instant::now());
        ensure!(
            !left.is_zero(),
            "{what}: saw {seen:x?} of {want:x?} within 2 s"
        );
        for e in sys::ep_wait(ep, 8, left.as_millis().max(1) as i32).ctx("epoll_wait")? {
            ensure!(
                want.contains(&e.data) && e.events == IN,
                "{what}: unexpected event {e:x?} (want IN for {want:x?})"
            );
            seen.insert(e.data);
        }
    }
    Ok(())
}

fn nothing(ep: RawFd, ms: i32, what: &str) -> Res<()> {
    let got = sys::ep_wait(ep, 8, ms).ctx("epoll_wait")?;
    ensure!(got.is_empty(), "{what}: got {got:x?}, want nothing");
    Ok(())
}

fn want_errno(r: Result<(), Errno>, e: i32, what: &str) -> Res<()> {
    ensure!(
        r == Err(Errno(e)),
        "{what}: {r:?}, the kernel says {}",
        Errno(e)
    );
    Ok(())
}

fn single(ep: RawFd, c: std::os::fd::OwnedFd, s: RawFd) -> Res<()> {
    let cn = c.as_raw_fd();
    sys::ep_add(ep, cn, IN, D).ctx("ADD")?;
    let d = sys::dup(cn).ctx("dup")?;
    let dn = d.as_raw_fd();
    drop(c);
    sys::send_all(s, b"a").ctx("send")?;
    expect_words(
        ep,
        &[D],
        "data after closing the registered fd (its dup still open)",
    )?;
    ensure!(
        util::read_exact(dn, 1, Duration::from_secs(1))? == b"a",
        "read through the dup"
    );
    nothing(ep, 0, "everything read")?;
    want_errno(
        sys::ep_del(ep, dn),
        libc::ENOENT,
        "DEL through the dup's number",
    )?;
    want_errno(
        sys::ep_mod(ep, dn, IN, 9),
        libc::ENOENT,
        "MOD through the dup's number",
    )?;
    want_errno(
        sys::ep_del(ep, cn),
        libc::EBADF,
        "DEL through the closed number",
    )?;
    let (pr, pw) = sys::pipe().ctx("pipe")?;
    if pr.as_raw_fd() != cn {
        util::info(&format!(
            "the closed number {cn} was not reused (pipe got {})",
            pr.as_raw_fd()
        ));
    }
    sys::ep_add(ep, pr.as_raw_fd(), IN, P).ctx("ADD of a new file on the reused number")?;
    sys::write(pw.as_raw_fd(), b"p").ctx("pipe write")?;
    expect_words(ep, &[P], "the pipe on the reused number")?;
    let mut b = [0u8; 4];
    sys::read(pr.as_raw_fd(), &mut b).ctx("pipe read")?;
    sys::send_all(s, b"b").ctx("send")?;
    expect_words(ep, &[D], "the connection while its old number is a pipe")?;
    ensure!(
        util::read_exact(dn, 1, Duration::from_secs(1))? == b"b",
        "read through the dup"
    );
    nothing(ep, 0, "everything read")?;
    drop(d);
    let _ = sys::send(s, b"c", 0);
    nothing(ep, 50, "after the last copy was closed")?;
    drop((pr, pw));
    Ok(())
}

fn both_registered(ep: RawFd, c: std::os::fd::OwnedFd, s: RawFd) -> Res<()> {
    let cn = c.as_raw_fd();
    let d = sys::dup(cn).ctx("dup")?;
    let dn = d.as_raw_fd();
    sys::ep_add(ep, cn, IN, W3).ctx("ADD the fd")?;
    sys::ep_add(ep, dn, IN, W3D).ctx("ADD its dup")?;
    sys::send_all(s, b"1").ctx("send")?;
    expect_words(ep, &[W3, W3D], "an fd and its dup, both registered")?;
    util::read_exact(cn, 1, Duration::from_secs(1))?;
    nothing(ep, 0, "everything read")?;
    drop(c);
    sys::send_all(s, b"2").ctx("send")?;
    expect_words(
        ep,
        &[W3, W3D],
        "after closing the fd: both items live on (the file is open)",
    )?;
    util::read_exact(dn, 1, Duration::from_secs(1))?;
    sys::ep_del(ep, dn).ctx("DEL the dup")?;
    sys::send_all(s, b"3").ctx("send")?;
    expect_words(
        ep,
        &[W3],
        "after DEL of the dup: the closed fd's item remains",
    )?;
    let got = sys::ep_wait(ep, 8, 0).ctx("epoll_wait")?;
    ensure!(
        got.iter().all(|e| *e
            == Ev {
                data: W3,
                events: IN
            }),
        "after DEL of the dup: {got:x?}"
    );
    util::read_exact(dn, 1, Duration::from_secs(1))?;
    drop(d);
    let _ = sys::send(s, b"4", 0);
    nothing(ep, 50, "after the last copy was closed")
}
