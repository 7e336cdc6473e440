//! `tag_words`: data words in the range memloop uses for its own kernel registrations
//! (`0x4d4c7470_XXXXXXXX`) are the program's like any other: a pipe, an eventfd and two ring
//! connections registered with such words (one of them exactly memloop's tag for its own fd
//! number) each report their event with their word. The kernel gives every 64-bit word back
//! unchanged; an emulation that recognises its registrations by this pattern swallows them.

use crate::ensure;
use crate::sys::{self, Ev, IN};
use crate::util::{Ctx, Net, Opts, Res};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const TAG: u64 = 0x4d4c_7470_0000_0000;

pub fn run(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let pairs = net.pairs(2)?;
    let (pr, pw) = sys::pipe().ctx("pipe")?;
    let ev = sys::eventfd(libc::EFD_NONBLOCK).ctx("eventfd")?;
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    let ep = ep.as_raw_fd();
    let (c1, c2) = (pairs[0].0.as_raw_fd(), pairs[1].0.as_raw_fd());
    let items = [
        ("pipe", pr.as_raw_fd(), TAG | pr.as_raw_fd() as u64),
        ("eventfd", ev.as_raw_fd(), TAG),
        ("ring 1", c1, TAG | c1 as u64),
        ("ring 2", c2, TAG | 0xffff_ffff),
    ];
    for (name, fd, w) in items {
        sys::ep_add(ep, fd, IN, w).ctx(&format!("ADD {name}"))?;
    }
    let mut problems = Vec::new();
    for (i, (name, fd, w)) in items.into_iter().enumerate() {
        match i {
            0 => sys::write(pw.as_raw_fd(), b"p")
                .map(drop)
                .ctx("pipe write")?,
            1 => sys::eventfd_add(fd, 1).ctx("eventfd write")?,
            _ => sys::send_all(pairs[i - 2].1.as_raw_fd(), b"r").ctx("send")?,
        }
        if let Err(e) = expect(ep, w, name) {
            problems.push(e);
        }
        consume(i, fd)?;
    }
    ensure!(problems.is_empty(), "{}", problems.join("; "));
    Ok(())
}

fn expect(ep: RawFd, w: u64, name: &str) -> Res<()> {
    let end = Instant::now() + Duration::from_secs(2);
    while Instant::now() < end {
        let got = sys::ep_wait(ep, 8, 100).ctx("epoll_wait")?;
        if got.is_empty() {
            continue;
        }
        ensure!(
            got == [Ev {
                data: w,
                events: IN
            }],
            "{name} registered with {w:#x}: got {got:x?}"
        );
        return Ok(());
    }
    Err(format!(
        "{name} registered with data word {w:#x} (memloop's tag range): no event within 2 s"
    ))
}

fn consume(i: usize, fd: RawFd) -> Res<()> {
    match i {
        1 => sys::eventfd_take(fd).map(drop).ctx("eventfd read"),
        _ => {
            let mut b = [0u8; 8];
            sys::read(fd, &mut b).map(drop).ctx("read")
        }
    }
}
