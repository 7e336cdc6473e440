//! Datagram sockets over shared memory: UDP's model (any number of peers per socket, message
//! boundaries kept, a full receiver drops) on datagram-pair channels.
//!
//! A socket is published as a `udp` endpoint under its bound address. A sender makes one
//! channel per (sender socket, receiver socket) pair on its first datagram to a member's
//! address — a record ring each way, the sender's address in the channel's tuple — and the
//! receiver takes it when it next looks; replies go back on the same pair. One peer's
//! datagrams always travel on one pair (the pair a socket first sends on stays its pair to
//! that peer), so they are never reordered; across peers there is no order, as with UDP.
//!
//! **Waking.** Every socket sleeps on one word, its endpoint's doorbell (the registry's
//! sequence word and waiting flag, bumped by every offer too): a sender rings the receiver's
//! after each datagram, which costs a load unless the receiver armed it. So a receiver with a
//! thousand peers sleeps on one futex.
//!
//! **Never blocking a sender.** A datagram that does not fit the receiver's ring is dropped
//! and counted ([`DatagramSocket::dropped`]), as a full UDP receive buffer drops it; one to a
//! socket that closed is dropped too (UDP would answer with an ICMP error nobody sees on an
//! unconnected socket). Nothing else is ever lost or reordered.
//!
//! This is the core the transparent layer's UDP builds on; the native API uses it directly.

use crate::channel::{self, PeerWatch, RecordEnds};
use crate::error::Error;
use crate::node::{Node, NodeInner};
use memloop_registry::{
    ChannelId, ChannelKind, ConnTuple, EndpointId, EndpointKey, Proto, RegistryError, Side,
};
use memloop_ring::presence::{self, Presence};
use memloop_ring::wait::SpinInputs;
use memloop_ring::{RecvInfo, RingError, Spinner, WaitCell, WaitPolicy, WakeMode};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Ring bytes per direction of a pair: a 64 KiB datagram fits (a record is at most half a
/// ring), and a little more than Linux's default UDP receive buffer (208 KiB) queues.
pub const DATAGRAM_RING_CAPACITY: u64 = 1 << 18;
/// The largest ring a receiver's `SO_RCVBUF` makes a pair's (a socket asking for more than
/// the kernel's default buffer gets rings of its size, up to this).
pub const MAX_DATAGRAM_RING: u64 = 1 << 24;

/// A *wake datagram*'s first bytes: sent once by the kernel path after a new pair's first
/// datagram, so that a receiver blocked in the kernel (it had no pair to watch) wakes up and
/// looks at its rings. Receivers swallow it ([`DatagramSocket::is_wake`]).
pub const WAKE_MAGIC: [u8; 8] = *b"mlwake\x00\x01";
/// A wake datagram's length: the magic and the new pair's channel (index, generation).
pub const WAKE_LEN: usize = 16;

/// The wake datagram of pair `ch`.
pub fn wake_payload(ch: ChannelId) -> [u8; WAKE_LEN] {
    let mut b = [0u8; WAKE_LEN];
    b[..8].copy_from_slice(&WAKE_MAGIC);
    b[8..12].copy_from_slice(&ch.idx.to_le_bytes());
    b[12..].copy_from_slice(&ch.gen.to_le_bytes());
    b
}

/// Whether `b` has a wake datagram's shape. A socket that is not (or no longer) on a ring
/// swallows every such datagram: it can only be a wake-up meant for a pair it had.
pub fn looks_like_wake(b: &[u8]) -> bool {
    b.len() == WAKE_LEN && b[..8] == WAKE_MAGIC
}

/// The flag of [`DatagramSocket`]'s `seen` word: the offers were taken at least once.
const SEEN: u64 = 1 << 32;

/// How often a receiver that finds nothing looks for pairs whose peer is gone.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// What became of a datagram handed to [`DatagramSocket::send_to`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// In the receiver's ring.
    Delivered,
    /// Dropped, as UDP drops it; counted.
    Dropped(DropReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The receiver's ring is full (it reads slower than we send).
    Full,
    /// The receiving socket closed or its process died.
    Closed,
}

/// The address of a socket as the registry keys it: the network scope that owns the address
/// (a namespace of one kernel) and the address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopedAddr {
    pub scope: u64,
    pub addr: SocketAddr,
}

impl ScopedAddr {
    fn key(&self) -> EndpointKey {
        EndpointKey::Socket {
            proto: Proto::Udp,
            scope: self.scope,
            addr: self.addr.ip(),
            port: self.addr.port(),
        }
    }
}

/// The address as both ends compare it: IPv4-mapped IPv6 as IPv4, no flow info or scope id.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// One pair this socket sends or receives on.
struct Pair {
    ch: ChannelId,
    side: Side,
    peer: SocketAddr,
    ends: RecordEnds,
    /// The peer socket's doorbell (none if it has no endpoint we can find: it cannot be
    /// woken, only polled, and its sleeps are bounded).
    peer_bell: Option<WaitCell>,
    /// The peer socket's count of datagrams dropped at it (`memloop status`).
    peer_dropped: Option<memloop_shm::ShmU32>,
    /// The peer socket's hand-back count (bumped when we hand its datagrams back).
    peer_returned: Option<memloop_shm::ShmU32>,
    /// The peer socket's receive buffer (bytes; 0: unknown): what our ring to it may queue.
    peer_rcvbuf: Option<memloop_shm::ShmU32>,
    watch: PeerWatch,
    /// Datagrams dropped because the ring was full (the receiver's liveness is looked at on
    /// the first and every [`Pair::full_for_good`] period after).
    full_streak: u32,
    /// Drops not added to `peer_dropped` yet: a flood drops millions, and that word shares a
    /// cache line with ones the receiver reads on every receive.
    drops_unpublished: u32,
}

impl Pair {
    /// One more datagram dropped at the peer: published in batches (and when a datagram
    /// goes through again, and at release), so `memloop status` lags a flood by a little.
    fn count_drop(&mut self) {
        const BATCH: u32 = 64;
        self.drops_unpublished += 1;
        if self.drops_unpublished >= BATCH {
            self.publish_drops();
        }
    }

    fn publish_drops(&mut self) {
        let n = std::mem::take(&mut self.drops_unpublished);
        if let (Some(d), true) = (&self.peer_dropped, n > 0) {
            d.fetch_add(n, Relaxed);
        }
    }

    fn release(mut self, reg: &memloop_registry::Registry, waker: Option<fn(u32)>) {
        self.publish_drops();
        self.ends.tx.shutdown();
        self.ends.rx.close();
        self.ring_peer(waker);
        channel::release(reg, self.ch, self.side);
    }

    /// Leaves the pair handing what we have not read back to its sender (which sends it by
    /// the kernel), and tells the sender's socket to look.
    fn hand_back(mut self, reg: &memloop_registry::Registry, waker: Option<fn(u32)>) {
        self.ends.rx.hand_back();
        if let Some(r) = &self.peer_returned {
            r.fetch_add(1, Release);
        }
        self.release(reg, waker);
    }

    /// What the peer handed back unread of what we sent it (see [`Pair::hand_back`]), into
    /// `out` with its destination.
    fn take_back(&mut self, out: &mut Vec<(SocketAddr, Vec<u8>)>) {
        match self.ends.tx.take_back() {
            Ok(recs) => out.extend(recs.into_iter().map(|r| (self.peer, r))),
            Err(e) => tracing::debug!(ch = ?self.ch, "taking datagrams back: {e}"),
        }
    }

    /// Whether the datagram `parts` would queue more than the receiver's buffer holds (a
    /// datagram into an empty queue always goes, as the kernel takes one past its limit).
    fn over_rcvbuf(&mut self, parts: &[&[u8]]) -> bool {
        let limit = self
            .peer_rcvbuf
            .as_ref()
            .map_or(0, |w| u64::from(w.load(Relaxed)));
        if limit == 0 || limit >= self.ends.tx.capacity() {
            return false; // (no limit, or the ring's own)
        }
        let need = 8 + parts.iter().map(|p| p.len() as u64).sum::<u64>();
        let within = limit.saturating_sub(need);
        match self.ends.tx.queued_bytes(within) {
            Ok(q) => q > 0 && q > within,
            Err(_) => false, // (the send itself reports it)
        }
    }

    /// After one more drop for a full ring: whether the receiver is gone for good (asked of
    /// the registry on the first drop and every `LOOK_EVERY` drops after: a flood against a
    /// slow receiver alternates drops and sends, and each look reads /proc).
    fn full_for_good(&mut self) -> bool {
        const LOOK_EVERY: u32 = 4096;
        let look = self.full_streak % LOOK_EVERY == 0;
        self.full_streak = self.full_streak.wrapping_add(1);
        look && self.watch.lost()
    }

    /// Wakes the peer if it sleeps: its futex here; a sleeper outside (poll, epoll) named
    /// by the flag's target through `waker`.
    fn ring_peer(&self, waker: Option<fn(u32)>) {
        let Some(b) = &self.peer_bell else { return };
        let rest = b.notify();
        if let (Some(w), true) = (waker, rest != 0) {
            w(rest);
        }
    }
}

#[derive(Default)]
struct State {
    pairs: Vec<Pair>,
    /// Peer → the pair we send to it on (the first one used; never changed while it lives).
    send_on: std::collections::HashMap<SocketAddr, usize>,
    /// Where the next receive starts (round robin over the pairs).
    next: usize,
    /// The doorbell's sequence value when we last took offers.
    offers_seen: Option<u32>,
    swept: Option<Instant>,
    /// Some pair's peer runs in another kernel: sleeps poll instead of using a futex.
    remote_peer: bool,
    /// No more offers taken, nothing sent by the ring ([`DatagramSocket::retire`]).
    retired: bool,
    /// Pairs we opened whose wake datagram the caller has not sent yet.
    opened: Vec<ChannelId>,
    /// Datagrams receivers handed back unread, with their destinations: the caller sends
    /// them by the kernel ([`DatagramSocket::take_returned`]) before anything newer.
    returned: Vec<(SocketAddr, Vec<u8>)>,
    /// Offers withdrawn whose datagrams the caller is sending by the kernel: kept CANCELLED
    /// (their receivers wait for them) until [`DatagramSocket::withdrawal_sent`].
    withdrawing: Vec<ChannelId>,
}

/// A datagram socket over shared memory (see the module text).
pub struct DatagramSocket {
    node: Arc<NodeInner>,
    ep: EndpointId,
    me: ScopedAddr,
    bell: WaitCell,
    state: Mutex<State>,
    spinner: Spinner,
    nonblocking: AtomicBool,
    read_timeout: Mutex<Option<Duration>>,
    dropped: AtomicU64,
    /// Pairs held now (read without the state lock: whether spinning can pay).
    npairs: std::sync::atomic::AtomicUsize,
    /// `State::opened` is not empty (one load on every send).
    opened: AtomicBool,
    /// The doorbell value the offers were last taken at, with [`SEEN`] set (0: never): with no
    /// pair and the doorbell unmoved there is nothing to look at, known without the lock.
    seen: AtomicU64,
    capacity: u64,
    /// Reaches sleepers that wait outside the ring (see [`DatagramSocket::set_waker`]).
    waker: Option<fn(u32)>,
    /// Our endpoint's hand-back count (see [`Pair::hand_back`]).
    returns: Option<memloop_shm::ShmU32>,
    /// `State::returned` is not empty (one load per call).
    has_returned: AtomicBool,
    /// `returns` when we last looked at our pairs for hand-backs.
    returns_seen: std::sync::atomic::AtomicU32,
    /// Our receive buffer as senders read it ([`DatagramSocket::set_recv_buffer`]).
    rcvbuf: Option<memloop_shm::ShmU32>,
    /// Holds the kernel's port for a socket the native API bound (no other socket, ours or
    /// not, can take the address meanwhile).
    _reserved: Option<std::net::UdpSocket>,
}

impl DatagramSocket {
    /// Binds `addr` for the native API: the kernel reserves the address (port 0 picks a
    /// free one) and the socket is published under it in our network scope.
    pub fn bind(node: &Node, addr: SocketAddr) -> Result<DatagramSocket, Error> {
        let reserved = std::net::UdpSocket::bind(addr)?;
        let local = reserved.local_addr()?;
        let scope = own_scope(&node.inner)?;
        let mut s = Self::publish(node, ScopedAddr { scope, addr: local })?;
        s._reserved = Some(reserved);
        Ok(s)
    }

    /// Publishes a socket already bound (by the caller, in the kernel) to `me`.
    pub fn publish(node: &Node, me: ScopedAddr) -> Result<DatagramSocket, Error> {
        let n = &node.inner;
        let me = ScopedAddr {
            scope: me.scope,
            addr: canonical(me.addr),
        };
        n.advertise();
        let reg = n.region.registry();
        let ep = match reg.add_endpoint(n.id, &me.key()) {
            Err(RegistryError::AddrInUse) => {
                // Only a dead member's leftover can hold an address the kernel gave us.
                let holder = reg.lookup(&me.key()).map(|e| e.owner);
                if holder.is_some_and(|h| n.check_peer(h)) {
                    return Err(Error::AddrInUse(me.addr.to_string()));
                }
                reg.add_endpoint(n.id, &me.key())?
            }
            other => other?,
        };
        let bell = channel::endpoint_bell(reg, ep)?;
        let returns = reg.endpoint_returned(ep).ok();
        let rcvbuf = reg.endpoint_rcvbuf(ep).ok();
        Ok(DatagramSocket {
            node: n.clone(),
            ep,
            me,
            bell,
            state: Mutex::new(State::default()),
            spinner: Spinner::new(WaitPolicy::default().spin),
            nonblocking: AtomicBool::new(false),
            read_timeout: Mutex::new(None),
            dropped: AtomicU64::new(0),
            npairs: std::sync::atomic::AtomicUsize::new(0),
            opened: AtomicBool::new(false),
            seen: AtomicU64::new(0),
            capacity: DATAGRAM_RING_CAPACITY,
            waker: None,
            returns,
            has_returned: AtomicBool::new(false),
            returns_seen: std::sync::atomic::AtomicU32::new(0),
            rcvbuf,
            _reserved: None,
        })
    }

    /// How a peer's sleeper outside the ring is woken: `f` gets the flag its doorbell held
    /// (a wake target, see [`memloop_ring::wait::flag_target`]), as the transparent layer's
    /// poll and epoll sleepers arm it.
    pub fn set_waker(&mut self, f: fn(u32)) {
        self.waker = Some(f);
    }

    /// Our receive buffer in bytes (`SO_RCVBUF` as the kernel reports it; 0: the default,
    /// no limit but the ring's): a sender's new pair to us gets a ring of at least that much
    /// (up to [`MAX_DATAGRAM_RING`]), and a datagram that would queue more than it in one pair
    /// is dropped, as the kernel drops it.
    pub fn set_recv_buffer(&self, bytes: u64) {
        if let Some(w) = &self.rcvbuf {
            w.store(bytes.min(u64::from(u32::MAX)) as u32, Relaxed);
        }
    }

    /// Our doorbell: what a sleeper outside the ring arms with its wake target.
    pub fn bell(&self) -> &WaitCell {
        &self.bell
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.me.addr
    }

    pub fn endpoint(&self) -> EndpointId {
        self.ep
    }

    pub fn set_nonblocking(&self, on: bool) {
        self.nonblocking.store(on, Relaxed);
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) {
        *lock(&self.read_timeout) = t;
    }

    /// Datagrams this socket sent that were dropped (full or closed receivers).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// Pairs this socket has (peers it exchanged datagrams with).
    pub fn pairs(&self) -> usize {
        self.state().pairs.len()
    }

    /// Before the socket closes: the datagrams in pairs whose receiver has not taken them
    /// yet, withdrawn (the offer cancelled, so it never will), for the caller to send by the
    /// kernel and then call [`Self::withdrawal_sent`]. A sender that closes right after
    /// sending (a logging client) loses nothing; a pair taken already keeps its datagrams for
    /// its receiver. Until then a receiver that finds nothing to read waits for them
    /// ([`Self::withdrawal_pending`]), as the kernel would have queued them at the send.
    pub fn withdraw_untaken(&self) -> Vec<(SocketAddr, Vec<u8>)> {
        self.withdraw_from(&mut self.state())
    }

    /// [`Self::withdraw_untaken`] under the state lock.
    fn withdraw_from(&self, st: &mut State) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < st.pairs.len() {
            let p = &st.pairs[i];
            // (Copied first, without consuming: the receiver may take the offer until the
            // cancel below wins, and must then find everything.)
            let recs = match p.side {
                Side::Client => p.ends.tx.unread().unwrap_or_default(),
                Side::Server => Vec::new(),
            };
            if recs.is_empty() || self.reg().withdraw_offer(p.ch, self.node.id).is_err() {
                i += 1;
                continue;
            }
            // Cancelled: the receiver never reads it; the channel goes once the kernel has
            // the datagrams.
            st.withdrawing.push(p.ch);
            let p = remove_pair(st, i);
            out.extend(recs.into_iter().map(|r| (p.peer, r)));
        }
        self.count_pairs(st);
        out
    }

    /// The datagrams [`Self::withdraw_untaken`] (or a retire) gave are with the kernel now:
    /// their offers go.
    pub fn withdrawal_sent(&self) {
        let mut st = self.state();
        self.free_withdrawn(&mut st);
    }

    fn free_withdrawn(&self, st: &mut State) {
        for ch in st.withdrawing.drain(..) {
            if let Err(e) = self.reg().cancel(ch, self.node.id) {
                tracing::debug!(?ch, "freeing a withdrawn offer: {e}");
            }
        }
    }

    /// Whether a sender is withdrawing an offer to us: its datagrams are on their way by the
    /// kernel, and a receive that finds nothing waits for them. One load while no offer to
    /// us is pending.
    pub fn withdrawal_pending(&self) -> bool {
        self.reg().withdrawing_to(self.ep)
    }

    /// What the spin policy needs ([`memloop_ring::wait::spin_plan`]) when this socket talks
    /// to one peer: that peer's published presence (where it runs, or that it sleeps) — ours
    /// published on the way, in both our ends of the pair. With several pairs (or none)
    /// nothing is known, and the wait spins as its history says.
    pub fn spin_inputs(&self) -> SpinInputs {
        let st = self.state();
        let [p] = &st.pairs[..] else {
            return SpinInputs::UNKNOWN;
        };
        let (rx_ours, rx_peer) = p.ends.rx.presence_words();
        let i = SpinInputs::sample(presence::read_in(rx_peer), None);
        let ours = Presence::running(i.our_cpu);
        presence::publish_in(rx_ours, ours);
        presence::publish_in(p.ends.tx.presence_words().0, ours);
        i
    }

    /// Whether the socket holds any pair (one load: no lock).
    pub fn has_pairs(&self) -> bool {
        self.npairs.load(Relaxed) > 0
    }

    /// The pairs opened since the last call, whose wake datagrams the caller sends (by the
    /// kernel, to the pair's receiver) after their first datagram.
    pub fn take_opened(&self) -> Vec<ChannelId> {
        if !self.opened.load(Relaxed) {
            return Vec::new();
        }
        let mut st = self.state();
        self.opened.store(false, Relaxed);
        std::mem::take(&mut st.opened)
    }

    /// Whether `b`, a datagram the kernel delivered, is a wake datagram (taking the offers
    /// made meanwhile first): the caller swallows it. Any datagram of that shape is one — also
    /// when its pair is gone already: a sender that sent one datagram and closed (a logging
    /// client) leaves its wake datagram behind a pair the receiver may have swept.
    pub fn is_wake(&self, b: &[u8]) -> bool {
        if !looks_like_wake(b) {
            return false;
        }
        let mut st = self.state();
        self.take_offers(&mut st);
        true
    }

    /// The datagrams receivers handed back to us unread (they left their rings: a fork, an
    /// exec), with their destinations, oldest first: the caller sends them by the kernel
    /// before any newer datagram to the same peer. Empty without a lock when there are none.
    pub fn take_returned(&self) -> Vec<(SocketAddr, Vec<u8>)> {
        if !self.has_returned.load(Relaxed) && !self.returns_moved() {
            return Vec::new();
        }
        let mut st = self.state();
        self.collect_returns(&mut st);
        self.has_returned.store(false, Relaxed);
        std::mem::take(&mut st.returned)
    }

    /// Whether a receiver handed datagrams back since we last looked (one load).
    fn returns_moved(&self) -> bool {
        let seen = self.returns_seen.load(Relaxed);
        self.returns
            .as_ref()
            .is_some_and(|w| w.load(Acquire) != seen)
    }

    /// Looks at our pairs for hand-backs if our endpoint's count moved since the last look
    /// (one load otherwise). A pair whose receiver handed back sends no more; it stays while
    /// its other ring has datagrams for us.
    fn collect_returns(&self, st: &mut State) {
        let Some(word) = &self.returns else { return };
        let now = word.load(Acquire);
        if now == self.returns_seen.load(Relaxed) {
            return;
        }
        self.returns_seen.store(now, Relaxed);
        for i in 0..st.pairs.len() {
            self.take_back_from(st, i);
        }
    }

    /// Takes back what pair `i`'s receiver handed back, if it closed (then nothing more is
    /// sent on the pair: its receiver is gone).
    fn take_back_from(&self, st: &mut State, i: usize) {
        let State {
            pairs,
            returned,
            send_on,
            ..
        } = st;
        let p = &mut pairs[i];
        if !p.ends.tx.reader_closed() {
            return;
        }
        let before = returned.len();
        p.take_back(returned);
        if send_on.get(&p.peer) == Some(&i) {
            send_on.remove(&p.peer);
        }
        if returned.len() > before {
            self.has_returned.store(true, Relaxed);
        }
    }

    /// Nothing can be received by the ring now: no pair, and no offer since the last look (a
    /// load of our doorbell; no lock). A socket talking only to non-members is always idle.
    fn idle(&self) -> bool {
        !self.has_pairs() && self.seen.load(Relaxed) == SEEN | u64::from(self.bell.seq_now())
    }

    fn count_pairs(&self, st: &State) {
        self.npairs.store(st.pairs.len(), Relaxed);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn reg(&self) -> &memloop_registry::Registry {
        self.node.region.registry()
    }

    /// Leaves the ring for good, losing nothing: the endpoint goes (new senders find
    /// nobody), and every pair goes, what it holds unread *handed back* to its sender, which
    /// sends it by the kernel — where whoever holds the socket now (a forked child, an exec'd
    /// image) receives it. What peers handed back to us, and what we sent on pairs nobody took
    /// yet, is in [`Self::take_returned`] for the caller to send by the kernel.
    pub fn retire(&self) {
        let mut st = self.state();
        st.offers_seen = None;
        self.take_offers(&mut st);
        if let Err(e) = self.reg().remove_endpoint(self.ep) {
            tracing::debug!("removing a datagram endpoint: {e}");
        }
        st.offers_seen = Some(u32::MAX); // (never looked at again: the endpoint is gone)
        st.retired = true;
        // What we sent on pairs nobody took yet would go with their offers: withdrawn, it
        // goes by the kernel too.
        let mut back = self.withdraw_from(&mut st);
        st.send_on.clear();
        let pairs = std::mem::take(&mut st.pairs);
        tracing::debug!(
            pairs = pairs.len(),
            "datagram socket retires: unread datagrams handed back"
        );
        for mut p in pairs {
            p.take_back(&mut back);
            p.hand_back(self.reg(), self.waker);
        }
        if !back.is_empty() {
            st.returned.extend(back);
            self.has_returned.store(true, Relaxed);
        }
        self.count_pairs(&st);
    }

    /// Sends one datagram to `dst`, a member's socket address (found in the registry under
    /// the scope that owns it). `NoService` if no member socket is bound there: the caller
    /// sends it by the kernel instead.
    pub fn send_to(&self, buf: &[u8], dst: SocketAddr) -> Result<Sent, Error> {
        let dst = canonical(dst);
        let scope = self.scope_of(dst.ip())?;
        let src = self.source_for(dst)?;
        self.send_parts_to(&[buf], src, ScopedAddr { scope, addr: dst })
    }

    /// [`DatagramSocket::send_to`] with the destination's scope and our source address as
    /// the receiver must see it already known (the transparent layer's case), the datagram
    /// the concatenation of `parts`.
    pub fn send_parts_to(
        &self,
        parts: &[&[u8]],
        src: SocketAddr,
        dst: ScopedAddr,
    ) -> Result<Sent, Error> {
        let mut st = self.state();
        if st.retired {
            return Err(Error::NoService(dst.addr.to_string()));
        }
        let i = match st.send_on.get(&dst.addr) {
            Some(&i) => i,
            None => self.new_pair(&mut st, src, dst)?,
        };
        let pair = &mut st.pairs[i];
        if pair.over_rcvbuf(parts) {
            pair.count_drop();
            return Ok(self.drop_one(DropReason::Full));
        }
        match pair.ends.tx.send_parts(parts) {
            Ok(true) => {
                if pair.drops_unpublished > 0 {
                    pair.publish_drops();
                }
                pair.ring_peer(self.waker);
                Ok(Sent::Delivered)
            }
            // A full ring may be one nobody reads any more: a receiver that died before it
            // took our offer (a clean close takes and closes it). Looked at now and then
            // only: the look reads the registry and /proc, a flood drops millions.
            Ok(false) if !pair.full_for_good() => {
                pair.count_drop();
                Ok(self.drop_one(DropReason::Full))
            }
            Ok(false) | Err(RingError::Closed) => {
                self.take_back_from(&mut st, i);
                // (Kept while it holds datagrams for us: they were sent before the close.)
                if matches!(st.pairs[i].ends.rx.peek_len(), Ok(None) | Err(_)) {
                    let p = remove_pair(&mut st, i);
                    self.count_pairs(&st);
                    p.release(self.reg(), self.waker);
                } else {
                    st.send_on.remove(&dst.addr);
                }
                Ok(self.drop_one(DropReason::Closed))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn drop_one(&self, why: DropReason) -> Sent {
        self.dropped.fetch_add(1, Relaxed);
        Sent::Dropped(why)
    }

    /// Offers a pair to the member socket bound at `dst` (exact address, then the wildcard
    /// of its family) and makes it our pair to that address.
    fn new_pair(&self, st: &mut State, src: SocketAddr, dst: ScopedAddr) -> Result<usize, Error> {
        let n = &self.node;
        let reg = self.reg();
        let ep = find_endpoint(reg, dst).ok_or_else(|| Error::NoService(dst.addr.to_string()))?;
        if !n.check_peer(ep.owner) {
            return Err(Error::NoService(dst.addr.to_string()));
        }
        let tuple = ConnTuple {
            client: canonical(src),
            server: dst.addr,
        };
        let peer_rcvbuf = reg.endpoint_rcvbuf(ep.id).ok();
        let asked = peer_rcvbuf
            .as_ref()
            .map_or(0, |w| u64::from(w.load(Relaxed)));
        let capacity = asked
            .next_power_of_two()
            .clamp(self.capacity, MAX_DATAGRAM_RING.max(self.capacity));
        let offer = || {
            reg.offer_kind(
                n.id,
                ep.id,
                ChannelKind::DatagramPair,
                capacity,
                Some(tuple),
            )
        };
        let ch = match offer() {
            Err(RegistryError::RegionFull { .. }) if n.reclaim_dead() > 0 => offer()?,
            other => other?,
        };
        let attached = RecordEnds::attach(reg, ch, Side::Client);
        let ends = match attached {
            Ok(e) => e,
            Err(e) => {
                let _ = reg.cancel(ch, n.id);
                return Err(e);
            }
        };
        let peer_bell = channel::endpoint_bell(reg, ep.id).ok();
        let peer_dropped = reg.endpoint_dropped(ep.id).ok();
        let peer_returned = reg.endpoint_returned(ep.id).ok();
        // (The offer bumped the receiver's doorbell; our first datagram wakes it.)
        let node = Node { inner: n.clone() };
        st.remote_peer |= !n.same_kernel(ep.owner);
        st.pairs.push(Pair {
            ch,
            side: Side::Client,
            peer: dst.addr,
            ends,
            peer_bell,
            peer_dropped,
            peer_returned,
            peer_rcvbuf,
            watch: PeerWatch::new(&node, ch, Side::Client),
            full_streak: 0,
            drops_unpublished: 0,
        });
        let i = st.pairs.len() - 1;
        st.send_on.insert(dst.addr, i);
        self.count_pairs(st);
        st.opened.push(ch);
        self.opened.store(true, Relaxed);
        tracing::debug!(?ch, src = %tuple.client, dst = %dst.addr, "datagram pair offered");
        Ok(i)
    }

    /// Takes every pair offered to us since we last looked.
    fn take_offers(&self, st: &mut State) {
        let seq = self.bell.seq_now();
        if st.retired || st.offers_seen == Some(seq) {
            return;
        }
        st.offers_seen = Some(seq);
        self.seen.store(SEEN | u64::from(seq), Relaxed);
        let reg = self.reg();
        while let Ok(Some(ch)) = reg.take_offer(self.ep, self.node.id) {
            match self.attach_offered(ch) {
                Ok(p) => {
                    st.remote_peer |= !p.watch.same_kernel();
                    // A peer we never sent to: our replies go on its pair.
                    st.send_on.entry(p.peer).or_insert(st.pairs.len());
                    st.pairs.push(p);
                    self.count_pairs(st);
                }
                Err(e) => {
                    tracing::debug!(?ch, "refusing a datagram pair: {e}");
                    channel::release(reg, ch, Side::Server);
                }
            }
        }
    }

    fn attach_offered(&self, ch: ChannelId) -> Result<Pair, Error> {
        let reg = self.reg();
        let info = reg.channel(ch)?;
        let tuple = info.tuple.ok_or_else(|| RegistryError::Corrupt {
            what: "datagram pair",
            detail: "no sender address".into(),
        })?;
        let ends = RecordEnds::attach(reg, ch, Side::Server)?;
        let peer = canonical(tuple.client);
        let scope = reg.member(info.client)?.identity.net_scope();
        let peer_ep =
            find_endpoint(reg, ScopedAddr { scope, addr: peer }).filter(|e| e.owner == info.client);
        let peer_bell = peer_ep
            .as_ref()
            .and_then(|e| channel::endpoint_bell(reg, e.id).ok());
        let peer_dropped = peer_ep
            .as_ref()
            .and_then(|e| reg.endpoint_dropped(e.id).ok());
        let peer_returned = peer_ep
            .as_ref()
            .and_then(|e| reg.endpoint_returned(e.id).ok());
        let peer_rcvbuf = peer_ep.and_then(|e| reg.endpoint_rcvbuf(e.id).ok());
        let node = Node {
            inner: self.node.clone(),
        };
        tracing::debug!(?ch, %peer, "datagram pair taken");
        Ok(Pair {
            ch,
            side: Side::Server,
            peer,
            ends,
            peer_bell,
            peer_dropped,
            peer_returned,
            peer_rcvbuf,
            watch: PeerWatch::new(&node, ch, Side::Server),
            full_streak: 0,
            drops_unpublished: 0,
        })
    }

    /// Receives the next datagram from any peer without waiting: what fitted `buf`, its full
    /// length and its sender. `peek` leaves it queued (`MSG_PEEK`).
    pub fn try_recv(
        &self,
        buf: &mut [u8],
        peek: bool,
    ) -> Result<Option<(RecvInfo, SocketAddr)>, Error> {
        self.try_recv_from(buf, peek, None)
    }

    /// [`DatagramSocket::try_recv`] for a connected socket: only datagrams from `only` are
    /// received; those from others are dropped on the way (the kernel drops them too).
    pub fn try_recv_from(
        &self,
        buf: &mut [u8],
        peek: bool,
        only: Option<SocketAddr>,
    ) -> Result<Option<(RecvInfo, SocketAddr)>, Error> {
        let got = self.each_pair(|st, i| {
            let pair = &mut st.pairs[i];
            if only.is_some_and(|o| o != pair.peer) {
                while pair.ends.rx.recv(&mut [])?.is_some() {}
                return Ok(None);
            }
            let got = match peek {
                true => pair.ends.rx.peek(buf)?,
                false => pair.ends.rx.recv(buf)?,
            };
            let peer = pair.peer;
            if got.is_some() && !peek {
                // The next call starts at the next pair: no peer starves the others.
                st.next = (i + 1) % st.pairs.len();
            }
            Ok(got.map(|info| (info, peer)))
        })?;
        if got.is_none() && !self.idle() {
            self.sweep(&mut self.state());
        }
        Ok(got)
    }

    /// The length of the next datagram (`FIONREAD` on a UDP socket), if one is queued.
    pub fn next_len(&self) -> Result<Option<u64>, Error> {
        self.each_pair(|st, i| Ok(st.pairs[i].ends.rx.peek_len()?))
    }

    /// `f` on each pair (by index), round robin from the next one's turn, under the lock and
    /// after taking new offers, until it finds something; nothing at all when [`Self::idle`].
    fn each_pair<T>(
        &self,
        mut f: impl FnMut(&mut State, usize) -> Result<Option<T>, Error>,
    ) -> Result<Option<T>, Error> {
        if self.idle() {
            return Ok(None);
        }
        let mut st = self.state();
        self.take_offers(&mut st);
        self.collect_returns(&mut st);
        let n = st.pairs.len();
        for k in 0..n {
            let i = (st.next + k) % n;
            if let Some(v) = f(&mut st, i)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// Drops pairs whose peer is gone and whose ring holds nothing more (at most every
    /// [`SWEEP_EVERY`]: each look reads the channel's slot).
    fn sweep(&self, st: &mut State) {
        if st.swept.is_some_and(|t| t.elapsed() < SWEEP_EVERY) {
            return;
        }
        st.swept = Some(Instant::now());
        let mut i = 0;
        while i < st.pairs.len() {
            let p = &mut st.pairs[i];
            let empty = matches!(p.ends.rx.peek_len(), Ok(None) | Err(_));
            if empty && (p.watch.lost() || p.ends.tx.reader_closed()) {
                self.take_back_from(st, i);
                let p = remove_pair(st, i);
                self.count_pairs(st);
                tracing::debug!(ch = ?p.ch, peer = %p.peer, "datagram pair closed: peer gone");
                p.release(self.reg(), self.waker);
            } else {
                i += 1;
            }
        }
    }

    /// Receives the next datagram, waiting as the socket's blocking mode and read timeout
    /// say (`WouldBlock`, `TimedOut`).
    pub fn recv_from(&self, buf: &mut [u8]) -> Result<(RecvInfo, SocketAddr), Error> {
        if let Some(got) = self.try_recv(buf, false)? {
            return Ok(got);
        }
        if self.nonblocking.load(Relaxed) {
            return Err(Error::WouldBlock);
        }
        let timeout = *lock(&self.read_timeout);
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !self.wait_readable(left)? {
                return Err(Error::TimedOut);
            }
            if let Some(got) = self.try_recv(buf, false)? {
                return Ok(got);
            }
        }
    }

    /// Waits until a datagram is queued (true) or `timeout` passes (false; `None`: no limit):
    /// spin while that can pay, then sleep on our doorbell.
    pub fn wait_readable(&self, timeout: Option<Duration>) -> Result<bool, Error> {
        let mut ready = || self.next_len().map(|l| l.is_some());
        let policy = self.policy();
        let spin = policy.spin.min(timeout.unwrap_or(Duration::MAX));
        if self.spinner.try_spin(spin, &mut ready)? {
            return Ok(true);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = memloop_ring::wait::MIN_BACKOFF;
        loop {
            let old = self.bell.arm();
            if ready()? {
                self.bell.disarm();
                return Ok(true);
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => policy.max_sleep,
            };
            if left.is_zero() {
                self.bell.disarm();
                return Ok(false);
            }
            self.bell.sleep(old, &policy, left, &mut backoff);
            self.bell.disarm();
        }
    }

    fn policy(&self) -> WaitPolicy {
        let remote = self.state().remote_peer;
        let futex = !remote && self.node.region.futex_usable();
        WaitPolicy {
            mode: if futex {
                WakeMode::Futex
            } else {
                WakeMode::SleepPoll
            },
            max_sleep: Duration::from_millis(if futex { 100 } else { 5 }),
            ..WaitPolicy::default()
        }
    }

    /// Where a datagram to `dst` comes from, as the receiver sees it: our address, or for a
    /// wildcard bind the address the kernel's route picks (asked of the kernel once per
    /// destination address family and route by connecting a throw-away socket).
    fn source_for(&self, dst: SocketAddr) -> Result<SocketAddr, Error> {
        if !self.me.addr.ip().is_unspecified() {
            return Ok(self.me.addr);
        }
        let probe = match dst {
            SocketAddr::V4(_) => std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?,
            SocketAddr::V6(_) => std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?,
        };
        probe.connect(dst)?;
        let ip = canonical(probe.local_addr()?).ip();
        Ok(SocketAddr::new(ip, self.me.addr.port()))
    }

    /// The scope that owns `ip`: ours for loopback, else the one member scope advertising it.
    fn scope_of(&self, ip: IpAddr) -> Result<u64, Error> {
        if ip.is_loopback() {
            return own_scope(&self.node);
        }
        // The receiver answers by our address: it must find us.
        self.node.advertise();
        let mut owners: Vec<u64> = self
            .reg()
            .members()
            .into_iter()
            .filter(|m| m.addresses.iter().any(|a| a.to_canonical() == ip))
            .map(|m| m.identity.net_scope())
            .collect();
        owners.sort_unstable();
        owners.dedup();
        match owners[..] {
            [one] => Ok(one),
            _ => Err(Error::NoService(ip.to_string())),
        }
    }
}

impl Drop for DatagramSocket {
    fn drop(&mut self) {
        let reg = self.node.region.registry();
        let mut st = std::mem::take(&mut *lock(&self.state));
        self.free_withdrawn(&mut st);
        if st.retired {
            return; // (endpoint and pairs gone already)
        }
        // Offers not taken yet are taken and closed, so their senders see the close at once.
        st.offers_seen = None;
        self.take_offers(&mut st);
        if let Err(e) = reg.remove_endpoint(self.ep) {
            tracing::debug!("removing a datagram endpoint: {e}");
        }
        for p in st.pairs {
            p.release(reg, self.waker);
        }
    }
}

/// The member that owns the socket bound at `at` (exactly, or on its family's wildcard).
pub fn member_socket_owner(
    reg: &memloop_registry::Registry,
    at: ScopedAddr,
) -> Option<memloop_registry::MemberId> {
    find_endpoint(reg, at).map(|e| e.owner)
}

/// Removes pair `i`, keeping the send map's indices right.
fn remove_pair(st: &mut State, i: usize) -> Pair {
    let p = st.pairs.swap_remove(i);
    let moved = st.pairs.len(); // the old index of the pair now at `i`
    st.send_on.retain(|_, v| *v != i);
    for v in st.send_on.values_mut() {
        if *v == moved {
            *v = i;
        }
    }
    // Another pair to the same peer (both sent first at once) takes over its sending.
    if let Some(j) = st.pairs.iter().position(|q| q.peer == p.peer) {
        st.send_on.entry(p.peer).or_insert(j);
    }
    st.next = 0;
    p
}

/// The endpoint of the socket bound at `at`: exactly there, or on its family's wildcard.
fn find_endpoint(
    reg: &memloop_registry::Registry,
    at: ScopedAddr,
) -> Option<memloop_registry::EndpointInfo> {
    let wild: &[IpAddr] = match at.addr.ip() {
        IpAddr::V4(_) => &[
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        ],
        IpAddr::V6(_) => &[IpAddr::V6(Ipv6Addr::UNSPECIFIED)],
    };
    std::iter::once(at.addr.ip())
        .chain(wild.iter().copied())
        .find_map(|ip| {
            let key = ScopedAddr {
                scope: at.scope,
                addr: SocketAddr::new(ip, at.addr.port()),
            };
            reg.lookup(&key.key())
        })
}

fn own_scope(n: &NodeInner) -> Result<u64, Error> {
    Ok(n.region.registry().member(n.id)?.identity.net_scope())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
