//! `multi_waiters`: four threads in `epoll_wait` (maxevents 1) on one set of connections.
//!
//! Level-triggered: every arrival is seen by at least one waiter (the kernel may report it to
//! several until someone reads it), no byte is lost or duplicated, and once everything is
//! read nothing more is reported. Edge-triggered: each arrival is reported exactly once (the
//! kernel hands an ET item to one waiter and does not requeue it), none lost, none phantom.

use super::Set;
use crate::book::{Log, Seen};
use crate::ensure;
use crate::sys::{self, Errno, ET, IN};
use crate::util::{self, stream_bytes, stream_mismatch, Net, Opts, Res, Rng};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CONNS: usize = 6;
const WAITERS: usize = 4;
const LIMIT: Duration = Duration::from_secs(3);

/// One connection as the waiters see it: its client end and how far it was read.
pub struct Stream {
    pub fd: RawFd,
    pub key: u64,
    /// Bytes read and verified (the lock also serialises readers).
    pub read: Mutex<u64>,
    pub sent: AtomicU64,
}

impl Stream {
    /// Reads up to `max` bytes (all there is, if `to_eagain`), checking them.
    pub fn consume(&self, max: usize, to_eagain: bool) -> Result<usize, String> {
        let mut off = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let mut buf = vec![0u8; max];
        let mut total = 0;
        loop {
            match sys::recv(self.fd, &mut buf, libc::MSG_DONTWAIT) {
                Ok(0) => return Err(format!("fd {}: unexpected EOF", self.fd)),
                Ok(n) => {
                    if let Some(at) = stream_mismatch(self.key, *off, &buf[..n]) {
                        return Err(format!("fd {}: wrong byte at offset {at}", self.fd));
                    }
                    *off += n as u64;
                    total += n;
                    if !to_eagain {
                        return Ok(total);
                    }
                }
                Err(Errno(libc::EAGAIN)) => return Ok(total),
                Err(Errno(libc::EINTR)) => continue,
                Err(e) => return Err(format!("fd {}: recv: {e}", self.fd)),
            }
        }
    }

    pub fn done(&self) -> bool {
        *self.read.lock().unwrap_or_else(|e| e.into_inner()) == self.sent.load(SeqCst)
    }

    /// The peer sends `len` more bytes of the stream.
    pub fn feed(&self, server: RawFd, len: usize) -> Res<()> {
        let off = self.sent.load(SeqCst);
        sys::send_all(server, &stream_bytes(self.key, off, len))
            .map_err(|e| format!("send: {e}"))?;
        self.sent.fetch_add(len as u64, SeqCst);
        Ok(())
    }
}

struct Shared {
    streams: Vec<Stream>,
    by_word: HashMap<u64, usize>,
    edge: AtomicBool,
    empty_reads: AtomicU64,
}

pub fn run(o: &Opts) -> Res<()> {
    let mut rng = Rng::new(o.seed);
    let net = Net::new()?;
    let pairs = net.pairs(CONNS)?;
    let lt: Vec<u64> = (0..CONNS).map(|_| rng.next()).collect();
    let et: Vec<u64> = (0..CONNS).map(|_| rng.next()).collect();
    let shared = Arc::new(Shared {
        streams: pairs
            .iter()
            .enumerate()
            .map(|(i, (c, _))| Stream {
                fd: c.as_raw_fd(),
                key: o.seed * 100 + i as u64,
                read: Mutex::new(0),
                sent: AtomicU64::new(0),
            })
            .collect(),
        by_word: lt
            .iter()
            .chain(&et)
            .enumerate()
            .map(|(i, w)| (*w, i % CONNS))
            .collect(),
        edge: AtomicBool::new(false),
        empty_reads: AtomicU64::new(0),
    });
    let mut set = Set::new()?;
    for (i, w) in lt.iter().enumerate() {
        set.add(shared.streams[i].fd, IN, *w, &format!("conn {i} LT"))?;
    }
    for _ in 0..WAITERS {
        set.waiter(1, -1, reaction(&shared, &set.log));
    }
    let servers: Vec<&OwnedFd> = pairs.iter().map(|(_, s)| s).collect();
    level_rounds(&set, &shared, &servers, &lt, &mut rng)?;
    shared.edge.store(true, SeqCst);
    for (i, (old, new)) in lt.iter().zip(&et).enumerate() {
        set.modify(
            shared.streams[i].fd,
            *old,
            IN | ET,
            *new,
            &format!("conn {i} ET"),
        )?;
    }
    edge_rounds(&set, &shared, &servers, &et, &mut rng)?;
    set.finish()?;
    util::info(&format!(
        "{} events, {} reads found nothing (another waiter had read it: allowed with LT)",
        set.log.snapshot().len(),
        shared.empty_reads.load(SeqCst)
    ));
    Ok(())
}

fn reaction(shared: &Arc<Shared>, log: &Arc<Log>) -> Arc<dyn Fn(&Seen) + Send + Sync> {
    let (sh, log) = (shared.clone(), log.clone());
    Arc::new(move |s: &Seen| {
        let Some(&i) = sh.by_word.get(&s.data) else {
            return;
        };
        let edge = sh.edge.load(SeqCst);
        // LT: read a little (the rest must be reported again); ET: read to EAGAIN.
        match sh.streams[i].consume(if edge { 65536 } else { 64 }, edge) {
            Ok(0) => {
                sh.empty_reads.fetch_add(1, SeqCst);
            }
            Ok(_) => {}
            Err(e) => log.fail(format!("conn {i}: {e}")),
        }
    })
}

fn level_rounds(
    set: &Set,
    sh: &Shared,
    servers: &[&OwnedFd],
    words: &[u64],
    rng: &mut Rng,
) -> Res<()> {
    for round in 0..150 {
        let picked: Vec<usize> = (0..CONNS).filter(|_| rng.chance(0.5)).collect();
        for &i in &picked {
            sh.streams[i].feed(servers[i].as_raw_fd(), rng.range(1, 600) as usize)?;
        }
        all_read(set, sh, words, &format!("level-triggered round {round}"))?;
    }
    std::thread::sleep(Duration::from_millis(30));
    for (i, w) in words.iter().enumerate() {
        let n = set.count(*w);
        set.quiet(
            *w,
            n,
            Duration::from_millis(30),
            &format!("conn {i} LT, read empty"),
        )?;
    }
    Ok(())
}

fn all_read(set: &Set, sh: &Shared, words: &[u64], what: &str) -> Res<()> {
    let r = util::wait_until(LIMIT, "", || {
        set.log.failure()?;
        Ok(sh.streams.iter().all(|s| s.done()).then_some(()))
    });
    if r.is_err() {
        set.log.failure()?;
        let (i, s) = sh
            .streams
            .iter()
            .enumerate()
            .find(|(_, s)| !s.done())
            .expect("one");
        return Err(format!(
            "{what}: lost wake-up: conn {i} read {} of {} bytes after {LIMIT:?} ({} unread per \
             FIONREAD); its events: [{}]",
            *s.read.lock().unwrap_or_else(|e| e.into_inner()),
            s.sent.load(SeqCst),
            sys::fionread(s.fd).unwrap_or(usize::MAX),
            set.describe(words[i])
        ));
    }
    Ok(())
}

fn edge_rounds(
    set: &Set,
    sh: &Shared,
    servers: &[&OwnedFd],
    words: &[u64],
    rng: &mut Rng,
) -> Res<()> {
    let mut expected = vec![0usize; CONNS];
    for round in 0..150 {
        exact_counts(set, words, &expected, round)?;
        for i in 0..CONNS {
            if rng.chance(0.5) {
                sh.streams[i].feed(servers[i].as_raw_fd(), rng.range(1, 600) as usize)?;
                expected[i] += 1;
            }
        }
        all_read(set, sh, words, &format!("edge-triggered round {round}"))?;
        for (i, w) in words.iter().enumerate() {
            set.log.wait_for(
                LIMIT,
                &format!("ET conn {i}: arrival {} not reported", expected[i]),
                |v| v.iter().filter(|s| s.data == *w).count() >= expected[i],
            )?;
        }
    }
    std::thread::sleep(Duration::from_millis(30));
    exact_counts(set, words, &expected, 150)
}

fn exact_counts(set: &Set, words: &[u64], expected: &[usize], round: usize) -> Res<()> {
    set.log.failure()?;
    for (i, w) in words.iter().enumerate() {
        let n = set.count(*w);
        ensure!(
            n == expected[i],
            "edge-triggered, before round {round}: conn {i} reported {n} times for {} arrivals \
             (each arrival must be reported exactly once): [{}]",
            expected[i],
            set.describe(*w)
        );
    }
    Ok(())
}
