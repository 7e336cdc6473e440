//! The late ring: a connection that fell back to TCP at connect for a transient reason (the
//! server accepted after the client's decide wait, the region was full, the client's offer
//! came after the server's decline marker) comes to a ring mid-stream, through the promotion
//! of switched connections (`conn/promote.rs`).
//!
//! - The client's heartbeat finds the server's decline marker for its 4-tuple, publishes a
//!   *late offer* (a channel whose switch word already says "both sides switched to TCP for
//!   `late`, promotion asked": the agreement of new connections never takes it) and sets a bit
//!   in the marker's switch word.
//! - The server's data calls on the plain connection look at that word (one shared load);
//!   once set, the next call accepts the offer and becomes a switched [`Conn`].
//! - The client's heartbeat sees the channel accepted; its next data call converts too.
//! - Both count their TCP phase from the kernel's stream positions since the connection began
//!   (exact, whoever made the calls), and the promotion brings the stream to the ring.
//!
//! A conversion needs the connection to itself: each data call, `poll`/`select` and
//! `epoll_ctl` on an armed connection is counted in flight, and the converter waits (bounded)
//! for none. The epoll registrations of the socket (made here while armed, or items of ours
//! from before the fallback) move into our epoll sets at the conversion, so an event loop
//! keeps watching it; a thread asleep in `epoll_wait` meanwhile is armed and kicked like for
//! any item added under a sleeper. Anything that could use the socket where we cannot
//! follow — dup, `SCM_RIGHTS`, a one-shot or exclusive epoll interest, shutdown, urgent data,
//! splice, exec, a fork the child is not counted for — disarms it for good ([`taint`]); a
//! server's fork child that is counted follows it (`marker.rs`). A peer that is not a member
//! never gets here: its connection has no `Late` at all. Nor may a socket another process
//! took with `pidfd_getfd` (a dup we are not told of): that process pins the server's marker
//! ([`taken_elsewhere`]), and neither side offers or takes a late ring for it any more.

mod marker;
pub use marker::{any_armed, at_exit};

use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::plain::PlainTcp;
use crate::table::{self, Entry};
use libc::c_int;
use marker::MarkerHold;
use memloop::registry::{ChannelId, ChannelState, ConnTuple, Registry, Side};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Armed, nothing under way.
const IDLE: u8 = 0;
/// Client: late offer published, the server has not taken it yet.
const OFFERED: u8 = 1;
/// Client: the server took it; the next data call converts.
const READY: u8 = 2;
/// A data call is converting the connection; other calls wait and route again.
const CONVERTING: u8 = 3;
/// Converted: the fd's table entry is the new connection.
const DONE: u8 = 4;
/// Disarmed for good.
const OFF: u8 = 5;

/// Heartbeats (200 ms) a client looks for the server's marker before it gives up.
const MARKER_TICKS: u32 = 50;
/// Heartbeats a late offer waits for the server to take it before it is withdrawn.
const ACCEPT_TICKS: u32 = 25;
/// Late offers per connection.
const MAX_OFFERS: u32 = 3;
/// Conversions that found calls in flight, before the connection stays on TCP.
const MAX_BUSY: u32 = 20;
/// How long a conversion waits for the calls in flight to end.
const DRAIN_WAIT: Duration = Duration::from_millis(20);

enum Role {
    Client,
    /// The server, with its listener's endpoint and its hold on its decline marker (whose
    /// switch word carries the client's signal).
    Server {
        ep: memloop::registry::EndpointId,
        marker: MarkerHold,
    },
}

/// A plain connection's late-ring state (`PlainTcp::late`).
pub struct Late {
    engine: Arc<Engine>,
    role: Role,
    tuple: ConnTuple,
    state: AtomicU8,
    inflight: AtomicU32,
    /// Of those, polls and selects.
    polls: AtomicU32,
    /// The late offer (client: ours; server: the one being taken).
    ch: ForkMutex<Option<ChannelId>>,
    ticks: AtomicU32,
    offers: AtomicU32,
    busy: AtomicU32,
    /// The socket's kernel epoll registrations (set, events, data), moved into our sets at
    /// the conversion.
    epolls: ForkMutex<Vec<(c_int, u32, u64)>>,
    /// A fork child's copy: the offer is the parent's, nothing here may change it.
    forgotten: AtomicBool,
    /// Counted in [`UNLISTED`] while armed.
    unlisted: AtomicBool,
    /// Client: counted among the region's clients that may look for a marker while armed
    /// ([`LookToken`]).
    looking: AtomicBool,
}

/// A member client that may look for a server's decline marker, counted in the region while
/// it lives (`Registry::late_clients_add`): a server that finds neither an announced connect
/// nor such a client for a connection it accepted without an offer knows the client runs
/// without the library, and publishes no marker for it (no late ring can come).
pub struct LookToken {
    engine: Arc<Engine>,
    /// The process that counted it (a fork child's copy must not uncount the parent's).
    pid: u32,
    counted: bool,
}

impl LookToken {
    pub fn take(engine: &Arc<Engine>) -> LookToken {
        engine.registry().late_clients_add(true);
        LookToken {
            engine: engine.clone(),
            pid: crate::real::getpid(),
            counted: true,
        }
    }

    /// The count passes to an armed connection (uncounted when it leaves the armed states).
    fn hand_over(mut self) -> bool {
        std::mem::replace(&mut self.counted, false) && self.pid == crate::real::getpid()
    }
}

impl Drop for LookToken {
    fn drop(&mut self) {
        if self.counted && self.pid == crate::real::getpid() {
            self.engine.registry().late_clients_add(false);
        }
    }
}

/// Armed connections to a co-resident address where nobody listened in the region at the
/// connect (a server that joins later, or one without the library): each costs a look per
/// heartbeat for a while, so only this many at once.
const MAX_UNLISTED: u32 = 64;
static UNLISTED: AtomicU32 = AtomicU32::new(0);

/// Heartbeats a server stays armed without being signalled (then its calls cost nothing).
const SERVER_TICKS: u32 = MARKER_TICKS + MAX_OFFERS * ACCEPT_TICKS;

/// Connections armed in this process (the heartbeat's work list).
static ARMED: ForkMutex<Vec<Weak<Late>>> = ForkMutex::new(Vec::new());
/// `ARMED`'s length at which the next arm prunes it (see `Late::new`).
static PRUNE_AT: AtomicUsize = AtomicUsize::new(PRUNE_MIN);
const PRUNE_MIN: usize = 16;

/// Whether a late ring may be tried in this process at all.
fn allowed(engine: &Engine) -> bool {
    engine.cfg.promote && !crate::dispatch::io_uring_used()
}

impl Late {
    /// `looking`: counted among the clients that may look for a marker (set before the
    /// heartbeat can see it, so its first disarm uncounts it).
    fn new(engine: &Arc<Engine>, role: Role, tuple: ConnTuple, looking: bool) -> Arc<Late> {
        // Its ticks run on the heartbeat.
        engine.node.hold();
        let l = Arc::new(Late {
            engine: engine.clone(),
            role,
            tuple,
            state: AtomicU8::new(IDLE),
            inflight: AtomicU32::new(0),
            polls: AtomicU32::new(0),
            ch: ForkMutex::new(None),
            ticks: AtomicU32::new(0),
            offers: AtomicU32::new(0),
            busy: AtomicU32::new(0),
            epolls: ForkMutex::new(Vec::new()),
            forgotten: AtomicBool::new(false),
            unlisted: AtomicBool::new(false),
            looking: AtomicBool::new(looking),
        });
        let mut armed = ARMED.lock();
        // Pruned here too, not only by the heartbeat: a forking server accepts thousands of
        // connections between two beats, and every entry left would cost each fork child a
        // copy-on-write fault (its weak count is written when the child forgets the list).
        // Only once the list has doubled since the last prune: amortised O(1) per arm, and
        // never more dead entries than live ones (plus a few).
        if armed.len() >= PRUNE_AT.load(Relaxed) {
            prune(&mut armed);
            PRUNE_AT.store((2 * armed.len()).max(PRUNE_MIN), Relaxed);
        }
        armed.push(Arc::downgrade(&l));
        drop(armed);
        l
    }

    /// A client connection that fell back for `reason`: armed if the reason may pass. It is
    /// counted as looking with `looking`, taken before the server could have stopped seeing
    /// this client otherwise, or — while the client is still announced on the endpoint —
    /// here.
    pub fn client(
        engine: &Arc<Engine>,
        tuple: ConnTuple,
        reason: memloop::registry::FallbackReason,
        looking: Option<LookToken>,
    ) -> Option<Arc<Late>> {
        use memloop::registry::FallbackReason as F;
        if !matches!(reason, F::Cancelled | F::RegionFull | F::NoOffer) || !allowed(engine) {
            return None;
        }
        let looking = looking.unwrap_or_else(|| LookToken::take(engine));
        Some(Late::new(engine, Role::Client, tuple, looking.hand_over()))
    }

    /// A client connection to `tuple.server`, where nobody listened in the region at the
    /// connect (counted as looking since before it, `looking`): armed if fewer than
    /// [`MAX_UNLISTED`] such are.
    fn client_unlisted(
        engine: &Arc<Engine>,
        tuple: ConnTuple,
        looking: LookToken,
    ) -> Option<Arc<Late>> {
        if !allowed(engine) || !take_unlisted() {
            return None;
        }
        let l = Late::new(engine, Role::Client, tuple, looking.hand_over());
        l.unlisted.store(true, Release);
        Some(l)
    }

    /// Left the armed states (disarmed, converted, forgotten): an unlisted one frees its
    /// place.
    fn unarmed(&self) {
        if self.unlisted.swap(false, AcqRel) {
            UNLISTED.fetch_sub(1, AcqRel);
        }
        if self.looking.swap(false, AcqRel) {
            self.reg().late_clients_add(false);
        }
    }

    /// A server connection of listener `ep` left on TCP with decline marker `marker` for
    /// `reason`.
    pub fn server(
        engine: &Arc<Engine>,
        tuple: ConnTuple,
        reason: memloop::registry::FallbackReason,
        ep: memloop::registry::EndpointId,
        marker: Option<ChannelId>,
    ) -> Option<Arc<Late>> {
        use memloop::registry::FallbackReason as F;
        if !matches!(reason, F::NoOffer | F::Cancelled) || !allowed(engine) {
            return None;
        }
        let marker = MarkerHold::new(engine.registry(), marker?)?;
        Some(Late::new(engine, Role::Server { ep, marker }, tuple, false))
    }

    fn reg(&self) -> &Registry {
        self.engine.registry()
    }

    /// Server: the client signalled a late offer (one shared load; bit 0 of the marker's
    /// switch word — the pin of [`taken_elsewhere`] is bit 16).
    fn signalled(&self) -> bool {
        matches!(&self.role, Role::Server { marker, .. } if marker.signal.load(Relaxed) & 1 != 0)
    }

    /// Server: another process holds the connection too (no conversion now).
    fn shared(&self) -> bool {
        matches!(&self.role, Role::Server { marker, .. } if marker.shared())
    }

    /// Disarms for good; a late offer of ours is withdrawn (or, taken already, given up). A
    /// server pins its marker: this process keeps the socket and goes on using it where a
    /// conversion elsewhere could not follow, so no other holder (after a fork) may convert
    /// either.
    fn disarm(&self, why: &str) {
        self.disarm_pinning(why, true);
    }

    /// [`Self::disarm`] of a process that stops holding the socket (it exits): the other
    /// holders may still convert once they are alone.
    fn disarm_leaving(&self, why: &str) {
        self.disarm_pinning(why, false);
    }

    /// A server lets go of its decline marker (see `marker.rs`).
    fn let_go_marker(&self, pin: bool) {
        if let Role::Server { marker, .. } = &self.role {
            marker.let_go(self.reg(), self.engine.me(), pin);
        }
    }

    fn disarm_pinning(&self, why: &str, pin: bool) {
        let mut cur = self.state.load(Acquire);
        loop {
            match cur {
                DONE | OFF => return,
                CONVERTING => {
                    std::thread::yield_now(); // a conversion is short: wait for its end
                    cur = self.state.load(Acquire);
                    continue;
                }
                _ => {}
            }
            match self.state.compare_exchange(cur, OFF, AcqRel, Acquire) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.unarmed();
        tracing::debug!(tuple = ?self.tuple, "late ring off: {why}");
        if let Some(ch) = self.ch.lock().take() {
            self.withdraw(ch);
        }
        self.let_go_marker(pin);
    }

    /// Client: our late offer goes (taken already: its promotion is called off and our side
    /// closed, so the server's side stays on TCP). Counted as a failed attempt.
    fn withdraw(&self, ch: ChannelId) {
        if !matches!(self.role, Role::Client) || self.forgotten.load(Acquire) {
            return;
        }
        let reg = self.reg();
        if reg.cancel(ch, self.engine.me()).is_err() {
            if let Ok(w) = reg.switch_word(ch) {
                w.cancel_promotion();
            }
            memloop::channel::release(reg, ch, Side::Client);
        }
        reg.count_late_failed();
    }

    /// In a fork child: the parent's connections are the parent's (no registry change; no
    /// lock either: a parent thread may have held one at the fork).
    fn forget(&self) {
        self.forgotten.store(true, Release);
        self.state.store(OFF, Release);
        self.unlisted.store(false, Release); // (the child's count starts at 0)
        self.looking.store(false, Release); // (the parent's, in the region's count)
    }
}

impl Drop for Late {
    fn drop(&mut self) {
        self.unarmed();
        self.let_go_marker(false);
        if let Some(ch) = self.ch.lock().take() {
            tracing::debug!(?ch, "connection closed before its late ring");
            self.withdraw(ch);
        }
    }
}

/// A data call on an armed connection in flight: no conversion until it ends.
pub struct InFlight<'a>(Option<&'a Late>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.0 {
            l.inflight.fetch_sub(1, Release);
        }
    }
}

/// What a data call on a plain connection does.
pub enum Enter<'a> {
    /// Go to the kernel (holding this while the call runs).
    Go(InFlight<'a>),
    /// The connection became (or is becoming) a connection of ours: route the call again.
    Reroute,
}

/// Before a kernel data call on plain connection `p` (fd `fd`).
#[inline]
pub fn enter<'a>(fd: c_int, p: &'a PlainTcp) -> Enter<'a> {
    let Some(l) = p.late() else {
        return Enter::Go(InFlight(None));
    };
    let state = l.state.load(Acquire);
    match state {
        OFF => return Enter::Go(InFlight(None)),
        DONE => return reroute_if_replaced(fd, p),
        CONVERTING => {
            std::thread::yield_now();
            return Enter::Reroute;
        }
        _ => {}
    }
    if (state == READY || (l.signalled() && !l.shared())) && convert(fd, l) {
        return Enter::Reroute;
    }
    l.inflight.fetch_add(1, SeqCst);
    if l.state.load(SeqCst) == CONVERTING {
        l.inflight.fetch_sub(1, Release);
        std::thread::yield_now();
        return Enter::Reroute;
    }
    Enter::Go(InFlight(Some(l)))
}

/// Converted: route again — unless the fd is no longer the converted connection's (closed
/// and reused meanwhile: the caller's record is stale, the kernel's answer stands).
fn reroute_if_replaced<'a>(fd: c_int, p: &PlainTcp) -> Enter<'a> {
    match table::get(fd).as_deref() {
        Some(Entry::Plain(q)) if std::ptr::eq(&**q, p) => Enter::Go(InFlight(None)),
        _ => Enter::Reroute,
    }
}

/// Converts `fd`'s connection if it can now; true if the caller must route again.
fn convert(fd: c_int, l: &Late) -> bool {
    let from = l.state.load(Acquire);
    if !matches!(from, IDLE | READY) {
        return true;
    }
    // SeqCst: with the callers' count-then-look in `enter`, one of us sees the other.
    if l.state
        .compare_exchange(from, CONVERTING, SeqCst, Acquire)
        .is_err()
    {
        return true;
    }
    // A poll in flight may sleep for long: no point waiting for it.
    if l.polls.load(SeqCst) != 0 || !drained(l) {
        l.state.store(from, Release);
        if l.busy.fetch_add(1, AcqRel) + 1 >= MAX_BUSY {
            l.disarm("calls always in flight");
            if matches!(l.role, Role::Server { .. }) {
                decline_signalled(l);
            }
        }
        return false;
    }
    let next = match l.role {
        Role::Client => convert_client(fd, l),
        Role::Server { .. } => convert_server(fd, l),
    };
    if next != IDLE {
        l.unarmed();
    }
    l.state.store(next, Release);
    true
}

/// Waits (bounded) until no other data call on the connection is in flight.
fn drained(l: &Late) -> bool {
    let end = Instant::now() + DRAIN_WAIT;
    while l.inflight.load(SeqCst) != 0 {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    true
}

/// The program's TCP_NODELAY on `fd` (kept on the TCP phase).
fn nodelay(fd: c_int) -> c_int {
    crate::real::sockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY).unwrap_or(0)
}

/// Client, its offer taken: the connection becomes a switched one on its channel.
fn convert_client(fd: c_int, l: &Late) -> u8 {
    let Some(ch) = *l.ch.lock() else {
        return OFF;
    };
    match crate::conn::Conn::late(&l.engine, ch, Side::Client, l.tuple, fd, nodelay(fd)) {
        Ok(c) => {
            l.ch.lock().take(); // the connection's now
            install(fd, l, c);
            tracing::debug!(fd, ?ch, "late ring: client converted, promotion under way");
            DONE
        }
        Err(reason) => {
            tracing::debug!(fd, ?ch, %reason, "late ring: client stays on TCP");
            l.ch.lock().take();
            l.withdraw(ch);
            OFF
        }
    }
}

/// Server, signalled: take the late offer for our tuple and become a switched connection —
/// if this process holds the connection alone. The hold lock is kept throughout: a fork
/// waits for the conversion, or the conversion for the fork (and then sees the child).
fn convert_server(fd: c_int, l: &Late) -> u8 {
    let Role::Server { ep, marker } = &l.role else {
        return OFF;
    };
    let held = marker.held.lock();
    if !*held {
        return OFF;
    }
    if marker.shared() {
        return IDLE; // a conversion waits until the other holders closed their copies
    }
    let signal = &marker.signal;
    let reg = l.reg();
    let Some(ch) = reg.find_late_offer(*ep, &l.tuple) else {
        signal.fetch_and(!1, Release); // withdrawn meanwhile: wait for another
        return IDLE;
    };
    if memloop::registry::SwitchWord(signal.clone()).pinned() {
        // The socket reached a process that cannot follow (`pidfd_getfd`, an exec, ...).
        tracing::debug!(fd, ?ch, "late ring declined: the socket is pinned to TCP");
        let _ = reg.decline(ch);
        signal.fetch_and(!1, Release);
        return OFF;
    }
    // A fork child converts as the member it is (the parent's membership is the parent's).
    let engine = crate::engine::get().unwrap_or_else(|| l.engine.clone());
    let open = reg.state() == memloop::registry::RegionState::Open;
    if !open || !allowed(&engine) {
        tracing::debug!(fd, ?ch, "late ring declined (paused, or not here)");
        let _ = reg.decline(ch);
        return IDLE; // a paused region may open again: the client retries, bounded
    }
    if let Err(e) = reg.accept(ch, engine.me()) {
        tracing::debug!(fd, ?ch, %e, "late offer gone");
        signal.fetch_and(!1, Release);
        return IDLE;
    }
    signal.fetch_and(!1, Release);
    drop(held);
    let next = match crate::conn::Conn::late(&engine, ch, Side::Server, l.tuple, fd, nodelay(fd)) {
        Ok(c) => {
            install(fd, l, c);
            tracing::debug!(fd, ?ch, "late ring: server converted, promotion under way");
            DONE
        }
        Err(reason) => {
            tracing::debug!(fd, ?ch, %reason, "late ring: server stays on TCP");
            if let Ok(w) = reg.switch_word(ch) {
                w.cancel_promotion();
            }
            memloop::channel::release(reg, ch, Side::Server);
            OFF
        }
    };
    l.let_go_marker(false); // the marker has served
    next
}

/// The converted connection takes `fd`'s place, and its epoll registrations with it: items
/// of ours made while it was deciding first, then the kernel registrations noted while armed
/// (an item handed back to the kernel meanwhile is among those: it is noted under its set's
/// lock, before the first step looks at that set).
fn install(fd: c_int, l: &Late, c: Arc<crate::conn::Conn>) {
    let old = match table::get(fd).as_deref() {
        Some(Entry::Conn(o)) => Some(o.clone()),
        _ => None,
    };
    table::insert(fd, Entry::Conn(c.clone()));
    if let Some(old) = &old {
        crate::dispatch::retarget_epolls(fd, old, &c);
    }
    let regs = std::mem::take(&mut *l.epolls.lock());
    crate::dispatch::adopt_epolls(fd, &c, regs);
}

/// A kernel registration of `fd` in set `epfd` changed (`ev`: its events and data; `None`:
/// removed), noted for the conversion.
fn note_epoll(l: &Late, epfd: c_int, ev: Option<(u32, u64)>) {
    let mut regs = l.epolls.lock();
    regs.retain(|(e, _, _)| *e != epfd);
    if let Some((events, data)) = ev {
        regs.push((epfd, events, data));
    }
}

/// Interests whose state a conversion could not carry over: a one-shot that may have fired
/// (the kernel disabled it, our item would report again), an exclusive wake-up (ADD only).
fn epoll_movable(ev: Option<(u32, u64)>) -> bool {
    let odd = (libc::EPOLLONESHOT | libc::EPOLLEXCLUSIVE) as u32;
    !matches!(ev, Some((events, _)) if events & odd != 0)
}

/// What `epoll_ctl` on an fd does.
pub enum Ctl {
    /// Not armed: the usual way.
    Pass,
    /// Made here, in flight, and noted for the conversion.
    Done(Result<(), c_int>),
    /// Converted meanwhile: route again.
    Reroute,
}

/// `epoll_ctl(epfd, op, fd, ev)` on `fd`, whose table entry is `e`.
pub fn epoll_ctl(fd: c_int, e: &Entry, epfd: c_int, op: c_int, ev: Option<(u32, u64)>) -> Ctl {
    let Some(p) = plain_of(e) else {
        return Ctl::Pass;
    };
    let Some(l) = p.late().cloned() else {
        return Ctl::Pass;
    };
    if !epoll_movable(ev) {
        l.disarm("one-shot or exclusive epoll interest");
        return Ctl::Pass;
    }
    let _in_flight = match enter(fd, &p) {
        Enter::Reroute => return Ctl::Reroute,
        Enter::Go(g) if g.0.is_none() => return Ctl::Pass,
        Enter::Go(g) => g,
    };
    // An item of ours from the days it was deciding goes back to the kernel first (noted).
    if let Some(s) = crate::dispatch::epoll_of(epfd) {
        s.release_fd(epfd, fd);
    }
    let (events, data) = ev.unwrap_or((0, 0));
    let mut kev = libc::epoll_event { events, u64: data };
    let r = crate::real::epoll_ctl_raw(epfd, op, fd, &mut kev);
    if r.is_ok() {
        note_epoll(&l, epfd, ev.filter(|_| op != libc::EPOLL_CTL_DEL));
    }
    Ctl::Done(r)
}

/// An item of ours for `c`, a connection that fell back at connect, went back to the kernel
/// as the program's registration (`epfd`, `events`, `data`): noted if it is armed.
pub fn handed_back(c: &crate::conn::Conn, epfd: c_int, events: u32, data: u64) {
    if let Some(l) = c.plain().and_then(|p| p.late().cloned()) {
        if !epoll_movable(Some((events, data))) {
            l.disarm("one-shot or exclusive epoll interest");
        } else if l.state.load(Acquire) < DONE {
            note_epoll(&l, epfd, Some((events, data)));
        }
    }
}

/// A poll or select on an armed connection, in flight while this lives.
pub struct Held(Arc<Late>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.polls.fetch_sub(1, Release);
        self.0.inflight.fetch_sub(1, Release);
    }
}

/// What a poll does with an fd's entry.
pub enum Hold {
    /// Not armed.
    No,
    Held(Held),
    /// Converted meanwhile: look the fd up again.
    Changed,
}

/// Before a poll or select that watches `e`.
pub fn hold(e: &Entry) -> Hold {
    let Some(l) = late_of(e) else {
        return Hold::No;
    };
    loop {
        match l.state.load(SeqCst) {
            OFF => return Hold::No,
            DONE => return Hold::Changed,
            CONVERTING => {
                std::thread::yield_now();
                continue;
            }
            _ => {}
        }
        l.polls.fetch_add(1, SeqCst);
        l.inflight.fetch_add(1, SeqCst);
        if l.state.load(SeqCst) != CONVERTING {
            return Hold::Held(Held(l));
        }
        l.inflight.fetch_sub(1, Release);
        l.polls.fetch_sub(1, Release);
    }
}

/// Whether `e` is armed for a late ring (poll and select must then count themselves).
pub fn is_armed(e: &Entry) -> bool {
    let armed = |l: &Late| l.state.load(Acquire) < DONE;
    match e {
        // (Every poll asks this of every plain fd in it: no clone on this path.)
        Entry::Plain(p) => p.late().is_some_and(|l| armed(l)),
        _ => late_of(e).is_some_and(|l| armed(&l)),
    }
}

/// A disarmed server declines the offer it was signalled for (the client counts it).
fn decline_signalled(l: &Late) {
    let Role::Server { ep, .. } = &l.role else {
        return;
    };
    if let Some(ch) = l.reg().find_late_offer(*ep, &l.tuple) {
        let _ = l.reg().decline(ch);
    }
}

/// The heartbeat: every armed connection one step further (never blocks).
pub fn tick() {
    let armed: Vec<Arc<Late>> = {
        let mut v = ARMED.lock();
        prune(&mut v);
        v.iter().filter_map(Weak::upgrade).collect()
    };
    for l in armed {
        match (&l.role, l.state.load(Acquire)) {
            (Role::Client, IDLE) => offer(&l),
            (Role::Client, OFFERED) => follow_offer(&l),
            (Role::Server { .. }, IDLE)
                if l.ticks.fetch_add(1, AcqRel) + 1 > SERVER_TICKS && !l.signalled() =>
            {
                l.disarm("no late offer came");
            }
            _ => {}
        }
    }
}

/// Client: once the server's marker is there, a late offer and its signal.
fn offer(l: &Late) {
    let reg = l.reg();
    let ticks = l.ticks.fetch_add(1, AcqRel) + 1;
    if l.offers.load(Acquire) >= MAX_OFFERS || ticks > MARKER_TICKS {
        l.disarm("no late ring in time");
        return;
    }
    if reg.state() != memloop::registry::RegionState::Open {
        return;
    }
    let Some(marker) = reg
        .markers_for_client(l.tuple.client)
        .into_iter()
        .find(|(_, t)| t.server == l.tuple.server)
        .map(|(m, _)| m)
    else {
        return; // the server has not accepted yet (or never publishes one)
    };
    if reg.switch_word(marker).is_ok_and(|w| w.pinned()) {
        l.disarm("the socket was taken by another process (pidfd_getfd)");
        return;
    }
    let cap = l.engine.cfg.ring_capacity;
    let ch = match reg.offer_late(l.engine.me(), marker, cap, l.tuple) {
        Ok(ch) => ch,
        Err(e) => {
            tracing::debug!(tuple = ?l.tuple, %e, "late offer not made (yet)");
            return; // region full: again on a later tick
        }
    };
    *l.ch.lock() = Some(ch);
    l.offers.fetch_add(1, AcqRel);
    l.ticks.store(0, Release);
    if l.state
        .compare_exchange(IDLE, OFFERED, AcqRel, Acquire)
        .is_err()
    {
        // Disarmed meanwhile (it could not see the offer): withdraw it here.
        if let Some(ch) = l.ch.lock().take() {
            l.withdraw(ch);
        }
        return;
    }
    match reg.switch_word(marker) {
        Ok(w) => {
            w.0.fetch_or(1, AcqRel);
            tracing::debug!(tuple = ?l.tuple, ?ch, "late ring offered");
        }
        Err(_) => l.disarm("the server's marker went away"),
    }
}

/// Client: the server took the offer (ready to convert), refused it, or keeps us waiting.
fn follow_offer(l: &Late) {
    let Some(ch) = *l.ch.lock() else { return };
    let reg = l.reg();
    let ticks = l.ticks.fetch_add(1, AcqRel) + 1;
    match reg.channel_state(ch) {
        Ok(ChannelState::Accepted) => {
            let _ = l.state.compare_exchange(OFFERED, READY, AcqRel, Acquire);
        }
        Ok(ChannelState::Offered) if ticks < ACCEPT_TICKS => {}
        Ok(ChannelState::Offered) | Ok(ChannelState::Declined) => {
            if l.state
                .compare_exchange(OFFERED, IDLE, AcqRel, Acquire)
                .is_ok()
            {
                if reg.cancel(ch, l.engine.me()).is_ok() {
                    tracing::debug!(?ch, "late offer not taken: withdrawn");
                    l.ch.lock().take();
                    reg.count_late_failed();
                    l.ticks.store(0, Release);
                } else {
                    l.state.store(READY, Release); // taken just now
                }
            }
        }
        _ => l.disarm("late offer lost"),
    }
}

/// A socket this process took with `pidfd_getfd` that is no ring connection: if it is a
/// connection that fell back to TCP at connect, its holders may still bring it to a late ring
/// — where our writes, which they cannot see, would follow their stop. The server's marker
/// for its 4-tuple is pinned: neither side offers or takes a late ring under a pinned marker
/// (a late offer already made is declined by the caller, `conn/grab.rs`). A server that has
/// not accepted yet has no marker to pin: see `docs/design/path-switching.md`.
pub fn taken_elsewhere(reg: &Registry, a: std::net::SocketAddr, b: std::net::SocketAddr) {
    for (client, server) in [(a, b), (b, a)] {
        for (marker, _) in reg
            .markers_for_client(client)
            .into_iter()
            .filter(|(_, t)| t.server == server)
        {
            if let Ok(w) = reg.switch_word(marker) {
                w.pin();
                tracing::debug!(
                    ?marker,
                    "late ring pinned off: the socket was taken elsewhere"
                );
            }
        }
    }
}

/// Something may use `fd`'s socket where a conversion cannot follow: no late ring for it.
pub fn taint(fd: c_int, why: &str) {
    if table::kind(fd) != table::K_OBJ {
        return;
    }
    if let Some(e) = table::get(fd) {
        let _ = taint_entry(&e, why);
    }
}

/// [`taint`] for a table entry; a connection still deciding is marked so that it is never
/// armed.
/// True if `e` had a late ring (a conversion may have replaced the fd's entry meanwhile).
pub fn taint_entry(e: &Entry, why: &str) -> bool {
    disarm_entry(e, |l| l.disarm(why))
}

/// Before the close of `e`'s fd: disarmed, without pinning the marker (this process stops
/// holding the socket; a forked holder may still convert once alone). True as for
/// [`taint_entry`].
pub fn closing(e: &Entry) -> bool {
    disarm_entry(e, |l| l.disarm_leaving("closed"))
}

fn disarm_entry(e: &Entry, disarm: impl FnOnce(&Late)) -> bool {
    if let Entry::Conn(c) = e {
        c.no_late_ring();
    }
    let late = late_of(e);
    if let Some(l) = &late {
        disarm(l);
    }
    late.is_some()
}

/// The plain connection behind `e`: a plain entry, or a connection that fell back at connect.
fn plain_of(e: &Entry) -> Option<Arc<PlainTcp>> {
    match e {
        Entry::Plain(p) => Some(p.clone()),
        Entry::Conn(c) if !c.was_ring() => c.plain(),
        _ => None,
    }
}

fn late_of(e: &Entry) -> Option<Arc<Late>> {
    plain_of(e).and_then(|p| p.late().cloned())
}

/// The connections armed in this process (the work list: a fork or an exec looks at these,
/// not at every fd).
/// Drops the entries of connections gone or no longer armed.
fn prune(armed: &mut Vec<Weak<Late>>) {
    armed.retain(|w| w.upgrade().is_some_and(|l| l.state.load(Acquire) < DONE));
}

fn armed() -> Vec<Arc<Late>> {
    ARMED.lock().iter().filter_map(Weak::upgrade).collect()
}

/// Every armed connection of this process: disarmed (before exec, after fork in the
/// parent).
pub fn taint_all(why: &str) {
    for l in armed() {
        l.disarm(why);
    }
}

/// Armed connections a spawned process inherits (not close-on-exec): disarmed.
pub fn taint_inheritable(why: &str) {
    for (fd, e) in table::all() {
        if crate::real::fd_flags(fd) & libc::FD_CLOEXEC == 0 {
            let _ = taint_entry(&e, why);
        }
    }
}

/// In a fork child: the parent's late offers are the parent's.
/// `kept`: server connections the child follows (`marker.rs`).
fn forget_in_child(kept: &[Arc<Late>]) {
    for l in armed() {
        if !kept.iter().any(|k| Arc::ptr_eq(k, &l)) {
            l.forget();
        }
    }
    ARMED.lock().clear();
    UNLISTED.store(0, Release);
}

/// A place among the [`MAX_UNLISTED`], if one is free.
fn take_unlisted() -> bool {
    UNLISTED
        .fetch_update(AcqRel, Acquire, |n| (n < MAX_UNLISTED).then_some(n + 1))
        .is_ok()
}

/// Whether a connect to a co-resident address nobody listens on in the region may be armed
/// (checked before the connect; [`unlisted`] takes the place after it).
pub fn may_arm_unlisted(engine: &Engine) -> bool {
    allowed(engine) && UNLISTED.load(Acquire) < MAX_UNLISTED
}

/// After the real connect of `fd` to `dst`, where nobody listened in the region (the client
/// counted as looking since before the connect: `looking`): the plain connection, armed for a
/// late ring (the server publishes a decline marker for it if it joins the region and accepts
/// it), or `None` if no place is free.
pub fn unlisted(
    engine: &Arc<Engine>,
    fd: c_int,
    dst: std::net::SocketAddr,
    looking: LookToken,
) -> Option<Arc<PlainTcp>> {
    let local = crate::real::local_addr(fd)?;
    let tuple = ConnTuple {
        client: crate::agree::canonical(local),
        server: crate::agree::canonical(dst),
    };
    let l = Late::client_unlisted(engine, tuple, looking)?;
    tracing::debug!(
        fd,
        ?tuple,
        "no listener in the region: armed for a late ring"
    );
    Some(PlainTcp::unrecorded_late(engine, None, Some(l)))
}

pub fn lock_for_fork() {
    ARMED.acquire_for_fork(|armed| {
        if !armed.is_empty() {
            crate::dispatch::child_needs_engine();
        }
        marker::prepare_fork(armed)
    });
}

/// Parent handler: armed connections the child holds too are disarmed (unless `marker.rs`
/// counted the child as a holder of their markers).
pub fn after_fork_in_parent() {
    ARMED.release_after_fork();
    marker::after_fork_in_parent();
}

/// Child handler: the parent's late offers are the parent's; server connections counted for
/// the child stay armed here.
pub fn after_fork_in_child() {
    ARMED.release_after_fork();
    marker::after_fork_in_child();
}

#[cfg(test)]
mod tests {
    use super::*;
    use memloop::registry::SwitchWord;

    #[test]
    fn a_late_offer_word_names_the_late_reason() {
        let v = memloop_shm::ShmSlice::new_heap(8);
        let w = SwitchWord(v.u64_at(0).unwrap());
        w.0.store(SwitchWord::LATE_OFFER, SeqCst);
        assert_eq!(w.reason(), Some(memloop::registry::SwitchReason::Late));
    }
}
