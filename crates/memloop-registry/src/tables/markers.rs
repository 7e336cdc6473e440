//! Decline markers: how a transparent server and client agree that a connection stays on TCP.
//!
//! The client offers a channel for its connection's 4-tuple right after `connect` succeeds; the
//! server looks for that offer right after `accept`. Either may be late. A server that finds no
//! offer within its short wait publishes a marker (a channel slot without rings, phase
//! DECLINED|MARKER, holding the tuple) and then scans the offers once more; a client, right after
//! publishing its offer, scans the markers. Both publish with a SeqCst CAS and scan after a SeqCst
//! fence (a Dekker pair), so at least one side sees the other: the server accepts the late offer,
//! or the client sees the marker and cancels its offer. When both happen, the CAS on the offer
//! decides (an accepted offer cannot be cancelled, a cancelled one cannot be accepted).
//!
//! A marker must outlive the client's scan, whose timing is unbounded: the server frees it when
//! the TCP connection closes. Its slot carries the server's tag, so reclaiming a dead server
//! frees it, and [`Registry::sweep_markers`] frees markers whose owner is no longer live.
//!
//! A server that forks while it waits for a late ring shares the connection with its child:
//! each process holding it then holds the marker too ([`Registry::hold_marker`]), counted in
//! the server side's `holders` word (0: one holder), and the last to let go frees it
//! ([`Registry::release_marker`]). A holder writes the count only while its own hold keeps
//! the slot alive, so no write lands on a later occupant.
//!
//! A marker is a channel slot (layout in `channels.rs`, written through `ChannelSlot`) with:
//!
//! | field | value |
//! | --- | --- |
//! | state | phase DECLINED, flag MARKER, tag = the server's |
//! | server, client | both the server's packed member id |
//! | capacity, ring offsets, kind | 0 (no rings) |
//! | tuple | the accepted connection's 4-tuple |

use crate::error::RegistryError;
use crate::header::H_CREATE_SEQ;
use crate::key::{
    decode_tuple, encode_tuple, member_tag, pack_id, ChannelId, ConnTuple, EndpointId, MemberId,
};
use crate::state_word::StateWord;
use crate::tables::channels::{
    c_phase, is_marker, phase_name, with_phase, ChannelFields, C_DECLINED, C_OFFERED, MARKER,
};
use crate::tables::index::IndexKey;
use crate::Registry;
use memloop_shm::sync::fence;
use memloop_shm::sync::Ordering::{Acquire, SeqCst};
use std::net::SocketAddr;

/// Same address and port, ignoring IPv6 flow info and scope, and IPv4-mapped IPv6 (a dual-stack
/// listener sees `::ffff:10.0.0.1` where the client's socket says `10.0.0.1`).
fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    a.ip().to_canonical() == b.ip().to_canonical() && a.port() == b.port()
}

impl Registry {
    /// Publishes a decline marker for the connection `tuple` that `server` accepted on `ep`
    /// without finding an offer. Then scan [`Registry::offers_from_client`] once more (a late
    /// offer), and free the marker with [`Registry::free_marker`] when the connection closes.
    pub fn mark_declined(
        &self,
        server: MemberId,
        ep: EndpointId,
        tuple: &ConnTuple,
    ) -> Result<ChannelId, RegistryError> {
        self.live_member(server)?;
        self.live_endpoint(ep)?;
        // Counted before it is published (and before our scan of the offers), so a client that
        // reads zero after publishing its offer is ordered before us: we will see its offer.
        self.markers_word()?.fetch_add(1, SeqCst);
        let published = self.publish_marker(server, ep, tuple);
        if published.is_err() {
            self.markers_gone(1);
        }
        published
    }

    fn publish_marker(
        &self,
        server: MemberId,
        ep: EndpointId,
        tuple: &ConnTuple,
    ) -> Result<ChannelId, RegistryError> {
        let (id, reserved) = self.reserve(server)?;
        if let Err(e) = self.write_marker(id, server, ep, tuple) {
            self.free_channel(id, reserved).ok();
            return Err(e);
        }
        let marker = with_phase(reserved, C_DECLINED | MARKER);
        let pos = self.index_insert(IndexKey::Client(tuple.client), id);
        self.channel_slot(id.idx)?.set_index_pos(pos)?;
        if !self.cas_channel(id.idx, reserved, marker)? {
            return Err(RegistryError::Stale); // reclaimed under us: we were declared dead
        }
        tracing::trace!(?id, ?tuple, "decline marker published");
        Ok(id)
    }

    fn write_marker(
        &self,
        id: ChannelId,
        server: MemberId,
        ep: EndpointId,
        tuple: &ConnTuple,
    ) -> Result<(), RegistryError> {
        let me = pack_id(server.idx, server.gen);
        // No rings, kind 0: a marker's slot only carries the tuple and its owner.
        let fields = ChannelFields {
            server: me,
            client: me,
            endpoint: pack_id(ep.idx, ep.gen),
            created: self.next_seq(H_CREATE_SEQ)?,
            capacity: 0,
            c2s: 0,
            s2c: 0,
            kind: 0,
            tuple: encode_tuple(tuple),
            holders: 0,
        };
        self.channel_slot(id.idx)?.write(&fields)
    }

    /// Markers for connections from `client` (the client's half of the tuple). The client calls
    /// this right after its offer is published, and cancels the offer if one matches.
    pub fn markers_for_client(&self, client: SocketAddr) -> Vec<(ChannelId, ConnTuple)> {
        fence(SeqCst); // Dekker: our offer's CAS before, the markers' words after
        if self.markers_word().is_ok_and(|w| w.load(SeqCst) == 0) {
            return Vec::new();
        }
        self.scan_tuples(client, |w| is_marker(w) && c_phase(w) == C_DECLINED)
    }

    fn markers_word(&self) -> Result<memloop_shm::ShmU64, RegistryError> {
        Ok(self.view.u64_at(crate::header::H_MARKERS)?)
    }

    /// `n` markers were freed (saturating: a count that stays too high only costs scans).
    pub(crate) fn markers_gone(&self, n: u64) {
        if let Ok(w) = self.markers_word() {
            super::step_count_by(&w, n);
        }
    }

    fn late_clients_word(&self) -> Result<memloop_shm::ShmU64, RegistryError> {
        Ok(self.view.u64_at(crate::header::H_LATE_CLIENTS)?)
    }

    /// One more (`up`) or one less member client that may look for a decline marker. A client
    /// counts itself before the server could stop seeing it otherwise: before withdrawing its
    /// announced connect or cancelling its offer, or — nobody listening in the region — before
    /// its connect (saturating, like the other hints: one that stays too high only costs
    /// markers nobody looks for).
    pub fn late_clients_add(&self, up: bool) {
        if let Ok(w) = self.late_clients_word() {
            super::step_count(&w, up);
        }
    }

    /// Whether a member client may look for a decline marker now. The server reads it after
    /// its look at the endpoint's announced connects and its offers, with a SeqCst fence in
    /// between: a client that withdrew from those had counted itself first. Unreadable: yes.
    pub fn late_clients_looking(&self) -> bool {
        fence(SeqCst);
        self.late_clients_word()
            .map_or(true, |w| w.load(SeqCst) > 0)
    }

    fn offers_word(&self) -> Result<memloop_shm::ShmU64, RegistryError> {
        Ok(self.view.u64_at(crate::header::H_OFFERS)?)
    }

    /// One more offer, before its CAS to OFFERED (`up`), or one less, after its CAS out of it
    /// (saturating: a count that stays too high only costs scans).
    pub(crate) fn offers_add(&self, up: bool) {
        if let Ok(w) = self.offers_word() {
            super::step_count(&w, up);
        }
    }

    /// How many offers are OFFERED in the region now (a hint: saturating, see `offers_add`).
    pub fn offers_outstanding(&self) -> u64 {
        self.offers_word().map_or(0, |w| w.load(SeqCst))
    }

    /// No offer is OFFERED anywhere in the region (read after the caller's SeqCst fence: an
    /// offer counted after this read is published after it, and its client's marker scan,
    /// after its CAS, sees the marker the caller published before).
    pub(crate) fn no_offers(&self) -> bool {
        self.offers_word().is_ok_and(|w| w.load(SeqCst) == 0)
    }

    /// Offers (OFFERED, not yet accepted) from `client`. The server uses it after publishing a
    /// marker to find a late offer for its exact tuple, and to decline offers whose server half
    /// differs from the address it accepted on (NAT or port mapping).
    pub fn offers_from_client(&self, client: SocketAddr) -> Vec<(ChannelId, ConnTuple)> {
        fence(SeqCst); // Dekker: our marker's CAS before, the offers' words after
        if self.no_offers() {
            return Vec::new();
        }
        let mut offers = self.scan_tuples(client, |w| !is_marker(w) && c_phase(w) == C_OFFERED);
        // A late-ring offer is for a connection that exists already, not a new one.
        // (A datagram pair's sender is no TCP client.)
        offers.retain(|(id, _)| {
            self.channel_slot(id.idx)
                .is_ok_and(|s| !Registry::is_late_offer(&s) && !Registry::is_datagram_pair(&s))
        });
        offers
    }

    /// Slots whose word satisfies `want` and whose tuple's client half is `client`, each read
    /// consistently (the word is re-checked after the tuple).
    fn scan_tuples(
        &self,
        client: SocketAddr,
        want: impl Fn(StateWord) -> bool,
    ) -> Vec<(ChannelId, ConnTuple)> {
        let mut out = Vec::new();
        for idx in self.slots_for(IndexKey::Client(client)) {
            let Ok(w) = self.channel_word(idx) else {
                continue;
            };
            if !want(w) {
                continue;
            }
            if let Some(t) = self.stable_tuple(idx, w) {
                if same_endpoint(t.client, client) {
                    out.push((ChannelId { idx, gen: w.gen() }, t));
                }
            }
        }
        out
    }

    /// The tuple of slot `idx` if its word is still `w` after reading it (and it decodes).
    fn stable_tuple(&self, idx: u32, w: StateWord) -> Option<ConnTuple> {
        let slot = self.channel_slot(idx).ok()?;
        let raw = slot.tuple().ok()?;
        fence(Acquire);
        if slot.word().ok()? != w {
            return None;
        }
        decode_tuple(&raw).ok().flatten()
    }

    /// Frees a marker that `server` published. Refuses real channels and other members' markers.
    pub fn free_marker(&self, ch: ChannelId, server: MemberId) -> Result<(), RegistryError> {
        let w = self.check_channel(ch)?;
        if !is_marker(w) {
            return Err(RegistryError::wrong(
                "a decline marker",
                phase_name(c_phase(w)),
            ));
        }
        if w.tag() != member_tag(server) {
            return Err(RegistryError::wrong(
                "the marker's server",
                "another member",
            ));
        }
        // A marker's word only ever changes to FREE, so a lost CAS means someone freed it.
        match self.free_channel(ch, w)? {
            true => Ok(()),
            false => Err(RegistryError::Stale),
        }
    }

    /// The hold count of marker `ch`: processes holding its connection besides the first.
    /// Valid while the caller holds the marker (only then may it change the count).
    pub fn marker_holders(&self, ch: ChannelId) -> Result<memloop_shm::ShmU32, RegistryError> {
        let (slot, w) = self.channel_entry(ch)?;
        if !is_marker(w) {
            return Err(RegistryError::wrong(
                "a decline marker",
                phase_name(c_phase(w)),
            ));
        }
        Ok(slot.side(crate::Side::Server)?.holders)
    }

    /// One more process holds a marker (`holders`: its [`Registry::marker_holders`]); the
    /// caller holds it already, so the slot is still that marker.
    pub fn hold_marker(&self, holders: &memloop_shm::ShmU32) {
        holders.fetch_add(1, SeqCst);
    }

    /// One holder of marker `ch` lets go; the last frees it (true then). `server` published
    /// it; `holders` is its count.
    pub fn release_marker(
        &self,
        ch: ChannelId,
        server: MemberId,
        holders: &memloop_shm::ShmU32,
    ) -> Result<bool, RegistryError> {
        let others = holders.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1));
        match others {
            Ok(_) => Ok(false),
            Err(_) => self.free_marker(ch, server).map(|()| true),
        }
    }

    /// Frees markers whose owner is no longer a live member (it was declared dead while
    /// publishing, after its reclaimer had scanned the table). Returns how many.
    pub fn sweep_markers(&self) -> u32 {
        let mut n = 0;
        for idx in 0..self.layout.params.max_channels {
            let Ok(w) = self.channel_word(idx) else {
                continue;
            };
            let id = ChannelId { idx, gen: w.gen() };
            if w != StateWord::new(id.gen, w.tag(), MARKER | C_DECLINED) || self.tag_alive(w.tag())
            {
                continue;
            }
            n += self.free_channel(id, w).unwrap_or(false) as u32;
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::tables::members::M_FREE;
    use crate::EndpointKey;

    /// A registry with member `s` that published one decline marker.
    fn one_marker() -> (Registry, MemberId, ChannelId) {
        let (r, s) = crate::tables::members::test_registry_with_member("s");
        let ep = r.add_endpoint(s, &EndpointKey::Native("x".into())).unwrap();
        let t = ConnTuple {
            client: "10.0.0.1:1".parse().unwrap(),
            server: "10.0.0.2:2".parse().unwrap(),
        };
        let m = r.mark_declined(s, ep, &t).unwrap();
        (r, s, m)
    }

    #[test]
    fn markers_of_an_owner_declared_dead_meanwhile_are_swept() {
        let (r, s, m) = one_marker();
        assert_eq!(r.sweep_markers(), 0, "owner is live");
        // reclaimed (slot FREE, generation + 1) before the marker was published
        let slot = r.member_slot(s.idx).unwrap();
        slot.state()
            .unwrap()
            .store(StateWord::new(s.gen + 1, 0, M_FREE));
        assert_eq!(r.sweep_markers(), 1);
        assert!(matches!(r.channel(m), Err(RegistryError::Stale)));
        assert_eq!(r.usage().channels, 0);
    }

    #[test]
    fn a_held_marker_is_freed_by_its_last_holder() {
        let (r, s, m) = one_marker();
        let h = r.marker_holders(m).unwrap();
        r.hold_marker(&h); // a fork: two holders
        r.hold_marker(&h); // another: three
        assert!(!r.release_marker(m, s, &h).unwrap());
        assert!(!r.release_marker(m, s, &h).unwrap());
        assert_eq!(r.usage().channels, 1, "one holder left");
        assert!(r.release_marker(m, s, &h).unwrap(), "the last frees it");
        assert_eq!(r.usage().channels, 0);
        assert!(r.marker_holders(m).is_err(), "gone");
    }

    #[test]
    fn endpoints_compare_canonically() {
        let p = |s: &str| s.parse().unwrap();
        assert!(same_endpoint(p("10.0.0.1:80"), p("[::ffff:10.0.0.1]:80")));
        assert!(same_endpoint(p("[fe80::1%2]:80"), p("[fe80::1]:80")));
        assert!(!same_endpoint(p("10.0.0.1:80"), p("10.0.0.1:81")));
        assert!(!same_endpoint(p("10.0.0.1:80"), p("10.0.0.2:80")));
    }
}
