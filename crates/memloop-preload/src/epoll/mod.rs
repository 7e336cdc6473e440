//! epoll over a mix of ring connections, nested epoll sets and kernel fds.
//!
//! Every epoll set of the process is known from its birth (`epoll_create*` are hooked), and
//! every wait on it comes through [`EpollSet::wait`], which filters the kernel's events: our
//! own registrations carry a tagged data word (`kernel::tag`) and never reach the program.
//!
//! A ring connection is registered in the kernel set for `EPOLLIN` only (its doorbell byte,
//! FIN or reset wakes the set); the program's interest (events, data, `ET`, `ONESHOT`) is kept
//! here and answered from the rings. A connection of ours off its ring (switching, or on TCP
//! after a switch) stays ours: its socket may hold the peer's doorbells, so its readiness is
//! the kernel's answer filtered as poll filters it ([`Conn::off_ring_look`]). A nested epoll
//! set (an epoll fd in this set) is registered under a tag too, so its ring members'
//! readiness can be reported even when no doorbell was sent. Kernel fds are the kernel's
//! business.
//!
//! **Sleepers.** While any thread sleeps in the kernel on this set — or on a set that contains
//! it, or in `poll` on it — every ring member is *armed*: the peer's next publication sends a
//! doorbell. A member added, modified or made ready by this process while someone sleeps is
//! armed at once and, if already ready, *kicked*: its registration briefly asks for `EPOLLOUT`,
//! which the kernel reports at once, so the sleepers wake and look again — as the kernel wakes
//! `epoll_wait` when a ready fd is added from another thread.

mod arming;
mod ctl;
mod index;
mod kernel;
mod lifecycle;
mod rules;
mod wait;

use arming::*;
pub use index::INDEX_AT;
pub use lifecycle::{forget_inherited, hold_for_fork, is_old_tag, release_after_fork};
use wait::*;

use crate::conn::{Conn, Dir, Path, Spinner};
use crate::forklock::ForkMutex;
use libc::{c_int, epoll_event};
use rules::{Edge, ET, EXCLUSIVE, ONESHOT};
use std::cell::Cell;
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
const RDHUP: u32 = libc::EPOLLRDHUP as u32;

thread_local! {
    static TMP: std::cell::RefCell<Vec<epoll_event>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// What an emulated registration watches.
#[derive(Clone)]
pub enum Target {
    Conn(Arc<Conn>),
    Set(Arc<EpollSet>),
    /// A UDP socket of ours: its kernel socket and its own wake socket are registered in the
    /// kernel set (both under the item's tag), its rings answered here.
    Udp(Arc<crate::udp::UdpSock>),
}

impl Target {
    fn is(&self, other: &Target) -> bool {
        match (self, other) {
            (Target::Conn(a), Target::Conn(b)) => Arc::ptr_eq(a, b),
            (Target::Set(a), Target::Set(b)) => Arc::ptr_eq(a, b),
            (Target::Udp(a), Target::Udp(b)) => Arc::ptr_eq(a, b),
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
    /// A connection of ours off its ring: edge-triggered in the kernel (unread bytes — data
    /// or doorbells — never wake a sleeper twice), each edge a cue to look again.
    OffRing,
    /// A UDP socket of ours: like [`Reg::OffRing`] for its kernel socket (edges are cues to
    /// look), plus its wake socket's registration.
    Udp,
}

impl Reg {
    fn of(t: &Target) -> Reg {
        match t {
            // A pending connection waits for the accept's doorbell in the kernel (asked for
            // here; decided already, no doorbell comes: the decision is taken now).
            Target::Conn(c) => match c.path() {
                Path::Pending if !c.expect_accept_bell() => {
                    Reg::following(c.resolve(true)).unwrap_or(Reg::Pending)
                }
                Path::Pending => Reg::Pending,
                Path::Ring => Reg::Ring,
                _ => Reg::OffRing,
            },
            Target::Set(_) => Reg::Set,
            Target::Udp(_) => Reg::Udp,
        }
    }

    /// The registration a connection's item gets when it follows the connection to `path`
    /// (`None`: a pending connection, whose item is settled when it is decided).
    fn following(path: Path) -> Option<Reg> {
        match path {
            Path::Ring => Some(Reg::Ring),
            Path::Pending => None,
            _ => Some(Reg::OffRing),
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
            Reg::OffRing | Reg::Udp if disabled => Some(ET),
            Reg::OffRing | Reg::Udp => Some(ET | kick | (events & (IN | OUT | RDHUP))),
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
    /// A large set's lasting arm (`index`): not counted as a sleeper on the connection, so
    /// its doorbells are read as they come.
    lasting: bool,
    /// When the item last reported or was named, in `index::now_ms` (large sets).
    seen: u64,
    kicked: bool,
    /// `OffRing`: look at the socket again (an edge came, or the last look found something
    /// or a switch in flight); otherwise nothing changed since a look that found nothing.
    hot: Cell<bool>,
    /// `OffRing`: kernel edges seen (new bytes or room): part of the edge signature.
    edges: u64,
    /// The set's wake target (`crate::wake`), 0 while it has none: arms name it.
    wake: u32,
    /// Which directions' arms named it (read, write): their disarms must say so.
    targeted: [bool; 2],
}

impl Item {
    /// The bits this item reports now and its edge signature; `None` if the kernel decides.
    fn readiness(&self) -> Option<(u32, (u64, u64, u32))> {
        self.readiness_with(true)
    }

    /// [`Self::readiness`]; the signature of a ring connection only if `sig` (or its
    /// interest is edge-triggered): the stream positions behind it cost two more looks at
    /// lines the peer writes.
    fn readiness_with(&self, sig: bool) -> Option<(u32, (u64, u64, u32))> {
        match &self.target {
            Target::Conn(c) if self.reg == Reg::OffRing => Some(self.off_ring(c)),
            Target::Conn(c) if c.path() == Path::Ring => {
                let revents = c.revents_for(self.events & OUT != 0);
                let rep = rules::report(rules::poll_to_epoll(revents), self.events);
                let progress = match sig || self.events & ET != 0 {
                    true => c.progress(),
                    false => (0, 0, false),
                };
                Some((rep, rules::edge_signature(self.events, progress, rep)))
            }
            Target::Conn(_) => None,
            Target::Set(s) => {
                let sig = s.peek()?;
                let rep = rules::report(IN, self.events);
                Some((rep, (sig, 0, rep)))
            }
            Target::Udp(u) => Some(self.udp(u)),
        }
    }

    /// [`Self::readiness`] of a UDP socket: its rings, and a look at its kernel socket when
    /// an edge came or the last look found something (or the program wants `EPOLLOUT`).
    fn udp(&self, u: &crate::udp::UdpSock) -> (u32, (u64, u64, u32)) {
        let events = rules::poll_events(self.events);
        let mut rev = 0;
        if self.fd_open && (self.hot.get() || self.events & OUT != 0) {
            rev = crate::real::wait_fd(self.fd, events, Some(Duration::ZERO)).unwrap_or(0);
            self.hot.set(rev & libc::POLLIN != 0);
        }
        let ring = u.ring_readable();
        if ring {
            rev |= libc::POLLIN;
        }
        let rep = rules::report(rules::poll_to_epoll(rev), self.events);
        let sig = (
            u.ring_received(),
            self.edges.wrapping_add(ring as u64),
            false,
        );
        (rep, rules::edge_signature(self.events, sig, rep))
    }

    /// [`Self::readiness`] of a connection off its ring: a fresh, filtered look at its
    /// socket, skipped while nothing can have changed.
    fn off_ring(&self, c: &Conn) -> (u32, (u64, u64, u32)) {
        let events = rules::poll_events(self.events);
        let in_flight = c.off_ring_sleep(events).1;
        let mut rep = 0;
        if self.hot.get() || in_flight {
            rep = rules::report(rules::poll_to_epoll(c.off_ring_look(events)), self.events);
            self.hot.set(rep != 0 || in_flight);
        }
        let (r, w, fin) = c.progress();
        let sig = (r.wrapping_add(self.edges), w.wrapping_add(self.edges), fin);
        (rep, rules::edge_signature(self.events, sig, rep))
    }

    /// Would report something now (nothing recorded).
    fn would_report(&self) -> bool {
        if self.disabled {
            return false;
        }
        match self.readiness_with(false) {
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
    /// The set's wake socket, registered in its kernel set under [`WAKE_ID`]; made at the
    /// first wait on the set with ring members (`wake_tried`), if it can be.
    wake: Option<Arc<crate::wake::WakeSocket>>,
    wake_tried: bool,
    /// The last sleeper out just read the wake socket: the kernel's report of it that the
    /// same wait returned needs no second read.
    wake_drained: bool,
    /// Items by the index of their connection's channel (the name its wake-ups carry).
    by_channel: HashMap<u32, Vec<u32>>,
    /// Nested sets among the items.
    nested: usize,
    /// A large set's members to look at (`index`): the others are armed and quiet.
    looks: Option<index::Looks>,
    /// Kernel registrations of ring connections the program removed, kept under their item
    /// id (by fd): an event loop that removes and adds a socket at every request (redis's ae)
    /// gets it back without two system calls (`ctl.rs`, "parked").
    parked: HashMap<c_int, (u32, Arc<Conn>)>,
    /// Their ids (never issued again while parked), with their fds.
    parked_ids: HashMap<u32, c_int>,
}

/// The item id of the set's wake socket's registration (never issued to an item).
const WAKE_ID: u32 = u32::MAX;

impl State {
    fn wake_target(&self) -> u32 {
        self.wake.as_ref().map_or(0, |w| w.target())
    }

    /// Reads the wake-ups queued for this set (before its members are looked at again); a
    /// large set looks at the members they name.
    fn drain_wake(&mut self) {
        let Some(w) = self.wake.clone() else { return };
        if self.looks.is_none() {
            return w.drain();
        }
        let n = w.drain_names(|name| self.named(name));
        self.drained(n);
    }
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
}
