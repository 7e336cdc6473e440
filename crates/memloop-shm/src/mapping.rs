//! Mapping a file or device shared and read-write (or read-only).

use crate::view::ShmSlice;
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

/// What kind of file backs a mapping; only used for messages and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A regular file in a tmpfs such as /dev/shm.
    File,
    /// A file on hugetlbfs (sizes must be multiples of the huge page size).
    Hugetlbfs,
    /// A device or sysfs resource, e.g. the ivshmem BAR `resource2`: never created or resized.
    Device,
}

#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    #[error("{path}: already exists")]
    Exists { path: PathBuf },
    #[error("{path}: no such region file")]
    NotFound { path: PathBuf },
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
    #[error("{path}: is empty or not yet sized")]
    Empty { path: PathBuf },
}

/// A shared mapping of a whole file. Dropping the last view unmaps it.
pub struct Mapping {
    raw: MmapRaw,
    file: File,
    path: PathBuf,
    backend: Backend,
    writable: bool,
}

/// Options for creating a new region file.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub size: u64,
    pub mode: u32,
    pub gid: Option<u32>,
    /// Take an exclusive `flock` before the file is sized and keep it: openers that wait for
    /// the lock then never see a sized but uninitialised file. Release with [`Mapping::unlock`].
    pub locked: bool,
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> MappingError + 'a {
    move |source| match source.kind() {
        io::ErrorKind::AlreadyExists => MappingError::Exists { path: path.into() },
        io::ErrorKind::NotFound => MappingError::NotFound { path: path.into() },
        _ => MappingError::Io {
            path: path.into(),
            what,
            source,
        },
    }
}

impl Mapping {
    /// Creates `path` exclusively (fails with [`MappingError::Exists`] if it is there), sizes it and
    /// maps it. The file is zero-filled by the kernel.
    pub fn create_new(
        path: &Path,
        backend: Backend,
        opts: &CreateOptions,
    ) -> Result<Arc<Self>, MappingError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(opts.mode)
            .open(path)
            .map_err(io_err(path, "create"))?;
        let setup = || -> Result<(), MappingError> {
            if opts.locked {
                rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
                    .map_err(|e| io_err(path, "lock")(e.into()))?;
            }
            // The umask may have narrowed the mode; the caller asked for exactly this one.
            rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(opts.mode))
                .map_err(|e| io_err(path, "chmod")(e.into()))?;
            if let Some(gid) = opts.gid {
                let gid = rustix::fs::Gid::from_raw(gid);
                rustix::fs::fchown(&file, None, Some(gid))
                    .map_err(|e| io_err(path, "chown")(e.into()))?;
            }
            file.set_len(opts.size).map_err(io_err(path, "resize"))
        };
        if let Err(e) = setup() {
            // Undoing a half-made file; the setup error is the one worth returning.
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Self::map(file, path, backend, true)
    }

    /// Opens and maps an existing file or device in full.
    pub fn open(path: &Path, backend: Backend, writable: bool) -> Result<Arc<Self>, MappingError> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(io_err(path, "open"))?;
        Self::map(file, path, backend, writable)
    }

    fn map(
        file: File,
        path: &Path,
        backend: Backend,
        writable: bool,
    ) -> Result<Arc<Self>, MappingError> {
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        if len == 0 {
            return Err(MappingError::Empty { path: path.into() });
        }
        let mut opts = MmapOptions::new();
        opts.len(len as usize);
        let raw = if writable {
            opts.map_raw(&file)
        } else {
            opts.map_raw_read_only(&file)
        }
        .map_err(io_err(path, "mmap"))?;
        Ok(Arc::new(Self {
            raw,
            file,
            path: path.into(),
            backend,
            writable,
        }))
    }

    pub fn len(&self) -> usize {
        self.raw.len()
    }
    pub fn is_empty(&self) -> bool {
        self.raw.len() == 0
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// The open file, e.g. for advisory locks during initialisation.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Takes an exclusive (`shared == false`) or shared advisory lock on the file, waiting for it.
    pub fn lock(&self, shared: bool) -> Result<(), MappingError> {
        use rustix::fs::FlockOperation::{LockExclusive, LockShared};
        let op = if shared { LockShared } else { LockExclusive };
        rustix::fs::flock(&self.file, op).map_err(|e| io_err(&self.path, "lock")(e.into()))
    }

    /// Releases a lock taken by [`Mapping::lock`] or at creation.
    pub fn unlock(&self) {
        // Unlocking an open file we locked cannot fail in a way we could act on; the lock also
        // goes with the file.
        let _ = rustix::fs::flock(&self.file, rustix::fs::FlockOperation::Unlock);
    }

    /// A view of the whole mapping that keeps it alive.
    pub fn view(self: &Arc<Self>) -> ShmSlice {
        let ptr = NonNull::new(self.raw.as_mut_ptr()).expect("mmap never returns null");
        let keep: Arc<dyn crate::view::Backing> = self.clone();
        // SAFETY: the mapping covers `len` bytes, is page aligned, is writable iff `writable`,
        // and stays mapped while `keep` (an Arc of the mapping) lives.
        unsafe { ShmSlice::from_raw(ptr, self.len(), self.writable, keep) }
    }
}

/// Backing memory is reserved with `fallocate`: a file system without room says so
/// (`ENOSPC`) instead of a later `SIGBUS`. One that cannot reserve (a device such as an ivshmem
/// BAR, which is all memory already) is taken at its word.
impl crate::view::Backing for Mapping {
    fn commit(&self, at: *const u8, len: usize) -> Result<(), crate::view::NoRoom> {
        let no_room = crate::view::NoRoom { len: len as u64 };
        let Some(off) = self.offset_of(at, len) else {
            return Err(no_room); // never from a checked view; refuse rather than guess
        };
        if self.resident(at, len) {
            return Ok(());
        }
        loop {
            let r = rustix::fs::fallocate(
                &self.file,
                rustix::fs::FallocateFlags::empty(),
                off,
                len as u64,
            );
            return match r {
                Ok(()) => Ok(()),
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::NOSPC) => Err(no_room),
                Err(_) => Ok(()),
            };
        }
    }

    /// A hole punched in the file: tmpfs and hugetlbfs free the pages (hugetlbfs only whole
    /// huge pages inside the range). A device cannot: its memory stays.
    fn release(&self, at: *const u8, len: usize) -> bool {
        use rustix::fs::FallocateFlags as F;
        let Some(off) = self.offset_of(at, len) else {
            return false;
        };
        let how = F::PUNCH_HOLE | F::KEEP_SIZE;
        loop {
            match rustix::fs::fallocate(&self.file, how, off, len as u64) {
                Err(rustix::io::Errno::INTR) => continue,
                r => return r.is_ok(),
            }
        }
    }
}

impl Mapping {
    /// Are the pages of `len` bytes at `at` all in the file's page cache, i.e. memory the
    /// file already holds? A ring reusing the memory of an earlier one mostly is, and asking
    /// costs one `mincore` where reserving again costs a walk of the file's pages under its
    /// lock (~4 µs for a new connection's two rings here). Only the owner of a range gives
    /// its memory back, so the answer stands until the owner itself acts. A page out on swap
    /// counts as absent (reserved again: harmless).
    fn resident(&self, at: *const u8, len: usize) -> bool {
        const PAGE: usize = 4096;
        const MAX_PAGES: usize = 64;
        let start = at as usize & !(PAGE - 1);
        let pages = (at as usize + len).div_ceil(PAGE) - start / PAGE;
        if len == 0 || pages > MAX_PAGES {
            return false;
        }
        let mut vec = [0u8; MAX_PAGES];
        // SAFETY: `start..start + pages * PAGE` lies in our mapping (`offset_of` checked the
        // range; the mapping is page aligned) and `vec` has room for one byte per page.
        let r =
            unsafe { libc::mincore(start as *mut libc::c_void, pages * PAGE, vec.as_mut_ptr()) };
        r == 0 && vec[..pages].iter().all(|b| b & 1 == 1)
    }

    /// The file offset of `len` bytes at `at`, if they lie in the mapping.
    fn offset_of(&self, at: *const u8, len: usize) -> Option<u64> {
        let off = (at as usize).wrapping_sub(self.raw.as_ptr() as usize) as u64;
        let end = off.checked_add(len as u64)?;
        (end <= self.len() as u64).then_some(off)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::Ordering::SeqCst;

    #[test]
    fn two_mappings_of_one_file_share_bytes() {
        let dir = std::env::temp_dir().join(format!("memloop-shm-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let opts = CreateOptions {
            size: 8192,
            mode: 0o600,
            gid: None,
            locked: false,
        };
        let a = Mapping::create_new(&dir, Backend::File, &opts).unwrap();
        assert!(matches!(
            Mapping::create_new(&dir, Backend::File, &opts),
            Err(MappingError::Exists { .. })
        ));
        let b = Mapping::open(&dir, Backend::File, true).unwrap();
        a.view().u64_at(4096).unwrap().store(7, SeqCst);
        assert_eq!(b.view().u64_at(4096).unwrap().load(SeqCst), 7);
        let ro = Mapping::open(&dir, Backend::File, false).unwrap();
        assert!(ro.view().write(0, &[1]).is_err());
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(
            Mapping::open(&dir, Backend::File, true),
            Err(MappingError::NotFound { .. })
        ));
    }
}
