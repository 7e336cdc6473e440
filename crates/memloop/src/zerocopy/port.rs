//! Descriptor channels: a port sends descriptors of loans and of what it received, and
//! receives messages it reads in place and holds until it drops them.

use super::message::{Message, Part};
use super::DEFAULT_DESC_RING;
use crate::channel::{self, PeerWatch};
use crate::error::Error;
use crate::listener::Listener;
use crate::node::Node;
use memloop_registry::{
    ChannelId, ChannelKind, MemberId, PoolId, PoolInfo, Registry, RegistryError, Side,
};
use memloop_ring::{
    Descriptor, HeldConsumer, HeldReleaser, RingError, SlotProducer, WaitCell, WaitPolicy, WakeMode,
};
use memloop_shm::PoolMapping;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Accepts descriptor channels offered to a named service.
pub struct ZcListener {
    inner: Listener,
}

impl ZcListener {
    pub fn bind(node: &Node, name: &str) -> Result<ZcListener, Error> {
        Ok(ZcListener {
            inner: Listener::bind(node, name)?,
        })
    }

    pub fn set_nonblocking(&mut self, on: bool) {
        self.inner.set_nonblocking(on);
    }

    /// Accepts the oldest pending descriptor channel (a stream offered here is declined).
    pub fn accept(&self) -> Result<ZcPort, Error> {
        self.accept_timeout(None)
    }

    pub fn accept_timeout(&self, timeout: Option<Duration>) -> Result<ZcPort, Error> {
        let (ch, client) = self
            .inner
            .accept_channel(ChannelKind::DescriptorPair, timeout)?;
        let node = Node {
            inner: self.inner.node().clone(),
        };
        ZcPort::attach(&node, ch, Side::Server, client)
    }
}

/// One end of a descriptor channel.
pub struct ZcPort {
    sh: Arc<PortShared>,
    tx: SlotProducer,
    nonblocking: bool,
    timeout: Option<Duration>,
    /// How long a wait spins before it sleeps (`None`: the node's policy for this peer).
    spin: Option<Duration>,
    /// When a non-blocking call that found nothing last found the peer alive.
    alive_at: Option<Instant>,
}

/// How long a non-blocking call that finds nothing trusts its last look at the peer's
/// liveness: a look reads /proc, and a port drained after every wake-up would otherwise read
/// it once per batch (thousands of times a second under load).
const NONBLOCKING_LOOK_EVERY: Duration = Duration::from_millis(5);

/// What a port shares with the messages it received (they release through it, and may
/// outlive it: the channel goes when the last of them does).
pub(super) struct PortShared {
    node: Node,
    ch: ChannelId,
    side: Side,
    peer: MemberId,
    watch: PeerWatch,
    policy: WaitPolicy,
    rx: Mutex<HeldConsumer>,
    releaser: HeldReleaser,
    /// Pools we read from, mapped read-only, by id.
    views: Mutex<HashMap<PoolId, Arc<PoolView>>>,
}

/// A pool as a reader sees it.
struct PoolView {
    info: PoolInfo,
    map: Arc<PoolMapping>,
    bell: WaitCell,
}

impl ZcPort {
    /// Connects to the service `service`, bound by a [`ZcListener`].
    pub fn connect(node: &Node, service: &str) -> Result<ZcPort, Error> {
        let kind = ChannelKind::DescriptorPair;
        let (ch, peer) = channel::offer_to_service(&node.inner, service, kind, DEFAULT_DESC_RING)?;
        Self::attach(node, ch, Side::Client, peer)
    }

    fn attach(node: &Node, ch: ChannelId, side: Side, peer: MemberId) -> Result<ZcPort, Error> {
        let rings = node
            .region()
            .registry()
            .rings_of(ch, ChannelKind::DescriptorPair)?;
        let (tx, rx) = match side {
            Side::Client => (rings.c2s, rings.s2c),
            Side::Server => (rings.s2c, rings.c2s),
        };
        let rx = HeldConsumer::attach(rx)?;
        let sh = Arc::new(PortShared {
            node: node.clone(),
            ch,
            side,
            peer,
            watch: PeerWatch::new(node, ch, side),
            policy: node.inner.wait_policy(peer),
            releaser: rx.releaser(),
            rx: Mutex::new(rx),
            views: Mutex::new(HashMap::new()),
        });
        Ok(ZcPort {
            sh,
            tx: SlotProducer::attach(tx)?,
            nonblocking: false,
            timeout: None,
            spin: None,
            alive_at: None,
        })
    }

    pub fn peer(&self) -> MemberId {
        self.sh.peer
    }
    pub fn channel(&self) -> ChannelId {
        self.sh.ch
    }
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }
    /// Longest wait of a blocking send or receive ([`Error::TimedOut`]).
    pub fn set_timeout(&mut self, t: Option<Duration>) {
        self.timeout = t;
    }
    /// How long a blocking send or receive may spin before it sleeps (`None`: the default,
    /// ~50 µs and adaptive). A longer spin trades CPU for latency when the peer takes a while
    /// to answer — a wake-up from sleep costs tens of µs on a VM; the spin still adapts down
    /// when it keeps failing.
    pub fn set_spin(&mut self, spin: Option<Duration>) {
        self.spin = spin;
    }

    /// Sends a message — a loan, a received message forwarded, or a [`Message`] mixing
    /// both — as one group of descriptors, waiting for room in the ring.
    pub fn send<'a>(&mut self, msg: impl Into<Message<'a>>) -> Result<(), Error> {
        let msg = msg.into();
        if msg.is_empty() {
            return Ok(());
        }
        let descs = msg.descriptors();
        let n = descs.len() as u64;
        if n > self.tx.slots() {
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{n} segments: more than the ring's {}", self.tx.slots()),
            )));
        }
        let deadline = self.timeout.map(|t| Instant::now() + t);
        while self.tx.free_slots()? < n {
            if self.tx.reader_closed() {
                return Err(self.sh.closed_error());
            }
            self.wait(deadline, |p, pol, s| p.tx.wait_writable(n, pol, s))?;
        }
        let encoded: Vec<[u8; 32]> = descs.iter().map(Descriptor::encode).collect();
        let slots: Vec<&[u8]> = encoded.iter().map(|b| &b[..]).collect();
        match self.tx.push_batch(&slots) {
            Ok(k) if k as u64 == n => {}
            // (We are the only writer and saw the room: a shortfall is a ring gone wrong.)
            Ok(_) => return Err(Error::Forged("a ring that lost room under its writer")),
            Err(RingError::Closed) => return Err(self.sh.closed_error()),
            Err(e) => return Err(e.into()),
        }
        self.after_publish(msg)
    }

    /// Loans are the rings' now; forwarded pools are told, before the sender may release
    /// what it forwarded (the registry's pools module says why). Every loan is marked sent
    /// first: one dropped unmarked would go back to its free list while a ring names it.
    fn after_publish(&self, msg: Message<'_>) -> Result<(), Error> {
        let mut forwarded: Vec<PoolId> = Vec::new();
        for p in msg.parts {
            match p {
                Part::Loan(l) => l.sent(),
                Part::Held { d, .. } => {
                    let id = PoolId::from_wire(d.pool, d.pool_gen);
                    if let Some(id) = id.filter(|id| !forwarded.contains(id)) {
                        forwarded.push(id);
                    }
                }
            }
        }
        let reg = self.sh.registry();
        forwarded
            .into_iter()
            .try_for_each(|id| reg.note_forward(id))
            .map_err(Error::from)
    }

    /// The next message; `Ok(None)` once the peer shut down its sending side and everything
    /// it sent was received.
    pub fn recv(&mut self) -> Result<Option<Received>, Error> {
        let deadline = self.timeout.map(|t| Instant::now() + t);
        loop {
            let mut rx = self.sh.rx();
            rx.advance()?;
            if let Some(m) = self.sh.take_message(&mut rx)? {
                return Ok(Some(m));
            }
            if rx.is_eof()? {
                return Ok(None);
            }
            drop(rx);
            self.wait(deadline, |p, pol, s| p.sh.rx().wait_readable(pol, s))?;
        }
    }

    /// Waits in liveness slices for `ready`, checking the peer between them.
    fn wait(
        &mut self,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut Self, &WaitPolicy, Duration) -> Result<bool, RingError>,
    ) -> Result<(), Error> {
        if self.nonblocking {
            return Err(match self.lost_lately() {
                true => Error::PeerDead,
                false => Error::WouldBlock,
            });
        }
        let mut policy = self.sh.policy;
        if let Some(s) = self.spin {
            policy.spin = s;
        }
        let slice = match policy.mode {
            WakeMode::SleepPoll => crate::LIVENESS_SLICE_VM,
            WakeMode::Futex => crate::LIVENESS_SLICE,
        };
        loop {
            let left = deadline.map_or(slice, |d| d.saturating_duration_since(Instant::now()));
            if ready(self, &policy, left.min(slice))? {
                return Ok(());
            }
            if self.sh.watch.lost() {
                return Err(Error::PeerDead);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::TimedOut);
            }
        }
    }

    /// Whether the peer is lost, looked at no more than every [`NONBLOCKING_LOOK_EVERY`]
    /// while it keeps being found alive (a death is seen that much later, at most).
    fn lost_lately(&mut self) -> bool {
        let now = Instant::now();
        if self
            .alive_at
            .is_some_and(|t| now.saturating_duration_since(t) < NONBLOCKING_LOOK_EVERY)
        {
            return false;
        }
        let lost = self.sh.watch.lost();
        self.alive_at = (!lost).then_some(now);
        lost
    }

    /// No more sends: the peer receives what was sent, then `None`.
    pub fn shutdown_send(&mut self) {
        self.tx.shutdown();
    }
}

impl Drop for ZcPort {
    fn drop(&mut self) {
        self.tx.shutdown();
    }
}

impl PortShared {
    fn registry(&self) -> &Registry {
        self.node.region().registry()
    }

    fn rx(&self) -> MutexGuard<'_, HeldConsumer> {
        self.rx.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn closed_error(&self) -> Error {
        match self.node.inner.check_peer(self.peer) {
            true => Error::BrokenPipe,
            false => Error::PeerDead,
        }
    }

    /// Takes one whole message (descriptors up to one without `FLAG_MORE`), validating each
    /// against its pool. A message with a bad descriptor is released and refused.
    fn take_message(self: &Arc<Self>, rx: &mut HeldConsumer) -> Result<Option<Received>, Error> {
        let mut segs: Vec<Segment> = Vec::new();
        loop {
            let Some((pos, d)) = rx.take()? else {
                if segs.is_empty() {
                    return Ok(None);
                }
                // The rest of the message is published with it: never split.
                segs.iter()
                    .for_each(|s| self.releaser.mark(s.pos).unwrap_or(()));
                return Err(Error::Forged("a message published in part"));
            };
            match self.view_of(&d) {
                Ok(view) => segs.push(Segment { pos, d, view }),
                Err(e) => {
                    segs.iter()
                        .for_each(|s| self.releaser.mark(s.pos).unwrap_or(()));
                    self.drop_rest(rx, pos, d)?;
                    return Err(e);
                }
            }
            if d.flags & Descriptor::FLAG_MORE == 0 {
                return Ok(Some(Received {
                    port: self.clone(),
                    segs,
                }));
            }
        }
    }

    /// Releases the refused descriptor at `pos` and the rest of its message (published with
    /// it), so the next receive starts at the next message.
    fn drop_rest(&self, rx: &mut HeldConsumer, pos: u64, d: Descriptor) -> Result<(), Error> {
        self.releaser.mark(pos)?;
        let mut more = d.flags & Descriptor::FLAG_MORE != 0;
        while more {
            let Some((p, next)) = rx.take()? else { break };
            self.releaser.mark(p)?;
            more = next.flags & Descriptor::FLAG_MORE != 0;
        }
        rx.advance()?;
        Ok(())
    }

    /// The read-only view of the pool a descriptor names, after checking that the pool is
    /// live (or closing), that the owner is the pool's and that the range is one buffer's.
    fn view_of(&self, d: &Descriptor) -> Result<Arc<PoolView>, Error> {
        let id = PoolId::from_wire(d.pool, d.pool_gen).ok_or(Error::Forged("pool 0"))?;
        let mut views = self.views.lock().unwrap_or_else(|p| p.into_inner());
        let view = match views.get(&id) {
            Some(v) => v.clone(),
            None => {
                let info = match self.registry().pool(id) {
                    Ok(i) => i,
                    Err(RegistryError::Stale | RegistryError::NotFound) => {
                        return Err(Error::Forged("no such pool"))
                    }
                    Err(e) => return Err(e.into()),
                };
                let region = self.node.region().mapping();
                let map =
                    PoolMapping::map(region, info.data_off, info.buf_size, info.buffers, false)?;
                let (waiting, seq) = self.registry().pool_bell(id)?;
                let v = Arc::new(PoolView {
                    info,
                    map,
                    bell: WaitCell::new(waiting, seq),
                });
                views.insert(id, v.clone());
                v
            }
        };
        if d.owner != view.info.owner_tag {
            return Err(Error::Forged("not the pool owner's"));
        }
        if view.info.buffer_of(d.offset, d.len).is_none() {
            return Err(Error::Forged("bytes outside one buffer of the pool"));
        }
        Ok(view)
    }
}

impl Drop for PortShared {
    fn drop(&mut self) {
        self.rx().close();
        channel::release(self.registry(), self.ch, self.side);
    }
}

/// A received message: its bytes, read in place (read-only), held until it is dropped.
pub struct Received {
    port: Arc<PortShared>,
    segs: Vec<Segment>,
}

struct Segment {
    pos: u64,
    d: Descriptor,
    view: Arc<PoolView>,
}

impl Segment {
    fn bytes(&self) -> &[u8] {
        self.view
            .map
            .bytes(self.d.offset, self.d.len as usize)
            .unwrap_or(&[])
    }
}

impl Received {
    /// The message's segments, in order.
    pub fn segments(&self) -> impl Iterator<Item = &[u8]> {
        self.segs.iter().map(Segment::bytes)
    }

    pub fn segment_count(&self) -> usize {
        self.segs.len()
    }

    /// The bytes of a one-segment message (the first segment of a longer one).
    pub fn bytes(&self) -> &[u8] {
        self.segs.first().map_or(&[], Segment::bytes)
    }

    /// Total bytes over all segments.
    pub fn len(&self) -> usize {
        self.segs.iter().map(|s| s.d.len as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sender's word ([`Message::user`]).
    pub fn user(&self) -> u32 {
        self.segs.first().map_or(0, |s| s.d.user)
    }

    /// The pools the segments lie in.
    pub fn pools(&self) -> impl Iterator<Item = PoolId> + '_ {
        self.segs.iter().map(|s| s.view.info.id)
    }

    pub(super) fn descriptors(&self) -> impl Iterator<Item = Descriptor> + '_ {
        self.segs.iter().map(|s| s.d)
    }

    /// `len` bytes from `off` of segment `seg`, as a descriptor to forward.
    pub(super) fn sub_descriptor(
        &self,
        seg: usize,
        off: usize,
        len: usize,
    ) -> Result<Descriptor, Error> {
        let s = self.segs.get(seg).ok_or(Error::Forged("no such segment"))?;
        let inside = off.checked_add(len).is_some_and(|e| e <= s.d.len as usize) && len > 0;
        if !inside {
            return Err(Error::Forged("a range outside the segment"));
        }
        Ok(Descriptor {
            offset: s.d.offset + off as u64,
            len: len as u32,
            ..s.d
        })
    }
}

impl Drop for Received {
    /// Our holds end: the slots are marked released (the head moves now if the port is not
    /// busy, else at its next call), and the owners waiting for a buffer are rung.
    fn drop(&mut self) {
        for s in &self.segs {
            if let Err(e) = self.port.releaser.mark(s.pos) {
                tracing::warn!("releasing a received buffer: {e}");
            }
        }
        if let Ok(mut rx) = self.port.rx.try_lock() {
            rx.advance().ok();
        }
        let reg = self.port.registry();
        let mut rung: Vec<PoolId> = Vec::new();
        for s in &self.segs {
            let id = s.view.info.id;
            if rung.contains(&id) {
                continue;
            }
            rung.push(id);
            s.view.bell.notify();
            // A closing pool goes with its last reference.
            if reg.pool_closing(id) {
                reg.collect_pool(id).ok();
            }
        }
    }
}
