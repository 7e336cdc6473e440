//! Reclaiming what a dead (or departing) member held.
//!
//! Anyone who notices a death may reclaim; a CAS LIVE → RECLAIMING(by) on the member's state
//! word elects one reclaimer. Every step is an idempotent CAS on some entry's state word, so a
//! reclaim that is interrupted (the reclaimer dies too) can be redone from the start by someone
//! else: a later reclaim takes over a RECLAIMING slot whose reclaimer is no longer LIVE, and
//! reclaiming a member also resumes the reclaims it had left unfinished. The slot becomes FREE
//! with generation + 1 last, so ids of the dead member turn `Stale` only once nothing refers to
//! it any more. Survivors keep their channel memory until they close (Fido: a dead peer's
//! mapping stays valid).

use crate::error::RegistryError;
use crate::key::{member_tag, MemberId};
use crate::state_word::StateWord;
use crate::tables::members::{M_CLAIMING, M_FREE, M_LIVE, M_RECLAIMING};
use crate::Registry;

/// What one [`Registry::sweep_leftovers`] collected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    pub markers_freed: u32,
    pub segments_freed: u64,
    pub conns_released: u32,
    /// Pools of gone owners that nothing referenced any more.
    pub pools_freed: u32,
    /// Link halves of gone members cleared, and half-built links of gone creators freed.
    pub links_cleared: u32,
}

/// What one call to [`Registry::reclaim`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimReport {
    pub endpoints_removed: u32,
    /// Channels returned to FREE (the other side was already gone, or never accepted), decline
    /// markers included.
    pub channels_freed: u32,
    /// Accepted channels marked dead on the member's side; the survivor frees them on close.
    pub channels_marked: u32,
    /// Its buffer pools: closed (freed once nothing references them), or freed half-built.
    pub pools_closed: u32,
    /// Its link halves, cleared (a link left with no half is freed), and its half-built links.
    pub links_left: u32,
    /// Orphan segments swept (segments of freed channels are released with them).
    pub segments_freed: u64,
    /// Connection records released (the member's, and any other dead owner's).
    pub conns_released: u32,
    /// This call took over from a reclaimer that is no longer alive.
    pub took_over: bool,
    /// Unfinished reclaims of other members (that `dead` was running) completed by this call.
    pub resumed: u32,
}

impl ReclaimReport {
    fn add_leftovers(&mut self, l: Leftovers) {
        self.channels_freed += l.markers_freed;
        self.segments_freed += l.segments_freed;
        self.conns_released += l.conns_released;
    }
}

impl Registry {
    /// Reclaims everything `dead` holds, on behalf of the live member `by` (`by == dead` for a
    /// graceful [`Registry::leave`]). `WrongState` if another, still live, member is already
    /// reclaiming it; `Stale` if it has already been reclaimed.
    pub fn reclaim(&self, dead: MemberId, by: MemberId) -> Result<ReclaimReport, RegistryError> {
        let mut rep = self.reclaim_member(dead, by)?;
        rep.add_leftovers(self.sweep_leftovers());
        Ok(rep)
    }

    /// [`Registry::reclaim`] without the sweep of leftovers, which scans whole tables and
    /// collects what *any* dead member left: a caller reclaiming several members calls
    /// [`Registry::sweep_leftovers`] once after them.
    pub fn reclaim_member(
        &self,
        dead: MemberId,
        by: MemberId,
    ) -> Result<ReclaimReport, RegistryError> {
        let took_over = self.begin_reclaim(dead, by)?;
        let tag = member_tag(dead);
        let endpoints_removed = self.remove_endpoints_of(tag);
        let (channels_freed, channels_marked) = self.reclaim_channels(dead);
        let pools_closed = self.reclaim_pools_of(tag);
        let links_left = self.reclaim_links_of(dead).unwrap_or_else(|e| {
            tracing::debug!(?dead, "links of a dead member: {e}");
            0
        });
        self.finish_reclaim(dead)?;
        let resumed = self.resume_reclaims_of(tag, by);
        tracing::debug!(
            ?dead,
            ?by,
            endpoints_removed,
            channels_freed,
            channels_marked,
            pools_closed,
            links_left,
            "member reclaimed"
        );
        Ok(ReclaimReport {
            endpoints_removed,
            channels_freed,
            channels_marked,
            pools_closed,
            links_left,
            took_over,
            resumed,
            ..ReclaimReport::default()
        })
    }

    /// What dead members leave outside their own entries: decline markers, orphan segments (a
    /// freer that died half-way), connection records. Each is recognised by an owner that is
    /// not LIVE, so one sweep serves any number of reclaimed members.
    pub fn sweep_leftovers(&self) -> Leftovers {
        Leftovers {
            markers_freed: self.sweep_markers(),
            segments_freed: self.sweep_orphans(),
            conns_released: self.reclaim_conns(),
            pools_freed: self.sweep_pools(),
            links_cleared: self.sweep_links(),
        }
    }

    /// Elects `by` as the reclaimer of `dead`; `Ok(true)` if it took over a dead reclaimer.
    fn begin_reclaim(&self, dead: MemberId, by: MemberId) -> Result<bool, RegistryError> {
        let mine = member_tag(by);
        let slot = self.member_slot(dead.idx)?;
        for _ in 0..1000 {
            let w = self.check_member(dead)?;
            // The reclaimer's tag rides in the member's state word while RECLAIMING.
            let took_over = match w.low() {
                M_LIVE | M_CLAIMING => false,
                M_RECLAIMING if w.tag() == mine => return Ok(false),
                M_RECLAIMING if self.tag_alive(w.tag()) => {
                    return Err(RegistryError::wrong("LIVE", "RECLAIMING"));
                }
                _ => true,
            };
            if slot.cas(w, StateWord::new(dead.gen, mine, M_RECLAIMING))? {
                return Ok(took_over);
            }
        }
        Err(RegistryError::corrupt(
            "member state",
            "reclaim election did not converge",
        ))
    }

    /// RECLAIMING → FREE with generation + 1 (whoever is the reclaimer by now).
    fn finish_reclaim(&self, dead: MemberId) -> Result<(), RegistryError> {
        let slot = self.member_slot(dead.idx)?;
        for _ in 0..1000 {
            let w = slot.word()?;
            if w.gen() != dead.gen || w.low() != M_RECLAIMING {
                return Ok(()); // someone who took over has finished
            }
            if slot.cas(w, w.next_gen(M_FREE))? {
                self.membership_moved();
                return Ok(());
            }
        }
        Err(RegistryError::corrupt(
            "member state",
            "reclaim did not finish",
        ))
    }

    /// Completes reclaims that the member with `tag` was running when it died.
    fn resume_reclaims_of(&self, tag: u32, by: MemberId) -> u32 {
        let mut n = 0;
        for idx in 0..self.layout.params.max_members {
            let Ok(w) = self.member_word(idx) else {
                continue;
            };
            if w.low() == M_RECLAIMING && w.tag() == tag {
                n += self
                    .reclaim_member(MemberId { idx, gen: w.gen() }, by)
                    .is_ok() as u32;
            }
        }
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{MemberIdentity, RegionParams, ShmSlice, Usage};

    fn setup() -> (Registry, Vec<MemberId>) {
        let p = RegionParams::small(1 << 20);
        let r = Registry::init(ShmSlice::new_heap(p.size as usize), &p).unwrap();
        let ids = (0..3)
            .map(|i| {
                let ident = MemberIdentity {
                    pid: i,
                    start_time: 0,
                    boot_id: [0; 16],
                    pid_ns: 0,
                    net_ns: 0,
                    name: "t".into(),
                };
                r.join(&ident).unwrap()
            })
            .collect();
        (r, ids)
    }

    fn base(r: &Registry, members: u32) -> Usage {
        Usage {
            members,
            segments_total: r.nsegments(),
            ..Usage::default()
        }
    }

    #[test]
    fn half_finished_reservation_is_reclaimed() {
        let (r, m) = setup();
        let (ch, _) = r.reserve(m[0]).unwrap();
        r.alloc_segments(ch, 2).unwrap();
        assert_eq!(r.usage().segments_used, 2);
        let rep = r.reclaim(m[0], m[1]).unwrap();
        assert_eq!(rep.channels_freed, 1);
        assert_eq!(r.usage(), base(&r, 2));
    }

    #[test]
    fn orphan_segments_of_a_dead_freer_are_swept() {
        let (r, m) = setup();
        let (ch, w) = r.reserve(m[0]).unwrap();
        r.alloc_segments(ch, 3).unwrap();
        // a freer that died right after the CAS to FREE: slot is FREE(gen+1), tags still old
        let slot = r.channel_slot(ch.idx).unwrap();
        assert!(slot.cas(w, w.next_gen(0)).unwrap());
        assert_eq!(r.sweep_orphans(), 3);
        assert_eq!(r.sweep_orphans(), 0);
        assert_eq!(r.usage().segments_used, 0);
    }

    #[test]
    fn a_live_reclaimer_is_not_overridden_but_a_dead_one_is() {
        let (r, m) = setup();
        let (dead, b, c) = (m[0], m[1], m[2]);
        assert!(!r.begin_reclaim(dead, b).unwrap()); // b starts ... and stalls
        assert!(matches!(
            r.reclaim(dead, c),
            Err(RegistryError::WrongState { .. })
        ));
        r.begin_reclaim(b, c).unwrap(); // b is now being reclaimed: no longer LIVE
        let rep = r.reclaim(dead, c).unwrap();
        assert!(rep.took_over);
        assert!(matches!(r.member(dead), Err(RegistryError::Stale)));
        r.reclaim(b, c).unwrap();
        assert_eq!(r.usage(), base(&r, 1));
    }

    #[test]
    fn reclaiming_a_stale_reclaimer_resumes_its_work() {
        let (r, m) = setup();
        let (dead, b, c) = (m[0], m[1], m[2]);
        r.begin_reclaim(dead, b).unwrap(); // b dies mid-way
        let rep = r.reclaim(b, c).unwrap();
        assert_eq!(rep.resumed, 1);
        assert!(matches!(r.member(dead), Err(RegistryError::Stale)));
        assert_eq!(r.usage(), base(&r, 1));
    }

    #[test]
    fn died_mid_accept_releases_the_server_word() {
        let (r, m) = setup();
        let ep = r
            .add_endpoint(m[1], &crate::EndpointKey::Native("s".into()))
            .unwrap();
        let ch = r.offer(m[0], ep, 64, None).unwrap();
        let sw = r.channel_slot(ch.idx).unwrap().server_cell().unwrap();
        // m[2] claimed, then died
        sw.store(
            crate::key::pack_id(m[2].idx, m[2].gen),
            std::sync::atomic::Ordering::SeqCst,
        );
        assert!(r.accept(ch, m[1]).is_err());
        r.reclaim(m[2], m[1]).unwrap();
        r.accept(ch, m[1]).unwrap();
    }
}
