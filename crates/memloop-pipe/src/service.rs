//! The pipe service: accepts clients on a Unix socket, takes their transfers, and lets a
//! few workers move them a chunk at a time in the order [`Credits`] decides.
//!
//! Threads, and why:
//! - one **acceptor**, and one **reader per client** (a client sends little: a blocking read
//!   per client is the simplest correct loop, and a client whose in-flight transfers reach the
//!   limit is simply not read — its own sends then block: push-back without a queue that
//!   grows);
//! - **workers** (one per CPU by default) run one chunk of the job [`Credits`] picks, then
//!   charge its bytes and thread CPU time to the tenant. At most that many jobs run at once.
//!   A job keeps its thread while no other job waits for a turn, and a job submitted when
//!   none waits is run by its client's reader itself, in a worker's stead: each hand-off
//!   between threads is a wake-up, tens of µs on a VM;
//! - one **poller**: a transfer whose source has nothing to read (or whose sink is full) is
//!   parked in an epoll set, not left to hold a worker, and comes back when it is ready.
//!
//! Descriptors are never switched to non-blocking (they are shared with the client): a
//! transfer only reads what `poll` says is there ([`crate::transfer`]). A client that goes
//! away has its queued and parked transfers dropped (their descriptors closed) and a running
//! one stopped after its chunk.

use crate::credits::{CostModel, Credits, TenantId};
use crate::transfer::{Primitive, Step, Transfer};
use crate::wire::{self, Done, ToClient, ToService};
use crate::{socket, PipeError};
use rustix::event::{epoll, eventfd, poll, EventfdFlags, PollFd, PollFlags};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How a service runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub socket: PathBuf,
    /// Threads moving bytes.
    pub workers: usize,
    /// Bytes a worker moves for one tenant before the next pick (vhost-net's per-turn weight).
    pub chunk: usize,
    pub max_clients: usize,
    /// Transfers one client may have in flight; its further submissions wait unread.
    pub max_inflight: usize,
    /// Weights by tenant name, over what clients ask for.
    pub weights: HashMap<String, u32>,
    pub cost: CostModel,
}

impl Config {
    pub fn new(socket: PathBuf) -> Config {
        Config {
            socket,
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            chunk: 256 << 10,
            max_clients: 1024,
            max_inflight: 64,
            weights: HashMap::new(),
            cost: CostModel::default(),
        }
    }
}

/// A running service; [`Service::stop`] (or dropping it) ends it.
pub struct Service {
    sh: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    cfg: Config,
    st: Mutex<State>,
    /// Workers wait here for a job to pick.
    work: Condvar,
    /// Client readers wait here for room under `max_inflight`.
    room: Condvar,
    epoll: OwnedFd,
    /// Wakes the poller and the acceptor at stop.
    waker: OwnedFd,
    stop: AtomicBool,
    started: Instant,
}

#[derive(Default)]
struct State {
    credits: Credits,
    queues: HashMap<TenantId, VecDeque<u64>>,
    running: HashMap<TenantId, usize>,
    jobs: HashMap<u64, Job>,
    by_id: HashMap<(u64, u64), u64>,
    clients: HashMap<u64, ClientEntry>,
    next_key: u64,
    next_client: u64,
    totals: Totals,
}

#[derive(Default, serde::Serialize)]
struct Totals {
    submitted: u64,
    completed: u64,
    failed: u64,
    cancelled: u64,
    refused: u64,
    /// Finished transfers by the primitive they ended with.
    by_primitive: HashMap<String, u64>,
}

struct Job {
    client: u64,
    id: u64,
    tenant: TenantId,
    /// `None` while a worker has it.
    transfer: Option<Transfer>,
    phase: Phase,
    cancelled: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Running,
    /// Waiting in the epoll set on its source (true) or its sink.
    Parked {
        src: bool,
    },
}

struct ClientEntry {
    sock: Arc<OwnedFd>,
    inflight: usize,
    gone: bool,
}

/// The epoll key of the waker.
const WAKER: u64 = u64::MAX;

impl Service {
    /// Binds the socket and starts the threads.
    pub fn start(cfg: Config) -> Result<Service, PipeError> {
        let listener = socket::listen(&cfg.socket)?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let waker = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        epoll::add(
            &ep,
            &waker,
            epoll::EventData::new_u64(WAKER),
            epoll::EventFlags::IN,
        )?;
        let workers = cfg.workers.max(1);
        let sh = Arc::new(Shared {
            st: Mutex::new(State {
                credits: Credits::new(cfg.cost),
                ..State::default()
            }),
            cfg,
            work: Condvar::new(),
            room: Condvar::new(),
            epoll: ep,
            waker,
            stop: AtomicBool::new(false),
            started: Instant::now(),
        });
        let mut threads = Vec::new();
        for i in 0..workers {
            let s = sh.clone();
            threads.push(spawn(&format!("pipe-worker-{i}"), move || worker(&s))?);
        }
        let s = sh.clone();
        threads.push(spawn("pipe-poller", move || poller(&s))?);
        let s = sh.clone();
        threads.push(spawn("pipe-accept", move || acceptor(&s, listener))?);
        tracing::debug!(socket = %sh.cfg.socket.display(), workers, "pipe service up");
        Ok(Service { sh, threads })
    }

    /// The statistics `memloop status` shows, as JSON.
    pub fn stats_json(&self) -> String {
        self.sh.stats_json()
    }

    /// Stops taking clients and transfers; transfers still queued are dropped.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&self.sh.waker, &1u64.to_ne_bytes());
        self.sh.work.notify_all();
        self.sh.room.notify_all();
        // Client readers block in recv: shutting their sockets down ends them.
        for c in self.sh.lock().clients.values() {
            let _ = rustix::net::shutdown(&*c.sock, rustix::net::Shutdown::Read);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.sh.cfg.socket);
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shutdown();
        }
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, PipeError> {
    Ok(std::thread::Builder::new().name(name.into()).spawn(f)?)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn stats_json(&self) -> String {
        let st = self.lock();
        let parked = st
            .jobs
            .values()
            .filter(|j| matches!(j.phase, Phase::Parked { .. }))
            .count();
        let v = serde_json::json!({
            "socket": self.cfg.socket.display().to_string(),
            "workers": self.cfg.workers,
            "chunk": self.cfg.chunk,
            "clients": st.clients.len(),
            "transfers": st.jobs.len(),
            "parked": parked,
            "totals": st.totals,
            "tenants": st.credits.stats(),
        });
        v.to_string()
    }
}

// ---------------------------------------------------------------------------------------------
// Clients.

fn acceptor(sh: &Arc<Shared>, listener: OwnedFd) {
    loop {
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(&sh.waker, PollFlags::IN),
        ];
        if poll(&mut fds, None).is_err() && !sh.stopping() {
            continue;
        }
        if sh.stopping() {
            return;
        }
        let Ok(c) = rustix::net::accept_with(&listener, rustix::net::SocketFlags::CLOEXEC) else {
            continue;
        };
        let s = sh.clone();
        if let Err(e) = spawn("pipe-client", move || client(&s, c)) {
            tracing::debug!("pipe service: a client thread: {e}");
        }
    }
}

/// One client's reader: its hello, then submissions and cancellations until it goes.
fn client(sh: &Arc<Shared>, sock: OwnedFd) {
    let sock = Arc::new(sock);
    let (cid, tenant) = match hello(sh, &sock) {
        Ok(Some(x)) => x,
        Ok(None) => return,
        Err(e) => {
            tracing::debug!("pipe service: a client's hello: {e}");
            return;
        }
    };
    loop {
        if !wait_for_room(sh, cid) {
            break;
        }
        match socket::recv(sock.as_fd(), 256) {
            Ok(Some(p)) => {
                if let Err(e) = handle(sh, cid, tenant, &sock, p) {
                    tracing::debug!(client = cid, "pipe service: {e}");
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(client = cid, "pipe service: reading a client: {e}");
                break;
            }
        }
    }
    client_gone(sh, cid);
}

/// Reads the hello, names and weighs the tenant, answers. `None`: refused or gone.
fn hello(sh: &Shared, sock: &Arc<OwnedFd>) -> Result<Option<(u64, TenantId)>, PipeError> {
    let Some(p) = socket::recv(sock.as_fd(), 256)? else {
        return Ok(None);
    };
    let refuse = |reason: String| {
        let _ = socket::send(sock.as_fd(), &ToClient::Refused { reason }.encode(), &[]);
        Ok(None)
    };
    let (version, weight, name) = match ToService::decode(&p.bytes)? {
        ToService::Hello {
            version,
            weight,
            name,
        } => (version, weight, name),
        _ => return refuse("the first message must be a hello".into()),
    };
    if version != wire::VERSION {
        return refuse(format!(
            "protocol version {version}; this service speaks {}",
            wire::VERSION
        ));
    }
    let name = match name.is_empty() {
        true => default_tenant(sock.as_fd()),
        false => name,
    };
    let weight = sh
        .cfg
        .weights
        .get(&name)
        .copied()
        .unwrap_or(weight as u32)
        .clamp(1, 1000);
    let mut st = sh.lock();
    if st.clients.len() >= sh.cfg.max_clients {
        drop(st);
        return refuse(format!("{} clients already", sh.cfg.max_clients));
    }
    let tenant = st.credits.add_tenant(name.clone(), weight);
    st.next_client += 1;
    let cid = st.next_client;
    st.clients.insert(
        cid,
        ClientEntry {
            sock: sock.clone(),
            inflight: 0,
            gone: false,
        },
    );
    drop(st);
    let welcome = ToClient::Welcome {
        version: wire::VERSION,
        weight: weight as u16,
        tenant: name,
    };
    socket::send(sock.as_fd(), &welcome.encode(), &[])?;
    Ok(Some((cid, tenant)))
}

/// A tenant named after the client's control group (a container is one), else its user.
fn default_tenant(sock: BorrowedFd<'_>) -> String {
    let Ok(cred) = rustix::net::sockopt::socket_peercred(sock) else {
        return "unknown".into();
    };
    let pid = cred.pid.as_raw_nonzero().get();
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        })
        .map(|cg| format!("cgroup:{cg}"))
        .unwrap_or_else(|| format!("uid:{}", cred.uid.as_raw()))
}

/// Waits while the client has `max_inflight` transfers; false at stop.
fn wait_for_room(sh: &Shared, cid: u64) -> bool {
    let mut st = sh.lock();
    loop {
        if sh.stopping() {
            return false;
        }
        match st.clients.get(&cid) {
            Some(c) if c.inflight < sh.cfg.max_inflight => return true,
            Some(_) => {}
            None => return false,
        }
        st = sh.room.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

fn handle(
    sh: &Shared,
    cid: u64,
    tenant: TenantId,
    sock: &Arc<OwnedFd>,
    p: socket::Packet,
) -> Result<(), PipeError> {
    match ToService::decode(&p.bytes)? {
        ToService::Submit { id, len, src_off } => {
            submit(sh, cid, tenant, sock, id, (len, src_off), p.fds)
        }
        ToService::Cancel { id } => {
            cancel(sh, cid, id);
            Ok(())
        }
        ToService::Stats => {
            let json = sh.stats_json();
            socket::send(sock.as_fd(), &ToClient::StatsReply { json }.encode(), &[])
        }
        ToService::Hello { .. } => Err(PipeError::Protocol("a second hello".into())),
    }
}

fn submit(
    sh: &Shared,
    cid: u64,
    tenant: TenantId,
    sock: &Arc<OwnedFd>,
    id: u64,
    (len, src_off): (Option<u64>, Option<u64>),
    fds: Vec<OwnedFd>,
) -> Result<(), PipeError> {
    let transfer = match <[OwnedFd; 2]>::try_from(fds) {
        Ok([src, dst]) => Transfer::new(src, dst, len, src_off),
        Err(v) => Err(PipeError::Protocol(format!(
            "a submission with {} descriptors (want 2)",
            v.len()
        ))),
    };
    let transfer = match transfer {
        Ok(t) => t,
        Err(e) => {
            sh.lock().totals.refused += 1;
            let d = Done {
                id,
                moved: 0,
                errno: e.errno(),
                primitive: None,
            };
            return socket::send(sock.as_fd(), &ToClient::Done(d).encode(), &[]);
        }
    };
    let now = sh.now();
    let mut st = sh.lock();
    st.next_key += 1;
    let key = st.next_key;
    st.totals.submitted += 1;
    if let Some(c) = st.clients.get_mut(&cid) {
        c.inflight += 1;
    }
    st.by_id.insert((cid, id), key);
    st.jobs.insert(
        key,
        Job {
            client: cid,
            id,
            tenant,
            transfer: Some(transfer),
            phase: Phase::Queued,
            cancelled: false,
        },
    );
    st.enqueue(key, tenant, now);
    // Nothing else waits for a turn: this thread runs it at once (a hand-off to a worker
    // costs a wake-up, tens of µs on a VM). It reads its client's next message when the
    // transfer ends, parks or has to take turns.
    let alone = st.queues.values().map(VecDeque::len).sum::<usize>() == 1;
    let mine = match alone {
        true => st.pick(now, sh.cfg.workers.max(1)),
        false => None,
    };
    drop(st);
    match mine {
        Some((key, tenant, t)) => run_job(sh, key, tenant, t),
        None => sh.work.notify_one(),
    }
    Ok(())
}

fn cancel(sh: &Shared, cid: u64, id: u64) {
    let mut st = sh.lock();
    let Some(&key) = st.by_id.get(&(cid, id)) else {
        return;
    };
    let done = st.cancel_job(sh, key);
    drop(st);
    if let Some((sock, d)) = done {
        let _ = socket::send(sock.as_fd(), &ToClient::Done(d).encode(), &[]);
    }
}

/// The client went away: its transfers go with it.
fn client_gone(sh: &Shared, cid: u64) {
    let mut st = sh.lock();
    if let Some(c) = st.clients.get_mut(&cid) {
        c.gone = true;
    }
    let keys: Vec<u64> = st
        .jobs
        .iter()
        .filter(|(_, j)| j.client == cid)
        .map(|(&k, _)| k)
        .collect();
    for k in keys {
        st.cancel_job(sh, k);
    }
    st.forget_client_if_idle(cid);
    drop(st);
    tracing::debug!(client = cid, "pipe service: client gone");
}

// ---------------------------------------------------------------------------------------------
// Jobs.

impl State {
    fn enqueue(&mut self, key: u64, tenant: TenantId, now: Duration) {
        self.queues.entry(tenant).or_default().push_back(key);
        if let Some(j) = self.jobs.get_mut(&key) {
            j.phase = Phase::Queued;
        }
        self.update_backlog(tenant, now);
    }

    /// A tenant competes for turns while it has work queued or running (a running job comes
    /// straight back): only a tenant with nothing but parked jobs is idle.
    fn update_backlog(&mut self, tenant: TenantId, now: Duration) {
        let queued = self.queues.get(&tenant).is_some_and(|q| !q.is_empty());
        let running = self.running.get(&tenant).copied().unwrap_or(0) > 0;
        self.credits.set_backlogged(tenant, queued || running, now);
    }

    /// The next job to run, by credits among the tenants with one queued, if fewer than `slots`
    /// run (a client's reader may run one in a worker's stead).
    /// `None` as well while `slots` jobs run already (whichever threads run them).
    fn pick(&mut self, now: Duration, slots: usize) -> Option<(u64, TenantId, Transfer)> {
        if self.running.values().sum::<usize>() >= slots {
            return None;
        }
        let queues = &self.queues;
        let tenant = self
            .credits
            .pick_where(now, |t| queues.get(&t).is_some_and(|q| !q.is_empty()))?;
        let key = self.queues.get_mut(&tenant)?.pop_front()?;
        *self.running.entry(tenant).or_default() += 1;
        let job = self.jobs.get_mut(&key)?;
        job.phase = Phase::Running;
        let t = job.transfer.take()?;
        Some((key, tenant, t))
    }

    /// Cancels a job that is not running (a running one is flagged and ends after its
    /// chunk). Returns the completion to send, if its client is still there.
    fn cancel_job(&mut self, sh: &Shared, key: u64) -> Option<(Arc<OwnedFd>, Done)> {
        let job = self.jobs.get_mut(&key)?;
        let holds = job.transfer.as_ref().is_some_and(|t| t.held() > 0);
        if holds && job.phase != Phase::Running {
            return self.drain_job(sh, key);
        }
        match job.phase {
            Phase::Running => {
                job.cancelled = true;
                None
            }
            Phase::Queued => {
                let t = job.tenant;
                if let Some(q) = self.queues.get_mut(&t) {
                    q.retain(|&k| k != key);
                }
                self.update_backlog(t, sh.now());
                self.finish(key, Err(PipeError::Cancelled))
            }
            Phase::Parked { src } => {
                if let Some(t) = &job.transfer {
                    let fd = if src { t.src() } else { t.dst() };
                    let _ = epoll::delete(&sh.epoll, fd);
                }
                self.finish(key, Err(PipeError::Cancelled))
            }
        }
    }

    /// Cancels a queued or parked job that holds bytes read from its source: it reads no
    /// more, and ends (as cancelled) once those bytes are in its sink.
    fn drain_job(&mut self, sh: &Shared, key: u64) -> Option<(Arc<OwnedFd>, Done)> {
        let job = self.jobs.get_mut(&key)?;
        job.cancelled = true;
        let t = job.transfer.as_mut()?;
        t.stop_reading();
        if job.phase == (Phase::Parked { src: true }) {
            let _ = epoll::delete(&sh.epoll, t.src());
            let tenant = job.tenant;
            self.enqueue(key, tenant, sh.now());
            sh.work.notify_one();
        }
        None
    }

    /// Ends a job: drops it (closing its descriptors), counts it, and returns the completion
    /// to send to its client (none if the client is gone).
    fn finish(&mut self, key: u64, r: Result<(), PipeError>) -> Option<(Arc<OwnedFd>, Done)> {
        let job = self.jobs.remove(&key)?;
        self.by_id.remove(&(job.client, job.id));
        let (moved, primitive) = job
            .transfer
            .as_ref()
            .map_or((0, None), |t| (t.moved(), Some(t.primitive())));
        let errno = match &r {
            Ok(()) => 0,
            Err(e) => e.errno(),
        };
        match &r {
            Ok(()) => self.totals.completed += 1,
            Err(PipeError::Cancelled) => self.totals.cancelled += 1,
            Err(_) => self.totals.failed += 1,
        }
        if let Some(p) = primitive {
            *self
                .totals
                .by_primitive
                .entry(primitive_name(p))
                .or_default() += 1;
        }
        drop(job.transfer);
        let c = self.clients.get_mut(&job.client)?;
        c.inflight = c.inflight.saturating_sub(1);
        let send = (!c.gone).then(|| c.sock.clone());
        self.forget_client_if_idle(job.client);
        let d = Done {
            id: job.id,
            moved,
            errno,
            primitive,
        };
        send.map(|s| (s, d))
    }

    fn forget_client_if_idle(&mut self, cid: u64) {
        if self
            .clients
            .get(&cid)
            .is_some_and(|c| c.gone && c.inflight == 0)
        {
            self.clients.remove(&cid);
        }
    }
}

fn primitive_name(p: Primitive) -> String {
    serde_json::to_value(p)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{p:?}"))
}

// ---------------------------------------------------------------------------------------------
// Workers and the poller.

fn worker(sh: &Shared) {
    while let Some((key, tenant, t)) = next_job(sh) {
        run_job(sh, key, tenant, t);
    }
}

/// Runs a job chunk by chunk for as long as it keeps this thread ([`after_step`]).
fn run_job(sh: &Shared, key: u64, tenant: TenantId, mut t: Transfer) {
    let mut lingered = false;
    loop {
        let cpu0 = thread_cpu();
        let t0 = Instant::now();
        let before = t.moved();
        let r = t.step(sh.cfg.chunk);
        let bytes = t.moved() - before;
        let (cpu, wall) = (thread_cpu().saturating_sub(cpu0), t0.elapsed());
        let step = Ran {
            key,
            tenant,
            bytes,
            cpu,
            wall,
            lingered,
        };
        match after_step(sh, step, t, r) {
            Next::Again(back) => (t, lingered) = (back, false),
            Next::Linger(back, src) => {
                linger(&back, src);
                (t, lingered) = (back, true);
            }
            Next::Over => return,
        }
    }
}

/// How long a worker with nothing else to do waits for a transfer's descriptor itself before
/// parking it: a park and its wake-up cost two thread hand-offs (tens of µs each on a VM),
/// where a socket's reader usually drains it within microseconds.
const LINGER: Duration = Duration::from_micros(500);

/// Waits up to [`LINGER`] for the source to be readable (or the sink writable).
fn linger(t: &Transfer, src: bool) {
    let (fd, ev) = match src {
        true => (t.src(), PollFlags::IN),
        false => (t.dst(), PollFlags::OUT),
    };
    let mut fds = [PollFd::new(fd, ev)];
    let timeout = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: LINGER.as_nanos() as _,
    };
    let _ = poll(&mut fds, Some(&timeout));
}

/// One chunk a worker ran, for [`after_step`].
struct Ran {
    key: u64,
    tenant: TenantId,
    bytes: u64,
    cpu: Duration,
    wall: Duration,
    /// The worker already lingered on this job since its last progress.
    lingered: bool,
}

/// What the worker does next with the job it ran.
enum Next {
    /// Run it again at once: no other job waits for a turn.
    Again(Transfer),
    /// Wait a little for its source (true) or sink, then run it again.
    Linger(Transfer, bool),
    /// It is queued, parked or finished.
    Over,
}

/// Waits for a job the credits pick; `None` at stop.
fn next_job(sh: &Shared) -> Option<(u64, TenantId, Transfer)> {
    let mut st = sh.lock();
    loop {
        if sh.stopping() {
            return None;
        }
        if let Some(j) = st.pick(sh.now(), sh.cfg.workers.max(1)) {
            return Some(j);
        }
        st = sh.work.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

/// Charges a chunk and decides what becomes of its job. A job keeps its worker while no
/// other job is queued (no turn to give, so no hand-off to pay for); otherwise it goes back
/// to its tenant's queue, and the credits pick who runs next.
fn after_step(sh: &Shared, ran: Ran, t: Transfer, r: Result<Step, PipeError>) -> Next {
    let (key, tenant, now) = (ran.key, ran.tenant, sh.now());
    let mut st = sh.lock();
    st.credits.charge(tenant, ran.bytes, ran.cpu, ran.wall, now);
    let cancelled = !matches!(st.jobs.get(&key), Some(j) if !j.cancelled);
    // A cancelled transfer still delivers what it took from its source.
    let mut t = t;
    let draining = cancelled && !sh.stopping() && t.held() > 0;
    if draining {
        t.stop_reading();
    }
    let r = match r {
        Ok(Step::WaitInput) if draining => Ok(Step::Moved(0)),
        r => r,
    };
    let alone = st.queues.values().all(|q| q.is_empty());
    let keep = (!cancelled || draining) && !sh.stopping() && alone;
    match &r {
        Ok(Step::Moved(_)) if keep => return Next::Again(t),
        Ok(Step::WaitInput) if keep && !ran.lingered => return Next::Linger(t, true),
        Ok(Step::WaitOutput) if keep && !ran.lingered => return Next::Linger(t, false),
        _ => {}
    }
    if let Some(n) = st.running.get_mut(&tenant) {
        *n = n.saturating_sub(1);
    }
    if let Some(j) = st.jobs.get_mut(&key) {
        j.transfer = Some(t);
    }
    let mut requeued = false;
    let done = match r {
        _ if (cancelled && !draining) || sh.stopping() => st.finish(key, Err(PipeError::Cancelled)),
        Ok(Step::Done) if cancelled => st.finish(key, Err(PipeError::Cancelled)),
        Ok(Step::Moved(_)) => {
            st.enqueue(key, tenant, now);
            requeued = true;
            None
        }
        Ok(Step::WaitInput) => park(sh, &mut st, key, true),
        Ok(Step::WaitOutput) => park(sh, &mut st, key, false),
        Ok(Step::Done) => st.finish(key, Ok(())),
        Err(e) => {
            tracing::debug!(job = key, "pipe transfer failed: {e}");
            st.finish(key, Err(e))
        }
    };
    st.update_backlog(tenant, now);
    drop(st);
    // This worker picks again at once; another is needed only if more than its job waits.
    if !requeued || !alone {
        sh.work.notify_one();
    }
    sh.room.notify_all();
    if let Some((sock, d)) = done {
        let _ = socket::send(sock.as_fd(), &ToClient::Done(d).encode(), &[]);
    }
    Next::Over
}

/// Puts a job in the epoll set until its source (or sink) is ready.
fn park(sh: &Shared, st: &mut State, key: u64, src: bool) -> Option<(Arc<OwnedFd>, Done)> {
    let job = st.jobs.get_mut(&key)?;
    let t = job.transfer.as_ref()?;
    let (fd, flags) = match src {
        true => (t.src(), epoll::EventFlags::IN),
        false => (t.dst(), epoll::EventFlags::OUT),
    };
    let flags = flags | epoll::EventFlags::ONESHOT | epoll::EventFlags::RDHUP;
    match epoll::add(&sh.epoll, fd, epoll::EventData::new_u64(key), flags) {
        Ok(()) => {
            job.phase = Phase::Parked { src };
            None
        }
        Err(e) => st.finish(key, Err(e.into())),
    }
}

fn poller(sh: &Shared) {
    let mut events = Vec::with_capacity(64);
    loop {
        events.clear();
        match epoll::wait(&sh.epoll, spare(&mut events), None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                tracing::debug!("pipe service: epoll: {e}");
                return;
            }
        }
        if sh.stopping() {
            return;
        }
        let now = sh.now();
        let mut st = sh.lock();
        for ev in &events {
            let key = ev.data.u64();
            if key != WAKER {
                unpark(sh, &mut st, key, now);
            }
        }
        drop(st);
        sh.work.notify_all();
    }
}

fn spare(v: &mut Vec<epoll::Event>) -> rustix::buffer::SpareCapacity<'_, epoll::Event> {
    rustix::buffer::spare_capacity(v)
}

fn unpark(sh: &Shared, st: &mut State, key: u64, now: Duration) {
    let Some(job) = st.jobs.get(&key) else {
        return; // cancelled meanwhile (and deleted from the set then)
    };
    let (Phase::Parked { src }, Some(t)) = (job.phase, &job.transfer) else {
        return;
    };
    let _ = epoll::delete(&sh.epoll, if src { t.src() } else { t.dst() });
    let tenant = job.tenant;
    st.enqueue(key, tenant, now);
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}
