//! A buffer pool mapped on its own: writable for its owner, **read-only** for everyone else,
//! so a reader that writes into a buffer it received faults (enforced by the MMU, not by
//! convention). The pool's bytes also lie in each member's mapping of the whole region, but
//! nothing above this crate can reach them there: ring and registry code only touches memory
//! through checked views of the region, and buffers only through these mappings.
//!
//! The bytes are plain `u8`, so whatever a buggy peer writes meanwhile is unpredictable but
//! never an invalid value. Within one process, the owner's writable mapping and a reader's
//! read-only one are two address ranges, and a buffer is written only through the one
//! [`BufMut`] that [`PoolMapping::take`] hands out for it at a time.

use crate::mapping::{Mapping, MappingError};
use memmap2::{MmapOptions, MmapRaw};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const PAGE: u64 = 4096;
/// Pools up to this size are mapped with their page tables filled ([`PoolMapping::map`]).
const POPULATE_MAX: u64 = 256 << 20;

/// One pool's data, mapped from the region's file.
pub struct PoolMapping {
    raw: MmapRaw,
    writable: bool,
    buf_size: usize,
    buffers: usize,
    /// Buffers handed out as [`BufMut`] (writable mappings only).
    taken: Box<[AtomicBool]>,
}

impl std::fmt::Debug for PoolMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolMapping")
            .field("buf_size", &self.buf_size)
            .field("buffers", &self.buffers)
            .field("writable", &self.writable)
            .finish()
    }
}

impl PoolMapping {
    /// Maps `buffers` buffers of `buf_size` bytes at offset `off` (page-aligned) of the
    /// region's file: shared, read-write only if `writable`.
    pub fn map(
        region: &Mapping,
        off: u64,
        buf_size: u32,
        buffers: u32,
        writable: bool,
    ) -> Result<Arc<Self>, MappingError> {
        let len = buf_size as u64 * buffers as u64;
        let bad = |what: &'static str| MappingError::Io {
            path: region.path().into(),
            what,
            source: std::io::ErrorKind::InvalidInput.into(),
        };
        let end = off.checked_add(len).ok_or_else(|| bad("pool range"))?;
        if len == 0 || off % PAGE != 0 || end > region.len() as u64 {
            return Err(bad("pool range"));
        }
        let mut opts = MmapOptions::new();
        opts.offset(off).len(len as usize);
        // Page tables filled now (the pool's memory is reserved already): a pool's pages are
        // otherwise faulted in one by one, by each member, the first time it touches each —
        // ~1 µs a page, paid inside the first messages. Not for huge pools, whose readers may
        // touch little of them.
        if len <= POPULATE_MAX {
            opts.populate();
        }
        let raw = match writable {
            true => opts.map_raw(region.file()),
            false => opts.map_raw_read_only(region.file()),
        }
        .map_err(|source| MappingError::Io {
            path: region.path().into(),
            what: "mmap of a pool",
            source,
        })?;
        Ok(Arc::new(PoolMapping {
            raw,
            writable,
            buf_size: buf_size as usize,
            buffers: buffers as usize,
            taken: (0..buffers).map(|_| AtomicBool::new(false)).collect(),
        }))
    }

    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    pub fn buffers(&self) -> usize {
        self.buffers
    }

    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The `len` bytes at `off` of the pool's data; `None` outside it.
    pub fn bytes(&self, off: u64, len: usize) -> Option<&[u8]> {
        let end = off.checked_add(len as u64)?;
        if end > self.raw.len() as u64 {
            return None;
        }
        // SAFETY: `off..end` lies inside the mapping, which lives as long as `self`; the
        // memory is plain bytes (any value valid). Writes to it in this process happen only
        // through a `BufMut` of the owner's writable mapping, a different address range.
        Some(unsafe { std::slice::from_raw_parts(self.raw.as_ptr().add(off as usize), len) })
    }

    /// Buffer `i` for writing, exclusively while the returned guard lives; `None` if this is
    /// a read-only mapping, `i` is out of range or the buffer is already taken.
    pub fn take(self: &Arc<Self>, i: u32) -> Option<BufMut> {
        let flag = self.taken.get(i as usize)?;
        if !self.writable || flag.swap(true, Ordering::Acquire) {
            return None;
        }
        Some(BufMut {
            map: self.clone(),
            i: i as usize,
        })
    }
}

/// Exclusive write access to one buffer of a writable [`PoolMapping`].
pub struct BufMut {
    map: Arc<PoolMapping>,
    i: usize,
}

impl BufMut {
    pub fn index(&self) -> u32 {
        self.i as u32
    }

    fn ptr(&self) -> *mut u8 {
        // (In range: `take` checked `i` against the buffer count.)
        self.map
            .raw
            .as_mut_ptr()
            .wrapping_add(self.i * self.map.buf_size)
    }
}

impl Deref for BufMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: buffer `i` lies inside the writable mapping kept alive by `map`; while this
        // guard lives no other `BufMut` of it exists (the `taken` flag), so the only other
        // accesses in this process are reads through a different (read-only) mapping.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.map.buf_size) }
    }
}

impl DerefMut for BufMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.map.buf_size) }
    }
}

impl Drop for BufMut {
    fn drop(&mut self) {
        self.map.taken[self.i].store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::{Backend, CreateOptions};

    #[test]
    fn the_owner_writes_what_a_read_only_mapping_reads() {
        let path = std::env::temp_dir().join(format!("memloop-pool-map-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let opts = CreateOptions {
            size: 4 * PAGE,
            mode: 0o600,
            gid: None,
            locked: false,
        };
        let region = Mapping::create_new(&path, Backend::File, &opts).unwrap();
        let owner = PoolMapping::map(&region, PAGE, 1024, 4, true).unwrap();
        let reader = PoolMapping::map(&region, PAGE, 1024, 4, false).unwrap();
        let mut b = owner.take(2).unwrap();
        assert!(owner.take(2).is_none(), "one writer per buffer");
        b[..5].copy_from_slice(b"hello");
        assert_eq!(reader.bytes(2048, 5).unwrap(), b"hello");
        let mut whole = [0u8; 5];
        region.view().read(PAGE + 2048, &mut whole).unwrap();
        assert_eq!(&whole, b"hello", "the same bytes as the region's");
        drop(b);
        assert!(owner.take(2).is_some());
        assert!(reader.take(0).is_none() && owner.take(4).is_none());
        assert!(reader.bytes(4090, 7).is_none());
        assert!(
            PoolMapping::map(&region, 100, 64, 1, false).is_err(),
            "unaligned"
        );
        assert!(
            PoolMapping::map(&region, PAGE, 4096, 4, false).is_err(),
            "past the end"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
