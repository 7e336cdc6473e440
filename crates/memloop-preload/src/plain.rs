//! A TCP connection that stays on the kernel path after memloop considered it: recorded in
//! the region so `memloop status` can show it with its reason and byte counts.

use crate::engine::Engine;
use memloop::registry::{ChannelId, ConnRecordId, ConnTuple, FallbackReason, Proto};
use memloop_shm::ShmU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

pub struct PlainTcp {
    engine: Arc<Engine>,
    record: Option<(ConnRecordId, ShmU64, ShmU64)>,
    /// The server's decline marker, freed when the connection closes.
    marker: Option<ChannelId>,
}

impl PlainTcp {
    /// Counts the fallback and records the connection (unrecorded if the table is full).
    pub fn record(
        engine: &Arc<Engine>,
        tuple: &ConnTuple,
        reason: FallbackReason,
        marker: Option<ChannelId>,
    ) -> Arc<PlainTcp> {
        let reg = engine.registry();
        let record = reg
            .record_conn(
                engine.me(),
                crate::real::getpid(),
                Proto::Tcp,
                tuple,
                reason,
            )
            .and_then(|id| match reg.conn_bytes(id) {
                Ok((s, r)) => Some((id, s, r)),
                Err(e) => {
                    // Recorded without byte counts: `memloop status` shows the connection.
                    tracing::debug!(?id, %e, "connection record without byte counters");
                    None
                }
            });
        Arc::new(PlainTcp {
            engine: engine.clone(),
            record,
            marker,
        })
    }

    pub fn unrecorded(engine: &Arc<Engine>, marker: Option<ChannelId>) -> Arc<PlainTcp> {
        Arc::new(PlainTcp {
            engine: engine.clone(),
            record: None,
            marker,
        })
    }

    pub fn count_sent(&self, n: isize) {
        if let (Some((_, s, _)), true) = (&self.record, n > 0) {
            s.fetch_add(n as u64, Relaxed);
        }
    }

    pub fn count_received(&self, n: isize) {
        if let (Some((_, _, r)), true) = (&self.record, n > 0) {
            r.fetch_add(n as u64, Relaxed);
        }
    }
}

impl Drop for PlainTcp {
    fn drop(&mut self) {
        let reg = self.engine.registry();
        // Best effort in a destructor: a failure means the slot was reclaimed or reused.
        if let Some((id, _, _)) = self.record {
            if let Err(e) = reg.release_conn(id) {
                tracing::debug!(?id, %e, "connection record not released");
            }
        }
        if let Some(m) = self.marker {
            if let Err(e) = reg.free_marker(m, self.engine.me()) {
                tracing::debug!(?m, %e, "decline marker not freed");
            }
        }
    }
}
