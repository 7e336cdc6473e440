//! `data_words`: the program only ever sees the `epoll_event.data` words it registered, once
//! per kernel-equivalent event.
//!
//! A waiter thread is already asleep in `epoll_wait` (timeout -1, as tokio's) on a set that
//! holds only kernel fds (an edge-triggered eventfd waker and a pipe) when non-blocking
//! connects are added with
//! `EPOLLIN|EPOLLOUT|EPOLLRDHUP|EPOLLET` right after `connect` (the tokio pattern). Data words:
//! a pointer, random 64-bit values, zero, one word shared by two fds, words equal to fd
//! numbers, `u64::MAX`. Then MOD/DEL/ADD while the waiter sleeps, and connections that the
//! peer closes or resets, or that we close ourselves, meanwhile.
//!
//! Kernel facts relied on (each checked by the reference run): a connect completing gives one
//! `EPOLLOUT` edge; each arrival of data gives one `EPOLLIN` edge; `ep_insert`/`ep_modify` of
//! a ready fd wakes a sleeping waiter at once; nothing is reported for a registration after
//! its DEL/MOD/last close returned.

use super::{no_reaction, Set};
use crate::ensure;
use crate::sys::{self, ERR, ET, HUP, IN, OUT, RDHUP};
use crate::util::{self, evname, ms, Ctx, Net, Opts, Res, Rng};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

const WAKER: u64 = 0xfeed_f00d_0bad_cafe;
const DUP_WORD: u64 = 0x1234_5678_9abc_def0;
const LIMIT: Duration = Duration::from_secs(3);
const QUIET: Duration = Duration::from_millis(30);
/// A sleeping waiter must see an event the kernel reports at once within this.
const PROMPT: Duration = Duration::from_millis(150);

struct Conn {
    label: String,
    word: u64,
    client: Option<OwnedFd>,
    server: Option<OwnedFd>,
}

impl Conn {
    fn fd(&self) -> RawFd {
        self.client.as_ref().map_or(-1, |c| c.as_raw_fd())
    }

    fn sfd(&self) -> RawFd {
        self.server.as_ref().map_or(-1, |s| s.as_raw_fd())
    }
}

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let mut set = Set::new()?;
    let waker = sys::eventfd(libc::EFD_NONBLOCK).ctx("eventfd")?;
    set.add(waker.as_raw_fd(), IN | ET, WAKER, "waker")?;
    let (pr, pw) = sys::pipe().ctx("pipe")?;
    let pipe_word = 1 << 63 | pr.as_raw_fd() as u64;
    set.add(pr.as_raw_fd(), IN | ET, pipe_word, "pipe")?;
    let tid = set.waiter(64, -1, no_reaction());
    util::wait_asleep(tid)?;

    let mut conns = connect_all(&net, &set, &mut rng, waker.as_raw_fd())?;
    for c in &conns {
        expect_edges(&set, c.word, dup_factor(c), OUT, "connect completion")?;
    }
    greet_each(&set, &mut conns)?;
    kernel_fds(
        &set,
        waker.as_raw_fd(),
        pw.as_raw_fd(),
        pr.as_raw_fd(),
        pipe_word,
    )?;
    util::wait_asleep(tid)?;
    changes_while_asleep(&set, &net, &mut conns, tid)?;
    endings(&set, &mut conns, tid)?;
    kernel_fds(
        &set,
        waker.as_raw_fd(),
        pw.as_raw_fd(),
        pr.as_raw_fd(),
        pipe_word,
    )?;
    set.finish()?;
    util::info(&format!(
        "{} events seen, all with registered words",
        set.log.snapshot().len()
    ));
    Ok(())
}

fn dup_factor(c: &Conn) -> usize {
    if c.word == DUP_WORD {
        2
    } else {
        1
    }
}

/// The data words: a pointer, random values, zero, a shared word, fd numbers, `u64::MAX`.
fn words(rng: &mut Rng, fd: RawFd, waker: RawFd, i: usize) -> (String, u64) {
    let ptr = Box::into_raw(Box::new(i as u64)) as u64;
    match i {
        0 => ("pointer".into(), ptr),
        1 => ("random".into(), rng.next() | 1 << 63),
        2 => ("zero".into(), 0),
        3 | 4 => ("shared word".into(), DUP_WORD),
        5 => ("the waker's fd number".into(), waker as u64),
        6 => ("its own fd number".into(), fd as u64),
        7 => (
            "a word beside memloop's tags".into(),
            0x4d4c_7471_0000_0000 | fd as u64,
        ),
        8 => ("u64::MAX".into(), u64::MAX),
        _ => ("random".into(), rng.next()),
    }
}

/// Non-blocking connects, each added to the set right after `connect` while the waiter sleeps
/// (an acceptor thread is already waiting on the listener).
fn connect_all(net: &Net, set: &Set, rng: &mut Rng, waker: RawFd) -> Res<Vec<Conn>> {
    let n = 9;
    std::thread::scope(|scope| {
        let acceptor = scope.spawn(|| accept_n(&net.listener, n));
        let mut conns = Vec::new();
        for i in 0..n {
            let c = sys::tcp_socket(true).ctx("socket")?;
            sys::connect(c.as_raw_fd(), net.addr).ctx("non-blocking connect")?;
            let (what, word) = words(rng, c.as_raw_fd(), waker, i);
            let label = format!("conn {i} ({what})");
            set.add(c.as_raw_fd(), IN | OUT | RDHUP | ET, word, &label)?;
            conns.push(Conn {
                label,
                word,
                client: Some(c),
                server: None,
            });
        }
        util::count_rings(n);
        let servers = acceptor.join().map_err(|_| "acceptor panicked")??;
        pair_up(conns, servers)
    })
}

/// Accepts `n` connections within 5 s.
fn accept_n(l: &std::net::TcpListener, n: usize) -> Res<Vec<OwnedFd>> {
    let end = Instant::now() + Duration::from_secs(5);
    let mut v = Vec::new();
    while v.len() < n {
        ensure!(
            Instant::now() < end,
            "accepted only {} of {n} connections",
            v.len()
        );
        if sys::poll1(l.as_raw_fd(), libc::POLLIN, 50).ctx("poll listener")? != 0 {
            v.push(OwnedFd::from(l.accept().ctx("accept")?.0));
        }
    }
    Ok(v)
}

/// Matches accepted sockets to their clients by port.
fn pair_up(mut conns: Vec<Conn>, servers: Vec<OwnedFd>) -> Res<Vec<Conn>> {
    let mut by_port = Vec::new();
    for s in servers {
        by_port.push((sys::sock_port(s.as_raw_fd(), true).ctx("getpeername")?, s));
    }
    for c in conns.iter_mut() {
        let port = sys::sock_port(c.fd(), false).ctx("getsockname")?;
        let i = by_port
            .iter()
            .position(|(p, _)| *p == port)
            .ok_or(format!("{}: no accepted socket for port {port}", c.label))?;
        let s = by_port.swap_remove(i).1;
        sys::set_nonblock(s.as_raw_fd(), true).ctx("O_NONBLOCK")?;
        c.server = Some(s);
    }
    Ok(conns)
}

/// Exactly `n` new events for `word`, each with `bits`, then quiet.
fn expect_edges(set: &Set, word: u64, n: usize, bits: u32, what: &str) -> Res<()> {
    set.log.wait_for(
        LIMIT,
        &format!("{what}: no {} event for {word:#x}", evname(bits)),
        |v| {
            v.iter()
                .filter(|s| s.data == word && s.events & bits == bits)
                .count()
                >= n
        },
    )?;
    set.quiet(word, n, QUIET, what)
}

/// The server greets each connection: one `EPOLLIN` edge each (`IN|OUT`: the full state).
fn greet_each(set: &Set, conns: &mut [Conn]) -> Res<()> {
    for c in conns.iter() {
        let before = set.count(c.word);
        let s = c.sfd();
        sys::send_all(s, b"g").ctx("greeting")?;
        let e = set.next(c.word, before, LIMIT, &format!("greeting on {}", c.label))?;
        ensure!(
            e.events == IN | OUT,
            "{}: greeting reported as {}, want IN|OUT",
            c.label,
            evname(e.events)
        );
        set.quiet(
            c.word,
            before + 1,
            QUIET,
            &format!("one edge per arrival on {}", c.label),
        )?;
    }
    Ok(())
}

/// The waker (ET eventfd) and a pipe: one event per write.
fn kernel_fds(set: &Set, waker: RawFd, pw: RawFd, pr: RawFd, pipe_word: u64) -> Res<()> {
    for _ in 0..3 {
        let before = set.count(WAKER);
        sys::eventfd_add(waker, 1).ctx("wake")?;
        set.next(WAKER, before, LIMIT, "eventfd waker")?;
        set.quiet(WAKER, before + 1, QUIET, "one event per wake")?;
        let before = set.count(pipe_word);
        sys::write(pw, b"p").ctx("pipe write")?;
        set.next(pipe_word, before, LIMIT, "pipe write")?;
        set.quiet(pipe_word, before + 1, QUIET, "one event per pipe write")?;
    }
    let mut b = [0u8; 16];
    let _ = sys::read(pr, &mut b);
    let _ = sys::eventfd_take(waker);
    Ok(())
}

/// MOD, DEL and ADD while the waiter sleeps; events must follow at once, with the new words.
fn changes_while_asleep(set: &Set, net: &Net, conns: &mut [Conn], tid: i32) -> Res<()> {
    // MOD to a new word with unread data (the greeting): one event at once, new word only.
    let c = &mut conns[0];
    let new = 0x0a0b_0c0d_0e0f_1011;
    let t0 = Instant::now();
    set.modify(c.fd(), c.word, IN | ET, new, "conn 0 after MOD")?;
    let e = set.next(
        new,
        0,
        LIMIT,
        "MOD of a readable fd while the waiter sleeps",
    )?;
    prompt(e.at - t0, "MOD of a readable fd")?;
    set.quiet(new, 1, QUIET, "MOD of a readable fd")?;
    c.word = new;
    // DEL, then data: never an event for the old word (the book rules out phantoms).
    util::wait_asleep(tid)?;
    let c = &conns[1];
    set.del(c.fd(), c.word, &c.label)?;
    let before = set.count(c.word);
    sys::send_all(c.sfd(), b"x").ctx("send")?;
    set.quiet(c.word, before, QUIET * 3, "data after DEL")?;
    // DEL + ADD level-triggered with a new word: reported at once, until read.
    let c = &mut conns[1];
    let new = 0x7fff_ffff_ffff_0001;
    let t0 = Instant::now();
    set.add(c.fd(), IN, new, "conn 1 re-added (LT)")?;
    let e = set.next(
        new,
        0,
        LIMIT,
        "ADD of a readable fd while the waiter sleeps",
    )?;
    prompt(e.at - t0, "ADD of a readable fd")?;
    let (got, _, _) = util::drain(c.fd());
    ensure!(got == b"gx", "conn 1: read {got:?}, want \"gx\"");
    std::thread::sleep(QUIET);
    let n = set.count(new);
    set.quiet(new, n, QUIET, "level-triggered fd after reading it empty")?;
    c.word = new;
    fresh_ready_add(set, net, tid)
}

/// A settled connection with data already waiting, added while the waiter sleeps.
fn fresh_ready_add(set: &Set, net: &Net, tid: i32) -> Res<()> {
    let (c, s) = net.pair()?;
    util::handshake(c.as_raw_fd(), s.as_raw_fd())?;
    sys::send_all(s.as_raw_fd(), b"ready").ctx("send")?;
    std::thread::sleep(Duration::from_millis(5));
    util::wait_asleep(tid)?;
    let word = 0xc0ff_ee00_0000_0001;
    let t0 = Instant::now();
    set.add(
        c.as_raw_fd(),
        IN | RDHUP | ET,
        word,
        "settled conn with data, added late",
    )?;
    let e = set.next(
        word,
        0,
        LIMIT,
        "ADD of a settled readable ring fd while the waiter sleeps",
    )?;
    prompt(e.at - t0, "ADD of a readable connection")?;
    ensure!(
        e.events == IN,
        "late ADD: events {}, want IN",
        evname(e.events)
    );
    set.quiet(word, 1, QUIET, "late ADD")?;
    set.del(c.as_raw_fd(), word, "late ADD")?;
    Ok(())
}

fn prompt(d: Duration, what: &str) -> Res<()> {
    ensure!(
        d <= PROMPT,
        "{what}: the sleeping waiter saw the event only after {:.1} ms (the kernel wakes it at \
         once)",
        ms(d)
    );
    Ok(())
}

/// The peer closes one connection, resets another; we close a third ourselves.
fn endings(set: &Set, conns: &mut [Conn], tid: i32) -> Res<()> {
    util::wait_asleep(tid)?;
    let c = &mut conns[5];
    let before = set.count(c.word);
    drop(c.server.take());
    let e = set.next(
        c.word,
        before,
        LIMIT,
        &format!("peer's close of {}", c.label),
    )?;
    ensure!(
        e.events & (IN | RDHUP) == IN | RDHUP && e.events & (HUP | ERR) == 0,
        "{}: peer close reported as {}, want IN|OUT|RDHUP",
        c.label,
        evname(e.events)
    );
    set.quiet(c.word, before + 1, QUIET, "one event for the peer's FIN")?;

    let c = &mut conns[6];
    let before = set.count(c.word);
    sys::abort(c.server.take().expect("paired")).ctx("reset")?;
    let e = set.next(
        c.word,
        before,
        LIMIT,
        &format!("peer's reset of {}", c.label),
    )?;
    ensure!(
        e.events & (IN | RDHUP | HUP | ERR) == IN | RDHUP | HUP | ERR,
        "{}: peer reset reported as {}, want IN|OUT|RDHUP|HUP|ERR",
        c.label,
        evname(e.events)
    );

    // Our own close of a registered connection: its registration is gone with it.
    let c = &mut conns[7];
    let fd = c.fd();
    drop(c.client.take());
    set.book.closed(fd);
    let s = c.sfd();
    let _ = sys::send(s, b"after close", 0);
    set.quiet(
        c.word,
        set.count(c.word),
        QUIET * 3,
        "data after our own close",
    )?;
    Ok(())
}
