//! Accepting native channels offered to a named service.

use crate::error::Error;
use crate::node::{Node, NodeInner};
use crate::stream::Stream;
use memloop_registry::{EndpointId, EndpointKey, RegistryError, Side};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest sleep in `accept` between checks (a doorbell normally wakes us earlier).
const ACCEPT_SLICE: Duration = Duration::from_millis(100);
/// Polling bounds for an accept where futexes do not work (a device-backed region in a VM).
const MIN_POLL: Duration = Duration::from_micros(50);
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
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = MIN_POLL;
        loop {
            if let Some(s) = self.try_accept()? {
                return Ok(s);
            }
            if self.nonblocking {
                return Err(Error::WouldBlock);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::TimedOut);
            }
            if self.node.region.futex_usable() {
                self.sleep_on_doorbell(deadline)?;
            } else {
                // No futex on a device mapping: poll, backing off to a few ms between looks.
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_POLL);
            }
        }
    }

    fn try_accept(&self) -> Result<Option<Stream>, Error> {
        let reg = self.node.region.registry();
        while let Some(ch) = reg.take_offer(self.ep, self.node.id)? {
            let client = reg.channel(ch)?.client;
            // A dead client's offer: reclaim it and look for the next.
            if !self.node.check_peer(client) {
                let _ = reg.close(ch, Side::Server);
                continue;
            }
            return Ok(Some(Stream::attach(
                self.node.clone(),
                ch,
                Side::Server,
                client,
            )?));
        }
        Ok(None)
    }

    /// Arms the endpoint's "waiting" flag, re-checks for offers, then sleeps on the doorbell.
    fn sleep_on_doorbell(&self, deadline: Option<Instant>) -> Result<(), Error> {
        let (seq, waiting) = self.node.region.registry().endpoint_doorbell(self.ep)?;
        let seen = seq.load(Ordering::SeqCst);
        waiting.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.has_offer() {
            waiting.store(0, Ordering::SeqCst);
            return Ok(());
        }
        let mut slice = ACCEPT_SLICE;
        if let Some(d) = deadline {
            slice = slice.min(d.saturating_duration_since(Instant::now()));
        }
        memloop_shm::futex::wait(&seq, seen, slice);
        waiting.store(0, Ordering::SeqCst);
        Ok(())
    }

    fn has_offer(&self) -> bool {
        let reg = self.node.region.registry();
        reg.channels()
            .iter()
            .any(|c| c.endpoint == self.ep && c.state == memloop_registry::ChannelState::Offered)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let reg = self.node.region.registry();
        let _ = reg.remove_endpoint(self.ep);
        // Offers nobody will accept: close them so their clients see the end of the stream.
        while let Ok(Some(ch)) = reg.take_offer(self.ep, self.node.id) {
            let _ = reg.close(ch, Side::Server);
        }
    }
}
