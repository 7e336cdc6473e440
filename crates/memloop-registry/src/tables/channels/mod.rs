//! Channels: fixed slots, each driven by CAS on one state word.
//!
//! ```text
//! FREE ─client─▶ RESERVED ─rings ready─▶ OFFERED ─server─▶ ACCEPTED ─both closed/dead─▶ FREE(gen+1)
//!                    │                      ├─client timeout─▶ CANCELLED ─▶ FREE(gen+1)
//!                    └──────server says no──┴─▶ DECLINED ─client acknowledges─▶ FREE(gen+1)
//! FREE ─server─▶ RESERVED ─▶ DECLINED|MARKER ─server frees (or reclaim)─▶ FREE(gen+1)
//! ```
//! State word ([`StateWord`]): generation, the client's member tag, and in the low byte
//! `flags << 3 | phase` (flags: MARKER, then the closed/dead bits; phase: 3 bits). The client's
//! member tag is in the word from the moment of reservation, so a reclaimer can find a dead
//! client's half-built reservations. A decline
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
//! | 120 | channel kind u32 ([`ChannelKind`] code; 0 for a decline marker) · 124 switch bell u32 |
//! | 128 | client side's switch words: doorbells sent u64 · 136 doorbells read u64 · 144 leave cell (32 B) |
//! | 176 | server side's switch words: the same · 224 switch word u64 (`switch.rs`) |
//! | 232 | client side's TCP stop position u64 (promotion) · 240 server side's · 248 offer index position (`index.rs`) |
//!
//! The kind is written with the other fields before the offer is published and checked by
//! every attach ([`Registry::rings_of`]) against what the caller expects and against the kind
//! fields of the two ring headers; `accept` refuses kinds this build cannot use.
//!
//! The switch words count the doorbell bytes each side sent and read on its kernel socket, in
//! shared memory so that processes sharing a side after fork count together, and hold the
//! side's ring-leave record (`memloop_ring::leave`): live path switching discards exactly the
//! peer's unread doorbells (`docs/design/path-switching.md`).
//!
//! The side words serve a channel shared by several processes after fork: `holders` counts the
//! processes that hold one side open, `lock` (0 or a pid) serialises them. They are written
//! only by the reserving client before the offer is published (1 holder per side, unlocked)
//! and never by a freer, whose late write could land on the slot's next occupant.

use crate::error::RegistryError;
use crate::header::H_CREATE_SEQ;
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, unpack_id, ChannelId, ConnTuple, EndpointId,
    MemberId, TUPLE_BYTES,
};
use crate::kind::ChannelKind;
use crate::state_word::{bad_state, StateWord};
use crate::switch::SwitchWord;
use crate::tables::index::{IndexKey, NOT_INSERTED};
use crate::Registry;
use memloop_ring::{init_ring_windowed, ring_bytes, RingKind};
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Relaxed, SeqCst};
use memloop_shm::{ShmSlice, ShmU32, ShmU64};
mod rings;

pub(crate) const C_FREE: u8 = 0;
pub(crate) const C_RESERVED: u8 = 1;
pub(crate) const C_OFFERED: u8 = 2;
pub(crate) const C_ACCEPTED: u8 = 3;
pub(crate) const C_CANCELLED: u8 = 4;
pub(crate) const C_DECLINED: u8 = 5;
const PHASE_MASK: u8 = 0x7;
/// Flag of a decline marker (phase DECLINED, no rings).
pub(crate) const MARKER: u8 = 0x8;
const CLIENT_CLOSED: u8 = 0x10;
const SERVER_CLOSED: u8 = 0x20;
const CLIENT_DEAD: u8 = 0x40;
const SERVER_DEAD: u8 = 0x80;

const O_SERVER: u64 = 8;
const O_CLIENT: u64 = 16;
const O_EP: u64 = 24;
const O_CREATED: u64 = 32;
const O_CAP: u64 = 40;
const O_C2S: u64 = 48;
const O_S2C: u64 = 56;
const O_TUPLE: u64 = 64;
const O_SIDE_CLIENT: u64 = 104;
const O_SIDE_SERVER: u64 = 112;
const O_KIND: u64 = 120;
/// Bumped at each step of a switch (a futex for waiters in one kernel; only a wake-up).
const O_BELL: u64 = O_KIND + 4;
const O_SWITCH_CLIENT: u64 = 128;
const O_SWITCH_SERVER: u64 = 176;
/// The channel's switch word (`crate::switch::SwitchWord`).
const O_SWITCH_WORD: u64 = 224;
/// Per side: the TCP bytes it sent before its writes went back to the ring (promotion).
const O_STOP_CLIENT: u64 = 232;
const O_STOP_SERVER: u64 = 240;
/// Where the channel is in the offer index: position + 1, 0 (not in it: counted), or
/// `index::NOT_INSERTED`.
const O_INDEX: u64 = 248;
/// Per side: doorbells sent, doorbells read, then the leave cell.
const SWITCH_BYTES: u64 = 16 + memloop_ring::leave::LEAVE_CELL_BYTES;
/// Per side: the kernel socket's stream positions at its last switch to TCP (written, read),
/// then the holds of fds in flight to other processes (`SCM_RIGHTS`).
const O_HANDOFF_CLIENT: u64 = 256;
const O_HANDOFF_SERVER: u64 = 280;
const HANDOFF_BYTES: u64 = 24;
/// Which side began closing first (0: neither yet, else [`first_close_code`]): the other side
/// holds its real close until the first one's FIN, so TIME_WAIT lands where TCP puts it.
const O_FIRST_CLOSE: u64 = O_HANDOFF_SERVER + HANDOFF_BYTES;
/// The decision word (`crate::DecideWord`): how a client waiting for the accept hears of it.
const O_DECIDE: u64 = O_FIRST_CLOSE + 4;
const _: () = assert!(O_DECIDE + 4 <= crate::header::CHANNEL_BYTES);
const MIN_RING: u64 = 64;
/// The smallest ring capacity pressure on the ring heap brings a new connection down to
/// (a 16 KiB pair takes 36 KiB of the heap with its headers).
pub const PRESSURE_FLOOR: u64 = 16 << 10;
/// The window a new stream ring starts with (it grows while the connection is busy, up to
/// the ring's capacity, and shrinks back when it idles): an idle connection holds 2 × 20 KiB.
pub const INITIAL_WINDOW: u64 = 16 << 10;
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
    /// What the channel's rings are; `None` for a decline marker (it has no rings).
    pub kind: Option<ChannelKind>,
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
    /// Doorbell bytes this side sent on its kernel socket (every process holding it).
    pub doorbells_sent: ShmU64,
    /// Doorbell bytes this side read from its kernel socket.
    pub doorbells_read: ShmU64,
    /// This side's ring-leave record (`memloop_ring::leave::LeaveCell::new(&leave, 0)`).
    pub leave: ShmSlice,
    /// The channel's switch word (shared by both sides).
    pub switch: crate::switch::SwitchWord,
    /// TCP bytes this side sent before its writes went back to the ring (promotion).
    pub tcp_stop: ShmU64,
    /// The kernel socket's stream positions (bytes the program side wrote / read, doorbells
    /// included) at this side's last switch to TCP: a process that adopts the socket later
    /// (fd passing, exec) counts its TCP phase from them. `u64::MAX`: unknown.
    pub tcp_base_written: ShmU64,
    pub tcp_base_read: ShmU64,
    /// Holds on this side taken for fds sent to other processes and not yet adopted there.
    pub handoffs: ShmU32,
    /// The channel's switch bell (shared by both sides): bumped after each step of a switch,
    /// so a side waiting for the peer's next step sleeps on it (a futex in one kernel).
    pub bell: ShmU32,
    /// The side that began closing first (shared by both sides; see [`SideWords::close_first`]).
    pub first_close: ShmU32,
    /// The channel's decision word (shared by both sides).
    pub decide: crate::DecideWord,
}

/// The code of `side` in [`SideWords::first_close`].
fn first_close_code(side: Side) -> u32 {
    match side {
        Side::Client => 1,
        Side::Server => 2,
    }
}

impl SideWords {
    /// Called by `side` as it begins its close: true if the peer began first (then the
    /// peer's FIN goes first too, and ours should follow it, as on TCP). Exactly one side of
    /// a simultaneous close is second.
    pub fn close_first(&self, side: Side) -> bool {
        let me = first_close_code(side);
        match self.first_close.compare_exchange(0, me, SeqCst, Acquire) {
            Ok(_) => false,
            Err(other) => other != me,
        }
    }
}

/// Views of the two rings of a channel, for `memloop_ring` attach.
#[derive(Clone)]
pub struct ChannelRings {
    pub c2s: ShmSlice,
    pub s2c: ShmSlice,
}

/// Everything a reserving member writes into its slot before publishing it.
pub(crate) struct ChannelFields {
    pub server: u64,
    pub client: u64,
    pub endpoint: u64,
    pub created: u64,
    pub capacity: u64,
    pub c2s: u64,
    pub s2c: u64,
    /// A [`ChannelKind`] code, or 0 for a decline marker.
    pub kind: u32,
    pub tuple: [u8; TUPLE_BYTES],
    /// Initial holders of each side (1 for a channel, 0 for a marker).
    pub holders: u32,
}

crate::tables::slot_view!(
    /// Typed view of one channel slot; the only code that knows the slot's field offsets.
    ChannelSlot,
    channels
);

impl<'a> ChannelSlot<'a> {
    /// Writes every field; the slot must be RESERVED by the caller (unpublished).
    pub fn write(&self, f: &ChannelFields) -> Result<(), RegistryError> {
        for (off, v) in [
            (O_SERVER, f.server),
            (O_CLIENT, f.client),
            (O_EP, f.endpoint),
            (O_CREATED, f.created),
            (O_CAP, f.capacity),
            (O_C2S, f.c2s),
            (O_S2C, f.s2c),
        ] {
            self.0.st(off, v)?;
        }
        self.0.write(O_TUPLE, &f.tuple)?;
        self.0.u32(O_KIND)?.store(f.kind, Relaxed);
        self.0.u32(O_BELL)?.store(0, Relaxed);
        for off in [O_SIDE_CLIENT, O_SIDE_SERVER] {
            self.0.u32(off)?.store(f.holders, Relaxed);
            self.0.u32(off + 4)?.store(0, Relaxed);
        }
        for off in [O_SWITCH_CLIENT, O_SWITCH_SERVER] {
            for word in (0..SWITCH_BYTES).step_by(8) {
                self.0.st(off + word, 0)?;
            }
        }
        self.0.st(O_STOP_CLIENT, 0)?;
        self.0.st(O_STOP_SERVER, 0)?;
        for off in [O_HANDOFF_CLIENT, O_HANDOFF_SERVER] {
            for word in (0..HANDOFF_BYTES).step_by(8) {
                self.0.st(off + word, 0)?;
            }
        }
        self.0.st(O_FIRST_CLOSE, 0)?; // (and the decision word beside it)
        self.0.st(O_SWITCH_WORD, 0)
    }
    pub fn decide_word(&self) -> Result<crate::DecideWord, RegistryError> {
        Ok(crate::DecideWord(self.0.u32(O_DECIDE)?))
    }
    pub fn index_pos(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_INDEX)
    }
    pub fn set_index_pos(&self, v: u64) -> Result<(), RegistryError> {
        self.0.st(O_INDEX, v)
    }
    pub fn switch_word(&self) -> Result<ShmU64, RegistryError> {
        self.0.u64(O_SWITCH_WORD)
    }
    /// The server word, claimed by CAS before OFFERED → ACCEPTED.
    pub fn server_cell(&self) -> Result<ShmU64, RegistryError> {
        self.0.u64(O_SERVER)
    }
    pub fn server(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_SERVER)
    }
    pub fn client(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_CLIENT)
    }
    pub fn set_client(&self, packed: u64) -> Result<(), RegistryError> {
        self.0.st(O_CLIENT, packed)
    }
    pub fn endpoint(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_EP)
    }
    pub fn created(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_CREATED)
    }
    pub fn capacity(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_CAP)
    }
    pub fn c2s(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_C2S)
    }
    pub fn s2c(&self) -> Result<u64, RegistryError> {
        self.0.ld(O_S2C)
    }
    pub fn tuple(&self) -> Result<[u8; TUPLE_BYTES], RegistryError> {
        self.0.bytes(O_TUPLE)
    }
    pub fn kind_code(&self) -> Result<u32, RegistryError> {
        Ok(self.0.u32(O_KIND)?.load(Relaxed))
    }
    pub fn side(&self, side: Side) -> Result<SideWords, RegistryError> {
        let off = match side {
            Side::Client => O_SIDE_CLIENT,
            Side::Server => O_SIDE_SERVER,
        };
        let sw = match side {
            Side::Client => O_SWITCH_CLIENT,
            Side::Server => O_SWITCH_SERVER,
        };
        let ho = match side {
            Side::Client => O_HANDOFF_CLIENT,
            Side::Server => O_HANDOFF_SERVER,
        };
        Ok(SideWords {
            holders: self.0.u32(off)?,
            lock: self.0.u32(off + 4)?,
            doorbells_sent: self.0.u64(sw)?,
            doorbells_read: self.0.u64(sw + 8)?,
            leave: self
                .0
                .view(sw + 16, memloop_ring::leave::LEAVE_CELL_BYTES)?,
            switch: crate::switch::SwitchWord(self.switch_word()?),
            tcp_stop: self.0.u64(match side {
                Side::Client => O_STOP_CLIENT,
                Side::Server => O_STOP_SERVER,
            })?,
            tcp_base_written: self.0.u64(ho)?,
            tcp_base_read: self.0.u64(ho + 8)?,
            handoffs: self.0.u32(ho + 16)?,
            bell: self.0.u32(O_BELL)?,
            first_close: self.0.u32(O_FIRST_CLOSE)?,
            decide: self.decide_word()?,
        })
    }
    #[cfg(all(test, not(loom)))]
    pub fn set_rings_for_test(&self, c2s: u64, s2c: u64) -> Result<(), RegistryError> {
        self.0.st(O_C2S, c2s)?;
        self.0.st(O_S2C, s2c)
    }
    #[cfg(all(test, not(loom)))]
    pub fn set_kind_for_test(&self, code: u32) -> Result<(), RegistryError> {
        self.0.u32(O_KIND)?.store(code, Relaxed);
        Ok(())
    }
}

/// Whether `side` of the channel whose state word is `w` closed or died.
pub(crate) fn side_gone(w: StateWord, side: Side) -> bool {
    let (closed, dead) = match side {
        Side::Client => (CLIENT_CLOSED, CLIENT_DEAD),
        Side::Server => (SERVER_CLOSED, SERVER_DEAD),
    };
    w.low() & (closed | dead) != 0
}

pub(crate) fn c_phase(w: StateWord) -> u8 {
    w.low() & PHASE_MASK
}
pub(crate) fn is_marker(w: StateWord) -> bool {
    w.low() & MARKER != 0
}
pub(crate) fn with_phase(w: StateWord, phase: u8) -> StateWord {
    w.with_low((w.low() & !PHASE_MASK) | phase)
}
fn with_flag(w: StateWord, bit: u8) -> StateWord {
    w.with_low(w.low() | bit)
}
fn side_bits(side: Side) -> (u8, u8) {
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
fn gone(w: StateWord, side: Side) -> bool {
    let (c, d) = side_bits(side);
    w.low() & (c | d) != 0
}

pub(crate) fn phase_name(p: u8) -> &'static str {
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

fn phase_state(p: u8) -> Option<ChannelState> {
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
    /// Records the kind of the channel being built in slot `idx` in the dense kinds array.
    /// Only the builder of a slot writes it (after reserving it, before publishing), so the
    /// byte always names the kind of the latest occupant: a scan that looks for one kind
    /// reads a byte per slot, then the slots that match (a freed slot keeps its byte, which
    /// costs that look only).
    pub(crate) fn note_kind(&self, idx: u32, kind: ChannelKind) -> Result<(), RegistryError> {
        let word = self
            .view
            .atomic_u64(self.layout.kinds_off + 8 * (idx as u64 / 8))?;
        let shift = 8 * (idx % 8);
        let code = kind.code() as u64 & 0xff;
        // A slot mostly gets the kind it had: then a load, and no write to a shared line on
        // the connection's set-up path.
        if (word.load(SeqCst) >> shift) & 0xff != code {
            let _ = word.fetch_update(SeqCst, SeqCst, |w| {
                Some((w & !(0xff << shift)) | code << shift)
            });
        }
        if kind == ChannelKind::DescriptorPair {
            if let Some(high) = self.header_hint(crate::header::H_DESC_HIGH) {
                high.fetch_max(idx as u64 + 1, SeqCst);
            }
        }
        Ok(())
    }

    /// Slots whose latest channel was built as `kind` (some since freed or rebuilt: callers
    /// check the slot itself).
    pub(crate) fn slots_of_kind(&self, kind: ChannelKind) -> Vec<u32> {
        let mut n = self.layout.params.max_channels;
        if kind == ChannelKind::DescriptorPair {
            // (A hint set before any descriptor channel is published: at most stale-high.)
            let high = self.header_hint(crate::header::H_DESC_HIGH);
            n = n.min(high.map_or(n as u64, |h| h.load(SeqCst)) as u32);
        }
        let code = kind.code() as u64 & 0xff;
        let mut out = Vec::new();
        for w in 0..(n as u64).div_ceil(8) {
            let Ok(word) = self.view.atomic_u64(self.layout.kinds_off + 8 * w) else {
                break;
            };
            let v = word.load(SeqCst);
            if v == 0 {
                continue;
            }
            for b in 0..8u32 {
                let idx = w as u32 * 8 + b;
                if idx < n && (v >> (8 * b)) & 0xff == code {
                    out.push(idx);
                }
            }
        }
        out
    }

    pub(crate) fn channel_slot(&self, idx: u32) -> Result<ChannelSlot<'_>, RegistryError> {
        ChannelSlot::new_checked(self, idx)
    }

    pub(crate) fn channel_word(&self, idx: u32) -> Result<StateWord, RegistryError> {
        self.channel_slot(idx)?.word()
    }

    pub(crate) fn cas_channel(
        &self,
        idx: u32,
        old: StateWord,
        new: StateWord,
    ) -> Result<bool, RegistryError> {
        self.channel_slot(idx)?.cas(old, new)
    }

    /// The slot and its state word if the slot still holds incarnation `id`.
    pub(crate) fn channel_entry(
        &self,
        id: ChannelId,
    ) -> Result<(ChannelSlot<'_>, StateWord), RegistryError> {
        let slot = self.channel_slot(id.idx)?;
        let w = slot.word()?;
        if w.gen() != id.gen {
            return Err(RegistryError::Stale);
        }
        match c_phase(w) {
            C_FREE => Err(RegistryError::NotFound),
            p if p > C_DECLINED || (is_marker(w) && p != C_DECLINED) => {
                Err(bad_state("channel state", id.idx, w))
            }
            _ => Ok((slot, w)),
        }
    }

    /// The state word of `id` if the slot still holds that incarnation.
    pub(crate) fn check_channel(&self, id: ChannelId) -> Result<StateWord, RegistryError> {
        self.channel_entry(id).map(|(_, w)| w)
    }

    /// Refuses decline markers where only a real channel makes sense.
    fn not_marker(w: StateWord) -> Result<StateWord, RegistryError> {
        match is_marker(w) {
            true => Err(RegistryError::wrong("a channel", "a decline marker")),
            false => Ok(w),
        }
    }

    /// Reserves a free slot for `client`, allocates and initialises two stream rings, publishes
    /// the offer (OFFERED) and rings the endpoint's doorbell. The caller wakes a sleeping
    /// listener (see [`Registry::endpoint_doorbell`]).
    pub fn offer(
        &self,
        client: MemberId,
        ep: EndpointId,
        ring_capacity: u64,
        tuple: Option<ConnTuple>,
    ) -> Result<ChannelId, RegistryError> {
        self.offer_kind(client, ep, ChannelKind::StreamPair, ring_capacity, tuple)
    }

    /// [`Registry::offer`] for a channel of `kind`; `UnsupportedChannelKind` for kinds this
    /// build cannot build yet.
    pub fn offer_kind(
        &self,
        client: MemberId,
        ep: EndpointId,
        kind: ChannelKind,
        ring_capacity: u64,
        tuple: Option<ConnTuple>,
    ) -> Result<ChannelId, RegistryError> {
        kind.require_supported()?;
        if !ring_capacity.is_power_of_two() || ring_capacity < MIN_RING {
            return Err(RegistryError::InvalidParams(format!(
                "ring capacity {ring_capacity}: power of two >= {MIN_RING}"
            )));
        }
        self.live_member(client)?;
        self.live_endpoint(ep)?;
        let (id, reserved) = self.reserve(client)?;
        if let Err(e) = self.build_offer(id, client, ep, kind, ring_capacity, tuple) {
            self.free_channel(id, reserved).ok();
            return Err(e);
        }
        // Only TCP's agreement looks offers up by the client's address; a datagram pair is
        // found by its receiver's endpoint, so no TCP server ever sees one.
        let key = match tuple {
            Some(t) if kind == ChannelKind::StreamPair => IndexKey::Client(t.client),
            _ => IndexKey::Endpoint(pack_id(ep.idx, ep.gen)),
        };
        let published = self.publish_offer(id, reserved, client, (ep, key), kind, false)?;
        if kind == ChannelKind::DescriptorPair {
            self.desc_channel_offered();
        }
        Ok(published)
    }

    /// A late-ring offer for the TCP connection `tuple` (it fell back at connect): published
    /// with its switch word already [`SwitchWord::LATE_OFFER`], so the transparent agreement
    /// of new connections never takes it ([`Registry::find_offer_by_tuple`] and
    /// [`Registry::offers_from_client`] skip it); the server finds it with
    /// [`Registry::find_late_offer`]. Keyed to the endpoint of the server's decline `marker`
    /// for the connection: the listener itself may be closed by now.
    pub fn offer_late(
        &self,
        client: MemberId,
        marker: ChannelId,
        ring_capacity: u64,
        tuple: ConnTuple,
    ) -> Result<ChannelId, RegistryError> {
        let kind = ChannelKind::StreamPair;
        if !ring_capacity.is_power_of_two() || ring_capacity < MIN_RING {
            return Err(RegistryError::InvalidParams(format!(
                "ring capacity {ring_capacity}: power of two >= {MIN_RING}"
            )));
        }
        self.live_member(client)?;
        let ep = self.marker_endpoint(marker)?;
        let (id, reserved) = self.reserve(client)?;
        let built = self
            .build_offer(id, client, ep, kind, ring_capacity, Some(tuple))
            .and_then(|()| self.channel_slot(id.idx)?.switch_word())
            .map(|w| w.store(SwitchWord::LATE_OFFER, SeqCst));
        if let Err(e) = built {
            self.free_channel(id, reserved).ok();
            return Err(e);
        }
        let key = IndexKey::Client(tuple.client);
        self.publish_offer(id, reserved, client, (ep, key), kind, true)
    }

    /// The endpoint a decline marker was published for.
    fn marker_endpoint(&self, marker: ChannelId) -> Result<EndpointId, RegistryError> {
        let (slot, w) = self.channel_entry(marker)?;
        if !is_marker(w) {
            return Err(RegistryError::wrong(
                "a decline marker",
                phase_name(c_phase(w)),
            ));
        }
        let packed = slot.endpoint()?;
        let (idx, gen) = unpack_id(packed, self.layout.params.max_endpoints)
            .ok_or_else(|| RegistryError::corrupt("marker endpoint", "out of range"))?;
        Ok(EndpointId { idx, gen })
    }

    /// The OFFERED channel of a late-ring offer for exactly `tuple` to `server_ep`.
    pub fn find_late_offer(&self, server_ep: EndpointId, tuple: &ConnTuple) -> Option<ChannelId> {
        fence(SeqCst);
        let want = encode_tuple(tuple);
        self.offers_to_any(server_ep, Some(IndexKey::Client(tuple.client)), true)
            .into_iter()
            .map(|(id, _)| id)
            .find(|id| {
                self.channel_slot(id.idx)
                    .and_then(|s| s.tuple())
                    .is_ok_and(|t| t == want)
                    && self
                        .check_channel(*id)
                        .is_ok_and(|w| c_phase(w) == C_OFFERED)
            })
    }

    /// Whether the OFFERED slot `slot` holds a late-ring offer (its switch word is set before
    /// it is published; a normal offer's is zero until it is accepted).
    pub(crate) fn is_late_offer(slot: &ChannelSlot<'_>) -> bool {
        slot.switch_word()
            .is_ok_and(|w| w.load(Acquire) == SwitchWord::LATE_OFFER)
    }

    /// Whether the slot holds a datagram pair: a TCP connection's lookups by client address
    /// never see one, even where the index cannot keep them apart (an index position shared
    /// with an endpoint key, or a table scanned whole).
    pub(crate) fn is_datagram_pair(slot: &ChannelSlot<'_>) -> bool {
        slot.kind_code()
            .is_ok_and(|c| c == u32::from(ChannelKind::DatagramPair.code()))
    }

    /// RESERVED → OFFERED for a built offer, with the endpoint's backlog and doorbell. A
    /// `late` offer is for a connection that exists already: it stands whether the listener
    /// is still there or not.
    fn publish_offer(
        &self,
        id: ChannelId,
        reserved: StateWord,
        client: MemberId,
        (ep, key): (EndpointId, IndexKey),
        kind: ChannelKind,
        late: bool,
    ) -> Result<ChannelId, RegistryError> {
        let epk = pack_id(ep.idx, ep.gen);
        let pos = self.index_insert(key, id);
        self.channel_slot(id.idx)?.set_index_pos(pos)?;
        self.backlog_add(epk, true);
        if !self.cas_channel(id.idx, reserved, with_phase(reserved, C_OFFERED))? {
            self.backlog_add(epk, false);
            return Err(self.offer_lost(id));
        }
        let _ = self.ring_doorbell(ep);
        if !late && self.live_endpoint(ep).is_err() && self.cancel(id, client).is_ok() {
            return Err(RegistryError::NotFound); // the listener went away meanwhile
        }
        tracing::trace!(?id, ?ep, %kind, "channel offered");
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

    pub(crate) fn reserve(
        &self,
        client: MemberId,
    ) -> Result<(ChannelId, StateWord), RegistryError> {
        let tag = member_tag(client);
        let n = self.layout.params.max_channels;
        let found = self.next_fit(crate::header::H_CHANNEL_HINT, n, |idx| {
            let slot = self.channel_slot(idx).ok()?;
            let w = slot.word().ok()?;
            if c_phase(w) != C_FREE {
                return None;
            }
            let reserved = StateWord::new(w.gen(), tag, C_RESERVED);
            if !slot.cas(w, reserved).ok()? {
                return None;
            }
            // Ours while RESERVED: a free before publication must not undo an index entry of
            // the slot's previous occupant.
            slot.set_index_pos(NOT_INSERTED).ok()?;
            Some((ChannelId { idx, gen: w.gen() }, reserved))
        });
        found.ok_or_else(|| self.full("channels"))
    }

    /// The c2s ring offset recorded in the entry (possibly stale: callers verify by tag).
    pub(crate) fn channel_c2s(&self, ch: ChannelId) -> Option<u64> {
        self.channel_slot(ch.idx).ok()?.c2s().ok()
    }

    /// Memory for two rings of `want` bytes each — or, when the ring heap runs short, of a
    /// smaller capacity: a quarter of `want` once a quarter of the heap is in use, a
    /// sixteenth past half, a sixty-fourth past three quarters, never below
    /// [`PRESSURE_FLOOR`] (nor above `want`). Where even that is not free, smaller still down
    /// to the floor: a connection falls back only when a floor-sized pair does not fit.
    /// Returns the capacity and the first segment (memory reserved).
    fn alloc_rings(&self, id: ChannelId, want: u64) -> Result<(u64, u64), RegistryError> {
        let floor = want.min(PRESSURE_FLOOR);
        let mut cap = self.capacity_under_pressure(want).max(floor);
        loop {
            let k = self.segments_for(2 * Self::ring_stride(cap));
            match self.alloc_segments(id, k) {
                Ok(first) => return Ok((cap, first)),
                Err(RegistryError::RegionFull {
                    what: "ring memory",
                }) if cap > floor => {
                    cap = (cap / 4).max(floor);
                }
                Err(RegistryError::RegionFull { what }) => return Err(self.full(what)),
                Err(e) => return Err(e),
            }
        }
    }

    /// `want` scaled down by how much of the ring heap is in use (see `alloc_rings`).
    fn capacity_under_pressure(&self, want: u64) -> u64 {
        let n = self.layout.nsegments.max(1);
        let used = self
            .header_hint(crate::header::H_SEGMENTS_USED)
            .map_or(0, |w| w.load(Relaxed))
            .min(n);
        let shift = match used * 4 / n {
            0 => 0,
            1 => 2,
            2 => 4,
            _ => 6,
        };
        want >> shift
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
        kind: ChannelKind,
        cap: u64,
        tuple: Option<ConnTuple>,
    ) -> Result<(), RegistryError> {
        let (cap, first) = self.alloc_rings(id, cap)?;
        let stride = Self::ring_stride(cap);
        let c2s = self.segment_offset(first);
        let fields = ChannelFields {
            server: 0,
            client: pack_id(client.idx, client.gen),
            endpoint: pack_id(ep.idx, ep.gen),
            created: self.next_seq(H_CREATE_SEQ)?,
            capacity: cap,
            c2s,
            s2c: c2s + stride,
            kind: kind.code() as u32,
            tuple: tuple.map(|t| encode_tuple(&t)).unwrap_or([0; TUPLE_BYTES]),
            holders: 1,
        };
        self.channel_slot(id.idx)?.write(&fields)?;
        self.note_kind(id.idx, kind)?;
        let (k1, k2) = kind.ring_kinds();
        for (off, rk) in [(c2s, k1), (c2s + stride, k2)] {
            let view = self.view.slice(off, ring_bytes(cap))?;
            // A stream ring starts with a small window and grows while busy (the ring
            // header's module text); memory is reserved for what is in use, before any of
            // it is touched (the region file is sparse: on a full file system a write to
            // an unbacked page is a SIGBUS, a failed reservation a full region).
            let window = match rk {
                RingKind::Stream => cap.min(INITIAL_WINDOW),
                _ => cap,
            };
            view.commit(0, ring_bytes(window))
                .map_err(crate::header::no_room)?;
            let slot = match rk {
                RingKind::Slots => memloop_ring::Descriptor::SIZE as u32,
                _ => 0,
            };
            init_ring_windowed(&view, rk, cap, slot, window)?;
        }
        Ok(())
    }

    /// The holders and lock words of `side` of an OFFERED or ACCEPTED channel (a client may
    /// fork before the server accepts). The views stay valid memory but name the slot, not the
    /// incarnation: use them only while this side is held open.
    pub fn side_words(&self, ch: ChannelId, side: Side) -> Result<SideWords, RegistryError> {
        let (slot, w) = self.channel_entry(ch)?;
        let w = Self::not_marker(w)?;
        if !matches!(c_phase(w), C_OFFERED | C_ACCEPTED) {
            return Err(RegistryError::wrong(
                "OFFERED or ACCEPTED",
                phase_name(c_phase(w)),
            ));
        }
        slot.side(side)
    }

    /// Frees the slot if its word is still `w`: FREE with generation + 1, then its segments.
    /// Returns whether this call freed it. A freer dying after the CAS leaves orphan segments,
    /// which `sweep_orphans` recognises by their stale generation.
    pub(crate) fn free_channel(&self, id: ChannelId, w: StateWord) -> Result<bool, RegistryError> {
        let slot = self.channel_slot(id.idx)?;
        let ep = slot.endpoint()?;
        // Read while the word is still `w` (the CAS below proves it was): once FREE, the slot
        // may be reused at once.
        let carried = if is_marker(w) {
            0
        } else {
            self.bytes_carried(&slot)
        };
        let indexed = slot.index_pos()?;
        if !slot.cas(w, StateWord::new(id.gen.wrapping_add(1), 0, C_FREE))? {
            return Ok(false);
        }
        self.index_remove(indexed, id);
        // Counted once, by whoever frees the channel (its last side to close, or the
        // reclaimer of a member that died): a process killed without closing is counted too.
        self.add_counter(crate::COUNTER_RING_BYTES, carried);
        // (A CANCELLED channel was an offer until it is freed: see `withdraw_offer`.)
        if matches!(c_phase(w), C_OFFERED | C_CANCELLED) && !is_marker(w) {
            self.backlog_add(ep, false);
        }
        if is_marker(w) {
            self.markers_gone(1);
        }
        // (A marker never has ring memory: no scan of the heap's tags for it.)
        let segs = if is_marker(w) {
            0
        } else {
            self.release_segments(id)
        };
        tracing::trace!(?id, segs, "channel freed");
        Ok(true)
    }

    /// Reads the endpoint and creation counter of an OFFERED channel, consistently.
    fn offered_fields(
        &self,
        slot: &ChannelSlot,
        w: StateWord,
    ) -> Result<Option<(u64, u64)>, RegistryError> {
        let ep = slot.endpoint()?;
        let created = slot.created()?;
        fence(Acquire);
        Ok((slot.word()? == w).then_some((ep, created)))
    }

    /// Offers to `ep` that are OFFERED right now, as (id, creation counter); late-ring
    /// offers are not for the agreement of a new connection.
    /// Only those found under `key` in the offer index (every one with `None`: a scan).
    fn offers_to(&self, ep: EndpointId, key: Option<IndexKey>) -> Vec<(ChannelId, u64)> {
        self.offers_to_any(ep, key, false)
    }

    /// [`Registry::offers_to`]: only late-ring offers if `late`, none of them otherwise.
    fn offers_to_any(
        &self,
        ep: EndpointId,
        key: Option<IndexKey>,
        late: bool,
    ) -> Vec<(ChannelId, u64)> {
        let epk = pack_id(ep.idx, ep.gen);
        let mut out = Vec::new();
        let slots = match key {
            Some(k) => self.slots_for(k),
            None => (0..self.layout.params.max_channels).collect(),
        };
        for idx in slots {
            let Ok(slot) = self.channel_slot(idx) else {
                continue;
            };
            let Ok(w) = slot.word() else {
                continue;
            };
            if c_phase(w) != C_OFFERED {
                continue;
            }
            let by_client = matches!(key, Some(IndexKey::Client(_)));
            if by_client && Self::is_datagram_pair(&slot) {
                continue;
            }
            if let Ok(Some((e, created))) = self.offered_fields(&slot, w) {
                if e == epk && Self::is_late_offer(&slot) == late {
                    out.push((ChannelId { idx, gen: w.gen() }, created));
                }
            }
        }
        out
    }

    /// Whether an offer without a connection tuple (the native API's) waits for `ep`.
    pub fn has_native_offer(&self, ep: EndpointId) -> bool {
        let key = IndexKey::Endpoint(pack_id(ep.idx, ep.gen));
        !self.offers_to(ep, Some(key)).is_empty()
    }

    /// Accepts the oldest pending offer to `ep`, if any. Offers of a kind this build cannot
    /// use are declined (the client falls back) and skipped.
    pub fn take_offer(
        &self,
        ep: EndpointId,
        server: MemberId,
    ) -> Result<Option<ChannelId>, RegistryError> {
        self.take_offer_of(ep, server, None)
    }

    /// [`Registry::take_offer`] for a server that speaks only channels of `kind` (if given):
    /// an offer of another kind is declined, so its client hears at once.
    pub fn take_offer_of(
        &self,
        ep: EndpointId,
        server: MemberId,
        kind: Option<ChannelKind>,
    ) -> Result<Option<ChannelId>, RegistryError> {
        self.live_member(server)?;
        self.live_endpoint(ep)?;
        for _ in 0..=self.layout.params.max_channels {
            let key = IndexKey::Endpoint(pack_id(ep.idx, ep.gen));
            let offers = self.offers_to(ep, Some(key));
            let Some((id, _)) = offers.into_iter().min_by_key(|&(_, c)| c) else {
                return Ok(None);
            };
            let code = self.channel_slot(id.idx)?.kind_code()?;
            if kind.is_some_and(|k| k.code() as u32 != code) {
                tracing::debug!(?id, code, "declining an offer of another kind");
                self.decline(id).ok();
                continue;
            }
            match self.accept(id, server) {
                Ok(()) => return Ok(Some(id)),
                Err(
                    RegistryError::Stale
                    | RegistryError::NotFound
                    | RegistryError::WrongState { .. },
                ) => {}
                Err(
                    e @ (RegistryError::UnknownChannelKind { .. }
                    | RegistryError::UnsupportedChannelKind(_)),
                ) => {
                    tracing::debug!(?id, error = %e, "declining an offer of another kind");
                    self.decline(id).ok();
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// The kind recorded in a channel slot; unknown codes and kinds this build cannot use are
    /// typed errors.
    fn usable_kind(slot: &ChannelSlot<'_>) -> Result<ChannelKind, RegistryError> {
        ChannelKind::from_code(slot.kind_code()?)?.require_supported()
    }

    /// OFFERED → ACCEPTED by `server`. Refuses channels of a kind this build cannot use.
    pub fn accept(&self, ch: ChannelId, server: MemberId) -> Result<(), RegistryError> {
        self.live_member(server)?;
        let (slot, w) = self.channel_entry(ch)?;
        if c_phase(w) != C_OFFERED {
            return Err(RegistryError::wrong("OFFERED", phase_name(c_phase(w))));
        }
        // Published by the CAS to OFFERED; if the slot is recycled meanwhile our CAS fails.
        Self::usable_kind(&slot)?;
        let me = pack_id(server.idx, server.gen);
        let sw = slot.server_cell()?;
        match sw.compare_exchange(0, me, SeqCst, Relaxed) {
            Ok(_) => {}
            Err(cur) if cur == me => {}
            Err(_) => return Err(RegistryError::wrong("OFFERED", "being accepted")),
        }
        let ep = slot.endpoint()?;
        // Decided before the accept shows: a client that sees it accepted finds the decision.
        slot.decide_word()?.decide();
        if !slot.cas(w, with_phase(w, C_ACCEPTED))? {
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
        if self.no_offers() {
            return None;
        }
        let want = encode_tuple(tuple);
        self.offers_to(server_ep, Some(IndexKey::Client(tuple.client)))
            .into_iter()
            .map(|(id, _)| id)
            .find(|id| {
                let Ok(t) = self.channel_slot(id.idx).and_then(|s| s.tuple()) else {
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
            let (slot, w) = self.channel_entry(ch)?;
            match c_phase(w) {
                C_DECLINED => return Ok(()),
                C_RESERVED | C_OFFERED => {
                    let ep = slot.endpoint()?;
                    if slot.cas(w, with_phase(w, C_DECLINED))? {
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
    /// already accepted (the client must then use the channel). Also frees a DECLINED channel,
    /// and one [`Self::withdraw_offer`] left CANCELLED.
    pub fn cancel(&self, ch: ChannelId, client: MemberId) -> Result<(), RegistryError> {
        let w = self.cancel_phase(ch, client)?;
        self.free_channel(ch, w)?;
        Ok(())
    }

    /// OFFERED → CANCELLED, the channel kept (and counted in its endpoint's backlog) until
    /// [`Self::cancel`] frees it: a datagram sender re-sending by the kernel what it had
    /// queued shows its receiver that more is on the way ([`Self::withdrawing_to`]).
    pub fn withdraw_offer(&self, ch: ChannelId, client: MemberId) -> Result<(), RegistryError> {
        self.cancel_phase(ch, client).map(|_| ())
    }

    /// Moves an offer of `client` to CANCELLED (a no-op on RESERVED, CANCELLED and DECLINED);
    /// the word it left.
    fn cancel_phase(&self, ch: ChannelId, client: MemberId) -> Result<StateWord, RegistryError> {
        for _ in 0..RETRIES {
            let (slot, w) = self.channel_entry(ch)?;
            let w = Self::not_marker(w)?;
            if w.tag() != member_tag(client) {
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
            if next == w || slot.cas(w, next)? {
                return Ok(next);
            }
        }
        Err(RegistryError::corrupt(
            "channel state",
            "cancel did not converge",
        ))
    }

    /// Whether an offer to `ep` is being withdrawn ([`Self::withdraw_offer`]): its datagrams
    /// are on their way by the kernel. One load while the endpoint has no offers.
    pub fn withdrawing_to(&self, ep: EndpointId) -> bool {
        if self.backlog(ep).unwrap_or(0) == 0 {
            return false;
        }
        let epk = pack_id(ep.idx, ep.gen);
        self.slots_for(IndexKey::Endpoint(epk))
            .into_iter()
            .any(|idx| {
                let Ok(slot) = self.channel_slot(idx) else {
                    return false;
                };
                let w = slot.word();
                let e = slot.endpoint();
                // (The endpoint read between two reads of the word: a recycled slot fails it.)
                matches!(w, Ok(w) if c_phase(w) == C_CANCELLED && !is_marker(w))
                    && e.ok() == Some(epk)
                    && slot.word().ok() == w.ok()
            })
    }

    pub fn channel_state(&self, ch: ChannelId) -> Result<ChannelState, RegistryError> {
        let w = self.check_channel(ch)?;
        phase_state(c_phase(w)).ok_or_else(|| bad_state("channel state", ch.idx, w))
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
        w: StateWord,
        side: Side,
        bit: u8,
    ) -> Result<bool, RegistryError> {
        if gone(w, other(side)) {
            return self.free_channel(ch, w);
        }
        if w.low() & bit != 0 {
            return Ok(true);
        }
        self.cas_channel(ch.idx, w, with_flag(w, bit))
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

    /// Moves `side` of accepted channel `ch` from member `from` to member `to`: a process
    /// that adopted the connection's socket (received with `SCM_RIGHTS`) answers for that
    /// side's liveness from now on, so the sender's exit no longer reads as the side's death.
    /// Refused if the side is closed or dead, or not `from`'s.
    pub fn transfer_side(
        &self,
        ch: ChannelId,
        side: Side,
        from: MemberId,
        to: MemberId,
    ) -> Result<(), RegistryError> {
        let (old, new) = (pack_id(from.idx, from.gen), pack_id(to.idx, to.gen));
        for _ in 0..RETRIES {
            let (slot, w) = self.channel_entry(ch)?;
            let w = Self::not_marker(w)?;
            if c_phase(w) != C_ACCEPTED || gone(w, side) {
                return Err(RegistryError::wrong(
                    "a live accepted side",
                    phase_name(c_phase(w)),
                ));
            }
            match side {
                Side::Server => {
                    let cell = slot.server_cell()?;
                    return match cell.compare_exchange(old, new, SeqCst, SeqCst) {
                        Ok(_) => Ok(()),
                        Err(_) => Err(RegistryError::Stale),
                    };
                }
                // The client's tag rides in the state word (the reclaimer looks there).
                Side::Client if w.tag() != member_tag(from) => return Err(RegistryError::Stale),
                Side::Client => {
                    let moved = StateWord::new(w.gen(), member_tag(to), w.low());
                    if self.cas_channel(ch.idx, w, moved)? {
                        slot.set_client(new)?;
                        return Ok(());
                    }
                }
            }
        }
        Err(RegistryError::Stale)
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
            let (slot, w) = self.channel_entry(ch)?;
            let raw = RawChannel {
                server: slot.server()?,
                client: slot.client()?,
                endpoint: slot.endpoint()?,
                capacity: slot.capacity()?,
                kind: slot.kind_code()?,
                tuple: slot.tuple()?,
            };
            fence(Acquire);
            if slot.word()? == w {
                return self.decode_channel(ch, w, &raw);
            }
        }
        Err(RegistryError::corrupt("channel", "entry kept changing"))
    }

    fn decode_channel(
        &self,
        id: ChannelId,
        w: StateWord,
        raw: &RawChannel,
    ) -> Result<ChannelInfo, RegistryError> {
        let p = &self.layout.params;
        let bad = |what: &'static str, v: u64| {
            RegistryError::corrupt(what, format!("channel {}: {v:#x}", id.idx))
        };
        let state = phase_state(c_phase(w)).ok_or_else(|| bad_state("channel state", id.idx, w))?;
        let member = |v: u64| unpack_id(v, p.max_members).map(|(idx, gen)| MemberId { idx, gen });
        let client = member(raw.client).ok_or_else(|| bad("channel client", raw.client))?;
        let server = if raw.server == 0 {
            None
        } else {
            Some(member(raw.server).ok_or_else(|| bad("channel server", raw.server))?)
        };
        let (eidx, egen) = unpack_id(raw.endpoint, p.max_endpoints)
            .ok_or_else(|| bad("channel endpoint", raw.endpoint))?;
        let kind = match (is_marker(w), raw.kind) {
            (true, 0) => None,
            (true, k) => return Err(bad("decline marker kind", k as u64)),
            (false, k) => Some(ChannelKind::from_code(k)?),
        };
        Ok(ChannelInfo {
            id,
            state,
            kind,
            client,
            server,
            endpoint: EndpointId {
                idx: eidx,
                gen: egen,
            },
            tuple: decode_tuple(&raw.tuple)?,
            client_closed: w.low() & CLIENT_CLOSED != 0,
            server_closed: w.low() & SERVER_CLOSED != 0,
            client_dead: w.low() & CLIENT_DEAD != 0,
            server_dead: w.low() & SERVER_DEAD != 0,
            ring_capacity: raw.capacity,
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
            match self.channel(ChannelId { idx, gen: w.gen() }) {
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
        for (id, _) in self.offers_to(ep, None) {
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
            let id = ChannelId { idx, gen: w.gen() };
            let phase = c_phase(w);
            if phase == C_FREE || phase > C_DECLINED {
                continue;
            }
            let (f, m) = if w.tag() == tag {
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
        let Ok((slot, w)) = self.channel_entry(id) else {
            return (0, 0);
        };
        if slot.server().unwrap_or(0) != packed {
            return (0, 0);
        }
        if c_phase(w) == C_ACCEPTED {
            return self.reclaim_side(id, Side::Server);
        }
        if let Ok(s) = slot.server_cell() {
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
            if w.tag() != tag {
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

/// A channel entry's fields, read before the state word is re-checked.
struct RawChannel {
    server: u64,
    client: u64,
    endpoint: u64,
    capacity: u64,
    kind: u32,
    tuple: [u8; TUPLE_BYTES],
}

#[cfg(all(test, not(loom)))]
mod tests;
