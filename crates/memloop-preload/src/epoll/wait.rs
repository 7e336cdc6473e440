//! `epoll_wait` on an emulated set: ring members answered from the rings, kernel events
//! filtered for our tags and translated, sleepers counted so members are armed while anyone
//! sleeps.

use super::*;

impl EpollSet {
    /// A thread is about to sleep on this set (or on a set or poll containing it): arm every
    /// ring member, re-arm those armed already (a doorbell cleared their flag). Returns the
    /// ring members with a switch to deal with, looked at after arming: a leave rings its
    /// doorbell only for a peer armed when it looks, so a sleeper that armed just after must
    /// see the switch here (`Waiter::block` deals with them).
    pub fn sleep_enter(&self) -> Vec<Arc<Conn>> {
        let mut st = self.st.lock();
        st.sleepers += 1;
        st.wake_drained = false;
        let mut switching = Vec::new();
        // (A large set's members outside its looks are armed already.)
        st.each_looked_at(|it| {
            if it.armed {
                rearm(it);
            } else {
                arm(it);
            }
            if let Target::Conn(c) = &it.target {
                // (One shared load while the word is quiet; a connection on TCP never counts.)
                if it.armed && c.switch_pending() {
                    switching.push(c.clone());
                }
            }
        });
        switching
    }

    /// The sleeper is awake; the last one disarms, and reads the set's wake-ups (before
    /// anyone looks at the members again: a wake-up read is never one that goes unseen).
    pub fn sleep_leave(&self) {
        let mut st = self.st.lock();
        st.sleepers = st.sleepers.saturating_sub(1);
        if st.sleepers == 0 {
            // (A large set's quiet members keep their lasting arms: wake-ups name them.)
            let mut woke = false;
            st.each_looked_at(|it| {
                if it.armed && !it.lasting {
                    woke |= disarm(it);
                }
            });
            if woke {
                st.drain_wake();
                st.wake_drained = true;
            }
        }
    }

    /// Readies a wait on a set with members, under one lock: the wake socket at the first
    /// wait with ring members, and looks kept or dropped as the set grew or shrank.
    fn prepare_wait(&self, epfd: c_int) {
        let mut st = self.st.lock();
        if !st.wake_tried
            && st
                .items
                .values()
                .any(|it| matches!(it.target, Target::Conn(_)))
        {
            st.wake_tried = true;
            add_wake(&mut st, epfd);
        }
        st.update_mode();
    }

    /// Whether some member would be reported now, with a signature of what is ready (for a
    /// containing set's edge-triggered interest). Nothing is consumed.
    pub fn peek(&self) -> Option<u64> {
        let st = self.st.lock();
        let mut sig: Option<u64> = None;
        for it in st.items.values().filter(|it| it.would_report()) {
            let (_, (a, b, c)) = it.readiness()?;
            let s = sig.unwrap_or(0);
            sig = Some(s.wrapping_add(a).wrapping_add(b).wrapping_add(c as u64));
        }
        sig
    }

    /// `epoll_wait`/`epoll_pwait`/`epoll_pwait2` (`precise`: nanosecond timeout).
    pub fn wait(
        &self,
        epfd: c_int,
        out: &mut [epoll_event],
        timeout: Option<Duration>,
        sigmask: *const libc::sigset_t,
        precise: bool,
    ) -> Result<usize, c_int> {
        self.set_fd(epfd);
        crate::engine::ensure_heartbeat();
        if self.has_targets() {
            self.prepare_wait(epfd);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        if !self.has_targets() {
            let w = Waiter {
                set: self,
                epfd,
                sigmask,
                precise,
            };
            if let Some(r) = w.kernel_only(out, timeout) {
                return r;
            }
        }
        // The program may offer room for thousands of events (redis: its whole fd limit): take
        // at most MAX_KERNEL_BATCH from the kernel per call, in a buffer kept per thread.
        let room = out.len().min(MAX_KERNEL_BATCH);
        TMP.with(|t| {
            let mut tmp = t.borrow_mut();
            if tmp.len() < room {
                tmp.resize(room, epoll_event { events: 0, u64: 0 });
            }
            let w = Waiter {
                set: self,
                epfd,
                sigmask,
                precise,
            };
            w.run(out, &mut tmp[..room], timeout, deadline)
        })
    }

    /// Ready ring members → program events, skipping (and adding to) `reported`.
    pub(super) fn collect(
        &self,
        epfd: c_int,
        out: &mut [epoll_event],
        reported: &mut Reported,
    ) -> usize {
        if out.is_empty() {
            return 0;
        }
        let mut st = self.st.lock();
        let mut got = Got::default();
        if st.indexed() {
            collect_looks(&mut st, epfd, out, reported, &mut got);
        } else {
            let cursor = st.cursor;
            let mut visit = |id: u32, it: &mut Item| {
                if got.n < out.len() && !reported.contains(&id) {
                    if let Some(e) = offer(epfd, id, it) {
                        got.push(id, it, e, out, reported);
                    }
                }
            };
            // Ready members take turns: start after the one reported last.
            for (id, it) in st.items.range_mut(cursor..) {
                visit(*id, it);
            }
            for (id, it) in st.items.range_mut(..cursor) {
                visit(*id, it);
            }
        }
        if let Some(id) = got.last {
            st.cursor = id.wrapping_add(1);
        }
        drop(st);
        // Doorbells for what we report are read now: left on the socket they would keep it
        // (and any set or poll watching this set) readable after the data is consumed.
        got.owed.iter().for_each(|c| c.drain_owed());
        got.n
    }

    /// Kernel events → program events: tagged ones are ours (doorbells, decisions, kicks,
    /// nested sets), everything else is the program's own.
    pub(super) fn translate(
        &self,
        epfd: c_int,
        got: &[epoll_event],
        out: &mut [epoll_event],
        reported: &mut Reported,
    ) -> usize {
        let mut n = 0;
        for ev in got {
            if let Some(e) = self.translate_one(epfd, *ev, reported) {
                out[n] = e;
                n += 1;
            }
        }
        n
    }

    /// One kernel event → what the program gets of it, if anything.
    pub(super) fn translate_one(
        &self,
        epfd: c_int,
        ev: epoll_event,
        reported: &mut Reported,
    ) -> Option<epoll_event> {
        let Some(id) = kernel::untag(ev.u64) else {
            return Some(ev);
        };
        match self.settle(epfd, id, ev.events) {
            Settled::NotOurs => Some(ev),
            Settled::Ours(Some(e)) if !reported.contains(&id) => {
                reported.push(id);
                Some(e)
            }
            Settled::Ours(_) => None,
        }
    }

    /// Handles a kernel event on one of our registrations; returns an event for the program
    /// when the item is a nested set or just became a plain TCP connection.
    pub(super) fn settle(&self, epfd: c_int, id: u32, kernel_ev: u32) -> Settled {
        let target = {
            let mut st = self.st.lock();
            if id == WAKE_ID && st.wake.is_some() {
                // (The collection that follows looks at the members.)
                if !std::mem::take(&mut st.wake_drained) {
                    st.drain_wake();
                }
                return Settled::Ours(None);
            }
            if !st.wrapped && id >= st.next {
                return Settled::NotOurs;
            }
            if !st.items.contains_key(&id) {
                super::ctl::parked_event(&mut st, epfd, id);
                return Settled::Ours(None); // removed meanwhile: a stale event
            }
            if st.items[&id].lasting && st.items[&id].reg == Reg::Ring {
                // (A quiet member's doorbell: most likely a wake-up that found the queue full.)
                st.crowded();
            }
            st.look(id);
            let it = st.items.get_mut(&id).expect("just looked up");
            if it.kicked {
                unkick(epfd, id, it);
            }
            (it.target.clone(), it.fd)
        };
        Settled::Ours(match target {
            (Target::Conn(c), _) => self.settle_conn(epfd, id, &c, kernel_ev),
            (Target::Udp(_), _) => {
                // An edge on its socket or a wake-up: the next collection looks.
                let mut st = self.st.lock();
                if let Some(it) = st.items.get_mut(&id) {
                    it.hot.set(true);
                    it.edges = it.edges.wrapping_add(1);
                }
                None
            }
            (Target::Set(s), fd) => {
                // (As poll does: not readable for late wake-ups of data read since.)
                let readable = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
                let stale =
                    kernel_ev & readable != 0 && s.peek().is_none() && !s.still_readable(fd);
                self.settle_set(
                    id,
                    if stale {
                        kernel_ev & !readable
                    } else {
                        kernel_ev
                    },
                )
            }
        })
    }

    pub(super) fn settle_set(&self, id: u32, kernel_ev: u32) -> Option<epoll_event> {
        let mut st = self.st.lock();
        let it = st.items.get_mut(&id)?;
        let rep = rules::report(kernel_ev, it.events);
        if it.disabled || rep == 0 {
            return None;
        }
        if it.events & ONESHOT != 0 {
            it.disabled = true; // the kernel disabled its own registration too
        }
        Some(epoll_event {
            events: rep,
            u64: it.data,
        })
    }

    pub(super) fn settle_conn(
        &self,
        epfd: c_int,
        id: u32,
        c: &Arc<Conn>,
        kernel_ev: u32,
    ) -> Option<epoll_event> {
        if !c.switch_quiet() {
            // A switch hands the registration back to the kernel itself; a leave waiting for
            // the peer is finished by a later wait (or call), never waited for here.
            c.settle_switch_nowait();
        }
        let path = match c.path() {
            Path::Pending => c.resolve(true),
            p => p,
        };
        if path == Path::Ring {
            c.drain();
        }
        let mut st = self.st.lock();
        if path == Path::Tcp && !c.was_ring() {
            // (Unless a late ring's conversion gave the item to another connection.)
            let same = |it: &Item| matches!(&it.target, Target::Conn(x) if Arc::ptr_eq(x, c));
            if !st.items.get(&id).is_some_and(same) {
                return None;
            }
            let it = self.remove(&mut st, id)?;
            return to_kernel_fd(epfd, it, kernel_ev);
        }
        let sleeping = st.sleepers > 0;
        let it = st.items.get_mut(&id)?;
        let now = c.path();
        if it.reg == Reg::Ring && now != Path::Ring {
            // It left its ring, and the thread that moved it has not made its items follow
            // yet (that thread may be waiting for this very lock). Left as it is, the ring's
            // level-triggered registration would report the peer's bytes on the socket at
            // every wait, and this thread would spin on this lock until then.
            if let Some(reg) = Reg::following(now) {
                it.hot.set(true);
                super::ctl::follow(epfd, id, it, reg, sleeping);
                st.look(id);
                return None;
            }
        }
        if it.reg == Reg::OffRing {
            // An edge on its socket: the next collection looks (and filters doorbells).
            it.hot.set(true);
            it.edges = it.edges.wrapping_add(1);
            return None;
        }
        if it.reg == Reg::Pending && it.fd_open {
            it.reg = Reg::Ring;
            let kev = it.kernel_events().unwrap_or(IN);
            kernel::ctl_or_log(
                "settled on a ring",
                epfd,
                libc::EPOLL_CTL_MOD,
                it.fd,
                kev,
                kernel::tag(id),
            );
        }
        if c.peer_closed() && it.reg == Reg::Ring && !it.kicked && it.fd_open {
            // EOF forever from now on: stop the kernel reporting it on every wait.
            it.reg = Reg::Dormant;
            kernel::ctl_or_log("peer gone: dormant", epfd, libc::EPOLL_CTL_DEL, it.fd, 0, 0);
        }
        None
    }

    /// Across kernels nothing closes a vanished VM's socket: look at the peers' heartbeats.
    /// Whether any such peer is left to watch (the next slices are then shorter).
    pub(super) fn watch_peers(&self) -> bool {
        // (Only those: a set of thousands would otherwise clone them all at every slice.)
        let elsewhere: Vec<Arc<Conn>> = self
            .st
            .lock()
            .items
            .values()
            .filter_map(|it| match &it.target {
                Target::Conn(c) if c.peer_elsewhere() && !c.peer_closed() => Some(c.clone()),
                _ => None,
            })
            .collect();
        let mut left = false;
        for c in elsewhere {
            c.watch_peer();
            if c.peer_closed() {
                // (Nothing names a quiet member whose peer vanished.)
                let mut st = self.st.lock();
                st.ids_of(&c).into_iter().for_each(|id| st.look(id));
            } else {
                left = true;
            }
        }
        left
    }

    pub(super) fn spin_window(&self) -> Duration {
        self.st
            .lock()
            .items
            .values()
            .find_map(|it| match &it.target {
                Target::Conn(c) if it.reg != Reg::OffRing => Some(c.spin_window()),
                Target::Udp(u) => Some(u.spin_window()),
                _ => None,
            })
            .unwrap_or(Duration::ZERO)
    }

    /// The spin inputs of a wait on this set ([`crate::conn::spin_inputs_of`] over its ring
    /// members).
    pub(super) fn spin_inputs(&self) -> memloop_ring::SpinInputs {
        let conns: Vec<Arc<Conn>> = self
            .st
            .lock()
            .items
            .values()
            .filter_map(|it| match &it.target {
                Target::Conn(c) if it.reg != Reg::OffRing && c.path() == Path::Ring => {
                    Some(c.clone())
                }
                _ => None,
            })
            .take(16)
            .collect();
        let refs: Vec<&Conn> = conns.iter().map(|c| &**c).collect();
        crate::conn::spin_inputs_of(&refs)
    }

    /// A member (or a member of a nested set) is off its ring with a switch in flight: its
    /// readiness changes without anything the kernel reports, so sleeps stay short.
    pub fn in_flight(&self) -> bool {
        let st = self.st.lock();
        // (A large set: connections off their ring never leave its looks.)
        st.any_looked_at(|it| match &it.target {
            Target::Conn(c) if it.reg == Reg::OffRing && !it.disabled => {
                c.off_ring_sleep(rules::poll_events(it.events)).1
            }
            Target::Conn(_) | Target::Udp(_) => false,
            Target::Set(s) => s.in_flight(),
        })
    }
}

/// One call of `epoll_wait` on a set.
pub(super) struct Waiter<'a> {
    set: &'a EpollSet,
    epfd: c_int,
    sigmask: *const libc::sigset_t,
    precise: bool,
}

impl Waiter<'_> {
    /// A set without ring members or nested sets: one kernel wait straight into the
    /// program's buffer (as cheap as without memloop), then our tagged events filtered out —
    /// another thread may have added a ring member meanwhile. `None`: only such events came,
    /// go the general way.
    pub(super) fn kernel_only(
        &self,
        out: &mut [epoll_event],
        timeout: Option<Duration>,
    ) -> Option<Result<usize, c_int>> {
        {
            let mut st = self.set.st.lock();
            if !st.items.is_empty() {
                return None;
            }
            st.sleepers += 1;
        }
        let r = kernel::wait(self.epfd, out, timeout, self.sigmask, self.precise);
        self.set.sleep_leave();
        let n = match r {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        let mut kept = 0;
        let mut reported = Reported::default();
        for i in 0..n {
            if let Some(e) = self.set.translate_one(self.epfd, out[i], &mut reported) {
                out[kept] = e;
                kept += 1;
            }
        }
        // Events came but all were ours: nothing for the program yet.
        (kept > 0 || n == 0).then_some(Ok(kept))
    }

    pub(super) fn run(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        timeout: Option<Duration>,
        deadline: Option<Instant>,
    ) -> Result<usize, c_int> {
        let mut spun = false;
        let mut slice = SLICE;
        loop {
            let n = self.harvest(out, tmp)?;
            if n > 0 || timeout == Some(Duration::ZERO) {
                return Ok(n);
            }
            if !spun {
                spun = true;
                let got = self.spin(out, tmp);
                if got > 0 {
                    return Ok(got);
                }
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => l,
                    _ => return Ok(0),
                },
                None => slice,
            };
            let n = self.block(out, tmp, left.min(slice))?;
            if n > 0 {
                return Ok(n);
            }
            if crate::cancel::asked_here() {
                return Err(libc::EINTR);
            }
            // A VM's death shows only as a silent heartbeat (1.5 s): look at it twice as
            // often then, so the program hears of it within 2 s.
            slice = match self.set.watch_peers() {
                true => memloop::LIVENESS_SLICE_VM,
                false => SLICE,
            };
        }
    }

    pub(super) fn spin(&self, out: &mut [epoll_event], tmp: &mut [epoll_event]) -> usize {
        let window = self.set.spin_window();
        let mut i = 0u32;
        let mut got = 0;
        self.set.spinner.spin_with(
            window,
            || self.set.spin_inputs(),
            || {
                i += 1;
                // (The kernel's fds are looked at every 32 rounds — a few µs: none during the
                // first polls, which mostly end the wait or lead to a sleep at once.)
                got = if i % 32 == 0 {
                    self.harvest(out, tmp).unwrap_or(0)
                } else {
                    self.set.collect(self.epfd, out, &mut Reported::default())
                };
                got > 0
            },
        );
        got
    }

    /// Ring readiness plus a non-blocking look at the kernel set. While rings are ready the
    /// kernel is asked only on one call in [`KERNEL_EVERY`] (the system call costs as much as
    /// a ring round trip) — and then first, so that kernel fds get their turn even when
    /// `maxevents` is smaller than the number of ready rings.
    pub(super) fn harvest(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
    ) -> Result<usize, c_int> {
        let set = self.set;
        let mut reported = Reported::default();
        let kernel_turn = set.calls.fetch_add(1, Relaxed) % KERNEL_EVERY == 0;
        if !kernel_turn {
            let n = set.collect(self.epfd, out, &mut reported);
            if n > 0 {
                return Ok(n);
            }
        }
        set.drain_nested_owed();
        let want = out.len().min(tmp.len());
        let k = kernel::wait(
            self.epfd,
            &mut tmp[..want],
            Some(Duration::ZERO),
            self.sigmask,
            false,
        )?;
        let m = set.translate(self.epfd, &tmp[..k], out, &mut reported);
        Ok(m + set.collect(self.epfd, &mut out[m..], &mut reported))
    }

    /// Arms every ring member, re-checks, then sleeps in the kernel.
    pub(super) fn block(
        &self,
        out: &mut [epoll_event],
        tmp: &mut [epoll_event],
        left: Duration,
    ) -> Result<usize, c_int> {
        let set = self.set;
        let mut reported = Reported::default();
        let switching = set.sleep_enter();
        let n = set.collect(self.epfd, out, &mut reported);
        // A switch asked of an armed member: dealt with now (never waiting for the peer), and
        // the sleep kept short while one is under way, as for a call in flight.
        switching.iter().for_each(|c| c.settle_switch_nowait());
        let left = match set.in_flight() || !switching.is_empty() {
            true => left.min(crate::pollsel::IN_FLIGHT),
            false => left,
        };
        let r = if n > 0 {
            Ok(0)
        } else {
            kernel::wait(self.epfd, tmp, Some(left), self.sigmask, self.precise)
        };
        set.sleep_leave();
        if n > 0 {
            return Ok(n);
        }
        let k = r?;
        let m = set.translate(self.epfd, &tmp[..k], out, &mut reported);
        Ok(m + set.collect(self.epfd, &mut out[m..], &mut reported))
    }
}

/// What a tagged kernel event turned out to be.
pub(super) enum Settled {
    /// A word of the program's that only looks like ours: pass it on.
    NotOurs,
    /// Ours; maybe with an event for the program (a nested set, a connection now on TCP).
    Ours(Option<epoll_event>),
}

/// A pending connection stayed on TCP: from now on a kernel fd like any other. Its
/// registration gets the program's own events and data, and the event that settled it goes
/// to the program.
pub(super) fn to_kernel_fd(epfd: c_int, mut it: Item, kernel_ev: u32) -> Option<epoll_event> {
    if it.armed {
        disarm(&mut it);
    }
    if it.fd_open {
        let events = it.events & !EXCLUSIVE;
        kernel::ctl_or_log(
            "settled on TCP",
            epfd,
            libc::EPOLL_CTL_MOD,
            it.fd,
            events,
            it.data,
        );
        if let Target::Conn(c) = &it.target {
            // A late ring may bring it back to us: noted (under the set's lock).
            crate::late::handed_back(c, epfd, events, it.data);
        }
    }
    let rep = rules::report(kernel_ev, it.events);
    (rep != 0).then_some(epoll_event {
        events: rep,
        u64: it.data,
    })
}

/// What a collection found so far.
#[derive(Default)]
pub(super) struct Got {
    n: usize,
    last: Option<u32>,
    owed: Vec<Arc<Conn>>,
}

impl Got {
    fn push(
        &mut self,
        id: u32,
        it: &Item,
        e: epoll_event,
        out: &mut [epoll_event],
        reported: &mut Reported,
    ) {
        out[self.n] = e;
        if let Target::Conn(c) = &it.target {
            self.owed.push(c.clone());
        }
        reported.push(id);
        self.last = Some(id);
        self.n += 1;
    }
}

/// The event item `id` reports now, if any (a one-shot fires, an edge is consumed).
fn offer(epfd: c_int, id: u32, it: &mut Item) -> Option<epoll_event> {
    if it.disabled {
        return None;
    }
    let (rep, sig) = it.readiness_with(false)?;
    if rep == 0 {
        it.edge.reset();
        return None;
    }
    if it.events & ET != 0 && !it.edge.fire(sig) {
        return None;
    }
    if it.events & ONESHOT != 0 {
        disable(epfd, id, it);
    }
    Some(epoll_event {
        events: rep,
        u64: it.data,
    })
}

/// [`EpollSet::collect`] for a large set: only the looks. A look that finds nothing arms the
/// item (or re-arms it: the wake-up that named it cleared its flag) and looks once more — a
/// publication between the two is then seen now, one after it wakes the set — and only then
/// lets it go quiet.
fn collect_looks(
    st: &mut State,
    epfd: c_int,
    out: &mut [epoll_event],
    reported: &mut Reported,
    got: &mut Got,
) {
    let mut quiet = Vec::new();
    let now = st.begin_round();
    let quiet_ms = st.quiet_ms();
    let cursor = st.cursor;
    let State { items, looks, .. } = &mut *st;
    let Some(l) = looks.as_ref() else { return };
    // Ready members take turns: from after the one reported last, until `out` is full.
    for &id in l.ids.range(cursor..).chain(l.ids.range(..cursor)) {
        if got.n == out.len() {
            break;
        }
        if reported.contains(&id) {
            continue;
        }
        let Some(it) = items.get_mut(&id) else {
            quiet.push(id);
            continue;
        };
        let mut ev = offer(epfd, id, it);
        if ev.is_none() && index::may_go_quiet(it, now, quiet_ms) && arm_lasting(it) {
            ev = offer(epfd, id, it);
            if ev.is_none() {
                quiet.push(id);
            }
        }
        if let Some(e) = ev {
            it.seen = now;
            got.push(id, it, e, out, reported);
        }
    }
    st.quiet(&quiet);
}

/// The items one call reported already: each is reported once per call, as by the kernel.
/// (A list while short; a set once a call reports many — a busy set of thousands reports
/// up to a thousand per call.)
#[derive(Default)]
pub(super) struct Reported {
    few: Vec<u32>,
    many: std::collections::HashSet<u32, std::hash::BuildHasherDefault<IdHasher>>,
}

/// Hashes item ids (small integers we issue, not chosen by anyone else): one multiplication,
/// where the default hasher's SipHash showed in a busy set's profile.
#[derive(Default)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|b| self.write_u64(u64::from(*b)));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Reported {
    const FEW: usize = 32;

    pub(super) fn contains(&self, id: &u32) -> bool {
        match self.many.is_empty() {
            true => self.few.contains(id),
            false => self.many.contains(id),
        }
    }

    pub(super) fn push(&mut self, id: u32) {
        if self.many.is_empty() && self.few.len() < Self::FEW {
            return self.few.push(id);
        }
        self.many.extend(self.few.drain(..));
        self.many.insert(id);
    }
}

/// Gives the set its wake socket, registered in the kernel set `epfd` (whose waits, and those
/// of any set or poll containing it, it then wakes). Without one the members' arms ring
/// doorbells.
fn add_wake(st: &mut State, epfd: c_int) {
    let Some(w) = crate::wake::WakeSocket::create() else {
        return;
    };
    if let Err(e) = kernel::ctl(epfd, libc::EPOLL_CTL_ADD, w.fd(), IN, kernel::tag(WAKE_ID)) {
        tracing::debug!(errno = e, "wake socket not registered: doorbells instead");
        return;
    }
    let t = w.target();
    st.wake = Some(Arc::new(w));
    st.items.values_mut().for_each(|it| it.wake = t);
}
