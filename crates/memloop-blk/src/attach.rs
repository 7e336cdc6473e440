//! What every frontend of an attachment shares, whatever the kernel sees (a FUSE file under a
//! loop device, an NBD device): the export's geometry, the requests in flight by tag, the
//! counters, and the three threads' jobs besides reading requests — the *replier* answering
//! completions, and the *connector* reattaching after the storage side went (or was given up
//! as stuck past the I/O timeout). Each frontend reads and answers in its own format.

use crate::client::{BlkClient, ClientOptions, Completer, Completion, SessionWatch, Submitter};
use crate::error::BlkError;
use crate::proto::{errno, ExportInfo};
use memloop::Node;
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const SLICE: Duration = Duration::from_millis(200);

/// The frontend's counters (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrontendStats {
    /// Requests the kernel sent (every opcode).
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Replies with an error (I/O and metadata alike).
    pub errors: u64,
    /// I/O failed because no storage server was attached (or it went with it in flight).
    pub failed_disconnected: u64,
    /// Requests refused as malformed.
    pub refused: u64,
    /// Times a new export was attached after the first.
    pub reattached: u64,
    /// Sessions given up because a request waited longer than the I/O timeout (the storage
    /// side alive but answering nothing): their requests failed with `EIO`.
    pub timed_out: u64,
    pub connected: bool,
}

/// How the frontend behaves.
#[derive(Clone, Copy, Debug)]
pub struct FrontendOptions {
    /// A request unanswered this long gives the session up: what is in flight fails with
    /// `EIO`, new I/O too until the storage side answers an attach again (`None`: wait for
    /// ever, as long as the storage side lives).
    pub io_timeout: Option<Duration>,
}

impl Default for FrontendOptions {
    fn default() -> Self {
        FrontendOptions {
            io_timeout: Some(DEFAULT_IO_TIMEOUT),
        }
    }
}

/// The default I/O timeout: long enough for any storage that is merely slow.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) discards: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) failed_disconnected: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) reattached: AtomicU64,
    pub(crate) timed_out: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

/// What a request in flight needs for its reply.
#[derive(Clone, Copy)]
pub(crate) enum Pend {
    /// Reply with `len` bytes of the data from `skip`.
    Read { skip: usize, len: usize },
    /// Reply `fuse_write_out { size }`.
    Write { size: u32 },
    /// An empty reply.
    Empty,
}

/// The state the threads of one attachment share.
pub(crate) struct Core {
    pub(crate) name: String,
    pub(crate) info: ExportInfo,
    /// What each request in flight needs for its answer, by tag.
    pub(crate) pending: Mutex<HashMap<u64, Pend>>,
    pub(crate) stats: Counters,
    pub(crate) connected: AtomicBool,
    pub(crate) stop: AtomicBool,
}

impl Core {
    pub(crate) fn new(name: &str, info: ExportInfo) -> Core {
        Core {
            name: name.into(),
            info,
            pending: Mutex::new(HashMap::new()),
            stats: Counters::default(),
            connected: AtomicBool::new(true),
            stop: AtomicBool::new(false),
        }
    }

    /// Whether a flush has nothing to do on the storage side, so that the frontend answers it
    /// itself: every write a flush covers has completed into the storage side's file, and
    /// only a volatile cache there (the export's `flush` flag) needs the round trip.
    pub(crate) fn flush_is_local(&self) -> bool {
        self.info.read_only() || !self.info.needs_flush()
    }

    pub(crate) fn stats(&self) -> FrontendStats {
        let c = &self.stats;
        let g = |a: &AtomicU64| a.load(Relaxed);
        FrontendStats {
            requests: g(&c.requests),
            reads: g(&c.reads),
            writes: g(&c.writes),
            flushes: g(&c.flushes),
            discards: g(&c.discards),
            bytes_read: g(&c.bytes_read),
            bytes_written: g(&c.bytes_written),
            errors: g(&c.errors),
            failed_disconnected: g(&c.failed_disconnected),
            refused: g(&c.refused),
            reattached: g(&c.reattached),
            timed_out: g(&c.timed_out),
            connected: self.connected.load(Relaxed),
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records the request, then submits it; a refusal is answered at once.
/// (`reply_err`: the frontend's error answer.)
pub(crate) fn submit(
    ctx: &Core,
    s: &mut Submitter,
    unique: u64,
    pend: Pend,
    f: impl FnOnce(&mut Submitter) -> Result<(), BlkError>,
    reply_err: impl FnOnce(u64, i32),
) {
    let r = s.wait_room(None).and_then(|()| {
        lock(&ctx.pending).insert(unique, pend);
        f(s)
    });
    if let Err(e) = r {
        lock(&ctx.pending).remove(&unique);
        if matches!(e, BlkError::Disconnected) {
            bump(&ctx.stats.failed_disconnected);
        }
        reply_err(unique, e.errno());
    }
}

/// [`submit`] to the session if there is one; without one (the storage side gone) the
/// request fails with `EIO` at once.
pub(crate) fn submit_to(
    ctx: &Core,
    sub: &mut Option<Submitter>,
    tag: u64,
    pend: Pend,
    f: impl FnOnce(&mut Submitter) -> Result<(), BlkError>,
    reply_err: impl FnOnce(u64, i32),
) {
    match sub.as_mut() {
        Some(s) => submit(ctx, s, tag, pend, f, reply_err),
        None => {
            bump(&ctx.stats.failed_disconnected);
            reply_err(tag, errno::EIO);
        }
    }
}

/// Takes completions and has `answer` answer each; when the storage side goes, says so in
/// `connected` and waits for the connector's next session.
fn replier(
    ctx: &Core,
    mut comp: Option<Completer>,
    rx: Receiver<Completer>,
    answer: impl Fn(Completion),
) {
    while !ctx.stop.load(Relaxed) {
        let Some(c) = comp.as_mut() else {
            match rx.recv_timeout(SLICE) {
                Ok(c) => comp = Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            continue;
        };
        match c.complete(Some(SLICE)) {
            Ok(done) => {
                for c in done {
                    answer(c);
                }
            }
            Err(e) => {
                if !matches!(e, BlkError::Disconnected) {
                    tracing::warn!(export = %ctx.name, "completions: {e}");
                }
                tracing::info!(export = %ctx.name, "the storage server is gone");
                ctx.connected.store(false, Relaxed);
                comp = None;
            }
        }
    }
}

/// While the server is gone, attaches again (every quarter second) to a new export of the
/// same name, which must have the same size, block size and max I/O. While it is there,
/// watches the oldest request: past the I/O timeout the session is given up (a server
/// alive but stuck), and an attach tried again like after a death.
fn connector(
    ctx: &Core,
    node: &Node,
    (fo, opts): (FrontendOptions, ClientOptions),
    mut watch: SessionWatch,
    (sub_tx, comp_tx): (Sender<Submitter>, Sender<Completer>),
) {
    let mut said = false;
    while !ctx.stop.load(Relaxed) {
        std::thread::sleep(Duration::from_millis(250));
        if ctx.connected.load(Relaxed) {
            said = false;
            give_up_if_stuck(ctx, &watch, fo.io_timeout);
            continue;
        }
        let client = match BlkClient::connect_with(node, &ctx.name, opts) {
            Ok(c) => c,
            Err(e) => {
                if !said {
                    tracing::info!(export = %ctx.name, "reattaching: {e}");
                    said = true;
                }
                continue;
            }
        };
        let i = client.info();
        let (was, now) = (ctx.info, *i);
        if now.size != was.size
            || now.block_size != was.block_size
            || now.max_io != was.max_io
            || now.read_only() != was.read_only()
        {
            if !said {
                tracing::warn!(
                    export = %ctx.name,
                    "the new export differs (size {} block {} max I/O {}): not reattaching",
                    now.size, now.block_size, now.max_io
                );
                said = true;
            }
            drop(client);
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        watch = client.watch();
        let (s, c) = client.split();
        if comp_tx.send(c).is_err() || sub_tx.send(s).is_err() {
            return;
        }
        bump(&ctx.stats.reattached);
        ctx.connected.store(true, Relaxed);
        tracing::info!(export = %ctx.name, "reattached");
    }
}

/// Gives the session up if its oldest request has waited past `timeout`.
fn give_up_if_stuck(ctx: &Core, watch: &SessionWatch, timeout: Option<Duration>) {
    let Some(t) = timeout else { return };
    if watch.is_over() || !watch.oldest_in_flight().is_some_and(|w| w >= t) {
        return;
    }
    tracing::warn!(
        export = %ctx.name,
        "a request unanswered for {:.1} s: the storage side is stuck; failing the I/O in \
         flight and attaching again",
        t.as_secs_f64()
    );
    bump(&ctx.stats.timed_out);
    watch.abandon();
}

/// Starts an attachment's threads around `client` (connected with `opts`): the frontend's
/// `reader` (handed the submitting half, and where the next session's comes from), the
/// replier (answering each completion with `answer`) and the connector.
pub(crate) fn start<C>(
    ctx: &Arc<C>,
    node: &Node,
    client: BlkClient,
    (fo, opts): (FrontendOptions, ClientOptions),
    reader: impl FnOnce(&C, Submitter, Receiver<Submitter>) + Send + 'static,
    answer: impl Fn(&C, Completion) + Send + 'static,
) -> std::io::Result<Vec<JoinHandle<()>>>
where
    C: Deref<Target = Core> + Send + Sync + 'static,
{
    let watch = client.watch();
    let (sub, comp) = client.split();
    let (sub_tx, sub_rx) = mpsc::channel::<Submitter>();
    let (comp_tx, comp_rx) = mpsc::channel::<Completer>();
    let spawn = |n: &str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(format!("blk-{n}"))
            .spawn(f)
    };
    let c = ctx.clone();
    let mut threads = vec![spawn("read", Box::new(move || reader(&c, sub, sub_rx)))?];
    let c = ctx.clone();
    threads.push(spawn(
        "reply",
        Box::new(move || replier(&c, Some(comp), comp_rx, |x| answer(&c, x))),
    )?);
    let c = ctx.clone();
    let node = node.clone();
    threads.push(spawn(
        "connect",
        Box::new(move || connector(&c, &node, (fo, opts), watch, (sub_tx, comp_tx))),
    )?);
    Ok(threads)
}

/// Joins `threads`, waiting at most `limit` for them to end (a thread stuck in the kernel is
/// left behind). A frontend joins its threads on the way out so that the session's buffers
/// and channels are given back to the region by their owner, not left for a liveness sweep
/// (which, towards another kernel, takes heartbeats to judge).
pub(crate) fn join_within(threads: Vec<JoinHandle<()>>, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    while threads.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for t in threads.into_iter().filter(|t| t.is_finished()) {
        let _ = t.join();
    }
}

/// How long a frontend waits for its threads when it goes.
pub(crate) const JOIN_LIMIT: Duration = Duration::from_secs(3);
