//! `fork_shared_set`: an epoll set made before `fork`, with a ring connection in it, used by
//! the child (request/response), then by both at once (every message read exactly once by one
//! of them), then by the parent alone after the child exited.
//!
//! `exec_inherits`: the set and the connection survive `exec` of this binary in a forked
//! child; the new program waits on the inherited set, must see exactly the data word the
//! parent registered, serves requests, and finally deletes the inherited registration (the
//! kernel still has it, so DEL succeeds).
//!
//! Kernel facts: a forked child shares the epoll instance (one open file description) and its
//! registrations; an item lives while its file is open in any process; exec keeps fds without
//! `FD_CLOEXEC`.

use crate::ensure;
use crate::sys::{self, Ev, IN};
use crate::util::{self, Ctx, Net, Opts, Res};
use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

const D: u64 = 0xf0f0_0000_dead_0001;
const LIMIT: Duration = Duration::from_secs(5);
const ROUNDS: u64 = 100;
const SHARED_MSGS: u64 = 300;

pub fn run_fork(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let mut pairs = net.pairs(1)?;
    let (c, s) = pairs.pop().expect("one pair");
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    sys::ep_add(ep.as_raw_fd(), c.as_raw_fd(), IN, D).ctx("ADD")?;
    let (report_r, report_w) = sys::pipe().ctx("pipe")?;
    let (stop_r, stop_w) = sys::pipe().ctx("pipe")?;
    let pid = sys::fork().ctx("fork")?;
    if pid == 0 {
        drop((report_r, stop_w, s));
        let fds = Fds {
            ep: ep.as_raw_fd(),
            c: c.as_raw_fd(),
            report: report_w.as_raw_fd(),
            stop: stop_r.as_raw_fd(),
        };
        let r = fork_child(&fds);
        if let Err(why) = &r {
            util::info(&format!("fork child: {why}"));
        }
        sys::exit_now(r.map_or(1, |_| 0));
    }
    drop((report_w, stop_r));
    let r = fork_parent(
        pid,
        ep.as_raw_fd(),
        c.as_raw_fd(),
        s.as_raw_fd(),
        &report_r,
        &stop_w,
    );
    if r.is_err() {
        // The child is ours: it must not outlive a failure.
        let _ = sys::kill(pid, libc::SIGKILL);
        let _ = sys::wait_child(pid);
    }
    r
}

struct Fds {
    ep: RawFd,
    c: RawFd,
    report: RawFd,
    stop: RawFd,
}

fn fork_child(f: &Fds) -> Res<()> {
    crate::watchdog("fork_shared_set child".into());
    // Phase 1: serve requests, waiting on the inherited set.
    for i in 0..ROUNDS {
        expect_d(f.ep, &format!("child, request {i}"))?;
        let b = util::read_exact(f.c, 8, LIMIT)?;
        let v = u64::from_le_bytes(b.try_into().expect("8"));
        ensure!(v == i, "child: request {v}, want {i}");
        sys::send_all(f.c, &(v + 1000).to_le_bytes()).ctx("child reply")?;
    }
    // Phase 2: both wait on the set; report every message read to the parent.
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        let mut b = [0u8; 1];
        if sys::read(f.stop, &mut b).is_ok() {
            return Ok(());
        }
        for v in shared_wait(f.ep, f.c)? {
            sys::write(f.report, &v.to_le_bytes()).ctx("report")?;
        }
    }
    Err("child: never told to stop".into())
}

/// One wait on the shared set; the messages read (8 bytes each) if it reported the
/// connection.
fn shared_wait(ep: RawFd, c: RawFd) -> Res<Vec<u64>> {
    let got = sys::ep_wait(ep, 8, 20).ctx("epoll_wait")?;
    ensure!(
        got.iter().all(|e| *e
            == Ev {
                data: D,
                events: IN
            }),
        "shared set reported {got:?}, want only IN for {D:#x}"
    );
    let mut out = Vec::new();
    let mut b = [0u8; 8];
    while !got.is_empty() {
        match sys::recv(c, &mut b, libc::MSG_DONTWAIT) {
            Ok(8) => out.push(u64::from_le_bytes(b)),
            Ok(n) => return Err(format!("read {n} bytes of an 8-byte message")),
            Err(sys::Errno(libc::EAGAIN)) => break,
            Err(e) => return Err(format!("recv: {e}")),
        }
    }
    Ok(out)
}

fn expect_d(ep: RawFd, what: &str) -> Res<()> {
    let got = sys::ep_wait(ep, 8, LIMIT.as_millis() as i32).ctx("epoll_wait")?;
    ensure!(
        got == [Ev {
            data: D,
            events: IN
        }],
        "{what}: the set reported {got:?}, want one IN event for {D:#x}{}",
        if got.iter().any(|e| util::looks_like_memloop_tag(e.data)) {
            " (memloop's internal tag leaked)"
        } else {
            ""
        }
    );
    Ok(())
}

fn fork_parent(
    pid: i32,
    ep: RawFd,
    c: RawFd,
    s: RawFd,
    report: &OwnedFd,
    stop: &OwnedFd,
) -> Res<()> {
    for i in 0..ROUNDS {
        sys::send_all(s, &i.to_le_bytes()).ctx("request")?;
        let b =
            util::read_exact(s, 8, LIMIT).map_err(|e| format!("reply {i} from the child: {e}"))?;
        let v = u64::from_le_bytes(b.try_into().expect("8"));
        ensure!(v == i + 1000, "reply {v}, want {}", i + 1000);
    }
    both_wait(ep, c, s, report.as_raw_fd())?;
    sys::write(stop.as_raw_fd(), b"x").ctx("stop the child")?;
    let code = wait_bounded(pid)?;
    ensure!(
        code == 0,
        "the fork child failed (exit status {code}; its reason is above)"
    );
    // Phase 3: the parent alone, after the child's copies are gone.
    for i in 0..20u64 {
        sys::send_all(s, &i.to_le_bytes()).ctx("send")?;
        expect_d(ep, &format!("parent after the child exited, message {i}"))?;
        util::read_exact(c, 8, LIMIT)?;
    }
    Ok(())
}

/// Parent and child both wait on the set while messages arrive; each is read exactly once.
fn both_wait(ep: RawFd, c: RawFd, s: RawFd, report: RawFd) -> Res<()> {
    sys::set_nonblock(report, true).ctx("O_NONBLOCK")?;
    let sender = std::thread::spawn(move || -> Res<()> {
        for v in 0..SHARED_MSGS {
            sys::send_all(s, &(v + 5000).to_le_bytes()).ctx("send")?;
            std::thread::sleep(Duration::from_micros(300));
        }
        Ok(())
    });
    let mut mine = Vec::new();
    let mut theirs = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while mine.len() + theirs.len() < SHARED_MSGS as usize && Instant::now() < end {
        mine.extend(shared_wait(ep, c)?);
        theirs.extend(read_reports(report));
    }
    sender.join().map_err(|_| "sender panicked")??;
    std::thread::sleep(Duration::from_millis(20));
    theirs.extend(read_reports(report));
    let all: BTreeSet<u64> = mine.iter().chain(&theirs).copied().collect();
    ensure!(
        mine.len() + theirs.len() == SHARED_MSGS as usize && all.len() == SHARED_MSGS as usize,
        "both waiting on the shared set: parent read {}, child read {}, {} distinct of {} \
         messages (lost or duplicated)",
        mine.len(),
        theirs.len(),
        all.len(),
        SHARED_MSGS
    );
    util::info(&format!(
        "shared set: parent read {}, child read {}",
        mine.len(),
        theirs.len()
    ));
    Ok(())
}

fn read_reports(fd: RawFd) -> Vec<u64> {
    let mut out = Vec::new();
    let mut b = [0u8; 8];
    while let Ok(8) = sys::read(fd, &mut b) {
        out.push(u64::from_le_bytes(b));
    }
    out
}

fn wait_bounded(pid: i32) -> Res<i32> {
    util::wait_until(Duration::from_secs(10), "the child did not exit", || {
        sys::try_wait_child(pid).ctx("waitpid")
    })
}

// ---- exec --------------------------------------------------------------------------------

pub fn run_exec(_o: &Opts) -> Res<()> {
    let net = Net::new()?;
    let mut pairs = net.pairs(1)?;
    let (c, s) = pairs.pop().expect("one pair");
    let ep = sys::epoll_create().ctx("epoll_create1")?;
    sys::ep_add(ep.as_raw_fd(), c.as_raw_fd(), IN, D).ctx("ADD")?;
    let exe = std::env::current_exe().ctx("current_exe")?;
    let args: Vec<CString> = [
        exe.display().to_string(),
        "__exec_child".into(),
        ep.as_raw_fd().to_string(),
        c.as_raw_fd().to_string(),
        D.to_string(),
        ROUNDS.to_string(),
    ]
    .into_iter()
    .map(|a| CString::new(a).expect("no NUL"))
    .collect();
    sys::set_cloexec(ep.as_raw_fd(), false).ctx("clear FD_CLOEXEC")?;
    sys::set_cloexec(c.as_raw_fd(), false).ctx("clear FD_CLOEXEC")?;
    let pid = sys::fork().ctx("fork")?;
    if pid == 0 {
        let e = sys::execv(&args[0], &args);
        util::info(&format!("exec: {e}"));
        sys::exit_now(127);
    }
    // The child is the only holder of the set and the connection from now on.
    drop((ep, c));
    let s = s.as_raw_fd();
    let served = (0..ROUNDS).try_for_each(|i| {
        sys::send_all(s, &i.to_le_bytes()).ctx("request")?;
        let b = util::read_exact(s, 8, LIMIT)
            .map_err(|e| format!("reply {i} from the exec'd child: {e}"))?;
        let v = u64::from_le_bytes(b.try_into().expect("8"));
        ensure!(v == i + 1000, "reply {v}, want {}", i + 1000);
        Ok(())
    });
    let code = wait_bounded(pid);
    if served.is_err() && code.is_err() {
        let _ = sys::kill(pid, libc::SIGKILL);
        let _ = sys::wait_child(pid);
    }
    let code = code?;
    ensure!(
        code == 0,
        "the exec'd child failed (exit status {code}; its reason is above)"
    );
    served
}

/// The exec'd program: `__exec_child EPFD FD DATA ROUNDS`.
pub fn exec_child(args: &[String]) -> Res<()> {
    crate::watchdog("exec_inherits child".into());
    let num = |i: usize| -> Res<u64> {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .ok_or(format!("argument {i} missing or not a number"))
    };
    let (ep, c, d, rounds) = (num(0)? as RawFd, num(1)? as RawFd, num(2)?, num(3)?);
    ensure!(d == D, "data word argument {d:#x}");
    for i in 0..rounds {
        expect_d(ep, &format!("exec'd child, request {i}"))?;
        let b = util::read_exact(c, 8, LIMIT)?;
        let v = u64::from_le_bytes(b.try_into().expect("8"));
        ensure!(v == i, "exec'd child: request {v}, want {i}");
        sys::send_all(c, &(v + 1000).to_le_bytes()).ctx("reply")?;
    }
    let got = sys::ep_wait(ep, 8, 20).ctx("epoll_wait")?;
    ensure!(
        got.is_empty(),
        "exec'd child: events with nothing to read: {got:?}"
    );
    sys::ep_del(ep, c)
        .ctx("exec'd child: DEL of the inherited registration (the kernel has it)")?;
    Ok(())
}
