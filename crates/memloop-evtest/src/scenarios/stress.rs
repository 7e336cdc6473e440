//! `stress`: four threads wait on one epoll set (maxevents 1, 2, 4, 8) while two controller
//! threads connect, ADD (level-triggered, edge-triggered, one-shot; random words, some of
//! them shaped like memloop's tag), MOD, DEL, re-ADD and close (some with a reset)
//! connections at random; a peer *process* (this binary, `__stress_peer`) accepts them and
//! streams a checksummed byte stream of a size derived from the seed and the connection id,
//! then closes it or resets it.
//!
//! Checked: every event's data word belongs to a registration live during the call (see
//! [`crate::book`]) and its bits to that registration's interest; a one-shot arm fires at most
//! once; every byte read is the right one; a connection the peer closed ends with EOF after
//! exactly its size, one it reset with ECONNRESET after at most its size; once the
//! controllers stop (and idle connections are re-added), every connection reaches its end —
//! a connection that never does lost its event. Runs until `--events` events were seen.

use crate::book::{Book, Reg};
use crate::ensure;
use crate::sys::{self, Errno, Ev, ET, IN, ONESHOT, OUT, RDHUP};
use crate::util::{self, splitmix, stream_bytes, stream_mismatch, Ctx, Opts, Res, Rng};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const WAITERS: [usize; 4] = [1, 2, 4, 8];
const CONTROLLERS: u64 = 2;
const MAX_LIVE: usize = 24;
/// Time for generating 10^5 events (the watchdog fires at 40 s); more events get more time.
const GEN_LIMIT: Duration = Duration::from_secs(26);

/// The time a run of `events` events gets beyond that of 10^5 (1 s per 4000 more).
pub fn extra_time(events: u64) -> Duration {
    Duration::from_secs(events.saturating_sub(100_000) / 4000)
}
const DRAIN_LIMIT: Duration = Duration::from_secs(8);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- the plan both sides derive ------------------------------------------------------------

/// What the peer does with connection `id`: send `total` bytes, then close, or reset.
#[derive(Clone, Copy, Debug)]
struct Plan {
    total: u64,
    reset: bool,
}

fn plan(seed: u64, id: u64, churn: bool) -> Plan {
    let r = splitmix(seed.wrapping_mul(0x51_7cc1_b727_220a) ^ id);
    if churn {
        return Plan {
            total: (r >> 8) % 2048,
            reset: (r >> 40) % 5 == 0,
        };
    }
    let total = match r % 20 {
        0..=5 => (r >> 8) % 4096,
        6..=16 => 4096 + (r >> 8) % 60_000,
        _ => 65_536 + (r >> 8) % 400_000,
    };
    Plan {
        total,
        reset: (r >> 40) % 5 == 0,
    }
}

fn key(seed: u64, id: u64) -> u64 {
    splitmix(seed ^ 0x5eed) ^ id
}

// ---- client side ----------------------------------------------------------------------------

#[derive(Default)]
struct Ctl {
    /// The registered data word and its events, if registered.
    word: Option<(u64, u32)>,
    closed: bool,
}

#[derive(Default)]
struct ReadState {
    off: u64,
    /// How the connection ended: `Ok(())` EOF, `Err(errno)` an error.
    end: Option<Result<(), i32>>,
}

struct Conn {
    id: u64,
    /// Closed by `Drop`, before its registration is marked ended.
    fd: RawFd,
    plan: Plan,
    ctl: Mutex<Ctl>,
    rd: Mutex<ReadState>,
    book: Arc<Book>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The last copy of the fd: its registration goes with it.
        let _ = sys::close(self.fd);
        let word = lock(&self.ctl).word;
        if let Some((w, _)) = word {
            self.book.ended(w);
        }
    }
}

#[derive(Default)]
struct Stats {
    events: AtomicU64,
    conns: AtomicU64,
    mods: AtomicU64,
    dels: AtomicU64,
    readds: AtomicU64,
    our_closes: AtomicU64,
    eofs: AtomicU64,
    resets: AtomicU64,
    bytes: AtomicU64,
    stale: AtomicU64,
}

struct State {
    seed: u64,
    /// Short connections (at most 2 KiB each): as many connections per second as possible.
    churn: bool,
    ep: OwnedFd,
    book: Arc<Book>,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    words: Mutex<HashSet<u64>>,
    fired: Mutex<HashMap<u64, u32>>,
    next_id: AtomicU64,
    stop_gen: AtomicBool,
    stop_wait: AtomicBool,
    fail: Mutex<Option<String>>,
    stats: Stats,
    peer: SocketAddrV4,
}

impl State {
    fn fail(&self, why: String) {
        let mut f = lock(&self.fail);
        if f.is_none() {
            *f = Some(why);
        }
        self.stop_gen.store(true, SeqCst);
    }

    fn failure(&self) -> Res<()> {
        lock(&self.fail).clone().map_or(Ok(()), Err)
    }

    fn epfd(&self) -> RawFd {
        self.ep.as_raw_fd()
    }

    /// A data word never used before: random, sometimes memloop-tag-shaped or pointer-like.
    fn fresh_word(&self, rng: &mut Rng) -> u64 {
        let mut words = lock(&self.words);
        loop {
            let w = match rng.below(8) {
                0 => 0x4d4c_7470_0000_0000 | (rng.next() & 0xffff_ffff),
                1 => 0x0000_7f00_0000_0000 | (rng.next() & 0xff_ffff_fff8),
                _ => rng.next(),
            };
            if words.insert(w) {
                return w;
            }
        }
    }
}

/// Random interest: level-triggered, edge-triggered or one-shot.
fn mode(rng: &mut Rng) -> u32 {
    let rdhup = if rng.chance(0.5) { RDHUP } else { 0 };
    match rng.below(3) {
        0 => IN | rdhup,
        1 => IN | ET | rdhup | if rng.chance(0.3) { OUT } else { 0 },
        _ => IN | ONESHOT | rdhup | if rng.chance(0.5) { ET } else { 0 },
    }
}

pub fn run(o: &Opts) -> Res<()> {
    run_mode(o, false)
}

/// `stress_churn`: the same with short connections, so channels are freed and reused at the
/// highest rate while waiters and controllers work on the set.
pub fn run_churn(o: &Opts) -> Res<()> {
    run_mode(o, true)
}

fn run_mode(o: &Opts, churn: bool) -> Res<()> {
    let mut peer = Peer::spawn(o.seed, o.events, churn)?;
    let st = Arc::new(State {
        seed: o.seed,
        churn,
        ep: sys::epoll_create().ctx("epoll_create1")?,
        book: Book::new(),
        conns: Mutex::default(),
        words: Mutex::default(),
        fired: Mutex::default(),
        next_id: AtomicU64::new(1),
        stop_gen: AtomicBool::new(false),
        stop_wait: AtomicBool::new(false),
        fail: Mutex::default(),
        stats: Stats::default(),
        peer: SocketAddrV4::new(Ipv4Addr::LOCALHOST, peer.port),
    });
    let waiters: Vec<_> = WAITERS
        .iter()
        .map(|&max| {
            let st = st.clone();
            std::thread::spawn(move || waiter(&st, max))
        })
        .collect();
    let controllers: Vec<_> = (0..CONTROLLERS)
        .map(|i| {
            let st = st.clone();
            let seed = o.seed.wrapping_mul(31).wrapping_add(i);
            std::thread::spawn(move || controller(&st, seed))
        })
        .collect();
    let r = generate(&st, o.events);
    st.stop_gen.store(true, SeqCst);
    for c in controllers {
        let _ = c.join();
    }
    peer.close_stdin();
    let r = r.and_then(|_| drain(&st));
    st.stop_wait.store(true, SeqCst);
    for w in waiters {
        let _ = w.join();
    }
    r?;
    st.failure()?;
    peer.finish()?;
    report(&st);
    Ok(())
}

fn generate(st: &State, target: u64) -> Res<()> {
    let t0 = Instant::now();
    let limit = GEN_LIMIT + extra_time(target);
    while st.stats.events.load(SeqCst) < target {
        st.failure()?;
        ensure!(
            t0.elapsed() < limit,
            "only {} of {target} events within {limit:?} ({} connections)",
            st.stats.events.load(SeqCst),
            st.stats.conns.load(SeqCst)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    util::info(&format!(
        "{} events in {:.2} s",
        st.stats.events.load(SeqCst),
        t0.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn report(st: &State) {
    let s = &st.stats;
    let g = |a: &AtomicU64| a.load(SeqCst);
    util::info(&format!(
        "events {} connections {} (ended by EOF {}, by reset {}, closed by us {}) MOD {} DEL {} \
         re-ADD {} bytes {} events for ended/closed connections {}",
        g(&s.events),
        g(&s.conns),
        g(&s.eofs),
        g(&s.resets),
        g(&s.our_closes),
        g(&s.mods),
        g(&s.dels),
        g(&s.readds),
        g(&s.bytes),
        g(&s.stale)
    ));
}

// ---- waiters ---------------------------------------------------------------------------------

fn waiter(st: &State, max: usize) {
    while !st.stop_wait.load(SeqCst) {
        let start = st.book.now();
        let evs = match sys::ep_wait(st.epfd(), max, 50) {
            Ok(v) => v,
            Err(Errno(libc::EINTR)) => continue,
            Err(e) => return st.fail(format!("epoll_wait: {e}")),
        };
        let end = st.book.now();
        st.stats.events.fetch_add(evs.len() as u64, SeqCst);
        for ev in evs {
            match st.book.check(ev, start, end) {
                Ok(reg) => on_event(st, ev, &reg),
                Err(why) => st.fail(why),
            }
        }
    }
}

fn on_event(st: &State, ev: Ev, reg: &Reg) {
    if reg.events & ONESHOT != 0 {
        let mut f = lock(&st.fired);
        let n = f.entry(ev.data).or_default();
        *n += 1;
        if *n > 1 {
            return st.fail(format!(
                "one-shot registration {:#x} (conn {}) fired {} times",
                ev.data, reg.label, n
            ));
        }
    }
    let id: u64 = reg.label.parse().unwrap_or(0);
    let Some(c) = lock(&st.conns).get(&id).cloned() else {
        st.stats.stale.fetch_add(1, SeqCst);
        return;
    };
    if ev.events & (IN | RDHUP | sys::HUP | sys::ERR) != 0 {
        let whole = reg.events & (ET | ONESHOT) != 0;
        if let Err(why) = read_conn(st, &c, whole) {
            return st.fail(format!("conn {id}: {why}"));
        }
    }
    after_event(st, &c, ev.data, reg.events);
}

/// Reads a chunk (level-triggered) or to EAGAIN (edge/one-shot), checking the bytes.
fn read_conn(st: &State, c: &Conn, whole: bool) -> Res<()> {
    let mut rd = lock(&c.rd);
    if rd.end.is_some() || lock(&c.ctl).closed {
        return Ok(());
    }
    let mut buf = vec![0u8; if whole { 65536 } else { 1500 }];
    loop {
        match sys::recv(c.fd, &mut buf, libc::MSG_DONTWAIT) {
            Ok(0) => return ended(st, c, &mut rd, Ok(())),
            Ok(n) => {
                if let Some(at) = stream_mismatch(key(st.seed, c.id), rd.off, &buf[..n]) {
                    return Err(format!("wrong byte at offset {at} (plan {:?})", c.plan));
                }
                rd.off += n as u64;
                st.stats.bytes.fetch_add(n as u64, SeqCst);
                ensure!(
                    rd.off <= c.plan.total,
                    "read {} bytes of a {}-byte stream",
                    rd.off,
                    c.plan.total
                );
                if !whole {
                    return Ok(());
                }
            }
            Err(Errno(libc::EAGAIN)) => return Ok(()),
            Err(Errno(libc::EINTR)) => continue,
            Err(Errno(e)) => return ended(st, c, &mut rd, Err(e)),
        }
    }
}

/// The stream ended: exactly as planned?
fn ended(st: &State, c: &Conn, rd: &mut ReadState, how: Result<(), i32>) -> Res<()> {
    rd.end = Some(how);
    match (how, c.plan.reset) {
        (Ok(()), false) => {
            ensure!(
                rd.off == c.plan.total,
                "EOF after {} of {} bytes (lost bytes)",
                rd.off,
                c.plan.total
            );
            st.stats.eofs.fetch_add(1, SeqCst);
        }
        (Err(libc::ECONNRESET), true) => {
            st.stats.resets.fetch_add(1, SeqCst);
        }
        (how, reset) => {
            return Err(format!(
                "ended with {} after {} bytes, but the peer {} after {} bytes",
                match how {
                    Ok(()) => "EOF".to_string(),
                    Err(e) => Errno(e).to_string(),
                },
                rd.off,
                if reset { "reset it" } else { "closed it" },
                c.plan.total
            ))
        }
    }
    Ok(())
}

/// After handling an event: retire an ended connection, or re-arm a fired one-shot.
fn after_event(st: &State, c: &Arc<Conn>, word: u64, events: u32) {
    let done = lock(&c.rd).end.is_some();
    let mut ctl = lock(&c.ctl);
    if ctl.closed {
        return;
    }
    let current = ctl.word.map(|(w, _)| w) == Some(word);
    let r = if done {
        retire(st, c, &mut ctl)
    } else if current && events & ONESHOT != 0 {
        let w = st.fresh_word(&mut Rng::new(word ^ c.id));
        let r = st
            .book
            .modify(st.epfd(), c.fd, word, events, w, &c.id.to_string());
        ctl.word = Some((w, events));
        r.ctx("MOD re-arming a one-shot")
    } else {
        Ok(())
    };
    if let Err(why) = r {
        st.fail(format!("conn {}: {why}", c.id));
    }
}

/// An ended connection leaves the set and the table (its fd closes with the last reference).
fn retire(st: &State, c: &Conn, ctl: &mut Ctl) -> Res<()> {
    ctl.closed = true;
    lock(&st.conns).remove(&c.id);
    match ctl.word.take() {
        Some((w, _)) => st
            .book
            .del(st.epfd(), c.fd, w)
            .ctx("DEL of an ended connection"),
        None => Ok(()),
    }
}

// ---- controllers -----------------------------------------------------------------------------

fn controller(st: &State, seed: u64) {
    let mut rng = Rng::new(seed);
    while !st.stop_gen.load(SeqCst) {
        let r = match rng.below(100) {
            0..=19 => connect(st, &mut rng),
            20..=59 => with_random(st, &mut rng, true, modify),
            60..=71 => with_random(st, &mut rng, true, del),
            72..=85 => with_random(st, &mut rng, false, readd),
            86..=88 => with_random_any(st, &mut rng, close),
            _ => Ok(()),
        };
        if let Err(why) = r {
            return st.fail(why);
        }
        if rng.chance(0.5) {
            std::thread::sleep(Duration::from_micros(rng.range(10, 300)));
        }
    }
}

fn connect(st: &State, rng: &mut Rng) -> Res<()> {
    if lock(&st.conns).len() >= MAX_LIVE {
        return Ok(());
    }
    let id = st.next_id.fetch_add(1, SeqCst);
    let fd = sys::tcp_socket(false).ctx("socket")?;
    sys::connect(fd.as_raw_fd(), st.peer).ctx("connect to the peer process")?;
    sys::send_all(fd.as_raw_fd(), &id.to_le_bytes()).ctx("send the connection id")?;
    sys::set_nonblock(fd.as_raw_fd(), true).ctx("O_NONBLOCK")?;
    util::count_rings(1);
    let c = Arc::new(Conn {
        id,
        fd: fd.into_raw_fd(),
        plan: plan(st.seed, id, st.churn),
        ctl: Mutex::default(),
        rd: Mutex::default(),
        book: st.book.clone(),
    });
    st.stats.conns.fetch_add(1, SeqCst);
    // In the table before the ADD (its first event must find it), locked until registered.
    let mut ctl = lock(&c.ctl);
    lock(&st.conns).insert(id, c.clone());
    let (w, ev) = (st.fresh_word(rng), mode(rng));
    st.book
        .add(st.epfd(), c.fd, ev, w, &id.to_string())
        .ctx(&format!("ADD conn {id}"))?;
    ctl.word = Some((w, ev));
    Ok(())
}

/// Runs `f` on a random connection that is (`registered`) or is not registered.
fn with_random(
    st: &State,
    rng: &mut Rng,
    registered: bool,
    f: fn(&State, &Conn, &mut Ctl, &mut Rng) -> Res<()>,
) -> Res<()> {
    let Some(c) = pick(st, rng) else {
        return Ok(());
    };
    let mut ctl = lock(&c.ctl);
    if ctl.closed || ctl.word.is_some() != registered {
        return Ok(());
    }
    f(st, &c, &mut ctl, rng).map_err(|e| format!("conn {}: {e}", c.id))
}

fn with_random_any(
    st: &State,
    rng: &mut Rng,
    f: fn(&State, Arc<Conn>, &mut Rng) -> Res<()>,
) -> Res<()> {
    match pick(st, rng) {
        Some(c) => f(st, c, rng),
        None => Ok(()),
    }
}

fn pick(st: &State, rng: &mut Rng) -> Option<Arc<Conn>> {
    let conns = lock(&st.conns);
    if conns.is_empty() {
        return None;
    }
    let i = rng.below(conns.len() as u64) as usize;
    conns.values().nth(i).cloned()
}

fn modify(st: &State, c: &Conn, ctl: &mut Ctl, rng: &mut Rng) -> Res<()> {
    let (old, _) = ctl.word.expect("registered");
    let (w, ev) = (st.fresh_word(rng), mode(rng));
    st.book
        .modify(st.epfd(), c.fd, old, ev, w, &c.id.to_string())
        .ctx("MOD")?;
    ctl.word = Some((w, ev));
    st.stats.mods.fetch_add(1, SeqCst);
    Ok(())
}

fn del(st: &State, c: &Conn, ctl: &mut Ctl, _rng: &mut Rng) -> Res<()> {
    let (old, _) = ctl.word.expect("registered");
    st.book.del(st.epfd(), c.fd, old).ctx("DEL")?;
    ctl.word = None;
    st.stats.dels.fetch_add(1, SeqCst);
    Ok(())
}

fn readd(st: &State, c: &Conn, ctl: &mut Ctl, rng: &mut Rng) -> Res<()> {
    let (w, ev) = (st.fresh_word(rng), mode(rng));
    st.book
        .add(st.epfd(), c.fd, ev, w, &c.id.to_string())
        .ctx("re-ADD")?;
    ctl.word = Some((w, ev));
    st.stats.readds.fetch_add(1, SeqCst);
    Ok(())
}

/// Closes a connection (sometimes with a reset): half the time after a DEL, else while
/// registered (the registration goes with the last reference to the fd).
fn close(st: &State, c: Arc<Conn>, rng: &mut Rng) -> Res<()> {
    {
        let mut ctl = lock(&c.ctl);
        if ctl.closed {
            return Ok(());
        }
        ctl.closed = true;
        if rng.chance(0.5) {
            sys::linger0(c.fd).ctx("SO_LINGER")?;
        }
        if rng.chance(0.5) {
            if let Some((w, _)) = ctl.word.take() {
                st.book.del(st.epfd(), c.fd, w).ctx("DEL before close")?;
            }
        }
    }
    st.stats.our_closes.fetch_add(1, SeqCst);
    // Usually the last reference: the fd closes here.
    lock(&st.conns).remove(&c.id);
    Ok(())
}

// ---- the end -------------------------------------------------------------------------------

/// Re-adds idle connections, then waits until every connection has ended.
fn drain(st: &State) -> Res<()> {
    let conns: Vec<Arc<Conn>> = lock(&st.conns).values().cloned().collect();
    let mut rng = Rng::new(st.seed ^ 0xd4a1);
    for c in conns {
        let mut ctl = lock(&c.ctl);
        if !ctl.closed && ctl.word.is_none() {
            readd(st, &c, &mut ctl, &mut rng)?;
        }
    }
    let r = util::wait_until(DRAIN_LIMIT, "", || {
        st.failure()?;
        Ok(lock(&st.conns).is_empty().then_some(()))
    });
    if r.is_err() {
        st.failure()?;
        return Err(lost(st));
    }
    Ok(())
}

fn lost(st: &State) -> String {
    let conns = lock(&st.conns);
    let mut v: Vec<String> = conns
        .values()
        .take(5)
        .map(|c| {
            let (rd, ctl) = (lock(&c.rd), lock(&c.ctl));
            format!(
                "conn {} read {} of {} (reset {}), registered {:?}, {} bytes waiting, end {:?}",
                c.id,
                rd.off,
                c.plan.total,
                c.plan.reset,
                ctl.word.map(|(w, e)| (
                    format!("{w:#x}"),
                    util::evname(e),
                    e & ET != 0,
                    e & ONESHOT != 0
                )),
                sys::fionread(c.fd).unwrap_or(usize::MAX),
                rd.end
            )
        })
        .collect();
    v.insert(0, format!("{} connection(s) never reached their end within {DRAIN_LIMIT:?} after the controllers stopped (lost events)", conns.len()));
    v.join("; ")
}

// ---- the peer process ---------------------------------------------------------------------

struct Peer {
    child: Child,
    port: u16,
}

impl Peer {
    fn spawn(seed: u64, events: u64, churn: bool) -> Res<Peer> {
        let exe = std::env::current_exe().ctx("current_exe")?;
        let mut child = Command::new(exe)
            .args([
                "__stress_peer",
                &seed.to_string(),
                &events.to_string(),
                if churn { "1" } else { "0" },
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .ctx("spawn the peer process")?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line).ctx("read the peer's port")?;
        // Whatever else the peer says (a FAIL line) goes to our output.
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                crate::say(&format!("peer: {l}"));
            }
        });
        let port = line
            .trim()
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .ok_or(format!("the peer said {line:?}, want \"port N\""))?;
        Ok(Peer { child, port })
    }

    fn close_stdin(&mut self) {
        drop(self.child.stdin.take());
    }

    fn finish(&mut self) -> Res<()> {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(st) = self.child.try_wait().ctx("wait for the peer")? {
                ensure!(st.success(), "the peer process failed: {st}");
                return Ok(());
            }
            ensure!(Instant::now() < end, "the peer process did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct Out {
    fd: OwnedFd,
    id: u64,
    plan: Plan,
    sent: u64,
}

/// `__stress_peer SEED EVENTS CHURN`: accepts connections, reads each one's id, streams its planned bytes,
/// then closes or resets it; exits when its stdin closes and every connection is done.
pub fn peer_main(args: &[String]) -> Res<()> {
    let num = |i: usize| args.get(i).and_then(|a| a.parse::<u64>().ok());
    let events = num(1).ok_or("events argument")?;
    let churn = num(2).ok_or("churn argument")? == 1;
    crate::watchdog_after("stress peer".into(), 40 + extra_time(events).as_secs());
    let seed: u64 = args
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or("seed argument")?;
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).ctx("bind")?;
    let port = listener.local_addr().ctx("local_addr")?.port();
    {
        let mut o = std::io::stdout().lock();
        writeln!(o, "port {port}").ctx("stdout")?;
        o.flush().ctx("stdout")?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stdin_watch = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut b = [0u8; 64];
            while sys::read(0, &mut b).is_ok_and(|n| n > 0) {}
            stop.store(true, SeqCst);
        })
    };
    let (txs, writers): (Vec<_>, Vec<_>) = (0..2)
        .map(|_| {
            let (tx, rx) = std::sync::mpsc::channel::<Out>();
            (tx, std::thread::spawn(move || writer(rx, seed)))
        })
        .unzip();
    let r = accept_loop(&listener, (seed, churn), &stop, &txs);
    drop(txs);
    for w in writers {
        w.join().map_err(|_| "writer panicked")??;
    }
    let _ = stdin_watch.join();
    r
}

fn accept_loop(
    l: &std::net::TcpListener,
    (seed, churn): (u64, bool),
    stop: &AtomicBool,
    txs: &[std::sync::mpsc::Sender<Out>],
) -> Res<()> {
    let mut n = 0usize;
    while !stop.load(SeqCst) {
        if sys::poll1(l.as_raw_fd(), libc::POLLIN, 50).ctx("poll listener")? == 0 {
            continue;
        }
        let (s, _) = l.accept().ctx("accept")?;
        let fd = OwnedFd::from(s);
        // The client sends the id before anything else and closes (or resets) a connection
        // only after that: data sent before a reset arrives before the reset.
        let b = util::read_exact(fd.as_raw_fd(), 8, Duration::from_secs(5))
            .map_err(|e| format!("reading a new connection's 8-byte id: {e}"))?;
        let id = u64::from_le_bytes(b.try_into().expect("8"));
        sys::set_nonblock(fd.as_raw_fd(), true).ctx("O_NONBLOCK")?;
        let o = Out {
            fd,
            id,
            plan: plan(seed, id, churn),
            sent: 0,
        };
        let _ = txs[n % txs.len()].send(o);
        n += 1;
    }
    Ok(())
}

fn writer(rx: std::sync::mpsc::Receiver<Out>, seed: u64) -> Res<()> {
    let mut outs: Vec<Out> = Vec::new();
    let mut rng = Rng::new(seed ^ 0x3173);
    let mut open = true;
    while open || !outs.is_empty() {
        loop {
            match rx.try_recv() {
                Ok(o) => outs.push(o),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let mut progress = false;
        outs.retain_mut(|o| match push(o, seed, &mut rng) {
            Step::More(p) => {
                progress |= p;
                true
            }
            Step::Done => {
                progress = true;
                false
            }
        });
        if !progress {
            wait_writable(&outs);
        }
    }
    Ok(())
}

enum Step {
    /// Still sending; whether bytes moved.
    More(bool),
    Done,
}

fn push(o: &mut Out, seed: u64, rng: &mut Rng) -> Step {
    let fd = o.fd.as_raw_fd();
    if o.sent == o.plan.total {
        if o.plan.reset {
            let _ = sys::linger0(fd);
        }
        return Step::Done;
    }
    let n = (rng.range(1, 16384)).min(o.plan.total - o.sent) as usize;
    let bytes = stream_bytes(key(seed, o.id), o.sent, n);
    match sys::send(fd, &bytes, libc::MSG_DONTWAIT) {
        Ok(k) => {
            o.sent += k as u64;
            Step::More(true)
        }
        Err(Errno(libc::EAGAIN)) | Err(Errno(libc::EINTR)) => Step::More(false),
        // The client closed it (allowed: it closes connections at random).
        Err(_) => Step::Done,
    }
}

fn wait_writable(outs: &[Out]) {
    let mut fds: Vec<libc::pollfd> = outs
        .iter()
        .map(|o| libc::pollfd {
            fd: o.fd.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        })
        .collect();
    if fds.is_empty() {
        std::thread::sleep(Duration::from_millis(2));
        return;
    }
    let _ = sys::poll(&mut fds, 5);
}
