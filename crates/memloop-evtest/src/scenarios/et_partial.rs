//! `et_partial`: `EPOLLET` with partial reads (one thread, direct `epoll_wait` calls).
//!
//! Kernel facts: an arrival queues the item once (two arrivals before a wait: one event); a
//! partial read produces no event; new data produces one event even if older data is still
//! unread; reading to EAGAIN produces none. On the sending side an `EPOLLOUT|EPOLLET`
//! registration reports space again after the peer drains a full connection, and a FIN is
//! one `IN|RDHUP` edge.

use crate::ensure;
use crate::sys::{self, Ev, ET, IN, OUT, RDHUP};
use crate::util::{self, evname, stream_bytes, stream_mismatch, Ctx, Net, Opts, Res, Rng};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const W: u64 = 0x0e7e_0e7e_0000_0001;
const SW: u64 = 0x0e7e_0e7e_0000_0002;
const NONE_MS: i32 = 10;

struct Side {
    ep: RawFd,
    c: RawFd,
    s: RawFd,
    key: u64,
    sent: u64,
    read: u64,
}

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let pairs = net.pairs(1)?;
    let (c, s) = (pairs[0].0.as_raw_fd(), pairs[0].1.as_raw_fd());
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    sys::ep_add(ep.as_raw_fd(), c, IN | RDHUP | ET, W).ctx("ADD IN|RDHUP|ET")?;
    none(ep.as_raw_fd(), "an idle connection")?;
    let mut side = Side {
        ep: ep.as_raw_fd(),
        c,
        s,
        key: o.seed ^ 0xe7,
        sent: 0,
        read: 0,
    };
    for round in 0..30 {
        partial_round(&mut side, &mut rng, round)?;
    }
    writer_edges(c, s)?;
    fin_edge(&mut side)
}

/// Exactly one event, with data word `word` and events `want`, within 2 s; then nothing.
fn one(ep: RawFd, word: u64, want: u32, what: &str) -> Res<()> {
    let got = wait_some(ep, Duration::from_secs(2))?;
    ensure!(
        got == [Ev {
            data: word,
            events: want
        }],
        "{what}: got {}, want one {} event for {word:#x}",
        show(&got),
        evname(want)
    );
    none(ep, &format!("{what}, after its one event"))
}

fn wait_some(ep: RawFd, limit: Duration) -> Res<Vec<Ev>> {
    let end = Instant::now() + limit;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let got = sys::ep_wait(ep, 8, left.as_millis().max(1) as i32).ctx("epoll_wait")?;
        if !got.is_empty() || Instant::now() >= end {
            return Ok(got);
        }
    }
}

fn none(ep: RawFd, what: &str) -> Res<()> {
    let got = sys::ep_wait(ep, 8, NONE_MS).ctx("epoll_wait")?;
    ensure!(got.is_empty(), "{what}: got {}, want no event", show(&got));
    Ok(())
}

fn show(v: &[Ev]) -> String {
    let s: Vec<String> = v
        .iter()
        .map(|e| format!("{:#x}:{}", e.data, evname(e.events)))
        .collect();
    format!("[{}]", s.join(", "))
}

impl Side {
    /// The peer sends `n` bytes, and we wait until they arrived (FIONREAD): on a loaded
    /// machine the kernel may deliver loopback data after `send` returned, and an arrival
    /// after a check would look like a spurious edge.
    fn send(&mut self, n: usize) -> Res<()> {
        sys::send_all(self.s, &stream_bytes(self.key, self.sent, n)).ctx("send")?;
        self.sent += n as u64;
        let want = self.unread() as usize;
        util::wait_until(Duration::from_secs(2), "sent data never arrived", || {
            Ok((sys::fionread(self.c).ctx("FIONREAD")? >= want).then_some(()))
        })
    }

    /// Reads up to `n` bytes (fewer only at EAGAIN), checking them.
    fn read(&mut self, n: usize) -> Res<usize> {
        let mut buf = vec![0u8; n];
        let mut have = 0;
        while have < n {
            match sys::recv(self.c, &mut buf[have..], libc::MSG_DONTWAIT) {
                Ok(0) => return Err("unexpected EOF".into()),
                Ok(k) => have += k,
                Err(sys::Errno(libc::EAGAIN)) => break,
                Err(e) => return Err(format!("recv: {e}")),
            }
        }
        if let Some(at) = stream_mismatch(self.key, self.read, &buf[..have]) {
            return Err(format!("wrong byte at offset {at}"));
        }
        self.read += have as u64;
        Ok(have)
    }

    fn unread(&self) -> u64 {
        self.sent - self.read
    }
}

fn partial_round(x: &mut Side, rng: &mut Rng, round: usize) -> Res<()> {
    let n = rng.range(100, 5000) as usize;
    x.send(n)?;
    if rng.chance(0.3) {
        // Two arrivals before anyone waits: one event.
        x.send(rng.range(1, 100) as usize)?;
    }
    one(x.ep, W, IN, &format!("round {round}: new data"))?;
    let k = rng.range(1, x.unread() - 1) as usize;
    ensure!(x.read(k)? == k, "round {round}: short read");
    none(
        x.ep,
        &format!("round {round}: after a partial read ({} left)", x.unread()),
    )?;
    if rng.chance(0.5) {
        x.send(rng.range(1, 300) as usize)?;
        one(
            x.ep,
            W,
            IN,
            &format!("round {round}: more data on top of unread data"),
        )?;
    }
    let left = x.unread() as usize;
    ensure!(
        x.read(left + 1)? == left,
        "round {round}: fewer bytes than sent"
    );
    none(x.ep, &format!("round {round}: after reading to EAGAIN"))?;
    util::drain(x.c); // nothing: already at EAGAIN
    Ok(())
}

/// `EPOLLOUT|EPOLLET` on the sender: one edge at ADD, none while full, again after a drain.
fn writer_edges(c: RawFd, s: RawFd) -> Res<()> {
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    let ep = ep.as_raw_fd();
    sys::ep_add(ep, s, OUT | ET, SW).ctx("ADD OUT|ET")?;
    one(ep, SW, OUT, "OUT|ET right after ADD")?;
    let chunk = vec![7u8; 65536];
    let mut total = 0usize;
    loop {
        match sys::send(s, &chunk, libc::MSG_DONTWAIT) {
            Ok(n) => total += n,
            Err(sys::Errno(libc::EAGAIN)) => break,
            Err(e) => return Err(format!("filling: send: {e}")),
        }
        ensure!(total < 1 << 30, "the connection never filled");
    }
    let got = sys::ep_wait(ep, 8, 20).ctx("epoll_wait")?;
    ensure!(
        got.iter().all(|e| e.events & OUT == 0),
        "a full connection reported writable: {}",
        show(&got)
    );
    let mut read = 0;
    while read < total {
        let (b, err, eof) = util::drain(c);
        ensure!(err.is_none() && !eof, "draining: {err:?} eof {eof}");
        read += b.len();
        if b.is_empty() {
            let _ = sys::poll1(c, libc::POLLIN, 100);
        }
    }
    let got = wait_some(ep, Duration::from_secs(2))?;
    ensure!(
        got.iter().any(|e| e.data == SW && e.events == OUT),
        "after the peer drained a full connection: {}, want an OUT edge",
        show(&got)
    );
    std::thread::sleep(Duration::from_millis(50));
    let _ = sys::ep_wait(ep, 8, 0);
    none(ep, "OUT|ET on an idle writable connection")
}

/// The peer's FIN: one `IN|RDHUP` edge; reading the EOF adds none.
fn fin_edge(x: &mut Side) -> Res<()> {
    x.send(10)?;
    one(x.ep, W, IN, "data before FIN")?;
    sys::shutdown(x.s, libc::SHUT_WR).ctx("shutdown")?;
    one(x.ep, W, IN | RDHUP, "the peer's FIN after unread data")?;
    ensure!(x.read(10)? == 10, "data before FIN");
    let mut b = [0u8; 8];
    let n = sys::recv(x.c, &mut b, libc::MSG_DONTWAIT).ctx("recv at EOF")?;
    ensure!(n == 0, "want EOF, read {n} bytes");
    none(x.ep, "after reading the EOF")
}
