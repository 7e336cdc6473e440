//! Links (MMNet): a point-to-point network link whose wire is a channel in the region.
//!
//! Each side owns a network device (a TUN device with the virtio-net header, in `memloop link`)
//! and moves whole frames — a 12-byte virtio-net header and an IP packet, up to a 64 KiB GSO
//! super-packet — through a [`ChannelKind::LinkPair`] channel: two record rings. The kernel
//! reads a frame from the device straight into the ring ([`LinkTx::pump_from_fd`]) and writes
//! it from the ring into the other device ([`LinkRx::drain_to_fd`]): one copy per side, no
//! segmentation or checksumming in between.
//!
//! The two sides are symmetric; who listens is decided at run time ([`Linker::establish`]):
//! the first side binds the link's service name and waits, the other offers it a channel. A
//! side that dies is noticed by the other through the channel's [`PeerWatch`]; a restarted
//! side simply establishes again — if the listener died, the survivor takes the name over.

mod frame;

pub use frame::{check_frame, BadFrame, FRAME_HEAD, MAX_FRAME, VNET_HDR_LEN};
/// The TUN device each side's service owns.
pub use memloop_shm::tun;

use crate::channel::{self, PeerWatch, RecordEnds};
use crate::error::Error;
use crate::listener::Listener;
use crate::node::Node;
use memloop_registry::{ChannelId, ChannelKind, ChannelState, MemberId, Side};
use memloop_ring::{RecordConsumer, RecordProducer, RingError, WaitPolicy};
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default ring size per direction: 32 super-packets in flight.
pub const DEFAULT_LINK_RING: u64 = 4 << 20;
/// A full ring is waited on this long before a frame is dropped, as a NIC drops on a full
/// ring: long enough to ride out a reader that was descheduled, short enough that a stuck
/// peer does not hold the device's queue.
pub const FULL_RING_GRACE: Duration = Duration::from_millis(2);

/// The native service name a link's listening side binds.
pub fn service_name(link: &str) -> String {
    format!("link/{link}")
}

/// Finds or becomes the other side of a link, again after each session ends.
pub struct Linker {
    node: Node,
    service: String,
    capacity: u64,
    listener: Option<Listener>,
}

impl Linker {
    pub fn new(node: &Node, link: &str, capacity: u64) -> Linker {
        Linker {
            node: node.clone(),
            service: service_name(link),
            capacity,
            listener: None,
        }
    }

    /// Whether this side holds the link's name (it waits; the other side offers).
    pub fn listening(&self) -> bool {
        self.listener.is_some()
    }

    /// Waits up to `timeout` for the other side: a session, or `None` if it did not come.
    pub fn establish(&mut self, timeout: Duration) -> Result<Option<(LinkTx, LinkRx)>, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.listener.is_none() {
                match Listener::bind(&self.node, &self.service) {
                    Ok(l) => self.listener = Some(l),
                    Err(Error::AddrInUse(_)) => {
                        if let Some(s) = self.offer(deadline)? {
                            return Ok(Some(s));
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            if let Some(l) = &self.listener {
                let left = deadline.saturating_duration_since(Instant::now());
                match l.accept_channel(ChannelKind::LinkPair, Some(left.min(ACCEPT_SLICE))) {
                    Ok((ch, peer)) => return self.session(ch, Side::Server, peer).map(Some),
                    Err(Error::TimedOut) => {}
                    Err(e) => return Err(e),
                }
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Offers a channel to the listening side and waits until it is accepted; `None` (offer
    /// withdrawn) if it was not by `deadline` or the listener vanished meanwhile.
    fn offer(&self, deadline: Instant) -> Result<Option<(LinkTx, LinkRx)>, Error> {
        let kind = ChannelKind::LinkPair;
        let (ch, peer) =
            match channel::offer_to_service(&self.node.inner, &self.service, kind, self.capacity) {
                Ok(x) => x,
                Err(Error::NoService(_)) => return Ok(None),
                Err(e) => return Err(e),
            };
        let reg = self.node.region().registry();
        loop {
            match reg.channel_state(ch)? {
                ChannelState::Accepted => return self.session(ch, Side::Client, peer).map(Some),
                ChannelState::Offered | ChannelState::Reserved
                    if Instant::now() < deadline && self.node.peer_alive(peer) =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                _ => {
                    channel::release(reg, ch, Side::Client);
                    return Ok(None);
                }
            }
        }
    }

    fn session(
        &self,
        ch: ChannelId,
        side: Side,
        peer: MemberId,
    ) -> Result<(LinkTx, LinkRx), Error> {
        let reg = self.node.region().registry();
        let ends = match RecordEnds::attach_kind(reg, ch, side, ChannelKind::LinkPair) {
            Ok(e) => e,
            Err(e) => {
                channel::release(reg, ch, side);
                return Err(e);
            }
        };
        let held = Arc::new(Held {
            watch: PeerWatch::new(&self.node, ch, side),
            side,
        });
        let policy = self.node.inner.wait_policy(peer);
        Ok((
            LinkTx {
                tx: ends.tx,
                held: held.clone(),
                policy,
            },
            LinkRx {
                rx: ends.rx,
                held,
                policy,
            },
        ))
    }
}

/// Longest accept wait between looks at the deadline.
const ACCEPT_SLICE: Duration = Duration::from_millis(100);

/// Our side of a session's channel, released when both halves are dropped.
struct Held {
    watch: PeerWatch,
    side: Side,
}

impl Drop for Held {
    fn drop(&mut self) {
        channel::release(
            self.watch.node().region().registry(),
            self.watch.channel(),
            self.side,
        );
    }
}

/// What one pump step did with a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pumped {
    /// A frame of this many bytes (virtio-net header included) went into the ring.
    Sent(u64),
    /// The ring stayed full: a frame of this many bytes was read and dropped.
    Dropped(u64),
    /// The device had nothing to read.
    Idle,
}

/// The sending half of a session: device → ring.
pub struct LinkTx {
    tx: RecordProducer,
    held: Arc<Held>,
    policy: WaitPolicy,
}

impl LinkTx {
    /// Moves one frame from the non-blocking device `fd` into the ring, read by the kernel
    /// straight into the ring. A ring that stays full for [`FULL_RING_GRACE`] makes the
    /// frame a drop (read into `scratch`, at least [`MAX_FRAME`] bytes, and discarded).
    /// `Err(BrokenPipe)` once the peer closed its side.
    pub fn pump_from_fd(
        &mut self,
        fd: BorrowedFd<'_>,
        scratch: &mut [u8],
    ) -> Result<Pumped, Error> {
        let r = match self.reserve()? {
            Some(r) => r,
            None => {
                return match read_fd(fd, scratch)? {
                    Some(n) => Ok(Pumped::Dropped(n as u64)),
                    None => Ok(Pumped::Idle),
                }
            }
        };
        match self.tx.data().read_from_fd(r.at, r.max, fd) {
            Ok(n) => {
                self.tx.commit(r, n as u64)?;
                Ok(Pumped::Sent(n as u64))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Pumped::Idle),
            Err(e) => Err(e.into()),
        }
    }

    fn reserve(&mut self) -> Result<Option<memloop_ring::Reservation>, Error> {
        match self.tx.reserve(MAX_FRAME as u64) {
            Ok(Some(r)) => return Ok(Some(r)),
            Ok(None) => {}
            Err(RingError::Closed) => return Err(Error::BrokenPipe),
            Err(e) => return Err(e.into()),
        }
        match self
            .tx
            .wait_writable(MAX_FRAME as u64, &self.policy, FULL_RING_GRACE)
        {
            Ok(_) => {}
            Err(RingError::Closed) => return Err(Error::BrokenPipe),
            Err(e) => return Err(e.into()),
        }
        match self.tx.reserve(MAX_FRAME as u64) {
            Err(RingError::Closed) => Err(Error::BrokenPipe),
            other => Ok(other?),
        }
    }

    /// The peer can no longer take part (it died, or the channel was refused).
    pub fn peer_lost(&self) -> bool {
        self.held.watch.lost()
    }

    /// Ends this half: the reader sees the end of the stream.
    pub fn shutdown(&mut self) {
        self.tx.shutdown();
    }
}

/// What [`LinkRx::drain_to_fd`] delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drained {
    pub packets: u64,
    pub bytes: u64,
    /// Frames refused: malformed by [`check_frame`], or refused by the device.
    pub bad: u64,
}

/// The receiving half of a session: ring → device.
pub struct LinkRx {
    rx: RecordConsumer,
    held: Arc<Held>,
    policy: WaitPolicy,
}

impl LinkRx {
    /// Writes every queued frame into the device `fd`, straight from the ring. A frame that
    /// fails [`check_frame`] or that the device refuses is dropped and counted, never
    /// delivered in part.
    pub fn drain_to_fd(&mut self, fd: BorrowedFd<'_>) -> Result<Drained, Error> {
        let mut d = Drained::default();
        let mut head = [0u8; FRAME_HEAD];
        while let Some((at, len)) = self.rx.peek_in_place()? {
            let n = (len as usize).min(FRAME_HEAD);
            self.rx.data().read(at, &mut head[..n])?;
            let delivered = match check_frame(&head[..n], len) {
                Ok(()) => self.rx.data().write_to_fd(at, len, fd),
                Err(bad) => Err(io::Error::new(io::ErrorKind::InvalidData, bad)),
            };
            match delivered {
                Ok(_) => {
                    d.packets += 1;
                    d.bytes += len;
                }
                Err(e) => {
                    tracing::debug!("link: frame of {len} bytes dropped: {e}");
                    d.bad += 1;
                }
            }
            self.rx.consume_peeked()?;
        }
        Ok(d)
    }

    /// Waits up to `slice` for a frame: `Ok(true)` when one is queued, `Ok(false)` on time
    /// out; `Err(PeerDead)` when the peer is lost, `Err(BrokenPipe)` when it shut down.
    pub fn wait(&mut self, slice: Duration) -> Result<bool, Error> {
        if self.rx.peek_len()?.is_some() {
            return Ok(true);
        }
        if self.rx.is_eof()? {
            return Err(Error::BrokenPipe);
        }
        if self.held.watch.lost() {
            return Err(Error::PeerDead);
        }
        self.rx.wait_readable(&self.policy, slice)?;
        Ok(self.rx.peek_len()?.is_some())
    }

    /// How long a wait spins before it sleeps (default: the adaptive window streams use).
    pub fn set_spin(&mut self, spin: Duration) {
        self.policy.spin = spin;
    }

    /// The member on the other side.
    pub fn peer(&self) -> Option<MemberId> {
        self.held.watch.peer()
    }

    /// Whether the peer runs in this kernel (else another VM on the same region).
    pub fn peer_same_kernel(&self) -> bool {
        self.held.watch.same_kernel()
    }

    /// Ends this half: the writer's next send fails, so its pump stops.
    pub fn close(&mut self) {
        self.rx.close();
    }
}

/// One read(2) from a non-blocking descriptor: `None` when it would block.
fn read_fd(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Option<usize>, Error> {
    loop {
        match rustix::io::read(fd, &mut *buf) {
            Ok(n) => return Ok(Some(n)),
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Ok(None),
            Err(e) => return Err(Error::Io(e.into())),
        }
    }
}
