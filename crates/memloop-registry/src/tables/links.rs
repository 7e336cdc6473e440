//! Links (`memloop link`): named point-to-point network links between two domains. Each side of
//! a link — a *half* — is a service process owning a TUN device; the frames cross a channel of
//! their own (not this table's business). What the table holds is what either side, and
//! `memloop status` run from any domain or VM on the region, sees of a link: its name, who holds
//! each half, each half's interface and counters.
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | state word: generation, tag, phase (FREE, RESERVED, NAMED, LIVE, CLOSING) |
//! | 8 | name length (1..=48 bytes) |
//! | 16..64 | name (UTF-8, zero-padded) |
//! | 64..256 | half 0 (below) |
//! | 256..448 | half 1 |
//! | 448..512 | reserved (zero) |
//!
//! A half, from its start:
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | member: packed member id of its holder (0: empty) |
//! | 8 | description sequence: odd while the holder rewrites 24..80 |
//! | 16 | flags: bit 0 carrier up; bits 32..56 the member tag of the holder who wrote them |
//! | 24, 28 | pid, MTU (u32) |
//! | 32, 36 | negotiated offloads (u32 bits), IPv4 address (u32, `u32::from(Ipv4Addr)`) |
//! | 40 | IPv4 prefix + 1 (byte 0), IPv6 prefix + 1 (byte 1); 0: no address |
//! | 48..64 | interface name (zero-padded) |
//! | 64..80 | IPv6 address |
//! | 80..104 | counters (u64): tx packets, tx bytes, rx packets |
//! | 104..136 | rx bytes, drops_full (ring full), drops_bad (malformed frames refused), restarts |
//! | 136..192 | reserved (zero) |
//!
//! **Lifetime.** A joiner that finds no link of its name takes a FREE slot (RESERVED, tagged
//! with its member tag), writes the name and clears the halves, publishes the name (NAMED) and
//! makes it LIVE unless a rival holds the name; then it claims a half like any joiner. A slot
//! whose halves are both empty goes LIVE → CLOSING → FREE (generation + 1).
//!
//! **One slot per name.** Two joiners may create the same name at once. As with endpoint
//! insertion, each publishes its name (NAMED, a SeqCst CAS) before it scans the table for the
//! same name (SeqCst loads), so of two racing creators at least one sees the other: a LIVE (or
//! CLOSING) rival wins; of two NAMED ones the lower index wins — the higher backs off at once,
//! the lower waits for the higher to resolve. The loser frees its slot and looks again, waiting
//! there for a NAMED slot of its name to resolve rather than naming one of its own again (which
//! the winner, waiting on it, would see), and joins the winner. Halves are only ever claimed in
//! LIVE slots, so nobody is left in a slot that loses. (Publishing LIVE at once and giving the
//! slot up after a rescan would not do: a joiner may claim a half between the publication and
//! the rescan, and a lower slot published later can win a rescan that a higher one already
//! passed.)
//!
//! **Halves.** A joiner claims a half by a CAS on its member word: from 0, or from a member that
//! is gone (not LIVE in the registry, or dead by the caller's test). A half taken over starts
//! afresh — description, flags and counters cleared — except its restarts (sessions started,
//! as its holders count them), which go on across holders. Freeing must not race a claim: the
//! freer moves the slot LIVE → CLOSING and then reads both member words; a claimer CASes a
//! member word and then reads the state word (both SeqCst: a Dekker pair). Either the freer sees
//! the claim and moves back to LIVE, or the claimer sees CLOSING and moves back to LIVE itself
//! (it holds a half) — unless the freer's CAS to FREE came first: then the claim is void, undone
//! and retried. Anyone may settle a CLOSING slot (FREE if both halves are empty, else LIVE), so
//! a freer that dies half-way leaves nothing stuck. The tag of a LIVE or CLOSING word counts the
//! returns to LIVE, so a freer whose look at the halves has gone stale cannot free the slot (no
//! ABA). One window is left: a joiner that read a slot's word just before it was freed and
//! taken again may, for an instant, hold a half of the new link before its check undoes it; a
//! joiner of that new link may meet it there and be told `LinkBusy`.
//!
//! **Description and counters.** Only a half's holder writes its description, under the half's
//! sequence word (a seqlock): a reader retries a torn read a few times, then takes what it got
//! (it is status, and every field is validated). Counters are relaxed adds by the holder. The
//! flags word names the holder who wrote it, so a reclaimer clears the carrier of a dead holder
//! with a CAS that cannot touch the flags of the member that took the half over.

use crate::error::RegistryError;
use crate::key::{member_tag, pack_id, unpack_id, MemberId};
use crate::state_word::StateWord;
use crate::tables::slot_view;
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, Release};
use std::net::{Ipv4Addr, Ipv6Addr};

const L_FREE: u8 = 0;
const L_RESERVED: u8 = 1;
const L_NAMED: u8 = 2;
const L_LIVE: u8 = 3;
const L_CLOSING: u8 = 4;

const F_NAME_LEN: u64 = 8;
const F_NAME: u64 = 16;
const NAME_WORDS: usize = MAX_LINK_NAME / 8;
/// Where each half starts.
const HALVES: [u64; 2] = [64, 256];
const HALF_BYTES: u64 = 192;
// Fields of a half, from its start.
const F_MEMBER: u64 = 0;
const F_SEQ: u64 = 8;
const F_FLAGS: u64 = 16;
/// The description: pid·MTU, offloads·IPv4, prefixes, interface name (2), IPv6 (2).
const F_DESC: u64 = 24;
const DESC_WORDS: usize = 7;
const F_COUNTERS: u64 = 80;
const NCOUNTERS: usize = 7;
/// Index of restarts among the counters.
const RESTARTS: usize = 6;
const _: () = assert!(F_NAME + MAX_LINK_NAME as u64 <= HALVES[0]);
const _: () = assert!(F_DESC + 8 * DESC_WORDS as u64 == F_COUNTERS);
const _: () = assert!(F_COUNTERS + 8 * NCOUNTERS as u64 <= HALF_BYTES);
const _: () = assert!(HALVES[0] + HALF_BYTES <= HALVES[1]);
const _: () = assert!(HALVES[1] + HALF_BYTES <= crate::header::LINK_BYTES);

/// Flags bit: the holder's carrier is up.
const CARRIER: u64 = 1;

/// Longest link name, in bytes of UTF-8.
pub const MAX_LINK_NAME: usize = 48;
/// Longest interface name (`IFNAMSIZ` less its NUL).
pub const MAX_LINK_IFNAME: usize = 15;

/// Rounds of look-up, creation and claim before a join gives up (each failed round is another
/// joiner's progress).
const JOIN_TRIES: usize = 64;
/// How long a creator waits for a higher-indexed rival to resolve.
const RESOLVE_SPINS: usize = 100_000;
/// Tries of a torn description read before the reader takes what it got.
const SEQ_TRIES: usize = 16;
/// CAS rounds on one slot's state word before it counts as corrupt.
const STATE_TRIES: usize = 1000;

/// A link slot and the generation of its occupant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinkRef {
    pub idx: u32,
    pub gen: u32,
}

/// A half's counters, as read ([`Registry::links`]) or as added ([`Registry::link_count`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkCounters {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Frames dropped because the ring was full.
    pub drops_full: u64,
    /// Malformed frames refused.
    pub drops_bad: u64,
    /// Sessions started on this half, as its holders count them ([`Registry::link_count`]);
    /// unlike the others, it survives a takeover of the half.
    pub restarts: u64,
}

impl LinkCounters {
    fn to_array(self) -> [u64; NCOUNTERS] {
        [
            self.tx_packets,
            self.tx_bytes,
            self.rx_packets,
            self.rx_bytes,
            self.drops_full,
            self.drops_bad,
            self.restarts,
        ]
    }

    fn from_array(a: [u64; NCOUNTERS]) -> Self {
        let [tx_packets, tx_bytes, rx_packets, rx_bytes, drops_full, drops_bad, restarts] = a;
        Self {
            tx_packets,
            tx_bytes,
            rx_packets,
            rx_bytes,
            drops_full,
            drops_bad,
            restarts,
        }
    }
}

/// What a half's holder says about its side ([`Registry::link_describe`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkHalfDesc {
    pub pid: u32,
    pub mtu: u32,
    /// The TUN device's name (at most [`MAX_LINK_IFNAME`] bytes, no NUL).
    pub ifname: String,
    pub ipv4: Option<(Ipv4Addr, u8)>,
    pub ipv6: Option<(Ipv6Addr, u8)>,
    /// Negotiated offloads (bits the link service defines).
    pub offloads: u32,
}

impl LinkHalfDesc {
    /// The description words (see the layout), or `InvalidParams`.
    fn encode(&self) -> Result<[u64; DESC_WORDS], RegistryError> {
        let bad = |what: String| Err(RegistryError::InvalidParams(what));
        if self.ifname.len() > MAX_LINK_IFNAME || self.ifname.contains('\0') {
            return bad(format!(
                "interface name {:?}: at most {MAX_LINK_IFNAME} bytes, no NUL",
                self.ifname
            ));
        }
        if let Some((a, p)) = self.ipv4.filter(|&(_, p)| p > 32) {
            return bad(format!("IPv4 prefix {a}/{p}: at most 32"));
        }
        if let Some((a, p)) = self.ipv6.filter(|&(_, p)| p > 128) {
            return bad(format!("IPv6 prefix {a}/{p}: at most 128"));
        }
        let (v4, p4) = self.ipv4.map_or((0, 0), |(a, p)| (u32::from(a), p + 1));
        let (v6, p6) = self.ipv6.map_or(([0; 16], 0), |(a, p)| (a.octets(), p + 1));
        let mut ifname = [0u8; 16];
        ifname[..self.ifname.len()].copy_from_slice(self.ifname.as_bytes());
        let [n0, n1] = words16(&ifname);
        let [a0, a1] = words16(&v6);
        Ok([
            u64::from(self.pid) | u64::from(self.mtu) << 32,
            u64::from(self.offloads) | u64::from(v4) << 32,
            u64::from(p4) | u64::from(p6) << 8,
            n0,
            n1,
            a0,
            a1,
        ])
    }
}

/// One side of a link, validated ([`Registry::links`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkHalf {
    pub member: MemberId,
    pub pid: u32,
    pub carrier: bool,
    pub mtu: u32,
    pub ifname: String,
    pub ipv4: Option<(Ipv4Addr, u8)>,
    pub ipv6: Option<(Ipv6Addr, u8)>,
    pub offloads: u32,
    pub counters: LinkCounters,
}

impl LinkHalf {
    /// A half from its member, flags, description words and counters; whatever a peer may have
    /// scribbled decodes to something (an unreadable name lossily, a bad prefix as no address).
    fn decode(member: MemberId, flags: u64, d: [u64; DESC_WORDS], c: [u64; NCOUNTERS]) -> Self {
        let [pid_mtu, offl_v4, prefixes, n0, n1, a0, a1] = d;
        let (p4, p6) = (prefixes as u8, (prefixes >> 8) as u8);
        let v4 = Ipv4Addr::from((offl_v4 >> 32) as u32);
        let v6 = Ipv6Addr::from(bytes16([a0, a1]));
        let name = bytes16([n0, n1]);
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        LinkHalf {
            member,
            pid: pid_mtu as u32,
            carrier: flags & CARRIER != 0,
            mtu: (pid_mtu >> 32) as u32,
            ifname: String::from_utf8_lossy(&name[..end]).into_owned(),
            ipv4: (1..=33).contains(&p4).then(|| (v4, p4 - 1)),
            ipv6: (1..=129).contains(&p6).then(|| (v6, p6 - 1)),
            offloads: offl_v4 as u32,
            counters: LinkCounters::from_array(c),
        }
    }
}

/// A LIVE link: its name and its two halves (`None`: nobody holds it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub link: LinkRef,
    pub name: String,
    pub halves: [Option<LinkHalf>; 2],
}

fn words16(b: &[u8; 16]) -> [u64; 2] {
    let mut w = [0u64; 2];
    for (w, c) in w.iter_mut().zip(b.chunks_exact(8)) {
        *w = u64::from_le_bytes(c.try_into().unwrap_or_default());
    }
    w
}

fn bytes16(w: [u64; 2]) -> [u8; 16] {
    let mut b = [0u8; 16];
    for (c, w) in b.chunks_exact_mut(8).zip(w) {
        c.copy_from_slice(&w.to_le_bytes());
    }
    b
}

/// A link name as the slot stores it: length and zero-padded words.
#[derive(PartialEq, Eq)]
struct LinkName {
    len: u64,
    words: [u64; NAME_WORDS],
}

impl LinkName {
    fn new(name: &str) -> Result<Self, RegistryError> {
        if name.is_empty() || name.len() > MAX_LINK_NAME {
            return Err(RegistryError::BadLinkName {
                name: name.to_owned(),
                len: name.len(),
                max: MAX_LINK_NAME,
            });
        }
        let mut b = [0u8; MAX_LINK_NAME];
        b[..name.len()].copy_from_slice(name.as_bytes());
        let mut words = [0u64; NAME_WORDS];
        for (w, c) in words.iter_mut().zip(b.chunks_exact(8)) {
            *w = u64::from_le_bytes(c.try_into().unwrap_or_default());
        }
        Ok(Self {
            len: name.len() as u64,
            words,
        })
    }

    /// The name for display: lossy UTF-8, or "?" for a length out of range.
    fn display(&self) -> String {
        let Some(len) = usize::try_from(self.len)
            .ok()
            .filter(|l| (1..=MAX_LINK_NAME).contains(l))
        else {
            return "?".into();
        };
        let b: Vec<u8> = self.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        String::from_utf8_lossy(&b[..len]).into_owned()
    }
}

/// What a claim of a half came to.
enum Claim {
    Got(u8),
    /// Both halves are held by live members.
    Busy,
    /// The slot moved on (freed, or a half changed under us): look again.
    Gone,
}

slot_view!(
    /// Typed view of one link slot.
    LinkSlot,
    links
);

impl LinkSlot<'_> {
    fn half(h: u8) -> u64 {
        HALVES[usize::from(h & 1)]
    }
    fn member(&self, h: u8) -> Result<u64, RegistryError> {
        self.0.ld_sc(Self::half(h) + F_MEMBER)
    }
    fn cas_member(&self, h: u8, old: u64, new: u64) -> Result<bool, RegistryError> {
        self.0.cas_data(Self::half(h) + F_MEMBER, old, new)
    }
    fn halves_empty(&self) -> Result<bool, RegistryError> {
        Ok(self.member(0)? == 0 && self.member(1)? == 0)
    }
    fn name(&self) -> Result<LinkName, RegistryError> {
        let mut words = [0u64; NAME_WORDS];
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.0.ld(F_NAME + 8 * i as u64)?;
        }
        Ok(LinkName {
            len: self.0.ld(F_NAME_LEN)?,
            words,
        })
    }
    /// Whether the slot, of word `w`, holds `key`: read, then checked to be the same
    /// incarnation and still named.
    fn named(&self, key: &LinkName, w: StateWord) -> Result<bool, RegistryError> {
        let same = self.name()? == *key;
        let now = self.word()?;
        Ok(same && now.gen() == w.gen() && matches!(now.low(), L_NAMED | L_LIVE | L_CLOSING))
    }
    /// A RESERVED slot's fields: the name, and both halves cleared.
    fn build(&self, key: &LinkName) -> Result<(), RegistryError> {
        self.0.st(F_NAME_LEN, key.len)?;
        for (i, &w) in key.words.iter().enumerate() {
            self.0.st(F_NAME + 8 * i as u64, w)?;
        }
        for base in HALVES {
            for off in (0..HALF_BYTES).step_by(8) {
                self.0.st(base + off, 0)?;
            }
        }
        Ok(())
    }
    /// The description words, read under the sequence word (a torn read is retried a few
    /// times; then it is taken as it is: status only, and decoded defensively).
    fn desc(&self, h: u8) -> Result<[u64; DESC_WORDS], RegistryError> {
        let base = Self::half(h);
        let mut d = [0u64; DESC_WORDS];
        for _ in 0..SEQ_TRIES {
            let s1 = self.0.ld(base + F_SEQ)?;
            fence(Acquire);
            for (i, w) in d.iter_mut().enumerate() {
                *w = self.0.ld(base + F_DESC + 8 * i as u64)?;
            }
            fence(Acquire);
            if s1 % 2 == 0 && self.0.ld(base + F_SEQ)? == s1 {
                break;
            }
            memloop_shm::sync::spin_hint();
        }
        Ok(d)
    }
    /// Rewrites the description (its holder only: one writer per half).
    fn write_desc(&self, h: u8, d: &[u64; DESC_WORDS]) -> Result<(), RegistryError> {
        let base = Self::half(h);
        // Odd while writing (a holder that died mid-write left it odd: it stays so until now).
        let odd = self.0.ld(base + F_SEQ)? | 1;
        self.0.st(base + F_SEQ, odd)?;
        fence(Release);
        for (i, &w) in d.iter().enumerate() {
            self.0.st(base + F_DESC + 8 * i as u64, w)?;
        }
        fence(Release);
        self.0.st(base + F_SEQ, odd.wrapping_add(1))
    }
    fn counters(&self, h: u8) -> Result<[u64; NCOUNTERS], RegistryError> {
        let mut c = [0u64; NCOUNTERS];
        for (i, v) in c.iter_mut().enumerate() {
            *v = self.0.ld(Self::half(h) + F_COUNTERS + 8 * i as u64)?;
        }
        Ok(c)
    }
    /// A freshly claimed half (its holder's tag `tag`): flags, description and counters
    /// cleared, but restarts.
    fn start(&self, h: u8, tag: u32) -> Result<(), RegistryError> {
        let base = Self::half(h);
        self.0.st(base + F_FLAGS, u64::from(tag) << 32)?;
        self.write_desc(h, &[0; DESC_WORDS])?;
        for i in (0..NCOUNTERS).filter(|&i| i != RESTARTS) {
            self.0.st(base + F_COUNTERS + 8 * i as u64, 0)?;
        }
        Ok(())
    }
    /// Carrier of holder `tag` up or down (other flags kept).
    fn set_carrier(&self, h: u8, tag: u32, up: bool) -> Result<(), RegistryError> {
        let off = Self::half(h) + F_FLAGS;
        let old = self.0.ld(off)?;
        let flags = (old & 0xffff_ffff & !CARRIER) | u64::from(up);
        self.0.st(off, flags | u64::from(tag) << 32)
    }
    /// The flags of holder `tag` cleared — only if it wrote them: never a later holder's.
    fn clear_flags_of(&self, h: u8, tag: u32) -> Result<(), RegistryError> {
        let off = Self::half(h) + F_FLAGS;
        let old = self.0.ld_sc(off)?;
        if old >> 32 == u64::from(tag) {
            self.0.cas_data(off, old, 0)?;
        }
        Ok(())
    }
}

/// A CLOSING word's way back to LIVE: one more return counted in the tag (see the module text).
fn reopened(w: StateWord) -> StateWord {
    StateWord::new(w.gen(), w.tag().wrapping_add(1), L_LIVE)
}

fn check_half(half: u8) -> Result<(), RegistryError> {
    if half > 1 {
        return Err(RegistryError::InvalidParams(format!(
            "link half {half}: a link has halves 0 and 1"
        )));
    }
    Ok(())
}

impl Registry {
    fn link_slot(&self, idx: u32) -> Result<LinkSlot<'_>, RegistryError> {
        LinkSlot::new_checked(self, idx)
    }

    fn link_member(&self, raw: u64) -> Option<MemberId> {
        let (idx, gen) = unpack_id(raw, self.layout.params.max_members)?;
        Some(MemberId { idx, gen })
    }

    /// Joins link `name` as `me`: the LIVE link of that name, or a new one, and in it a half
    /// that is empty or whose holder is gone — not LIVE in the registry, or dead by `alive` (a
    /// half taken over starts afresh, but for its restarts count). A member that already holds
    /// a half of the link gets that half back, untouched. Returns the link and the half (0, 1).
    ///
    /// `BadLinkName` for an empty name or one longer than [`MAX_LINK_NAME`] bytes; `LinkBusy`
    /// if both halves are held by live members; `RegionFull { what: "links" }` if the link is
    /// new and no slot is free. Racing creators of one name end on one slot (module text).
    pub fn link_join(
        &self,
        name: &str,
        me: MemberId,
        alive: impl Fn(MemberId) -> bool,
    ) -> Result<(LinkRef, u8), RegistryError> {
        let key = LinkName::new(name)?;
        self.live_member(me)?;
        for _ in 0..JOIN_TRIES {
            let found = match self.find_link(&key)? {
                Some(link) => Some(link),
                None => self.create_link(&key, me)?,
            };
            let Some(link) = found else {
                continue; // a rival took the name: join it
            };
            match self.claim_half(link, me, &alive)? {
                Claim::Got(half) => {
                    tracing::debug!(name, ?link, half, ?me, "link joined");
                    return Ok((link, half));
                }
                Claim::Busy => {
                    return Err(RegistryError::LinkBusy {
                        name: name.to_owned(),
                    })
                }
                Claim::Gone => {}
            }
        }
        Err(RegistryError::corrupt(
            "links",
            format!("joining link {name:?} did not settle in {JOIN_TRIES} rounds"),
        ))
    }

    /// The LIVE link named `key`, waiting for a creator of that name to resolve and settling a
    /// CLOSING one on the way. (A creator that lost to a NAMED rival waits here, instead of
    /// naming a slot again which the rival, waiting for it, would see.)
    fn find_link(&self, key: &LinkName) -> Result<Option<LinkRef>, RegistryError> {
        for idx in 0..self.layout.params.max_links {
            let slot = self.link_slot(idx)?;
            let mut w = slot.word()?;
            if w.low() == L_NAMED && slot.named(key, w)? {
                w = self.await_named(&slot, w)?;
            }
            if !matches!(w.low(), L_LIVE | L_CLOSING) || !slot.named(key, w)? {
                continue;
            }
            if w.low() == L_CLOSING {
                self.settle_link(&slot, w)?;
                w = slot.word()?;
                if w.low() != L_LIVE || !slot.named(key, w)? {
                    continue;
                }
            }
            return Ok(Some(LinkRef { idx, gen: w.gen() }));
        }
        Ok(None)
    }

    /// A new LIVE slot named `key`, or `None` if a rival holds the name (ours is freed then).
    fn create_link(&self, key: &LinkName, me: MemberId) -> Result<Option<LinkRef>, RegistryError> {
        let (slot, reserved) = self.reserve_link(member_tag(me))?;
        let idx = slot.0.idx();
        slot.build(key)?;
        let named = reserved.with_low(L_NAMED);
        if !slot.cas(reserved, named)? {
            return Err(RegistryError::Stale); // reclaimed under us: we were declared dead
        }
        if self.link_rival(idx, key) {
            slot.cas(named, named.next_gen(L_FREE))?;
            return Ok(None);
        }
        let live = StateWord::new(named.gen(), 0, L_LIVE);
        if !slot.cas(named, live)? {
            return Err(RegistryError::Stale);
        }
        Ok(Some(LinkRef {
            idx,
            gen: live.gen(),
        }))
    }

    fn reserve_link(&self, tag: u32) -> Result<(LinkSlot<'_>, StateWord), RegistryError> {
        for idx in 0..self.layout.params.max_links {
            let slot = self.link_slot(idx)?;
            let w = slot.word()?;
            if w.low() != L_FREE {
                continue;
            }
            let reserved = StateWord::new(w.gen(), tag, L_RESERVED);
            if slot.cas(w, reserved)? {
                return Ok((slot, reserved));
            }
        }
        Err(self.full("links"))
    }

    /// Whether another slot holds (or is about to hold) the name our NAMED slot `me` has.
    /// Errors reading count as a rival (backing off is always safe).
    fn link_rival(&self, me: u32, key: &LinkName) -> bool {
        (0..self.layout.params.max_links)
            .filter(|&idx| idx != me)
            .any(|idx| self.link_rival_at(idx, me, key).unwrap_or(true))
    }

    fn link_rival_at(&self, idx: u32, me: u32, key: &LinkName) -> Result<bool, RegistryError> {
        let slot = self.link_slot(idx)?;
        let w = slot.word()?;
        if !matches!(w.low(), L_NAMED | L_LIVE | L_CLOSING) || !slot.named(key, w)? {
            return Ok(false);
        }
        if w.low() != L_NAMED || idx < me {
            return Ok(true);
        }
        // A higher-indexed rival: it backs off if it saw us, else it goes LIVE. Wait for that;
        // a creator too slow for our patience wins too (we back off and look again).
        let now = self.await_named(&slot, w)?;
        Ok(
            now == w
                || matches!(now.low(), L_NAMED | L_LIVE | L_CLOSING) && slot.named(key, now)?,
        )
    }

    /// Waits for the NAMED slot of word `w` to move on; a creator that died there has it freed.
    /// Returns its word then (`w` still if its creator is slow).
    fn await_named(&self, slot: &LinkSlot<'_>, w: StateWord) -> Result<StateWord, RegistryError> {
        for _ in 0..RESOLVE_SPINS {
            let now = slot.word()?;
            if now != w {
                return Ok(now);
            }
            memloop_shm::sync::spin_hint();
        }
        if !self.tag_alive(w.tag()) {
            slot.cas(w, w.next_gen(L_FREE))?;
        }
        slot.word()
    }

    /// Claims a half of `link` for `me` (see [`Registry::link_join`]).
    fn claim_half(
        &self,
        link: LinkRef,
        me: MemberId,
        alive: &impl Fn(MemberId) -> bool,
    ) -> Result<Claim, RegistryError> {
        let slot = self.link_slot(link.idx)?;
        let mine = pack_id(me.idx, me.gen);
        for h in 0..2 {
            if slot.member(h)? == mine {
                let still = self.held_half(link, h).is_ok();
                return Ok(if still { Claim::Got(h) } else { Claim::Gone });
            }
        }
        for h in 0..2 {
            let cur = slot.member(h)?;
            let free = cur == 0
                || self
                    .link_member(cur)
                    .map_or(true, |m| self.live_member(m).is_err() || !alive(m));
            if !free {
                continue;
            }
            if !slot.cas_member(h, cur, mine)? {
                return Ok(Claim::Gone); // another joiner moved first: look again
            }
            if !self.confirm_claim(&slot, link)? {
                slot.cas_member(h, mine, 0)?;
                return Ok(Claim::Gone);
            }
            slot.start(h, member_tag(me))?;
            return Ok(Claim::Got(h));
        }
        let w = slot.word()?;
        let there = w.gen() == link.gen && matches!(w.low(), L_LIVE | L_CLOSING);
        Ok(if there { Claim::Busy } else { Claim::Gone })
    }

    /// After a claim's CAS: whether the slot is still `link`'s, LIVE — moved back from CLOSING
    /// if a freer is at work (we hold a half now). `false`: it was freed first, the claim is void.
    fn confirm_claim(&self, slot: &LinkSlot<'_>, link: LinkRef) -> Result<bool, RegistryError> {
        for _ in 0..STATE_TRIES {
            let w = slot.word()?;
            if w.gen() != link.gen {
                return Ok(false);
            }
            match w.low() {
                L_LIVE => return Ok(true),
                L_CLOSING if slot.cas(w, reopened(w))? => return Ok(true),
                L_CLOSING => {}
                _ => return Ok(false),
            }
        }
        Err(RegistryError::corrupt(
            "links",
            format!("slot {}: state kept moving under a claim", link.idx),
        ))
    }

    /// Settles a CLOSING slot of word `w`: FREE (generation + 1) if both halves are empty, else
    /// LIVE again. Anyone may; `Ok(true)` if this call freed it.
    fn settle_link(&self, slot: &LinkSlot<'_>, w: StateWord) -> Result<bool, RegistryError> {
        let empty = slot.halves_empty()?;
        let next = match empty {
            true => w.next_gen(L_FREE),
            false => reopened(w),
        };
        let freed = slot.cas(w, next)? && empty;
        if freed {
            tracing::debug!(link = slot.0.idx(), "link freed");
        }
        Ok(freed)
    }

    /// Frees `link` if both its halves are empty; `Ok(true)` if this call did.
    fn free_link_if_empty(&self, link: LinkRef) -> Result<bool, RegistryError> {
        let slot = self.link_slot(link.idx)?;
        for _ in 0..STATE_TRIES {
            let w = slot.word()?;
            if w.gen() != link.gen {
                return Ok(false);
            }
            match w.low() {
                L_LIVE if slot.halves_empty()? => {
                    let closing = w.with_low(L_CLOSING);
                    if slot.cas(w, closing)? {
                        return self.settle_link(&slot, closing);
                    }
                }
                L_CLOSING => return self.settle_link(&slot, w),
                _ => return Ok(false),
            }
        }
        Err(RegistryError::corrupt(
            "links",
            format!("slot {}: state kept moving under a free", link.idx),
        ))
    }

    /// `link`'s slot, if it is still `link`'s and `half` has a holder, and that holder.
    fn held_half(
        &self,
        link: LinkRef,
        half: u8,
    ) -> Result<(LinkSlot<'_>, MemberId), RegistryError> {
        check_half(half)?;
        let slot = self.link_slot(link.idx)?;
        let w = slot.word()?;
        if w.gen() != link.gen || !matches!(w.low(), L_LIVE | L_CLOSING) {
            return Err(RegistryError::Stale);
        }
        match slot.member(half)? {
            0 => Err(RegistryError::Stale),
            raw => {
                let m = self.link_member(raw).ok_or_else(|| {
                    let detail = format!("link {} half {half}: member word {raw:#x}", link.idx);
                    RegistryError::corrupt("link half", detail)
                })?;
                Ok((slot, m))
            }
        }
    }

    /// Leaves our half of `link` (only if `me` still holds it: else `Stale`), its carrier
    /// down; the link goes when its other half is empty too.
    pub fn link_leave(&self, link: LinkRef, half: u8, me: MemberId) -> Result<(), RegistryError> {
        let (slot, holder) = self.held_half(link, half)?;
        if holder != me {
            return Err(RegistryError::Stale);
        }
        slot.clear_flags_of(half, member_tag(me))?;
        if !slot.cas_member(half, pack_id(me.idx, me.gen), 0)? {
            return Err(RegistryError::Stale);
        }
        self.free_link_if_empty(link)?;
        tracing::debug!(?link, half, ?me, "link left");
        Ok(())
    }

    /// Writes our half's description (by the half's holder only). `InvalidParams` for an
    /// interface name or a prefix out of range, `Stale` if the half is no longer held.
    pub fn link_describe(
        &self,
        link: LinkRef,
        half: u8,
        d: &LinkHalfDesc,
    ) -> Result<(), RegistryError> {
        let words = d.encode()?;
        let (slot, _) = self.held_half(link, half)?;
        slot.write_desc(half, &words)
    }

    /// Our half's carrier up or down (by the half's holder only).
    pub fn link_set_carrier(&self, link: LinkRef, half: u8, up: bool) -> Result<(), RegistryError> {
        let (slot, holder) = self.held_half(link, half)?;
        slot.set_carrier(half, member_tag(holder), up)
    }

    /// Adds `delta` to our half's counters (by the half's holder only: relaxed adds).
    pub fn link_count(
        &self,
        link: LinkRef,
        half: u8,
        delta: &LinkCounters,
    ) -> Result<(), RegistryError> {
        let (slot, _) = self.held_half(link, half)?;
        let base = LinkSlot::half(half) + F_COUNTERS;
        for (i, n) in delta.to_array().into_iter().enumerate() {
            if n != 0 {
                slot.0.add(base + 8 * i as u64, n)?;
            }
        }
        Ok(())
    }

    /// Link `link` as it is now, validated; `Stale` if it is gone.
    pub fn link(&self, link: LinkRef) -> Result<LinkInfo, RegistryError> {
        let slot = self.link_slot(link.idx)?;
        let ours = |w: StateWord| w.gen() == link.gen && matches!(w.low(), L_LIVE | L_CLOSING);
        if !ours(slot.word()?) {
            return Err(RegistryError::Stale);
        }
        let name = slot.name()?.display();
        let halves = [self.read_half(&slot, 0)?, self.read_half(&slot, 1)?];
        if !ours(slot.word()?) {
            return Err(RegistryError::Stale);
        }
        Ok(LinkInfo { link, name, halves })
    }

    fn read_half(&self, slot: &LinkSlot<'_>, h: u8) -> Result<Option<LinkHalf>, RegistryError> {
        let raw = slot.member(h)?;
        let Some(member) = self.link_member(raw) else {
            if raw != 0 {
                tracing::trace!(link = slot.0.idx(), h, "unreadable member word {raw:#x}");
            }
            return Ok(None);
        };
        let flags = slot.0.ld(LinkSlot::half(h) + F_FLAGS)?;
        let half = LinkHalf::decode(member, flags, slot.desc(h)?, slot.counters(h)?);
        Ok(Some(half))
    }

    /// Every LIVE link (those being closed included), for `memloop status`. What is read is
    /// validated: a slot a buggy peer scribbled on shows what could be made of it.
    pub fn links(&self) -> Result<Vec<LinkInfo>, RegistryError> {
        let mut out = Vec::new();
        for idx in 0..self.layout.params.max_links {
            let w = self.link_slot(idx)?.word()?;
            if !matches!(w.low(), L_LIVE | L_CLOSING) {
                continue;
            }
            match self.link(LinkRef { idx, gen: w.gen() }) {
                Ok(info) => out.push(info),
                Err(e) => tracing::trace!("link slot {idx} moved on under the listing: {e}"),
            }
        }
        Ok(out)
    }

    /// The halves the dead member `dead` holds: cleared (member word 0, its carrier down), and
    /// links left with no half freed; its half-built links (RESERVED, NAMED) freed. Returns how
    /// many halves and half-built links. Called by [`Registry::reclaim`].
    pub fn reclaim_links_of(&self, dead: MemberId) -> Result<u32, RegistryError> {
        let (packed, tag) = (pack_id(dead.idx, dead.gen), member_tag(dead));
        let mut n = 0;
        for idx in 0..self.layout.params.max_links {
            n += self.clear_link_slot(idx, &|raw| raw == packed, &|t| t == tag)?;
        }
        Ok(n)
    }

    /// Halves whose holder is no longer LIVE in the registry (or unreadable), half-built links
    /// of creators no longer LIVE, stuck CLOSING slots: cleared, freed, settled (a reclaim that
    /// missed them). Returns how many halves and half-built links.
    pub(crate) fn sweep_links(&self) -> u32 {
        let gone = |raw: u64| {
            self.link_member(raw)
                .map_or(true, |m| self.live_member(m).is_err())
        };
        let creator_gone = |tag: u32| !self.tag_alive(tag);
        (0..self.layout.params.max_links)
            .map(|idx| self.clear_link_slot(idx, &gone, &creator_gone).unwrap_or(0))
            .sum()
    }

    /// Slot `idx`: halves whose member word `gone` accepts cleared (a link left with no half
    /// freed, a CLOSING one settled), or, half-built by a creator `creator_gone` accepts, freed.
    fn clear_link_slot(
        &self,
        idx: u32,
        gone: &impl Fn(u64) -> bool,
        creator_gone: &impl Fn(u32) -> bool,
    ) -> Result<u32, RegistryError> {
        let slot = self.link_slot(idx)?;
        let w = slot.word()?;
        match w.low() {
            L_RESERVED | L_NAMED if creator_gone(w.tag()) => {
                Ok(slot.cas(w, w.next_gen(L_FREE))? as u32)
            }
            L_LIVE | L_CLOSING => {
                let mut n = 0;
                for h in 0..2 {
                    let raw = slot.member(h)?;
                    if raw == 0 || !gone(raw) {
                        continue;
                    }
                    if let Some(m) = self.link_member(raw) {
                        slot.clear_flags_of(h, member_tag(m))?;
                    }
                    n += slot.cas_member(h, raw, 0)? as u32;
                }
                if n > 0 || w.low() == L_CLOSING {
                    self.free_link_if_empty(LinkRef { idx, gen: w.gen() })?;
                }
                Ok(n)
            }
            _ => Ok(0),
        }
    }

    pub(crate) fn count_links(&self) -> u32 {
        (0..self.layout.params.max_links)
            .filter(|&idx| {
                self.link_slot(idx)
                    .and_then(|s| s.word())
                    .is_ok_and(|w| w.low() != L_FREE)
            })
            .count() as u32
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
