//! Every source → sink pair of [`Transfer`] among regular files, TCP sockets over loopback,
//! Unix stream sockets and pipes (plus `/dev/null`), with a hash of what arrived, the
//! primitive chosen, the file offsets the client sees, and the descriptors' flags left alone;
//! then the edges: file → file across file systems (`EXDEV`), the whole fallback chain, data
//! larger than any pipe, sources that end early, bad descriptors and lengths, sinks whose
//! reader is gone, and sources or sinks that are not ready (the step must not block).
//!
//! The test drives `step` the way the service does: on `WaitInput`/`WaitOutput` it polls the
//! descriptor (with a timeout) before stepping again. Socket and pipe peers are fed and drained
//! by helper threads.

use memloop_pipe::transfer::{EndKind, Fallback, Primitive, Step, Transfer};
use memloop_pipe::PipeError;
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::net::SendFlags;
use std::fs::File;
use std::io::{self, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What the test hands to one `step`, as the service would.
const BUDGET: usize = 256 * 1024;
/// A few MiB, not a multiple of a page.
const DATA_LEN: usize = 3 * 1024 * 1024 + 4321;
/// An exact length shorter than the data.
const SHORT_LEN: usize = DATA_LEN / 2 + 777;
/// How long one transfer may take before the test calls it stuck.
const DRIVE_LIMIT: Duration = Duration::from_secs(60);
/// How long one test may take (a step that blocks is caught here).
const TEST_LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------------
// Data and hash.

/// Deterministic pseudo-random bytes (splitmix64).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn data() -> Arc<Vec<u8>> {
    static DATA: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    DATA.get_or_init(|| Arc::new(random_bytes(DATA_LEN, 20)))
        .clone()
}

/// A streaming 64-bit hash in the manner of xxHash64 (8-byte lanes, multiply-rotate rounds,
/// length and tail folded in, final avalanche): order- and length-sensitive, and strong enough
/// to tell a lost, repeated or reordered chunk.
struct Hasher {
    h: u64,
    tail: [u8; 8],
    tail_len: usize,
    total: u64,
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

impl Hasher {
    fn new() -> Hasher {
        Hasher {
            h: P3,
            tail: [0; 8],
            tail_len: 0,
            total: 0,
        }
    }

    fn word(&mut self, w: u64) {
        let k = w.wrapping_mul(P2).rotate_left(31).wrapping_mul(P1);
        self.h = (self.h ^ k)
            .rotate_left(27)
            .wrapping_mul(P1)
            .wrapping_add(P3);
    }

    fn update(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.tail_len > 0 {
            let take = (8 - self.tail_len).min(bytes.len());
            self.tail[self.tail_len..self.tail_len + take].copy_from_slice(&bytes[..take]);
            self.tail_len += take;
            bytes = &bytes[take..];
            if self.tail_len < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.tail));
            self.tail_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().unwrap()));
        }
        let rest = words.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.tail_len = rest.len();
    }

    /// (bytes hashed, hash)
    fn finish(&self) -> (u64, u64) {
        let mut h = self.h ^ self.total.wrapping_mul(P1);
        for &b in &self.tail[..self.tail_len] {
            h = (h ^ (b as u64).wrapping_mul(P3))
                .rotate_left(11)
                .wrapping_mul(P1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^= h >> 32;
        (self.total, h)
    }
}

fn hash_of(bytes: &[u8]) -> (u64, u64) {
    let mut h = Hasher::new();
    h.update(bytes);
    h.finish()
}

#[test]
fn hash_ignores_chunking_and_sees_content() {
    let d = random_bytes(100_003, 1);
    let whole = hash_of(&d);
    let mut pieces = Hasher::new();
    for c in d.chunks(7919) {
        pieces.update(c);
    }
    assert_eq!(
        pieces.finish(),
        whole,
        "the hash depends on how the bytes were chunked"
    );
    let mut swapped = d.clone();
    swapped.swap(10, 50_000);
    assert_ne!(hash_of(&swapped), whole, "two bytes swapped, same hash");
    let mut flipped = d.clone();
    flipped[99_999] ^= 1;
    assert_ne!(hash_of(&flipped), whole, "a bit flipped, same hash");
    assert_ne!(hash_of(&d[..100_002]), whole, "a byte lost, same hash");
}

// ---------------------------------------------------------------------------------------------
// Harness.

/// Runs `f` on a thread and fails the test if it does not finish in `limit` (a step that
/// blocks would otherwise hang the test run).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("test did not finish within {limit:?}: a step blocked or the transfer stalled")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the test thread ended without a result"),
        },
    }
}

/// A directory of its own under `base`, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new_in(base: &Path, tag: &str) -> io::Result<TempDir> {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("memloop-pipe-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }

    fn new(tag: &str) -> TempDir {
        TempDir::new_in(Path::new(env!("CARGO_TARGET_TMPDIR")), tag).expect("temp dir")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn wait_for(fd: BorrowedFd<'_>, events: PollFlags, timeout: Duration) {
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    let mut fds = [PollFd::from_borrowed_fd(fd, events)];
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(Errno::INTR) => {}
        Err(e) => panic!("poll: {e}"),
    }
}

#[derive(Debug, Default)]
struct Stats {
    steps: u64,
    wait_input: u64,
    wait_output: u64,
}

/// Steps `t` to the end as the service would; checks every step's count against the budget and
/// `moved()`.
fn drive(t: &mut Transfer) -> Result<Stats, PipeError> {
    let start = Instant::now();
    let mut stats = Stats::default();
    let mut sum = t.moved();
    loop {
        assert!(
            start.elapsed() < DRIVE_LIMIT,
            "transfer stalled: {} bytes moved, {stats:?}",
            t.moved()
        );
        stats.steps += 1;
        match t.step(BUDGET)? {
            Step::Moved(n) => {
                assert!(n > 0, "Moved(0) with a budget of {BUDGET}");
                assert!(
                    n <= BUDGET as u64,
                    "a step moved {n} bytes, budget {BUDGET}"
                );
                sum += n;
                assert_eq!(sum, t.moved(), "steps' counts and moved() disagree");
            }
            Step::WaitInput => {
                stats.wait_input += 1;
                wait_for(t.src().as_fd(), PollFlags::IN, Duration::from_secs(1));
            }
            Step::WaitOutput => {
                stats.wait_output += 1;
                wait_for(t.dst().as_fd(), PollFlags::OUT, Duration::from_secs(1));
            }
            Step::Done => {
                assert_eq!(t.step(BUDGET)?, Step::Done, "a finished transfer went on");
                return Ok(stats);
            }
        }
    }
}

/// The kinds of ends the test builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Tcp,
    Unix,
    Pipe,
    Null,
}

impl Kind {
    fn end_kind(self) -> EndKind {
        match self {
            Kind::File => EndKind::File,
            Kind::Tcp | Kind::Unix => EndKind::Socket,
            Kind::Pipe => EndKind::Pipe,
            Kind::Null => EndKind::Other,
        }
    }
}

/// A connected TCP pair over loopback: (one end, the other).
fn tcp_pair() -> (OwnedFd, OwnedFd) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let client = TcpStream::connect(listener.local_addr().unwrap()).expect("connect");
    let (server, _) = listener.accept().expect("accept");
    (server.into(), client.into())
}

fn unix_pair() -> (OwnedFd, OwnedFd) {
    let (a, b) = UnixStream::pair().expect("socketpair");
    (a.into(), b.into())
}

/// (read end, write end), blocking, close-on-exec.
fn pipe_pair() -> (OwnedFd, OwnedFd) {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe")
}

/// Writes `data` to `fd` and closes it; an error stops it (the reader may be gone).
fn feed(fd: OwnedFd, data: Arc<Vec<u8>>, socket: bool) -> io::Result<usize> {
    let mut off = 0;
    while off < data.len() {
        let end = (off + 100_000).min(data.len());
        let r = if socket {
            rustix::net::send(&fd, &data[off..end], SendFlags::NOSIGNAL)
        } else {
            rustix::io::write(&fd, &data[off..end])
        };
        match r {
            Ok(n) => off += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(off)
}

/// Reads `fd` to its end: (bytes, hash).
fn drain(fd: OwnedFd) -> io::Result<(u64, u64)> {
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        match rustix::io::read(&fd, &mut buf[..]) {
            Ok(0) => return Ok(h.finish()),
            Ok(n) => h.update(&buf[..n]),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// A source end handed to the transfer, and what the test keeps of it.
struct Source {
    fd: Option<OwnedFd>,
    /// A dup of a file source (it shares the offset).
    file: Option<File>,
    feeder: Option<JoinHandle<io::Result<usize>>>,
}

fn make_source(kind: Kind, data: &Arc<Vec<u8>>, dir: &TempDir) -> Source {
    match kind {
        Kind::File => {
            let path = dir.path("source");
            std::fs::write(&path, &data[..]).expect("write source file");
            let f = File::open(&path).expect("open source");
            let dup = f.try_clone().expect("dup");
            Source {
                fd: Some(f.into()),
                file: Some(dup),
                feeder: None,
            }
        }
        Kind::Tcp | Kind::Unix | Kind::Pipe => {
            let (handed, peer) = match kind {
                Kind::Tcp => tcp_pair(),
                Kind::Unix => unix_pair(),
                _ => pipe_pair(),
            };
            let d = data.clone();
            let socket = kind != Kind::Pipe;
            Source {
                fd: Some(handed),
                file: None,
                feeder: Some(thread::spawn(move || feed(peer, d, socket))),
            }
        }
        Kind::Null => unreachable!("/dev/null is not used as a source"),
    }
}

/// A sink end handed to the transfer, and what the test keeps of it.
struct Sink {
    fd: Option<OwnedFd>,
    path: Option<PathBuf>,
    /// A dup of a file sink (it shares the offset).
    file: Option<File>,
    drainer: Option<JoinHandle<io::Result<(u64, u64)>>>,
}

fn make_sink(kind: Kind, dir: &TempDir) -> Sink {
    match kind {
        Kind::File => {
            let path = dir.path("sink");
            let f = File::create(&path).expect("create sink");
            let dup = f.try_clone().expect("dup");
            Sink {
                fd: Some(f.into()),
                path: Some(path),
                file: Some(dup),
                drainer: None,
            }
        }
        Kind::Null => {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")
                .expect("open /dev/null");
            Sink {
                fd: Some(f.into()),
                path: None,
                file: None,
                drainer: None,
            }
        }
        Kind::Tcp | Kind::Unix | Kind::Pipe => {
            let (handed, peer) = match kind {
                Kind::Tcp => tcp_pair(),
                Kind::Unix => unix_pair(),
                _ => {
                    let (r, w) = pipe_pair();
                    (w, r)
                }
            };
            Sink {
                fd: Some(handed),
                path: None,
                file: None,
                drainer: Some(thread::spawn(move || drain(peer))),
            }
        }
    }
}

impl Sink {
    /// What arrived: (bytes, hash); `None` for `/dev/null`. Call after the transfer is
    /// dropped (its end of a socket or pipe must be closed for the drainer to see EOF).
    fn arrived(&mut self) -> Option<(u64, u64)> {
        if let Some(d) = self.drainer.take() {
            return Some(d.join().expect("drainer panicked").expect("drain"));
        }
        self.path
            .as_ref()
            .map(|p| hash_of(&std::fs::read(p).expect("read sink file")))
    }
}

fn flags(fd: &OwnedFd) -> OFlags {
    rustix::fs::fcntl_getfl(fd).expect("F_GETFL")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LenMode {
    /// `Some(all of the data)`.
    Exact,
    /// `None`: until the source ends.
    ToEof,
    /// `Some(n)` shorter than the data.
    Shorter,
}

/// One transfer of `data` from a `src` end to a `dst` end; checks everything a client sees.
fn run_pair(src: Kind, dst: Kind, mode: LenMode, expect: Primitive, data: Arc<Vec<u8>>) {
    let dir = TempDir::new(&format!("{src:?}-{dst:?}-{mode:?}"));
    let n = match mode {
        LenMode::Exact | LenMode::ToEof => data.len(),
        LenMode::Shorter => SHORT_LEN.min(data.len() - 1),
    };
    let len = match mode {
        LenMode::ToEof => None,
        _ => Some(n as u64),
    };
    let mut source = make_source(src, &data, &dir);
    let mut sink = make_sink(dst, &dir);
    let (src_fd, dst_fd) = (source.fd.take().unwrap(), sink.fd.take().unwrap());
    let (src_flags, dst_flags) = (flags(&src_fd), flags(&dst_fd));
    let what = format!("{src:?} → {dst:?} ({mode:?}, {n} bytes)");

    let mut t =
        Transfer::new(src_fd, dst_fd, len, None).unwrap_or_else(|e| panic!("{what}: new: {e}"));
    assert_eq!(t.kinds(), (src.end_kind(), dst.end_kind()), "{what}: kinds");
    let stats = drive(&mut t).unwrap_or_else(|e| panic!("{what}: {e} after {} bytes", t.moved()));
    assert_eq!(
        t.primitive(),
        expect,
        "{what}: primitive (fallbacks: {:?})",
        t.fallback_log()
    );
    assert_eq!(t.fallbacks(), 0, "{what}: {:?}", t.fallback_log());
    assert_eq!(t.moved(), n as u64, "{what}: moved");
    assert_eq!(t.held(), 0, "{what}: bytes left held");
    assert_eq!(flags(t.src()), src_flags, "{what}: source flags changed");
    assert_eq!(flags(t.dst()), dst_flags, "{what}: sink flags changed");
    assert!(!flags(t.src()).contains(OFlags::NONBLOCK), "{what}");
    assert!(!flags(t.dst()).contains(OFlags::NONBLOCK), "{what}");
    if let Some(f) = &source.file {
        assert_eq!(
            rustix::fs::tell(f).unwrap(),
            n as u64,
            "{what}: source offset"
        );
    }
    if let Some(f) = &sink.file {
        assert_eq!(
            rustix::fs::tell(f).unwrap(),
            n as u64,
            "{what}: sink offset"
        );
    }
    drop(t);

    if let Some(feeder) = source.feeder.take() {
        let fed = feeder.join().expect("feeder panicked");
        if mode != LenMode::Shorter {
            assert_eq!(fed.expect("feed"), data.len(), "{what}: feeder");
        }
    }
    if let Some(got) = sink.arrived() {
        assert_eq!(
            got,
            hash_of(&data[..n]),
            "{what}: (bytes, hash) that arrived"
        );
    }
    eprintln!("{what}: {expect:?}, {stats:?}");
}

fn all_modes(src: Kind, dst: Kind, expect: Primitive) {
    within(TEST_LIMIT, move || {
        for mode in [LenMode::Exact, LenMode::ToEof, LenMode::Shorter] {
            run_pair(src, dst, mode, expect, data());
        }
    })
}

macro_rules! pairs {
    ($($name:ident: $src:ident -> $dst:ident = $prim:ident;)*) => {$(
        #[test]
        fn $name() {
            all_modes(Kind::$src, Kind::$dst, Primitive::$prim);
        }
    )*};
}

pairs! {
    file_to_file: File -> File = CopyFileRange;
    file_to_tcp: File -> Tcp = Sendfile;
    file_to_unix: File -> Unix = Sendfile;
    file_to_pipe: File -> Pipe = Splice;
    file_to_dev_null: File -> Null = Sendfile;
    tcp_to_file: Tcp -> File = SpliceViaPipe;
    tcp_to_tcp: Tcp -> Tcp = SpliceViaPipe;
    tcp_to_unix: Tcp -> Unix = SpliceViaPipe;
    tcp_to_pipe: Tcp -> Pipe = Splice;
    unix_to_file: Unix -> File = SpliceViaPipe;
    unix_to_tcp: Unix -> Tcp = SpliceViaPipe;
    unix_to_unix: Unix -> Unix = SpliceViaPipe;
    unix_to_pipe: Unix -> Pipe = Splice;
    unix_to_dev_null: Unix -> Null = Copy;
    pipe_to_file: Pipe -> File = Splice;
    pipe_to_tcp: Pipe -> Tcp = Splice;
    pipe_to_unix: Pipe -> Unix = Splice;
    pipe_to_pipe: Pipe -> Pipe = Splice;
}

// ---------------------------------------------------------------------------------------------
// Across file systems, and the fallback chain.

fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (a, b) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

#[test]
fn file_to_file_across_file_systems() {
    within(TEST_LIMIT, || {
        let mut candidates: Vec<PathBuf> = vec![
            "/dev/shm".into(),
            env!("CARGO_TARGET_TMPDIR").into(),
            std::env::temp_dir(),
            "/tmp".into(),
            "/var/tmp".into(),
        ];
        candidates.dedup();
        let mut dirs: Vec<TempDir> = Vec::new();
        for base in &candidates {
            let Ok(dir) = TempDir::new_in(base, "xfs") else {
                continue;
            };
            let dev = rustix::fs::stat(&dir.0).unwrap().st_dev;
            if dirs
                .iter()
                .all(|d| rustix::fs::stat(&d.0).unwrap().st_dev != dev)
            {
                dirs.push(dir);
            }
            if dirs.len() == 2 {
                break;
            }
        }
        // (No silent skip: a pass must mean it ran. /dev/shm is tmpfs wherever memloop runs,
        // so a second file system is all this needs.)
        assert!(
            dirs.len() == 2,
            "file_to_file_across_file_systems cannot run: no two distinct writable file \
             systems among {candidates:?}"
        );
        let (a, b) = (&dirs[0], &dirs[1]);
        let type_a = rustix::fs::statfs(&a.0).unwrap().f_type;
        let type_b = rustix::fs::statfs(&b.0).unwrap().f_type;
        let d = data();
        for len in [Some(d.len() as u64), None] {
            let src_path = a.path("source");
            let dst_path = b.path("sink");
            std::fs::write(&src_path, &d[..]).unwrap();
            let src = File::open(&src_path).unwrap();
            let src_dup = src.try_clone().unwrap();
            let dst = File::create(&dst_path).unwrap();
            let mut t = Transfer::new(src.into(), dst.into(), len, None).unwrap();
            assert_eq!(
                t.primitive(),
                Primitive::CopyFileRange,
                "chosen before the first step"
            );
            drive(&mut t).unwrap();
            assert_eq!(t.moved(), d.len() as u64);
            assert_eq!(rustix::fs::tell(&src_dup).unwrap(), d.len() as u64);
            assert_eq!(hash_of(&std::fs::read(&dst_path).unwrap()), hash_of(&d));
            eprintln!(
                "file → file from {} (fs type {type_a:#x}) to {} (fs type {type_b:#x}), \
                 len {len:?}: {:?}, fallbacks {:?}",
                a.0.display(),
                b.0.display(),
                t.primitive(),
                t.fallback_log()
            );
            match t.primitive() {
                Primitive::CopyFileRange => assert_eq!(t.fallbacks(), 0),
                Primitive::Sendfile => {
                    let log = t.fallback_log();
                    assert_eq!(log.len(), 1, "{log:?}");
                    assert_eq!(
                        (log[0].from, log[0].to),
                        (Primitive::CopyFileRange, Primitive::Sendfile)
                    );
                    assert!(
                        [Errno::XDEV, Errno::INVAL, Errno::OPNOTSUPP, Errno::NOSYS]
                            .iter()
                            .any(|e| e.raw_os_error() == log[0].errno),
                        "fell back on errno {}",
                        log[0].errno
                    );
                }
                other => panic!(
                    "file → file ended up with {other:?}: {:?}",
                    t.fallback_log()
                ),
            }
            // Since 5.19, copy_file_range between file systems of different types (without a
            // copy_file_range of their own, like tmpfs and ext4) is refused with EXDEV.
            if type_a != type_b && kernel_at_least(5, 19) {
                assert_eq!(
                    t.fallback_log().first().map(|f| f.errno),
                    Some(Errno::XDEV.raw_os_error()),
                    "expected EXDEV from copy_file_range between different file systems"
                );
            }
            std::fs::remove_file(&src_path).unwrap();
            std::fs::remove_file(&dst_path).unwrap();
        }
    })
}

/// A sink opened with `O_APPEND` is refused by `copy_file_range` (`EBADF`), `sendfile`
/// (`EINVAL`) and `splice` (`EINVAL`): the transfer goes down the whole chain to the copy loop,
/// and the bytes the pipe already held when `splice` refused them still arrive, in order.
#[test]
fn append_sink_falls_back_through_the_whole_chain() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("append");
        let d = data();
        let src_path = dir.path("source");
        let dst_path = dir.path("sink");
        std::fs::write(&src_path, &d[..]).unwrap();
        std::fs::write(&dst_path, b"header\n").unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = std::fs::OpenOptions::new()
            .append(true)
            .open(&dst_path)
            .unwrap();
        let mut t = Transfer::new(src.into(), dst.into(), None, None).unwrap();
        assert_eq!(t.primitive(), Primitive::CopyFileRange);
        drive(&mut t).unwrap();
        let chain: Vec<(Primitive, Primitive)> =
            t.fallback_log().iter().map(|f| (f.from, f.to)).collect();
        assert_eq!(
            chain,
            [
                (Primitive::CopyFileRange, Primitive::Sendfile),
                (Primitive::Sendfile, Primitive::SpliceViaPipe),
                (Primitive::SpliceViaPipe, Primitive::Copy),
            ],
            "{:?}",
            t.fallback_log()
        );
        assert_eq!(
            t.fallback_log()[0],
            Fallback {
                from: Primitive::CopyFileRange,
                to: Primitive::Sendfile,
                errno: Errno::BADF.raw_os_error()
            }
        );
        assert_eq!(t.primitive(), Primitive::Copy);
        assert_eq!(t.moved(), d.len() as u64);
        let mut expected = b"header\n".to_vec();
        expected.extend_from_slice(&d);
        assert_eq!(
            hash_of(&std::fs::read(&dst_path).unwrap()),
            hash_of(&expected)
        );
    })
}

// ---------------------------------------------------------------------------------------------
// Sizes, offsets, budgets.

#[test]
fn data_larger_than_any_pipe() {
    within(TEST_LIMIT, || {
        let (r, _w) = pipe_pair();
        let default_pipe = rustix::pipe::fcntl_getpipe_size(&r).unwrap();
        let max_pipe: usize = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20);
        let big = Arc::new(random_bytes(3 * max_pipe.max(1 << 20) + 12_345, 7));
        assert!(big.len() > default_pipe && big.len() > 2 * max_pipe);
        for (src, dst, prim) in [
            (Kind::File, Kind::Pipe, Primitive::Splice),
            (Kind::Pipe, Kind::File, Primitive::Splice),
            (Kind::Tcp, Kind::Tcp, Primitive::SpliceViaPipe),
            (Kind::Unix, Kind::File, Primitive::SpliceViaPipe),
        ] {
            run_pair(src, dst, LenMode::ToEof, prim, big.clone());
        }
    })
}

/// The transfer reads and writes at the files' own positions, as `sendfile(…, NULL, …)` does.
#[test]
fn files_are_read_and_written_at_their_own_offsets() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("offsets");
        let d = data();
        let src_path = dir.path("source");
        std::fs::write(&src_path, &d[..]).unwrap();
        for dst_kind in [Kind::File, Kind::Tcp] {
            let src = File::open(&src_path).unwrap();
            rustix::fs::seek(&src, rustix::fs::SeekFrom::Start(1000)).unwrap();
            let src_dup = src.try_clone().unwrap();
            let mut sink = make_sink(dst_kind, &dir);
            if let Some(f) = &mut sink.file {
                f.write_all(&[b'h'; 500]).unwrap();
            }
            let mut t = Transfer::new(src.into(), sink.fd.take().unwrap(), None, None).unwrap();
            drive(&mut t).unwrap();
            assert_eq!(t.moved(), (d.len() - 1000) as u64);
            assert_eq!(rustix::fs::tell(&src_dup).unwrap(), d.len() as u64);
            if let Some(f) = &sink.file {
                assert_eq!(rustix::fs::tell(f).unwrap(), 500 + t.moved());
            }
            drop(t);
            let mut expected = if dst_kind == Kind::File {
                vec![b'h'; 500]
            } else {
                Vec::new()
            };
            expected.extend_from_slice(&d[1000..]);
            assert_eq!(sink.arrived(), Some(hash_of(&expected)), "{dst_kind:?}");
        }
    })
}

/// With a source offset (`sendfile(…, &off, …)`), every primitive reads the file from that
/// offset and leaves its position alone: file → file (`copy_file_range`), → TCP and
/// → `/dev/null` (`sendfile`), → pipe (`splice`), and an `O_APPEND` file (the whole fallback
/// chain down to the copy loop, which `pread`s). The bytes are the file's from the offset on.
#[test]
fn a_source_offset_is_honoured_and_the_file_position_left_alone() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("src-off");
        let d = data();
        let src_path = dir.path("source");
        std::fs::write(&src_path, &d[..]).unwrap();
        const OFF: u64 = 123_457;
        const POS: u64 = 999;
        for (dst_kind, append, prim) in [
            (Kind::File, false, Primitive::CopyFileRange),
            (Kind::Tcp, false, Primitive::Sendfile),
            (Kind::Null, false, Primitive::Sendfile),
            (Kind::Pipe, false, Primitive::Splice),
            (Kind::File, true, Primitive::Copy),
        ] {
            for len in [None, Some(SHORT_LEN as u64)] {
                let what = format!("{dst_kind:?} (append {append}, len {len:?})");
                let src = File::open(&src_path).unwrap();
                rustix::fs::seek(&src, rustix::fs::SeekFrom::Start(POS)).unwrap();
                let src_dup = src.try_clone().unwrap();
                let mut sink = make_sink(dst_kind, &dir);
                let dst = match append {
                    false => sink.fd.take().unwrap(),
                    true => {
                        drop(sink.fd.take());
                        std::fs::OpenOptions::new()
                            .append(true)
                            .open(sink.path.as_ref().unwrap())
                            .unwrap()
                            .into()
                    }
                };
                let mut t = Transfer::new(src.into(), dst, len, Some(OFF))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                drive(&mut t).unwrap_or_else(|e| panic!("{what}: {e}"));
                let n = len.unwrap_or(d.len() as u64 - OFF);
                assert_eq!(t.moved(), n, "{what}: moved");
                assert_eq!(t.primitive(), prim, "{what}: {:?}", t.fallback_log());
                assert_eq!(
                    t.src_offset(),
                    Some(OFF + n),
                    "{what}: the transfer's offset"
                );
                assert_eq!(
                    rustix::fs::tell(&src_dup).unwrap(),
                    POS,
                    "{what}: the source's file position moved"
                );
                drop(t);
                let want = &d[OFF as usize..(OFF + n) as usize];
                if let Some(got) = sink.arrived() {
                    assert_eq!(got, hash_of(want), "{what}: the bytes that arrived");
                }
            }
        }
    })
}

/// An offset at the end of the file moves nothing (until the end: done; an exact length:
/// the source ended early); an offset on anything but a regular file is refused.
#[test]
fn an_offset_at_the_end_moves_nothing_and_one_on_a_non_file_is_refused() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("src-off-end");
        let d = data();
        let src_path = dir.path("source");
        std::fs::write(&src_path, &d[..]).unwrap();
        let open = || -> OwnedFd { File::open(&src_path).unwrap().into() };
        let null = || -> OwnedFd {
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")
                .unwrap()
                .into()
        };
        let mut t = Transfer::new(open(), null(), None, Some(d.len() as u64)).unwrap();
        assert_eq!(t.step(BUDGET).unwrap(), Step::Done);
        assert_eq!(t.moved(), 0);
        let mut t = Transfer::new(open(), null(), Some(10), Some(d.len() as u64 + 5)).unwrap();
        assert!(t.step(BUDGET).is_err(), "ended before the length");
        let (r, _w) = pipe_pair();
        expect_bad_fd(
            Transfer::new(r, null(), None, Some(0)),
            "source",
            "an offset on a pipe",
        );
        let (a, _b) = tcp_pair();
        match Transfer::new(a, null(), None, Some(0)) {
            Err(PipeError::BadFd {
                which: "source",
                why,
            }) => {
                assert!(why.contains("an offset on a non-file"), "{why}")
            }
            other => panic!("an offset on a socket: {:?}", other.err()),
        }
        match Transfer::new(open(), null(), None, Some(i64::MAX as u64 + 1)) {
            Err(e) => assert_eq!(e.errno(), Errno::INVAL.raw_os_error(), "{e}"),
            Ok(_) => panic!("an offset beyond i64::MAX accepted"),
        }
    })
}

#[test]
fn a_step_moves_no_more_than_its_budget() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("budget");
        let d = data();
        for (src_kind, dst_kind) in [(Kind::File, Kind::File), (Kind::Tcp, Kind::Unix)] {
            let mut source = make_source(src_kind, &d, &dir);
            let mut sink = make_sink(dst_kind, &dir);
            let mut t = Transfer::new(
                source.fd.take().unwrap(),
                sink.fd.take().unwrap(),
                Some(d.len() as u64),
                None,
            )
            .unwrap();
            assert_eq!(t.step(0).unwrap(), Step::Moved(0), "budget 0");
            assert_eq!(t.moved(), 0);
            let mut budget = 1;
            while t.moved() < d.len() as u64 {
                match t.step(budget).unwrap() {
                    Step::Moved(n) => assert!(n <= budget as u64, "{n} > {budget}"),
                    Step::WaitInput => {
                        wait_for(t.src().as_fd(), PollFlags::IN, Duration::from_secs(1))
                    }
                    Step::WaitOutput => {
                        wait_for(t.dst().as_fd(), PollFlags::OUT, Duration::from_secs(1))
                    }
                    Step::Done => panic!("done after {} bytes", t.moved()),
                }
                budget = (budget * 3 + 1) % 300_000 + 1;
            }
            assert_eq!(t.step(BUDGET).unwrap(), Step::Done);
            drop(t);
            source.feeder.take().map(|f| f.join().unwrap().unwrap());
            assert_eq!(sink.arrived(), Some(hash_of(&d)));
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Sources that end early.

fn ends_early(src: Kind, dst: Kind, expect: Primitive) {
    let dir = TempDir::new("early");
    let have = 100_003usize;
    let d = Arc::new(random_bytes(have, 3));
    let asked = 2 * have as u64;
    let mut source = make_source(src, &d, &dir);
    let mut sink = make_sink(dst, &dir);
    let mut t = Transfer::new(
        source.fd.take().unwrap(),
        sink.fd.take().unwrap(),
        Some(asked),
        None,
    )
    .unwrap();
    assert_eq!(t.primitive(), expect);
    let err = match drive(&mut t) {
        Ok(stats) => panic!("{src:?} → {dst:?}: no error for a short source ({stats:?})"),
        Err(e) => e,
    };
    match &err {
        PipeError::Io(e) => {
            assert_eq!(
                e.kind(),
                io::ErrorKind::UnexpectedEof,
                "{src:?} → {dst:?}: {e}"
            );
            assert_eq!(
                e.to_string(),
                format!("source ended after {have} of {asked} bytes")
            );
        }
        other => panic!("{src:?} → {dst:?}: {other:?}"),
    }
    assert_eq!(
        t.moved(),
        have as u64,
        "everything read must have been written"
    );
    assert_eq!(t.held(), 0);
    // The error stays.
    assert!(matches!(t.step(BUDGET), Err(PipeError::Io(_))));
    drop(t);
    if let Some(f) = source.feeder.take() {
        assert_eq!(f.join().unwrap().unwrap(), have);
    }
    if dst != Kind::Null {
        assert_eq!(sink.arrived(), Some(hash_of(&d)), "{src:?} → {dst:?}");
    }
}

#[test]
fn a_source_that_ends_before_the_length_is_an_error() {
    within(TEST_LIMIT, || {
        ends_early(Kind::File, Kind::File, Primitive::CopyFileRange);
        ends_early(Kind::File, Kind::Tcp, Primitive::Sendfile);
        ends_early(Kind::Pipe, Kind::Tcp, Primitive::Splice);
        ends_early(Kind::Tcp, Kind::Unix, Primitive::SpliceViaPipe);
        ends_early(Kind::Unix, Kind::Null, Primitive::Copy);
    })
}

// ---------------------------------------------------------------------------------------------
// Bad descriptors and lengths.

fn expect_bad_fd(r: Result<Transfer, PipeError>, which: &str, what: &str) {
    match r {
        Err(PipeError::BadFd { which: w, why }) => {
            assert_eq!(w, which, "{what}: {why}");
            eprintln!("{what}: {which} refused: {why}");
        }
        Err(e) => panic!("{what}: expected BadFd({which}), got {e:?}"),
        Ok(t) => panic!("{what}: accepted, primitive {:?}", t.primitive()),
    }
}

#[test]
fn bad_descriptors_are_refused() {
    let dir = TempDir::new("badfd");
    let file_path = dir.path("file");
    std::fs::write(&file_path, b"some bytes").unwrap();
    let readable = || -> OwnedFd { File::open(&file_path).unwrap().into() };
    let writable = || -> OwnedFd {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file_path)
            .unwrap()
            .into()
    };
    let directory = || -> OwnedFd { File::open(&dir.0).unwrap().into() };
    let listener = || -> OwnedFd { TcpListener::bind("127.0.0.1:0").unwrap().into() };

    expect_bad_fd(
        Transfer::new(directory(), writable(), None, None),
        "source",
        "directory source",
    );
    expect_bad_fd(
        Transfer::new(readable(), directory(), None, None),
        "sink",
        "directory sink",
    );
    expect_bad_fd(
        Transfer::new(writable(), writable(), None, None),
        "source",
        "write-only source",
    );
    expect_bad_fd(
        Transfer::new(readable(), readable(), None, None),
        "sink",
        "read-only sink",
    );
    expect_bad_fd(
        Transfer::new(listener(), writable(), None, None),
        "source",
        "listening source",
    );
    expect_bad_fd(
        Transfer::new(readable(), listener(), None, None),
        "sink",
        "listening sink",
    );
    let (r, w) = pipe_pair();
    expect_bad_fd(
        Transfer::new(w, writable(), None, None),
        "source",
        "pipe write end as source",
    );
    expect_bad_fd(
        Transfer::new(readable(), r, None, None),
        "sink",
        "pipe read end as sink",
    );
    let o_path = rustix::fs::open(
        &file_path,
        OFlags::PATH | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    expect_bad_fd(
        Transfer::new(o_path, writable(), None, None),
        "source",
        "O_PATH source",
    );
    let udp: OwnedFd = UdpSocket::bind("127.0.0.1:0").unwrap().into();
    expect_bad_fd(
        Transfer::new(udp, writable(), None, None),
        "source",
        "datagram socket",
    );
    // A Unix listening socket too.
    let upath = dir.path("listen.sock");
    let ulistener: OwnedFd = std::os::unix::net::UnixListener::bind(&upath)
        .unwrap()
        .into();
    expect_bad_fd(
        Transfer::new(readable(), ulistener, None, None),
        "sink",
        "unix listening sink",
    );

    // The good pair is accepted, so the refusals above are about the bad end.
    let t = Transfer::new(readable(), writable(), None, None).expect("a good pair");
    assert_eq!(t.kinds(), (EndKind::File, EndKind::File));
}

#[test]
fn zero_length_is_refused() {
    let (a, _b) = unix_pair();
    let (_c, d) = unix_pair();
    match Transfer::new(a, d, Some(0), None) {
        Err(PipeError::BadLength(0)) => {}
        Err(e) => panic!("expected BadLength(0), got {e:?}"),
        Ok(_) => panic!("Some(0) accepted"),
    }
}

// ---------------------------------------------------------------------------------------------
// Sinks whose reader is gone.

/// `SIGPIPE` must be ignored in the process that runs transfers: the kernel raises it for
/// `splice` and `sendfile` into a pipe or socket whose reader is gone, as for `write`. Rust's
/// runtime ignores it before `main`; this checks that it still is here (otherwise the tests
/// below would kill the test process instead of failing).
fn sigpipe_ignored() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("SigIgn:"))
        .expect("SigIgn in /proc/self/status");
    let mask = u64::from_str_radix(line["SigIgn:".len()..].trim(), 16).unwrap();
    mask & (1 << (13 - 1)) != 0
}

fn expect_broken(src: Kind, dst: Kind, expect: Primitive) {
    let dir = TempDir::new("broken");
    let d = data();
    let mut source = make_source(src, &d, &dir);
    let (handed, peer) = match dst {
        Kind::Tcp => tcp_pair(),
        Kind::Unix => unix_pair(),
        Kind::Pipe => {
            let (r, w) = pipe_pair();
            (w, r)
        }
        _ => unreachable!(),
    };
    drop(peer);
    let mut t = Transfer::new(source.fd.take().unwrap(), handed, None, None).unwrap();
    assert_eq!(t.primitive(), expect);
    let err = match drive(&mut t) {
        Ok(stats) => panic!("{src:?} → closed {dst:?}: no error ({stats:?})"),
        Err(e) => e,
    };
    let errno = match &err {
        PipeError::Io(e) => e.raw_os_error(),
        other => panic!("{src:?} → closed {dst:?}: {other:?}"),
    };
    let ok = [Errno::PIPE, Errno::CONNRESET].map(|e| Some(e.raw_os_error()));
    assert!(ok.contains(&errno), "{src:?} → closed {dst:?}: {err}");
    assert_eq!(
        t.fallbacks(),
        0,
        "a broken sink is not a reason to fall back"
    );
    eprintln!(
        "{src:?} → closed {dst:?}: {err} after {} bytes ({:?})",
        t.moved(),
        t.primitive()
    );
    drop(t);
    if let Some(f) = source.feeder.take() {
        let _ = f.join().unwrap();
    }
}

#[test]
fn a_sink_whose_reader_is_gone_is_an_error_not_a_hang() {
    assert!(
        sigpipe_ignored(),
        "SIGPIPE is not ignored in the test process: splice/sendfile into a closed pipe or \
         socket would kill it"
    );
    within(TEST_LIMIT, || {
        expect_broken(Kind::File, Kind::Pipe, Primitive::Splice);
        expect_broken(Kind::File, Kind::Unix, Primitive::Sendfile);
        expect_broken(Kind::File, Kind::Tcp, Primitive::Sendfile);
        expect_broken(Kind::Pipe, Kind::Tcp, Primitive::Splice);
        expect_broken(Kind::Tcp, Kind::Unix, Primitive::SpliceViaPipe);
        expect_broken(Kind::Unix, Kind::Tcp, Primitive::SpliceViaPipe);
        expect_broken(Kind::Tcp, Kind::Pipe, Primitive::Splice);
    })
}

// ---------------------------------------------------------------------------------------------
// Nothing to read, no room to write: the step says so instead of blocking.

#[test]
fn an_empty_source_reports_wait_input() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("waitin");
        let d = data();
        for (src_kind, dst_kind) in [
            (Kind::Pipe, Kind::File),
            (Kind::Tcp, Kind::File),
            (Kind::Unix, Kind::Tcp),
        ] {
            let (handed, peer) = match src_kind {
                Kind::Tcp => tcp_pair(),
                Kind::Unix => unix_pair(),
                _ => pipe_pair(),
            };
            let mut sink = make_sink(dst_kind, &dir);
            let mut t = Transfer::new(handed, sink.fd.take().unwrap(), None, None).unwrap();
            let start = Instant::now();
            for _ in 0..3 {
                assert_eq!(t.step(BUDGET).unwrap(), Step::WaitInput, "{src_kind:?}");
            }
            assert!(start.elapsed() < Duration::from_secs(2), "the step waited");
            let dd = d.clone();
            let socket = src_kind != Kind::Pipe;
            let feeder = thread::spawn(move || feed(peer, dd, socket));
            drive(&mut t).unwrap();
            assert_eq!(t.moved(), d.len() as u64);
            drop(t);
            assert_eq!(feeder.join().unwrap().unwrap(), d.len());
            assert_eq!(
                sink.arrived(),
                Some(hash_of(&d)),
                "{src_kind:?} → {dst_kind:?}"
            );
        }
    })
}

/// A pipe sink that is full: the step reports `WaitOutput`.
#[test]
fn a_full_pipe_sink_reports_wait_output() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("waitout-pipe");
        let d = data();
        let src_path = dir.path("source");
        std::fs::write(&src_path, &d[..]).unwrap();
        let (r, w) = pipe_pair();
        let size = rustix::pipe::fcntl_getpipe_size(&w).unwrap();
        // Exactly the pipe's size fits without blocking, in whole pages.
        let prefill = random_bytes(size, 9);
        let mut off = 0;
        while off < size {
            off += rustix::io::write(&w, &prefill[off..]).unwrap();
        }
        let mut t = Transfer::new(
            File::open(&src_path).unwrap().into(),
            w,
            Some(d.len() as u64),
            None,
        )
        .unwrap();
        let start = Instant::now();
        assert_eq!(t.step(BUDGET).unwrap(), Step::WaitOutput);
        assert!(start.elapsed() < Duration::from_secs(2), "the step waited");
        let drainer = thread::spawn(move || drain(r));
        drive(&mut t).unwrap();
        drop(t);
        let mut expected = prefill;
        expected.extend_from_slice(&d);
        assert_eq!(drainer.join().unwrap().unwrap(), hash_of(&expected));
    })
}

/// A socket sink whose reader does not read: `sendfile`/`splice` into a blocking socket cannot
/// be told not to wait, so the transfer must keep each write within what the socket takes;
/// the steps must end in `WaitOutput`, never block.
#[test]
fn a_socket_sink_nobody_reads_reports_wait_output() {
    within(TEST_LIMIT, || {
        let dir = TempDir::new("waitout-sock");
        // More than loopback TCP's send buffer can grow to, plus a small receive buffer.
        let wmem_max: usize = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
            .ok()
            .and_then(|s| s.split_whitespace().nth(2)?.parse().ok())
            .unwrap_or(4 << 20);
        let big = Arc::new(random_bytes(2 * wmem_max + (5 << 20), 11));
        for (src_kind, dst_kind, prim) in [
            (Kind::File, Kind::Tcp, Primitive::Sendfile),
            (Kind::File, Kind::Unix, Primitive::Sendfile),
            (Kind::Pipe, Kind::Tcp, Primitive::Splice),
            (Kind::Tcp, Kind::Unix, Primitive::SpliceViaPipe),
        ] {
            let mut source = make_source(src_kind, &big, &dir);
            let (handed, peer) = if dst_kind == Kind::Tcp {
                tcp_pair()
            } else {
                unix_pair()
            };
            rustix::net::sockopt::set_socket_recv_buffer_size(&peer, 64 * 1024).unwrap();
            let mut t = Transfer::new(
                source.fd.take().unwrap(),
                handed,
                Some(big.len() as u64),
                None,
            )
            .unwrap();
            assert_eq!(t.primitive(), prim);
            // A budget far above what any socket buffer holds: the cap must come from the
            // socket, not from the budget.
            let mut steps = 0;
            let full = loop {
                steps += 1;
                match t.step(64 << 20).unwrap() {
                    Step::Moved(_) => {}
                    Step::WaitInput => {
                        wait_for(t.src().as_fd(), PollFlags::IN, Duration::from_millis(100))
                    }
                    Step::WaitOutput => break true,
                    Step::Done => break false,
                }
            };
            assert!(
                full,
                "{src_kind:?} → {dst_kind:?}: all {} bytes went into a socket nobody reads",
                t.moved()
            );
            eprintln!(
                "{src_kind:?} → {dst_kind:?}: WaitOutput after {steps} steps, {} bytes in flight",
                t.moved()
            );
            let drainer = thread::spawn(move || drain(peer));
            drive(&mut t).unwrap();
            assert_eq!(t.moved(), big.len() as u64);
            drop(t);
            if let Some(f) = source.feeder.take() {
                assert_eq!(f.join().unwrap().unwrap(), big.len());
            }
            assert_eq!(drainer.join().unwrap().unwrap(), hash_of(&big));
        }
    })
}
