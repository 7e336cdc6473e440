//! A bidirectional byte stream over two SPSC rings.
//!
//! Connecting offers a channel to the service's endpoint and returns at once, like a TCP
//! connection waiting in a listen backlog: the client may write before the server accepts.
//! Blocking calls wait on the ring (spin, then sleep) in slices of [`LIVENESS_SLICE`], checking
//! between slices whether the peer is still alive, so a dead peer is noticed within a second.

use crate::channel::{self, PeerWatch, StreamEnds};
use crate::error::Error;
use crate::node::{Node, NodeInner};
use memloop_registry::{ChannelId, MemberId, Side, DEFAULT_RING_CAPACITY};
use memloop_ring::{RingError, StreamConsumer, StreamProducer, WaitPolicy, WakeMode};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a wait may begin with a look at a cross-kernel peer's heartbeat.
const PEER_LOOK: Duration = Duration::from_millis(100);

/// Longest wait between two liveness checks of the peer.
pub const LIVENESS_SLICE: Duration = Duration::from_millis(200);
/// The same towards a peer in another kernel, whose death only its silent heartbeat shows:
/// shorter, so the heartbeat timeout (1.5 s) plus our reaction stays well under 2 s.
pub const LIVENESS_SLICE_VM: Duration = Duration::from_millis(100);

pub struct Stream {
    node: Arc<NodeInner>,
    ch: ChannelId,
    side: Side,
    peer: MemberId,
    watch: PeerWatch,
    tx: StreamProducer,
    rx: StreamConsumer,
    policy: WaitPolicy,
    nonblocking: bool,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    write_shut: bool,
    /// When we last looked at a cross-kernel peer's heartbeat on entering a wait.
    peer_looked: Instant,
}

#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

impl Stream {
    /// Connects to the native service `service` with the default ring size.
    pub fn connect(node: &Node, service: &str) -> Result<Stream, Error> {
        Self::connect_with(node, service, DEFAULT_RING_CAPACITY)
    }

    /// Connects with rings of `capacity` bytes per direction (a power of two).
    pub fn connect_with(node: &Node, service: &str, capacity: u64) -> Result<Stream, Error> {
        let kind = memloop_registry::ChannelKind::StreamPair;
        let (ch, peer) = channel::offer_to_service(&node.inner, service, kind, capacity)?;
        Self::attach(node.inner.clone(), ch, Side::Client, peer)
    }

    pub(crate) fn attach(
        node: Arc<NodeInner>,
        ch: ChannelId,
        side: Side,
        peer: MemberId,
    ) -> Result<Stream, Error> {
        let StreamEnds { tx, rx, .. } = StreamEnds::attach(node.region.registry(), ch, side)?;
        let policy = node.wait_policy(peer);
        let watch = PeerWatch::new(
            &Node {
                inner: node.clone(),
            },
            ch,
            side,
        );
        Ok(Stream {
            node,
            ch,
            side,
            peer,
            watch,
            tx,
            rx,
            policy,
            nonblocking: false,
            read_timeout: None,
            write_timeout: None,
            write_shut: false,
            peer_looked: Instant::now(),
        })
    }

    pub fn channel(&self) -> ChannelId {
        self.ch
    }
    pub fn peer(&self) -> MemberId {
        self.peer
    }
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }
    pub fn set_read_timeout(&mut self, t: Option<Duration>) {
        self.read_timeout = t;
    }
    pub fn set_write_timeout(&mut self, t: Option<Duration>) {
        self.write_timeout = t;
    }
    /// Bytes received and sent so far.
    pub fn counters(&self) -> (u64, u64) {
        (self.rx.total_read(), self.tx.total_written())
    }

    /// Receives up to `buf.len()` bytes; `Ok(0)` means end of stream (the peer shut down writing).
    pub fn recv(&mut self, buf: &mut [u8]) -> Result<usize, Error> {
        self.recv_with(|rx| rx.read(buf))
    }

    pub fn recv_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, Error> {
        self.recv_with(|rx| rx.read_vectored(bufs))
    }

    fn recv_with(
        &mut self,
        mut op: impl FnMut(&mut StreamConsumer) -> Result<usize, RingError>,
    ) -> Result<usize, Error> {
        let deadline = self.read_timeout.map(|t| Instant::now() + t);
        loop {
            let n = op(&mut self.rx)?;
            if n > 0 || self.rx.is_eof()? {
                return Ok(n);
            }
            if let Err(e) = self.wait(Dir::Read, deadline) {
                // Data may have landed just before the peer died: deliver it first.
                if self.rx.available()? > 0 || self.rx.is_eof()? {
                    continue;
                }
                return Err(e);
            }
        }
    }

    /// Sends some of `buf` (at least one byte unless it is empty), blocking while the ring is full.
    pub fn send(&mut self, buf: &[u8]) -> Result<usize, Error> {
        self.send_with(buf.is_empty(), |tx| tx.write(buf))
    }

    pub fn send_vectored(&mut self, bufs: &[IoSlice<'_>]) -> Result<usize, Error> {
        let empty = bufs.iter().all(|b| b.is_empty());
        self.send_with(empty, |tx| tx.write_vectored(bufs))
    }

    fn send_with(
        &mut self,
        empty: bool,
        mut op: impl FnMut(&mut StreamProducer) -> Result<usize, RingError>,
    ) -> Result<usize, Error> {
        if self.write_shut {
            return Err(Error::WriteShutdown);
        }
        if empty {
            return Ok(0);
        }
        let deadline = self.write_timeout.map(|t| Instant::now() + t);
        loop {
            match op(&mut self.tx) {
                Ok(0) => self.wait(Dir::Write, deadline)?,
                Ok(n) => return Ok(n),
                Err(RingError::Closed) => return Err(self.closed_error()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Sends all of `buf`.
    pub fn send_all(&mut self, mut buf: &[u8]) -> Result<(), Error> {
        while !buf.is_empty() {
            let n = self.send(buf)?;
            buf = &buf[n..];
        }
        Ok(())
    }

    /// No more sends: the peer reads what was sent, then end of stream.
    pub fn shutdown_write(&mut self) {
        if !self.write_shut {
            self.write_shut = true;
            self.tx.shutdown();
        }
    }

    fn closed_error(&self) -> Error {
        if self.node.check_peer(self.peer) {
            Error::BrokenPipe
        } else {
            Error::PeerDead
        }
    }

    fn wait(&mut self, dir: Dir, deadline: Option<Instant>) -> Result<(), Error> {
        if self.nonblocking {
            return Err(if self.peer_gone() {
                Error::PeerDead
            } else {
                Error::WouldBlock
            });
        }
        // Across kernels the peer's heartbeat is the only sign of life: look at it on entering
        // a wait (at most every PEER_LOOK: it costs more than a round trip), so a death during
        // this wait is timed from about here rather than from our first idle slice.
        if self.policy.mode == WakeMode::SleepPoll && self.peer_looked.elapsed() >= PEER_LOOK {
            self.peer_looked = Instant::now();
            if !self.node.check_peer(self.peer) {
                return Err(Error::PeerDead);
            }
        }
        loop {
            let slice = match deadline {
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(self.liveness_slice()),
                None => self.liveness_slice(),
            };
            let ready = match dir {
                Dir::Read => self.rx.wait_readable(&self.policy, slice)?,
                Dir::Write => self.tx.wait_writable(1, &self.policy, slice)?,
            };
            if ready {
                return Ok(());
            }
            if self.peer_gone() {
                return Err(Error::PeerDead);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::TimedOut);
            }
        }
    }

    fn liveness_slice(&self) -> Duration {
        match self.policy.mode {
            WakeMode::SleepPoll => LIVENESS_SLICE_VM,
            WakeMode::Futex => LIVENESS_SLICE,
        }
    }

    /// Has the peer died, or (for an unaccepted offer) been declined?
    fn peer_gone(&self) -> bool {
        self.watch.lost()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.shutdown_write();
        self.rx.close();
        channel::release(self.node.region.registry(), self.ch, self.side);
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(self.recv(buf)?)
    }
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        Ok(self.recv_vectored(bufs)?)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(self.send(buf)?)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        Ok(self.send_vectored(bufs)?)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
