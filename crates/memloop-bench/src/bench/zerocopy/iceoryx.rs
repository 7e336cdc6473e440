//! The iceoryx2 path of `bench zerocopy` (feature `iceoryx2`): publish-subscribe of byte
//! slices in loaned samples, in the same arrangement as memloop's zero-copy path.
//!
//! - Latency: the driver publishes on `<svc>/ping`, an echo peer process subscribes there and
//!   publishes the reply on `<svc>/pong`. iceoryx2 cannot send a received sample on, so the
//!   echo loans a sample of the same size for each reply: untouched, it writes only the
//!   sequence word (no copy, like memloop's forward); touched, it reads every byte received
//!   and writes every byte of the reply.
//! - Pipeline: source (the driver) → middle → sink, 1 MiB messages. The middle loans a sample
//!   of header + payload and copies the payload behind its header (1 MiB copied per message);
//!   the sink reads the header and the payload's sequence word in place.
//!
//! iceoryx2 has no blocking receive short of its event service (a notification, and a system
//! call, per message), so receivers poll: spin for 50 µs as memloop does before it sleeps,
//! then yield the CPU between polls. The last message of each run is an end marker.
//!
//! A publisher that finds the subscriber's queue full drops the message, even when told to
//! retry until delivered, while the subscriber has not opened its end of the connection (it
//! does so when created, or on its next receive once the publisher exists). So each publisher
//! is created before its subscriber, and a peer that says it is ready is connected; a send
//! that reached no subscriber fails the run.
//!
//! Files: each run has its own iceoryx2 configuration, whose prefix (the shared-memory objects
//! in /dev/shm) and root directory (under the temporary directory, instead of /tmp/iceoryx2)
//! carry a tag with the driver's pid; services are named after the run's peers. The run
//! removes them at its end, and those of earlier runs whose driver is gone at its start. No
//! root, no setup: /dev/shm must only be writable, as for memloop.
// Loaned samples come uninitialised; see `loan`.
#![allow(unsafe_code)]

use super::{
    latency_record, peer_args, read_all, say, seq_of, stamp, time_trips, unique, Cfg, Counter,
    Record, ZcPeer, ZcPeerArgs, HEADER, IOX, PIPE_MSG,
};
use crate::error::{fail, CliResult, Context};
use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::port::LoanError;
use iceoryx2::prelude::*;
use iceoryx2::sample::Sample;
use iceoryx2::sample_mut::SampleMut;
use iceoryx2::service::port_factory::publish_subscribe::PortFactory;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

type Svc = PortFactory<ipc::Service, [u8], ()>;
type Pub = Publisher<ipc::Service, [u8], ()>;
type Sub = Subscriber<ipc::Service, [u8], ()>;

/// Sequence word of the last message: the receiver stops there.
const END: u64 = u64::MAX;
/// Spin this long for a message before yielding the CPU between polls.
const SPIN: Duration = Duration::from_micros(50);
/// A receiver waiting this long for a message gives up (a peer died or hung).
const SILENCE: Duration = Duration::from_secs(20);
/// The tag of a run's files: this prefix, then the driver's pid.
const TAG: &str = "memloop-bench-iox-";

// ---------------------------------------------------------------------------------------------
// Setup and cleanup.

/// The driver's side of one benchmark run: its iceoryx2 node, and its files, removed when
/// dropped.
pub struct Run {
    node: Node<ipc::Service>,
    tag: String,
    _files: Files,
}

/// Removes a run's files when dropped (after the node that made them: fields drop in order).
struct Files(String);

impl Drop for Files {
    fn drop(&mut self) {
        remove_files(&self.0);
    }
}

fn root_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(tag)
}

/// A run's iceoryx2 files: the shared-memory objects (named with the prefix) and the directory.
fn remove_files(tag: &str) {
    let _ = std::fs::remove_dir_all(root_dir(tag));
    let prefix = format!("{tag}_");
    for e in std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.file_name().as_bytes().starts_with(prefix.as_bytes()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Files of earlier runs whose driver is gone (killed before it could clean up).
fn remove_stale() {
    let mut tags = Vec::new();
    for dir in [
        std::path::Path::new("/dev/shm").to_path_buf(),
        std::env::temp_dir(),
    ] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(TAG).and_then(|r| {
                let digits = r.split(|c: char| !c.is_ascii_digit()).next()?;
                digits.parse::<u32>().ok()
            });
            if let Some(pid) = pid {
                if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    tags.push(format!("{TAG}{pid}"));
                }
            }
        }
    }
    tags.sort();
    tags.dedup();
    for t in tags {
        remove_files(&t);
    }
}

/// A node whose files carry the run's tag, with iceoryx2's defaults otherwise (no config file
/// is read), and without its signal handlers.
fn node(tag: &str) -> CliResult<Node<ipc::Service>> {
    let mut config = Config::default();
    config.global.prefix =
        FileName::new(format!("{tag}_").as_bytes()).context("iceoryx2 file prefix")?;
    let root = root_dir(tag);
    config
        .global
        .set_root_path(&Path::new(root.as_os_str().as_bytes()).context("iceoryx2 root path")?);
    NodeBuilder::new()
        .config(&config)
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<ipc::Service>()
        .context("creating an iceoryx2 node")
}

/// A one-to-one service of byte slices; nothing dropped (no overflow, publishers retry until
/// delivered); `queue` samples in flight to the subscriber.
fn service(node: &Node<ipc::Service>, name: &str, queue: usize) -> CliResult<Svc> {
    let name = ServiceName::new(name).context("iceoryx2 service name")?;
    node.service_builder(&name)
        .publish_subscribe::<[u8]>()
        .max_publishers(1)
        .max_subscribers(1)
        .max_nodes(2)
        .history_size(0)
        .subscriber_max_buffer_size(queue)
        .subscriber_max_borrowed_samples(2)
        .enable_safe_overflow(false)
        .open_or_create()
        .context(format!("iceoryx2 service {name}"))
}

fn publisher(svc: &Svc, max_len: usize) -> CliResult<Pub> {
    svc.publisher_builder()
        .initial_max_slice_len(max_len)
        .max_loaned_samples(2)
        .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
        .create()
        .context("creating an iceoryx2 publisher")
}

fn subscriber(svc: &Svc, queue: usize) -> CliResult<Sub> {
    svc.subscriber_builder()
        .buffer_size(queue)
        .create()
        .context("creating an iceoryx2 subscriber")
}

// ---------------------------------------------------------------------------------------------
// Sending and receiving.

/// Waits for `try_once` to give something: spins for [`SPIN`], then yields between tries;
/// fails after [`SILENCE`].
fn poll<T>(what: &str, mut try_once: impl FnMut() -> CliResult<Option<T>>) -> CliResult<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = try_once()? {
            return Ok(v);
        }
        let waited = start.elapsed();
        if waited < SPIN {
            std::hint::spin_loop();
        } else if waited < SILENCE {
            std::thread::yield_now();
        } else {
            return Err(fail(format!(
                "iceoryx2: nothing from {what} for {SILENCE:?}"
            )));
        }
    }
}

fn recv(sub: &Sub, what: &str) -> CliResult<Sample<ipc::Service, [u8], ()>> {
    poll(what, || sub.receive().context("iceoryx2 receive"))
}

/// A sample of `len` bytes, none of them written: what is in the buffer stays (as with
/// memloop's loans), so that an untouched message costs no pass over its bytes.
fn loan(p: &Pub, len: usize) -> CliResult<SampleMut<ipc::Service, [u8], ()>> {
    let s = poll("the subscriber (samples not returned)", || {
        match p.loan_slice_uninit(len) {
            Ok(s) => Ok(Some(s)),
            Err(LoanError::OutOfMemory | LoanError::ExceedsMaxLoans) => Ok(None),
            Err(e) => Err(fail(format!("iceoryx2 loan of {len} bytes: {e}"))),
        }
    })?;
    // SAFETY: `u8` has no invalid values, and the bytes are initialised memory: the sample is
    // in an iceoryx2 shared-memory segment (shm_open + ftruncate + mmap, so zero-filled by the
    // kernel), and the publishers of this benchmark only ever write whole `u8`s into it.
    Ok(unsafe { s.assume_init() })
}

/// Sends to the one subscriber, which must have taken it: iceoryx2 drops a message rather
/// than wait for a subscriber whose end of the connection is not open yet (hence the order in
/// which the ends are created, publishers first).
fn send(s: SampleMut<ipc::Service, [u8], ()>) -> CliResult<()> {
    match s.send().context("iceoryx2 send")? {
        0 => Err(fail("iceoryx2 dropped a message: no subscriber connected")),
        _ => Ok(()),
    }
}

/// The end marker: a message whose sequence word is [`END`].
fn send_end(p: &Pub, len: usize) -> CliResult<()> {
    let mut s = loan(p, len)?;
    stamp(s.payload_mut(), END, false);
    send(s)
}

// ---------------------------------------------------------------------------------------------
// Peers.

pub fn run_peer(a: &ZcPeerArgs) -> CliResult<()> {
    let node = node(&a.region)?;
    match a.role.as_str() {
        "echo" => echo(&node, a),
        "middle" => middle(&node, a),
        "sink" => sink(&node, a),
        r => Err(fail(format!("unknown iceoryx2 peer role {r}"))),
    }
}

/// Replies to each message with one of the same size and sequence word, in a sample of its own
/// (touched: every byte read, every byte written).
fn echo(node: &Node<ipc::Service>, a: &ZcPeerArgs) -> CliResult<()> {
    let pong = service(node, &format!("{}/pong", a.svc), 1)?;
    let out = publisher(&pong, a.size)?;
    let ping = service(node, &format!("{}/ping", a.svc), 1)?;
    let sub = subscriber(&ping, 1)?;
    super::ready();
    let mut sink = 0u64;
    loop {
        let m = recv(&sub, "the driver")?;
        let seq = seq_of(m.payload());
        if seq == END {
            break;
        }
        if a.touch {
            sink = sink.wrapping_add(read_all(m.payload()));
        }
        let mut b = loan(&out, a.size)?;
        stamp(b.payload_mut(), seq, a.touch);
        drop(m);
        send(b)?;
    }
    std::hint::black_box(sink);
    Ok(())
}

/// Copies each message behind a header of its own into a new sample, looking only at the
/// headers; says how many payload bytes it copied, then waits for the driver to close its
/// stdin (so that its publisher outlives the sink's last read).
fn middle(node: &Node<ipc::Service>, a: &ZcPeerArgs) -> CliResult<()> {
    let svc_out = service(node, a.out.as_deref().unwrap_or_default(), 8)?;
    let out = publisher(&svc_out, HEADER + a.size)?;
    let svc_in = service(node, &a.svc, 8)?;
    let sub = subscriber(&svc_in, 8)?;
    super::ready();
    let mut copied = 0u64;
    loop {
        let m = recv(&sub, "the source")?;
        let p = m.payload();
        let seq = seq_of(p);
        if seq == END {
            send_end(&out, HEADER + 8)?;
            break;
        }
        let mut b = loan(&out, HEADER + p.len())?;
        let dst = b.payload_mut();
        stamp(&mut dst[..HEADER], seq, false);
        dst[HEADER..].copy_from_slice(p);
        copied += p.len() as u64;
        drop(m);
        send(b)?;
    }
    say(&format!("{copied} payload bytes copied"));
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    Ok(())
}

/// Counts whole messages (checking their order by the headers) until the end marker; says the
/// count and the seconds from the first to the last.
fn sink(node: &Node<ipc::Service>, a: &ZcPeerArgs) -> CliResult<()> {
    let svc = service(node, &a.svc, 8)?;
    let sub = subscriber(&svc, 8)?;
    super::ready();
    let mut c = Counter::default();
    loop {
        let m = recv(&sub, "the middle stage")?;
        let (h, p) = m.payload().split_at(HEADER.min(m.payload().len()));
        if seq_of(h) == END {
            break;
        }
        c.see(seq_of(h), seq_of(p), p.len() == a.size)?;
    }
    say(&c.report());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Driver.

impl Run {
    pub fn new() -> CliResult<Run> {
        remove_stale();
        let tag = format!("{TAG}{}", std::process::id());
        let files = Files(tag.clone());
        Ok(Run {
            node: node(&tag)?,
            tag,
            _files: files,
        })
    }

    fn spawn(&self, role: &str, svc: &str, size: usize, extra: &[String]) -> CliResult<ZcPeer> {
        let mut args = peer_args(role, "iox", &self.tag, svc, size);
        args.extend_from_slice(extra);
        ZcPeer::spawn(&args)
    }

    /// Round trips through an echo peer, as [`super::latency_zc`].
    pub fn latency(&self, size: usize, touch: bool, cfg: &Cfg) -> CliResult<Record> {
        let svc = unique("iox-echo");
        let ping = service(&self.node, &format!("{svc}/ping"), 1)?;
        let out = publisher(&ping, size)?;
        let mut extra = Vec::new();
        if touch {
            extra.push("--touch".to_string());
        }
        if let Some((_, peer)) = cfg.cpus {
            extra.extend(["--cpu".into(), peer.to_string()]);
        }
        let peer = self.spawn("echo", &svc, size, &extra)?;
        let pong = service(&self.node, &format!("{svc}/pong"), 1)?;
        let sub = subscriber(&pong, 1)?;
        let mut sink = 0u64;
        let rtts = time_trips(cfg, |seq| {
            let mut b = loan(&out, size)?;
            stamp(b.payload_mut(), seq, touch);
            send(b)?;
            let m = recv(&sub, "the echo peer")?;
            if touch {
                sink = sink.wrapping_add(read_all(m.payload()));
            }
            match seq_of(m.payload()) == seq {
                true => Ok(()),
                false => Err(fail("iceoryx2 echo out of order")),
            }
        })?;
        std::hint::black_box(sink);
        send_end(&out, size)?;
        peer.finish()?;
        Ok(latency_record(touch, IOX, size, rtts))
    }

    /// source (here) → middle (copying) → sink, as [`super::pipeline`].
    pub fn pipeline(&self, cfg: &Cfg) -> CliResult<Vec<Record>> {
        let (sink_svc, mid_svc) = (unique("iox-sink"), unique("iox-mid"));
        let svc = service(&self.node, &mid_svc, 8)?;
        let out = publisher(&svc, PIPE_MSG)?;
        let margs = ["--out".to_string(), sink_svc.clone()];
        let mid = self.spawn("middle", &mid_svc, PIPE_MSG, &margs)?;
        let sink = self.spawn("sink", &sink_svc, PIPE_MSG, &[])?;
        let start = Instant::now();
        let mut seq = 0u64;
        while start.elapsed() < cfg.dur {
            let mut b = loan(&out, PIPE_MSG)?;
            stamp(b.payload_mut(), seq, false);
            send(b)?;
            seq += 1;
        }
        send_end(&out, PIPE_MSG)?;
        super::pipeline_records(mid, sink, IOX, seq, 0)
    }
}
