//! The client side: attach to an export, submit tagged requests, take their completions.
//!
//! An attachment is two descriptor channels: requests go out on one, completions come back
//! on the other. A [`ZcPort`] sends and receives through `&mut self`, so one port cannot be
//! driven by two threads at once; two channels make the halves independent:
//! [`BlkClient::split`] gives a [`Submitter`] (the thread that reads `/dev/fuse` and
//! submits) and a [`Completer`] (the thread that takes completions and answers the kernel),
//! each `Send`, sharing only the table of requests in flight. [`BlkClient`] keeps both for a
//! single thread, with blocking [`read_at`](BlkClient::read_at) /
//! [`write_at`](BlkClient::write_at) helpers.
//!
//! Copies: a write's payload is written by the caller into a [`WriteBuf`] (a loan from our
//! pool, after the header) and the server writes it to the file from there; a read's data
//! arrives in the server's buffer, which [`Completion::data`] shows in place (read-only).
//! Only the helpers copy (the caller's slice into the loan, the data out to the caller's
//! slice), and they count it ([`ClientStats::copied_bytes`]).
//!
//! The server dying: [`Completer::complete`] notices within a liveness slice (200 ms) and
//! completes every request in flight with `EIO`; submits fail with
//! [`BlkError::Disconnected`] from then on. Attach again (to a new export) to go on. A server
//! alive but stuck (stopped, hung on its storage) is not dead: a [`SessionWatch`] sees how
//! long the oldest request has waited, and may abandon the session, with the same effect.

use crate::error::BlkError;
use crate::proto::{
    self, errno, CompletionHeader, ExportInfo, Hello, Op, Ready, RequestHeader, Role, HEADER_LEN,
};
use crate::server::service_name;
use memloop::registry::MemberId;
use memloop::zerocopy::{Loan, Pool, Received, ZcPort};
use memloop::Node;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest wait of ours between looks at the server's liveness.
const SLICE: Duration = Duration::from_millis(200);
/// Small buffers (headers of reads, flushes, discards; the hellos): enough for the largest
/// queue depth, as the session's depth is known only after the handshake.
const SMALL_BUFFERS: u32 = proto::MAX_QUEUE_DEPTH + 8;
/// Tags the blocking helpers use have this bit set; a caller mixing its own submits with
/// the helpers keeps it clear in its tags.
pub const HELPER_TAG: u64 = 1 << 63;
/// Most completions one [`Completer::complete`] returns.
const MAX_BATCH: usize = 256;

/// What a client asks of the export.
#[derive(Clone, Copy, Debug)]
pub struct ClientOptions {
    /// Requests in flight (0: the export's).
    pub queue_depth: u32,
    /// Largest READ/WRITE (0: the export's). Our pool holds `queue_depth` buffers of
    /// `64 + headroom + max_io` bytes, and the server's as many of `64 + max_io`.
    pub max_io: u32,
    /// Bytes between the request header and a write's payload that the caller may use (the
    /// FUSE frontend reads a whole FUSE request — 80 bytes of headers, then the data — into
    /// the buffer after our header).
    pub headroom: u32,
    /// Longest wait for the server's answers during the attachment.
    pub timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            queue_depth: 0,
            max_io: 0,
            headroom: 0,
            timeout: Duration::from_secs(5),
        }
    }
}

/// The client's counters (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    pub submitted: u64,
    pub completed: u64,
    /// Completions with an error status (those made up for a dead server included).
    pub errors: u64,
    /// Completions made up with `EIO` because the server went.
    pub failed_by_disconnect: u64,
    /// Completions refused: malformed, for no request in flight, or not matching theirs.
    pub bogus: u64,
    /// Bytes the client copied in user space: only the helpers do (`write_at` into the
    /// loan, `read_at` out of the server's buffer).
    pub copied_bytes: u64,
}

#[derive(Default)]
struct Counters {
    submitted: AtomicU64,
    completed: AtomicU64,
    errors: AtomicU64,
    failed_by_disconnect: AtomicU64,
    bogus: AtomicU64,
    copied_bytes: AtomicU64,
}

/// What the two halves share.
struct Shared {
    node: Node,
    server: MemberId,
    info: ExportInfo,
    headroom: usize,
    st: Mutex<State>,
    /// Rung when a request leaves the table, or the server goes.
    room: Condvar,
    stats: Counters,
}

#[derive(Default)]
struct State {
    inflight: HashMap<u64, Inflight>,
    /// Reads' data not yet dropped: each holds one of the server's read buffers, of which
    /// the session has as many as its queue depth — so they count against it too.
    held: usize,
    dead: bool,
    /// Threads waiting for room: a notification costs a system call, so none is made
    /// without a waiter (a completion would otherwise pay one each).
    room_waiters: usize,
}

impl State {
    fn outstanding(&self) -> usize {
        self.inflight.len() + self.held
    }
}

#[derive(Clone, Copy)]
struct Inflight {
    op: Op,
    len: u32,
    since: Instant,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_dead(&self) {
        let mut st = self.state();
        st.dead = true;
        self.ring_room(st);
    }

    /// Tells the threads waiting for room (if any) that some came free; takes the lock
    /// under which it was freed, so no waiter can slip between the check and its sleep.
    fn ring_room(&self, st: MutexGuard<'_, State>) {
        let waiters = st.room_waiters > 0;
        drop(st);
        if waiters {
            self.room.notify_all();
        }
    }

    fn is_dead(&self) -> bool {
        self.state().dead
    }

    /// A loan from `pool`, waiting while every buffer is out — not past the server's death.
    fn loan(&self, pool: &Pool) -> Result<Loan, BlkError> {
        loop {
            if self.is_dead() {
                return Err(BlkError::Disconnected);
            }
            match pool.loan_timeout(Some(SLICE)) {
                Ok(l) => return Ok(l),
                Err(memloop::Error::TimedOut) => {
                    if !self.node.peer_alive(self.server) {
                        self.mark_dead();
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The two channels of an attachment, after the handshake — the raw protocol, for tests
/// and tools that speak it themselves. Requests go out on `requests`, completions come
/// back on `completions`; `small` is the pool the hellos came from.
pub struct Channels {
    pub requests: ZcPort,
    pub completions: ZcPort,
    pub info: ExportInfo,
}

/// Sends `h` in a loan of `pool`.
fn send_header(port: &mut ZcPort, pool: &Pool, h: &[u8; HEADER_LEN]) -> Result<(), BlkError> {
    let mut l = pool.loan_timeout(Some(Duration::from_secs(5)))?;
    l[..HEADER_LEN].copy_from_slice(h);
    l.truncate(HEADER_LEN);
    port.send(l)?;
    Ok(())
}

/// The first message on `port`, waiting at most `timeout`.
fn first_message(port: &mut ZcPort, timeout: Duration) -> Result<Received, BlkError> {
    port.set_timeout(Some(timeout));
    let m = match port.recv() {
        Ok(Some(m)) => m,
        Ok(None) | Err(memloop::Error::BrokenPipe | memloop::Error::PeerDead) => {
            return Err(BlkError::Disconnected)
        }
        Err(memloop::Error::TimedOut) => return Err(BlkError::TimedOut),
        Err(e) => return Err(e.into()),
    };
    port.set_timeout(None);
    Ok(m)
}

/// Attaches to the export `name`: the request channel and its `Hello`/`Info`, then the
/// completion channel and its `Hello`/`Ready`. `small` supplies the hello buffers.
pub fn open_channels(
    node: &Node,
    name: &str,
    small: &Pool,
    queue_depth: u32,
    max_io: u32,
    timeout: Duration,
) -> Result<Channels, BlkError> {
    let service = service_name(name)?;
    let mut requests = ZcPort::connect(node, &service)?;
    let hello = Hello {
        role: Role::Requests,
        token: 0,
        queue_depth,
        max_io,
    };
    send_header(&mut requests, small, &hello.encode())?;
    let m = first_message(&mut requests, timeout)?;
    let info = match ExportInfo::decode(m.bytes()) {
        Ok(Ok(info)) => info,
        Ok(Err(errno)) => return Err(BlkError::Refused(errno)),
        Err(why) => return Err(BlkError::Protocol(format!("the export's info: {why}"))),
    };
    drop(m);
    let mut completions = ZcPort::connect(node, &service)?;
    let hello = Hello {
        role: Role::Completions,
        token: info.token,
        queue_depth: 0,
        max_io: 0,
    };
    send_header(&mut completions, small, &hello.encode())?;
    let m = first_message(&mut completions, timeout)?;
    match Ready::decode(m.bytes()) {
        Ok(r) if r.token == info.token => {}
        Ok(_) => return Err(BlkError::Protocol("ready for another session".into())),
        Err(why) => return Err(BlkError::Protocol(format!("ready: {why}"))),
    }
    Ok(Channels {
        requests,
        completions,
        info,
    })
}

/// A client of one export: both halves, for one thread.
pub struct BlkClient {
    sub: Submitter,
    comp: Completer,
    /// Completions of the caller's own requests taken while a helper waited for its own.
    stash: VecDeque<Completion>,
    next_tag: u64,
}

/// The submitting half.
pub struct Submitter {
    sh: Arc<Shared>,
    port: ZcPort,
    small: Pool,
    data: Pool,
}

/// What another thread may see of a session, and do to it.
#[derive(Clone)]
pub struct SessionWatch {
    sh: Arc<Shared>,
}

impl SessionWatch {
    /// How long the oldest request in flight has waited (`None`: none in flight).
    pub fn oldest_in_flight(&self) -> Option<Duration> {
        let st = self.sh.state();
        let oldest = st.inflight.values().map(|f| f.since).min()?;
        Some(oldest.elapsed())
    }

    /// Gives up on the server as if it had died: every request in flight completes with
    /// `EIO` (within a slice of the completer's wait), submits fail with
    /// [`BlkError::Disconnected`]. For a server that is alive but answers nothing.
    pub fn abandon(&self) {
        self.sh.mark_dead();
    }

    /// The session is over (the server died or it was abandoned).
    pub fn is_over(&self) -> bool {
        self.sh.is_dead()
    }
}

/// The completing half.
pub struct Completer {
    sh: Arc<Shared>,
    port: ZcPort,
}

/// A write's buffer: a loan from our pool, the request header at its start (written at
/// submit), the payload anywhere after it.
pub struct WriteBuf {
    loan: Loan,
    /// The payload: `[at, at + len)` of the area after the header.
    at: usize,
    len: usize,
    headroom: usize,
}

impl WriteBuf {
    /// The area after the header: `headroom + max_io` bytes.
    pub fn area_mut(&mut self) -> &mut [u8] {
        &mut self.loan[HEADER_LEN..]
    }

    pub fn area(&self) -> &[u8] {
        &self.loan[HEADER_LEN..]
    }

    /// The payload is `len` bytes at `at` of the area (where a FUSE request's data landed).
    pub fn set_payload(&mut self, at: usize, len: usize) -> Result<(), BlkError> {
        let room = self.loan.len() - HEADER_LEN;
        let fits = matches!(at.checked_add(len), Some(end) if end <= room);
        if !fits {
            return Err(BlkError::Invalid(proto::Invalid::TooLong {
                len: len.min(u32::MAX as usize) as u32,
                max: room.saturating_sub(at) as u32,
            }));
        }
        self.at = at;
        self.len = len;
        Ok(())
    }

    /// A payload of `len` bytes just after the headroom, to fill.
    pub fn payload_mut(&mut self, len: usize) -> Result<&mut [u8], BlkError> {
        self.set_payload(self.headroom, len)?;
        let (a, n) = (HEADER_LEN + self.at, self.len);
        Ok(&mut self.loan[a..a + n])
    }

    pub fn payload(&self) -> &[u8] {
        let a = HEADER_LEN + self.at;
        &self.loan[a..a + self.len]
    }
}

/// A finished request.
pub struct Completion {
    tag: u64,
    op: Op,
    status: i32,
    data: Option<ReadData>,
}

/// A read's data, in place in the server's buffer (mapped read-only here), held until this
/// is dropped. Until then it counts against the queue depth (the server has that many read
/// buffers for the session): drop it once the bytes are delivered.
pub struct ReadData {
    msg: Received,
    range: Range<usize>,
    sh: Arc<Shared>,
}

impl Drop for ReadData {
    fn drop(&mut self) {
        let mut st = self.sh.state();
        st.held = st.held.saturating_sub(1);
        self.sh.ring_room(st);
    }
}

impl ReadData {
    pub fn bytes(&self) -> &[u8] {
        &self.msg.bytes()[self.range.clone()]
    }
    /// The message holding the data (to forward it without copying) and where the data
    /// lies in its first segment.
    pub fn message(&self) -> (&Received, Range<usize>) {
        (&self.msg, self.range.clone())
    }
}

impl Completion {
    pub fn tag(&self) -> u64 {
        self.tag
    }
    pub fn op(&self) -> Op {
        self.op
    }
    /// 0, or the errno the request failed with.
    pub fn status(&self) -> i32 {
        self.status
    }
    pub fn is_ok(&self) -> bool {
        self.status == 0
    }
    pub fn result(&self) -> Result<(), BlkError> {
        match self.status {
            0 => Ok(()),
            e => Err(BlkError::Status(e)),
        }
    }
    /// A successful read's bytes, in place (empty for anything else).
    pub fn data(&self) -> &[u8] {
        self.data.as_ref().map_or(&[], ReadData::bytes)
    }
    /// The read's data, kept held after the completion goes.
    pub fn take_data(&mut self) -> Option<ReadData> {
        self.data.take()
    }
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("tag", &self.tag)
            .field("op", &self.op)
            .field("status", &self.status)
            .field("data", &self.data().len())
            .finish()
    }
}

impl BlkClient {
    /// Attaches to the export `name` with the export's queue depth and max I/O.
    pub fn connect(node: &Node, name: &str) -> Result<BlkClient, BlkError> {
        Self::connect_with(node, name, ClientOptions::default())
    }

    pub fn connect_with(
        node: &Node,
        name: &str,
        opts: ClientOptions,
    ) -> Result<BlkClient, BlkError> {
        let small = Pool::create(node, HEADER_LEN as u32, SMALL_BUFFERS)?;
        let ch = open_channels(
            node,
            name,
            &small,
            opts.queue_depth,
            opts.max_io,
            opts.timeout,
        )?;
        let info = ch.info;
        let buf = HEADER_LEN as u64 + opts.headroom as u64 + info.max_io as u64;
        let buf = u32::try_from(buf).map_err(|_| {
            BlkError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "headroom too large",
            ))
        })?;
        let data = Pool::create(node, buf, info.queue_depth)?;
        let sh = Arc::new(Shared {
            node: node.clone(),
            server: ch.requests.peer(),
            info,
            headroom: opts.headroom as usize,
            st: Mutex::new(State::default()),
            room: Condvar::new(),
            stats: Counters::default(),
        });
        Ok(BlkClient {
            sub: Submitter {
                sh: sh.clone(),
                port: ch.requests,
                small,
                data,
            },
            comp: Completer {
                sh,
                port: ch.completions,
            },
            stash: VecDeque::new(),
            next_tag: 0,
        })
    }

    /// The export as this session sees it (its queue depth and max I/O are the session's).
    pub fn info(&self) -> &ExportInfo {
        &self.sub.sh.info
    }

    pub fn stats(&self) -> ClientStats {
        self.sub.stats()
    }

    /// A watch on this session, for a thread of its own.
    pub fn watch(&self) -> SessionWatch {
        SessionWatch {
            sh: self.sub.sh.clone(),
        }
    }

    /// The two halves, for two threads.
    pub fn split(self) -> (Submitter, Completer) {
        (self.sub, self.comp)
    }

    pub fn submitter(&mut self) -> &mut Submitter {
        &mut self.sub
    }

    pub fn completer(&mut self) -> &mut Completer {
        &mut self.comp
    }

    pub fn write_buf(&self) -> Result<WriteBuf, BlkError> {
        self.sub.write_buf()
    }
    pub fn submit_read(&mut self, tag: u64, offset: u64, len: u32) -> Result<(), BlkError> {
        self.sub.submit_read(tag, offset, len)
    }
    pub fn submit_write(
        &mut self,
        tag: u64,
        offset: u64,
        buf: WriteBuf,
        fua: bool,
    ) -> Result<(), BlkError> {
        self.sub.submit_write(tag, offset, buf, fua)
    }
    pub fn submit_flush(&mut self, tag: u64) -> Result<(), BlkError> {
        self.sub.submit_flush(tag)
    }
    pub fn submit_discard(&mut self, tag: u64, offset: u64, len: u32) -> Result<(), BlkError> {
        self.sub.submit_discard(tag, offset, len)
    }
    pub fn in_flight(&self) -> usize {
        self.sub.in_flight()
    }
    pub fn outstanding(&self) -> usize {
        self.sub.outstanding()
    }

    /// Completions (see [`Completer::complete`]), those a helper set aside first.
    pub fn complete(&mut self, timeout: Option<Duration>) -> Result<Vec<Completion>, BlkError> {
        if !self.stash.is_empty() {
            return Ok(self.stash.drain(..).collect());
        }
        self.comp.complete(timeout)
    }

    fn helper_tag(&mut self) -> u64 {
        loop {
            self.next_tag = self.next_tag.wrapping_add(1);
            let t = HELPER_TAG | self.next_tag;
            if !self.sub.sh.state().inflight.contains_key(&t) {
                return t;
            }
        }
    }

    /// Runs `n` requests, as many in flight as the queue allows: `submit(sub, tag, i)` sends
    /// the `i`th, `done(i, completion)` takes its completion. The first error is returned,
    /// after every request sent has completed.
    fn drive(
        &mut self,
        n: usize,
        mut submit: impl FnMut(&mut Submitter, u64, usize) -> Result<(), BlkError>,
        mut done: impl FnMut(usize, Completion) -> Result<(), BlkError>,
    ) -> Result<(), BlkError> {
        let depth = self.sub.sh.info.queue_depth as usize;
        let mut mine: HashMap<u64, usize> = HashMap::new();
        let mut next = 0;
        let mut err: Option<BlkError> = None;
        while (next < n && err.is_none()) || !mine.is_empty() {
            while next < n && err.is_none() && self.sub.outstanding() < depth {
                let tag = self.helper_tag();
                match submit(&mut self.sub, tag, next) {
                    Ok(()) => {
                        mine.insert(tag, next);
                        next += 1;
                    }
                    Err(e) => err = Some(e),
                }
            }
            if mine.is_empty() {
                if next >= n || err.is_some() {
                    break;
                }
                // No room, none of it ours: the caller's own requests must free it (their
                // completions are set aside for the caller) — unless there are none, and
                // held reads' data fill the queue.
                if self.sub.in_flight() == 0 {
                    return Err(BlkError::QueueFull(depth as u32));
                }
            }
            let got = match self.comp.complete(None) {
                Ok(got) => got,
                // (Requests in flight are always completed, with EIO if need be, before
                // this can happen.)
                Err(e) => return Err(err.unwrap_or(e)),
            };
            for c in got {
                match mine.remove(&c.tag) {
                    Some(i) => {
                        if let Err(e) = done(i, c) {
                            err.get_or_insert(e);
                        }
                    }
                    None => self.stash.push_back(c),
                }
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Reads `buf.len()` bytes at `offset` (both multiples of the block size), in requests
    /// of at most max I/O, several in flight; copies the data out (counted).
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlkError> {
        let max = self.sub.sh.info.max_io as usize;
        let n = buf.len().div_ceil(max);
        let sh = self.sub.sh.clone();
        let total = buf.len();
        self.drive(
            n,
            |sub, tag, i| {
                let len = max.min(total - i * max);
                sub.submit_read(tag, offset + (i * max) as u64, len as u32)
            },
            |i, c| {
                c.result()?;
                let d = c.data();
                buf[i * max..i * max + d.len()].copy_from_slice(d);
                sh.stats.copied_bytes.fetch_add(d.len() as u64, Relaxed);
                Ok(())
            },
        )
    }

    /// Writes `data` at `offset` (both multiples of the block size), copying it into our
    /// buffers (counted); `fua`: each request durable before it completes.
    pub fn write_at(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), BlkError> {
        let max = self.sub.sh.info.max_io as usize;
        let n = data.len().div_ceil(max);
        let sh = self.sub.sh.clone();
        self.drive(
            n,
            |sub, tag, i| {
                let part = &data[i * max..data.len().min((i + 1) * max)];
                let mut b = sub.write_buf()?;
                b.payload_mut(part.len())?.copy_from_slice(part);
                sh.stats.copied_bytes.fetch_add(part.len() as u64, Relaxed);
                sub.submit_write(tag, offset + (i * max) as u64, b, fua)
            },
            |_, c| c.result(),
        )
    }

    /// Everything written before is durable.
    pub fn flush(&mut self) -> Result<(), BlkError> {
        self.drive(1, |sub, tag, _| sub.submit_flush(tag), |_, c| c.result())
    }

    /// Discards `len` bytes at `offset` (multiples of the block size): they read as zeros.
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), BlkError> {
        let bs = self.sub.sh.info.block_size as u64;
        let max = (u32::MAX as u64) / bs * bs;
        let n = len.div_ceil(max) as usize;
        self.drive(
            n,
            |sub, tag, i| {
                let at = i as u64 * max;
                sub.submit_discard(tag, offset + at, max.min(len - at) as u32)
            },
            |_, c| c.result(),
        )
    }
}

impl Submitter {
    pub fn info(&self) -> &ExportInfo {
        &self.sh.info
    }

    pub fn stats(&self) -> ClientStats {
        let c = &self.sh.stats;
        let g = |a: &AtomicU64| a.load(Relaxed);
        ClientStats {
            submitted: g(&c.submitted),
            completed: g(&c.completed),
            errors: g(&c.errors),
            failed_by_disconnect: g(&c.failed_by_disconnect),
            bogus: g(&c.bogus),
            copied_bytes: g(&c.copied_bytes),
        }
    }

    /// The server is known to be gone.
    pub fn is_disconnected(&self) -> bool {
        self.sh.is_dead()
    }

    /// Requests submitted and not completed yet.
    pub fn in_flight(&self) -> usize {
        self.sh.state().inflight.len()
    }

    /// Requests in flight plus reads' data still held: what the queue depth bounds (a
    /// submit beyond it is [`BlkError::QueueFull`]).
    pub fn outstanding(&self) -> usize {
        self.sh.state().outstanding()
    }

    /// Waits until fewer than the queue depth are [outstanding](Self::outstanding).
    pub fn wait_room(&self, timeout: Option<Duration>) -> Result<(), BlkError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let depth = self.sh.info.queue_depth as usize;
        let mut st = self.sh.state();
        loop {
            if st.dead {
                return Err(BlkError::Disconnected);
            }
            if st.outstanding() < depth {
                return Ok(());
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => SLICE,
            };
            if left.is_zero() {
                return Err(BlkError::TimedOut);
            }
            st.room_waiters += 1;
            st = match self.sh.room.wait_timeout(st, left.min(SLICE)) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            st.room_waiters -= 1;
        }
    }

    /// A buffer for a write, waiting while all are out (a write's buffer comes back when
    /// the server has written it, before its completion).
    pub fn write_buf(&self) -> Result<WriteBuf, BlkError> {
        let loan = self.sh.loan(&self.data)?;
        Ok(self.wrap(loan))
    }

    /// A buffer for a write if one is free now.
    pub fn try_write_buf(&self) -> Result<Option<WriteBuf>, BlkError> {
        if self.sh.is_dead() {
            return Err(BlkError::Disconnected);
        }
        match self.data.try_loan() {
            Ok(l) => Ok(Some(self.wrap(l))),
            Err(memloop::Error::WouldBlock) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn wrap(&self, loan: Loan) -> WriteBuf {
        WriteBuf {
            loan,
            at: self.sh.headroom,
            len: 0,
            headroom: self.sh.headroom,
        }
    }

    pub fn submit_read(&mut self, tag: u64, offset: u64, len: u32) -> Result<(), BlkError> {
        let r = RequestHeader {
            op: Op::Read,
            fua: false,
            tag,
            offset,
            len,
            data_off: 0,
        };
        self.submit_small(r)
    }

    pub fn submit_flush(&mut self, tag: u64) -> Result<(), BlkError> {
        let r = RequestHeader {
            op: Op::Flush,
            fua: false,
            tag,
            offset: 0,
            len: 0,
            data_off: 0,
        };
        self.submit_small(r)
    }

    pub fn submit_discard(&mut self, tag: u64, offset: u64, len: u32) -> Result<(), BlkError> {
        let r = RequestHeader {
            op: Op::Discard,
            fua: false,
            tag,
            offset,
            len,
            data_off: 0,
        };
        self.submit_small(r)
    }

    /// Sends `buf`'s payload to be written at `offset`; the buffer is the server's to read
    /// until it has written it.
    pub fn submit_write(
        &mut self,
        tag: u64,
        offset: u64,
        buf: WriteBuf,
        fua: bool,
    ) -> Result<(), BlkError> {
        let r = RequestHeader {
            op: Op::Write,
            fua,
            tag,
            offset,
            len: u32::try_from(buf.len).unwrap_or(u32::MAX),
            data_off: (HEADER_LEN + buf.at) as u32,
        };
        let mut loan = buf.loan;
        loan.truncate(HEADER_LEN + buf.at + buf.len);
        self.submit(r, loan)
    }

    fn submit_small(&mut self, r: RequestHeader) -> Result<(), BlkError> {
        // Checked before a buffer is taken for it.
        r.validate(&self.sh.info, HEADER_LEN as u64)?;
        let mut loan = self.sh.loan(&self.small)?;
        loan.truncate(HEADER_LEN);
        self.submit(r, loan)
    }

    fn submit(&mut self, r: RequestHeader, mut loan: Loan) -> Result<(), BlkError> {
        r.validate(&self.sh.info, loan.len() as u64)?;
        {
            let mut st = self.sh.state();
            if st.dead {
                return Err(BlkError::Disconnected);
            }
            if st.outstanding() >= self.sh.info.queue_depth as usize {
                return Err(BlkError::QueueFull(self.sh.info.queue_depth));
            }
            if st.inflight.contains_key(&r.tag) {
                return Err(BlkError::DuplicateTag(r.tag));
            }
            let f = Inflight {
                op: r.op,
                len: r.len,
                since: Instant::now(),
            };
            st.inflight.insert(r.tag, f);
        }
        loan[..HEADER_LEN].copy_from_slice(&r.encode());
        match self.port.send(loan) {
            Ok(()) => {
                self.sh.stats.submitted.fetch_add(1, Relaxed);
                Ok(())
            }
            Err(e) => {
                let mut st = self.sh.state();
                st.inflight.remove(&r.tag);
                self.sh.ring_room(st);
                match e {
                    memloop::Error::PeerDead | memloop::Error::BrokenPipe => {
                        self.sh.mark_dead();
                        Err(BlkError::Disconnected)
                    }
                    e => Err(e.into()),
                }
            }
        }
    }
}

impl Completer {
    pub fn info(&self) -> &ExportInfo {
        &self.sh.info
    }

    /// The next completions: waits up to `timeout` (`None`: until one comes or the server
    /// goes; zero: not at all) for the first, then takes whatever else is there. Empty on a
    /// timeout. When the server has gone, every request in flight completes with `EIO`
    /// (within a liveness slice of its death); after that, [`BlkError::Disconnected`].
    pub fn complete(&mut self, timeout: Option<Duration>) -> Result<Vec<Completion>, BlkError> {
        let mut out = Vec::new();
        if self.sh.is_dead() {
            return self.fail_in_flight();
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            self.port.set_nonblocking(left.is_some_and(|l| l.is_zero()));
            self.port.set_timeout(left);
            match self.port.recv() {
                Ok(Some(m)) => {
                    if let Some(c) = self.accept(m) {
                        out.push(c);
                        break;
                    }
                }
                Ok(None) | Err(memloop::Error::PeerDead | memloop::Error::BrokenPipe) => {
                    self.sh.mark_dead();
                    return self.fail_in_flight();
                }
                Err(memloop::Error::TimedOut | memloop::Error::WouldBlock) => return Ok(out),
                Err(memloop::Error::Forged(why)) => {
                    self.sh.stats.bogus.fetch_add(1, Relaxed);
                    tracing::debug!("a forged completion descriptor: {why}");
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.port.set_nonblocking(true);
        while out.len() < MAX_BATCH {
            match self.port.recv() {
                Ok(Some(m)) => out.extend(self.accept(m)),
                Err(memloop::Error::Forged(_)) => {
                    self.sh.stats.bogus.fetch_add(1, Relaxed);
                }
                _ => break,
            }
        }
        Ok(out)
    }

    /// A completion message, checked against its request.
    fn accept(&self, m: Received) -> Option<Completion> {
        let stats = &self.sh.stats;
        let h = match CompletionHeader::decode(m.bytes()) {
            Ok(h) if m.segment_count() == 1 => h,
            Ok(_) => {
                stats.bogus.fetch_add(1, Relaxed);
                return None;
            }
            Err(why) => {
                stats.bogus.fetch_add(1, Relaxed);
                tracing::debug!("a bad completion: {why}");
                return None;
            }
        };
        let mut st = self.sh.state();
        let Some(req) = st.inflight.get(&h.tag).copied() else {
            drop(st);
            stats.bogus.fetch_add(1, Relaxed);
            tracing::debug!(tag = h.tag, "a completion for no request in flight");
            return None;
        };
        st.inflight.remove(&h.tag);
        // A completion that does not fit its request fails it (the server is broken).
        let status = match h.validate(req.op, req.len, m.bytes().len()) {
            Ok(()) => h.status as i32,
            Err(why) => {
                stats.bogus.fetch_add(1, Relaxed);
                tracing::debug!(tag = h.tag, "a completion that does not fit: {why}");
                errno::EIO
            }
        };
        let has_data = req.op == Op::Read && status == 0;
        if has_data {
            st.held += 1;
        }
        self.sh.ring_room(st);
        stats.completed.fetch_add(1, Relaxed);
        if status != 0 {
            stats.errors.fetch_add(1, Relaxed);
        }
        let data = has_data.then(|| {
            let a = h.data_off as usize;
            ReadData {
                msg: m,
                range: a..a + h.len as usize,
                sh: self.sh.clone(),
            }
        });
        Some(Completion {
            tag: h.tag,
            op: req.op,
            status,
            data,
        })
    }

    /// The server is gone: every request in flight fails with `EIO`.
    fn fail_in_flight(&mut self) -> Result<Vec<Completion>, BlkError> {
        let mut st = self.sh.state();
        let gone: Vec<(u64, Inflight)> = st.inflight.drain().collect();
        self.sh.ring_room(st);
        if gone.is_empty() {
            return Err(BlkError::Disconnected);
        }
        let n = gone.len() as u64;
        let stats = &self.sh.stats;
        for c in [&stats.completed, &stats.errors, &stats.failed_by_disconnect] {
            c.fetch_add(n, Relaxed);
        }
        Ok(gone
            .into_iter()
            .map(|(tag, f)| Completion {
                tag,
                op: f.op,
                status: errno::EIO,
                data: None,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_send<T: Send>() {}

    /// The halves go to two threads (the FUSE frontend's reader and replier); completions
    /// and write buffers may be handed between threads too.
    #[test]
    fn halves_completions_and_buffers_are_send() {
        is_send::<Submitter>();
        is_send::<Completer>();
        is_send::<Completion>();
        is_send::<ReadData>();
        is_send::<WriteBuf>();
        is_send::<BlkClient>();
        is_send::<crate::BlkServer>();
    }
}
