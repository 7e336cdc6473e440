//! Bounds-checked views into shared memory.
//!
//! A [`ShmSlice`] is a window `[offset, offset+len)` into a mapping that keeps the mapping alive.
//! Offsets and lengths passed to its methods are usually derived from data a peer wrote, so every
//! method validates them and returns [`OutOfBounds`] instead of touching memory outside the window.

use crate::sync::{AtomicU32, AtomicU64};
use std::ops::Deref;
use std::sync::Arc;

/// An access outside a view, misaligned, or a write through a read-only view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OutOfBounds {
    #[error(
        "shared-memory access of {len} bytes at offset {off} is outside a view of {view} bytes"
    )]
    Range { off: u64, len: u64, view: u64 },
    #[error("shared-memory atomic at offset {off} is not aligned to {align} bytes")]
    Misaligned { off: u64, align: u64 },
    #[error("write to a read-only shared-memory view")]
    ReadOnly,
}

/// The file system behind a mapping has no room left for memory a view was to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no memory left in the file system behind the region ({len} bytes asked)")]
pub struct NoRoom {
    pub len: u64,
}

/// What keeps the memory behind a view mapped, and can make sure that memory exists.
#[cfg(not(loom))]
pub(crate) trait Backing: Send + Sync {
    /// Makes sure memory backs the `len` bytes at `at` (inside the mapping), so that touching
    /// them cannot fault for want of it (a sparse file on a full tmpfs raises `SIGBUS`).
    fn commit(&self, _at: *const u8, _len: usize) -> Result<(), NoRoom> {
        Ok(())
    }
    /// Gives the memory behind the `len` bytes at `at` back to the system (the bytes read as
    /// zero afterwards); false where that cannot be done (heap memory, a device).
    fn release(&self, _at: *const u8, _len: usize) -> bool {
        false
    }
}

#[cfg(not(loom))]
mod imp {
    use super::*;
    use std::ptr::NonNull;

    /// Whatever keeps the memory behind a view mapped.
    pub(crate) type Keep = Arc<dyn Backing>;

    /// Heap memory exists once allocated.
    impl Backing for Arc<[AtomicU64]> {}

    #[derive(Clone)]
    pub struct ShmSlice {
        ptr: NonNull<u8>,
        len: usize,
        writable: bool,
        _keep: Keep,
    }

    // SAFETY: the view only hands out atomics and copies; the memory is shared by design and
    // every access goes through atomics or explicit copies, never through `&mut`.
    unsafe impl Send for ShmSlice {}
    // SAFETY: as above: no method gives out a reference that could alias a `&mut`.
    unsafe impl Sync for ShmSlice {}

    impl ShmSlice {
        /// # Safety
        /// `ptr..ptr+len` must stay mapped (readable, and writable if `writable`) for as long as
        /// `keep` is alive, and must be aligned to at least 8 bytes.
        pub(crate) unsafe fn from_raw(
            ptr: NonNull<u8>,
            len: usize,
            writable: bool,
            keep: Keep,
        ) -> Self {
            Self {
                ptr,
                len,
                writable,
                _keep: keep,
            }
        }

        /// A heap-backed view for tests and single-process use: zero-filled, 64-byte aligned.
        pub fn new_heap(len: usize) -> Self {
            let words = len.div_ceil(64).max(1);
            let buf: Arc<[crate::sync::AtomicU64]> =
                (0..words * 8).map(|_| AtomicU64::new(0)).collect();
            let ptr = NonNull::from(&buf[0]).cast::<u8>();
            // SAFETY: `buf` is kept alive by the view, holds `words*64 >= len` bytes of interior
            // mutable memory (atomics), and is 8-byte aligned.
            unsafe { Self::from_raw(ptr, len, true, Arc::new(buf)) }
        }

        pub(super) fn base(&self) -> NonNull<u8> {
            self.ptr
        }
        /// The sub-view `[off, off+len)`; fails unless it lies inside this one.
        pub(super) fn with_range(&self, off: u64, len: u64) -> Result<Self, OutOfBounds> {
            let o = self.check(off, len)?;
            // SAFETY: `check` proved `o + len <= self.len`, so the offset stays inside (or one
            // past the end of) this view's allocation, and a non-null base plus it is non-null.
            let ptr = unsafe { self.ptr.add(o) };
            Ok(Self {
                ptr,
                len: len as usize,
                writable: self.writable,
                _keep: self._keep.clone(),
            })
        }
        pub fn len(&self) -> usize {
            self.len
        }
        /// Makes sure memory backs `[off, off+len)` of the view before it is first touched: a
        /// region is a sparse file, and on a full file system (a container's small
        /// `/dev/shm`) a write to a page never written kills the program with `SIGBUS`. An
        /// error instead lets the caller give up (a connection falls back to TCP, counted).
        pub fn commit(&self, off: u64, len: u64) -> Result<(), CommitError> {
            let o = self.check(off, len)?;
            // SAFETY: `check` proved `o + len <= self.len`: the pointer stays inside the view.
            let at = unsafe { self.ptr.as_ptr().add(o) };
            self._keep.commit(at, len as usize)?;
            Ok(())
        }
        /// Gives the memory behind `off..off + len` back to the system ([`Backing::release`]):
        /// only for bytes nobody uses any more, which then read as zero. Whether it was done.
        pub fn release(&self, off: u64, len: u64) -> Result<bool, OutOfBounds> {
            let o = self.check(off, len)?;
            // SAFETY: `check` proved `o + len <= self.len`: the pointer stays inside the view.
            let at = unsafe { self.ptr.as_ptr().add(o) };
            Ok(self._keep.release(at, len as usize))
        }
        pub fn is_writable(&self) -> bool {
            self.writable
        }
        pub fn read_only(&self) -> Self {
            Self {
                writable: false,
                ..self.clone()
            }
        }

        /// Copies `src` into the view at `off`.
        pub fn write(&self, off: u64, src: &[u8]) -> Result<(), OutOfBounds> {
            let o = self.check(off, src.len() as u64)?;
            if !self.writable {
                return Err(OutOfBounds::ReadOnly);
            }
            // SAFETY: the range was checked to lie inside the mapping, which is writable and
            // stays mapped while `self` lives. Any bit pattern is a valid `u8`. Concurrent access
            // by a peer is excluded by the ring protocol; a buggy peer can only make the bytes
            // garbage, which readers treat as untrusted data.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(o), src.len())
            };
            Ok(())
        }

        /// Copies from the view at `off` into `dst`.
        pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
            let o = self.check(off, dst.len() as u64)?;
            // SAFETY: as for `write`: checked range, live mapping, plain bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(o), dst.as_mut_ptr(), dst.len())
            };
            Ok(())
        }

        /// Fills `len` bytes at `off` with `byte`.
        pub fn fill(&self, off: u64, len: u64, byte: u8) -> Result<(), OutOfBounds> {
            let o = self.check(off, len)?;
            if !self.writable {
                return Err(OutOfBounds::ReadOnly);
            }
            // SAFETY: checked range inside a live, writable mapping.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(o), byte, len as usize) };
            Ok(())
        }

        /// `read(2)` from `fd` into bytes `[off, off+len)` of this view: the kernel copies
        /// straight into shared memory, with no bounce buffer. Bounds-checked (a range outside
        /// the view is `InvalidInput`); a read-only view is refused (`PermissionDenied`).
        /// Returns the byte count `read(2)` returned (0 at end of file; a packet device such as
        /// a TUN gives one frame). `EINTR` is retried. Memory the kernel cannot fill (a sparse
        /// region on a full file system) is an `EFAULT` error here, never a `SIGBUS`.
        pub fn read_from_fd(
            &self,
            off: u64,
            len: u64,
            fd: std::os::fd::BorrowedFd<'_>,
        ) -> std::io::Result<usize> {
            use std::os::fd::AsRawFd;
            let o = self.check(off, len).map_err(fd_io_error)?;
            if !self.writable {
                return Err(fd_io_error(OutOfBounds::ReadOnly));
            }
            loop {
                // SAFETY: `check` proved `[o, o+len)` lies inside the view, whose mapping is
                // writable (checked above) and stays mapped while `self` lives; the kernel
                // writes plain bytes there, as `write` does, and reports a fault as `EFAULT`.
                // Concurrent access by a peer is excluded by the protocol above; a buggy peer
                // can only make the bytes garbage, which readers treat as untrusted data.
                let n = unsafe {
                    libc::read(
                        fd.as_raw_fd(),
                        self.ptr.as_ptr().add(o).cast::<libc::c_void>(),
                        len as usize,
                    )
                };
                if let Some(r) = fd_result(n) {
                    return r;
                }
            }
        }

        /// `write(2)` bytes `[off, off+len)` of this view to `fd`: the kernel copies straight
        /// out of shared memory. Bounds-checked (a range outside the view is `InvalidInput`).
        /// Returns the byte count `write(2)` returned. `EINTR` is retried.
        pub fn write_to_fd(
            &self,
            off: u64,
            len: u64,
            fd: std::os::fd::BorrowedFd<'_>,
        ) -> std::io::Result<usize> {
            use std::os::fd::AsRawFd;
            let o = self.check(off, len).map_err(fd_io_error)?;
            loop {
                // SAFETY: `check` proved `[o, o+len)` lies inside the view, which is readable
                // and stays mapped while `self` lives; the kernel only reads plain bytes.
                let n = unsafe {
                    libc::write(
                        fd.as_raw_fd(),
                        self.ptr.as_ptr().add(o).cast::<libc::c_void>(),
                        len as usize,
                    )
                };
                if let Some(r) = fd_result(n) {
                    return r;
                }
            }
        }

        pub fn u64_at(&self, off: u64) -> Result<ShmU64, OutOfBounds> {
            let view = self.with_range(off, 8)?;
            if off % 8 != 0 {
                return Err(OutOfBounds::Misaligned { off, align: 8 });
            }
            Ok(ShmU64 { view })
        }

        pub fn u32_at(&self, off: u64) -> Result<ShmU32, OutOfBounds> {
            let view = self.with_range(off, 4)?;
            if off % 4 != 0 {
                return Err(OutOfBounds::Misaligned { off, align: 4 });
            }
            Ok(ShmU32 { view })
        }

        /// The 8-byte atomic at `off`, borrowed from this view: no handle (and no reference
        /// count) is made, which matters on paths that poll a few words in a loop.
        pub fn atomic_u64(&self, off: u64) -> Result<&AtomicU64, OutOfBounds> {
            let o = self.check_atomic(off, 8)?;
            // SAFETY: `check_atomic` proved `[o, o+8)` lies inside this view and `o` is a
            // multiple of 8 (the base is 8-aligned); the mapping lives as long as `self`, which
            // the returned reference borrows; `AtomicU64` has no invalid bit patterns and the
            // shared memory is only ever accessed atomically or by copies.
            Ok(unsafe { &*(self.ptr.as_ptr().add(o) as *const AtomicU64) })
        }

        /// The 4-byte atomic at `off`, borrowed from this view (see [`ShmSlice::atomic_u64`]).
        pub fn atomic_u32(&self, off: u64) -> Result<&AtomicU32, OutOfBounds> {
            let o = self.check_atomic(off, 4)?;
            // SAFETY: as in `atomic_u64`, with 4 bytes and 4-byte alignment.
            Ok(unsafe { &*(self.ptr.as_ptr().add(o) as *const AtomicU32) })
        }
    }

    /// An [`OutOfBounds`] from [`ShmSlice::read_from_fd`] / [`ShmSlice::write_to_fd`] as an
    /// `io::Error`: `PermissionDenied` for a read-only view, `InvalidInput` otherwise.
    fn fd_io_error(e: OutOfBounds) -> std::io::Error {
        let kind = match e {
            OutOfBounds::ReadOnly => std::io::ErrorKind::PermissionDenied,
            _ => std::io::ErrorKind::InvalidInput,
        };
        std::io::Error::new(kind, e)
    }

    /// What a `read`/`write` that returned `n` means, or `None` to retry (`EINTR`).
    fn fd_result(n: isize) -> Option<std::io::Result<usize>> {
        if n >= 0 {
            return Some(Ok(n as usize));
        }
        let e = std::io::Error::last_os_error();
        (e.kind() != std::io::ErrorKind::Interrupted).then_some(Err(e))
    }

    /// A validated 8-byte atomic in shared memory.
    #[derive(Clone)]
    pub struct ShmU64 {
        view: ShmSlice,
    }
    impl Deref for ShmU64 {
        type Target = AtomicU64;
        fn deref(&self) -> &AtomicU64 {
            // SAFETY: `u64_at` checked bounds and 8-byte alignment (the base is 8-aligned), the
            // mapping lives as long as `view`, `AtomicU64` has no invalid bit patterns, and
            // shared memory is only ever accessed atomically or by copies.
            unsafe { &*(self.view.base().as_ptr() as *const AtomicU64) }
        }
    }

    /// A validated 4-byte atomic in shared memory.
    #[derive(Clone)]
    pub struct ShmU32 {
        view: ShmSlice,
    }
    impl Deref for ShmU32 {
        type Target = AtomicU32;
        fn deref(&self) -> &AtomicU32 {
            // SAFETY: as for `ShmU64`, with 4-byte alignment checked by `u32_at`.
            unsafe { &*(self.view.base().as_ptr() as *const AtomicU32) }
        }
    }
}

#[cfg(loom)]
mod imp {
    //! Loom model of shared memory: control words are loom atomics; data bytes live in loom
    //! `AtomicU64` words accessed relaxed, so a missing acquire/release in an algorithm shows up
    //! as stale data. u32 and u64 atomics are kept in separate arrays (they never overlap in
    //! memloop's layouts).
    use super::*;
    use crate::sync::Ordering::Relaxed;

    pub struct Model {
        words: Vec<AtomicU64>,
        halves: Vec<AtomicU32>,
    }

    #[derive(Clone)]
    pub struct ShmSlice {
        mem: Arc<Model>,
        start: usize,
        len: usize,
        writable: bool,
    }

    impl ShmSlice {
        pub fn new_model(len: usize) -> Self {
            let len8 = len.div_ceil(8);
            let mem = Model {
                words: (0..len8).map(|_| AtomicU64::new(0)).collect(),
                halves: (0..len8 * 2).map(|_| AtomicU32::new(0)).collect(),
            };
            Self {
                mem: Arc::new(mem),
                start: 0,
                len,
                writable: true,
            }
        }
        pub fn new_heap(len: usize) -> Self {
            Self::new_model(len)
        }
        pub(super) fn with_range(&self, off: u64, len: u64) -> Result<Self, OutOfBounds> {
            let o = self.check(off, len)?;
            Ok(Self {
                start: self.start + o,
                len: len as usize,
                ..self.clone()
            })
        }
        pub fn len(&self) -> usize {
            self.len
        }
        /// Model memory always exists.
        pub fn commit(&self, off: u64, len: u64) -> Result<(), CommitError> {
            self.check(off, len)?;
            Ok(())
        }
        pub fn release(&self, off: u64, len: u64) -> Result<bool, OutOfBounds> {
            self.check(off, len)?;
            Ok(false)
        }
        pub fn is_writable(&self) -> bool {
            self.writable
        }
        pub fn read_only(&self) -> Self {
            Self {
                writable: false,
                ..self.clone()
            }
        }
        fn byte_op(&self, abs: usize, f: impl FnOnce(u64, u32) -> Option<u64>) {
            let w = &self.mem.words[abs / 8];
            let shift = (abs % 8) as u32 * 8;
            let cur = w.load(Relaxed);
            if let Some(new) = f(cur, shift) {
                w.store(new, Relaxed);
            }
        }
        pub fn write(&self, off: u64, src: &[u8]) -> Result<(), OutOfBounds> {
            let o = self.check(off, src.len() as u64)?;
            if !self.writable {
                return Err(OutOfBounds::ReadOnly);
            }
            for (i, b) in src.iter().enumerate() {
                self.byte_op(self.start + o + i, |cur, s| {
                    Some((cur & !(0xff << s)) | ((*b as u64) << s))
                });
            }
            Ok(())
        }
        pub fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
            let o = self.check(off, dst.len() as u64)?;
            for (i, d) in dst.iter_mut().enumerate() {
                self.byte_op(self.start + o + i, |cur, s| {
                    *d = (cur >> s) as u8;
                    None
                });
            }
            Ok(())
        }
        pub fn fill(&self, off: u64, len: u64, byte: u8) -> Result<(), OutOfBounds> {
            self.write(off, &vec![byte; len as usize])
        }
        pub fn u64_at(&self, off: u64) -> Result<ShmU64, OutOfBounds> {
            self.check_atomic(off, 8)?;
            Ok(ShmU64 {
                mem: self.mem.clone(),
                idx: (self.start + off as usize) / 8,
            })
        }
        pub fn u32_at(&self, off: u64) -> Result<ShmU32, OutOfBounds> {
            self.check_atomic(off, 4)?;
            Ok(ShmU32 {
                mem: self.mem.clone(),
                idx: (self.start + off as usize) / 4,
            })
        }
        pub fn atomic_u64(&self, off: u64) -> Result<&AtomicU64, OutOfBounds> {
            self.check_atomic(off, 8)?;
            Ok(&self.mem.words[(self.start + off as usize) / 8])
        }
        pub fn atomic_u32(&self, off: u64) -> Result<&AtomicU32, OutOfBounds> {
            self.check_atomic(off, 4)?;
            Ok(&self.mem.halves[(self.start + off as usize) / 4])
        }
    }

    #[derive(Clone)]
    pub struct ShmU64 {
        mem: Arc<Model>,
        idx: usize,
    }
    impl Deref for ShmU64 {
        type Target = AtomicU64;
        fn deref(&self) -> &AtomicU64 {
            &self.mem.words[self.idx]
        }
    }
    #[derive(Clone)]
    pub struct ShmU32 {
        mem: Arc<Model>,
        idx: usize,
    }
    impl Deref for ShmU32 {
        type Target = AtomicU32;
        fn deref(&self) -> &AtomicU32 {
            &self.mem.halves[self.idx]
        }
    }
}

pub use imp::{ShmSlice, ShmU32, ShmU64};

impl ShmSlice {
    /// Validates `[off, off+len)` against the view and returns `off` as a `usize`.
    #[inline]
    fn check(&self, off: u64, len: u64) -> Result<usize, OutOfBounds> {
        let view = self.len() as u64;
        match off.checked_add(len) {
            Some(end) if end <= view => Ok(off as usize),
            _ => Err(OutOfBounds::Range { off, len, view }),
        }
    }

    /// Validates an atomic of `align` bytes at `off` (in range and aligned); returns `off`.
    #[inline]
    fn check_atomic(&self, off: u64, align: u64) -> Result<usize, OutOfBounds> {
        let o = self.check(off, align)?;
        if off % align != 0 {
            return Err(OutOfBounds::Misaligned { off, align });
        }
        Ok(o)
    }

    /// A sub-view `[off, off+len)`; fails if it does not fit. Sub-views keep 8-byte alignment
    /// only if `off` is a multiple of 8, which atomics accessors re-check relative to the view.
    pub fn slice(&self, off: u64, len: u64) -> Result<ShmSlice, OutOfBounds> {
        self.check_slice(off, len)?;
        self.with_range(off, len)
    }

    /// What [`ShmSlice::slice`] checks, without making the view (a view holds a reference
    /// count on the mapping: taking one per slot would cost a table scan more than its reads).
    #[inline]
    pub fn check_slice(&self, off: u64, len: u64) -> Result<(), OutOfBounds> {
        self.check(off, len)?;
        if off % 8 != 0 {
            return Err(OutOfBounds::Misaligned { off, align: 8 });
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why [`ShmSlice::commit`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    OutOfBounds(#[from] OutOfBounds),
    #[error(transparent)]
    NoRoom(#[from] NoRoom),
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::Ordering::SeqCst;

    #[test]
    fn bounds_are_enforced() {
        let s = ShmSlice::new_heap(128);
        assert!(s.write(120, &[1; 8]).is_ok());
        assert!(matches!(
            s.write(121, &[1; 8]),
            Err(OutOfBounds::Range { .. })
        ));
        assert!(matches!(
            s.read(u64::MAX, &mut [0; 2]),
            Err(OutOfBounds::Range { .. })
        ));
        assert!(matches!(s.u64_at(4), Err(OutOfBounds::Misaligned { .. })));
        assert!(matches!(s.u64_at(128), Err(OutOfBounds::Range { .. })));
        assert!(s.slice(64, 65).is_err());
        assert!(matches!(
            s.read_only().write(0, &[1]),
            Err(OutOfBounds::ReadOnly)
        ));
    }

    #[test]
    fn sub_views_alias_the_same_memory() {
        let s = ShmSlice::new_heap(256);
        let sub = s.slice(64, 64).unwrap();
        sub.u64_at(8).unwrap().store(42, SeqCst);
        assert_eq!(s.u64_at(72).unwrap().load(SeqCst), 42);
        sub.write(16, b"hello").unwrap();
        let mut b = [0u8; 5];
        s.read(80, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(sub.u32_at(64).is_err());
    }

    /// A pipe: (read end, write end).
    fn pipe() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        use std::os::fd::FromRawFd;
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is valid for writes of the two descriptors `pipe2` returns.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
        assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
        // SAFETY: `pipe2` succeeded: both descriptors are new and owned by nobody else.
        unsafe {
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        }
    }

    #[test]
    fn fd_io_copies_between_a_pipe_and_the_view() {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        let s = ShmSlice::new_heap(256);
        s.write(100, b"frame from shared memory").unwrap();
        let (r, w) = pipe();
        // View -> pipe.
        assert_eq!(s.write_to_fd(100, 24, w.as_fd()).unwrap(), 24);
        let mut got = [0u8; 24];
        std::fs::File::from(r.try_clone().unwrap())
            .read_exact(&mut got)
            .unwrap();
        assert_eq!(&got, b"frame from shared memory");
        // Pipe -> view, through a sub-view (offsets are relative to it).
        std::fs::File::from(w.try_clone().unwrap())
            .write_all(b"from the kernel")
            .unwrap();
        let sub = s.slice(192, 64).unwrap();
        assert_eq!(sub.read_from_fd(8, 64 - 8, r.as_fd()).unwrap(), 15);
        let mut back = [0u8; 15];
        s.read(200, &mut back).unwrap();
        assert_eq!(&back, b"from the kernel");
        // A read-only view may still be written out.
        assert_eq!(s.read_only().write_to_fd(200, 4, w.as_fd()).unwrap(), 4);
        // End of file: the write end closed, read(2) returns 0.
        drop(w);
        let mut rest = [0u8; 4];
        std::fs::File::from(r.try_clone().unwrap())
            .read_exact(&mut rest)
            .unwrap();
        assert_eq!(&rest, b"from");
        assert_eq!(s.read_from_fd(0, 8, r.as_fd()).unwrap(), 0);
    }

    #[test]
    fn fd_io_is_bounds_checked_and_refuses_read_only_views() {
        use std::io::ErrorKind;
        use std::os::fd::AsFd;
        let s = ShmSlice::new_heap(128);
        let (r, w) = pipe();
        for (off, len) in [(121, 8), (128, 1), (u64::MAX, 2), (0, 129)] {
            assert_eq!(
                s.write_to_fd(off, len, w.as_fd()).unwrap_err().kind(),
                ErrorKind::InvalidInput,
                "write_to_fd({off}, {len})"
            );
            assert_eq!(
                s.read_from_fd(off, len, r.as_fd()).unwrap_err().kind(),
                ErrorKind::InvalidInput,
                "read_from_fd({off}, {len})"
            );
        }
        let ro = s.read_only();
        assert_eq!(
            ro.read_from_fd(0, 8, r.as_fd()).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
        // An empty range at the very end is inside the view.
        assert_eq!(s.write_to_fd(128, 0, w.as_fd()).unwrap(), 0);
        // Errors of read(2) itself come back as they are: the write end cannot be read.
        assert!(s.read_from_fd(0, 8, w.as_fd()).is_err());
    }
}
