//! One transfer between two descriptors, moved in bounded chunks so that tenants can take turns.
//!
//! [`Transfer::new`] checks both ends (`fstat`, access mode, no listening socket, no directory)
//! and picks the kernel primitive that suits the pair:
//!
//! | source → sink | primitive |
//! | --- | --- |
//! | file → file | `copy_file_range` |
//! | file → socket, file → other (a char device such as `/dev/null`) | `sendfile` |
//! | file → pipe, pipe → file/socket/pipe, socket → pipe | `splice` |
//! | socket → socket, socket → file | `splice` twice, through a pipe of the transfer's own |
//! | anything else | `read` + `write` through a 256 KiB buffer ([`Primitive::Copy`]) |
//!
//! When the kernel refuses a primitive with an error that means "not supported for these
//! descriptors" (`EINVAL`, `EXDEV`, `EOPNOTSUPP`, `ENOSYS`; and `EBADF` from `copy_file_range`
//! onto an `O_APPEND` file), the transfer falls back along
//! `copy_file_range → sendfile → splice via a pipe → copy` (`splice` falls back to copy) and
//! retries within the same [`Transfer::step`]; [`Transfer::fallback_log`] says what was refused.
//! Every other error is returned as [`PipeError::Io`].
//!
//! The descriptors are shared with the client, so the transfer never changes their flags.
//! Without a source offset, files are read and written at their own positions, and a client
//! sees its offsets advanced by the bytes moved (as with `sendfile(…, NULL, …)`). With one
//! (`src_off`, a regular-file source only: `sendfile(…, &off, …)`), the source is read at that
//! offset — the primitives get an offset pointer, the copy loop `pread`s — and its file
//! position is left alone; [`Transfer::src_offset`] says where the next read would start. The
//! sink is always written at its own position. Bytes read from the source but not yet written
//! to the sink (in the transfer's pipe or copy buffer) are [`Transfer::held`]; they are not
//! counted in [`Transfer::moved`].
//!
//! A step never waits. Before reading from a socket or a pipe it polls it with a zero timeout
//! and reports [`Step::WaitInput`] when there is nothing to read; before writing to a socket or
//! a pipe it polls for writability and reports [`Step::WaitOutput`]. Since a shared, blocking
//! socket cannot be written with `MSG_DONTWAIT` through `splice`/`sendfile`, each such write
//! is capped at a quarter of the socket's send buffer, which a writable socket always has free
//! (TCP reports writable with at least a third free, a Unix stream socket with three quarters).
//! Pipe ends are spliced with `SPLICE_F_NONBLOCK`; the copy loop uses `MSG_DONTWAIT` on sockets
//! and `PIPE_BUF`-sized writes on pipes. Files and character devices count as always ready.
//!
//! Writing to a socket or pipe whose reader is gone raises `SIGPIPE` in the calling process
//! (the kernel does it for `splice` and `sendfile` too): the process running transfers must
//! ignore `SIGPIPE` (Rust programs do by default); the error then comes back as `EPIPE`.

use crate::PipeError;
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{FileType, OFlags};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};
use rustix::pipe::{PipeFlags, SpliceFlags};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The copy loop's buffer.
const COPY_BUF: usize = 256 * 1024;
/// The size asked for the transfer's own pipe (socket → socket, socket → file).
const VIA_PIPE_SIZE: usize = 1 << 20;
/// A write of at most this many bytes to a pipe that polls writable does not block.
const PIPE_BUF: usize = 4096;
/// The largest count handed to one system call.
const MAX_CALL: u64 = 1 << 30;

/// What a descriptor is, as far as moving bytes goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndKind {
    File,
    Socket,
    Pipe,
    /// A character device or anything else that reads and writes (`/dev/null`, a tty).
    Other,
}

/// The kernel primitive a transfer uses (after any fallback).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Primitive {
    CopyFileRange,
    Sendfile,
    Splice,
    /// Two splices through a pipe of the service's own (socket → socket, socket → file).
    SpliceViaPipe,
    /// read + write through a buffer: the last resort, counted.
    Copy,
}

/// What one chunk did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Moved this many bytes to the sink; call again (the next step may find the transfer
    /// [`Step::Done`]). `Moved(0)` only for a budget of zero.
    Moved(u64),
    /// The source has nothing to read now: wait until `src` is readable.
    WaitInput,
    /// The sink cannot take more now: wait until `dst` is writable.
    WaitOutput,
    /// Finished: the length was reached, or the source ended (EOF) when the length was "all".
    Done,
}

/// A primitive the kernel refused, and what the transfer used instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Fallback {
    pub from: Primitive,
    pub to: Primitive,
    /// The `errno` of the refusal.
    pub errno: i32,
}

/// The transfer's own pipe, between two splices.
struct ViaPipe {
    r: OwnedFd,
    w: OwnedFd,
    cap: usize,
    /// Bytes in the pipe (read from the source, not yet written to the sink).
    held: usize,
}

/// The copy loop's buffer: `buf[start..end]` is read and not yet written.
struct CopyBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// Why a primitive's loop stopped (bytes moved are already counted).
enum Stop {
    Budget,
    Input,
    Output,
    /// The length is reached, or the source ended and nothing is held.
    End,
}

pub struct Transfer {
    src: OwnedFd,
    dst: OwnedFd,
    src_kind: EndKind,
    dst_kind: EndKind,
    len: Option<u64>,
    /// Where the next read of the source starts, when the transfer reads at an offset.
    src_off: Option<u64>,
    dst_append: bool,
    primitive: Primitive,
    moved: u64,
    src_eof: bool,
    via: Option<ViaPipe>,
    copy: Option<CopyBuf>,
    fallbacks: Vec<Fallback>,
}

impl Transfer {
    /// Checks both descriptors and picks a primitive. `len`: `None` = until end of input.
    /// `src_off`: read the source, which must then be a regular file, from this offset
    /// without moving its file position (`None`: at and advancing its position).
    pub fn new(
        src: OwnedFd,
        dst: OwnedFd,
        len: Option<u64>,
        src_off: Option<u64>,
    ) -> Result<Transfer, PipeError> {
        let (src_kind, _) = check_end(src.as_fd(), "source", false)?;
        let (dst_kind, dst_flags) = check_end(dst.as_fd(), "sink", true)?;
        if len == Some(0) {
            return Err(PipeError::BadLength(0));
        }
        if let Some(off) = src_off {
            if src_kind != EndKind::File {
                return Err(PipeError::BadFd {
                    which: "source",
                    why: format!("an offset on a non-file ({src_kind:?})"),
                });
            }
            if off > i64::MAX as u64 {
                return Err(PipeError::Io(Errno::INVAL.into()));
            }
        }
        let primitive = choose(src_kind, dst_kind);
        let via = if primitive == Primitive::SpliceViaPipe {
            Some(ViaPipe::new()?)
        } else {
            None
        };
        Ok(Transfer {
            src,
            dst,
            src_kind,
            dst_kind,
            len,
            src_off,
            dst_append: dst_flags.contains(OFlags::APPEND),
            primitive,
            moved: 0,
            src_eof: false,
            via,
            copy: None,
            fallbacks: Vec::new(),
        })
    }

    /// Moves at most `budget` bytes; never waits for input or output readiness (it reports
    /// [`Step::WaitInput`]/[`Step::WaitOutput`] instead).
    pub fn step(&mut self, budget: usize) -> Result<Step, PipeError> {
        let budget = budget as u64;
        let before = self.moved;
        loop {
            let left = budget - (self.moved - before);
            let result = match self.primitive {
                Primitive::CopyFileRange | Primitive::Sendfile | Primitive::Splice => {
                    self.step_direct(left)
                }
                Primitive::SpliceViaPipe => self.step_via_pipe(left),
                Primitive::Copy => self.step_copy(left),
            };
            match result {
                Ok(stop) => return self.outcome(self.moved - before, stop),
                Err(e) if self.unsupported(e) => self.fall_back(e)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Bytes written to the sink so far.
    pub fn moved(&self) -> u64 {
        self.moved
    }

    /// Bytes read from the source and not yet written to the sink (in the transfer's pipe or
    /// copy buffer): the source's position is ahead of the sink's by this much.
    pub fn held(&self) -> u64 {
        let via = self.via.as_ref().map_or(0, |v| v.held);
        let copy = self.copy.as_ref().map_or(0, |c| c.end - c.start);
        (via + copy) as u64
    }

    /// Reads nothing more from the source: the transfer now ends once the bytes it holds
    /// (read, not yet written) are in the sink. A cancelled transfer ends so, because bytes
    /// taken from a socket cannot be put back.
    pub fn stop_reading(&mut self) {
        self.len = Some(self.moved + self.held());
    }

    /// The primitive in use (the last one fallen back to, if any).
    pub fn primitive(&self) -> Primitive {
        self.primitive
    }

    /// What the source and the sink are.
    pub fn kinds(&self) -> (EndKind, EndKind) {
        (self.src_kind, self.dst_kind)
    }

    /// The length asked for (`None`: until the source ends).
    pub fn length(&self) -> Option<u64> {
        self.len
    }

    /// Where the next read of the source starts, for a transfer that reads at an offset
    /// (`None`: it reads at the file's own position). Ahead of the first offset by
    /// [`Transfer::moved`] + [`Transfer::held`].
    pub fn src_offset(&self) -> Option<u64> {
        self.src_off
    }

    /// How many times the kernel refused a primitive and the transfer fell back.
    pub fn fallbacks(&self) -> u32 {
        self.fallbacks.len() as u32
    }

    /// Each refusal, in order.
    pub fn fallback_log(&self) -> &[Fallback] {
        &self.fallbacks
    }

    pub fn src(&self) -> &OwnedFd {
        &self.src
    }

    pub fn dst(&self) -> &OwnedFd {
        &self.dst
    }

    /// How many more bytes may be read from the source.
    fn room(&self) -> u64 {
        match self.len {
            None => u64::MAX,
            Some(n) => n.saturating_sub(self.moved + self.held()),
        }
    }

    fn outcome(&self, moved_now: u64, stop: Stop) -> Result<Step, PipeError> {
        if moved_now > 0 {
            return Ok(Step::Moved(moved_now));
        }
        Ok(match stop {
            Stop::Budget => Step::Moved(0),
            Stop::Input => Step::WaitInput,
            Stop::Output => Step::WaitOutput,
            Stop::End => match self.len {
                Some(n) if self.moved < n => {
                    return Err(PipeError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("source ended after {} of {} bytes", self.moved, n),
                    )))
                }
                _ => Step::Done,
            },
        })
    }

    /// Whether `e` means "this primitive does not work for these descriptors".
    fn unsupported(&self, e: Errno) -> bool {
        if self.primitive == Primitive::Copy {
            return false;
        }
        matches!(
            e,
            Errno::INVAL | Errno::XDEV | Errno::OPNOTSUPP | Errno::NOSYS
        ) || (e == Errno::BADF && self.primitive == Primitive::CopyFileRange && self.dst_append)
    }

    fn fall_back(&mut self, e: Errno) -> Result<(), PipeError> {
        let from = self.primitive;
        let to = match from {
            Primitive::CopyFileRange => Primitive::Sendfile,
            Primitive::Sendfile => Primitive::SpliceViaPipe,
            Primitive::Splice | Primitive::SpliceViaPipe | Primitive::Copy => Primitive::Copy,
        };
        tracing::debug!(
            ?from,
            ?to,
            errno = e.raw_os_error(),
            "pipe transfer falls back"
        );
        match to {
            Primitive::SpliceViaPipe if self.via.is_none() => self.via = Some(ViaPipe::new()?),
            Primitive::Copy => {
                // Bytes already in the transfer's pipe go to the copy buffer, in order.
                let mut copy = CopyBuf::new(COPY_BUF);
                if let Some(via) = self.via.take() {
                    if copy.buf.len() < via.held {
                        copy.buf.resize(via.held, 0);
                    }
                    while copy.end < via.held {
                        match rustix::io::read(&via.r, &mut copy.buf[copy.end..via.held]) {
                            Ok(0) => return Err(Errno::IO.into()),
                            Ok(n) => copy.end += n,
                            Err(Errno::INTR) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
                self.copy = Some(copy);
            }
            _ => {}
        }
        self.fallbacks.push(Fallback {
            from,
            to,
            errno: e.raw_os_error(),
        });
        self.primitive = to;
        Ok(())
    }

    /// Before a read: how much the source may give now (what is left of the length and of
    /// this step's `budget`), or why the step stops instead — the end, the budget, or a
    /// source with nothing to read.
    fn readable(&self, start: u64, budget: u64) -> Result<Result<u64, Stop>, Errno> {
        let room = self.room();
        if room == 0 || self.src_eof {
            return Ok(Err(Stop::End));
        }
        let left = budget - (self.moved - start);
        if left == 0 {
            return Ok(Err(Stop::Budget));
        }
        if !source_ready(self.src.as_fd(), self.src_kind)? {
            return Ok(Err(Stop::Input));
        }
        Ok(Ok(room.min(left)))
    }

    /// `copy_file_range`, `sendfile` or `splice` straight from the source to the sink.
    fn step_direct(&mut self, budget: u64) -> Result<Stop, Errno> {
        let start = self.moved;
        loop {
            let can = match self.readable(start, budget)? {
                Ok(n) => n,
                Err(stop) => return Ok(stop),
            };
            let Some(cap) = sink_room(self.dst.as_fd(), self.dst_kind)? else {
                return Ok(Stop::Output);
            };
            let want = can.min(cap).min(MAX_CALL) as usize;
            // (The kernel advances the offset by what it read.)
            let off = self.src_off.as_mut();
            let r = match self.primitive {
                Primitive::CopyFileRange => {
                    rustix::fs::copy_file_range(&self.src, off, &self.dst, None, want)
                }
                Primitive::Sendfile => rustix::fs::sendfile(&self.dst, &self.src, off, want),
                _ => rustix::pipe::splice(
                    &self.src,
                    off,
                    &self.dst,
                    None,
                    want,
                    SpliceFlags::NONBLOCK | SpliceFlags::MOVE,
                ),
            };
            match r {
                Ok(0) => self.src_eof = true,
                Ok(n) => self.moved += n as u64,
                Err(Errno::INTR) => {}
                // Only pipe ends (and O_NONBLOCK descriptors, set by their owner) say this.
                Err(Errno::AGAIN) => {
                    return Ok(if source_ready(self.src.as_fd(), self.src_kind)? {
                        Stop::Output
                    } else {
                        Stop::Input
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Source → the transfer's pipe → sink. The pipe is filled only when empty, and drained
    /// first.
    fn step_via_pipe(&mut self, budget: u64) -> Result<Stop, Errno> {
        let start = self.moved;
        loop {
            // Drain what the pipe holds.
            loop {
                let via = self.via.as_mut().expect("splice via pipe without a pipe");
                if via.held == 0 {
                    break;
                }
                let left = budget - (self.moved - start);
                if left == 0 {
                    return Ok(Stop::Budget);
                }
                let Some(cap) = sink_room(self.dst.as_fd(), self.dst_kind)? else {
                    return Ok(Stop::Output);
                };
                let want = (via.held as u64).min(left).min(cap) as usize;
                match rustix::pipe::splice(
                    &via.r,
                    None,
                    &self.dst,
                    None,
                    want,
                    SpliceFlags::NONBLOCK | SpliceFlags::MOVE,
                ) {
                    Ok(0) => return Err(Errno::IO),
                    Ok(n) => {
                        via.held -= n;
                        self.moved += n as u64;
                    }
                    Err(Errno::INTR) => {}
                    Err(Errno::AGAIN) => return Ok(Stop::Output),
                    Err(e) => return Err(e),
                }
            }
            // Refill it.
            let can = match self.readable(start, budget)? {
                Ok(n) => n,
                Err(stop) => return Ok(stop),
            };
            let via = self.via.as_mut().expect("splice via pipe without a pipe");
            let want = can.min(via.cap as u64) as usize;
            match rustix::pipe::splice(
                &self.src,
                self.src_off.as_mut(),
                &via.w,
                None,
                want,
                SpliceFlags::NONBLOCK | SpliceFlags::MOVE,
            ) {
                Ok(0) => self.src_eof = true,
                Ok(n) => via.held += n,
                Err(Errno::INTR) => {}
                // The pipe is empty here, so it is the source that has nothing.
                Err(Errno::AGAIN) => return Ok(Stop::Input),
                Err(e) => return Err(e),
            }
        }
    }

    /// read + write through a buffer.
    fn step_copy(&mut self, budget: u64) -> Result<Stop, Errno> {
        let start = self.moved;
        if self.copy.is_none() {
            self.copy = Some(CopyBuf::new(COPY_BUF));
        }
        loop {
            let left = budget - (self.moved - start);
            let copy = self.copy.as_mut().expect("copy buffer");
            if copy.start < copy.end {
                if left == 0 {
                    return Ok(Stop::Budget);
                }
                if sink_room(self.dst.as_fd(), self.dst_kind)?.is_none() {
                    return Ok(Stop::Output);
                }
                let mut want = ((copy.end - copy.start) as u64).min(left) as usize;
                if self.dst_kind == EndKind::Pipe {
                    want = want.min(PIPE_BUF);
                }
                let data = &copy.buf[copy.start..copy.start + want];
                let r = if self.dst_kind == EndKind::Socket {
                    rustix::net::send(&self.dst, data, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)
                } else {
                    rustix::io::write(&self.dst, data)
                };
                match r {
                    Ok(0) => return Err(Errno::IO),
                    Ok(n) => {
                        copy.start += n;
                        if copy.start == copy.end {
                            copy.start = 0;
                            copy.end = 0;
                        }
                        self.moved += n as u64;
                    }
                    Err(Errno::INTR) => {}
                    Err(Errno::AGAIN) => return Ok(Stop::Output),
                    Err(e) => return Err(e),
                }
                continue;
            }
            let can = match self.readable(start, budget)? {
                Ok(n) => n,
                Err(stop) => return Ok(stop),
            };
            let copy = self.copy.as_mut().expect("copy buffer");
            let want = can.min(copy.buf.len() as u64) as usize;
            let buf = &mut copy.buf[..want];
            let r = if self.src_kind == EndKind::Socket {
                rustix::net::recv(&self.src, buf, RecvFlags::DONTWAIT).map(|(n, _)| n)
            } else if let Some(off) = self.src_off {
                rustix::io::pread(&self.src, buf, off)
            } else {
                rustix::io::read(&self.src, buf)
            };
            match r {
                Ok(0) => self.src_eof = true,
                Ok(n) => {
                    copy.start = 0;
                    copy.end = n;
                    if let Some(off) = &mut self.src_off {
                        *off += n as u64;
                    }
                }
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => return Ok(Stop::Input),
                Err(e) => return Err(e),
            }
        }
    }
}

impl ViaPipe {
    fn new() -> Result<ViaPipe, PipeError> {
        let (r, w) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        // A big pipe means fewer splices; a smaller one still works.
        let _ = rustix::pipe::fcntl_setpipe_size(&w, VIA_PIPE_SIZE);
        let cap = rustix::pipe::fcntl_getpipe_size(&w).unwrap_or(16 * 4096);
        Ok(ViaPipe { r, w, cap, held: 0 })
    }
}

impl CopyBuf {
    fn new(size: usize) -> CopyBuf {
        CopyBuf {
            buf: vec![0; size],
            start: 0,
            end: 0,
        }
    }
}

/// The primitive to try first for a pair.
fn choose(src: EndKind, dst: EndKind) -> Primitive {
    use EndKind::*;
    match (src, dst) {
        (File, File) => Primitive::CopyFileRange,
        (File, Socket) | (File, Other) => Primitive::Sendfile,
        (File, Pipe) | (Pipe, File) | (Pipe, Socket) | (Pipe, Pipe) | (Socket, Pipe) => {
            Primitive::Splice
        }
        (Socket, Socket) | (Socket, File) => Primitive::SpliceViaPipe,
        _ => Primitive::Copy,
    }
}

/// What `fd` is, and its status flags; refuses what cannot be read (`write == false`) or
/// written (`write == true`).
fn check_end(
    fd: BorrowedFd<'_>,
    which: &'static str,
    write: bool,
) -> Result<(EndKind, OFlags), PipeError> {
    let bad = |why: String| PipeError::BadFd { which, why };
    let flags = rustix::fs::fcntl_getfl(fd).map_err(|e| bad(format!("fcntl(F_GETFL): {e}")))?;
    if flags.contains(OFlags::PATH) {
        return Err(bad(
            "opened with O_PATH (neither readable nor writable)".into()
        ));
    }
    let stat = rustix::fs::fstat(fd).map_err(|e| bad(format!("fstat: {e}")))?;
    let kind = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => EndKind::File,
        FileType::Socket => EndKind::Socket,
        FileType::Fifo => EndKind::Pipe,
        FileType::CharacterDevice => EndKind::Other,
        FileType::Directory => return Err(bad("a directory".into())),
        other => return Err(bad(format!("unsupported file type ({other:?})"))),
    };
    let access = flags & OFlags::ACCMODE;
    let readable = access == OFlags::RDONLY || access == OFlags::RDWR;
    let writable = access == OFlags::WRONLY || access == OFlags::RDWR;
    if write && !writable {
        return Err(bad("not open for writing".into()));
    }
    if !write && !readable {
        return Err(bad("not open for reading".into()));
    }
    if kind == EndKind::Socket {
        let listening = rustix::net::sockopt::socket_acceptconn(fd)
            .map_err(|e| bad(format!("getsockopt(SO_ACCEPTCONN): {e}")))?;
        if listening {
            return Err(bad(
                "a listening socket (hand a connection accepted from it)".into(),
            ));
        }
        let ty = rustix::net::sockopt::socket_type(fd)
            .map_err(|e| bad(format!("getsockopt(SO_TYPE): {e}")))?;
        if ty != rustix::net::SocketType::STREAM {
            return Err(bad(format!("not a stream socket ({ty:?})")));
        }
    }
    Ok((kind, flags))
}

/// Polls `fd` for `events` without waiting; an error or hang-up counts as ready (the next
/// call reports it).
fn ready(fd: BorrowedFd<'_>, events: PollFlags) -> Result<bool, Errno> {
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let mut fds = [PollFd::from_borrowed_fd(fd, events)];
    loop {
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(_) => break,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
    let revents = fds[0].revents();
    if revents.contains(PollFlags::NVAL) {
        return Err(Errno::BADF);
    }
    Ok(revents.intersects(events | PollFlags::ERR | PollFlags::HUP))
}

/// Whether reading the source now would find data or its end.
fn source_ready(fd: BorrowedFd<'_>, kind: EndKind) -> Result<bool, Errno> {
    match kind {
        EndKind::Socket | EndKind::Pipe => ready(fd, PollFlags::IN),
        EndKind::File | EndKind::Other => Ok(true),
    }
}

/// How many bytes the sink takes now without blocking, if it is writable: for a socket a
/// quarter of its send buffer (`splice`/`sendfile` cannot ask for `MSG_DONTWAIT`), for a pipe
/// as much as fits (pipe writes pass `SPLICE_F_NONBLOCK`), for the rest anything.
fn sink_room(fd: BorrowedFd<'_>, kind: EndKind) -> Result<Option<u64>, Errno> {
    match kind {
        EndKind::Socket => {
            if !ready(fd, PollFlags::OUT)? {
                return Ok(None);
            }
            let sndbuf = rustix::net::sockopt::socket_send_buffer_size(fd)?;
            Ok(Some((sndbuf as u64 / 4).max(PIPE_BUF as u64)))
        }
        EndKind::Pipe => Ok(ready(fd, PollFlags::OUT)?.then_some(u64::MAX)),
        EndKind::File | EndKind::Other => Ok(Some(u64::MAX)),
    }
}
