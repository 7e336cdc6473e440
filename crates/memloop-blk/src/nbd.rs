//! The NBD frontend: an attachment shown to the client's kernel as `/dev/nbdN`, its NBD client
//! driven through `ioctl`s on one end of a Unix socket pair, the other end ours. It needs the
//! kernel's `nbd` module (the QEMU guests' Debian kernel has it; this project's host kernel does
//! not, where [`crate::fuse`] serves) and no loop device.
//!
//! Copies on our side of the kernel:
//!
//! - **WRITE**: the payload is received from the socket straight into a [`WriteBuf`] of the
//!   client's pool (a plain `read`, so a device mapping such as the ivshmem BAR is fine: the
//!   kernel copies into it without pinning pages) and submitted as it lies.
//! - **READ**: the reply is `writev(header, completion data)` from the server's buffer.
//!
//! The transmission protocol (the kernel skips the handshake when set up by `ioctl`): requests
//! of 28 bytes (magic `0x25609513`, flags << 16 | command, 8-byte handle, offset, length, all
//! big-endian) followed by a WRITE's payload; replies of 16 bytes (magic `0x67446698`, error,
//! handle) followed by a READ's data. The handle is the blk tag.

use crate::attach::{
    self, bump, lock, submit, submit_to, Core, FrontendOptions, FrontendStats, Pend,
};
use crate::client::{BlkClient, ClientOptions, Completion, Submitter};
use crate::error::BlkError;
use crate::proto::{errno, ExportInfo};
use memloop::Node;
use memloop_shm::nbd::{self, NbdDevice, NbdGeometry};
use std::io::{IoSlice, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

const REQUEST_MAGIC: u32 = 0x2560_9513;
const REPLY_MAGIC: u32 = 0x6744_6698;
const REQUEST_LEN: usize = 28;
const REPLY_LEN: usize = 16;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const FLAG_FUA: u16 = 1;

/// One request's header, as read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Request {
    cmd: u16,
    flags: u16,
    handle: u64,
    offset: u64,
    len: u32,
}

/// Parses a request header; `None` if its magic is wrong (the stream cannot be trusted).
fn parse(h: &[u8; REQUEST_LEN]) -> Option<Request> {
    let be32 = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().expect("4 bytes"));
    let be64 = |at: usize| u64::from_be_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    if be32(0) != REQUEST_MAGIC {
        return None;
    }
    let ty = be32(4);
    Some(Request {
        cmd: ty as u16,
        flags: (ty >> 16) as u16,
        handle: be64(8),
        offset: be64(16),
        len: be32(24),
    })
}

/// What is left of `parts` once their first `done` bytes are sent (empty pieces left out).
fn rest_of<'a>(parts: &[&'a [u8]], done: usize) -> Vec<&'a [u8]> {
    let mut skip = done;
    parts
        .iter()
        .filter_map(|p| {
            let rest = p.get(skip..).filter(|r| !r.is_empty());
            skip = skip.saturating_sub(p.len());
            rest
        })
        .collect()
}

fn reply_header(handle: u64, error: i32) -> [u8; REPLY_LEN] {
    let mut h = [0u8; REPLY_LEN];
    h[0..4].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&(error as u32).to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h
}

/// Whether `r`'s range is whole blocks inside the export, and (for data) at most max I/O
/// long; a discard moves no data and may cover more.
fn range_ok(info: &ExportInfo, r: &Request) -> bool {
    let bs = u64::from(info.block_size);
    let (off, len) = (r.offset, u64::from(r.len));
    len > 0
        && (r.cmd == CMD_TRIM || len <= u64::from(info.max_io))
        && off % bs == 0
        && len % bs == 0
        && off.checked_add(len).is_some_and(|end| end <= info.size)
}

struct Ctx {
    core: Core,
    sock: UnixStream,
    /// Replies come from two threads (errors from the reader, the rest from the replier):
    /// one at a time, each whole.
    send: Mutex<()>,
}

impl std::ops::Deref for Ctx {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Ctx {
    fn send(&self, parts: &[&[u8]]) {
        let _one = lock(&self.send);
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut done = 0;
        while done < total {
            let iov: Vec<IoSlice<'_>> =
                rest_of(parts, done).into_iter().map(IoSlice::new).collect();
            match (&self.sock).write_vectored(&iov) {
                Ok(0) => return,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(export = %self.name, "an NBD reply: {e}");
                    return;
                }
            }
        }
    }

    fn reply(&self, handle: u64, data: &[u8]) {
        self.send(&[&reply_header(handle, 0), data]);
    }

    /// An error answer, counted in [`FrontendStats::errors`].
    fn reply_err(&self, handle: u64, errno: i32) {
        bump(&self.stats.errors);
        self.send(&[&reply_header(handle, errno)]);
    }
}

/// An attached NBD device and its threads. Dropping it disconnects the device.
pub struct NbdFrontend {
    ctx: Arc<Ctx>,
    dev: Arc<NbdDevice>,
    threads: Vec<JoinHandle<()>>,
}

impl NbdFrontend {
    /// Whether this kernel has NBD devices (the `nbd` module loaded).
    pub fn available() -> bool {
        Path::new("/sys/module/nbd").exists()
    }

    /// Attaches to export `name` on the first free `/dev/nbdN`.
    pub fn start(node: &Node, name: &str, fo: FrontendOptions) -> Result<NbdFrontend, BlkError> {
        let opts = ClientOptions::default();
        let client = BlkClient::connect_with(node, name, opts)?;
        let info = *client.info();
        let (ours, theirs) = UnixStream::pair()?;
        widen(&ours, &theirs, info.max_io);
        let dev = Arc::new(configure_free_device(&info, &theirs)?);
        // The device holds its own reference to its end.
        drop(theirs);
        limit_request_size(dev.path(), info.max_io);
        let ctx = Arc::new(Ctx {
            core: Core::new(name, info),
            sock: ours,
            send: Mutex::new(()),
        });
        let mut threads = attach::start(
            &ctx,
            node,
            client,
            (fo, opts),
            |c, sub, rx| reader(c, Some(sub), rx),
            answer,
        )?;
        let (c, d) = (ctx.clone(), dev.clone());
        threads.push(
            std::thread::Builder::new()
                .name("blk-nbd".into())
                .spawn(move || {
                    if let Err(e) = d.run() {
                        tracing::info!(export = %c.name, "the NBD device ended: {e}");
                    }
                    c.stop.store(true, Relaxed);
                })?,
        );
        Ok(NbdFrontend { ctx, dev, threads })
    }

    /// The block device (`/dev/nbdN`).
    pub fn device(&self) -> PathBuf {
        self.dev.path().into()
    }

    pub fn info(&self) -> ExportInfo {
        self.ctx.info
    }

    pub fn stats(&self) -> FrontendStats {
        self.ctx.core.stats()
    }

    /// The device was disconnected (by `nbd-client -d`, or the socket failed): nothing is
    /// served any more.
    pub fn ended(&self) -> bool {
        self.ctx.stop.load(Relaxed)
    }
}

impl Drop for NbdFrontend {
    /// Disconnects: the kernel fails what is still queued and lets go of the socket; the
    /// threads end with it, and are joined (their session's buffers go back to the region).
    fn drop(&mut self) {
        let _ = self.dev.disconnect();
        let _ = self.ctx.sock.shutdown(std::net::Shutdown::Both);
        self.ctx.stop.store(true, Relaxed);
        attach::join_within(std::mem::take(&mut self.threads), attach::JOIN_LIMIT);
    }
}

fn configure_free_device(info: &ExportInfo, sock: &UnixStream) -> Result<NbdDevice, BlkError> {
    let mut flags = nbd::flags::HAS_FLAGS | nbd::flags::SEND_FLUSH;
    if info.read_only() {
        flags |= nbd::flags::READ_ONLY;
    } else {
        flags |= nbd::flags::SEND_FUA;
        if info.can_discard() {
            flags |= nbd::flags::SEND_TRIM;
        }
    }
    let g = NbdGeometry {
        block_size: info.block_size,
        size: info.size,
        flags,
    };
    let mut last = None;
    for path in nbd::free_devices() {
        let tried = NbdDevice::open(&path).and_then(|d| d.configure(sock.as_fd(), g).map(|()| d));
        match tried {
            Ok(d) => return Ok(d),
            // Taken meanwhile by another server: the next one.
            Err(e) => last = Some(e),
        }
    }
    Err(BlkError::Io(last.unwrap_or_else(|| {
        std::io::Error::other("no free NBD device (is the nbd module loaded?)")
    })))
}

/// Socket buffers that hold a whole request or reply: with the defaults (~200 KiB) a 1 MiB
/// WRITE crosses in several rounds of the device's sender blocking and our reader waking.
/// (Root may exceed the system's limits; if not, the defaults serve, only slower.)
fn widen(ours: &UnixStream, theirs: &UnixStream, max_io: u32) {
    use rustix::net::sockopt;
    let want = 2 * max_io as usize + (64 << 10);
    for s in [ours, theirs] {
        let _ = sockopt::set_socket_send_buffer_size_force(s, want)
            .or_else(|_| sockopt::set_socket_send_buffer_size(s, want));
        let _ = sockopt::set_socket_recv_buffer_size_force(s, want)
            .or_else(|_| sockopt::set_socket_recv_buffer_size(s, want));
    }
}

/// Keeps the kernel's requests within the export's max I/O (the device allows far more).
fn limit_request_size(dev: &Path, max_io: u32) {
    let name = dev
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let knob = format!("/sys/block/{name}/queue/max_sectors_kb");
    let kb = (max_io / 1024).max(4);
    if let Err(e) = std::fs::write(&knob, kb.to_string()) {
        tracing::warn!("{knob}: {e} (requests over {max_io} bytes will be refused)");
    }
}

// ---- the reader ----

fn reader(ctx: &Ctx, mut sub: Option<Submitter>, rx: Receiver<Submitter>) {
    let mut scratch = vec![0u8; ctx.info.max_io as usize];
    loop {
        while let Ok(s) = rx.try_recv() {
            sub = Some(s);
        }
        if sub.as_ref().is_some_and(|s| s.is_disconnected()) {
            sub = None;
        }
        let mut h = [0u8; REQUEST_LEN];
        if (&ctx.sock).read_exact(&mut h).is_err() {
            break;
        }
        bump(&ctx.stats.requests);
        let Some(r) = parse(&h) else {
            bump(&ctx.stats.refused);
            tracing::warn!(export = %ctx.name, "an NBD request with a bad magic: giving up the device");
            break;
        };
        match r.cmd {
            CMD_WRITE => {
                if write(ctx, &mut sub, &r, &mut scratch).is_err() {
                    break;
                }
            }
            CMD_DISC => break,
            _ => handle(ctx, &mut sub, &r),
        }
    }
    ctx.stop.store(true, Relaxed);
}

/// A WRITE: its payload into a pool buffer (or, if it cannot be served, read past, to keep
/// the stream in step), then submitted. `Err` only if the socket failed.
fn write(
    ctx: &Ctx,
    sub: &mut Option<Submitter>,
    r: &Request,
    scratch: &mut [u8],
) -> std::io::Result<()> {
    bump(&ctx.stats.writes);
    let len = r.len as usize;
    let ok = range_ok(&ctx.info, r);
    let target = match (ok, sub.as_mut()) {
        (true, Some(s)) => s.write_buf().ok().map(|b| (s, b)),
        _ => None,
    };
    let Some((s, mut b)) = target else {
        let mut left = len;
        while left > 0 {
            let n = left.min(scratch.len());
            (&ctx.sock).read_exact(&mut scratch[..n])?;
            left -= n;
        }
        let e = if ok {
            bump(&ctx.stats.failed_disconnected);
            errno::EIO
        } else {
            bump(&ctx.stats.refused);
            errno::EINVAL
        };
        ctx.reply_err(r.handle, e);
        return Ok(());
    };
    // (Within the buffer: `range_ok` bounds it by max I/O, the buffer's size.)
    let area = b.payload_mut(len).map_err(std::io::Error::other)?;
    (&ctx.sock).read_exact(area)?;
    if ctx.info.read_only() {
        ctx.reply_err(r.handle, errno::EROFS);
        return Ok(());
    }
    let (h, off, fua) = (r.handle, r.offset, r.flags & FLAG_FUA != 0);
    let pend = Pend::Write { size: r.len };
    let go = |s: &mut Submitter| s.submit_write(h, off, b, fua);
    submit(ctx, s, h, pend, go, |u, e| ctx.reply_err(u, e));
    Ok(())
}

/// READ, FLUSH, TRIM and anything else.
fn handle(ctx: &Ctx, sub: &mut Option<Submitter>, r: &Request) {
    let h = r.handle;
    let io = |sub: &mut Option<Submitter>,
              pend: Pend,
              f: &mut dyn FnMut(&mut Submitter) -> Result<(), BlkError>| {
        submit_to(ctx, sub, h, pend, f, |u, e| ctx.reply_err(u, e))
    };
    match r.cmd {
        CMD_READ => {
            bump(&ctx.stats.reads);
            if !range_ok(&ctx.info, r) {
                bump(&ctx.stats.refused);
                return ctx.reply_err(h, errno::EINVAL);
            }
            let pend = Pend::Read {
                skip: 0,
                len: r.len as usize,
            };
            io(sub, pend, &mut |s| s.submit_read(h, r.offset, r.len));
        }
        CMD_FLUSH => {
            bump(&ctx.stats.flushes);
            if ctx.flush_is_local() {
                return ctx.reply(h, &[]);
            }
            io(sub, Pend::Empty, &mut |s| s.submit_flush(h));
        }
        CMD_TRIM => {
            bump(&ctx.stats.discards);
            if ctx.info.read_only() {
                return ctx.reply_err(h, errno::EROFS);
            }
            if !range_ok(&ctx.info, r) {
                bump(&ctx.stats.refused);
                return ctx.reply_err(h, errno::EINVAL);
            }
            io(sub, Pend::Empty, &mut |s| {
                s.submit_discard(h, r.offset, r.len)
            });
        }
        _ => {
            bump(&ctx.stats.refused);
            ctx.reply_err(h, errno::EINVAL);
        }
    }
}

// ---- the replier's answers ----

fn answer(ctx: &Ctx, c: Completion) {
    let Some(p) = lock(&ctx.pending).remove(&c.tag()) else {
        return;
    };
    let h = c.tag();
    if !c.is_ok() {
        return ctx.reply_err(h, c.status());
    }
    match p {
        Pend::Read { len, .. } => {
            let Some(d) = c.data().get(..len) else {
                return ctx.reply_err(h, errno::EIO);
            };
            ctx.stats.bytes_read.fetch_add(len as u64, Relaxed);
            ctx.reply(h, d);
        }
        Pend::Write { size } => {
            ctx.stats.bytes_written.fetch_add(u64::from(size), Relaxed);
            ctx.reply(h, &[]);
        }
        Pend::Empty => ctx.reply(h, &[]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ExportInfo {
        ExportInfo {
            token: 1,
            size: 1 << 20,
            block_size: 512,
            max_io: 64 << 10,
            queue_depth: 8,
            flags: 0,
        }
    }

    fn header(cmd: u16, flags: u16, handle: u64, off: u64, len: u32) -> [u8; REQUEST_LEN] {
        let mut h = [0u8; REQUEST_LEN];
        h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[4..8].copy_from_slice(&((u32::from(flags) << 16) | u32::from(cmd)).to_be_bytes());
        h[8..16].copy_from_slice(&handle.to_be_bytes());
        h[16..24].copy_from_slice(&off.to_be_bytes());
        h[24..28].copy_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn requests_are_parsed_and_ranges_checked() {
        let r = parse(&header(CMD_WRITE, FLAG_FUA, 0xdead_beef, 4096, 8192)).unwrap();
        assert_eq!(
            (r.cmd, r.flags, r.handle, r.offset, r.len),
            (1, 1, 0xdead_beef, 4096, 8192)
        );
        assert!(range_ok(&info(), &r));
        let mut bad = header(CMD_READ, 0, 1, 0, 512);
        bad[0] ^= 1;
        assert!(parse(&bad).is_none(), "a wrong magic");
        let at = |off: u64, len: u32| parse(&header(CMD_READ, 0, 1, off, len)).unwrap();
        assert!(!range_ok(&info(), &at(100, 512)), "unaligned offset");
        assert!(!range_ok(&info(), &at(0, 100)), "unaligned length");
        assert!(!range_ok(&info(), &at(0, 0)), "empty");
        assert!(!range_ok(&info(), &at(0, 128 << 10)), "over max I/O");
        let trim = parse(&header(CMD_TRIM, 0, 1, 0, 512 << 10)).unwrap();
        assert!(
            range_ok(&info(), &trim),
            "a discard is not bound by max I/O"
        );
        assert!(
            !range_ok(&info(), &at((1 << 20) - 512, 1024)),
            "past the end"
        );
        assert!(!range_ok(&info(), &at(u64::MAX - 511, 512)), "overflow");
    }

    #[test]
    fn a_partly_sent_reply_goes_on_where_it_stopped() {
        let (h, d): (&[u8], &[u8]) = (b"0123", b"abcdefgh");
        let parts = [h, &[][..], d];
        assert_eq!(rest_of(&parts, 0), vec![h, d]);
        assert_eq!(rest_of(&parts, 3), vec![&b"3"[..], d]);
        assert_eq!(rest_of(&parts, 4), vec![d]);
        assert_eq!(rest_of(&parts, 9), vec![&b"fgh"[..]]);
        assert!(rest_of(&parts, 12).is_empty());
        assert!(rest_of(&parts, 20).is_empty());
    }

    #[test]
    fn replies_are_big_endian_with_the_handle() {
        let h = reply_header(0x0102_0304_0506_0708, 5);
        assert_eq!(&h[0..4], &REPLY_MAGIC.to_be_bytes());
        assert_eq!(&h[4..8], &5u32.to_be_bytes());
        assert_eq!(&h[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
    }
}
