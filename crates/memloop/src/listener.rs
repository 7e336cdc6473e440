//! Accepting native channels offered to a named service.

use crate::channel;
use crate::error::Error;
use crate::node::{Node, NodeInner};
use crate::stream::Stream;
use memloop_registry::{
    ChannelId, ChannelKind, EndpointId, EndpointKey, MemberId, RegistryError, Side,
};
use memloop_ring::wait::MIN_BACKOFF;
use memloop_ring::{WaitPolicy, WakeMode};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest sleep in `accept` between checks (a doorbell normally wakes us earlier).
const ACCEPT_SLICE: Duration = Duration::from_millis(100);
/// Longest polling sleep in an accept where futexes do not work (a device-backed region in a VM).
const MAX_POLL: Duration = Duration::from_millis(5);

pub struct Listener {
    node: Arc<NodeInner>,
    ep: EndpointId,
    name: String,
    nonblocking: bool,
}

impl Listener {
    /// Binds `name`; if another member holds it but is dead, reclaims it and binds.
    pub fn bind(node: &Node, name: &str) -> Result<Listener, Error> {
        let n = &node.inner;
        let reg = n.region.registry();
        let key = EndpointKey::Native(name.to_string());
        let ep = match reg.add_endpoint(n.id, &key) {
            Err(RegistryError::AddrInUse) => {
                let holder = reg.lookup(&key).map(|e| e.owner);
                if holder.is_some_and(|h| n.check_peer(h)) {
                    return Err(Error::AddrInUse(name.into()));
                }
                reg.add_endpoint(n.id, &key)?
            }
            Err(RegistryError::RegionFull { .. }) if n.reclaim_dead() > 0 => {
                reg.add_endpoint(n.id, &key)?
            }
            other => other?,
        };
        Ok(Listener {
            node: n.clone(),
            ep,
            name: name.into(),
            nonblocking: false,
        })
    }

    pub(crate) fn node(&self) -> &Arc<NodeInner> {
        &self.node
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn set_nonblocking(&mut self, on: bool) {
        self.nonblocking = on;
    }

    /// Accepts the oldest pending offer, waiting for one unless non-blocking.
    pub fn accept(&self) -> Result<Stream, Error> {
        self.accept_timeout(None)
    }

    pub fn accept_timeout(&self, timeout: Option<Duration>) -> Result<Stream, Error> {
        let (ch, client) = self.accept_channel(ChannelKind::StreamPair, timeout)?;
        Stream::attach(self.node.clone(), ch, Side::Server, client)
    }

    /// Takes the oldest pending offer of a channel of `kind` (others are declined), waiting
    /// for one unless non-blocking: the channel, accepted, and its client.
    pub(crate) fn accept_channel(
        &self,
        kind: ChannelKind,
        timeout: Option<Duration>,
    ) -> Result<(ChannelId, MemberId), Error> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = MIN_BACKOFF;
        loop {
            if let Some(taken) = self.try_take(kind)? {
                return Ok(taken);
            }
            if self.nonblocking {
                return Err(Error::WouldBlock);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::TimedOut);
            }
            self.sleep_on_doorbell(deadline, &mut backoff)?;
        }
    }

    fn try_take(&self, kind: ChannelKind) -> Result<Option<(ChannelId, MemberId)>, Error> {
        let reg = self.node.region.registry();
        while let Some(ch) = reg.take_offer_of(self.ep, self.node.id, Some(kind))? {
            let client = reg.channel(ch)?.client;
            // A dead client's offer: reclaim it and look for the next.
            if !self.node.check_peer(client) {
                channel::release(reg, ch, Side::Server);
                continue;
            }
            return Ok(Some((ch, client)));
        }
        Ok(None)
    }

    /// Arms the endpoint's doorbell, re-checks for offers, then sleeps until a connecting
    /// client rings it (a futex; without one — a device mapping in a VM — a polling sleep that
    /// backs off to a few ms).
    fn sleep_on_doorbell(
        &self,
        deadline: Option<Instant>,
        backoff: &mut Duration,
    ) -> Result<(), Error> {
        let bell = channel::endpoint_bell(self.node.region.registry(), self.ep)?;
        let policy = WaitPolicy {
            mode: if self.node.region.futex_usable() {
                WakeMode::Futex
            } else {
                WakeMode::SleepPoll
            },
            spin: Duration::ZERO,
            max_sleep: if self.node.region.futex_usable() {
                ACCEPT_SLICE
            } else {
                MAX_POLL
            },
        };
        let seen = bell.arm();
        if !self.has_offer() {
            let mut slice = ACCEPT_SLICE;
            if let Some(d) = deadline {
                slice = slice.min(d.saturating_duration_since(Instant::now()));
            }
            bell.sleep(seen, &policy, slice, backoff);
        }
        bell.disarm();
        Ok(())
    }

    fn has_offer(&self) -> bool {
        self.node.region.registry().has_native_offer(self.ep)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let reg = self.node.region.registry();
        if let Err(e) = reg.remove_endpoint(self.ep) {
            tracing::debug!(name = %self.name, "removing the endpoint: {e}");
        }
        // Offers nobody will accept: close them so their clients see the end of the stream.
        while let Ok(Some(ch)) = reg.take_offer(self.ep, self.node.id) {
            channel::release(reg, ch, Side::Server);
        }
    }
}
