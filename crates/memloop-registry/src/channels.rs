//! Channels: fixed slots, each driven by CAS on one state word.
//!
//! ```text
//! FREE ─client─▶ RESERVED ─rings ready─▶ OFFERED ─server─▶ ACCEPTED ─both closed/dead─▶ FREE(gen+1)
//!                    │                      ├─client timeout─▶ CANCELLED ─▶ FREE(gen+1)
//!                    └──────server says no──┴─▶ DECLINED ─client acknowledges─▶ FREE(gen+1)
//! FREE ─server─▶ RESERVED ─▶ DECLINED|MARKER ─server frees (or reclaim)─▶ FREE(gen+1)
//! ```
//! State word: `gen << 32 | client_tag << 8 | flags << 3 | phase` (flags: MARKER, then the
//! closed/dead bits; phase: 3 bits). The client's member tag is in the word from the moment of
//! reservation, so a reclaimer can find a dead client's half-built reservations. A decline
//! marker (see `markers.rs`) is a slot without rings that a server publishes for a connection
//! it found no offer for; its tag is the server's, so a dead server's markers are found the
//! same way. The other fields are written by the client while RESERVED and published by the
//! CAS to OFFERED; they are immutable until the slot is FREE again, and readers re-check the
//! state word after reading them. The server id has its own word, claimed by CAS *before* the
//! OFFERED → ACCEPTED transition so that a reclaimer can always find an accepted channel's server.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state · 8 server (packed member id, 0 = none) · 16 client · 24 endpoint |
//! | 32 | creation counter · 40 ring capacity · 48 c2s ring offset · 56 s2c ring offset |
//! | 64 | connection 4-tuple (40 B) |
//! | 104 | client side: holders u32 · lock u32 · 112 server side: holders u32 · lock u32 |
//!
//! The side words serve a channel shared by several processes after fork: `holders` counts the
//! processes that hold one side open, `lock` (0 or a pid) serialises them. They are written
//! only by the reserving client before the offer is published (1 holder per side, unlocked)
//! and never by a freer, whose late write could land on the slot's next occupant.

use crate::error::RegistryError;
use crate::header::{CHANNEL_BYTES, H_CREATE_SEQ};
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, unpack_id, ChannelId, ConnTuple, EndpointId,
    MemberId, TUPLE_BYTES,
};
use crate::Registry;
use memloop_ring::{init_ring, ring_bytes, RingKind};
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, SeqCst};
use memloop_shm::{ShmSlice, ShmU32};

pub(crate) const C_FREE: u64 = 0;
pub(crate) const C_RESERVED: u64 = 1;
pub(crate) const C_OFFERED: u64 = 2;
pub(crate) const C_ACCEPTED: u64 = 3;
pub(crate) const C_CANCELLED: u64 = 4;
pub(crate) const C_DECLINED: u64 = 5;
/// Flag of a decline marker (phase DECLINED, no rings).
pub(crate) const MARKER: u64 = 0x8;
const CLIENT_CLOSED: u64 = 0x10;
const SERVER_CLOSED: u64 = 0x20;
const CLIENT_DEAD: u64 = 0x40;
const SERVER_DEAD: u64 = 0x80;

pub(crate) const O_SERVER: u64 = 8;
pub(crate) const O_CLIENT: u64 = 16;
pub(crate) const O_EP: u64 = 24;
pub(crate) const O_CREATED: u64 = 32;
pub(crate) const O_CAP: u64 = 40;
pub(crate) const O_C2S: u64 = 48;
pub(crate) const O_S2C: u64 = 56;
pub(crate) const O_TUPLE: u64 = 64;
const O_SIDE_CLIENT: u64 = 104;
const O_SIDE_SERVER: u64 = 112;
const MIN_RING: u64 = 64;
/// Bound on CAS retries of one operation (only reachable under heavy contention or corruption).
const RETRIES: usize = 10_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelState {
    Reserved,
    Offered,
    Accepted,
    Cancelled,
    Declined,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Client,
    Server,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelInfo {
    pub id: ChannelId,
    pub state: ChannelState,
    pub client: MemberId,
    pub server: Option<MemberId>,
    pub endpoint: EndpointId,
    pub tuple: Option<ConnTuple>,
    pub client_closed: bool,
    pub server_closed: bool,
    pub client_dead: bool,
    pub server_dead: bool,
    pub ring_capacity: u64,
    /// A decline marker: `client` and `server` are both the server that published it.
    pub marker: bool,
}

/// The per-side words of a channel (see the module docs): processes holding this side open,
/// and a lock word (0 = free, else the pid of the holder).
#[derive(Clone)]
pub struct SideWords {
    pub holders: ShmU32,
    pub lock: ShmU32,
}

/// Views of the two stream rings of a channel, for `memloop_ring` attach.
#[derive(Clone)]
pub struct ChannelRings {
    pub c2s: ShmSlice,
    pub s2c: ShmSlice,
}

pub(crate) fn c_phase(w: u64) -> u64 {
    w & 0x7
}
pub(crate) fn is_marker(w: u64) -> bool {
    w & MARKER != 0
}
pub(crate) fn c_gen(w: u64) -> u32 {
    (w >> 32) as u32
}
pub(crate) fn c_client_tag(w: u64) -> u32 {
    ((w >> 8) & 0xff_ffff) as u32
}
pub(crate) fn c_word(gen: u32, client_tag: u32, flags: u64, phase: u64) -> u64 {
    ((gen as u64) << 32) | ((client_tag as u64 & 0xff_ffff) << 8) | (flags & 0xf8) | phase
}
pub(crate) fn with_phase(w: u64, phase: u64) -> u64 {
    (w & !0x7) | phase
}
fn side_bits(side: Side) -> (u64, u64) {
    match side {
        Side::Client => (CLIENT_CLOSED, CLIENT_DEAD),
        Side::Server => (SERVER_CLOSED, SERVER_DEAD),
    }
}
fn other(side: Side) -> Side {
    match side {
        Side::Client => Side::Server,
        Side::Server => Side::Client,
    }
}
fn gone(w: u64, side: Side) -> bool {
    let (c, d) = side_bits(side);
    w & (c | d) != 0
}

pub(crate) fn phase_name(p: u64) -> &'static str {
    match p {
        C_FREE => "FREE",
        C_RESERVED => "RESERVED",
        C_OFFERED => "OFFERED",
        C_ACCEPTED => "ACCEPTED",
        C_CANCELLED => "CANCELLED",
        C_DECLINED => "DECLINED",
        _ => "invalid",
    }
}

fn phase_state(p: u64) -> Option<ChannelState> {
    Some(match p {
        C_RESERVED => ChannelState::Reserved,
        C_OFFERED => ChannelState::Offered,
        C_ACCEPTED => ChannelState::Accepted,
        C_CANCELLED => ChannelState::Cancelled,
        C_DECLINED => ChannelState::Declined,
        _ => return None,
    })
}

impl Registry {
    pub(crate) fn channel_off(&self, idx: u32) -> u64 {
        self.layout.channels_off + idx as u64 * CHANNEL_BYTES
    }

    pub(crate) fn channel_word(&self, idx: u32) -> Result<u64, RegistryError> {
        if idx >= self.layout.params.max_channels {
            return Err(RegistryError::NotFound);
        }
        Ok(self.w64(self.channel_off(idx))?.load(SeqCst))
    }

    pub(crate) fn cas_channel(&self, idx: u32, old: u64, new: u64) -> Result<bool, RegistryError> {
        Ok(self
            .w64(self.channel_off(idx))?
            .compare_exchange(old, new, SeqCst, Relaxed)
            .is_ok())
    }

    /// The state word of `id` if the slot still holds that incarnation.
    pub(crate) fn check_channel(&self, id: ChannelId) -> Result<u64, RegistryError> {
        let w = self.channel_word(id.idx)?;
        if c_gen(w) != id.gen {
            return Err(RegistryError::Stale);
        }
        match c_phase(w) {
            C_FREE => Err(RegistryError::NotFound),
            p if p > C_DECLINED || (is_marker(w) && p != C_DECLINED) => Err(
                RegistryError::corrupt("channel state", format!("slot {} word {w:#x}", id.idx)),
            ),
            _ => Ok(w),
        }
    }

    /// Refuses decline markers where only a real channel makes sense.
    fn not_marker(w: u64) -> Result<u64, RegistryError> {
        match is_marker(w) {
            true => Err(RegistryError::wrong("a channel", "a decline marker")),
            false => Ok(w),
        }
    }

    /// Reserves a free slot for `client`, allocates and initialises both stream rings, publishes
    /// the offer (OFFERED) and rings the endpoint's doorbell. The caller wakes a sleeping
    /// listener (see [`Registry::endpoint_doorbell`]).
    pub fn offer(
        &self,
        client: MemberId,
        ep: EndpointId,
        ring_capacity: u64,
        tuple: Option<ConnTuple>,
    ) -> Result<ChannelId, RegistryError> {
        if !ring_capacity.is_power_of_two() || ring_capacity < MIN_RING {
            return Err(RegistryError::InvalidParams(format!(
                "ring capacity {ring_capacity}: power of two >= {MIN_RING}"
            )));
        }
        self.live_member(client)?;
        self.live_endpoint(ep)?;
        let (id, reserved) = self.reserve(client)?;
        if let Err(e) = self.build_offer(id, client, ep, ring_capacity, tuple) {
            self.free_channel(id, reserved).ok();
            return Err(e);
        }
        let epk = pack_id(ep.idx, ep.gen);
        self.backlog_add(epk, true);
        if !self.cas_channel(id.idx, reserved, with_phase(reserved, C_OFFERED))? {
            self.backlog_add(epk, false);
            return Err(self.offer_lost(id));
        }
        let _ = self.ring_doorbell(ep);
        if self.live_endpoint(ep).is_err() && self.cancel(id, client).is_ok() {
            return Err(RegistryError::NotFound); // the listener went away meanwhile
        }
        tracing::trace!(?id, ?ep, "channel offered");
        Ok(id)
    }

    /// The reservation was changed under us (declined, or reclaimed): clean up what is ours.
    fn offer_lost(&self, id: ChannelId) -> RegistryError {
        match self.check_channel(id) {
            Ok(w) => {
                let found = phase_name(c_phase(w));
                self.free_channel(id, w).ok();
                RegistryError::wrong("RESERVED", found)
            }
            Err(e) => e,
        }
    }

    pub(crate) fn reserve(&self, client: MemberId) -> Result<(ChannelId, u64), RegistryError> {
        let tag = member_tag(client);
        for idx in 0..self.layout.params.max_channels {
            let w = self.channel_word(idx)?;
            if c_phase(w) != C_FREE {
                continue;
            }
            let reserved = c_word(c_gen(w), tag, 0, C_RESERVED);
            if self.cas_channel(idx, w, reserved)? {
                return Ok((ChannelId { idx, gen: c_gen(w) }, reserved));
            }
        }
        Err(RegistryError::RegionFull { what: "channels" })
    }

    /// The c2s ring offset recorded in the entry (possibly stale: callers verify by tag).
    pub(crate) fn channel_c2s(&self, ch: ChannelId) -> Option<u64> {
        self.ld(self.channel_off(ch.idx) + O_C2S).ok()
    }

    /// Bytes between the starts of the two rings (cache-line aligned).
    fn ring_stride(cap: u64) -> u64 {
        ring_bytes(cap).div_ceil(64) * 64
    }

    fn build_offer(
        &self,
        id: ChannelId,
        client: MemberId,
        ep: EndpointId,
        cap: u64,
        tuple: Option<ConnTuple>,
    ) -> Result<(), RegistryError> {
        let base = self.channel_off(id.idx);
        let stride = Self::ring_stride(cap);
        let first = self.alloc_segments(id, self.segments_for(2 * stride))?;
        let c2s = self.segment_offset(first);
        let created = self.next_seq(H_CREATE_SEQ)?;
        for (off, v) in [
            (O_SERVER, 0),
            (O_CLIENT, pack_id(client.idx, client.gen)),
            (O_EP, pack_id(ep.idx, ep.gen)),
            (O_CREATED, created),
            (O_CAP, cap),
            (O_C2S, c2s),
            (O_S2C, c2s + stride),
        ] {
            self.st(base + off, v)?;
        }
        let t = tuple.map(|t| encode_tuple(&t)).unwrap_or([0; TUPLE_BYTES]);
        self.view.write(base + O_TUPLE, &t)?;
        self.init_side_words(id.idx, 1)?;
        for off in [c2s, c2s + stride] {
            init_ring(
                &self.view.slice(off, ring_bytes(cap))?,
                RingKind::Stream,
                cap,
                0,
            )?;
        }
        Ok(())
    }

    /// Sets both sides' holders to `holders` and unlocks them (the slot is RESERVED by us).
    pub(crate) fn init_side_words(&self, idx: u32, holders: u32) -> Result<(), RegistryError> {
        let base = self.channel_off(idx);
        for off in [O_SIDE_CLIENT, O_SIDE_SERVER] {
            self.view.u32_at(base + off)?.store(holders, Relaxed);
            self.view.u32_at(base + off + 4)?.store(0, Relaxed);
        }
        Ok(())
    }

    /// The holders and lock words of `side` of an OFFERED or ACCEPTED channel (a client may
    /// fork before the server accepts). The views stay valid memory but name the slot, not the
    /// incarnation: use them only while this side is held open.
    pub fn side_words(&self, ch: ChannelId, side: Side) -> Result<SideWords, RegistryError> {
        let w = Self::not_marker(self.check_channel(ch)?)?;
        if !matches!(c_phase(w), C_OFFERED | C_ACCEPTED) {
            return Err(RegistryError::wrong(
                "OFFERED or ACCEPTED",
                phase_name(c_phase(w)),
            ));
        }
        let off = self.channel_off(ch.idx)
            + match side {
                Side::Client => O_SIDE_CLIENT,
                Side::Server => O_SIDE_SERVER,
            };
        Ok(SideWords {
            holders: self.view.u32_at(off)?,
            lock: self.view.u32_at(off + 4)?,
        })
    }

    /// Frees the slot if its word is still `w`: FREE with generation + 1, then its segments.
    /// Returns whether this call freed it. A freer dying after the CAS leaves orphan segments,
    /// which `sweep_orphans` recognises by their stale generation.
    pub(crate) fn free_channel(&self, id: ChannelId, w: u64) -> Result<bool, RegistryError> {
        let ep = self.ld(self.channel_off(id.idx) + O_EP)?;
        if !self.cas_channel(id.idx, w, (id.gen.wrapping_add(1) as u64) << 32)? {
            return Ok(false);
        }
        if c_phase(w) == C_OFFERED {
            self.backlog_add(ep, false);
        }
        if is_marker(w) {
            self.markers_gone(1);
        }
        let segs = self.release_segments(id);
        tracing::trace!(?id, segs, "channel freed");
        Ok(true)
    }

    /// Reads the endpoint and creation counter of an OFFERED channel, consistently.
    fn offered_fields(&self, idx: u32, w: u64) -> Result<Option<(u64, u64)>, RegistryError> {
        let base = self.channel_off(idx);
        let ep = self.ld(base + O_EP)?;
        let created = self.ld(base + O_CREATED)?;
        fence(Acquire);
        Ok((self.channel_word(idx)? == w).then_some((ep, created)))
    }

    /// Offers to `ep` that are OFFERED right now, as (id, creation counter).
    fn offers_to(&self, ep: EndpointId) -> Vec<(ChannelId, u64)> {
        let epk = pack_id(ep.idx, ep.gen);
        let mut out = Vec::new();
        for idx in 0..self.layout.params.max_channels {
            let Ok(w) = self.channel_word(idx) else {
                continue;
            };
            if c_phase(w) != C_OFFERED {
                continue;
            }
            if let Ok(Some((e, created))) = self.offered_fields(idx, w) {
                if e == epk {
                    out.push((ChannelId { idx, gen: c_gen(w) }, created));
                }
            }
        }
        out
    }

    /// Accepts the oldest pending offer to `ep`, if any.
    pub fn take_offer(
        &self,
        ep: EndpointId,
        server: MemberId,
    ) -> Result<Option<ChannelId>, RegistryError> {
        self.live_member(server)?;
        self.live_endpoint(ep)?;
        for _ in 0..=self.layout.params.max_channels {
            let Some((id, _)) = self.offers_to(ep).into_iter().min_by_key(|&(_, c)| c) else {
                return Ok(None);
            };
            match self.accept(id, server) {
                Ok(()) => return Ok(Some(id)),
                Err(
                    RegistryError::Stale
                    | RegistryError::NotFound
                    | RegistryError::WrongState { .. },
                ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// OFFERED → ACCEPTED by `server`.
    pub fn accept(&self, ch: ChannelId, server: MemberId) -> Result<(), RegistryError> {
        self.live_member(server)?;
        let w = self.check_channel(ch)?;
        if c_phase(w) != C_OFFERED {
            return Err(RegistryError::wrong("OFFERED", phase_name(c_phase(w))));
        }
        let base = self.channel_off(ch.idx);
        let me = pack_id(server.idx, server.gen);
        let sw = self.w64(base + O_SERVER)?;
        match sw.compare_exchange(0, me, SeqCst, Relaxed) {
            Ok(_) => {}
            Err(cur) if cur == me => {}
            Err(_) => return Err(RegistryError::wrong("OFFERED", "being accepted")),
        }
        let ep = self.ld(base + O_EP)?;
        if !self.cas_channel(ch.idx, w, with_phase(w, C_ACCEPTED))? {
            sw.compare_exchange(me, 0, SeqCst, Relaxed).ok();
            let found = self.check_channel(ch)?;
            return Err(RegistryError::wrong("OFFERED", phase_name(c_phase(found))));
        }
        self.backlog_add(ep, false);
        tracing::trace!(?ch, ?server, "channel accepted");
        Ok(())
    }

    /// The OFFERED channel to `server_ep` for this exact 4-tuple (transparent accept). Starts
    /// with a SeqCst fence: after [`Registry::mark_declined`] this is the server's half of the
    /// Dekker pair with the client's offer + [`Registry::markers_for_client`].
    pub fn find_offer_by_tuple(
        &self,
        server_ep: EndpointId,
        tuple: &ConnTuple,
    ) -> Option<ChannelId> {
        fence(SeqCst);
        let want = encode_tuple(tuple);
        self.offers_to(server_ep)
            .into_iter()
            .map(|(id, _)| id)
            .find(|id| {
                let Ok(t) = self.bytes::<TUPLE_BYTES>(self.channel_off(id.idx) + O_TUPLE) else {
                    return false;
                };
                fence(Acquire);
                t == want
                    && self
                        .check_channel(*id)
                        .map(|w| c_phase(w) == C_OFFERED)
                        .unwrap_or(false)
            })
    }

    /// The server says no: RESERVED/OFFERED → DECLINED. The client frees it (close or cancel).
    pub fn decline(&self, ch: ChannelId) -> Result<(), RegistryError> {
        for _ in 0..RETRIES {
            let w = self.check_channel(ch)?;
            match c_phase(w) {
                C_DECLINED => return Ok(()),
                C_RESERVED | C_OFFERED => {
                    let ep = self.ld(self.channel_off(ch.idx) + O_EP)?;
                    if self.cas_channel(ch.idx, w, with_phase(w, C_DECLINED))? {
                        if c_phase(w) == C_OFFERED {
                            self.backlog_add(ep, false);
                        }
                        return Ok(());
                    }
                }
                p => return Err(RegistryError::wrong("OFFERED", phase_name(p))),
            }
        }
        Err(RegistryError::corrupt(
            "channel state",
            "decline did not converge",
        ))
    }

    /// The client gives up waiting: OFFERED → CANCELLED → FREE. `WrongState` if the server has
    /// already accepted (the client must then use the channel). Also frees a DECLINED channel.
    pub fn cancel(&self, ch: ChannelId, client: MemberId) -> Result<(), RegistryError> {
        for _ in 0..RETRIES {
            let w = Self::not_marker(self.check_channel(ch)?)?;
            if c_client_tag(w) != member_tag(client) {
                return Err(RegistryError::wrong(
                    "the channel's client",
                    "another member",
                ));
            }
            let next = match c_phase(w) {
                C_OFFERED => with_phase(w, C_CANCELLED),
                C_RESERVED | C_CANCELLED | C_DECLINED => w,
                p => return Err(RegistryError::wrong("OFFERED", phase_name(p))),
            };
            let ep = self.ld(self.channel_off(ch.idx) + O_EP)?;
            if next != w && !self.cas_channel(ch.idx, w, next)? {
                continue;
            }
            if next != w {
                self.backlog_add(ep, false);
            }
            self.free_channel(ch, next)?;
            return Ok(());
        }
        Err(RegistryError::corrupt(
            "channel state",
            "cancel did not converge",
        ))
    }

    pub fn channel_state(&self, ch: ChannelId) -> Result<ChannelState, RegistryError> {
        let w = self.check_channel(ch)?;
        phase_state(c_phase(w)).ok_or_else(|| RegistryError::corrupt("channel state", "phase"))
    }

    /// Views of the two rings, validated against the heap bounds.
    pub fn rings(&self, ch: ChannelId) -> Result<ChannelRings, RegistryError> {
        let w = self.check_channel(ch)?;
        if !matches!(c_phase(w), C_OFFERED | C_ACCEPTED) {
            return Err(RegistryError::wrong(
                "OFFERED or ACCEPTED",
                phase_name(c_phase(w)),
            ));
        }
        let base = self.channel_off(ch.idx);
        let (cap, c2s, s2c) = (
            self.ld(base + O_CAP)?,
            self.ld(base + O_C2S)?,
            self.ld(base + O_S2C)?,
        );
        fence(Acquire);
        if c_gen(self.channel_word(ch.idx)?) != ch.gen {
            return Err(RegistryError::Stale);
        }
        let len = self.ring_len(cap)?;
        self.check_ring_place(ch, c2s, s2c, len)?;
        Ok(ChannelRings {
            c2s: self.heap_view(c2s, len)?,
            s2c: self.heap_view(s2c, len)?,
        })
    }

    /// The two rings of a channel must not overlap and must lie in memory tagged as this
    /// channel's: a peer's bad entry could otherwise make two channels (or two directions)
    /// share bytes.
    fn check_ring_place(
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

    fn ring_len(&self, cap: u64) -> Result<u64, RegistryError> {
        if !cap.is_power_of_two() || cap < MIN_RING || cap > self.layout.heap_end() {
            return Err(RegistryError::corrupt(
                "channel ring capacity",
                cap.to_string(),
            ));
        }
        Ok(ring_bytes(cap))
    }

    fn heap_view(&self, off: u64, len: u64) -> Result<ShmSlice, RegistryError> {
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

    /// Marks `side` closed; frees the channel when both sides are closed or dead. A client
    /// closing a channel that was never accepted frees it at once.
    pub fn close(&self, ch: ChannelId, side: Side) -> Result<(), RegistryError> {
        for _ in 0..RETRIES {
            let w = Self::not_marker(self.check_channel(ch)?)?;
            let done = match (c_phase(w), side) {
                (C_ACCEPTED, _) => self.mark_side(ch, w, side, side_bits(side).0)?,
                (_, Side::Client) => self.free_channel(ch, w)?,
                (C_DECLINED | C_CANCELLED, Side::Server) => true,
                (p, Side::Server) => return Err(RegistryError::wrong("ACCEPTED", phase_name(p))),
            };
            if done {
                return Ok(());
            }
        }
        Err(RegistryError::corrupt(
            "channel state",
            "close did not converge",
        ))
    }

    /// Sets `bit` for `side` on an ACCEPTED channel whose word is `w`, or frees the channel if
    /// the other side is already gone. `false` if the word changed (retry).
    pub(crate) fn mark_side(
        &self,
        ch: ChannelId,
        w: u64,
        side: Side,
        bit: u64,
    ) -> Result<bool, RegistryError> {
        if gone(w, other(side)) {
            return self.free_channel(ch, w);
        }
        if w & bit != 0 {
            return Ok(true);
        }
        self.cas_channel(ch.idx, w, w | bit)
    }

    /// Sets the dead bit of `side` (reclaim), freeing the channel if the other side is gone.
    pub(crate) fn mark_dead(&self, ch: ChannelId, side: Side) -> Result<bool, RegistryError> {
        for _ in 0..RETRIES {
            let w = self.check_channel(ch)?;
            if c_phase(w) != C_ACCEPTED {
                return Ok(false);
            }
            if self.mark_side(ch, w, side, side_bits(side).1)? {
                return Ok(self.check_channel(ch).is_err());
            }
        }
        Ok(false)
    }

    /// `side` learnt from the kernel that the peer's socket is gone (every process holding that
    /// end closed it or died): mark the other side dead, which frees the channel once `side`
    /// closes too. Needed when the peer's holders could not all say goodbye (killed, or a
    /// forked child that exec'd without closing its inherited copy).
    pub fn peer_socket_closed(&self, ch: ChannelId, side: Side) -> Result<bool, RegistryError> {
        self.mark_dead(ch, other(side))
    }

    /// Has the other side closed or died (or, for a client, did the server decline)?
    pub fn peer_gone(&self, ch: ChannelId, side: Side) -> Result<bool, RegistryError> {
        let w = self.check_channel(ch)?;
        let refused = match side {
            Side::Client => c_phase(w) == C_DECLINED,
            Side::Server => c_phase(w) == C_CANCELLED,
        };
        Ok(refused || gone(w, other(side)))
    }

    /// Reads a whole channel entry.
    pub fn channel(&self, ch: ChannelId) -> Result<ChannelInfo, RegistryError> {
        for _ in 0..64 {
            let w = self.check_channel(ch)?;
            let base = self.channel_off(ch.idx);
            let raw = [
                self.ld(base + O_SERVER)?,
                self.ld(base + O_CLIENT)?,
                self.ld(base + O_EP)?,
                self.ld(base + O_CAP)?,
            ];
            let tuple = self.bytes::<TUPLE_BYTES>(base + O_TUPLE)?;
            fence(Acquire);
            if self.channel_word(ch.idx)? == w {
                return self.decode_channel(ch, w, raw, &tuple);
            }
        }
        Err(RegistryError::corrupt("channel", "entry kept changing"))
    }

    fn decode_channel(
        &self,
        id: ChannelId,
        w: u64,
        raw: [u64; 4],
        tuple: &[u8; TUPLE_BYTES],
    ) -> Result<ChannelInfo, RegistryError> {
        let p = &self.layout.params;
        let bad = |what: &'static str, v: u64| {
            RegistryError::corrupt(what, format!("channel {}: {v:#x}", id.idx))
        };
        let state = phase_state(c_phase(w)).ok_or_else(|| bad("channel state", w))?;
        let member = |v: u64| unpack_id(v, p.max_members).map(|(idx, gen)| MemberId { idx, gen });
        let client = member(raw[1]).ok_or_else(|| bad("channel client", raw[1]))?;
        let server = if raw[0] == 0 {
            None
        } else {
            Some(member(raw[0]).ok_or_else(|| bad("channel server", raw[0]))?)
        };
        let (eidx, egen) =
            unpack_id(raw[2], p.max_endpoints).ok_or_else(|| bad("channel endpoint", raw[2]))?;
        Ok(ChannelInfo {
            id,
            state,
            client,
            server,
            endpoint: EndpointId {
                idx: eidx,
                gen: egen,
            },
            tuple: decode_tuple(tuple)?,
            client_closed: w & CLIENT_CLOSED != 0,
            server_closed: w & SERVER_CLOSED != 0,
            client_dead: w & CLIENT_DEAD != 0,
            server_dead: w & SERVER_DEAD != 0,
            ring_capacity: raw[3],
            marker: is_marker(w),
        })
    }

    /// Every channel that is past RESERVED (entries failing validation are skipped and logged).
    pub fn channels(&self) -> Vec<ChannelInfo> {
        let mut out = Vec::new();
        for idx in 0..self.layout.params.max_channels {
            let Ok(w) = self.channel_word(idx) else {
                continue;
            };
            if matches!(c_phase(w), C_FREE | C_RESERVED) {
                continue;
            }
            match self.channel(ChannelId { idx, gen: c_gen(w) }) {
                Ok(c) => out.push(c),
                Err(RegistryError::Stale | RegistryError::NotFound) => {}
                Err(e) => tracing::warn!(idx, error = %e, "skipping channel entry"),
            }
        }
        out
    }

    pub(crate) fn count_channels(&self) -> u32 {
        let max = self.layout.params.max_channels;
        (0..max)
            .filter(|&i| {
                self.channel_word(i)
                    .map(|w| c_phase(w) != C_FREE)
                    .unwrap_or(false)
            })
            .count() as u32
    }

    /// Declines every pending offer to `ep` (its listener is gone).
    pub(crate) fn decline_offers_to(&self, ep: EndpointId) {
        for (id, _) in self.offers_to(ep) {
            self.decline(id).ok();
        }
    }

    /// Releases what a dead member held in the channel table; returns (freed, marked).
    pub(crate) fn reclaim_channels(&self, dead: MemberId) -> (u32, u32) {
        let (tag, packed) = (member_tag(dead), pack_id(dead.idx, dead.gen));
        let (mut freed, mut marked) = (0, 0);
        for idx in 0..self.layout.params.max_channels {
            let Ok(w) = self.channel_word(idx) else {
                continue;
            };
            let id = ChannelId { idx, gen: c_gen(w) };
            let phase = c_phase(w);
            if phase == C_FREE || phase > C_DECLINED {
                continue;
            }
            let (f, m) = if c_client_tag(w) == tag {
                self.reclaim_client_side(id, tag)
            } else {
                (0, 0)
            };
            let (f2, m2) = self.reclaim_server_side(id, packed);
            let (f, m) = (f + f2, m + m2);
            freed += f;
            marked += m;
        }
        (freed, marked)
    }

    /// If the dead member is (or was becoming) the server of `id`: dead bit, or release the
    /// server word it claimed just before dying mid-accept.
    fn reclaim_server_side(&self, id: ChannelId, packed: u64) -> (u32, u32) {
        let Ok(w) = self.check_channel(id) else {
            return (0, 0);
        };
        let off = self.channel_off(id.idx) + O_SERVER;
        if self.ld(off).unwrap_or(0) != packed {
            return (0, 0);
        }
        if c_phase(w) == C_ACCEPTED {
            return self.reclaim_side(id, Side::Server);
        }
        if let Ok(s) = self.w64(off) {
            s.compare_exchange(packed, 0, SeqCst, Relaxed).ok();
        }
        (0, 0)
    }

    /// The dead member is the client: dead bit if accepted, else free the unfinished channel
    /// (retrying if a server accepts it concurrently).
    fn reclaim_client_side(&self, id: ChannelId, tag: u32) -> (u32, u32) {
        for _ in 0..RETRIES {
            let Ok(w) = self.check_channel(id) else {
                return (0, 0);
            };
            if c_client_tag(w) != tag {
                return (0, 0);
            }
            if c_phase(w) == C_ACCEPTED {
                return self.reclaim_side(id, Side::Client);
            }
            if self.free_channel(id, w).unwrap_or(false) {
                return (1, 0);
            }
        }
        (0, 0)
    }

    fn reclaim_side(&self, id: ChannelId, side: Side) -> (u32, u32) {
        match self.mark_dead(id, side) {
            Ok(true) => (1, 0),
            Ok(false) => (0, 1),
            Err(_) => (0, 0),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod ring_place_tests {
    use super::*;
    use crate::EndpointKey;

    fn offered() -> (Registry, ChannelId, ChannelId) {
        let (r, m) = crate::members::test_registry_with_member("m");
        let ep = r.add_endpoint(m, &EndpointKey::Native("x".into())).unwrap();
        let a = r.offer(m, ep, 4096, None).unwrap();
        let b = r.offer(m, ep, 4096, None).unwrap();
        (r, a, b)
    }

    #[test]
    fn a_channel_whose_rings_overlap_is_corrupt() {
        let (r, a, _) = offered();
        let base = r.channel_off(a.idx);
        let c2s = r.ld(base + O_C2S).unwrap();
        r.st(base + O_S2C, c2s + 64).unwrap();
        let e = r.rings(a).err().expect("overlapping rings refused");
        assert!(e.to_string().contains("overlap"), "{e}");
    }

    #[test]
    fn a_ring_in_another_channels_memory_is_corrupt() {
        let (r, a, b) = offered();
        assert!(r.rings(a).is_ok() && r.rings(b).is_ok());
        let (ba, bb) = (r.channel_off(a.idx), r.channel_off(b.idx));
        let theirs = r.ld(bb + O_C2S).unwrap();
        r.st(ba + O_S2C, theirs).unwrap();
        let e = r.rings(a).err().expect("a ring in b's memory refused");
        assert!(e.to_string().contains("outside this channel"), "{e}");
        // b itself is untouched and still fine.
        assert!(r.rings(b).is_ok());
    }
}
