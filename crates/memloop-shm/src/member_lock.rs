//! Liveness without a thread: an open-file-description (OFD) lock on one byte of the region
//! file, held for as long as a member lives.
//!
//! The kernel drops an OFD lock when the last fd of its open file description closes, which a
//! process's death (SIGKILL included) does. Any process of the same kernel that can open the
//! file can ask whether the byte is locked (`F_OFD_GETLK`), whatever pid namespace it runs in
//! — containers sharing a region included — so a member proven alive this way needs no
//! heartbeat thread. The lock's fd is close-on-exec, sits high in the fd table (out of the way
//! of programs that want low numbers), and is closed in every fork child (a child inheriting
//! it would keep its parent "alive" after the parent died).
//!
//! The locked bytes lie far beyond the end of the file (locks need no data there).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::AcqRel, Ordering::Acquire};

/// Where members' bytes start: beyond any region size.
pub const LOCK_BASE: u64 = 1 << 48;

/// The process's lock fds, so a fork child can close its copies: `gen << 32 | (fd + 1)`, the
/// low half 0 when the slot is empty. The generation tells a stale handle (copied by fork)
/// from the slot's next user.
static SLOTS: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];
static AT_FORK: std::sync::Once = std::sync::Once::new();

/// A held lock on byte `LOCK_BASE + index` of a file; released when dropped (or when the
/// process ends, or in a fork child at once).
#[derive(Debug)]
pub struct MemberLock {
    slot: usize,
    word: u64,
}

impl MemberLock {
    /// Opens `path` on its own file description and locks byte `index` exclusively, without
    /// waiting. `WouldBlock`: another description holds it (a process that has not let go of
    /// an earlier member in that slot). `fd_floor`: the lowest number the fd may take.
    pub fn take(path: &Path, index: u64, fd_floor: RawFd) -> io::Result<MemberLock> {
        register_fork_handler();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let file = move_up(file, fd_floor);
        set_lock(file.as_raw_fd(), libc::F_WRLCK as i16, index)?;
        let fd = file.into_raw_fd();
        for (slot, w) in SLOTS.iter().enumerate() {
            let cur = w.load(Acquire);
            if cur as u32 != 0 {
                continue;
            }
            let word = (cur >> 32).wrapping_add(1) << 32 | (fd as u32 as u64 + 1);
            if w.compare_exchange(cur, word, AcqRel, Acquire).is_ok() {
                return Ok(MemberLock { slot, word });
            }
        }
        // SAFETY: `fd` was just released from `file` and is owned by nobody else.
        drop(unsafe { File::from_raw_fd(fd) });
        Err(io::Error::other("too many member locks in one process"))
    }

    /// The lock's fd while it is held here (not in a fork child).
    pub fn fd(&self) -> Option<RawFd> {
        (SLOTS[self.slot].load(Acquire) == self.word).then(|| (self.word as u32 - 1) as RawFd)
    }
}

impl Drop for MemberLock {
    fn drop(&mut self) {
        let next = ((self.word >> 32) + 1) << 32;
        if SLOTS[self.slot]
            .compare_exchange(self.word, next, AcqRel, Acquire)
            .is_ok()
        {
            close_raw((self.word as u32 - 1) as RawFd);
        }
    }
}

/// Closes by system call, not through the C library's `close`: in a process running the
/// transparent layer that is its own hook, which takes the closing of this fd for the
/// program's (and in a fork child would depend on the order of the fork handlers).
fn close_raw(fd: RawFd) {
    // SAFETY: close takes no pointers; the fd is ours and nothing else uses it.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

/// Is byte `index` of `file` locked by any open file description but `file`'s own? Errors
/// (a file system without locks) prove nothing either way.
pub fn held(file: &File, index: u64) -> io::Result<bool> {
    let mut fl = flock(libc::F_WRLCK as i16, index);
    // SAFETY: `fl` is a valid flock for F_OFD_GETLK, which only writes into it.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as i16)
}

fn flock(kind: i16, index: u64) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value (l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = (LOCK_BASE + index) as libc::off_t;
    fl.l_len = 1;
    fl
}

fn set_lock(fd: RawFd, kind: i16, index: u64) -> io::Result<()> {
    let fl = flock(kind, index);
    // SAFETY: `fl` is a valid flock; F_OFD_SETLK only reads it.
    match unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The fd moved to `floor` or above (close-on-exec); the same file if it cannot move.
fn move_up(file: File, floor: RawFd) -> File {
    if file.as_raw_fd() >= floor {
        return file;
    }
    // SAFETY: F_DUPFD_CLOEXEC on an fd we own returns a new fd or -1.
    match unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor) } {
        // SAFETY: a fresh fd from the kernel, owned by nobody else.
        fd if fd >= 0 => unsafe { File::from_raw_fd(fd) },
        _ => file,
    }
}

/// Highest floor for a library's own fds. Every `fork` copies the fd table up to the highest
/// open fd, and a table that large is allocated and freed as virtual memory: one fd at 10,000
/// made `fork` + `exit` 2.4× dearer here (`memloop bench process`).
const FLOOR_MAX: usize = 256;

/// The lowest fd number for a library's own fds: half the soft fd limit, at most
/// [`FLOOR_MAX`], within `max` (programs get numbers lowest-first, and some expect to own the
/// low ones).
pub fn private_fd_floor(max: usize) -> RawFd {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit to fill.
    let soft = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } {
        0 => lim.rlim_cur as usize,
        _ => 1024,
    };
    (soft / 2).min(FLOOR_MAX).clamp(64, max.saturating_sub(1)) as RawFd
}

/// The caller runs the fork child's work itself ([`close_in_child`] or
/// [`forget_closed_in_child`]): no handler of our own is registered. For a library whose fork
/// handlers are run by another (the preload shim), which may put a child's work off.
pub fn child_handled_by_caller() {
    AT_FORK.call_once(|| {});
}

/// The fds of the locks held now (a fork child must close its copies).
pub fn held_fds() -> Vec<RawFd> {
    SLOTS
        .iter()
        .map(|w| w.load(Acquire) as u32)
        .filter(|&low| low != 0)
        .map(|low| (low - 1) as RawFd)
        .collect()
}

fn register_fork_handler() {
    AT_FORK.call_once(|| {
        // SAFETY: registers a plain extern "C" function; no prepare or parent handler.
        unsafe { libc::pthread_atfork(None, None, Some(child_handler)) };
    });
}

extern "C" fn child_handler() {
    close_in_child();
}

/// In a fork child: the parent's locks are the parent's. Loads only, unless a lock is held
/// (a write would cost the child a copy-on-write fault).
pub fn close_in_child() {
    forget_in_child(true);
}

/// [`close_in_child`] for a child whose copies of [`held_fds`] were closed already.
pub fn forget_closed_in_child() {
    forget_in_child(false);
}

fn forget_in_child(close: bool) {
    for w in &SLOTS {
        let cur = w.load(Acquire);
        if cur as u32 != 0 {
            w.store(
                ((cur >> 32) + 1) << 32,
                std::sync::atomic::Ordering::Release,
            );
            if close {
                // (A copy the child inherited, which nothing else uses.)
                close_raw((cur as u32 - 1) as RawFd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests fork: a child holds copies of every fd until its handler closes them, so a
    /// test must not look at a lock while another test's fork is under way.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn scratch(tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("memloop-lock-{tag}-{}", std::process::id()));
        std::fs::write(&p, b"x").unwrap();
        p
    }

    #[test]
    fn a_lock_is_seen_by_other_descriptions_and_goes_with_its_holder() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let p = scratch("seen");
        let probe = File::open(&p).unwrap();
        let l = MemberLock::take(&p, 3, 0).unwrap();
        assert!(held(&probe, 3).unwrap());
        assert!(!held(&probe, 4).unwrap());
        let again = MemberLock::take(&p, 3, 0).unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::WouldBlock);
        drop(l);
        assert!(!held(&probe, 3).unwrap());
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn the_fd_sits_at_or_above_the_floor() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let p = scratch("floor");
        let floor = private_fd_floor(1 << 16);
        let l = MemberLock::take(&p, 0, floor).unwrap();
        assert!(l.fd().unwrap() >= floor);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn a_fork_child_does_not_keep_its_parents_lock() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let p = scratch("fork");
        let probe = File::open(&p).unwrap();
        let l = MemberLock::take(&p, 7, 0).unwrap();
        let mut ends = [0; 2];
        // SAFETY: `ends` has room for the two fds.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        // SAFETY: the child only writes, sleeps and exits (async-signal-safe calls).
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: async-signal-safe calls only; the fork handlers have run by now.
            unsafe {
                libc::write(ends[1], b"r".as_ptr().cast(), 1);
                libc::sleep(3);
                libc::_exit(0);
            }
        }
        assert!(child > 0);
        let mut b = [0u8; 1];
        // SAFETY: reading one byte into `b`: the child is past its fork handlers.
        assert_eq!(unsafe { libc::read(ends[0], b.as_mut_ptr().cast(), 1) }, 1);
        drop(l);
        // The child still lives (sleeping): had it kept its copy of the fd, the lock would be
        // held by the shared description.
        let still = held(&probe, 7).unwrap();
        // SAFETY: ending the child we forked.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        // SAFETY: closing the pipe we made.
        unsafe { ends.iter().for_each(|&fd| _ = libc::close(fd)) };
        assert!(!still, "a fork child kept its parent's member lock");
        std::fs::remove_file(&p).unwrap();
    }
}
