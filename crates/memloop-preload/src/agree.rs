//! The connection agreement (BRIEF §3): the client finds a co-resident listener in the registry
//! and offers a channel keyed by the real connection's 4-tuple; the server, at accept, takes
//! the offer with the same tuple or publishes a decline marker. Either way both ends reach the
//! same decision before a byte of application data moves.

use crate::conn::{Conn, ConnParts, Path};
use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::late::Late;
use crate::plain::PlainTcp;
use crate::real;
use libc::c_int;
use memloop::channel::{self, PeerWatch};
use memloop::registry::{
    ChannelId, ConnTuple, EndpointId, EndpointInfo, EndpointKey, FallbackReason, Proto,
    RegistryError, Side,
};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The address as both ends compare it: IPv4-mapped IPv6 as IPv4, no flow info or scope.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Who owns an address: its network scope, and whether that is in another kernel.
#[derive(Clone, Copy)]
struct Owner {
    scope: u64,
    other_kernel: bool,
}

/// The network scope (namespace of one kernel) that owns `ip`, from the members' advertised
/// addresses (one pass over the member table): ours for loopback; an address owned in two
/// scopes is ambiguous.
fn owner_of(engine: &Engine, ip: IpAddr) -> Result<Owner, FallbackReason> {
    if ip.is_loopback() {
        return Ok(Owner {
            scope: engine.scope,
            other_kernel: false,
        });
    }
    // A peer beyond loopback finds us by our addresses (a server checks its client's).
    engine.node.advertise();
    let epoch = engine.registry().membership_epoch();
    if let Some(known) = OWNERS.lock().known(epoch, ip) {
        return known;
    }
    let found = scan_owners(engine, ip);
    OWNERS.lock().remember(epoch, ip, found);
    found
}

/// Answers of [`owner_of`] while the region's membership epoch stands: a connect then reads
/// one header word instead of a thousand member slots.
struct OwnerCache {
    epoch: u64,
    known: Vec<(IpAddr, Result<Owner, FallbackReason>)>,
}

static OWNERS: ForkMutex<OwnerCache> = ForkMutex::new(OwnerCache {
    epoch: u64::MAX,
    known: Vec::new(),
});

impl OwnerCache {
    fn known(&self, epoch: u64, ip: IpAddr) -> Option<Result<Owner, FallbackReason>> {
        let hit = self.known.iter().find(|(a, _)| *a == ip);
        hit.filter(|_| self.epoch == epoch).map(|&(_, r)| r)
    }

    fn remember(&mut self, epoch: u64, ip: IpAddr, r: Result<Owner, FallbackReason>) {
        if self.epoch != epoch || self.known.len() >= 256 {
            self.known.clear();
            self.epoch = epoch;
        }
        self.known.push((ip, r));
    }
}

/// [`owner_of`] from the member table itself.
fn scan_owners(engine: &Engine, ip: IpAddr) -> Result<Owner, FallbackReason> {
    let owners: BTreeSet<(u64, bool)> = engine
        .registry()
        .members()
        .into_iter()
        .filter(|m| m.addresses.iter().any(|a| a.to_canonical() == ip))
        .map(|m| (m.identity.net_scope(), m.identity.boot_id != engine.boot_id))
        .collect();
    match owners.len() {
        0 => Err(FallbackReason::NotMember),
        1 => {
            let (scope, other_kernel) = *owners.first().unwrap_or(&(0, false));
            Ok(Owner {
                scope,
                other_kernel,
            })
        }
        _ => Err(FallbackReason::Ambiguous),
    }
}

/// The network scope that owns `ip` (see [`owner_of`]), for keys of other protocols.
pub(crate) fn scope_of(engine: &Engine, ip: IpAddr) -> Result<u64, FallbackReason> {
    owner_of(engine, ip.to_canonical()).map(|o| o.scope)
}

pub fn listener_key(scope: u64, addr: SocketAddr) -> EndpointKey {
    let addr = canonical(addr);
    EndpointKey::Socket {
        proto: Proto::Tcp,
        scope,
        addr: addr.ip(),
        port: addr.port(),
    }
}

/// The co-resident listener for `dst`, if one is registered.
pub fn find_listener(engine: &Engine, dst: SocketAddr) -> Result<EndpointInfo, FallbackReason> {
    let dst = canonical(dst);
    let scope = owner_of(engine, dst.ip())?.scope;
    let wild: &[IpAddr] = match dst.ip() {
        IpAddr::V4(_) => &[
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        ],
        IpAddr::V6(_) => &[IpAddr::V6(Ipv6Addr::UNSPECIFIED)],
    };
    std::iter::once(dst.ip())
        .chain(wild.iter().copied())
        .find_map(|ip| {
            engine
                .registry()
                .lookup(&listener_key(scope, SocketAddr::new(ip, dst.port())))
        })
        .ok_or(FallbackReason::NoListener)
}

/// Keeps a registry result's value; an error is logged (with what we were doing) and dropped:
/// the callers go on without it (no marker, no hint), which only costs a ring, never a byte.
fn logged<T>(what: &str, r: Result<T, RegistryError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::debug!("{what}: {e}");
            None
        }
    }
}

/// Client side, right after the real `connect` started or finished: offer a channel for this
/// 4-tuple. `Err` means plain TCP (the reason is already counted by the caller).
pub fn client_offer(
    engine: &Arc<Engine>,
    ep: &EndpointInfo,
    fd: c_int,
    dst: SocketAddr,
) -> Result<Arc<Conn>, FallbackReason> {
    let local = real::local_addr(fd).ok_or(FallbackReason::Error)?;
    let tuple = ConnTuple {
        client: canonical(local),
        server: canonical(dst),
    };
    let reg = engine.registry();
    let offer = || reg.offer(engine.me(), ep.id, engine.cfg.ring_capacity, Some(tuple));
    // A full region may be full of dead members' rings: reclaimed at once, as the native
    // API does (the heartbeats' sweeps come up to a second later).
    let ch = match offer() {
        Err(RegistryError::RegionFull { .. }) if engine.node.reclaim_dead() > 0 => offer(),
        r => r,
    }
    .map_err(|e| {
        tracing::debug!("cannot offer a channel: {e}");
        FallbackReason::from_registry(&e)
    })?;
    let marked = reg
        .markers_for_client(tuple.client)
        .iter()
        .any(|(_, t)| t.server == tuple.server);
    let mut path = Path::Pending;
    if marked {
        if reg.cancel(ch, engine.me()).is_ok() {
            return Err(FallbackReason::NoOffer);
        }
        path = Path::Ring; // the server accepted just before our cancel
    }
    let conn = Conn::new(ConnParts {
        engine: engine.clone(),
        ch,
        side: Side::Client,
        tuple,
        fd,
        path,
        same_kernel: engine.node.same_kernel(ep.owner),
        decide_wait: if ep.owner == engine.me() {
            engine.cfg.decide_wait_self
        } else {
            engine.cfg.decide_wait
        },
    });
    if conn.is_err() {
        logged("withdrawing the offer", reg.cancel(ch, engine.me()));
    }
    conn
}

/// What a server makes of a freshly accepted connection.
pub enum Accepted {
    Ring(Arc<Conn>),
    /// Kernel path, with the marker to free when the connection closes.
    Plain(FallbackReason, Option<ChannelId>),
}

/// The 4-tuple of an accepted connection as the server sees it (none if the kernel cannot
/// name both ends: the connection is already gone, and stays on TCP to report it).
fn accepted_tuple(fd: c_int) -> Option<ConnTuple> {
    let t = (|| {
        Some(ConnTuple {
            client: canonical(real::peer_addr(fd)?),
            server: canonical(real::local_addr(fd)?),
        })
    })();
    if t.is_none() {
        tracing::debug!(fd, "accepted connection without addresses: stays on TCP");
    }
    t
}

/// Server side, when this process cannot use rings (it waits in ways memloop cannot see), or
/// the region takes none now (paused): a decline marker for the connection's tuple, and a
/// decline of an offer already made, so the client settles on TCP at once.
pub fn server_refuse(
    engine: &Arc<Engine>,
    ep: EndpointId,
    fd: c_int,
    reason: FallbackReason,
) -> Accepted {
    let Some(tuple) = accepted_tuple(fd) else {
        return Accepted::Plain(FallbackReason::Error, None);
    };
    let reg = engine.registry();
    let marker = logged(
        "publishing a decline marker",
        reg.mark_declined(engine.me(), ep, &tuple),
    );
    if let Some(ch) = reg.find_offer_by_tuple(ep, &tuple) {
        logged("declining an offer", reg.decline(ch));
    }
    Accepted::Plain(reason, marker)
}

/// Server side, right after the real `accept`.
pub fn server_accept(engine: &Arc<Engine>, ep: EndpointId, fd: c_int) -> Accepted {
    let Some(tuple) = accepted_tuple(fd) else {
        return Accepted::Plain(FallbackReason::Error, None);
    };
    let peer = tuple.client;
    // Only a member can be behind the peer's address; one in another kernel (an emulated VM
    // especially) may take milliseconds from its connect returning to its offer, so wait
    // longer for it while it has announced a connect.
    let Ok(owner) = owner_of(engine, peer.ip()) else {
        return Accepted::Plain(FallbackReason::NotMember, None);
    };
    // (Never below the short wait: raising that, as the tests do, lengthens both.)
    let wait_max = if owner.other_kernel {
        engine.cfg.server_wait_vm
    } else {
        engine.cfg.server_wait_max
    }
    .max(engine.cfg.server_wait);
    let reg = engine.registry();
    let connecting = logged(
        "the endpoint's connecting word",
        reg.endpoint_connecting(ep),
    );
    let start = Instant::now();
    let (found, announced) = loop {
        // A member client announces its connect on the endpoint before the real connect and
        // withdraws only once its offer and its marker scan are done. So nobody announced
        // *before* a look that finds no offer means the peer is no member, and a non-member's
        // connection does not wait (read after the look, the word may have dropped with an
        // offer made since). Only when the word cannot be read does the short wait stand in
        // for it. While some client is announced, wait for its offer (it may just be
        // descheduled), up to the long bound.
        let announced = connecting.as_ref().map(|w| w.load(SeqCst) > 0);
        if let Some(ch) = reg.find_offer_by_tuple(ep, &tuple) {
            break (Some(ch), announced);
        }
        let waited = start.elapsed();
        let waiting = announced.unwrap_or(waited < engine.cfg.server_wait);
        if !waiting || waited >= wait_max {
            break (None, announced);
        }
        std::thread::yield_now();
    };
    // Nobody announced, no offer, and no member client anywhere may look for a marker: the
    // client runs without the library (a client that withdrew its announcement or offer, or
    // connected where nobody listened, counted itself as looking first). No marker, no late
    // ring: nothing that could take either (a forking server then has none to hand around).
    if found.is_none() && announced == Some(false) && !reg.late_clients_looking() {
        return Accepted::Plain(FallbackReason::PeerNotPreloaded, None);
    }
    let mut marker = None;
    let late = found.is_none();
    let ch = match found {
        Some(ch) => Some(ch),
        None => {
            marker = logged(
                "publishing a decline marker",
                reg.mark_declined(engine.me(), ep, &tuple),
            );
            late_offer(engine, &tuple)
        }
    };
    let Some(ch) = ch else {
        return Accepted::Plain(FallbackReason::NoOffer, marker);
    };
    if reg.accept(ch, engine.me()).is_err() {
        return Accepted::Plain(FallbackReason::Cancelled, marker);
    }
    if let Some(m) = marker {
        logged(
            "freeing our decline marker",
            reg.free_marker(m, engine.me()),
        );
    }
    let conn = Conn::new(ConnParts {
        engine: engine.clone(),
        ch,
        side: Side::Server,
        tuple,
        fd,
        path: Path::Ring,
        same_kernel: PeerWatch::new(&engine.node, ch, Side::Server).same_kernel(),
        decide_wait: Duration::ZERO,
    });
    match conn {
        Ok(c) => {
            reg.bump_counter(memloop::registry::COUNTER_RING_CONNS);
            c.wake_after_accept(late);
            Accepted::Ring(c)
        }
        Err(r) => {
            channel::release(reg, ch, Side::Server);
            Accepted::Plain(r, None)
        }
    }
}

/// After publishing a marker: an offer for exactly this tuple that arrived late is taken;
/// offers from the same client address for a different server address mean the client
/// connected somewhere else than where it landed (NAT, port mapping) and are declined.
fn late_offer(engine: &Engine, tuple: &ConnTuple) -> Option<ChannelId> {
    let reg = engine.registry();
    let mut exact = None;
    for (ch, t) in reg.offers_from_client(tuple.client) {
        if t.server == tuple.server {
            exact = Some(ch);
        } else {
            tracing::debug!(?t, ?tuple, "offer for another address: declined (NAT?)");
            logged("declining an offer", reg.decline(ch));
            reg.count_fallback(FallbackReason::TupleMismatch);
        }
    }
    exact
}

/// Records a connection that stays on TCP, for `memloop status` (and holds the server's
/// decline marker until the connection closes).
/// `server`: the listener's endpoint when this is the server's side. A reason that may pass
/// arms the connection for a late ring (`crate::late`).
pub fn record_plain(
    engine: &Arc<Engine>,
    fd: c_int,
    reason: FallbackReason,
    server: Option<EndpointId>,
    marker: Option<ChannelId>,
) -> Arc<PlainTcp> {
    let (Some(local), Some(peer)) = (real::local_addr(fd), real::peer_addr(fd)) else {
        engine.registry().count_fallback(reason);
        return PlainTcp::unrecorded(engine, marker);
    };
    let (client, server_addr) = match server {
        Some(_) => (peer, local),
        None => (local, peer),
    };
    let tuple = ConnTuple {
        client: canonical(client),
        server: canonical(server_addr),
    };
    let late = match server {
        Some(ep) => Late::server(engine, tuple, reason, ep, marker),
        // (Still announced on the endpoint: the server sees this client until it counts.)
        None => Late::client(engine, tuple, reason, None),
    };
    // An armed server's marker is its late ring's to hold (`late/marker.rs`).
    let marker = marker.filter(|_| late.is_none() || server.is_none());
    PlainTcp::record(engine, &tuple, reason, marker, late)
}
