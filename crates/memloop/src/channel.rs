//! The channel layer: what every transport does with a channel once the registry holds one
//! for it — attach its rings, watch the peer, release our side. The native [`crate::Stream`]
//! and the preload's transparent connections sit on it, and so will datagrams, pools, links
//! and block devices. Waiting (spin, then arm / re-check / sleep) is the other shared piece:
//! [`memloop_ring::wait`], whose handshake the loom models check.

use crate::error::Error;
use crate::node::Node;
use memloop_registry::{ChannelId, ChannelKind, ChannelState, MemberId, Registry, Side};
use memloop_ring::{RecordConsumer, RecordProducer, StreamConsumer, StreamProducer, WaitCell};
use memloop_shm::futex;
use memloop_shm::sync::{fence, Ordering::SeqCst};
use memloop_shm::{ShmSlice, ShmU32};

/// Our two ends of a byte-stream channel: the ring we write and the ring we read, plus their
/// views (readiness probes and byte totals read the headers without the ends' locks).
pub struct StreamEnds {
    pub tx: StreamProducer,
    pub rx: StreamConsumer,
    pub tx_view: ShmSlice,
    pub rx_view: ShmSlice,
}

impl StreamEnds {
    /// Attaches `side`'s ends of channel `ch`, which must be a byte-stream pair. The registry
    /// validates the channel's kind and where its rings lie; attaching validates each ring's
    /// header (kind, capacity, indices).
    pub fn attach(reg: &Registry, ch: ChannelId, side: Side) -> Result<StreamEnds, Error> {
        let rings = reg.rings_of(ch, ChannelKind::StreamPair)?;
        let (tx_view, rx_view) = match side {
            Side::Client => (rings.c2s, rings.s2c),
            Side::Server => (rings.s2c, rings.c2s),
        };
        Ok(StreamEnds {
            tx: StreamProducer::attach(tx_view.clone())?,
            rx: StreamConsumer::attach(rx_view.clone())?,
            tx_view,
            rx_view,
        })
    }
}

/// Our two ends of a datagram channel: the record ring we send on and the one we receive from.
pub struct RecordEnds {
    pub tx: RecordProducer,
    pub rx: RecordConsumer,
}

impl RecordEnds {
    /// Attaches `side`'s ends of channel `ch`, which must be a datagram pair (validated as
    /// [`StreamEnds::attach`] validates a stream pair).
    pub fn attach(reg: &Registry, ch: ChannelId, side: Side) -> Result<RecordEnds, Error> {
        Self::attach_kind(reg, ch, side, ChannelKind::DatagramPair)
    }

    /// The same for another kind of channel made of two record rings (a link).
    pub fn attach_kind(
        reg: &Registry,
        ch: ChannelId,
        side: Side,
        kind: ChannelKind,
    ) -> Result<RecordEnds, Error> {
        let rings = reg.rings_of(ch, kind)?;
        let (tx, rx) = match side {
            Side::Client => (rings.c2s, rings.s2c),
            Side::Server => (rings.s2c, rings.c2s),
        };
        Ok(RecordEnds {
            tx: RecordProducer::attach(tx)?,
            rx: RecordConsumer::attach(rx)?,
        })
    }
}

/// What one side of a channel can learn about the other: is it still there, did it close,
/// die or refuse the channel, does it run in our kernel.
#[derive(Clone)]
pub struct PeerWatch {
    node: Node,
    ch: ChannelId,
    side: Side,
}

impl PeerWatch {
    /// (Holding a side of a channel needs our heartbeat: [`Node::hold`].)
    pub fn new(node: &Node, ch: ChannelId, side: Side) -> Self {
        node.hold();
        PeerWatch {
            node: node.clone(),
            ch,
            side,
        }
    }

    pub fn node(&self) -> &Node {
        &self.node
    }

    pub fn channel(&self) -> ChannelId {
        self.ch
    }

    fn registry(&self) -> &Registry {
        self.node.region().registry()
    }

    /// The member on the other side (`None`: a server has not taken the offer yet, or the
    /// channel is unreadable).
    pub fn peer(&self) -> Option<MemberId> {
        let info = self.registry().channel(self.ch).ok()?;
        match self.side {
            Side::Client => info.server,
            Side::Server => Some(info.client),
        }
    }

    /// The peer is dead: someone reclaimed it (its side carries the dead bit), or its member
    /// is dead by `/proc` in our pid namespace or by its heartbeat (reclaimed on the spot). A
    /// channel without a peer yet is not; an unreadable one is. One read of the channel.
    pub fn dead(&self) -> bool {
        let Ok(info) = self.registry().channel(self.ch) else {
            return true;
        };
        let (peer, dead_bit) = match self.side {
            Side::Client => (info.server, info.server_dead),
            Side::Server => (Some(info.client), info.client_dead),
        };
        dead_bit || peer.is_some_and(|p| !self.node.peer_alive(p))
    }

    /// The peer closed its side, died, or refused the channel (a client's offer declined, a
    /// server's accepted offer cancelled). An unreadable channel counts as gone.
    pub fn gone(&self) -> bool {
        self.registry()
            .peer_gone(self.ch, self.side)
            .unwrap_or(true)
    }

    /// The peer can no longer take part: the channel was refused or is unreadable, or the
    /// peer is [`dead`](PeerWatch::dead). Unlike [`PeerWatch::gone`], a peer that merely closed
    /// its side is not lost (its rings say so, and what it sent is still read).
    pub fn lost(&self) -> bool {
        match self.registry().channel_state(self.ch) {
            Ok(ChannelState::Declined | ChannelState::Cancelled) | Err(_) => true,
            Ok(_) => self.dead(),
        }
    }

    /// Wakes the peer's heartbeat: its sweep takes the next step of a switch even while its
    /// program is in none of our calls (see [`crate::kick`]).
    pub fn kick(&self) {
        if let Some(p) = self.peer() {
            crate::kick(self.registry(), p);
        }
    }

    /// The peer runs in our kernel (futexes and kernel sockets reach it). Unknown → yes.
    pub fn same_kernel(&self) -> bool {
        self.peer().map_or(true, |p| self.node.same_kernel(p))
    }
}

/// After a request in channel `ch`'s switch word made by neither side (`memloop promote`,
/// `memloop demote`): both sides' heartbeats wake and act on it now.
pub fn kick_sides(reg: &Registry, ch: ChannelId) {
    if let Ok(info) = reg.channel(ch) {
        for m in [Some(info.client), info.server].into_iter().flatten() {
            crate::kick(reg, m);
        }
    }
}

/// A switch's bell (`SideWords::bell`, one per channel): rung after each step of a switch
/// (a leave published, a takeover done, ready, stopped), so that a side waiting for its
/// peer's next step sleeps instead of polling. Only a wake-up: waiters bound their sleeps.
pub fn ring_switch_bell(bell: &ShmU32) {
    futex::bump_and_wake(bell);
}

/// The bell's value, read before looking at the condition a caller then waits for.
pub fn switch_bell_value(bell: &ShmU32) -> u32 {
    let v = bell.load(SeqCst);
    fence(SeqCst); // the caller's look at its condition comes after
    v
}

/// Sleeps until the bell moves off `seen` (any step of the switch), at most `timeout`.
pub fn wait_switch_bell(bell: &ShmU32, seen: u32, timeout: std::time::Duration) {
    futex::wait(bell, seen, timeout);
}

/// Offers a channel of `kind` (rings of `capacity` bytes) to the native service `service`,
/// and rings its listener's doorbell: the channel and the listener's member. A full region
/// is retried once after reclaiming the dead.
pub(crate) fn offer_to_service(
    n: &crate::node::NodeInner,
    service: &str,
    kind: ChannelKind,
    capacity: u64,
) -> Result<(ChannelId, MemberId), Error> {
    let reg = n.region.registry();
    let key = memloop_registry::EndpointKey::Native(service.to_string());
    let ep = reg
        .lookup(&key)
        .ok_or_else(|| Error::NoService(service.into()))?;
    if !n.check_peer(ep.owner) {
        return Err(Error::NoService(service.into()));
    }
    let ch = match reg.offer_kind(n.id, ep.id, kind, capacity, None) {
        Err(memloop_registry::RegistryError::RegionFull { .. }) if n.reclaim_dead() > 0 => {
            reg.offer_kind(n.id, ep.id, kind, capacity, None)?
        }
        other => other?,
    };
    // Tells a listener sleeping in `accept` that an offer is waiting.
    endpoint_bell(reg, ep.id)?.notify();
    Ok((ch, ep.owner))
}

/// Releases our side of a channel; its ring memory is freed once both sides let go. An
/// error only means the slot changed under us (reclaimed, or a buggy peer): it is logged.
pub fn release(reg: &Registry, ch: ChannelId, side: Side) {
    if let Err(e) = reg.close(ch, side) {
        tracing::debug!(?ch, ?side, "releasing a channel side: {e}");
    }
}

/// A listener's doorbell in the registry: the endpoint's sequence word and waiting flag,
/// driven by the same handshake as a ring end's ([`WaitCell`]).
pub(crate) fn endpoint_bell(
    reg: &Registry,
    ep: memloop_registry::EndpointId,
) -> Result<WaitCell, Error> {
    let (seq, waiting) = reg.endpoint_doorbell(ep)?;
    Ok(WaitCell::new(waiting, seq))
}
