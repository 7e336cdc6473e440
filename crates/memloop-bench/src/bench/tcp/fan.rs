//! Many connections at once (issue 14's concurrency sweep): one client process holds `conns`
//! connections, each with one request in flight, multiplexed with epoll — as a load generator
//! or a proxy does — against a server that serves them all from one epoll thread, as an event
//! loop server (redis, nginx) does. Plain C-library calls only, so a preloaded library sees
//! what it would see from any such program.
//!
//! The one place in this crate with `unsafe`: epoll, `fcntl` and raw `read`/`write` through
//! the C library (std has no epoll, and rustix's raw system calls would bypass the preloaded
//! library being measured).
#![allow(unsafe_code)]

use super::wire::{fill, header, verify, Conn, Op};
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Largest total of in-flight reply buffers the client keeps (conns × size).
const MAX_BUFFERED: usize = 256 << 20;

fn check(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

fn epoll_create() -> io::Result<RawFd> {
    // SAFETY: no pointers.
    check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) } as isize).map(|fd| fd as RawFd)
}

fn epoll_add(ep: RawFd, fd: RawFd, data: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: data,
    };
    // SAFETY: a valid event for the duration of the call.
    check(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } as isize).map(|_| ())
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: no pointers.
    let fl = check(unsafe { libc::fcntl(fd, libc::F_GETFL) } as isize)? as i32;
    // SAFETY: no pointers.
    check(unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } as isize).map(|_| ())
}

/// Reads what is there (`Ok(0)`: end of stream; `WouldBlock`: nothing yet).
fn read_some(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    check(unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) })
}

/// Writes all of `buf` on a non-blocking socket, waiting in `poll` when it is full.
fn write_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is valid for reads of its length.
        match check(unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) }) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 1000) };
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Raises the soft limit on open files to the hard one (thousands of connections).
pub fn raise_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to fill, then to set.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Server: one epoll thread echoing every fan connection.

struct Worker {
    ep: RawFd,
    conns: Mutex<HashMap<RawFd, Conn>>,
}

static WORKER: OnceLock<Worker> = OnceLock::new();

/// Hands a fan connection (header read) to the server's epoll thread, started at the first.
pub fn adopt(c: Conn) -> io::Result<()> {
    let w = match WORKER.get() {
        Some(w) => w,
        None => {
            raise_nofile();
            let w = WORKER.get_or_init(|| Worker {
                ep: epoll_create().expect("epoll_create1 for the fan server"),
                conns: Mutex::new(HashMap::new()),
            });
            std::thread::spawn(move || echo_loop(w));
            w
        }
    };
    let fd = c.as_raw_fd()?;
    c.set_nodelay()?;
    set_nonblocking(fd)?;
    w.conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(fd, c);
    epoll_add(w.ep, fd, fd as u64)
}

fn echo_loop(w: &Worker) -> ! {
    let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // SAFETY: `evs` holds room for its length.
        let n = unsafe { libc::epoll_wait(w.ep, evs.as_mut_ptr(), evs.len() as i32, -1) };
        for ev in &evs[..n.max(0) as usize] {
            let fd = ev.u64 as RawFd;
            if echo(fd, &mut buf).is_err() {
                // (Closing the connection removes it from the set.)
                w.conns
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&fd);
            }
        }
    }
}

/// Echoes what `fd` holds; `Err` once it ended or failed.
fn echo(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    loop {
        match read_some(fd, buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => write_all(fd, &buf[..n])?,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Client.

struct Flight {
    c: Conn,
    seq: u64,
    got: usize,
}

/// Transactions completed from `warmup` on, over `dur`: every connection keeps one `size`-byte
/// request in flight; each reply is checked. Returns (count, seconds, connections made).
pub fn run(
    connect: impl Fn() -> io::Result<Conn>,
    size: usize,
    conns: usize,
    warmup: Duration,
    dur: Duration,
) -> io::Result<(u64, f64)> {
    if conns == 0 || conns.saturating_mul(size) > MAX_BUFFERED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{conns} connections of {size}-byte messages: out of range"),
        ));
    }
    raise_nofile();
    let ep = epoll_create()?;
    let mut fl = Vec::with_capacity(conns);
    let mut tx = vec![0xa5u8; size];
    for i in 0..conns {
        let mut c = connect()?;
        std::io::Write::write_all(&mut c, &header(Op::Fan, size))?;
        let fd = c.as_raw_fd()?;
        set_nonblocking(fd)?;
        epoll_add(ep, fd, i as u64)?;
        fill(&mut tx, 0);
        write_all(fd, &tx)?;
        fl.push(Flight { c, seq: 0, got: 0 });
    }
    let mut rx = vec![0u8; conns * size];
    let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
    // The clock starts once every connection has had a reply: the server may still be
    // accepting the last ones well after their connects returned.
    let mut primed = 0;
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut start = None;
    let mut count = 0u64;
    loop {
        let now = Instant::now();
        let t0 = match start {
            Some(t0) if now >= t0 + warmup + dur => break,
            Some(t0) => t0,
            None if now >= give_up => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{primed} of {conns} connections answered within 60 s"),
                ))
            }
            None => now + warmup + dur,
        };
        // SAFETY: `evs` holds room for its length.
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as i32, 100) };
        let counting = Instant::now() >= t0 + warmup;
        for ev in &evs[..n.max(0) as usize] {
            let i = ev.u64 as usize;
            let first = fl[i].seq == 0;
            let done = take_replies(&mut fl[i], &mut rx[i * size..(i + 1) * size], &mut tx)?;
            if counting {
                count += done;
            }
            if first && done > 0 {
                primed += 1;
                if primed == conns {
                    start = Some(Instant::now());
                }
            }
        }
    }
    let from = start.map_or_else(Instant::now, |t0| t0 + warmup);
    let secs = Instant::now().duration_since(from).as_secs_f64();
    // SAFETY: our own epoll fd.
    unsafe { libc::close(ep) };
    drop(fl);
    Ok((count, secs))
}

/// Reads what connection `f` holds; for each complete reply, checks it and sends the next
/// request. The replies completed.
fn take_replies(f: &mut Flight, rx: &mut [u8], tx: &mut [u8]) -> io::Result<u64> {
    let fd = f.c.as_raw_fd()?;
    let mut done = 0;
    loop {
        match read_some(fd, &mut rx[f.got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => f.got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(done),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        if f.got == rx.len() {
            verify(rx, f.seq)?;
            f.seq += 1;
            f.got = 0;
            done += 1;
            fill(tx, f.seq);
            write_all(fd, tx)?;
        }
    }
}
