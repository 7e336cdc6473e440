//! The FUSE frontend: an attachment shown to the client's kernel as one regular file, `disk`,
//! in a FUSE file system served straight on `/dev/fuse` (no libfuse), so that a loop device
//! (`losetup --direct-io=on`) can make it a block device.
//!
//! Zero-copy on our side of the kernel:
//!
//! - **WRITE**: every read(2) of `/dev/fuse` lands in a [`WriteBuf`] of the client's pool
//!   (headroom 80: the FUSE in-header and `fuse_write_in`), so a WRITE's payload is where
//!   the storage server reads it from; the request is submitted as it lies. A request that
//!   is not a WRITE leaves the buffer for the next read.
//! - **READ**: the reply is `writev(out header, completion data)`: the data goes from the
//!   server's buffer (mapped read-only here) to the kernel, which copies it to the reader's
//!   pages.
//!
//! Threads: the *reader* reads `/dev/fuse`, answers the metadata requests itself and submits
//! READ / WRITE / FSYNC / FLUSH / FALLOCATE with the FUSE `unique` as the blk tag; the
//! *replier* takes completions and answers them; the *connector* reattaches when the storage
//! server went (every request in flight then fails with `EIO`, and new ones fail at once
//! until a new export of the same name, the same size, is up).
//!
//! Everything the kernel sends is checked as a peer's data would be: lengths against what
//! was read, argument sizes per opcode, offsets against the export.

use crate::attach::{self, bump, lock, submit, submit_to, Core, Pend};
pub use crate::attach::{FrontendOptions, FrontendStats, DEFAULT_IO_TIMEOUT};
use crate::client::{BlkClient, ClientOptions, Completion, Submitter, WriteBuf};
use crate::error::BlkError;
use crate::proto::{errno, ExportInfo};
use memloop::Node;
use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

/// `fuse_in_header`.
const IN_HEADER: usize = 40;
/// `fuse_out_header`.
const OUT_HEADER: usize = 16;
/// In-header + `fuse_write_in`: where a WRITE's payload starts.
pub const HEADROOM: usize = IN_HEADER + 40;
/// The file the export is.
pub const DISK_NAME: &str = "disk";
const ROOT_INO: u64 = 1;
const DISK_INO: u64 = 2;
/// The kernel refuses a read(2) of `/dev/fuse` into less.
const MIN_READ_BUFFER: usize = 8192;
/// Largest request that is not a WRITE we accept.
const MAX_SMALL_REQUEST: usize = 64 << 10;

mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

// INIT flags.
const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_ASYNC_DIO: u32 = 1 << 15;
const FUSE_PARALLEL_DIROPS: u32 = 1 << 18;
const FUSE_MAX_PAGES: u32 = 1 << 22;
// OPEN reply flags.
const FOPEN_DIRECT_IO: u32 = 1 << 0;
const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
const FATTR_SIZE: u32 = 1 << 3;
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
const ENOSYS: i32 = 38;
const EPERM: i32 = 1;
const ENOTDIR: i32 = 20;
const EISDIR: i32 = 21;

struct Ctx {
    core: Core,
    dev: File,
    /// Bytes a read(2) of `/dev/fuse` may bring.
    bufsize: usize,
    /// The region is a device mapping (the ivshmem BAR in a guest): the FUSE device pins the
    /// pages it copies to and from, which a PFN mapping has none of (`EFAULT`, and the request
    /// is lost). Requests and replies then go through a buffer of ours: one more copy each.
    bounce: bool,
}

impl std::ops::Deref for Ctx {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

/// A mounted frontend: the file system and its threads. Dropping it unmounts.
pub struct Frontend {
    ctx: Arc<Ctx>,
    mountpoint: PathBuf,
    threads: Vec<JoinHandle<()>>,
}

fn io_err(why: String) -> BlkError {
    BlkError::Io(std::io::Error::other(why))
}

impl Frontend {
    /// Attaches to export `name` and mounts its file at `mountpoint/disk` (root only).
    pub fn start(node: &Node, name: &str, mountpoint: &Path) -> Result<Frontend, BlkError> {
        Self::start_with(node, name, mountpoint, FrontendOptions::default())
    }

    pub fn start_with(
        node: &Node,
        name: &str,
        mountpoint: &Path,
        fo: FrontendOptions,
    ) -> Result<Frontend, BlkError> {
        let opts = ClientOptions {
            headroom: HEADROOM as u32,
            ..ClientOptions::default()
        };
        let client = BlkClient::connect_with(node, name, opts)?;
        let info = *client.info();
        let bufsize = HEADROOM + info.max_io as usize;
        if bufsize < MIN_READ_BUFFER {
            return Err(io_err(format!(
                "max I/O {}: the FUSE frontend needs at least {}",
                info.max_io,
                MIN_READ_BUFFER - HEADROOM
            )));
        }
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?;
        let data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,max_read={}",
            dev.as_raw_fd(),
            info.max_io
        );
        let data = std::ffi::CString::new(data).map_err(|e| io_err(e.to_string()))?;
        use rustix::mount::MountFlags;
        rustix::mount::mount(
            format!("memloop-blk:{name}").as_str(),
            mountpoint,
            "fuse.memloop-blk",
            MountFlags::NOSUID | MountFlags::NODEV,
            data.as_c_str(),
        )?;
        let ctx = Arc::new(Ctx {
            core: Core::new(name, info),
            dev,
            bufsize,
            bounce: node.region().device_backed(),
        });
        let threads = attach::start(
            &ctx,
            node,
            client,
            (fo, opts),
            |c, sub, rx| reader(c, Some(sub), rx),
            answer,
        )?;
        Ok(Frontend {
            ctx,
            mountpoint: mountpoint.into(),
            threads,
        })
    }

    /// The file to give `losetup`.
    pub fn disk_path(&self) -> PathBuf {
        self.mountpoint.join(DISK_NAME)
    }

    pub fn info(&self) -> ExportInfo {
        self.ctx.info
    }

    pub fn stats(&self) -> FrontendStats {
        self.ctx.core.stats()
    }
}

impl Drop for Frontend {
    /// Unmounts, lazily: the threads go on serving whoever still holds the file (a loop
    /// device being detached) and end when the kernel ends the connection; they are joined
    /// (for a few seconds at most), so that the session's buffers go back to the region.
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.mountpoint, rustix::mount::UnmountFlags::DETACH);
        // Once nothing holds the file, the kernel ends the connection and the reader sees it.
        attach::join_within(std::mem::take(&mut self.threads), attach::JOIN_LIMIT);
    }
}

// ---- replies ----

fn out_header(unique: u64, error: i32, len: usize) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    h[0..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..8].copy_from_slice(&(-error).to_le_bytes());
    h[8..16].copy_from_slice(&unique.to_le_bytes());
    h
}

impl Ctx {
    fn send(&self, parts: &[&[u8]]) {
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        if let Err(e) = rustix::io::writev(&self.dev, &iov) {
            // ENOENT: the request was interrupted (or the connection aborted).
            tracing::debug!(export = %self.name, "a FUSE reply: {e}");
        }
    }

    fn reply(&self, unique: u64, body: &[u8]) {
        let h = out_header(unique, 0, OUT_HEADER + body.len());
        self.send(&[&h, body]);
    }

    /// An error answer, counted in [`FrontendStats::errors`].
    fn reply_err(&self, unique: u64, errno: i32) {
        bump(&self.stats.errors);
        self.reply_quiet(unique, errno);
    }

    /// An error answer that is no fault (a name that is not there, an operation we lack).
    fn reply_quiet(&self, unique: u64, errno: i32) {
        let h = out_header(unique, errno, OUT_HEADER);
        self.send(&[&h]);
    }

    fn attr(&self, ino: u64) -> [u8; 88] {
        let mut a = [0u8; 88];
        let (size, mode, nlink) = if ino == ROOT_INO {
            (0u64, 0o040755u32, 2u32)
        } else {
            let perm = if self.info.read_only() { 0o444 } else { 0o644 };
            (self.info.size, 0o100000 | perm, 1)
        };
        a[0..8].copy_from_slice(&ino.to_le_bytes());
        a[8..16].copy_from_slice(&size.to_le_bytes());
        a[16..24].copy_from_slice(&size.div_ceil(512).to_le_bytes());
        // times 0; mode, nlink, uid 0, gid 0, rdev 0, blksize
        a[60..64].copy_from_slice(&mode.to_le_bytes());
        a[64..68].copy_from_slice(&nlink.to_le_bytes());
        a[80..84].copy_from_slice(&self.info.block_size.max(4096).to_le_bytes());
        a
    }

    fn attr_out(&self, ino: u64) -> [u8; 104] {
        let mut o = [0u8; 104];
        o[0..8].copy_from_slice(&1u64.to_le_bytes()); // attr_valid: 1 s
        o[16..].copy_from_slice(&self.attr(ino));
        o
    }
}

// ---- parsing ----

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

struct InHeader {
    len: usize,
    opcode: u32,
    unique: u64,
    nodeid: u64,
}

fn in_header(b: &[u8]) -> Option<InHeader> {
    if b.len() < IN_HEADER {
        return None;
    }
    Some(InHeader {
        len: u32_at(b, 0) as usize,
        opcode: u32_at(b, 4),
        unique: u64_at(b, 8),
        nodeid: u64_at(b, 16),
    })
}

/// The kernel told us the file system is gone, or told us nothing we can go on with.
enum ReadEnd {
    Again,
    Gone,
}

fn read_dev(ctx: &Ctx, buf: &mut [u8]) -> Result<usize, ReadEnd> {
    use rustix::io::Errno;
    match rustix::io::read(&ctx.dev, buf) {
        Ok(n) => Ok(n),
        Err(e) if e == Errno::INTR || e == Errno::AGAIN || e == Errno::NOENT => Err(ReadEnd::Again),
        Err(e) => {
            if e != Errno::NODEV {
                tracing::warn!(export = %ctx.name, "reading /dev/fuse: {e}");
            }
            Err(ReadEnd::Gone)
        }
    }
}

// ---- the reader ----

fn reader(ctx: &Ctx, mut sub: Option<Submitter>, rx: Receiver<Submitter>) {
    let mut plain = vec![0u8; ctx.bufsize];
    let mut wbuf: Option<WriteBuf> = None;
    loop {
        while let Ok(s) = rx.try_recv() {
            sub = Some(s);
            wbuf = None;
        }
        if sub.as_ref().is_some_and(|s| s.is_disconnected()) {
            sub = None;
            wbuf = None;
        }
        if wbuf.is_none() {
            if let Some(s) = &sub {
                match s.write_buf() {
                    Ok(b) => wbuf = Some(b),
                    Err(_) => sub = None,
                }
            }
        }
        let got = match &mut wbuf {
            Some(b) if ctx.bounce => read_dev(ctx, &mut plain).map(|n| {
                // (A request longer than the area fails the header's length check below.)
                let area = b.area_mut();
                let n = n.min(area.len());
                area[..n].copy_from_slice(&plain[..n]);
                n
            }),
            Some(b) => {
                let area = b.area_mut();
                let n = area.len().min(ctx.bufsize);
                read_dev(ctx, &mut area[..n])
            }
            None => read_dev(ctx, &mut plain),
        };
        let n = match got {
            Ok(n) => n,
            Err(ReadEnd::Again) => continue,
            Err(ReadEnd::Gone) => break,
        };
        let bytes: &[u8] = match &wbuf {
            Some(b) => &b.area()[..n],
            None => &plain[..n],
        };
        bump(&ctx.stats.requests);
        let Some(h) = in_header(bytes) else {
            bump(&ctx.stats.refused);
            tracing::warn!(export = %ctx.name, "a FUSE request of {n} bytes");
            continue;
        };
        if h.len != n {
            bump(&ctx.stats.refused);
            ctx.reply_err(h.unique, errno::EINVAL);
            continue;
        }
        if h.opcode == op::WRITE {
            let args = parse_write(ctx, &h, bytes);
            let buf = wbuf.take();
            write(ctx, &mut sub, h.unique, args, buf);
            continue;
        }
        if n > MAX_SMALL_REQUEST {
            bump(&ctx.stats.refused);
            ctx.reply_err(h.unique, errno::EINVAL);
            continue;
        }
        let req = bytes[IN_HEADER..].to_vec();
        if h.opcode == op::DESTROY {
            ctx.reply(h.unique, &[]);
            break;
        }
        handle(ctx, &mut sub, &h, &req);
    }
    // Whatever is pending is answered by the replier or dies with the connection.
    ctx.stop.store(true, Relaxed);
}

/// A WRITE's (offset, size), checked: the payload is exactly the rest of the request.
fn parse_write(ctx: &Ctx, h: &InHeader, b: &[u8]) -> Result<(u64, u32), i32> {
    if b.len() < HEADROOM {
        bump(&ctx.stats.refused);
        return Err(errno::EINVAL);
    }
    if h.nodeid != DISK_INO {
        return Err(EISDIR);
    }
    let offset = u64_at(b, IN_HEADER + 8);
    let size = u32_at(b, IN_HEADER + 16);
    if size as usize != b.len() - HEADROOM {
        bump(&ctx.stats.refused);
        return Err(errno::EINVAL);
    }
    Ok((offset, size))
}

fn write(
    ctx: &Ctx,
    sub: &mut Option<Submitter>,
    unique: u64,
    args: Result<(u64, u32), i32>,
    buf: Option<WriteBuf>,
) {
    bump(&ctx.stats.writes);
    let (offset, size) = match args {
        Ok(a) => a,
        Err(e) => return ctx.reply_err(unique, e),
    };
    if size == 0 {
        return ctx.reply(unique, &0u64.to_le_bytes());
    }
    let bs = ctx.info.block_size as u64;
    let end = offset.checked_add(size as u64);
    if !end.is_some_and(|e| e <= ctx.info.size) {
        return ctx.reply_err(unique, errno::ENOSPC);
    }
    if offset % bs != 0 || size as u64 % bs != 0 {
        // No read-modify-write here: the loop device always writes whole blocks.
        return ctx.reply_err(unique, errno::EINVAL);
    }
    if ctx.info.read_only() {
        return ctx.reply_err(unique, errno::EROFS);
    }
    let (Some(s), Some(mut b)) = (sub.as_mut(), buf) else {
        bump(&ctx.stats.failed_disconnected);
        return ctx.reply_err(unique, errno::EIO);
    };
    if let Err(e) = b.set_payload(HEADROOM, size as usize) {
        return ctx.reply_err(unique, e.errno());
    }
    let write = |s: &mut Submitter| s.submit_write(unique, offset, b, false);
    submit(ctx, s, unique, Pend::Write { size }, write, |u, e| {
        ctx.reply_err(u, e)
    });
}

/// Every request but WRITE and DESTROY. `a`: the arguments after the in-header.
fn handle(ctx: &Ctx, sub: &mut Option<Submitter>, h: &InHeader, a: &[u8]) {
    let u = h.unique;
    let need = |n: usize| -> bool {
        if a.len() < n {
            bump(&ctx.stats.refused);
            ctx.reply_err(u, errno::EINVAL);
            false
        } else {
            true
        }
    };
    let io = |sub: &mut Option<Submitter>,
              pend: Pend,
              f: &mut dyn FnMut(&mut Submitter) -> Result<(), BlkError>| {
        submit_to(ctx, sub, u, pend, f, |u, e| ctx.reply_err(u, e))
    };
    match h.opcode {
        op::INIT => {
            if !need(16) {
                return;
            }
            init(ctx, u, a);
        }
        op::LOOKUP => {
            let name = a.split(|b| *b == 0).next().unwrap_or(&[]);
            if h.nodeid != ROOT_INO {
                return ctx.reply_err(u, ENOTDIR);
            }
            if name != DISK_NAME.as_bytes() {
                return ctx.reply_quiet(u, errno::ENOENT);
            }
            let mut e = [0u8; 128];
            e[0..8].copy_from_slice(&DISK_INO.to_le_bytes());
            e[16..24].copy_from_slice(&1u64.to_le_bytes()); // entry_valid
            e[24..32].copy_from_slice(&1u64.to_le_bytes()); // attr_valid
            e[40..].copy_from_slice(&ctx.attr(DISK_INO));
            ctx.reply(u, &e);
        }
        op::FORGET | op::BATCH_FORGET | op::INTERRUPT => {}
        op::GETATTR => match h.nodeid {
            ROOT_INO | DISK_INO => ctx.reply(u, &ctx.attr_out(h.nodeid)),
            _ => ctx.reply_err(u, errno::ENOENT),
        },
        op::SETATTR => {
            if !need(88) {
                return;
            }
            let valid = u32_at(a, 0);
            let size = u64_at(a, 16);
            if valid & FATTR_SIZE != 0 && (h.nodeid != DISK_INO || size != ctx.info.size) {
                return ctx.reply_err(u, EPERM);
            }
            // Modes, owners and times are not kept: the attributes stay as they are.
            match h.nodeid {
                ROOT_INO | DISK_INO => ctx.reply(u, &ctx.attr_out(h.nodeid)),
                _ => ctx.reply_err(u, errno::ENOENT),
            }
        }
        op::ACCESS => ctx.reply(u, &[]),
        op::OPEN => {
            if !need(8) {
                return;
            }
            if h.nodeid != DISK_INO {
                return ctx.reply_err(u, EISDIR);
            }
            let flags = u32_at(a, 0);
            if ctx.info.read_only() && flags & 3 != 0 {
                return ctx.reply_err(u, errno::EROFS);
            }
            let mut o = [0u8; 16];
            let f = FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES;
            o[8..12].copy_from_slice(&f.to_le_bytes());
            ctx.reply(u, &o);
        }
        op::OPENDIR => {
            if h.nodeid != ROOT_INO {
                return ctx.reply_err(u, ENOTDIR);
            }
            ctx.reply(u, &[0u8; 16]);
        }
        op::RELEASE | op::RELEASEDIR | op::FSYNCDIR => ctx.reply(u, &[]),
        op::READDIR => {
            if !need(24) {
                return;
            }
            readdir(ctx, u, u64_at(a, 8), u32_at(a, 16) as usize);
        }
        op::STATFS => {
            let mut s = [0u8; 80];
            let bs = 4096u64;
            let blocks = ctx.info.size / bs;
            s[0..8].copy_from_slice(&blocks.to_le_bytes());
            s[40..44].copy_from_slice(&(bs as u32).to_le_bytes());
            s[44..48].copy_from_slice(&255u32.to_le_bytes());
            s[48..52].copy_from_slice(&(bs as u32).to_le_bytes());
            s[24..32].copy_from_slice(&2u64.to_le_bytes());
            ctx.reply(u, &s);
        }
        op::READ => {
            if !need(24) {
                return;
            }
            bump(&ctx.stats.reads);
            if h.nodeid != DISK_INO {
                return ctx.reply_err(u, EISDIR);
            }
            let (offset, size) = (u64_at(a, 8), u32_at(a, 16) as u64);
            let i = &ctx.info;
            let Some((start, rlen, skip, len)) =
                read_span(offset, size, i.size, i.block_size as u64, i.max_io as u64)
            else {
                return ctx.reply(u, &[]);
            };
            let pend = Pend::Read { skip, len };
            io(sub, pend, &mut |s| s.submit_read(u, start, rlen));
        }
        op::FLUSH | op::FSYNC => {
            bump(&ctx.stats.flushes);
            if ctx.flush_is_local() {
                return ctx.reply(u, &[]);
            }
            io(sub, Pend::Empty, &mut |s| s.submit_flush(u));
        }
        op::FALLOCATE => {
            if !need(32) {
                return;
            }
            let (offset, len, mode) = (u64_at(a, 8), u64_at(a, 16), u32_at(a, 24));
            let end = offset.checked_add(len);
            if !end.is_some_and(|e| e <= ctx.info.size) {
                return ctx.reply_err(u, errno::EOPNOTSUPP);
            }
            if mode == 0 {
                // Allocating within the file: it is all there.
                return ctx.reply(u, &[]);
            }
            let punch = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
            let zero = FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE;
            let bs = ctx.info.block_size as u64;
            if (mode != punch && mode != zero && mode != FALLOC_FL_ZERO_RANGE)
                || !ctx.info.can_discard()
                || len > u32::MAX as u64
            {
                return ctx.reply_err(u, errno::EOPNOTSUPP);
            }
            if offset % bs != 0 || len % bs != 0 {
                return ctx.reply_err(u, errno::EINVAL);
            }
            if len == 0 {
                return ctx.reply(u, &[]);
            }
            bump(&ctx.stats.discards);
            // (A discard reads back as zeros: it is a zero-range too.)
            io(sub, Pend::Empty, &mut |s| {
                s.submit_discard(u, offset, len as u32)
            });
        }
        _ => ctx.reply_quiet(u, ENOSYS),
    }
}

/// A READ of `size` bytes at `offset` of a disk of `disk` bytes: the blk read, rounded out
/// to whole blocks (a reader of the file may ask for any range) and at most `max_io` —
/// `(start, len)` — and the part of its data to answer, `(skip, len)` (shorter at the end
/// of the disk or past max I/O, as a short read may be). `None`: nothing to read (at or
/// past the end, or zero bytes).
fn read_span(
    offset: u64,
    size: u64,
    disk: u64,
    bs: u64,
    max_io: u64,
) -> Option<(u64, u32, usize, usize)> {
    if offset >= disk || size == 0 {
        return None;
    }
    let end = offset.saturating_add(size).min(disk);
    let start = offset - offset % bs;
    let rend = end.div_ceil(bs).saturating_mul(bs).min(disk);
    let rlen = (rend - start).min(max_io);
    let skip = (offset - start) as usize;
    let len = ((start + rlen).min(end) - offset) as usize;
    Some((start, rlen as u32, skip, len))
}

fn init(ctx: &Ctx, u: u64, a: &[u8]) {
    let (major, minor) = (u32_at(a, 0), u32_at(a, 4));
    let (max_readahead, flags) = (u32_at(a, 8), u32_at(a, 12));
    let mut o = [0u8; 64];
    o[0..4].copy_from_slice(&7u32.to_le_bytes());
    if major != 7 {
        // A newer major: answer ours, the kernel tries again (or gives up).
        return ctx.reply(u, &o[..8]);
    }
    if minor < 28 {
        tracing::warn!(export = %ctx.name, "FUSE 7.{minor}: too old (7.28 needed)");
        return ctx.reply_err(u, errno::EPROTO);
    }
    let want =
        FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES;
    let max_io = ctx.info.max_io;
    let qd = ctx.info.queue_depth.clamp(1, u16::MAX as u32) as u16;
    o[4..8].copy_from_slice(&31u32.min(minor).to_le_bytes());
    o[8..12].copy_from_slice(&max_readahead.min(max_io).to_le_bytes());
    o[12..16].copy_from_slice(&(flags & want).to_le_bytes());
    // max_background, congestion_threshold: as many as our queue takes.
    o[16..18].copy_from_slice(&qd.to_le_bytes());
    o[18..20].copy_from_slice(&(qd - qd / 4).max(1).to_le_bytes());
    o[20..24].copy_from_slice(&max_io.to_le_bytes());
    o[24..28].copy_from_slice(&1u32.to_le_bytes()); // time_gran
    let pages = (max_io / 4096).clamp(1, u16::MAX as u32) as u16;
    o[28..30].copy_from_slice(&pages.to_le_bytes());
    tracing::debug!(export = %ctx.name, "FUSE 7.{minor}, flags {:#x}", flags & want);
    ctx.reply(u, &o);
}

fn readdir(ctx: &Ctx, u: u64, offset: u64, size: usize) {
    let entries: [(u64, &str, u32); 3] = [
        (ROOT_INO, ".", 4),
        (ROOT_INO, "..", 4),
        (DISK_INO, DISK_NAME, 8),
    ];
    let mut out = Vec::new();
    for (i, (ino, name, typ)) in entries.iter().enumerate().skip(offset as usize) {
        let rec = (24 + name.len()).div_ceil(8) * 8;
        if out.len() + rec > size {
            break;
        }
        out.extend_from_slice(&ino.to_le_bytes());
        out.extend_from_slice(&(i as u64 + 1).to_le_bytes());
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&typ.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.resize(out.len().div_ceil(8) * 8, 0);
    }
    ctx.reply(u, &out);
}

// ---- the replier ----

fn answer(ctx: &Ctx, c: Completion) {
    let Some(p) = lock(&ctx.pending).remove(&c.tag()) else {
        return;
    };
    let u = c.tag();
    if !c.is_ok() {
        return ctx.reply_err(u, c.status());
    }
    match p {
        Pend::Read { skip, len } => {
            let d = c.data();
            let Some(d) = d.get(skip..skip + len) else {
                return ctx.reply_err(u, errno::EIO);
            };
            ctx.stats.bytes_read.fetch_add(len as u64, Relaxed);
            let h = out_header(u, 0, OUT_HEADER + len);
            if ctx.bounce {
                // The FUSE device cannot take the data from a device mapping: a copy of ours.
                let mut copy = vec![0u8; len];
                copy.copy_from_slice(d);
                return ctx.send(&[&h, &copy]);
            }
            ctx.send(&[&h, d]);
        }
        Pend::Write { size } => {
            ctx.stats.bytes_written.fetch_add(size as u64, Relaxed);
            let mut w = [0u8; 8];
            w[0..4].copy_from_slice(&size.to_le_bytes());
            ctx.reply(u, &w);
        }
        Pend::Empty => ctx.reply(u, &[]),
    }
}

// ---- the connector ----

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_rounded_to_blocks_and_clipped() {
        const M: u64 = 1 << 20;
        // Aligned: as asked.
        assert_eq!(
            read_span(4096, 4096, M, 512, M),
            Some((4096, 4096, 0, 4096))
        );
        // Unaligned both ends: whole blocks read, the middle answered.
        assert_eq!(read_span(100, 10, M, 512, M), Some((0, 512, 100, 10)));
        assert_eq!(read_span(510, 4, M, 512, M), Some((0, 1024, 510, 4)));
        // Past the end: clipped; at or after it, nothing.
        assert_eq!(
            read_span(M - 512, 4096, M, 512, M),
            Some((M - 512, 512, 0, 512))
        );
        assert_eq!(read_span(M, 4096, M, 512, M), None);
        assert_eq!(read_span(u64::MAX, u64::MAX, M, 512, M), None);
        assert_eq!(read_span(0, 0, M, 512, M), None);
        // More than max I/O: a short read.
        assert_eq!(
            read_span(100, 8192, M, 512, 4096),
            Some((0, 4096, 100, 3996))
        );
        // Huge sizes do not overflow.
        assert_eq!(
            read_span(512, u64::MAX, M, 512, M),
            Some((512, M as u32 - 512, 0, M as usize - 512))
        );
    }

    #[test]
    fn headers_are_checked_and_encoded() {
        assert!(in_header(&[0u8; IN_HEADER - 1]).is_none());
        let mut b = [0u8; IN_HEADER];
        b[0..4].copy_from_slice(&40u32.to_le_bytes());
        b[4..8].copy_from_slice(&op::GETATTR.to_le_bytes());
        b[8..16].copy_from_slice(&77u64.to_le_bytes());
        b[16..24].copy_from_slice(&DISK_INO.to_le_bytes());
        let h = in_header(&b).unwrap();
        assert_eq!(
            (h.len, h.opcode, h.unique, h.nodeid),
            (40, op::GETATTR, 77, DISK_INO)
        );
        let o = out_header(9, errno::EIO, 16);
        assert_eq!(u32_at(&o, 0), 16);
        assert_eq!(i32::from_le_bytes(o[4..8].try_into().unwrap()), -errno::EIO);
        assert_eq!(u64_at(&o, 8), 9);
    }
}
