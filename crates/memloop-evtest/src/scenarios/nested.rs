//! `nested_poll`, `nested_select`, `nested_epoll`: an epoll fd holding a ring connection,
//! itself watched by `poll`, by `select`, or as a member of another epoll set. It must become
//! readable when ring data arrives: 200 request/response round trips with a peer that spins
//! (never sleeps, answers at once — the reply often lands before we wait), then 50 with a
//! peer that answers after 1 ms (we are asleep when it lands); and it must not be readable
//! when nothing is there.

use crate::ensure;
use crate::sys::{self, Ev, IN};
use crate::util::{self, Ctx, Net, Opts, Res};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

const INNER: u64 = 0x1a2e_0000_0000_0001;
const OUTER: u64 = 0x0a7e_0000_0000_0002;
const LIMIT: Duration = Duration::from_secs(2);
const QUIT: u64 = u64::MAX;

#[derive(Clone, Copy, PartialEq)]
enum Outer {
    Poll,
    Select,
    Epoll,
}

pub fn run_poll(o: &Opts) -> Res<()> {
    run(o, Outer::Poll)
}

pub fn run_select(o: &Opts) -> Res<()> {
    run(o, Outer::Select)
}

pub fn run_epoll(o: &Opts) -> Res<()> {
    run(o, Outer::Epoll)
}

struct Nest {
    how: Outer,
    inner: OwnedFd,
    outer: Option<OwnedFd>,
}

impl Nest {
    fn new(how: Outer, c: RawFd) -> Res<Nest> {
        let inner = sys::epoll_create().ctx("epoll_create1")?;
        sys::ep_add(inner.as_raw_fd(), c, IN, INNER).ctx("ADD to the inner set")?;
        let outer = if how == Outer::Epoll {
            let o = sys::epoll_create().ctx("epoll_create1")?;
            sys::ep_add(o.as_raw_fd(), inner.as_raw_fd(), IN, OUTER)
                .ctx("ADD inner set to outer")?;
            Some(o)
        } else {
            None
        };
        Ok(Nest { how, inner, outer })
    }

    /// Whether the inner set is reported readable within `t`.
    fn readable(&self, t: Duration) -> Res<bool> {
        let fd = self.inner.as_raw_fd();
        let ms = t.as_millis() as i32;
        match self.how {
            Outer::Poll => Ok(sys::poll1(fd, libc::POLLIN, ms).ctx("poll")? & libc::POLLIN != 0),
            Outer::Select => sys::select_readable(fd, t).ctx("select"),
            Outer::Epoll => {
                let o = self.outer.as_ref().expect("outer").as_raw_fd();
                let got = sys::ep_wait(o, 8, ms).ctx("epoll_wait on the outer set")?;
                ensure!(
                    got.iter().all(|e| *e
                        == Ev {
                            data: OUTER,
                            events: IN
                        }),
                    "outer set reported {got:?}, want only IN for {OUTER:#x}"
                );
                Ok(!got.is_empty())
            }
        }
    }

    fn name(&self) -> &'static str {
        match self.how {
            Outer::Poll => "poll",
            Outer::Select => "select",
            Outer::Epoll => "the outer epoll set",
        }
    }
}

fn run(_o: &Opts, how: Outer) -> Res<()> {
    let net = Net::new()?;
    let mut pairs = net.pairs(1)?;
    let (c, s) = pairs.pop().expect("one pair");
    let nest = Nest::new(how, c.as_raw_fd())?;
    // Phantom readiness is noted and the round trips go on: they are the main check.
    let mut problems = Vec::new();
    if nest.readable(Duration::from_millis(20))? {
        problems.push(format!(
            "{} reported the epoll fd readable while idle",
            nest.name()
        ));
    }
    for (spin, rounds) in [(true, 200), (false, 50)] {
        let peer = std::thread::spawn({
            let s = s.as_raw_fd();
            move || echo_peer(s, spin)
        });
        let r = round_trips(&nest, c.as_raw_fd(), rounds, spin);
        let _ = sys::send_all(c.as_raw_fd(), &QUIT.to_le_bytes());
        let p = peer.join().map_err(|_| "peer panicked".to_string())?;
        problems.extend(r?);
        p?;
        let _ = util::read_exact(c.as_raw_fd(), 8, LIMIT)?;
    }
    if nest.readable(Duration::from_millis(20))? {
        problems.push(format!(
            "{} reported the epoll fd readable after everything was read",
            nest.name()
        ));
    }
    ensure!(problems.is_empty(), "{}", problems.join("; "));
    Ok(())
}

/// Request/response rounds; `Ok` carries a note when the outer wait said readable while the
/// inner set had nothing to report.
fn round_trips(nest: &Nest, c: RawFd, rounds: u64, spin: bool) -> Res<Option<String>> {
    let peer = if spin {
        "spinning peer"
    } else {
        "peer answering after 1 ms"
    };
    let mut phantoms = 0;
    for i in 0..rounds {
        sys::send_all(c, &i.to_le_bytes()).ctx("request")?;
        phantoms += wait_reply(nest, c, &format!("{peer}, round {i}"))?;
        let b = util::read_exact(c, 8, LIMIT)?;
        let v = u64::from_le_bytes(b.try_into().expect("8 bytes"));
        ensure!(
            v == i + 1_000_000,
            "{peer}, round {i}: reply {v}, want {}",
            i + 1_000_000
        );
    }
    Ok((phantoms > 0).then(|| {
        format!(
            "{peer}: in {phantoms} of {rounds} rounds {} said readable while the inner set had \
             nothing to report",
            nest.name()
        )
    }))
}

/// Waits (through the outer wait) until the inner set reports the connection; the number of
/// times the outer wait said readable with nothing inside.
fn wait_reply(nest: &Nest, c: RawFd, what: &str) -> Res<usize> {
    let end = Instant::now() + LIMIT;
    let mut phantoms = 0;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || !nest.readable(left)? {
            return Err(format!(
                "{what}: the epoll fd was not reported readable by {} within {LIMIT:?} although \
                 ring data arrived ({} bytes waiting per FIONREAD)",
                nest.name(),
                sys::fionread(c).unwrap_or(usize::MAX)
            ));
        }
        let got = sys::ep_wait(nest.inner.as_raw_fd(), 8, 0).ctx("epoll_wait on the inner set")?;
        if got.is_empty() {
            phantoms += 1;
            std::thread::yield_now();
            continue;
        }
        ensure!(
            got == [Ev {
                data: INNER,
                events: IN
            }],
            "{what}: inner set reported {got:?}"
        );
        return Ok(phantoms);
    }
}

/// Answers each 8-byte request `i` with `i + 1_000_000` (`QUIT` is echoed, then it stops);
/// spinning: busy non-blocking reads, never a sleep.
fn echo_peer(s: RawFd, spin: bool) -> Res<()> {
    let end = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 8];
    let mut have = 0;
    while Instant::now() < end {
        match sys::recv(s, &mut buf[have..], libc::MSG_DONTWAIT) {
            Ok(0) => return Err("peer: EOF".into()),
            Ok(n) => have += n,
            Err(sys::Errno(libc::EAGAIN)) => {
                if !spin {
                    let _ = sys::poll1(s, libc::POLLIN, 100);
                }
                continue;
            }
            Err(e) => return Err(format!("peer: recv: {e}")),
        }
        if have < 8 {
            continue;
        }
        have = 0;
        let v = u64::from_le_bytes(buf);
        if v == QUIT {
            return sys::send_all(s, &v.to_le_bytes()).ctx("peer: send");
        }
        if !spin {
            std::thread::sleep(Duration::from_millis(1));
        }
        sys::send_all(s, &(v + 1_000_000).to_le_bytes()).ctx("peer: reply")?;
    }
    Err("peer: ran out of time".into())
}
