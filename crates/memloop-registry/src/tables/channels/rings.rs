//! Where a channel's rings lie: read from the slot, checked against the channel's kind, the
//! heap bounds, each other (no overlap) and the segments tagged as the channel's, then the
//! ring headers' kinds.

use super::*;

impl Registry {
    /// Views of the two rings of a stream-pair channel (see [`Registry::rings_of`]).
    pub fn rings(&self, ch: ChannelId) -> Result<ChannelRings, RegistryError> {
        self.rings_of(ch, ChannelKind::StreamPair)
    }

    /// Views of the two rings of a channel the caller expects to be of `kind`, validated: the
    /// slot's kind must be `kind` (`ChannelKindMismatch`, or `UnknownChannelKind` for a code
    /// this build does not know), the rings must lie in the heap, apart, in this channel's
    /// segments, and each ring header must carry the ring kind `kind` implies.
    pub fn rings_of(
        &self,
        ch: ChannelId,
        kind: ChannelKind,
    ) -> Result<ChannelRings, RegistryError> {
        let (slot, w) = self.channel_entry(ch)?;
        if !matches!(c_phase(w), C_OFFERED | C_ACCEPTED) {
            return Err(RegistryError::wrong(
                "OFFERED or ACCEPTED",
                phase_name(c_phase(w)),
            ));
        }
        let (code, cap, c2s, s2c) = (
            slot.kind_code()?,
            slot.capacity()?,
            slot.c2s()?,
            slot.s2c()?,
        );
        fence(Acquire);
        if slot.word()?.gen() != ch.gen {
            return Err(RegistryError::Stale);
        }
        let found = ChannelKind::from_code(code)?;
        if found != kind {
            return Err(RegistryError::ChannelKindMismatch {
                expected: kind,
                found,
            });
        }
        kind.require_supported()?;
        let len = self.ring_len(cap)?;
        self.check_ring_place(ch, c2s, s2c, len)?;
        let rings = ChannelRings {
            c2s: self.heap_view(c2s, len)?,
            s2c: self.heap_view(s2c, len)?,
        };
        let (k1, k2) = kind.ring_kinds();
        for (ring, view, expected) in [("c2s", &rings.c2s, k1), ("s2c", &rings.s2c, k2)] {
            let found = memloop_ring::header::kind_code(view)?;
            if found != expected as u32 {
                return Err(RegistryError::RingKindMismatch {
                    channel: kind,
                    ring,
                    expected,
                    found,
                });
            }
        }
        Ok(rings)
    }

    /// The two rings of a channel must not overlap and must lie in memory tagged as this
    /// channel's: a peer's bad entry could otherwise make two channels (or two directions)
    /// share bytes.
    pub(super) fn check_ring_place(
        &self,
        ch: ChannelId,
        c2s: u64,
        s2c: u64,
        len: u64,
    ) -> Result<(), RegistryError> {
        let apart = c2s.abs_diff(s2c) >= len;
        if !apart {
            return Err(RegistryError::corrupt(
                "channel rings",
                format!("the rings at {c2s} and {s2c} overlap ({len} bytes each)"),
            ));
        }
        for off in [c2s, s2c] {
            if !self.range_owned_by(ch, off, len) {
                return Err(RegistryError::corrupt(
                    "channel rings",
                    format!("the ring at {off} lies outside this channel's ring memory"),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn ring_len(&self, cap: u64) -> Result<u64, RegistryError> {
        if !cap.is_power_of_two() || cap < MIN_RING || cap > self.layout.heap_end() {
            return Err(RegistryError::corrupt(
                "channel ring capacity",
                cap.to_string(),
            ));
        }
        Ok(ring_bytes(cap))
    }

    pub(super) fn heap_view(&self, off: u64, len: u64) -> Result<ShmSlice, RegistryError> {
        match off.checked_add(len) {
            Some(end)
                if off >= self.layout.heap_off
                    && end <= self.layout.heap_end()
                    && off % 64 == 0 =>
            {
                Ok(self.view.slice(off, len)?)
            }
            _ => Err(RegistryError::corrupt(
                "channel ring offset",
                format!("{off:#x}+{len:#x}"),
            )),
        }
    }

    /// Bytes a channel's rings have carried, both directions (each ring's tail counts every
    /// byte ever published). Statistics only: an unreadable ring counts as 0.
    pub(super) fn bytes_carried(&self, slot: &ChannelSlot<'_>) -> u64 {
        let tail = |off: u64, cap: u64| -> Option<u64> {
            let view = self.heap_view(off, self.ring_len(cap).ok()?).ok()?;
            memloop_ring::header::totals(&view).map(|(tail, _)| tail)
        };
        let (Ok(cap), Ok(c2s), Ok(s2c)) = (slot.capacity(), slot.c2s(), slot.s2c()) else {
            return 0;
        };
        let c = tail(c2s, cap).unwrap_or(0);
        c.saturating_add(tail(s2c, cap).unwrap_or(0))
    }

    /// Bytes carried by the rings of every channel still allocated (see
    /// [`Registry::bytes_carried`]): with the ring-bytes counter, which counts freed channels,
    /// the total the region has carried, current while connections live.
    pub fn live_ring_bytes(&self) -> u64 {
        (0..self.layout.params.max_channels)
            .filter_map(|idx| {
                let slot = self.channel_slot(idx).ok()?;
                let w = slot.word().ok()?;
                let live = !is_marker(w) && c_phase(w) != C_FREE;
                live.then(|| self.bytes_carried(&slot))
            })
            .fold(0u64, u64::saturating_add)
    }
}
