//! Which fds memloop knows about. The hot check is one relaxed load from a flat array, so a
//! call on an fd that is not ours costs a table lookup and no system call.

use crate::conn::Conn;
use crate::epoll::EpollSet;
use crate::forklock::ForkMutex;
use crate::listen::Listener;
use crate::plain::PlainTcp;
use std::collections::BTreeMap;
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

static KIND: [AtomicU8; MAX_FD] = [const { AtomicU8::new(K_NONE) }; MAX_FD];
static ENTRIES: ForkMutex<BTreeMap<i32, Entry>> = ForkMutex::new(BTreeMap::new());

#[derive(Clone)]
pub enum Entry {
    /// A TCP socket not connected yet that the program already put into epoll sets.
    Fresh(Arc<Fresh>),
    Listener(Arc<Listener>),
    Conn(Arc<Conn>),
    /// A TCP connection on the kernel path, recorded for `memloop status`.
    Plain(Arc<PlainTcp>),
    Epoll(Arc<EpollSet>),
}

/// Epoll registrations made before the socket connected: (epoll fd, events, data).
#[derive(Default)]
pub struct Fresh {
    pub epolls: ForkMutex<Vec<(i32, u32, u64)>>,
}

fn slot(fd: i32) -> Option<&'static AtomicU8> {
    usize::try_from(fd).ok().and_then(|i| KIND.get(i))
}

#[inline]
pub fn kind(fd: i32) -> u8 {
    slot(fd).map_or(K_NONE, |k| k.load(Relaxed))
}

pub fn mark_tcp(fd: i32) {
    if let Some(k) = slot(fd) {
        k.store(K_TCP, Relaxed);
    }
}

pub fn get(fd: i32) -> Option<Entry> {
    if kind(fd) != K_OBJ {
        return None;
    }
    ENTRIES.lock().get(&fd).cloned()
}

pub fn conn(fd: i32) -> Option<Arc<Conn>> {
    match get(fd)? {
        Entry::Conn(c) => Some(c),
        _ => None,
    }
}

/// Installs `e` for `fd` (false if the fd is too large to track).
pub fn insert(fd: i32, e: Entry) -> bool {
    let Some(k) = slot(fd) else { return false };
    ENTRIES.lock().insert(fd, e);
    k.store(K_OBJ, Relaxed);
    true
}

/// Forgets `fd` (closed, or reused by the kernel for something else).
pub fn remove(fd: i32) -> Option<Entry> {
    let k = slot(fd)?;
    let prev = k.swap(K_NONE, Relaxed);
    if prev == K_OBJ {
        ENTRIES.lock().remove(&fd)
    } else {
        None
    }
}

/// Copies `old`'s state to `new` (dup family); returns what `new` held before.
pub fn duplicate(old: i32, new: i32) -> Option<Entry> {
    let prev = remove(new);
    match kind(old) {
        K_TCP => mark_tcp(new),
        K_OBJ => {
            if let Some(e) = get(old) {
                if let Entry::Conn(c) = &e {
                    c.add_fd(new);
                }
                insert(new, e);
            }
        }
        _ => {}
    }
    prev
}

/// Every entry (fork handlers, epoll clean-up).
pub fn all() -> Vec<(i32, Entry)> {
    ENTRIES
        .lock()
        .iter()
        .map(|(k, v)| (*k, v.clone()))
        .collect()
}

/// atfork prepare: takes the table lock (held across fork) and runs `f` on every connection
/// under it, so no connection can appear between `f` and the fork.
pub fn lock_for_fork(mut f: impl FnMut(&Arc<Conn>)) {
    ENTRIES.acquire_for_fork(|entries| {
        let mut seen: Vec<&Arc<Conn>> = Vec::new();
        for e in entries.values() {
            if let Entry::Conn(c) = e {
                if !seen.iter().any(|s| Arc::ptr_eq(s, c)) {
                    f(c);
                    seen.push(c);
                }
            }
        }
    });
}

pub fn release_after_fork() {
    ENTRIES.release_after_fork();
}
