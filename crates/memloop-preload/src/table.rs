//! Which fds memloop knows about. The hot check is one relaxed load from a flat array, so a
//! call on an fd that is not ours costs a table lookup and no system call; an fd that is ours
//! is found with a lock-free load (`arc-swap`), so data calls never take a lock here.

use crate::conn::Conn;
use crate::epoll::EpollSet;
use crate::forklock::ForkMutex;
use crate::listen::Listener;
use crate::plain::PlainTcp;
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::Arc;

/// fds at or above this are never accelerated (counted as unsupported).
pub const MAX_FD: usize = 1 << 16;
/// Not ours: every call passes straight through.
pub const K_NONE: u8 = 0;
/// An inet stream socket created under us that has not connected or listened yet.
pub const K_TCP: u8 = 1;
/// Has an [`Entry`].
pub const K_OBJ: u8 = 2;
/// The library's own (a wake socket): a close, `dup2` over it or `closefrom` by the program
/// turns it back to [`K_NONE`], and the library stops using the number.
pub const K_OWN: u8 = 3;
/// An inet datagram socket created under us that is not published (not bound yet, or bound
/// before a region was there): its first send to a member's socket publishes it.
pub const K_UDP: u8 = 4;

static KIND: [AtomicU8; MAX_FD] = [const { AtomicU8::new(K_NONE) }; MAX_FD];
static SLOTS: [ArcSwapOption<Entry>; MAX_FD] = [const { ArcSwapOption::const_empty() }; MAX_FD];
/// Serialises changes (not lookups) so the fork handlers see a stable set of connections.
static CHANGES: ForkMutex<()> = ForkMutex::new(());
/// Highest fd ever given an entry + 1: bounds the scans below.
static HIGH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// The epoll sets we track (a close must drop the fd from each).
static EPOLLS: ForkMutex<Vec<(i32, Arc<EpollSet>)>> = ForkMutex::new(Vec::new());

pub enum Entry {
    /// A TCP socket not connected yet that the program already put into epoll sets.
    Fresh(Arc<Fresh>),
    Listener(Arc<Listener>),
    Conn(Arc<Conn>),
    /// A TCP connection on the kernel path, recorded for `memloop status`.
    Plain(Arc<PlainTcp>),
    Epoll(Arc<EpollSet>),
    /// A UDP socket published as a datagram endpoint.
    Udp(Arc<crate::udp::UdpSock>),
}

/// Epoll registrations made before the socket connected: (epoll fd, events, data).
#[derive(Default)]
pub struct Fresh {
    pub epolls: ForkMutex<Vec<(i32, u32, u64)>>,
}

fn index(fd: i32) -> Option<usize> {
    // A negative fd is simply not ours (the real call reports EBADF).
    usize::try_from(fd).ok().filter(|&i| i < MAX_FD)
}

#[inline]
pub fn kind(fd: i32) -> u8 {
    index(fd).map_or(K_NONE, |i| KIND[i].load(Relaxed))
}

pub fn mark_tcp(fd: i32) {
    if let Some(i) = index(fd) {
        KIND[i].store(K_TCP, Relaxed);
        HIGH.fetch_max(i + 1, Relaxed);
    }
}

pub fn mark_udp(fd: i32) {
    if let Some(i) = index(fd) {
        KIND[i].store(K_UDP, Relaxed);
        HIGH.fetch_max(i + 1, Relaxed);
    }
}

pub fn mark_own(fd: i32) {
    if let Some(i) = index(fd) {
        KIND[i].store(K_OWN, Relaxed);
        HIGH.fetch_max(i + 1, Relaxed);
    }
}

/// Gives up a library-owned fd (before the library closes it itself).
pub fn unmark_own(fd: i32) {
    if let Some(i) = index(fd) {
        let _ = KIND[i].compare_exchange(K_OWN, K_NONE, Relaxed, Relaxed);
    }
}

pub fn get(fd: i32) -> Option<Arc<Entry>> {
    let i = index(fd)?;
    if KIND[i].load(Relaxed) != K_OBJ {
        return None;
    }
    SLOTS[i].load_full()
}

pub fn conn(fd: i32) -> Option<Arc<Conn>> {
    match &*get(fd)? {
        Entry::Conn(c) => Some(c.clone()),
        _ => None,
    }
}

/// The published UDP socket behind `fd`. Asked first by every send on an fd of ours, TCP
/// ring connections' too: the entry is only looked at (no reference taken unless it is one).
pub fn udp(fd: i32) -> Option<Arc<crate::udp::UdpSock>> {
    let i = index(fd)?;
    if KIND[i].load(Relaxed) != K_OBJ {
        return None;
    }
    match (*SLOTS[i].load()).as_deref() {
        Some(Entry::Udp(u)) => Some(u.clone()),
        _ => None,
    }
}

/// Every published UDP socket, once each.
pub fn udps() -> Vec<Arc<crate::udp::UdpSock>> {
    let mut v: Vec<Arc<crate::udp::UdpSock>> = Vec::new();
    each(|_, e| {
        if let Entry::Udp(u) = e {
            if !v.iter().any(|x| Arc::ptr_eq(x, u)) {
                v.push(u.clone());
            }
        }
    });
    v
}

/// Installs `e` for `fd` (false if the fd is too large to track).
pub fn insert(fd: i32, e: Entry) -> bool {
    let Some(i) = index(fd) else { return false };
    let _g = CHANGES.lock();
    if let Entry::Epoll(s) = &e {
        EPOLLS.lock().push((fd, s.clone()));
    }
    SLOTS[i].store(Some(Arc::new(e)));
    KIND[i].store(K_OBJ, Relaxed);
    HIGH.fetch_max(i + 1, Relaxed);
    true
}

/// Forgets `fd` (closed, or reused by the kernel for something else).
pub fn remove(fd: i32) -> Option<Arc<Entry>> {
    let i = index(fd)?;
    let _g = CHANGES.lock();
    let prev = KIND[i].swap(K_NONE, Relaxed);
    let e = SLOTS[i].swap(None);
    if matches!(e.as_deref(), Some(Entry::Epoll(_))) {
        EPOLLS.lock().retain(|(f, _)| *f != fd);
    }
    (prev == K_OBJ).then_some(e).flatten()
}

/// Copies `old`'s state to `new` (dup family).
pub fn duplicate(old: i32, new: i32) {
    remove(new);
    match kind(old) {
        K_TCP => mark_tcp(new),
        K_UDP => mark_udp(new),
        K_OBJ => {
            let (Some(i), Some(e)) = (index(new), get(old)) else {
                return;
            };
            if let Entry::Conn(c) = &*e {
                c.add_fd(new);
            }
            let _g = CHANGES.lock();
            if let Entry::Epoll(s) = &*e {
                EPOLLS.lock().push((new, s.clone()));
            }
            SLOTS[i].store(Some(e));
            KIND[i].store(K_OBJ, Relaxed);
            HIGH.fetch_max(i + 1, Relaxed);
        }
        _ => {}
    }
}

/// The fds in `first..=last` that are not plain kernel fds to us.
pub fn tracked_in(first: i32, last: i32) -> Vec<i32> {
    let high = HIGH.load(Relaxed).min(MAX_FD) as i64;
    let (lo, hi) = (i64::from(first.max(0)), i64::from(last).min(high - 1));
    (lo..=hi)
        .map(|fd| fd as i32)
        .filter(|&fd| kind(fd) != K_NONE)
        .collect()
}

/// `f` on every entry, borrowed: no reference is taken on entries `f` does not keep (in a fork
/// child, a count written is a page copied).
pub fn each(mut f: impl FnMut(i32, &Entry)) {
    for i in 0..HIGH.load(Relaxed).min(MAX_FD) {
        if KIND[i].load(Relaxed) != K_OBJ {
            continue;
        }
        if let Some(e) = (*SLOTS[i].load()).as_deref() {
            f(i as i32, e);
        }
    }
}

/// With the change lock held (fork prepare), if every entry is a plain TCP connection a fork
/// child may use without the engine or a listener (which such a child may close without it:
/// only its parent unregisters it): their fds, `None` otherwise, or past `max` of either.
pub fn plain_only(max: usize) -> Option<(Vec<i32>, Vec<i32>)> {
    let (mut plain, mut listeners, mut other) = (Vec::new(), Vec::new(), false);
    each(|fd, e| match e {
        Entry::Listener(_) => listeners.push(fd),
        Entry::Plain(p) if p.child_needs_nothing() => plain.push(fd),
        _ => other = true,
    });
    (!other && plain.len() <= max && listeners.len() <= max).then_some((plain, listeners))
}

/// The kinds array (for the shim, which reads it in a fork child that has not needed the
/// engine yet) and how far it is used: past that, no fd is ours.
pub fn kinds() -> (*const u8, usize) {
    (KIND.as_ptr().cast(), HIGH.load(Relaxed).min(MAX_FD))
}

/// A fork child closed `fd` (a plain connection) before it needed the engine: its entry goes,
/// with nothing else done (the record is the parent's).
pub fn forget_closed(fd: i32) {
    if let Some(i) = index(fd) {
        if KIND[i].load(Relaxed) == K_OBJ {
            KIND[i].store(K_NONE, Relaxed);
            drop(SLOTS[i].swap(None));
        }
    }
}

/// Every entry.
pub fn all() -> Vec<(i32, Arc<Entry>)> {
    (0..HIGH.load(Relaxed) as i32)
        .filter_map(|fd| get(fd).map(|e| (fd, e)))
        .collect()
}

/// Every connection of ours, once each (several fds may name one).
pub fn conns() -> Vec<Arc<Conn>> {
    // (By address, in a set: the heartbeat lists them every beat, and a server with 10,000
    // connections made a pairwise comparison take the whole of a CPU. Made at the first one:
    // the fork handlers ask in every child, where each allocation is a page to copy.)
    let mut seen: Option<std::collections::HashSet<usize>> = None;
    let mut v: Vec<Arc<Conn>> = Vec::new();
    each(|_, e| {
        if let Entry::Conn(c) = e {
            if seen
                .get_or_insert_with(Default::default)
                .insert(Arc::as_ptr(c) as usize)
            {
                v.push(c.clone());
            }
        }
    });
    v
}

/// The fds under which `set` is known (an epoll fd may have been duplicated).
pub fn epoll_fds_of(set: &Arc<EpollSet>) -> Vec<i32> {
    EPOLLS
        .lock()
        .iter()
        .filter(|(_, s)| Arc::ptr_eq(s, set))
        .map(|(f, _)| *f)
        .collect()
}

/// Whether an fd other than `fd` holds the same entry (a `dup` of it).
pub fn shared_with_another_fd(fd: i32, e: &Arc<Entry>) -> bool {
    all()
        .iter()
        .any(|(f, other)| *f != fd && Arc::ptr_eq(other, e))
}

/// Every epoll fd we track, with its set.
pub fn epoll_fds() -> Vec<(i32, Arc<EpollSet>)> {
    EPOLLS.lock().clone()
}

/// Every epoll set we track.
pub fn epoll_sets() -> Vec<Arc<EpollSet>> {
    let mut v: Vec<Arc<EpollSet>> = Vec::new();
    for (_, s) in EPOLLS.lock().iter() {
        if !v.iter().any(|x| Arc::ptr_eq(x, s)) {
            v.push(s.clone());
        }
    }
    v
}

/// atfork prepare: holds the change lock across fork and runs `f` on every connection under
/// it, so no connection can appear between `f` and the fork.
pub fn lock_for_fork(mut f: impl FnMut(&Arc<Conn>)) {
    CHANGES.acquire_for_fork(|_| {
        let mut seen: Vec<*const Conn> = Vec::new();
        each(|_, e| {
            if let Entry::Conn(c) = e {
                if !seen.contains(&Arc::as_ptr(c)) {
                    f(c);
                    seen.push(Arc::as_ptr(c));
                }
            }
        });
    });
}

/// Runs `f` while no fork can happen in this process (the fork handlers hold this lock).
pub fn without_fork<R>(f: impl FnOnce() -> R) -> R {
    let _g = CHANGES.lock();
    f()
}

/// atfork prepare, once the epoll sets are held: the list of epoll fds too. It is read
/// without the change lock (`epoll_sets`, `epoll_fds_of`), so a parent thread may hold it at
/// the fork, and a child that inherited it held would spin for good at its first close of an
/// epoll fd (Python's `subprocess` child closes the inherited fds before its exec). Writers
/// take it under the change lock, which is held already: the same order.
pub fn hold_epoll_list_for_fork() {
    EPOLLS.acquire_for_fork(|_| {});
}

pub fn release_after_fork() {
    EPOLLS.release_after_fork();
    CHANGES.release_after_fork();
}
