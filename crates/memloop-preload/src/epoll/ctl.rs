//! `epoll_ctl` on an emulated set: items added, modified and removed under the kernel's own
//! error rules, registrations following the kernel's lifetime rules for closed and dup'd fds,
//! and kicks for members made ready while someone sleeps.

use super::*;

impl EpollSet {
    /// `epoll_ctl` on a ring connection or a nested set, with the kernel's error rules.
    pub fn ctl(
        &self,
        epfd: c_int,
        op: c_int,
        fd: c_int,
        target: Target,
        ev: Option<(u32, u64)>,
    ) -> Result<(), c_int> {
        self.set_fd(epfd);
        let mut st = self.st.lock();
        let existing = st.by_fd.get(&fd).copied();
        let exclusive = existing.map(|id| st.items[&id].events & EXCLUSIVE != 0);
        let is_set = matches!(target, Target::Set(_));
        rules::check_ctl(op, ev.map(|e| e.0), is_set, exclusive)?;
        match (op, existing, ev) {
            (libc::EPOLL_CTL_ADD, _, Some((events, data))) => {
                self.insert(&mut st, epfd, fd, target, events, data, libc::EPOLL_CTL_ADD)
            }
            (libc::EPOLL_CTL_MOD, Some(id), Some(ev)) => self.modify(&mut st, epfd, id, ev),
            (libc::EPOLL_CTL_DEL, Some(id), _) => self.delete(&mut st, epfd, id),
            _ => Err(libc::EINVAL),
        }
    }

    /// Takes over a registration the program made in the kernel before `fd` became ours (a
    /// socket registered before it connected, or a registration inherited across exec).
    pub fn adopt(&self, epfd: c_int, fd: c_int, target: Target, events: u32, data: u64) {
        let mut st = self.st.lock();
        if st.by_fd.contains_key(&fd) {
            return;
        }
        if let Err(e) = self.insert(&mut st, epfd, fd, target, events, data, libc::EPOLL_CTL_MOD) {
            tracing::debug!(fd, e, "could not take over an epoll registration");
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert(
        &self,
        st: &mut State,
        epfd: c_int,
        fd: c_int,
        target: Target,
        events: u32,
        data: u64,
        op: c_int,
    ) -> Result<(), c_int> {
        // A parked registration of the same connection: its id, and no kernel ADD.
        let parked = take_parked(st, epfd, fd, &target);
        let id = parked.unwrap_or_else(|| free_id(st));
        let mut it = Item {
            fd,
            fd_open: true,
            reg: Reg::of(&target),
            target,
            events,
            data,
            edge: Edge::default(),
            disabled: false,
            armed: false,
            lasting: false,
            seen: index::now_ms(),
            kicked: false,
            hot: Cell::new(true),
            edges: 0,
            wake: st.wake_target(),
            targeted: [false; 2],
        };
        let kev = it.kernel_events().unwrap_or(IN);
        match parked {
            Some(_) if kev == PARKED_EVENTS => {}
            Some(_) => kernel::ctl(epfd, libc::EPOLL_CTL_MOD, fd, kev, kernel::tag(id))
                .inspect_err(|_| {
                    // (Not left behind under an id nobody knows.)
                    kernel::ctl_or_log("unpark", epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
                })?,
            None => kernel::ctl(epfd, op, fd, kev, kernel::tag(id))?,
        }
        if let Target::Udp(u) = &it.target {
            // Its senders' wake-ups: edge-triggered, read by the socket's last sleeper out.
            let ev = IN | ET;
            if let Err(e) = kernel::ctl(epfd, libc::EPOLL_CTL_ADD, u.wake_fd(), ev, kernel::tag(id))
            {
                tracing::debug!(fd, e, "UDP wake socket not in the epoll set");
            }
        }
        if st.sleepers > 0 {
            arm(&mut it);
            kick_if_ready(epfd, id, &mut it);
        }
        st.map_item(id, &it.target);
        st.items.insert(id, it);
        st.by_fd.insert(fd, id);
        self.targets.fetch_add(1, Release);
        Ok(())
    }

    pub(super) fn modify(
        &self,
        st: &mut State,
        epfd: c_int,
        id: u32,
        (events, data): (u32, u64),
    ) -> Result<(), c_int> {
        let sleeping = st.sleepers > 0;
        st.look(id);
        let it = st.items.get_mut(&id).ok_or(libc::ENOENT)?;
        let (old_events, old_kicked) = (it.events, it.kicked);
        let old_kev = it.kernel_events();
        it.events = events;
        it.kicked = false;
        it.disabled = false;
        it.hot.set(true);
        // (A ring connection's registration does not depend on the program's interest: a
        // `MOD` at every request, as event loops do, costs no system call.)
        if let Some(kev) = it.kernel_events().filter(|k| Some(*k) != old_kev) {
            if let Err(e) = kernel::ctl(epfd, libc::EPOLL_CTL_MOD, it.fd, kev, kernel::tag(id)) {
                it.events = old_events;
                it.kicked = old_kicked;
                return Err(e);
            }
        }
        // Re-arm for the new directions: disarm with the old interest, arm with the new.
        let was_armed = it.armed;
        if was_armed {
            it.events = old_events;
            disarm(it);
            it.events = events;
        }
        it.data = data;
        it.edge.reset();
        if sleeping {
            arm(it);
            kick_if_ready(epfd, id, it);
        }
        Ok(())
    }

    pub(super) fn delete(&self, st: &mut State, epfd: c_int, id: u32) -> Result<(), c_int> {
        let mut it = self.remove(st, id).ok_or(libc::ENOENT)?;
        if it.armed {
            disarm(&mut it);
        }
        match (&it.target, it.reg) {
            (_, Reg::Dormant) => Ok(()),
            (Target::Conn(c), Reg::Ring)
                if it.fd_open && it.kernel_events() == Some(PARKED_EVENTS) =>
            {
                st.parked.insert(it.fd, (id, c.clone()));
                st.parked_ids.insert(id, it.fd);
                Ok(())
            }
            _ => kernel::ctl(epfd, libc::EPOLL_CTL_DEL, it.fd, 0, 0),
        }
    }

    pub(super) fn remove(&self, st: &mut State, id: u32) -> Option<Item> {
        let it = st.items.remove(&id)?;
        if let Target::Udp(u) = &it.target {
            let epfd = self.fd();
            kernel::ctl_or_log("udp wake", epfd, libc::EPOLL_CTL_DEL, u.wake_fd(), 0, 0);
        }
        if st.by_fd.get(&it.fd) == Some(&id) {
            st.by_fd.remove(&it.fd);
        }
        st.unmap_item(id, &it.target);
        self.targets.fetch_sub(1, Release);
        Some(it)
    }

    /// `fd` settled on TCP without a kernel event telling us: its registration becomes the
    /// program's own again.
    pub fn release_fd(&self, epfd: c_int, fd: c_int) {
        let mut st = self.st.lock();
        let Some(&id) = st.by_fd.get(&fd) else { return };
        if let Some(it) = self.remove(&mut st, id) {
            // Without a kernel event (0) there is never an event to report.
            let _ = to_kernel_fd(epfd, it, 0);
        }
    }

    /// `new` took `fd`'s place from `old` (a late ring's conversion): `old`'s item for `fd`
    /// watches `new` from now on, answered off its ring.
    pub fn retarget(&self, fd: c_int, old: &Arc<Conn>, new: &Arc<Conn>) {
        {
            let mut st = self.st.lock();
            let Some(&id) = st.by_fd.get(&fd) else { return };
            let Some(it) = st.items.get_mut(&id) else {
                return;
            };
            if !matches!(&it.target, Target::Conn(x) if Arc::ptr_eq(x, old)) {
                return;
            }
            let (was, now) = (it.target.clone(), Target::Conn(new.clone()));
            it.target = now.clone();
            st.unmap_item(id, &was);
            st.map_item(id, &now);
        }
        tracing::debug!(fd, "epoll item follows the late ring's connection");
        self.conn_path_changed(new);
    }

    /// Connection `c` left its ring or came back to it: its items follow. Off its ring an
    /// item is answered from its socket, filtered ([`Reg::OffRing`]); back on it, from the
    /// ring again, armed for sleepers and kicked if ready.
    pub fn conn_path_changed(&self, c: &crate::conn::Conn) {
        let epfd = self.fd();
        let mut st = self.st.lock();
        // Read under the lock: of two threads following two path changes, the later one
        // converts last.
        let Some(reg) = Reg::following(c.path()) else {
            return;
        };
        let sleeping = st.sleepers > 0;
        for id in st.ids_of(c) {
            st.look(id);
            if let Some(it) = st.items.get_mut(&id) {
                it.hot.set(true);
                follow(epfd, id, it, reg, sleeping);
            }
        }
    }

    /// The program is closing `fd`, one of `target`'s fds. The kernel keeps a registration
    /// while another fd of the same file is open (`last == false`): so do we, but the closed
    /// number no longer names it. With the last fd the registration goes.
    pub fn fd_closed(&self, fd: c_int, target: &Target, last: bool) {
        let mut st = self.st.lock();
        // (Before the close: another holder of the file would keep the registration.)
        unpark(&mut st, self.fd(), fd);
        let candidates = match target {
            Target::Conn(c) => st.ids_of(c),
            Target::Set(_) | Target::Udp(_) => st.items.keys().copied().collect(),
        };
        let ids: Vec<u32> = candidates
            .into_iter()
            .filter(|id| {
                st.items
                    .get(id)
                    .is_some_and(|it| it.target.is(target) && (last || it.fd == fd))
            })
            .collect();
        for id in ids {
            if last {
                if let Some(mut it) = self.remove(&mut st, id) {
                    if it.armed {
                        disarm(&mut it);
                    }
                }
            } else if let Some(it) = st.items.get_mut(&id) {
                it.fd_open = false;
                if st.by_fd.get(&fd) == Some(&id) {
                    st.by_fd.remove(&fd);
                }
            }
        }
    }

    /// Something of this process made `conn` ready (a shutdown of our own): wake sleepers
    /// that watch it, as the kernel would.
    pub fn poke(&self, conn: &Arc<Conn>) {
        let epfd = self.fd();
        let mut st = self.st.lock();
        let sleeping = st.sleepers > 0;
        for id in st.ids_of(conn) {
            // (A large set's quiet member: no wake-up will name it for this.)
            st.look(id);
            if let (Some(it), true) = (st.items.get_mut(&id), sleeping) {
                kick_if_ready(epfd, id, it);
            }
        }
    }

    /// Kicks one ready member (a set containing this one must wake).
    pub(super) fn kick_ready(&self) {
        let epfd = self.fd();
        let mut st = self.st.lock();
        if let Some((id, it)) = st.items.iter_mut().find(|(_, it)| it.would_report()) {
            kick(epfd, *id, it);
        }
    }

    /// [`Self::drain_owed`] for the nested sets only (this set's own doorbells are read as
    /// their events come).
    pub(super) fn drain_nested_owed(&self) {
        if self.st.lock().nested == 0 {
            return;
        }
        for t in self.targets() {
            if let Target::Set(s) = t {
                s.drain_owed();
            }
        }
    }

    /// Reads the doorbells owed to the ring members (of this set and the sets in it) before
    /// the kernel is asked whether this set is readable: an unread doorbell whose data was
    /// consumed would make it look readable with nothing to report.
    pub fn drain_owed(&self) {
        {
            // A large set's members stay armed: wake-ups for data the program has read
            // since (without a wait on this set) would leave it readable with nothing to
            // report. Their names are kept as looks.
            let mut st = self.st.lock();
            if st.indexed() {
                st.drain_wake();
            }
        }
        for t in self.targets() {
            match t {
                Target::Conn(c) => c.drain_owed(),
                Target::Set(s) => s.drain_owed(),
                // (Its wake socket is registered edge-triggered: never readable twice.)
                Target::Udp(_) => {}
            }
        }
    }

    /// Whether this set (open as `fd`) has something to report, asked when the kernel says
    /// it is readable but no ring member is ready: a wake-up or doorbell sent for data read
    /// since (the peer saw our arm just before we left) keeps the kernel saying so, and the
    /// kernel's own sets are never readable with nothing inside. Reads those, then looks
    /// again (at the rings too: data that came meanwhile is reported here, where its wake-up
    /// was read).
    pub fn still_readable(&self, fd: c_int) -> bool {
        self.st.lock().drain_wake();
        self.drain_owed();
        if self.peek().is_some() {
            return true;
        }
        let mut p = [libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }];
        crate::real::poll_now(&mut p).map_or(true, |_| p[0].revents & libc::POLLIN != 0)
    }

    /// The members' targets, taken under the lock to be used after it (their calls may
    /// block or take other sets' locks).
    pub(super) fn targets(&self) -> Vec<Target> {
        self.st
            .lock()
            .items
            .values()
            .map(|it| it.target.clone())
            .collect()
    }
}

pub(super) fn free_id(st: &mut State) -> u32 {
    loop {
        let id = st.next;
        st.next = st.next.wrapping_add(1);
        st.wrapped |= st.next == 0;
        if id != WAKE_ID && !st.items.contains_key(&id) && !st.parked_ids.contains_key(&id) {
            return id;
        }
    }
}

/// The kernel events of a registration that can be parked: a ring connection's, unkicked.
const PARKED_EVENTS: u32 = IN;

/// The id of `fd`'s parked registration if it is `target`'s (taken out of the parked ones);
/// one of another connection (the number was reused) is removed from the kernel.
fn take_parked(st: &mut State, epfd: c_int, fd: c_int, target: &Target) -> Option<u32> {
    let (id, c) = st.parked.get(&fd)?.clone();
    if !matches!(target, Target::Conn(t) if Arc::ptr_eq(t, &c)) {
        unpark(st, epfd, fd);
        return None;
    }
    st.parked.remove(&fd);
    st.parked_ids.remove(&id);
    Some(id)
}

/// Removes `fd`'s parked registration, if any, from the kernel set for good.
pub(super) fn unpark(st: &mut State, epfd: c_int, fd: c_int) {
    if let Some((id, _)) = st.parked.remove(&fd) {
        st.parked_ids.remove(&id);
        kernel::ctl_or_log("unpark", epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
    }
}

/// A kernel event for a parked registration (a doorbell, the peer's FIN): nobody watches it,
/// so it leaves the kernel set (level-triggered, it would report at every wait).
pub(super) fn parked_event(st: &mut State, epfd: c_int, id: u32) -> bool {
    match st.parked_ids.get(&id) {
        Some(&fd) => {
            unpark(st, epfd, fd);
            true
        }
        None => false,
    }
}

/// Converts one item of a connection whose path changed to the registration `reg` of its new
/// path (nothing if it has it already).
pub(super) fn follow(epfd: c_int, id: u32, it: &mut Item, reg: Reg, sleeping: bool) {
    if it.reg == reg {
        return;
    }
    if it.armed {
        disarm(it);
    }
    let op = match it.reg {
        Reg::Dormant => libc::EPOLL_CTL_ADD,
        _ => libc::EPOLL_CTL_MOD,
    };
    (it.reg, it.kicked) = (reg, false);
    it.edge.reset();
    if let (Some(kev), true) = (it.kernel_events(), it.fd_open) {
        kernel::ctl_or_log("path changed", epfd, op, it.fd, kev, kernel::tag(id));
    }
    if sleeping {
        arm(it);
        kick_if_ready(epfd, id, it);
    }
}
