//! Listening sockets: published in the registry so co-resident clients can find them. A
//! listener made while the library is dormant (no region yet) is published once the process
//! joins a region, at its next accept — so a server started before its region was created
//! takes rings for the connections that come after.

use crate::agree::listener_key;
use crate::engine::Engine;
use crate::forklock::ForkMutex;
use crate::real;
use libc::c_int;
use memloop::registry::{EndpointId, EndpointKey, RegistryError};
use std::sync::atomic::{AtomicU8, Ordering::*};

const DORMANT: u8 = 0;
const PUBLISHING: u8 = 1;
const PUBLISHED: u8 = 2;
use std::sync::Arc;

pub struct Listener {
    pub key: EndpointKey,
    /// Set when we registered the key ourselves (and must remove it on close).
    owned: ForkMutex<Option<(Arc<Engine>, EndpointId)>>,
    /// `DORMANT` until published (by us, or by a sibling on the same key); one thread
    /// publishes, the others go on without waiting.
    state: AtomicU8,
    /// The process that registered it: a forked child closing its inherited copy must not
    /// unpublish the parent's listener.
    pid: u32,
}

impl Listener {
    /// Registers the listening socket `fd`. Another live listener on the same key (e.g.
    /// `SO_REUSEPORT` siblings) keeps its registration; offers are matched by tuple anyway.
    pub fn register(engine: &Arc<Engine>, fd: c_int) -> Option<Arc<Listener>> {
        let l = Listener::dormant(engine.scope, fd)?;
        l.publish(engine).then_some(l)
    }

    /// The listening socket `fd`, known but not published (no region to publish it in yet).
    pub fn dormant(scope: u64, fd: c_int) -> Option<Arc<Listener>> {
        let local = real::local_addr(fd)?;
        Some(Arc::new(Listener {
            key: listener_key(scope, local),
            owned: ForkMutex::new(None),
            state: AtomicU8::new(DORMANT),
            pid: real::getpid(),
        }))
    }

    /// Publishes the key in `engine`'s region unless done already; false if it is not
    /// published (now, or by a thread doing it right now).
    pub fn publish(&self, engine: &Arc<Engine>) -> bool {
        // (A load first: every accept asks, and a failing CAS still writes the line — after
        // each fork of a forking server, a copy-on-write fault on this page.)
        if self.state.load(Acquire) == PUBLISHED {
            return true;
        }
        match self
            .state
            .compare_exchange(DORMANT, PUBLISHING, AcqRel, Acquire)
        {
            Ok(_) => {}
            Err(now) => return now == PUBLISHED,
        }
        engine.node.advertise();
        let reg = engine.registry();
        let mut added = reg.add_endpoint(engine.me(), &self.key);
        if matches!(added, Err(RegistryError::AddrInUse)) {
            // A live sibling's (fork, SO_REUSEPORT) — or a dead listener's not swept yet:
            // then it is reclaimed here, and the key is ours.
            let holder = reg.lookup(&self.key).map(|e| e.owner);
            if holder.is_some_and(|h| !engine.node.peer_alive(h)) {
                added = reg.add_endpoint(engine.me(), &self.key);
            }
        }
        let done = match added {
            Ok(id) => {
                *self.owned.lock() = Some((engine.clone(), id));
                true
            }
            Err(RegistryError::AddrInUse) => true,
            Err(e) => {
                tracing::debug!("listener {} not published: {e}", self.key);
                false
            }
        };
        if done {
            tracing::debug!("listening on {}", self.key);
        }
        self.state
            .store(if done { PUBLISHED } else { DORMANT }, Release);
        done
    }

    /// The endpoint id clients offer to (looked up each time: a sibling may have re-registered).
    pub fn endpoint(&self, engine: &Engine) -> Option<EndpointId> {
        engine.registry().lookup(&self.key).map(|e| e.id)
    }

    pub fn unregister(&self) {
        if self.pid != real::getpid() {
            return;
        }
        if let Some((engine, id)) = &*self.owned.lock() {
            if let Err(e) = engine.registry().remove_endpoint(*id) {
                // Gone already (reclaimed, or a sibling re-registered the key): nothing to undo.
                tracing::debug!(?id, %e, "listener's endpoint not removed");
            }
        }
    }
}
