//! The scenarios, and what several of them share: an epoll set with its book, log and waiter
//! threads, and ways to wait for (or rule out) events.

pub mod close_dup;
pub mod data_words;
pub mod et_partial;
pub mod exclusive;
pub mod fork;
pub mod listener_dup;
pub mod mixed;
pub mod multi_waiters;
pub mod nested;
pub mod oneshot;
pub mod pwait2;
pub mod stress;
pub mod tag_words;
pub mod wake_burst;

use crate::book::{Book, Log, Seen, WaitSpec, Waiter};
use crate::sys;
use crate::util::{evname, Ctx, Res};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// Hidden roles of re-executed children: the exit code.
pub fn child_role(role: &str, args: &[String]) -> i32 {
    let r = match role {
        "__exec_child" => fork::exec_child(args),
        "__stress_peer" => stress::peer_main(args),
        _ => Err(format!("unknown role {role}")),
    };
    match r {
        Ok(()) => 0,
        Err(why) => {
            crate::say(&format!("FAIL {role}: {why}"));
            1
        }
    }
}

/// An epoll set with its registrations, the events its waiters saw, and a stop switch whose
/// eventfd (level-triggered, never read) wakes every waiter at the end.
pub struct Set {
    pub ep: OwnedFd,
    pub book: Arc<Book>,
    pub log: Arc<Log>,
    stop: Arc<AtomicBool>,
    stop_fd: OwnedFd,
    waiters: Vec<Waiter>,
}

pub const STOP_WORD: u64 = 0x5354_4f50_5354_4f50;

impl Set {
    pub fn new() -> Res<Set> {
        let ep = sys::epoll_create().ctx("epoll_create1")?;
        let book = Book::new();
        let stop_fd = sys::eventfd(libc::EFD_NONBLOCK).ctx("eventfd")?;
        book.add(
            ep.as_raw_fd(),
            stop_fd.as_raw_fd(),
            sys::IN,
            STOP_WORD,
            "stop",
        )
        .ctx("epoll_ctl ADD stop eventfd")?;
        Ok(Set {
            ep,
            book,
            log: Log::new(),
            stop: Arc::new(AtomicBool::new(false)),
            stop_fd,
            waiters: Vec::new(),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.ep.as_raw_fd()
    }

    /// Starts a waiter (`timeout_ms` -1: it sleeps until an event, as tokio's does).
    pub fn waiter(
        &mut self,
        max: usize,
        timeout_ms: i32,
        react: Arc<dyn Fn(&Seen) + Send + Sync>,
    ) -> i32 {
        let spec = WaitSpec {
            epfd: self.fd(),
            idx: self.waiters.len(),
            max,
            timeout_ms,
        };
        let w = Waiter::spawn(
            spec,
            self.book.clone(),
            self.log.clone(),
            self.stop.clone(),
            react,
        );
        let tid = w.tid;
        self.waiters.push(w);
        tid
    }

    pub fn add(&self, fd: RawFd, events: u32, data: u64, label: &str) -> Res<()> {
        self.book
            .add(self.fd(), fd, events, data, label)
            .ctx(&format!(
                "epoll_ctl ADD {label} (fd {fd}, {})",
                evname(events)
            ))
    }

    pub fn modify(&self, fd: RawFd, old: u64, events: u32, data: u64, label: &str) -> Res<()> {
        self.book
            .modify(self.fd(), fd, old, events, data, label)
            .ctx(&format!(
                "epoll_ctl MOD {label} (fd {fd}, {})",
                evname(events)
            ))
    }

    pub fn del(&self, fd: RawFd, data: u64, label: &str) -> Res<()> {
        self.book
            .del(self.fd(), fd, data)
            .ctx(&format!("epoll_ctl DEL {label} (fd {fd})"))
    }

    /// Events seen so far whose data word is `data`.
    pub fn count(&self, data: u64) -> usize {
        self.log
            .snapshot()
            .iter()
            .filter(|s| s.data == data && s.label != "stop")
            .count()
    }

    /// Waits for the event after the first `before` ones with data word `data`.
    pub fn next(&self, data: u64, before: usize, limit: Duration, what: &str) -> Res<Seen> {
        self.log
            .wait_for(limit, &format!("no event: {what}"), |v| {
                v.iter().filter(|s| s.data == data).count() > before
            })?;
        let v = self.log.snapshot();
        Ok(v.into_iter()
            .filter(|s| s.data == data)
            .nth(before)
            .expect("counted"))
    }

    /// Lets `dur` pass and checks that `data` still has exactly `want` events.
    pub fn quiet(&self, data: u64, want: usize, dur: Duration, what: &str) -> Res<()> {
        std::thread::sleep(dur);
        self.log.failure()?;
        let n = self.count(data);
        crate::ensure!(
            n == want,
            "{what}: {n} event(s) for data word {data:#x}, want exactly {want} (events: {})",
            self.describe(data)
        );
        Ok(())
    }

    /// The events seen for `data`, for messages.
    pub fn describe(&self, data: u64) -> String {
        let v: Vec<String> = self
            .log
            .snapshot()
            .iter()
            .filter(|s| s.data == data)
            .map(|s| format!("{}@w{}", evname(s.events), s.waiter))
            .collect();
        v.join(", ")
    }

    /// Stops and joins every waiter; then the waiters' first failure, if any.
    pub fn finish(&mut self) -> Res<()> {
        self.stop.store(true, SeqCst);
        sys::eventfd_add(self.stop_fd.as_raw_fd(), 1).ctx("write stop eventfd")?;
        let all_done = crate::util::wait_until(Duration::from_secs(5), "", || {
            Ok(self.waiters.iter().all(|w| w.is_finished()).then_some(()))
        });
        self.log.failure()?;
        if all_done.is_err() {
            let stuck = self.waiters.iter().filter(|w| !w.is_finished()).count();
            self.waiters.clear();
            return Err(format!(
                "{stuck} waiter(s) still in epoll_wait 5 s after the stop eventfd (a kernel fd, \
                 level-triggered) became readable: lost wake-up"
            ));
        }
        for w in self.waiters.drain(..) {
            w.join();
        }
        Ok(())
    }
}

impl Drop for Set {
    fn drop(&mut self) {
        if !self.waiters.is_empty() {
            let _ = self.finish();
        }
    }
}

/// A reaction that does nothing (the scenario looks at the log).
pub fn no_reaction() -> Arc<dyn Fn(&Seen) + Send + Sync> {
    Arc::new(|_| {})
}
