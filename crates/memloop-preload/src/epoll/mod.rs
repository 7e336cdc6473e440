//! epoll over a mix of ring connections, nested epoll sets and kernel fds.
//!
//! Every epoll set of the process is known from its birth (`epoll_create*` are hooked), and
//! every wait on it comes through [`EpollSet::wait`], which filters the kernel's events: our
//! own registrations carry a tagged data word (`kernel::tag`) and never reach the program.
//!
//! A ring connection is registered in the kernel set for `EPOLLIN` only (its doorbell byte,
//! FIN or reset wakes the set); the program's interest (events, data, `ET`, `ONESHOT`) is kept
//! here and answered from the rings. A nested epoll set (an epoll fd in this set) is
//! registered under a tag too, so its ring members' readiness can be reported even when no
//! doorbell was sent. Kernel fds are the kernel's business.
//!
//! **Sleepers.** While any thread sleeps in the kernel on this set — or on a set that contains
//! it, or in `poll` on it — every ring member is *armed*: the peer's next publication sends a
//! doorbell. A member added, modified or made ready by this process while someone sleeps is
//! armed at once and, if already ready, *kicked*: its registration briefly asks for `EPOLLOUT`,
//! which the kernel reports at once, so the sleepers wake and look again — as the kernel wakes
//! `epoll_wait` when a ready fd is added from another thread.

mod kernel;
mod rules;

use crate::conn::{Conn, Dir, Path, Spinner};
use crate::forklock::ForkMutex;
use libc::{c_int, epoll_event};
use rules::{Edge, ET, EXCLUSIVE, ONESHOT};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLICE: Duration = Duration::from_millis(200);
/// While rings keep the set busy, the kernel's own fds are polled on one call in this many.
const KERNEL_EVERY: u32 = 4;
/// Most kernel events fetched per call (the rest wait for the next call, as with the kernel).
const MAX_KERNEL_BATCH: usize = 1024;
const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;

thread_local! {
    static TMP: std::cell::RefCell<Vec<epoll_event>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// What an emulated registration watches.
#[derive(Clone)]
pub enum Target {
    Conn(Arc<Conn>),
    Set(Arc<EpollSet>),
}

impl Target {
    fn is(&self, other: &Target) -> bool {
        match (self, other) {
            (Target::Conn(a), Target::Conn(b)) => Arc::ptr_eq(a, b),
            (Target::Set(a), Target::Set(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// What the kernel registration behind an item is made for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Reg {
    /// A connection still deciding between ring and TCP: the kernel's own readiness
    /// (connect completion) plus the server's accept doorbell.
    Pending,
    /// A ring connection: `EPOLLIN` for doorbells, FIN and resets.
    Ring,
    /// A ring connection whose peer socket is gone: the kernel would report EOF on every
    /// wait and has nothing more to say, so the registration is removed.
    Dormant,
    /// A nested epoll set.
    Set,
}

impl Reg {
    fn of(t: &Target) -> Reg {
        match t {
            Target::Conn(c) if c.path() == Path::Pending => Reg::Pending,
            Target::Conn(_) => Reg::Ring,
            Target::Set(_) => Reg::Set,
        }
    }

    /// The kernel events of the registration; `None` when there is none.
    fn kernel_events(self, events: u32, disabled: bool, kicked: bool) -> Option<u32> {
        let kick = if kicked { OUT } else { 0 };
        match self {
            Reg::Pending => Some(IN | kick | (events & (OUT | libc::EPOLLRDHUP as u32))),
            Reg::Ring => Some(IN | kick),
            Reg::Dormant => None,
            // One-shot and edge-triggered as the program asked; a disabled one-shot stays
            // quiet in the kernel too (an epoll fd never reports hang-up or error).
            Reg::Set if disabled => Some(ONESHOT),
            Reg::Set => Some(IN | (events & (ET | ONESHOT))),
        }
    }
}

struct Item {
    fd: c_int,
    /// False once the program closed `fd` while another fd of the same file keeps the
    /// registration alive (the kernel's rule): no kernel call can name it any more.
    fd_open: bool,
    target: Target,
    events: u32,
    data: u64,
    reg: Reg,
    edge: Edge,
    /// A one-shot interest that fired and was not re-armed.
    disabled: bool,
    /// Armed for the sleepers of this set.
    armed: bool,
    kicked: bool,
}

impl Item {
    /// The bits this item reports now and its edge signature; `None` if the kernel decides.
    fn readiness(&self) -> Option<(u32, (u64, u64, u32))> {
        match &self.target {
            Target::Conn(c) if c.path() == Path::Ring => {
                let rep = rules::report(rules::poll_to_epoll(c.revents()), self.events);
                Some((rep, rules::edge_signature(self.events, c.progress(), rep)))
            }
            Target::Conn(_) => None,
            Target::Set(s) => {
                let sig = s.peek()?;
                let rep = rules::report(IN, self.events);
                Some((rep, (sig, 0, rep)))
            }
        }
    }

    /// Would report something now (nothing recorded).
    fn would_report(&self) -> bool {
        if self.disabled {
            return false;
        }
        match self.readiness() {
            Some((rep, sig)) if rep != 0 => self.events & ET == 0 || self.edge.would_fire(sig),
            _ => false,
        }
    }

    fn kernel_events(&self) -> Option<u32> {
        self.reg
            .kernel_events(self.events, self.disabled, self.kicked)
    }
}

#[derive(Default)]
struct State {
    items: BTreeMap<u32, Item>,
    by_fd: HashMap<c_int, u32>,
    next: u32,
    /// Every id was issued once: any id may be ours.
    wrapped: bool,
    /// Threads asleep in the kernel on this set (or on a set or poll containing it).
    sleepers: u32,
    /// Where the next collection starts (ready members take turns, as in the kernel).
    cursor: u32,
}

pub struct EpollSet {
    /// The fd the program last used for this set (kicks from elsewhere need one).
    home: AtomicI32,
    calls: AtomicU32,
    /// Number of items: lets waits on sets without any skip everything.
    targets: AtomicUsize,
    spinner: Spinner,
    st: ForkMutex<State>,
}

impl EpollSet {
    pub fn new(epfd: c_int) -> Arc<EpollSet> {
        Arc::new(EpollSet {
            home: AtomicI32::new(epfd),
            calls: AtomicU32::new(0),
            targets: AtomicUsize::new(0),
            spinner: Spinner::new(Duration::from_micros(50)),
            st: ForkMutex::new(State::default()),
        })
    }

    /// Whether the set holds ring connections or nested sets (poll must then look inside).
    pub fn has_targets(&self) -> bool {
        self.targets.load(Acquire) > 0
    }

    /// This set's fd (for the kernel calls made on behalf of another set).
    pub fn fd(&self) -> c_int {
        self.home.load(Relaxed)
    }

    pub fn set_fd(&self, epfd: c_int) {
        self.home.store(epfd, Relaxed);
    }

    // ---- epoll_ctl -------------------------------------------------------------------------

    /// `epoll_ctl` on a ring connection or a nested set, with the kernel's error rules.
    pub fn ctl(
        &self,
        epfd: c_int,
        op: c_int,
        fd: c_int,
        target: Target,
        ev: Option<(u32, u64)>,
    ) -> Result<(), c_int> {
        self.set_fd(epfd);
        let mut st = self.st.lock();
        let existing = st.by_fd.get(&fd).copied();
        let exclusive = existing.map(|id| st.items[&id].events & EXCLUSIVE != 0);
        let is_set = matches!(target, Target::Set(_));
        rules::check_ctl(op, ev.map(|e| e.0), is_set, exclusive)?;
        match (op, existing, ev) {
            (libc::EPOLL_CTL_ADD, _, Some((events, data))) => {
                self.insert(&mut st, epfd, fd, target, events, data, libc::EPOLL_CTL_ADD)
            }
            (libc::EPOLL_CTL_MOD, Some(id), Some(ev)) => self.modify(&mut st, epfd, id, ev),
            (libc::EPOLL_CTL_DEL, Some(id), _) => self.delete(&mut st, epfd, id),
            _ => Err(libc::EINVAL),
        }
    }

    /// Takes over a registration the program made in the kernel before `fd` became ours (a
    /// socket registered before it connected, or a registration inherited across exec).
    pub fn adopt(&self, epfd: c_int, fd: c_int, target: Target, events: u32, data: u64) {
        let mut st = self.st.lock();
        if st.by_fd.contains_key(&fd) {
            return;
        }
        if let Err(e) = self.insert(&mut st, epfd, fd, target, events, data, libc::EPOLL_CTL_MOD) {
            tracing::debug!(fd, e, "could not take over an epoll registration");
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        st: &mut State,
        epfd: c_int,
        fd: c_int,
        target: Target,
        events: u32,
        data: u64,
        op: c_int,
    ) -> Result<(), c_int> {
        let id = free_id(st);
        let mut it = Item {
            fd,
            fd_open: true,
            reg: Reg::of(&target),
            target,
            events,
            data,
            edge: Edge::default(),
            disabled: false,
            armed: false,
            kicked: false,
        };
        let kev = it.kernel_events().unwrap_or(IN);
        kernel::ctl(epfd, op, fd, kev, kernel::tag(id))?;
        if st.sleepers > 0 {
            arm(&mut it);
            kick_if_ready(epfd, id, &mut it);
        }
        st.items.insert(id, it);
        st.by_fd.insert(fd, id);
        self.targets.fetch_add(1, Release);
        Ok(())
    }

    fn modify(
        &self,
        st: &mut State,
        epfd: c_int,
        id: u32,
        (events, data): (u32, u64),
    ) -> Result<(), c_int> {
        let sleeping = st.sleepers > 0;
        let it = st.items.get_mut(&id).ok_or(libc::ENOENT)?;
        let (old_events, old_kicked) = (it.events, it.kicked);
        it.events = events;
        it.kicked = false;
        it.disabled = false;
        if let Some(kev) = it.kernel_events() {
            if let Err(e) = kernel::ctl(epfd, libc::EPOLL_CTL_MOD, it.fd, kev, kernel::tag(id)) {
                it.events = old_events;
                it.kicked = old_kicked;
                return Err(e);
            }
        }
        // Re-arm for the new directions: disarm with the old interest, arm with the new.
        let was_armed = it.armed;
        if was_armed {
            it.events = old_events;
            disarm(it);
            it.events = events;
        }
        it.data = data;
        it.edge.reset();
        if sleeping {
            arm(it);
            kick_if_ready(epfd, id, it);
        }
        Ok(())
    }

    fn delete(&self, st: &mut State, epfd: c_int, id: u32) -> Result<(), c_int> {
        let mut it = self.remove(st, id).ok_or(libc::ENOENT)?;
        if it.armed {
            disarm(&mut it);
        }
        match it.reg {
            Reg::Dormant => Ok(()),
            _ => kernel::ctl(epfd, libc::EPOLL_CTL_DEL, it.fd, 0, 0),
        }
    }

    fn remove(&self, st: &mut State, id: u32) -> Option<Item> {
        let it = st.items.remove(&id)?;
        if st.by_fd.get(&it.fd) == Some(&id) {
            st.by_fd.remove(&it.fd);
        }
        self.targets.fetch_sub(1, Release);
        Some(it)
    }

    /// `fd` settled on TCP without a kernel event telling us: its registration becomes the
    /// program's own again.
    pub fn release_fd(&self, epfd: c_int, fd: c_int) {
        let mut st = self.st.lock();
        let Some(&id) = st.by_fd.get(&fd) else { return };
        if let Some(it) = self.remove(&mut st, id) {
            // Without a kernel event (0) there is never an event to report.
            let _ = to_kernel_fd(epfd, it, 0);
        }
    }

    /// The program is closing `fd`, one of `target`'s fds. The kernel keeps a registration
    /// while another fd of the same file is open (`last == false`): so do we, but the closed
    /// number no longer names it. With the last fd the registration goes.
    pub fn fd_closed(&self, fd: c_int, target: &Target, last: bool) {
        let mut st = self.st.lock();
        let ids: Vec<u32> = st
            .items
            .iter()
            .filter(|(_, it)| it.target.is(target) && (last || it.fd == fd))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if last {
                if let Some(mut it) = self.remove(&mut st, id) {
                    if it.armed {
                        disarm(&mut it);
                    }
                }
            } else if let Some(it) = st.items.get_mut(&id) {
                it.fd_open = false;
                if st.by_fd.get(&fd) == Some(&id) {
                    st.by_fd.remove(&fd);
                }
            }
        }
    }

    /// Something of this process made `conn` ready (a shutdown of our own): wake sleepers
    /// that watch it, as the kernel would.
    pub fn poke(&self, conn: &Arc<Conn>) {
        let epfd = self.fd();
        let mut st = self.st.lock();
        if st.sleepers == 0 {
            return;
        }
        let t = Target::Conn(conn.clone());
        for (id, it) in st.items.iter_mut().filter(|(_, it)| it.target.is(&t)) {
            kick_if_ready(epfd, *id, it);
        }
    }

    /// Kicks one ready member (a set containing this one must wake).
    fn kick_ready(&self) {
        let epfd = self.fd();
        let mut st = self.st.lock();
        if let Some((id, it)) = st.items.iter_mut().find(|(_, it)| it.would_report()) {
            kick(epfd, *id, it);
        }
    }

    /// [`Self::drain_owed`] for the nested sets only (this set's own doorbells are read as
    /// their events come).
    fn drain_nested_owed(&self) {
        for t in self.targets() {
            if let Target::Set(s) = t {
                s.drain_owed();
            }
        }
    }

    /// Reads the doorbells owed to the ring members (of this set and the sets in it) before
    /// the kernel is asked whether this set is readable: an unread doorbell whose data was
    /// consumed would make it look readable with nothing to report.
    pub fn drain_owed(&self) {
        for t in self.targets() {
            match t {
                Target::Conn(c) => c.drain_owed(),
                Target::Set(s) => s.drain_owed(),
            }
        }
    }

    /// The members' targets, taken under the lock to be used after it (their calls may
    /// block or take other sets' locks).
    fn targets(&self) -> Vec<Target> {
        self.st
            .lock()
            .items
            .values()
            .map(|it| it.target.clone())
            .collect()
    }

    // ---- exec ------------------------------------------------------------------------------

    /// Before `exec`, for a set the new image inherits: the kernel registrations get the
    /// program's own events and data back (the new image knows only those; its memloop, if
    /// any, takes them over again from `/proc/self/fdinfo`).
    pub fn prepare_exec(&self, epfd: c_int) {
        let st = self.st.lock();
        for it in st.items.values().filter(|it| it.fd_open) {
            let op = if it.reg == Reg::Dormant {
                libc::EPOLL_CTL_ADD
            } else {
                libc::EPOLL_CTL_MOD
            };
            let events = it.events & !EXCLUSIVE;
            kernel::ctl_or_log("give back for exec", epfd, op, it.fd, events, it.data);
        }
    }

    /// The exec failed: our own registrations again.
    pub fn restore_after_exec(&self, epfd: c_int) {
        let st = self.st.lock();
        for (id, it) in st.items.iter().filter(|(_, it)| it.fd_open) {
            match it.kernel_events() {
                Some(kev) => {
                    kernel::ctl_or_log(
                        "restore after exec",
                        epfd,
                        libc::EPOLL_CTL_MOD,
                        it.fd,
                        kev,
                        kernel::tag(*id),
                    );
                }
                None => {
                    kernel::ctl_or_log(
                        "restore after exec",
                        epfd,
                        libc::EPOLL_CTL_DEL,
                        it.fd,
                        0,
                        0,
                    );
                }
            }
        }
    }

    // ---- sleeping --------------------------------------------------------------------------

    /// A thread is about to sleep on this set (or on a set or poll containing it): arm every
    /// ring member, re-arm those armed already (a doorbell cleared their flag).
    pub fn sleep_enter(&self) {
        let mut st = self.st.lock();
        st.sleepers += 1;
        for it in st.items.values_mut() {
            if it.armed {
                rearm(it);
            } else {
                arm(it);
            }
        }
    }

    /// The sleeper is awake; the last one disarms.
    pub fn sleep_leave(&self) {
        let mut st = self.st.lock();
        st.sleepers = st.sleepers.saturating_sub(1);
        if st.sleepers == 0 {
            st.items.values_mut().filter(|it| it.armed).for_each(disarm);
        }
    }

    /// Whether some member would be reported now, with a signature of what is ready (for a
    /// containing set's edge-triggered interest). Nothing is consumed.
    pub fn peek(&self) -> Option<u64> {
        let st = self.st.lock();
        let mut sig: Option<u64> = None;
        for it in st.items.values().filter(|it| it.would_report()) {
            let (_, (a, b, c)) = it.readiness()?;
            let s = sig.unwrap_or(0);
            sig = Some(s.wrapping_add(a).wrapping_add(b).wrapping_add(c as u64));
        }
        sig
    }

    // ---- epoll_wait ------------------------------------------------------------------------

    /// `epoll_wait`/`epoll_pwait`/`epoll_pwait2` (`precise`: nanosecond timeout).
    pub fn wait(
        &self,
        epfd: c_int,
        out: &mut [epoll_event],
        timeout: Option<Duration>,
        sigmask: *const libc::sigset_t,
        precise: bool,
    ) -> Result<usize, c_int> {
        self.set_fd(epfd);
        let deadline = timeout.map(|t| Instant::now() + t);
        if !self.has_targets() {
            let w = Waiter {
                set: self,
                epfd,
                sigmask,
                precise,
            };
            if let Some(r) = w.kernel_only(out, timeout) {
                return r;
            }
        }
        // The program may offer room for thousands of events (redis: its whole fd limit): take
        // at most MAX_KERNEL_BATCH from the kernel per call, in a buffer kept per thread.
        let room = out.len().min(MAX_KERNEL_BATCH);
        TMP.with(|t| {
            let mut tmp = t.borrow_mut();
            if tmp.len() < room {
                tmp.resize(room, epoll_event { events: 0, u64: 0 });
            }
            let w = Waiter {
                set: self,
                epfd,
                sigmask,
                precise,
            };
            w.run(out, &mut tmp[..room], timeout, deadline)
        })
    }

    /// Ready ring members → program events, skipping (and adding to) `reported`.
    fn collect(&self, epfd: c_int, out: &mut [epoll_event], reported: &mut Vec<u32>) -> usize {
        if out.is_empty() {
            return 0;
        }
        let mut st = self.st.lock();
        let cursor = st.cursor;
        let mut n = 0;
        let mut last = None;
        let mut owed: Vec<Arc<Conn>> = Vec::new();
        let mut visit = |id: u32, it: &mut Item| {
            if n == out.len() || it.disabled || reported.contains(&id) {
                return;
            }
            let Some((rep, sig)) = it.readiness() else {
                return;
            };
            if rep == 0 {
                it.edge.reset();
                return;
            }
            if it.events & ET != 0 && !it.edge.fire(sig) {
                return;
            }
            if it.events & ONESHOT != 0 {
                disable(epfd, id, it);
            }
            out[n] = epoll_event {
                events: rep,
                u64: it.data,
            };
            if let Target::Conn(c) = &it.target {
                owed.push(c.clone());
            }
            reported.push(id);
            last = Some(id);
            n += 1;
        };
        // Ready members take turns: start after the one reported last.
        for (id, it) in st.items.range_mut(cursor..) {
            visit(*id, it);
        }
        for (id, it) in st.items.range_mut(..cursor) {
            visit(*id, it);
        }
        if let Some(id) = last {
            st.cursor = id.wrapping_add(1);
        }
        drop(st);
        // Doorbells for what we report are read now: left on the socket they would keep it
        // (and any set or poll watching this set) readable after the data is consumed.
        owed.iter().for_each(|c| c.drain_owed());
        n
    }

    /// Kernel events → program events: tagged ones are ours (doorbells, decisions, kicks,
    /// nested sets), everything else is the program's own.
    fn translate(
        &self,
        epfd: c_int,
        got: &[epoll_event],
        out: &mut [epoll_event],
        reported: &mut Vec<u32>,
    ) -> usize {
        let mut n = 0;
        for ev in got {
            if let Some(e) = self.translate_one(epfd, *ev, reported) {
                out[n] = e;
                n += 1;
            }
        }
        n
    }

    /// One kernel event → what the program gets of it, if anything.
    fn translate_one(
        &self,
        epfd: c_int,
        ev: epoll_event,
        reported: &mut Vec<u32>,
    ) -> Option<epoll_event> {
        let Some(id) = kernel::untag(ev.u64) else {
            return Some(ev);
        };
        match self.settle(epfd, id, ev.events) {
            Settled::NotOurs => Some(ev),
            Settled::Ours(Some(e)) if !reported.contains(&id) => {
                reported.push(id);
                Some(e)
            }
            Settled::Ours(_) => None,
        }
    }

    /// Handles a kernel event on one of our registrations; returns an event for the program
    /// when the item is a nested set or just became a plain TCP connection.
    fn settle(&self, epfd: c_int, id: u32, kernel_ev: u32) -> Settled {
        let target = {
            let mut st = self.st.lock();
            if !st.wrapped && id >= st.next {
                return Settled::NotOurs;
            }
            let Some(it) = st.items.get_mut(&id) else {
                return Settled::Ours(None); // removed meanwhile: a stale event
            };
            if it.kicked {
                unkick(epfd, id, it);
            }
            it.target.clone()
        };
        Settled::Ours(match target {
            Target::Conn(c) => self.settle_conn(epfd, id, &c, kernel_ev),
            Target::Set(_) => self.settle_set(id, kernel_ev),
        })
    }

    fn settle_set(&self, id: u32, kernel_ev: u32) -> Option<epoll_event> {
        let mut st = self.st.lock();
        let it = st.items.get_mut(&id)?;
        let rep = rules::report(kernel_ev, it.events);
        if it.disabled || rep == 0 {
            return None;
        }
        if it.events & ONESHOT != 0 {
            it.disabled = true; // the kernel disabled its own registration too
        }
        Some(epoll_event {
            events: rep,
            u64: it.data,
        })
    }

    fn settle_conn(
        &self,
        epfd: c_int,
        id: u32,
        c: &Arc<Conn>,
        kernel_ev: u32,
    ) -> Option<epoll_event> {
        let path = match c.path() {
            Path::Pending => c.resolve(true),
            p => p,
        };
        if path == Path::Ring {
            c.drain();
        }
        let mut st = self.st.lock();
        if path == Path::Tcp {
            let it = self.remove(&mut st, id)?;
            return to_kernel_fd(epfd, it, kernel_ev);
        }
        let it = st.items.get_mut(&id)?;
        if it.reg == Reg::Pending && it.fd_open {
            it.reg = Reg::Ring;
            let kev = it.kernel_events().unwrap_or(IN);
            kernel::ctl_or_log(
                "settled on a ring",
                epfd,
                libc::EPOLL_CTL_MOD,
                it.fd,
                kev,
                kernel::tag(id),
            );
        }
        if c.peer_closed() && it.reg == Reg::Ring && !it.kicked && it.fd_open {
            // EOF forever from now on: stop the kernel reporting it on every wait.
            it.reg = Reg::Dormant;
            kernel::ctl_or_log("peer gone: dormant", epfd, libc::EPOLL_CTL_DEL, it.fd, 0, 0);
        }
        None
    }

    /// Across kernels nothing closes a vanished VM's socket: look at the peers' heartbeats.
    fn watch_peers(&self) {
        for t in self.targets() {
            if let Target::Conn(c) = t {
                c.watch_peer();
            }
        }
    }

    fn spin_window(&self) -> Duration {
        self.st
            .lock()
            .items
            .values()
            .find_map(|it| match &it.target {
                Target::Conn(c) => Some(c.spin_window()),
                Target::Set(_) => None,
            })
            .unwrap_or(Duration::ZERO)
    }
}

/// Whether a data word found in a set inherited across exec is a tag of the previous image.
pub fn is_old_tag(data: u64) -> bool {
    kernel::looks_like_old_tag(data)
}

/// Removes a tagged registration inherited across exec (its program data is unknown: the
/// previous image exec'd without going through a hooked `exec` function).
pub fn forget_inherited(epfd: c_int, fd: c_int) {
    kernel::ctl_or_log("forget inherited", epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
}

/// Sets whose locks the atfork handlers hold across `fork`.
static HELD: ForkMutex<Vec<Arc<EpollSet>>> = ForkMutex::new(Vec::new());

/// atfork prepare: takes every set's lock, so the child never inherits one held by a thread
/// it does not have. All or none, retried: a thread holding a set may be waiting for a
/// nested set's lock, which we may hold.
pub fn hold_for_fork(sets: Vec<Arc<EpollSet>>) {
    loop {
        let taken = sets
            .iter()
            .take_while(|s| s.st.try_acquire_for_fork())
            .count();
        if taken == sets.len() {
            break;
        }
        sets[..taken].iter().for_each(|s| s.st.release_after_fork());
        std::thread::yield_now();
    }
    HELD.acquire_for_fork(|held| *held = sets);
}

/// atfork parent and child: releases what [`hold_for_fork`] took.
pub fn release_after_fork() {
    HELD.release_after_fork();
    let sets = std::mem::take(&mut *HELD.lock());
    sets.iter().for_each(|s| s.st.release_after_fork());
}

/// One call of `epoll_wait` on a set.
struct Waiter<'a> {
    set: &'a EpollSet,
    epfd: c_int,
    sigmask: *const libc::sigset_t,
    precise: bool,
}

impl Waiter<'_> {
    /// A set without ring members or nested sets: one kernel wait straight into the
    /// program's buffer (as cheap as without memloop), then our tagged events filtered out —
    /// another thread may have added a ring member meanwhile. `None`: only such events came,
    /// go the general way.
    fn kernel_only(
        &self,
        out: &mut [epoll_event],
        timeout: Option<Duration>,
    ) -> Option<Result<usize, c_int>> {
        {
            let mut st = self.set.st.lock();
            if !st.items.is_empty() {
                return None;
            }
            st.sleepers += 1;
        }
        let r = kernel::wait(self.epfd, out, timeout, self.sigmask, self.precise);
        self.set.sleep_leave();
        let n = match r {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        let mut kept = 0;
        let mut reported = Vec::new();
        for i in 0..n {
            if let Some(e) = self.set.translate_one(self.epfd, out[i], &mut reported) {
                out[kept] = e;
                kept += 1;
            }
        }
        // Events came but all were ours: nothing for the program yet.
        (kept > 0 || n == 0).then_some(Ok(kept))
    }

    fn run(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        timeout: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Result<usize, c_int> {
        let mut spun = false;
        loop {
            let n = self.harvest(out, tmp)?;
            if n > 0 || timeout == Some(Duration::ZERO) {
                return Ok(n);
            }
            if !spun {
                spun = true;
                let got = self.spin(out, tmp);
                if got > 0 {
                    return Ok(got);
                }
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => l,
                    _ => return Ok(0),
                },
                None => SLICE,
            };
            let n = self.block(out, tmp, left.min(SLICE))?;
            if n > 0 {
                return Ok(n);
            }
            self.set.watch_peers();
        }
    }

    fn spin(&self, out: &mut [epoll_event], tmp: &mut [epoll_event]) -> usize {
        let window = self.set.spin_window();
        let mut i = 0u32;
        let mut got = 0;
        self.set.spinner.spin(window, || {
            i += 1;
            got = if i % 8 == 0 {
                self.harvest(out, tmp).unwrap_or(0)
            } else {
                self.set.collect(self.epfd, out, &mut Vec::new())
            };
            got > 0
        });
        got
    }

    /// Ring readiness plus a non-blocking look at the kernel set. While rings are ready the
    /// kernel is asked only on one call in [`KERNEL_EVERY`] (the system call costs as much as
    /// a ring round trip) — and then first, so that kernel fds get their turn even when
    /// `maxevents` is smaller than the number of ready rings.
    fn harvest(&self, out: &mut [epoll_event], tmp: &mut [epoll_event]) -> Result<usize, c_int> {
        let set = self.set;
        let mut reported = Vec::new();
        let kernel_turn = set.calls.fetch_add(1, Relaxed) % KERNEL_EVERY == 0;
        if !kernel_turn {
            let n = set.collect(self.epfd, out, &mut reported);
            if n > 0 {
                return Ok(n);
            }
        }
        set.drain_nested_owed();
        let want = out.len().min(tmp.len());
        let k = kernel::wait(
            self.epfd,
            &mut tmp[..want],
            Some(Duration::ZERO),
            self.sigmask,
            false,
        )?;
        let m = set.translate(self.epfd, &tmp[..k], out, &mut reported);
        Ok(m + set.collect(self.epfd, &mut out[m..], &mut reported))
    }

    /// Arms every ring member, re-checks, then sleeps in the kernel.
    fn block(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        left: Duration,
    ) -> Result<usize, c_int> {
        let set = self.set;
        let mut reported = Vec::new();
        set.sleep_enter();
        let n = set.collect(self.epfd, out, &mut reported);
        let r = if n > 0 {
            Ok(0)
        } else {
            kernel::wait(self.epfd, tmp, Some(left), self.sigmask, self.precise)
        };
        set.sleep_leave();
        if n > 0 {
            return Ok(n);
        }
        let k = r?;
        let m = set.translate(self.epfd, &tmp[..k], out, &mut reported);
        Ok(m + set.collect(self.epfd, &mut out[m..], &mut reported))
    }
}

fn free_id(st: &mut State) -> u32 {
    loop {
        let id = st.next;
        st.next = st.next.wrapping_add(1);
        st.wrapped |= st.next == 0;
        if !st.items.contains_key(&id) {
            return id;
        }
    }
}

/// What a tagged kernel event turned out to be.
enum Settled {
    /// A word of the program's that only looks like ours: pass it on.
    NotOurs,
    /// Ours; maybe with an event for the program (a nested set, a connection now on TCP).
    Ours(Option<epoll_event>),
}

/// Arms an item for the sleepers of its set (a fired one-shot waits for its re-arm).
fn arm(it: &mut Item) {
    if it.armed || it.disabled {
        return;
    }
    match &it.target {
        Target::Conn(c) if c.path() == Path::Ring => {
            c.enter_wait();
            let (r, w) = rules::wants(it.events);
            if r {
                c.arm(Dir::Read);
            }
            if w {
                c.arm(Dir::Write);
            }
        }
        Target::Conn(_) => return,
        Target::Set(s) => s.sleep_enter(),
    }
    it.armed = true;
}

fn rearm(it: &mut Item) {
    match &it.target {
        Target::Conn(c) => {
            let (r, w) = rules::wants(it.events);
            if r {
                c.rearm(Dir::Read);
            }
            if w {
                c.rearm(Dir::Write);
            }
        }
        Target::Set(s) => s.rearm_all(),
    }
}

fn disarm(it: &mut Item) {
    if !it.armed {
        return;
    }
    it.armed = false;
    match &it.target {
        Target::Conn(c) => {
            let (r, w) = rules::wants(it.events);
            if r {
                c.disarm(Dir::Read);
            }
            if w {
                c.disarm(Dir::Write);
            }
            c.leave_wait();
        }
        Target::Set(s) => s.sleep_leave(),
    }
}

impl EpollSet {
    /// A further sleeper of a containing set: refresh the arms of the members.
    fn rearm_all(&self) {
        let mut st = self.st.lock();
        for it in st.items.values_mut() {
            if it.armed {
                rearm(it);
            } else {
                arm(it);
            }
        }
    }
}

/// Wakes the sleepers if `it` is ready now.
fn kick_if_ready(epfd: c_int, id: u32, it: &mut Item) {
    if it.would_report() {
        kick(epfd, id, it);
    }
}

/// Makes the kernel report the item's registration at once (`EPOLLOUT` on a socket is
/// ready), so every thread asleep on the set wakes; [`unkick`] undoes it.
fn kick(epfd: c_int, id: u32, it: &mut Item) {
    match &it.target {
        Target::Set(s) => s.kick_ready(),
        Target::Conn(_) if !it.fd_open || it.kicked => {}
        Target::Conn(_) => {
            let op = if it.reg == Reg::Dormant {
                it.reg = Reg::Ring;
                libc::EPOLL_CTL_ADD
            } else {
                libc::EPOLL_CTL_MOD
            };
            it.kicked = true;
            let kev = it.kernel_events().unwrap_or(IN | OUT);
            if kernel::ctl(epfd, op, it.fd, kev, kernel::tag(id)).is_err() {
                it.kicked = false;
            }
        }
    }
}

fn unkick(epfd: c_int, id: u32, it: &mut Item) {
    it.kicked = false;
    if let (Some(kev), true) = (it.kernel_events(), it.fd_open) {
        kernel::ctl_or_log(
            "unkick",
            epfd,
            libc::EPOLL_CTL_MOD,
            it.fd,
            kev,
            kernel::tag(id),
        );
    }
}

/// A one-shot interest fired: quiet until the program re-arms it.
fn disable(epfd: c_int, id: u32, it: &mut Item) {
    it.disabled = true;
    if it.reg == Reg::Set && it.fd_open {
        if let Some(kev) = it.kernel_events() {
            kernel::ctl_or_log(
                "one-shot fired",
                epfd,
                libc::EPOLL_CTL_MOD,
                it.fd,
                kev,
                kernel::tag(id),
            );
        }
    }
}

/// A pending connection stayed on TCP: from now on a kernel fd like any other. Its
/// registration gets the program's own events and data, and the event that settled it goes
/// to the program.
fn to_kernel_fd(epfd: c_int, mut it: Item, kernel_ev: u32) -> Option<epoll_event> {
    if it.armed {
        disarm(&mut it);
    }
    if it.fd_open {
        let events = it.events & !EXCLUSIVE;
        kernel::ctl_or_log(
            "settled on TCP",
            epfd,
            libc::EPOLL_CTL_MOD,
            it.fd,
            events,
            it.data,
        );
    }
    let rep = rules::report(kernel_ev, it.events);
    (rep != 0).then_some(epoll_event {
        events: rep,
        u64: it.data,
    })
}
