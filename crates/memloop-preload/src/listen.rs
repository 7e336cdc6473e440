//! Listening sockets: published in the registry so co-resident clients can find them.

use crate::agree::listener_key;
use crate::engine::Engine;
use crate::real;
use libc::c_int;
use memloop::registry::{EndpointId, EndpointKey, RegistryError};
use std::sync::Arc;

pub struct Listener {
    pub key: EndpointKey,
    /// Set when we registered the key ourselves (and must remove it on close).
    owned: Option<(Arc<Engine>, EndpointId)>,
    /// The process that registered it: a forked child closing its inherited copy must not
    /// unpublish the parent's listener.
    pid: u32,
}

impl Listener {
    /// Registers the listening socket `fd`. Another live listener on the same key (e.g.
    /// `SO_REUSEPORT` siblings) keeps its registration; offers are matched by tuple anyway.
    pub fn register(engine: &Arc<Engine>, fd: c_int) -> Option<Arc<Listener>> {
        let local = real::local_addr(fd)?;
        let key = listener_key(engine.scope, local);
        let reg = engine.registry();
        let owned = match reg.add_endpoint(engine.me(), &key) {
            Ok(id) => Some((engine.clone(), id)),
            Err(RegistryError::AddrInUse) => None,
            Err(e) => {
                tracing::debug!("listener {key} not published: {e}");
                return None;
            }
        };
        tracing::debug!("listening on {key}");
        Some(Arc::new(Listener {
            key,
            owned,
            pid: real::getpid(),
        }))
    }

    /// The endpoint id clients offer to (looked up each time: a sibling may have re-registered).
    pub fn endpoint(&self, engine: &Engine) -> Option<EndpointId> {
        engine.registry().lookup(&self.key).map(|e| e.id)
    }

    pub fn unregister(&self) {
        if self.pid != real::getpid() {
            return;
        }
        if let Some((engine, id)) = &self.owned {
            if let Err(e) = engine.registry().remove_endpoint(*id) {
                // Gone already (reclaimed, or a sibling re-registered the key): nothing to undo.
                tracing::debug!(?id, %e, "listener's endpoint not removed");
            }
        }
    }
}
