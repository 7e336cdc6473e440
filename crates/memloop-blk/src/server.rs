//! The storage side: an export of a file or block device as the service `blk/NAME`, serving
//! every client that attaches, a thread per client.
//!
//! A session (one client) owns two pools of its own: small buffers for completions without
//! data, and buffers of `64 + max I/O` bytes for reads (the client's queue depth of them). A
//! write is `pwritev`'d straight from the client's buffer, read in place through our
//! read-only view of its pool, and released (dropped) before its completion is sent; a read
//! is `pread` into one of our buffers after the completion header, and the client releases
//! it when it is done with the bytes.
//!
//! The session's thread receives requests in batches: it sleeps for the first, then takes
//! every request already queued (up to the queue depth) without waiting. By default it also
//! serves them, in arrival order, answering each as soon as it is done (storage at memory
//! speed gains nothing from hand-offs between threads); with [`ExportOptions::workers`] > 1,
//! that many threads of the session do the I/O, so slow storage sees several requests at
//! once, and completions come in the order they finish.

use crate::error::BlkError;
use crate::proto::{
    self, errno, CompletionHeader, ExportInfo, Hello, Op, Ready, RequestHeader, Role, HEADER_LEN,
};
use memloop::zerocopy::{Loan, Pool, Received, ZcListener, ZcPort};
use memloop::Node;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a blocked wait of ours runs before it looks at the stop flag and the client.
const SLICE: Duration = Duration::from_millis(200);
/// How long a client may take between connecting and its hello, and between `Info` and
/// its second channel.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// The export's parameters (sessions may ask for less queue depth or max I/O, not more).
#[derive(Clone, Copy, Debug)]
pub struct ExportOptions {
    /// Writes and discards get `EROFS`; the backing file is opened read-only.
    pub read_only: bool,
    /// Logical block size: 512 or 4096. Offsets and lengths must be multiples of it.
    pub block_size: u32,
    /// Largest READ/WRITE, bytes (a multiple of the block size, ≤ 16 MiB).
    pub max_io: u32,
    /// Most requests in flight per client (≤ 256).
    pub queue_depth: u32,
    /// Threads doing a session's I/O. 1: the session's own thread, one request after the
    /// other (memory-speed storage: no hand-offs); more: that many requests reach slow
    /// storage at once, and complete in any order.
    pub workers: u32,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            read_only: false,
            block_size: 512,
            max_io: proto::DEFAULT_MAX_IO,
            queue_depth: proto::DEFAULT_QUEUE_DEPTH,
            workers: 1,
        }
    }
}

/// The server's counters (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    pub sessions_opened: u64,
    pub sessions_active: u64,
    /// Requests received (refused ones included).
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    /// Bytes `pread` into our pool for clients: the one copy of a read (page cache → pool).
    pub bytes_read: u64,
    /// Bytes `pwrite`n from clients' pools: the one copy of a write (pool → page cache).
    pub bytes_written: u64,
    /// `fdatasync` calls and FUA writes (`RWF_DSYNC`).
    pub syncs: u64,
    /// Completions with an error status, refusals not counted (`EIO`, `EROFS`, …).
    pub errors: u64,
    /// Bad requests (malformed, out of range, misaligned, oversized, forged descriptors,
    /// bad hellos), answered `EINVAL` where they named a tag.
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    sessions_opened: AtomicU64,
    sessions_active: AtomicU64,
    requests: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    syncs: AtomicU64,
    errors: AtomicU64,
    refused: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// An export: serves `blk/NAME` until dropped.
pub struct BlkServer {
    sh: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    node: Node,
    name: String,
    file: File,
    /// The export as a whole (token 0; a session's own max I/O and depth may be smaller).
    info: ExportInfo,
    stats: Counters,
    stop: AtomicBool,
    /// Sessions waiting for their completion channel, by token.
    pending: Mutex<HashMap<u64, mpsc::SyncSender<ZcPort>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// `pwritev2(RWF_DSYNC)` works here (cleared at its first refusal: then FUA is a write
    /// and an `fdatasync`).
    rwf_dsync: AtomicBool,
    workers: u32,
}

/// The service an export named `name` binds.
pub fn service_name(name: &str) -> Result<String, BlkError> {
    if name.is_empty() || name.len() > 60 || name.contains('\0') {
        return Err(BlkError::BadName(name.into()));
    }
    Ok(format!("blk/{name}"))
}

fn invalid_input(why: String) -> BlkError {
    BlkError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, why))
}

impl BlkServer {
    /// Exports the file or block device at `path` as `NAME` with the default options.
    pub fn export(
        node: &Node,
        name: &str,
        path: &Path,
        read_only: bool,
    ) -> Result<BlkServer, BlkError> {
        let opts = ExportOptions {
            read_only,
            ..ExportOptions::default()
        };
        Self::export_with(node, name, path, opts)
    }

    pub fn export_with(
        node: &Node,
        name: &str,
        path: &Path,
        opts: ExportOptions,
    ) -> Result<BlkServer, BlkError> {
        let service = service_name(name)?;
        let bs = opts.block_size;
        if bs != 512 && bs != 4096 {
            return Err(invalid_input(format!("block size {bs}: 512 or 4096")));
        }
        if opts.max_io < bs || opts.max_io % bs != 0 || opts.max_io > proto::MAX_MAX_IO {
            return Err(invalid_input(format!(
                "max I/O {}: a multiple of {bs} up to {}",
                opts.max_io,
                proto::MAX_MAX_IO
            )));
        }
        if opts.queue_depth == 0 || opts.queue_depth > proto::MAX_QUEUE_DEPTH {
            return Err(invalid_input(format!(
                "queue depth {}: 1..={}",
                opts.queue_depth,
                proto::MAX_QUEUE_DEPTH
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .open(path)?;
        let meta = file.metadata()?;
        let size = if meta.file_type().is_file() {
            meta.len()
        } else if meta.file_type().is_block_device() {
            // A block device's size is where its end is.
            rustix::fs::seek(&file, rustix::fs::SeekFrom::End(0))?
        } else {
            return Err(invalid_input(format!(
                "{}: neither a regular file nor a block device",
                path.display()
            )));
        };
        // A tail shorter than a block cannot be addressed.
        let size = size - size % bs as u64;
        if size == 0 {
            return Err(invalid_input(format!(
                "{}: smaller than one {bs}-byte block",
                path.display()
            )));
        }
        let mut flags = if opts.read_only {
            proto::INFO_READ_ONLY | proto::INFO_FLUSH
        } else {
            proto::INFO_FLUSH | proto::INFO_FUA | proto::INFO_DISCARD
        };
        if memory_backed(&file) {
            // tmpfs or ramfs: a completed pwrite is as durable as it gets (no volatile
            // cache, like a write-through disk), so clients need not send flushes.
            flags &= !proto::INFO_FLUSH;
        }
        let info = ExportInfo {
            token: 0,
            size,
            block_size: bs,
            max_io: opts.max_io,
            queue_depth: opts.queue_depth,
            flags,
        };
        info.validate()?;
        let listener = ZcListener::bind(node, &service)?;
        let sh = Arc::new(Shared {
            node: node.clone(),
            name: name.into(),
            file,
            info,
            stats: Counters::default(),
            stop: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            rwf_dsync: AtomicBool::new(true),
            workers: opts.workers.clamp(1, 64),
        });
        let s2 = sh.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("blk-accept-{name}"))
            .spawn(move || accept_loop(s2, listener))?;
        Ok(BlkServer {
            sh,
            acceptor: Some(acceptor),
        })
    }

    pub fn name(&self) -> &str {
        &self.sh.name
    }

    /// The export as a whole (what a client asking for everything gets, less its token).
    pub fn info(&self) -> ExportInfo {
        self.sh.info
    }

    pub fn stats(&self) -> ServerStats {
        let c = &self.sh.stats;
        let g = |a: &AtomicU64| a.load(Relaxed);
        ServerStats {
            sessions_opened: g(&c.sessions_opened),
            sessions_active: g(&c.sessions_active),
            requests: g(&c.requests),
            reads: g(&c.reads),
            writes: g(&c.writes),
            flushes: g(&c.flushes),
            discards: g(&c.discards),
            bytes_read: g(&c.bytes_read),
            bytes_written: g(&c.bytes_written),
            syncs: g(&c.syncs),
            errors: g(&c.errors),
            refused: g(&c.refused),
        }
    }
}

impl Drop for BlkServer {
    /// Stops accepting and ends every session (each within a wait slice): their clients see
    /// the end of their channels and fail what is in flight with `EIO`.
    fn drop(&mut self) {
        self.sh.stop.store(true, Relaxed);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let threads = std::mem::take(&mut *lock(&self.sh.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(sh: Arc<Shared>, listener: ZcListener) {
    while !sh.stop.load(Relaxed) {
        match listener.accept_timeout(Some(SLICE)) {
            Ok(port) => {
                let s2 = sh.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("blk-{}", sh.name))
                    .spawn(move || on_channel(s2, port));
                match spawned {
                    Ok(t) => {
                        let mut threads = lock(&sh.threads);
                        threads.retain(|t| !t.is_finished());
                        threads.push(t);
                    }
                    Err(e) => tracing::warn!(export = %sh.name, "no thread for a client: {e}"),
                }
            }
            Err(memloop::Error::TimedOut | memloop::Error::WouldBlock) => {}
            Err(e) => {
                tracing::warn!(export = %sh.name, "accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A new channel: its hello says whether it starts a session or completes one.
fn on_channel(sh: Arc<Shared>, mut port: ZcPort) {
    port.set_timeout(Some(HANDSHAKE));
    let hello = match port.recv() {
        Ok(Some(m)) => Hello::decode(m.bytes()),
        Ok(None) => return,
        Err(e) => {
            if matches!(e, memloop::Error::Forged(_)) {
                bump(&sh.stats.refused, 1);
            }
            tracing::debug!(export = %sh.name, "no hello: {e}");
            return;
        }
    };
    let hello = match hello {
        Ok(h) => h,
        Err(why) => {
            bump(&sh.stats.refused, 1);
            tracing::debug!(export = %sh.name, "a bad hello: {why}");
            return;
        }
    };
    match hello.role {
        Role::Requests => {
            bump(&sh.stats.sessions_opened, 1);
            bump(&sh.stats.sessions_active, 1);
            if let Err(e) = session(&sh, port, hello) {
                tracing::debug!(export = %sh.name, "session ended: {e}");
            }
            sh.stats.sessions_active.fetch_sub(1, Relaxed);
        }
        Role::Completions => match lock(&sh.pending).remove(&hello.token) {
            Some(tx) => {
                let _ = tx.send(port);
            }
            None => {
                bump(&sh.stats.refused, 1);
                tracing::debug!(export = %sh.name, "a completion channel for no session");
            }
        },
    }
}

/// A token no pending session has (never 0).
fn new_token(sh: &Shared) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let pending = lock(&sh.pending);
    loop {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        let t = h.finish();
        if t != 0 && !pending.contains_key(&t) {
            return t;
        }
    }
}

/// Sends the 64-byte header `h` in a loan of its own.
fn send_header(port: &mut ZcPort, mut l: Loan, h: &[u8; HEADER_LEN]) -> Result<(), BlkError> {
    l[..HEADER_LEN].copy_from_slice(h);
    l.truncate(HEADER_LEN);
    port.send(l)?;
    Ok(())
}

/// One client: the handshake, then its requests until it goes or we stop.
fn session(sh: &Arc<Shared>, mut req: ZcPort, hello: Hello) -> Result<(), BlkError> {
    let ex = sh.info;
    let bs = ex.block_size;
    let qd = match hello.queue_depth {
        0 => ex.queue_depth,
        q => q.min(ex.queue_depth),
    };
    let max_io = match hello.max_io {
        0 => ex.max_io,
        m => (m.min(ex.max_io) / bs * bs).max(bs),
    };
    let token = new_token(sh);
    let info = ExportInfo {
        token,
        max_io,
        queue_depth: qd,
        ..ex
    };
    // Completions without data, and the handshake: never more out than requests in flight
    // (and the two handshake messages).
    let small = Pool::create(&sh.node, HEADER_LEN as u32, qd + 2)?;
    let data = match Pool::create(&sh.node, HEADER_LEN as u32 + max_io, qd) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(export = %sh.name, "no room for a session's buffers: {e}");
            let l = small.loan_timeout(Some(HANDSHAKE))?;
            send_header(&mut req, l, &ExportInfo::encode_refusal(errno::ENOSPC))?;
            return Err(e.into());
        }
    };
    let (tx, rx) = mpsc::sync_channel(1);
    lock(&sh.pending).insert(token, tx);
    let l = small.loan_timeout(Some(HANDSHAKE))?;
    let sent = send_header(&mut req, l, &info.encode());
    let comp = sent.and_then(|()| {
        let deadline = Instant::now() + HANDSHAKE;
        loop {
            match rx.recv_timeout(SLICE) {
                Ok(p) => return Ok(p),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(BlkError::Disconnected),
            }
            let client_gone = !sh.node.peer_alive(req.peer());
            if sh.stop.load(Relaxed) || client_gone || Instant::now() > deadline {
                return Err(BlkError::TimedOut);
            }
        }
    });
    lock(&sh.pending).remove(&token);
    let mut comp = comp?;
    let l = small.loan_timeout(Some(HANDSHAKE))?;
    send_header(&mut comp, l, &Ready { token }.encode())?;
    let s = Session {
        sh: sh.clone(),
        info,
        client: req.peer(),
        comp: Mutex::new(comp),
        small,
        data,
        over: AtomicBool::new(false),
    };
    match sh.workers {
        1 => s.serve(&mut req, |m| s.handle(m)),
        n => {
            // The session's thread receives; `n` workers do the I/O and answer.
            let (tx, rx) = mpsc::channel::<Received>();
            let rx = Mutex::new(rx);
            std::thread::scope(|scope| {
                for _ in 0..n {
                    scope.spawn(|| loop {
                        let next = lock(&rx).recv();
                        let Ok(m) = next else { return };
                        if s.handle(m).is_err() {
                            s.over.store(true, Relaxed);
                        }
                    });
                }
                s.serve(&mut req, |m| tx.send(m).map_err(|_| Over));
                drop(tx);
            });
        }
    }
    Ok(())
}

struct Session {
    sh: Arc<Shared>,
    info: ExportInfo,
    client: memloop::registry::MemberId,
    /// Only sent on (by the session's thread, or by its workers).
    comp: Mutex<ZcPort>,
    small: Pool,
    data: Pool,
    /// A worker found the client gone.
    over: AtomicBool,
}

/// The session cannot go on (the client went, or we stop).
struct Over;

impl Session {
    /// Receives requests in batches — waiting for the first, then taking what is queued —
    /// and hands each to `run`, until the client goes or we stop.
    fn serve(&self, req: &mut ZcPort, mut run: impl FnMut(Received) -> Result<(), Over>) {
        let depth = self.info.queue_depth as usize;
        let mut batch: Vec<Received> = Vec::with_capacity(depth);
        loop {
            if self.sh.stop.load(Relaxed) || self.over.load(Relaxed) {
                return;
            }
            req.set_nonblocking(false);
            req.set_timeout(Some(SLICE));
            match req.recv() {
                Ok(Some(m)) => batch.push(m),
                Ok(None) => return,
                Err(memloop::Error::TimedOut) => continue,
                Err(memloop::Error::Forged(why)) => {
                    self.refused_descriptor(why);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(export = %self.sh.name, "client gone: {e}");
                    return;
                }
            }
            // Whatever else is queued already, without waiting.
            req.set_nonblocking(true);
            while batch.len() < depth {
                match req.recv() {
                    Ok(Some(m)) => batch.push(m),
                    Err(memloop::Error::Forged(why)) => self.refused_descriptor(why),
                    _ => break,
                }
            }
            for m in batch.drain(..) {
                if run(m).is_err() {
                    return;
                }
            }
        }
    }

    fn refused_descriptor(&self, why: &str) {
        bump(&self.sh.stats.refused, 1);
        tracing::debug!(export = %self.sh.name, "a forged descriptor: {why}");
    }

    /// One request, answered.
    fn handle(&self, m: Received) -> Result<(), Over> {
        let st = &self.sh.stats;
        bump(&st.requests, 1);
        let r = match proto::parse_request(m.bytes(), m.len() as u64, &self.info) {
            Ok(r) => r,
            Err(refusal) => {
                drop(m);
                bump(&st.refused, 1);
                tracing::debug!(export = %self.sh.name, "refused: {}", refusal.why);
                let h = CompletionHeader::status(refusal.tag.unwrap_or(0), errno::EINVAL);
                return self.reply(&h);
            }
        };
        if self.info.read_only() && matches!(r.op, Op::Write | Op::Discard) {
            drop(m);
            bump(&st.errors, 1);
            return self.reply(&CompletionHeader::status(r.tag, errno::EROFS));
        }
        let status = match r.op {
            Op::Read => {
                drop(m);
                return self.read(&r);
            }
            Op::Write => {
                let s = self.write(&m, &r);
                drop(m);
                bump(&st.writes, 1);
                s
            }
            Op::Flush => {
                drop(m);
                bump(&st.flushes, 1);
                bump(&st.syncs, 1);
                rustix::fs::fdatasync(&self.sh.file)
            }
            Op::Discard => {
                drop(m);
                bump(&st.discards, 1);
                use rustix::fs::FallocateFlags as F;
                let mode = F::PUNCH_HOLE | F::KEEP_SIZE;
                rustix::fs::fallocate(&self.sh.file, mode, r.offset, r.len as u64)
            }
        };
        let errno = match status {
            Ok(()) => 0,
            Err(e) => {
                bump(&st.errors, 1);
                e.raw_os_error()
            }
        };
        self.reply(&CompletionHeader::status(r.tag, errno))
    }

    /// A completion without data.
    fn reply(&self, h: &CompletionHeader) -> Result<(), Over> {
        let l = self.loan(false)?;
        send_header(&mut lock(&self.comp), l, &h.encode()).map_err(|_| Over)
    }

    /// A buffer of ours, waiting while the client holds them all (not past its death or
    /// our stop).
    fn loan(&self, data: bool) -> Result<Loan, Over> {
        let pool = if data { &self.data } else { &self.small };
        loop {
            match pool.loan_timeout(Some(SLICE)) {
                Ok(l) => return Ok(l),
                Err(memloop::Error::TimedOut) => {
                    if self.sh.stop.load(Relaxed) || !self.sh.node.peer_alive(self.client) {
                        return Err(Over);
                    }
                }
                Err(_) => return Err(Over),
            }
        }
    }

    /// READ: the data straight into our buffer, after the completion header.
    fn read(&self, r: &RequestHeader) -> Result<(), Over> {
        let st = &self.sh.stats;
        bump(&st.reads, 1);
        let n = r.len as usize;
        let mut l = self.loan(true)?;
        match pread_full(&self.sh.file, &mut l[HEADER_LEN..HEADER_LEN + n], r.offset) {
            Ok(()) => {
                bump(&st.bytes_read, n as u64);
                let h = CompletionHeader {
                    tag: r.tag,
                    status: 0,
                    len: r.len,
                    data_off: HEADER_LEN as u32,
                };
                l[..HEADER_LEN].copy_from_slice(&h.encode());
                l.truncate(HEADER_LEN + n);
                lock(&self.comp).send(l).map_err(|_| Over)
            }
            Err(e) => {
                drop(l);
                bump(&st.errors, 1);
                self.reply(&CompletionHeader::status(r.tag, e.raw_os_error()))
            }
        }
    }

    /// WRITE: `pwritev` from the client's buffers as we see them (read-only, in place).
    fn write(&self, m: &Received, r: &RequestHeader) -> rustix::io::Result<()> {
        let fd = &self.sh.file;
        let (from, len) = (r.data_off as usize, r.len as usize);
        let mut done = 0;
        // Every byte went with RWF_DSYNC (else FUA takes an fdatasync after).
        let mut synced = r.fua;
        while done < len {
            let iov = slices(m, from + done, len - done);
            let off = r.offset + done as u64;
            let n = if r.fua && self.sh.rwf_dsync.load(Relaxed) {
                match rustix::io::pwritev2(fd, &iov, off, rustix::io::ReadWriteFlags::DSYNC) {
                    Err(e)
                        if e == rustix::io::Errno::NOSYS
                            || e == rustix::io::Errno::OPNOTSUPP
                            || e == rustix::io::Errno::INVAL =>
                    {
                        self.sh.rwf_dsync.store(false, Relaxed);
                        continue;
                    }
                    other => other?,
                }
            } else {
                synced = false;
                rustix::io::pwritev(fd, &iov, off)?
            };
            if n == 0 {
                return Err(rustix::io::Errno::IO);
            }
            done += n;
        }
        bump(&self.sh.stats.bytes_written, len as u64);
        if r.fua {
            bump(&self.sh.stats.syncs, 1);
            if !synced {
                rustix::fs::fdatasync(fd)?;
            }
        }
        Ok(())
    }
}

/// The bytes `[from, from + len)` of a message, over its segments in order.
fn slices(m: &Received, from: usize, len: usize) -> Vec<IoSlice<'_>> {
    let end = from + len;
    let mut out = Vec::new();
    let mut pos = 0;
    for seg in m.segments() {
        let (s, e) = (pos, pos + seg.len());
        let (a, b) = (s.max(from), e.min(end));
        if a < b {
            out.push(IoSlice::new(&seg[a - s..b - s]));
        }
        pos = e;
        if pos >= end {
            break;
        }
    }
    out
}

/// Fills `buf` from `off`; past the end of a file that shrank under us, zeros.
fn pread_full(f: &File, buf: &mut [u8], off: u64) -> rustix::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(f, &mut buf[done..], off + done as u64)? {
            0 => {
                buf[done..].fill(0);
                return Ok(());
            }
            n => done += n,
        }
    }
    Ok(())
}

/// Whether `f` lives in memory (tmpfs, ramfs), where `fdatasync` has nothing to do.
fn memory_backed(f: &File) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    rustix::fs::fstatfs(f).is_ok_and(|s| {
        // (`f_type`'s C type differs between architectures.)
        #[allow(clippy::unnecessary_cast)]
        let t = s.f_type as u64;
        t == TMPFS_MAGIC || t == RAMFS_MAGIC
    })
}
