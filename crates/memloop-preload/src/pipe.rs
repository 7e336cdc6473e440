//! The pipe service (`memloop-pipe`, `memloop pipe serve`) from inside a program: what the C
//! functions `memloop_pipe*` do (exported by `hooks::pipe`, declared in
//! `crates/memloop-preload/include/memloop_pipe.h`), and `sendfile` handed to the service when the user asks for it
//! (`MEMLOOP_PIPE_SENDFILE=1`, `hooks::data`).
//!
//! **One client per process**, connected at first use to `MEMLOOP_PIPE_SOCKET`, else to the
//! region's socket (`<region file>.wake/pipe`, the rule of `memloop pipe serve`), as tenant
//! `MEMLOOP_PIPE_TENANT` (unset: the service names it after the process's control group) with
//! weight `MEMLOOP_PIPE_WEIGHT` (1). A service that cannot be reached is asked again at most
//! once per [`RETRY`]; a connection that breaks is replaced at the next submission. A fork
//! child never uses its parent's connection (nor its locks): the state is per process id, and
//! the child makes its own at its first call.
//!
//! **Completions.** Every thread waiting for a transfer waits on the one connection: one of
//! them at a time reads the socket (the *reader*), files each completion under its transfer,
//! and wakes the others ([`Proc::pump`]); the rest sleep on a condition variable. Completions
//! of transfers the program submitted itself (`memloop_pipe_submit`) go to a queue that
//! `memloop_pipe_complete` takes from; `memloop_pipe_fd` is an epoll set holding an eventfd
//! (one count per queued completion) and the connection's socket (a completion nobody has
//! read yet), so it polls readable whenever `memloop_pipe_complete` would find one — and,
//! briefly, when the socket holds only completions that a waiting thread is about to take.
//!
//! **Our descriptors.** The connection's socket, a duplicate of it that is polled without the
//! client's lock, the eventfd and the epoll set are ordinary descriptors of the program's. They
//! are marked the library's own (`table::K_OWN`): a program that closes one (`closefrom`, a
//! `dup2` over it) makes the library stop using that number — it is forgotten, never closed
//! again — and the connection counts as broken.
//!
//! **sendfile** ([`sendfile`]): a call on a kernel descriptor (ring connections keep their own
//! path) moving at least `MEMLOOP_PIPE_SENDFILE_MIN` bytes (64 KiB) is submitted with the
//! source offset the caller gave or the file's position, and waited for: the hook then stores
//! the new offset (or sets the position), as the kernel does. A non-blocking sink is waited
//! for at most `MEMLOOP_PIPE_NONBLOCK_WAIT_US` (2 ms); then the transfer is cancelled and the
//! completion of the cancel awaited, so nothing of it is in flight when the call returns — a
//! file → socket transfer holds no bytes between source and sink (`sendfile` straight into
//! the socket), and its `moved` is exactly what the socket took (a short count, as the
//! kernel's would be). (Should the service fall back from `sendfile` to splicing through a
//! pipe of its own, bytes it holds there are dropped by the cancel; the read being at an
//! explicit offset, the next call reads them again: the stream stays in order.) When the service cannot be reached, refuses or fails the transfer, or
//! cancels it before any byte moved, the kernel's own `sendfile` runs instead (which says
//! `EAGAIN` for a sink still full). Both are counted per process and logged at debug (the
//! preload's other counters live in the region's registry, whose layout this does not
//! change).

use crate::table;
use arc_swap::ArcSwapOption;
use libc::c_int;
use memloop_pipe::client::{Client, Completion};
use rustix::event::{epoll, eventfd, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How long a service that could not be reached is not asked again.
pub const RETRY: Duration = Duration::from_secs(1);
/// `MEMLOOP_PIPE_SENDFILE_MIN`'s default.
pub const SENDFILE_MIN: u64 = 64 << 10;
/// `MEMLOOP_PIPE_NONBLOCK_WAIT_US`'s default.
pub const NONBLOCK_WAIT: Duration = Duration::from_micros(2_000);
/// The errno of a transfer whose connection to the service broke before it completed (how
/// many of its bytes moved is not known).
pub const BROKEN: c_int = libc::ECONNABORTED;

// ---- settings -----------------------------------------------------------------------------

/// The `MEMLOOP_PIPE_*` settings, read once (as the process started, under the shim).
pub struct Settings {
    pub socket: PathBuf,
    pub tenant: Option<String>,
    pub weight: u16,
    /// `MEMLOOP_PIPE_SENDFILE=1`: large `sendfile` calls go to the service.
    pub sendfile: bool,
    pub sendfile_min: u64,
    pub nonblock_wait: Duration,
}

fn parsed<T: std::str::FromStr>(name: &str) -> Option<T> {
    let s = crate::real::setting(name)?;
    let v = s.trim().parse().ok();
    if v.is_none() {
        tracing::warn!(name, value = %s, "ignoring a setting that does not parse");
    }
    v
}

pub fn settings() -> &'static Settings {
    #[cfg(test)]
    if let Some(s) = tests::SETTINGS.get() {
        return s; // (the library's constructor read the environment before any test ran)
    }
    static S: OnceLock<Settings> = OnceLock::new();
    S.get_or_init(|| {
        let socket = crate::real::setting("MEMLOOP_PIPE_SOCKET")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                // `memloop_cli::pipe_cmd::socket_of`'s rule, for the engine's own region.
                memloop::region::wake_dir(&crate::engine::region().path()).join("pipe")
            });
        Settings {
            socket,
            tenant: crate::real::setting("MEMLOOP_PIPE_TENANT").filter(|t| !t.is_empty()),
            weight: parsed::<u16>("MEMLOOP_PIPE_WEIGHT")
                .unwrap_or(1)
                .clamp(1, 1000),
            // (MEMLOOP_DISABLE turns it off too, as under the shim, which then never loads us.)
            sendfile: crate::real::setting("MEMLOOP_PIPE_SENDFILE")
                .is_some_and(|v| !v.is_empty() && v != "0")
                && !crate::engine::disabled(),
            sendfile_min: parsed("MEMLOOP_PIPE_SENDFILE_MIN")
                .unwrap_or(SENDFILE_MIN)
                .max(1),
            nonblock_wait: parsed("MEMLOOP_PIPE_NONBLOCK_WAIT_US")
                .map_or(NONBLOCK_WAIT, Duration::from_micros),
        }
    })
}

/// Whether a `sendfile` of `count` bytes is for the service (the hook's fast-path test).
#[inline]
pub fn sendfile_wanted(count: usize) -> bool {
    let s = settings();
    s.sendfile && count as u64 >= s.sendfile_min
}

// ---- counters -----------------------------------------------------------------------------

static ROUTED: AtomicU64 = AtomicU64::new(0);
static ROUTED_BYTES: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// A `sendfile` the service made (`moved` bytes): counted, logged (debug: the first, and
/// every 1024th; trace: each).
fn routed(moved: u64) {
    let n = ROUTED.fetch_add(1, Relaxed) + 1;
    let bytes = ROUTED_BYTES.fetch_add(moved, Relaxed) + moved;
    if n == 1 || n % 1024 == 0 {
        tracing::debug!(calls = n, bytes, "sendfile through the pipe service");
    } else {
        tracing::trace!(calls = n, bytes, "sendfile through the pipe service");
    }
}

/// A `sendfile` the kernel made instead: counted, logged (debug).
fn fell_back(why: &str, errno: c_int) {
    let n = FALLBACKS.fetch_add(1, Relaxed) + 1;
    tracing::debug!(
        why,
        errno,
        fallbacks = n,
        routed = ROUTED.load(Relaxed),
        "sendfile: the kernel's (pipe service fallback)"
    );
}

// ---- our descriptors ----------------------------------------------------------------------

/// A descriptor of the library's in the program's table, marked `K_OWN`: once the program
/// closes that number it is never touched again (forgotten, not closed).
struct OwnFd(Option<OwnedFd>);

/// Whether the number `fd` is still ours (numbers past the table cannot be marked: assumed).
fn still_own(fd: c_int) -> bool {
    fd as usize >= table::MAX_FD || table::kind(fd) == table::K_OWN
}

impl OwnFd {
    fn new(fd: OwnedFd) -> OwnFd {
        table::mark_own(fd.as_raw_fd());
        OwnFd(Some(fd))
    }

    fn raw(&self) -> c_int {
        self.0.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    fn get(&self) -> Result<BorrowedFd<'_>, c_int> {
        match &self.0 {
            Some(f) if still_own(f.as_raw_fd()) => Ok(f.as_fd()),
            _ => Err(libc::EBADF),
        }
    }
}

impl Drop for OwnFd {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            let fd = f.as_raw_fd();
            if still_own(fd) {
                table::unmark_own(fd);
                drop(f);
            } else {
                std::mem::forget(f); // the program's number now
            }
        }
    }
}

// ---- one connection -----------------------------------------------------------------------

/// A transfer's completion, as the C functions report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    pub moved: u64,
    /// 0, or why the transfer stopped.
    pub errno: c_int,
}

impl Done {
    fn of(c: &Completion) -> Done {
        Done {
            moved: c.moved,
            errno: c.result.as_ref().err().map_or(0, |e| e.errno()),
        }
    }
}

/// A connection to the service.
struct Conn {
    gen: u64,
    /// `None` once dropped or forgotten.
    client: Mutex<Option<Client>>,
    /// The client's socket's number (ours, `K_OWN`).
    sock: c_int,
    /// A duplicate of the socket, polled without the client's lock.
    watch: OwnFd,
    /// 0, or why the connection is unusable.
    broken: AtomicI32,
}

impl Conn {
    fn lock(&self) -> MutexGuard<'_, Option<Client>> {
        self.client.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn broken(&self) -> c_int {
        let b = self.broken.load(Relaxed);
        if b == 0 && (!still_own(self.sock) || self.watch.get().is_err()) {
            return libc::EBADF; // the program closed one of our numbers
        }
        b
    }

    fn set_broken(&self, e: c_int) {
        let _ = self.broken.compare_exchange(0, e.max(1), Relaxed, Relaxed);
    }

    /// Waits up to `timeout` (`None`: forever) for the socket to be readable, then reads every
    /// completion there without waiting.
    fn read(&self, timeout: Option<Duration>) -> Read {
        let Ok(watch) = self.watch.get() else {
            return Read::Broken(Vec::new(), libc::EBADF);
        };
        let ts = timeout.map(|t| Timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        let mut fds = [PollFd::from_borrowed_fd(watch, PollFlags::IN)];
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(0) => return Read::Got(Vec::new()),
            Ok(_) => {}
            Err(Errno::INTR) => return Read::Interrupted,
            Err(e) => return Read::Broken(Vec::new(), e.raw_os_error()),
        }
        let mut got = Vec::new();
        let mut client = self.lock();
        let Some(c) = client.as_mut().filter(|_| still_own(self.sock)) else {
            return Read::Broken(got, libc::EBADF);
        };
        loop {
            match c.completion(false) {
                Ok(Some(done)) => got.push(done),
                Ok(None) => return Read::Got(got),
                Err(e) => {
                    tracing::debug!("pipe service connection: {e}");
                    return Read::Broken(got, BROKEN);
                }
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let client = self
            .client
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if still_own(self.sock) {
            table::unmark_own(self.sock);
            drop(client);
        } else {
            std::mem::forget(client); // its socket's number is the program's now
        }
    }
}

enum Read {
    Got(Vec<Completion>),
    Interrupted,
    /// What was read before the connection broke, and why.
    Broken(Vec<Completion>, c_int),
}

// ---- the process's client -----------------------------------------------------------------

/// `memloop_pipe_fd`'s epoll set and the eventfd in it.
struct Notify {
    /// One count per completion in `Book::user_done` (a semaphore eventfd).
    ready: OwnFd,
    set: OwnFd,
}

#[derive(Default)]
struct Book {
    conn: Option<Arc<Conn>>,
    gens: u64,
    /// When the service could last not be reached, and why.
    down: Option<(Instant, c_int)>,
    notify: Option<Arc<Notify>>,
    /// Transfers the program submitted, not completed yet: (connection, wire id) → its id.
    user: HashMap<(u64, u64), i64>,
    user_key: HashMap<i64, (u64, u64)>,
    next_user: i64,
    /// Their completions, for `memloop_pipe_complete`.
    user_done: VecDeque<(i64, Done)>,
    /// Completions of the transfers the library waits for itself.
    done: HashMap<(u64, u64), Done>,
    /// A thread is reading the socket.
    reader: bool,
}

/// The pipe client of one process.
pub struct Proc {
    pid: u32,
    book: Mutex<Book>,
    cv: Condvar,
    /// One handshake at a time.
    connecting: Mutex<()>,
}

/// How a wait ended.
enum Waited<R> {
    Got(R),
    TimedOut,
    Interrupted,
}

static PROC: ArcSwapOption<Proc> = ArcSwapOption::const_empty();

/// This process's client (a fork child makes its own: the parent's connection and locks are
/// never used there).
pub fn this_process() -> Arc<Proc> {
    let pid = std::process::id();
    loop {
        let cur = PROC.load_full();
        if let Some(p) = cur.as_ref().filter(|p| p.pid == pid) {
            return p.clone();
        }
        let fresh = Arc::new(Proc {
            pid,
            book: Mutex::new(Book {
                next_user: 1,
                ..Book::default()
            }),
            cv: Condvar::new(),
            connecting: Mutex::new(()),
        });
        let prev = PROC.compare_and_swap(&cur, Some(fresh.clone()));
        let replaced = match (&*prev, &cur) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        drop(prev);
        if replaced {
            if let Some(parents) = cur {
                // A fork parent's: closed here if nothing else refers to it (the child's
                // copies of its descriptors), else left alone for good — a thread of the
                // parent was inside it at the fork, and may have held its locks.
                match Arc::try_unwrap(parents) {
                    Ok(p) => drop(p),
                    Err(p) => std::mem::forget(p),
                }
            }
            tracing::debug!(pid, "pipe client for this process");
            return fresh;
        }
    }
}

impl Proc {
    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live connection, connecting if there is none (at most once per [`RETRY`] after a
    /// failure).
    fn conn(&self) -> Result<Arc<Conn>, c_int> {
        let usable = |b: &Book| -> Option<Result<Arc<Conn>, c_int>> {
            if let Some(c) = b.conn.as_ref().filter(|c| c.broken() == 0) {
                return Some(Ok(c.clone()));
            }
            match b.down {
                Some((at, e)) if at.elapsed() < RETRY => Some(Err(e)),
                _ => None,
            }
        };
        if let Some(r) = usable(&self.lock()) {
            return r;
        }
        let _one = self.connecting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = usable(&self.lock()) {
            return r;
        }
        let s = settings();
        let client = match Client::connect(&s.socket, s.tenant.as_deref(), s.weight) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(socket = %s.socket.display(), "no pipe service: {e}");
                let errno = e.errno();
                self.lock().down = Some((Instant::now(), errno));
                return Err(errno);
            }
        };
        let watch = client
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EMFILE))?;
        let sock = client.as_fd().as_raw_fd();
        table::mark_own(sock);
        tracing::debug!(socket = %s.socket.display(), tenant = client.tenant().0, "pipe service connected");
        let mut book = self.lock();
        if let Some(old) = book.conn.take() {
            let e = old.broken();
            self.break_conn(&mut book, &old, e);
        }
        book.gens += 1;
        let conn = Arc::new(Conn {
            gen: book.gens,
            client: Mutex::new(Some(client)),
            sock,
            watch: OwnFd::new(watch),
            broken: AtomicI32::new(0),
        });
        if let Some(n) = &book.notify {
            add_watch(n, &conn);
        }
        book.down = None;
        book.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Sends a submission on the live connection (on a fresh one once, if the service's end
    /// of it turns out gone): the connection and the transfer's wire id.
    fn submit(
        &self,
        src: BorrowedFd<'_>,
        dst: BorrowedFd<'_>,
        len: Option<u64>,
        src_off: Option<u64>,
    ) -> Result<(Arc<Conn>, u64), c_int> {
        let mut tries = 0;
        loop {
            tries += 1;
            let conn = self.conn()?;
            let r = {
                let mut client = conn.lock();
                match client.as_mut() {
                    Some(c) if conn.broken() == 0 => Some(c.submit_at(src, dst, len, src_off)),
                    _ => None, // (the program closed one of its numbers meanwhile)
                }
            };
            let Some(r) = r else {
                if tries >= 2 {
                    return Err(libc::EBADF);
                }
                continue;
            };
            match r {
                Ok(id) => return Ok((conn, id)),
                Err(memloop_pipe::PipeError::Io(e)) => {
                    // (A packet is sent whole or not at all: nothing was submitted.)
                    let errno = e.raw_os_error().unwrap_or(libc::EIO);
                    tracing::debug!(errno, "pipe service connection broken at a submission");
                    self.break_conn(&mut self.lock(), &conn, BROKEN);
                    self.cv.notify_all();
                    if tries >= 2 {
                        return Err(errno);
                    }
                }
                Err(e) => return Err(e.errno()),
            }
        }
    }

    /// The connection is unusable: the program's transfers on it end with [`BROKEN`] (their
    /// bytes moved unknown: 0 is reported), waiters for the library's own see it broken.
    fn break_conn(&self, book: &mut Book, conn: &Conn, e: c_int) {
        conn.set_broken(e);
        // (Out of `memloop_pipe_fd`'s set: a hung-up socket would poll readable for good.)
        if let Some(n) = &book.notify {
            if let (Ok(set), Ok(w)) = (n.set.get(), conn.watch.get()) {
                let _ = epoll::delete(set, w);
            }
        }
        let gone: Vec<((u64, u64), i64)> = book
            .user
            .iter()
            .filter(|((g, _), _)| *g == conn.gen)
            .map(|(&k, &u)| (k, u))
            .collect();
        for (k, u) in gone {
            book.user.remove(&k);
            book.user_key.remove(&u);
            self.queue_user(
                book,
                u,
                Done {
                    moved: 0,
                    errno: BROKEN,
                },
            );
        }
    }

    fn queue_user(&self, book: &mut Book, id: i64, d: Done) {
        book.user_done.push_back((id, d));
        if let Some(n) = &book.notify {
            if let Ok(r) = n.ready.get() {
                let _ = rustix::io::write(r, &1u64.to_ne_bytes());
            }
        }
    }

    fn file(&self, book: &mut Book, conn: &Conn, c: Completion) {
        let key = (conn.gen, c.id);
        let d = Done::of(&c);
        match book.user.remove(&key) {
            Some(u) => {
                book.user_key.remove(&u);
                self.queue_user(book, u, d);
            }
            None => {
                book.done.insert(key, d);
            }
        }
    }

    /// Waits until `until` finds what it looks for in the book, reading the connection's
    /// socket while no other thread does. `deadline`: `None` waits for good, a time already
    /// past looks once. `interruptible`: a signal ends the wait of the reading thread
    /// (`Waited::Interrupted`; threads asleep on the condition variable are not interrupted).
    /// `Err`: the connection broke first.
    fn pump<R>(
        &self,
        conn: &Conn,
        mut until: impl FnMut(&mut Book) -> Option<R>,
        deadline: Option<Instant>,
        interruptible: bool,
    ) -> Result<Waited<R>, c_int> {
        let mut book = self.lock();
        let mut looked = false;
        loop {
            if let Some(r) = until(&mut book) {
                return Ok(Waited::Got(r));
            }
            let e = conn.broken();
            if e != 0 {
                return Err(e);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) && (looked || book.reader) {
                return Ok(Waited::TimedOut);
            }
            if book.reader {
                book = match left {
                    None => self.cv.wait(book).unwrap_or_else(|p| p.into_inner()),
                    Some(l) => {
                        self.cv
                            .wait_timeout(book, l)
                            .unwrap_or_else(|p| p.into_inner())
                            .0
                    }
                };
                continue;
            }
            book.reader = true;
            drop(book);
            let r = conn.read(left);
            looked = true;
            book = self.lock();
            book.reader = false;
            let interrupted = match r {
                Read::Got(list) => {
                    for c in list {
                        self.file(&mut book, conn, c);
                    }
                    false
                }
                Read::Interrupted => true,
                Read::Broken(list, e) => {
                    for c in list {
                        self.file(&mut book, conn, c);
                    }
                    self.break_conn(&mut book, conn, e);
                    false
                }
            };
            self.cv.notify_all();
            if interrupted && interruptible {
                return Ok(until(&mut book).map_or(Waited::Interrupted, Waited::Got));
            }
        }
    }

    /// Waits for the library's own transfer `id` on `conn`.
    fn wait(
        &self,
        conn: &Conn,
        id: u64,
        deadline: Option<Instant>,
        interruptible: bool,
    ) -> Result<Waited<Done>, c_int> {
        let key = (conn.gen, id);
        self.pump(conn, |b| b.done.remove(&key), deadline, interruptible)
    }

    fn cancel_wire(&self, conn: &Conn, id: u64) -> Result<(), c_int> {
        let mut client = conn.lock();
        match client.as_mut() {
            Some(c) => c.cancel(id).map_err(|e| e.errno()),
            None => Err(libc::EBADF),
        }
    }

    /// `memloop_pipe_fd`'s set, made at first use.
    fn notify(&self) -> Result<Arc<Notify>, c_int> {
        let mut book = self.lock();
        if let Some(n) = &book.notify {
            return Ok(n.clone());
        }
        let errno = |e: Errno| e.raw_os_error();
        let ready = eventfd(
            0,
            EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK | EventfdFlags::SEMAPHORE,
        )
        .map_err(errno)?;
        let set = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(errno)?;
        epoll::add(
            &set,
            &ready,
            epoll::EventData::new_u64(0),
            epoll::EventFlags::IN,
        )
        .map_err(errno)?;
        let n = Arc::new(Notify {
            ready: OwnFd::new(ready),
            set: OwnFd::new(set),
        });
        if !book.user_done.is_empty() {
            let _ = rustix::io::write(n.ready.get()?, &(book.user_done.len() as u64).to_ne_bytes());
        }
        if let Some(c) = book.conn.as_ref().filter(|c| c.broken() == 0) {
            add_watch(&n, c);
        }
        book.notify = Some(n.clone());
        Ok(n)
    }
}

fn add_watch(n: &Notify, c: &Conn) {
    if let (Ok(set), Ok(w)) = (n.set.get(), c.watch.get()) {
        let _ = epoll::add(set, w, epoll::EventData::new_u64(1), epoll::EventFlags::IN);
    }
}

// ---- the C functions' logic -----------------------------------------------------------------

/// `memloop_pipe`: moves `len` bytes (0: until the source ends) and waits. The bytes moved,
/// or an errno — also when the transfer failed part way (the count is then lost: the
/// non-blocking functions report both).
pub fn pipe(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, len: u64) -> Result<u64, c_int> {
    let p = this_process();
    let (conn, id) = p.submit(src, dst, (len > 0).then_some(len), None)?;
    match p.wait(&conn, id, None, false)? {
        Waited::Got(d) if d.errno == 0 => Ok(d.moved),
        Waited::Got(d) => Err(d.errno),
        Waited::TimedOut | Waited::Interrupted => Err(libc::EIO), // (not for an endless wait)
    }
}

/// `memloop_pipe_submit`: the transfer's id (> 0).
pub fn submit(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, len: u64) -> Result<i64, c_int> {
    let p = this_process();
    // (Made now: a completion counted before the set exists would be counted again.)
    p.notify()?;
    let (conn, wire) = p.submit(src, dst, (len > 0).then_some(len), None)?;
    let mut book = p.lock();
    let id = book.next_user;
    book.next_user += 1;
    let key = (conn.gen, wire);
    // Its completion may have been read already (filed as one of the library's own).
    match book.done.remove(&key) {
        Some(d) => p.queue_user(&mut book, id, d),
        None if conn.broken() != 0 => p.queue_user(
            &mut book,
            id,
            Done {
                moved: 0,
                errno: BROKEN,
            },
        ),
        None => {
            book.user.insert(key, id);
            book.user_key.insert(id, key);
        }
    }
    Ok(id)
}

/// `memloop_pipe_fd`: the descriptor that polls readable when a completion waits.
pub fn notify_fd() -> Result<c_int, c_int> {
    let n = this_process().notify()?;
    n.set.get()?;
    Ok(n.set.raw())
}

/// `memloop_pipe_complete`: the next completion of a transfer the program submitted
/// (`Err(EAGAIN)`: none yet; `Err(ENOENT)`: none will come, nothing is in flight).
pub fn complete(wait: bool) -> Result<(i64, Done), c_int> {
    let p = this_process();
    let take = |b: &mut Book| -> Option<Result<(i64, Done), c_int>> {
        if let Some(x) = b.user_done.pop_front() {
            if let Some(n) = &b.notify {
                if let Ok(r) = n.ready.get() {
                    let mut eight = [0u8; 8];
                    let _ = rustix::io::read(r, &mut eight);
                }
            }
            return Some(Ok(x));
        }
        b.user.is_empty().then_some(Err(libc::ENOENT))
    };
    let conn = {
        let mut book = p.lock();
        if let Some(r) = take(&mut book) {
            return r;
        }
        match book.conn.clone() {
            Some(c) => c,
            None => return Err(libc::ENOENT),
        }
    };
    let deadline = (!wait).then(Instant::now);
    match p.pump(&conn, take, deadline, false) {
        Ok(Waited::Got(r)) => r,
        Ok(_) => Err(libc::EAGAIN),
        // (Broken: its transfers were queued as failed; one of them is next.)
        Err(_) => take(&mut p.lock()).unwrap_or(Err(libc::ENOENT)),
    }
}

/// `memloop_pipe_cancel`: asks the service to stop transfer `id` (its completion still
/// comes: `ECANCELED`, or how it ended if it was done already).
pub fn cancel(id: i64) -> Result<(), c_int> {
    let p = this_process();
    let (conn, wire) = {
        let book = p.lock();
        let Some(&(gen, wire)) = book.user_key.get(&id) else {
            return Err(libc::ENOENT);
        };
        match book.conn.clone().filter(|c| c.gen == gen) {
            Some(c) => (c, wire),
            None => return Err(libc::ENOENT),
        }
    };
    p.cancel_wire(&conn, wire)
}

// ---- sendfile -------------------------------------------------------------------------------

/// What a `sendfile` handed to the service came to.
pub enum Sent {
    /// Bytes moved: the offset (or position) advances by that much.
    Moved(u64),
    /// Nothing moved, and this is the call's error (`EINTR` for a signal, `EIO` when the
    /// connection broke with the transfer in flight).
    Failed(c_int),
    /// The service did not do it, and nothing moved: the kernel's `sendfile` instead.
    Kernel,
}

/// `sendfile(out, inp, &off, count)` by the service: `inp` is a regular file read from `off`
/// (its position is not touched); `nonblock`: `out` is `O_NONBLOCK`. The count is cut to what
/// the file holds from `off` (as the kernel's call stops at its end): less than
/// `MEMLOOP_PIPE_SENDFILE_MIN` left is the kernel's to move.
pub fn sendfile(
    out: BorrowedFd<'_>,
    inp: BorrowedFd<'_>,
    off: u64,
    count: u64,
    nonblock: bool,
) -> Sent {
    let s = settings();
    let size = match rustix::fs::fstat(inp) {
        Ok(st) if rustix::fs::FileType::from_raw_mode(st.st_mode).is_file() => st.st_size as u64,
        _ => return Sent::Kernel,
    };
    let count = count.min(size.saturating_sub(off));
    if count < s.sendfile_min {
        return Sent::Kernel;
    }
    let p = this_process();
    let (conn, id) = match p.submit(inp, out, Some(count), Some(off)) {
        Ok(x) => x,
        Err(e) => {
            fell_back("no pipe service", e);
            return Sent::Kernel;
        }
    };
    let deadline = nonblock.then(|| Instant::now() + s.nonblock_wait);
    let mut interrupted = false;
    let done = loop {
        match p.wait(&conn, id, deadline, !nonblock) {
            Ok(Waited::Got(d)) => break d,
            Ok(Waited::Interrupted) if crate::real::signals_restart() => continue,
            Ok(w) => {
                // Out of time (non-blocking), or a signal: stop it and wait for the stop,
                // so nothing of it is in flight when the call returns.
                interrupted = matches!(w, Waited::Interrupted);
                if let Err(e) = p.cancel_wire(&conn, id) {
                    tracing::debug!(errno = e, "sendfile: cancelling at the pipe service");
                }
                match p.wait(&conn, id, None, false) {
                    Ok(Waited::Got(d)) => break d,
                    _ => return Sent::Failed(libc::EIO),
                }
            }
            // Broken with the transfer in flight: how much of it went is not known.
            Err(e) => {
                tracing::debug!(
                    errno = e,
                    "sendfile: pipe service connection lost mid-transfer"
                );
                return Sent::Failed(libc::EIO);
            }
        }
    };
    if done.moved > 0 {
        routed(done.moved);
        return Sent::Moved(done.moved);
    }
    match done.errno {
        libc::ECANCELED if interrupted => Sent::Failed(libc::EINTR),
        // Not started in time (the service busy with others: a sink that is writable must
        // not see EAGAIN), or refused, or failed: the kernel's call answers.
        libc::ECANCELED => {
            fell_back("not done in time", libc::ECANCELED);
            Sent::Kernel
        }
        e => {
            fell_back("the pipe service moved nothing", e);
            Sent::Kernel
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memloop_pipe::service::{Config, Service};
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::AtomicUsize;

    /// The settings of these tests (`settings()` returns them once set).
    pub static SETTINGS: OnceLock<Settings> = OnceLock::new();

    /// A service in this test process, on the socket the settings name (one for the whole
    /// binary).
    fn service() -> &'static Mutex<Service> {
        static S: OnceLock<Mutex<Service>> = OnceLock::new();
        S.get_or_init(|| {
            let path = std::env::temp_dir()
                .join(format!("memloop-preload-pipe-unit-{}", std::process::id()));
            let _ = SETTINGS.set(Settings {
                socket: path.clone(),
                tenant: Some("unit".into()),
                weight: 2,
                sendfile: true,
                sendfile_min: SENDFILE_MIN,
                // (Long enough for the service to start the transfer on a loaded machine:
                // one not started in time goes to the kernel, which this test tells apart.)
                nonblock_wait: Duration::from_millis(200),
            });
            assert_eq!(settings().socket, path);
            Mutex::new(Service::start(Config::new(path)).expect("a pipe service"))
        })
    }

    fn stats() -> serde_json::Value {
        let svc = service().lock().unwrap();
        serde_json::from_str(&svc.stats_json()).unwrap()
    }

    fn data(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 16) as u8
            })
            .collect()
    }

    fn file_of(bytes: &[u8]) -> std::fs::File {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "memloop-preload-pipe-unit-{}-{}",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        std::fs::write(&p, bytes).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }

    /// What `sock` reads until its end, on a thread.
    fn reader(mut sock: UnixStream) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            sock.read_to_end(&mut v).unwrap();
            v
        })
    }

    /// One test, its parts in order: they share the process's client.
    #[test]
    fn waits_completions_cancels_and_a_nonblocking_sendfile() {
        service();
        let want = data((1 << 20) + 333, 5);

        // Nothing submitted: none will come.
        assert_eq!(complete(false).err(), Some(libc::ENOENT));
        assert_eq!(complete(true).err(), Some(libc::ENOENT));
        assert_eq!(cancel(12345).err(), Some(libc::ENOENT));

        // Threads waiting at once, blocking (`pipe`) and not (`submit` + `complete`): each
        // completion reaches the thread it belongs to.
        let mut threads = Vec::new();
        for t in 0..6 {
            let want = want.clone();
            threads.push(std::thread::spawn(move || {
                for _ in 0..4 {
                    let f = file_of(&want);
                    let (a, b) = UnixStream::pair().unwrap();
                    let r = reader(b);
                    assert_eq!(pipe(f.as_fd(), a.as_fd(), 0), Ok(want.len() as u64), "{t}");
                    drop(a);
                    assert!(r.join().unwrap() == want, "thread {t}: the bytes");
                }
            }));
        }
        let mut takers = Vec::new();
        for t in 0..2 {
            let want = want.clone();
            takers.push(std::thread::spawn(move || {
                let mut ids = Vec::new();
                let mut readers = Vec::new();
                for _ in 0..3 {
                    let f = file_of(&want);
                    let (a, b) = UnixStream::pair().unwrap();
                    readers.push(reader(b));
                    ids.push(submit(f.as_fd(), a.as_fd(), want.len() as u64).unwrap());
                }
                let mut got = Vec::new();
                for _ in 0..3 {
                    let (id, d) = complete(true).unwrap_or_else(|e| panic!("taker {t}: {e}"));
                    assert_eq!(
                        d,
                        Done {
                            moved: want.len() as u64,
                            errno: 0
                        },
                        "{id}"
                    );
                    got.push(id);
                }
                for r in readers {
                    assert!(r.join().unwrap() == want, "taker {t}: the bytes");
                }
                (ids, got)
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        let (mut submitted, mut completed) = (Vec::new(), Vec::new());
        for t in takers {
            let (s, c) = t.join().unwrap();
            submitted.extend(s);
            completed.extend(c);
        }
        submitted.sort();
        completed.sort();
        assert_eq!(
            submitted, completed,
            "every submitted transfer completed once"
        );
        assert_eq!(complete(false).err(), Some(libc::ENOENT));

        // Cancelled while waiting for its source: "none yet", then its own ECANCELED.
        let (r, _w) = rustix::pipe::pipe().unwrap();
        let null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        let id = submit(r.as_fd(), null.as_fd(), 0).unwrap();
        assert_eq!(complete(false).err(), Some(libc::EAGAIN));
        let set = notify_fd().unwrap();
        assert!(table::kind(set) == table::K_OWN || set as usize >= table::MAX_FD);
        cancel(id).unwrap();
        assert_eq!(
            complete(true),
            Ok((
                id,
                Done {
                    moved: 0,
                    errno: libc::ECANCELED
                }
            ))
        );

        // A non-blocking sink nobody reads: a short count, stopped in time, nothing left in
        // flight, the bytes those of the file from the offset on.
        let big = data(8 << 20, 9);
        let f = file_of(&big);
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let t0 = Instant::now();
        let n = match sendfile(a.as_fd(), f.as_fd(), 1000, 4 << 20, true) {
            Sent::Moved(n) => n,
            Sent::Failed(e) => panic!("failed: {e}"),
            Sent::Kernel => panic!("not done by the service"),
        };
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert!(n > 0 && n < 4 << 20, "{n}");
        assert_eq!(stats()["transfers"], 0, "nothing in flight after the call");
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        assert!(got == big[1000..1000 + n as usize], "{} bytes", got.len());
        assert_eq!(rustix::fs::tell(&f).unwrap(), 0, "the file position");

        // Less than the threshold left in the file: the kernel's.
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(matches!(
            sendfile(a.as_fd(), f.as_fd(), big.len() as u64 - 10, 1 << 20, false),
            Sent::Kernel
        ));
    }
}
