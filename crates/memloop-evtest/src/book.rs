//! The registrations a scenario made (so every event's data word can be checked against them)
//! and the events its waiter threads saw.
//!
//! Every `epoll_ctl` goes through a [`Book`], which stamps it with a global sequence number:
//! a registration lives from the number taken *before* its ADD/MOD to the number taken *after*
//! the DEL/MOD/close that ended it. A waiter reads the number before and after each
//! `epoll_wait`. The kernel reports an item only while it is registered (an item removed by
//! `EPOLL_CTL_DEL` or a MOD is never reported by a later harvest), so an event is legitimate
//! only when its data word belongs to a registration whose life overlaps the call, and when
//! its bits are within that registration's interest plus `EPOLLHUP|EPOLLERR`.

use crate::sys::{self, Errno, Ev};
use crate::util::{evname, looks_like_memloop_tag, Res};
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Reg {
    pub label: String,
    pub fd: RawFd,
    pub events: u32,
    pub add: u64,
    pub del: Option<u64>,
}

#[derive(Default)]
pub struct Book {
    seq: AtomicU64,
    regs: Mutex<HashMap<u64, Vec<Reg>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Book {
    pub fn new() -> Arc<Book> {
        Arc::new(Book::default())
    }

    pub fn now(&self) -> u64 {
        self.seq.load(SeqCst)
    }

    fn tick(&self) -> u64 {
        self.seq.fetch_add(1, SeqCst) + 1
    }

    fn insert(&self, fd: RawFd, events: u32, data: u64, label: &str) -> u64 {
        let add = self.tick();
        lock(&self.regs).entry(data).or_default().push(Reg {
            label: label.to_string(),
            fd,
            events,
            add,
            del: None,
        });
        add
    }

    /// Forgets a registration the kernel refused (it never existed).
    fn unwind(&self, data: u64, add: u64) {
        if let Some(v) = lock(&self.regs).get_mut(&data) {
            v.retain(|r| r.add != add);
        }
    }

    /// `EPOLL_CTL_ADD` of `fd` with `data`, known as `label`.
    pub fn add(
        &self,
        epfd: RawFd,
        fd: RawFd,
        events: u32,
        data: u64,
        label: &str,
    ) -> Result<(), Errno> {
        let add = self.insert(fd, events, data, label);
        sys::ep_add(epfd, fd, events, data).inspect_err(|_| self.unwind(data, add))
    }

    /// `EPOLL_CTL_MOD` of `fd` from data word `old` to `data`.
    pub fn modify(
        &self,
        epfd: RawFd,
        fd: RawFd,
        old: u64,
        events: u32,
        data: u64,
        label: &str,
    ) -> Result<(), Errno> {
        let add = self.insert(fd, events, data, label);
        match sys::ep_mod(epfd, fd, events, data) {
            Ok(()) => {
                self.end_word(old, |r| r.fd == fd && r.add != add);
                Ok(())
            }
            Err(e) => {
                self.unwind(data, add);
                Err(e)
            }
        }
    }

    /// `EPOLL_CTL_DEL` of `fd` registered with `data`.
    pub fn del(&self, epfd: RawFd, fd: RawFd, data: u64) -> Result<(), Errno> {
        sys::ep_del(epfd, fd)?;
        self.end_word(data, |r| r.fd == fd);
        Ok(())
    }

    /// After the last copy of `fd`'s file was closed: the kernel dropped its registrations.
    pub fn closed(&self, fd: RawFd) {
        self.end_where(|_, r| r.fd == fd);
    }

    /// The registration with data word `data` ended (its fd was closed; words are unique).
    pub fn ended(&self, data: u64) {
        self.end_word(data, |_| true);
    }

    fn end_word(&self, data: u64, f: impl Fn(&Reg) -> bool) {
        let t = self.tick();
        if let Some(v) = lock(&self.regs).get_mut(&data) {
            for r in v.iter_mut().filter(|r| r.del.is_none() && f(r)) {
                r.del = Some(t);
            }
        }
    }

    fn end_where(&self, f: impl Fn(u64, &Reg) -> bool) {
        let t = self.tick();
        for (d, v) in lock(&self.regs).iter_mut() {
            for r in v.iter_mut().filter(|r| r.del.is_none()) {
                if f(*d, r) {
                    r.del = Some(t);
                }
            }
        }
    }

    /// The registration `ev` belongs to, for a call that ran between `start` and `end`.
    pub fn check(&self, ev: Ev, start: u64, end: u64) -> Result<Reg, String> {
        let regs = lock(&self.regs);
        let Some(v) = regs.get(&ev.data) else {
            let hint = if looks_like_memloop_tag(ev.data) {
                " (memloop's internal epoll tag 0x4d4c7470_XXXXXXXX leaked into the program)"
            } else {
                ""
            };
            return Err(format!(
                "unknown data word {:#018x} with events {}: never registered{hint}",
                ev.data,
                evname(ev.events)
            ));
        };
        let live: Vec<&Reg> = v
            .iter()
            .filter(|r| r.add <= end && !matches!(r.del, Some(d) if d < start))
            .collect();
        if live.is_empty() {
            return Err(format!(
                "event {} for data word {:#018x} ({}) whose registration had ended before the \
                 epoll_wait started (phantom event after DEL/MOD/close)",
                evname(ev.events),
                ev.data,
                v[0].label
            ));
        }
        let fits = live
            .iter()
            .find(|r| ev.events & !(r.events | sys::HUP | sys::ERR) == 0);
        match fits {
            Some(r) => Ok((*r).clone()),
            None => Err(format!(
                "event {} for {} ({:#018x}) outside its interest {}",
                evname(ev.events),
                live[0].label,
                ev.data,
                evname(live[0].events)
            )),
        }
    }
}

// ---- the waiters' log ---------------------------------------------------------------------

/// One event a waiter saw.
#[derive(Clone, Debug)]
pub struct Seen {
    pub label: String,
    pub data: u64,
    pub events: u32,
    pub at: Instant,
    pub waiter: usize,
}

#[derive(Default)]
pub struct Log {
    seen: Mutex<Vec<Seen>>,
    cv: Condvar,
    fail: Mutex<Option<String>>,
}

impl Log {
    pub fn new() -> Arc<Log> {
        Arc::new(Log::default())
    }

    pub fn push(&self, s: Seen) {
        lock(&self.seen).push(s);
        self.cv.notify_all();
    }

    /// Records the first failure a waiter met.
    pub fn fail(&self, why: String) {
        let mut f = lock(&self.fail);
        if f.is_none() {
            *f = Some(why);
        }
        drop(f);
        self.cv.notify_all();
    }

    pub fn failure(&self) -> Res<()> {
        match &*lock(&self.fail) {
            Some(f) => Err(f.clone()),
            None => Ok(()),
        }
    }

    pub fn snapshot(&self) -> Vec<Seen> {
        lock(&self.seen).clone()
    }

    /// Waits until `pred` holds over the events so far (or a waiter failed).
    pub fn wait_for(&self, limit: Duration, what: &str, pred: impl Fn(&[Seen]) -> bool) -> Res<()> {
        let end = Instant::now() + limit;
        let mut seen = lock(&self.seen);
        loop {
            self.failure()?;
            if pred(&seen) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= end {
                return Err(format!("{what} (waited {limit:?})"));
            }
            seen = self
                .cv
                .wait_timeout(seen, (end - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A thread looping in `epoll_wait` on a set, checking every event against the book and
/// logging it; `react` runs for each legitimate event (in the waiter thread).
pub struct Waiter {
    pub tid: i32,
    handle: Option<std::thread::JoinHandle<()>>,
}

pub struct WaitSpec {
    pub epfd: RawFd,
    pub idx: usize,
    pub max: usize,
    pub timeout_ms: i32,
}

impl Waiter {
    pub fn spawn(
        spec: WaitSpec,
        book: Arc<Book>,
        log: Arc<Log>,
        stop: Arc<AtomicBool>,
        react: Arc<dyn Fn(&Seen) + Send + Sync>,
    ) -> Waiter {
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            let _ = tx.send(sys::gettid());
            waiter_loop(&spec, &book, &log, &stop, &*react);
        });
        let tid = rx.recv().unwrap_or(0);
        Waiter {
            tid,
            handle: Some(handle),
        }
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().map_or(true, |h| h.is_finished())
    }

    pub fn join(mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn waiter_loop(spec: &WaitSpec, book: &Book, log: &Log, stop: &AtomicBool, react: &dyn Fn(&Seen)) {
    while !stop.load(SeqCst) {
        let start = book.now();
        let evs = match sys::ep_wait(spec.epfd, spec.max, spec.timeout_ms) {
            Ok(v) => v,
            Err(Errno(libc::EINTR)) => continue,
            Err(e) => {
                log.fail(format!("waiter {}: epoll_wait: {e}", spec.idx));
                return;
            }
        };
        let end = book.now();
        let at = Instant::now();
        for ev in evs {
            match book.check(ev, start, end) {
                Ok(r) => {
                    let s = Seen {
                        label: r.label,
                        data: ev.data,
                        events: ev.events,
                        at,
                        waiter: spec.idx,
                    };
                    react(&s);
                    log.push(s);
                }
                Err(why) => log.fail(format!("waiter {}: {why}", spec.idx)),
            }
        }
    }
}
