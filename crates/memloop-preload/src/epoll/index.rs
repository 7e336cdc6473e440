//! Large sets: a wait that costs O(members that may be ready), not O(members).
//!
//! A small set arms every ring member when a thread sleeps and looks at all of them at every
//! call — a few cache lines each, nothing beside a system call. With thousands of members
//! that is milliseconds per call. A set with [`INDEX_AT`] or more ring members (and a wake
//! socket) keeps a list of members to look at, its *looks*; every other member is armed and
//! stays armed, so the peer's next publication sends a wake-up naming the channel (or a
//! doorbell, which the kernel reports under the member's own registration). A member joins the
//! looks when a wake-up or a kernel event names it, when the program adds or modifies it, or
//! when it changes path; it leaves them when it has had nothing to report for a while and a
//! look made after arming it finds nothing either. Busy members thus stay in the looks
//! unarmed, and their peers publish without a wake-up: going quiet at the first empty look
//! costs every request a datagram — half the rate of a busy set. The kernel queues only
//! `net.unix.max_dgram_qlen` datagrams (10 by default): a sender turned away loses its name,
//! so a drain that finds the queue full looks at every member. A set whose wake-ups crowd (a
//! drain that finds the queue nearly full, or a doorbell for a quiet member) lets its members
//! stay longer, up to the second between full looks; a calm set shortens it. Members that are
//! not plain ring connections (nested sets, connections off their ring) never leave. Once a
//! second every member is looked at, in case a wake-up went astray.

use super::*;
use std::collections::BTreeSet;

/// Ring members from which a set keeps looks by default (armed, quiet members cost the peer a
/// wake-up per first publication after each look: small sets spin on all members instead);
/// `MEMLOOP_EPOLL_INDEX_AT` sets another.
pub const INDEX_AT: usize = 64;

/// The threshold in force, and the size under which a set goes back to looking at all its
/// members (half of it: no flapping around one size).
fn thresholds() -> (usize, usize) {
    let at = crate::engine::get().map_or(INDEX_AT, |e| e.cfg.epoll_index_at);
    (at, at / 2)
}
/// How often every member of a large set is looked at all the same.
const FULL_LOOK: Duration = Duration::from_secs(1);
/// How long a member of the looks may have nothing to report before it goes quiet: at first,
/// at least and at most (ms). (A full look does not count as a member's activity: idle
/// members it finds go quiet again at once.)
const QUIET_MS: (u64, u64, u64) = (250, 20, 1000);
/// Wake-ups read in one drain that say the queue was nearly full (the kernel's default
/// limit is 10).
const CROWDED_DRAIN: usize = 8;

/// Milliseconds on a clock of the process's own (the time items were last seen ready).
pub(super) fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

pub(super) struct Looks {
    pub(super) ids: BTreeSet<u32>,
    full_at: Instant,
    /// How long a member may have nothing to report before it goes quiet (ms).
    pub(super) quiet_ms: u64,
    /// Wake-ups crowded since the last full look.
    crowded: bool,
}

impl State {
    /// Whether the set keeps looks.
    pub(super) fn indexed(&self) -> bool {
        self.looks.is_some()
    }

    /// Item `id` may be ready: the next collection looks at it.
    pub(super) fn look(&mut self, id: u32) {
        if let Some(l) = &mut self.looks {
            l.ids.insert(id);
            if let Some(it) = self.items.get_mut(&id) {
                it.seen = now_ms();
            }
        }
    }

    /// Every item is looked at by the next collection (the once-a-second full look keeps its
    /// time).
    fn look_all_now(&mut self) {
        let ids: BTreeSet<u32> = self.items.keys().copied().collect();
        if let Some(l) = &mut self.looks {
            l.ids = ids;
        }
    }

    /// Every item is looked at by the next collection; members stay longer before they go
    /// quiet if wake-ups crowded meanwhile, less long if not.
    fn look_all(&mut self) {
        self.look_all_now();
        if let Some(l) = &mut self.looks {
            l.full_at = Instant::now() + FULL_LOOK;
            l.quiet_ms = match std::mem::take(&mut l.crowded) {
                true => (l.quiet_ms * 4).min(QUIET_MS.2),
                false => (l.quiet_ms / 2).max(QUIET_MS.1),
            };
        }
    }

    /// Wake-ups crowd: see [`Self::look_all`].
    pub(super) fn crowded(&mut self) {
        if let Some(l) = &mut self.looks {
            l.crowded = true;
        }
    }

    /// A drain of the wake socket read `n` wake-ups: a full queue may have turned senders
    /// away (their names lost: every member is looked at).
    pub(super) fn drained(&mut self, n: usize) {
        if n >= CROWDED_DRAIN {
            self.crowded();
        }
        if n >= crate::wake::queue_limit() {
            self.look_all_now();
        }
    }

    /// A wake-up read from the set's socket: the items of the channel it names are looked
    /// at (one without a name: all of them).
    pub(super) fn named(&mut self, name: Option<u32>) {
        let Some(ch) = name else {
            // (Not a full look's turn: how long members stay is not changed by it.)
            return self.look_all_now();
        };
        for id in self.by_channel.get(&ch).cloned().unwrap_or_default() {
            self.look(id);
        }
    }

    /// Starts or stops keeping looks as the set grows or shrinks. Called with the set's lock
    /// at the start of a wait.
    pub(super) fn update_mode(&mut self) {
        let members = self.items.len() - self.nested;
        let (index_at, plain_below) = thresholds();
        match &self.looks {
            None if members >= index_at && self.wake.is_some() => {
                // Every member looked at once: each one found quiet is armed as it leaves.
                self.looks = Some(Looks {
                    ids: BTreeSet::new(),
                    full_at: Instant::now() + FULL_LOOK,
                    quiet_ms: QUIET_MS.0,
                    crowded: false,
                });
                self.look_all_now();
            }
            Some(_) if members < plain_below && self.sleepers == 0 => {
                // Small again: armed only while someone sleeps, as a small set is.
                self.looks = None;
                for it in self.items.values_mut().filter(|it| it.armed) {
                    disarm(it);
                }
            }
            _ => {}
        }
    }

    /// Starts a collection of the looks (all members once a second); the time, in
    /// [`now_ms`].
    pub(super) fn begin_round(&mut self) -> u64 {
        if self
            .looks
            .as_ref()
            .is_some_and(|l| Instant::now() >= l.full_at)
        {
            self.look_all();
        }
        now_ms()
    }

    /// How long a member may have nothing to report before it goes quiet (ms).
    pub(super) fn quiet_ms(&self) -> u64 {
        self.looks.as_ref().map_or(QUIET_MS.0, |l| l.quiet_ms)
    }

    /// Runs `f` on the items that may be ready without a wake-up naming them: the looks of a
    /// large set, every item of a small one.
    pub(super) fn each_looked_at(&mut self, mut f: impl FnMut(&mut Item)) {
        let State { looks, items, .. } = self;
        match looks {
            Some(l) => {
                for id in &l.ids {
                    if let Some(it) = items.get_mut(id) {
                        f(it);
                    }
                }
            }
            None => items.values_mut().for_each(f),
        }
    }

    /// Whether `f` holds for one of the items [`Self::each_looked_at`] visits.
    pub(super) fn any_looked_at(&self, mut f: impl FnMut(&Item) -> bool) -> bool {
        match &self.looks {
            Some(l) => l.ids.iter().filter_map(|id| self.items.get(id)).any(&mut f),
            None => self.items.values().any(&mut f),
        }
    }

    /// Items found quiet (armed) leave the looks.
    pub(super) fn quiet(&mut self, ids: &[u32]) {
        if let Some(l) = &mut self.looks {
            ids.iter().for_each(|id| {
                l.ids.remove(id);
            });
        }
    }

    /// Notes a new item (or one whose target changed) under its channel.
    pub(super) fn map_item(&mut self, id: u32, target: &Target) {
        match target {
            Target::Conn(c) => self.by_channel.entry(c.ch.idx).or_default().push(id),
            Target::Set(_) => self.nested += 1,
            Target::Udp(_) => {}
        }
        self.look(id);
    }

    /// Forgets an item removed (or whose target is about to change).
    pub(super) fn unmap_item(&mut self, id: u32, target: &Target) {
        match target {
            Target::Conn(c) => {
                if let Some(ids) = self.by_channel.get_mut(&c.ch.idx) {
                    ids.retain(|&i| i != id);
                    if ids.is_empty() {
                        self.by_channel.remove(&c.ch.idx);
                    }
                }
            }
            Target::Set(_) => self.nested = self.nested.saturating_sub(1),
            Target::Udp(_) => {}
        }
        if let Some(l) = &mut self.looks {
            l.ids.remove(&id);
        }
    }

    /// The ids of the items watching connection `c`.
    pub(super) fn ids_of(&self, c: &Conn) -> Vec<u32> {
        let mine = |id: &&u32| {
            self.items
                .get(id)
                .is_some_and(|it| matches!(&it.target, Target::Conn(x) if std::ptr::eq(&**x, c)))
        };
        self.by_channel
            .get(&c.ch.idx)
            .map_or_else(Vec::new, |ids| ids.iter().filter(mine).copied().collect())
    }
}

/// Whether an item that reports nothing at `now` ([`now_ms`]) may leave the looks once
/// armed: a fired one-shot (quiet until the program modifies it), or a ring connection on its
/// ring (its peer's publications wake the set) that has been quiet for a while.
pub(super) fn may_go_quiet(it: &Item, now: u64, quiet_ms: u64) -> bool {
    it.disabled
        || (now.saturating_sub(it.seen) >= quiet_ms
            && matches!(&it.target, Target::Conn(c) if it.reg == Reg::Ring && c.path() == Path::Ring))
}
