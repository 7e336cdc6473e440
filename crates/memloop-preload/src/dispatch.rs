//! Safe glue between the exported C functions and the rest: where a call on an fd goes, and
//! the bookkeeping for socket creation, connect, listen, accept, close and dup.

use crate::agree::{self, Accepted};
use crate::conn::{Conn, Path};
use crate::engine;
use crate::epoll::{EpollSet, Target};
use crate::listen::Listener;
use crate::plain::PlainTcp;
use crate::table::{self, Entry, Fresh};
use libc::c_int;
use memloop::registry::{EndpointInfo, FallbackReason, SwitchReason};
use std::net::SocketAddr;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;

/// Where a data call on an fd goes.
pub enum Route {
    /// Straight to the kernel, untouched.
    Real,
    Ring(Arc<Conn>),
    /// On TCP after a switch: still ours to carry (it may come back to its ring).
    Switched(Arc<Conn>),
    /// Switching paths and the peer has not left yet, on a non-blocking socket: `EAGAIN`.
    Busy,
    /// To the kernel, with byte counts for `memloop status`.
    Counted(Arc<PlainTcp>),
}

#[inline]
pub fn route(fd: c_int) -> Route {
    if table::kind(fd) != table::K_OBJ {
        return Route::Real;
    }
    match table::get(fd).as_deref() {
        Some(Entry::Conn(c)) => {
            engine::ensure_heartbeat();
            if !c.switch_quiet() {
                c.settle_switch();
            }
            let mut path = c.resolve(true);
            if path == Path::Leaving && crate::real::status_flags(fd) & libc::O_NONBLOCK != 0 {
                // Non-blocking: finish the switch if the peer has left, else come back later.
                c.settle_switch_nowait();
                path = c.path();
                if path == Path::Leaving {
                    return Route::Busy;
                }
            }
            while path == Path::Leaving {
                // Another thread is switching it: the socket is not ours to use until the
                // switch is over (the peer's doorbells are still ahead of its data, and our
                // TCP byte count starts when it is done).
                c.settle_switch();
                path = c.path();
                if path == Path::Leaving {
                    std::thread::yield_now();
                }
            }
            match path {
                Path::Ring => Route::Ring(c.clone()),
                // (Not from `switched()`: it looks at the path again, which may have moved on
                // since `path` was read — a promotion just completed — and a kernel call on
                // a connection of ours sends data behind its doorbells or reads them.)
                _ if c.was_ring() => Route::Switched(c.clone()),
                _ => c.plain().map_or(Route::Real, Route::Counted),
            }
        }
        Some(Entry::Plain(p)) => Route::Counted(p.clone()),
        _ => Route::Real,
    }
}

/// A new socket: inet stream sockets become candidates.
pub fn on_socket(fd: c_int, domain: c_int, ty: c_int, proto: c_int) {
    let stream = ty & 0xf == libc::SOCK_STREAM;
    let inet = domain == libc::AF_INET || domain == libc::AF_INET6;
    if fd >= 0 && stream && inet && (proto == 0 || proto == libc::IPPROTO_TCP) {
        table::mark_tcp(fd);
    } else if fd >= 0 && crate::udp::is_udp(domain, ty, proto) && !engine::disabled() {
        table::mark_udp(fd);
    }
}

/// Whether `fd` is a candidate socket that has not connected or listened yet.
pub fn is_candidate(fd: c_int) -> bool {
    match table::kind(fd) {
        table::K_TCP => true,
        table::K_OBJ => matches!(table::get(fd).as_deref(), Some(Entry::Fresh(_))),
        _ => false,
    }
}

/// A connect to a co-resident listener in progress: announced on the endpoint from before the
/// real `connect` until the offer is published, so the server knows an offer is coming.
pub struct Connecting {
    engine: Arc<engine::Engine>,
    /// `None`: the address is co-resident but nobody listens there in the region (yet): the
    /// connection may come to a ring late if a listener is published for it.
    ep: Option<EndpointInfo>,
    dst: SocketAddr,
    announced: Option<memloop::registry::ShmU32>,
    /// Nobody listening: counted among the clients that may look for a decline marker from
    /// before the connect (a server that accepts it finds no announced connect).
    looking: Option<crate::late::LookToken>,
}

impl Drop for Connecting {
    fn drop(&mut self) {
        if let Some(w) = &self.announced {
            // Cannot fail: the update always returns `Some`.
            let _ = w.fetch_update(SeqCst, Relaxed, |v| Some(v.saturating_sub(1)));
        }
    }
}

/// Set once the process created an io_uring instance: it may then poll or read sockets
/// through it, where the rings and their doorbells cannot be seen, so its new connections
/// stay on TCP (counted as unsupported).
static IO_URING: AtomicBool = AtomicBool::new(false);

/// The program called `io_uring_setup` (through the C library's `syscall`).
pub fn note_io_uring() {
    if !IO_URING.swap(true, SeqCst) {
        tracing::debug!("io_uring in use: new connections of this process stay on TCP");
    }
}

pub(crate) fn io_uring_used() -> bool {
    IO_URING.load(Relaxed)
}

/// The region takes new ring connections (not paused or being destroyed by its operator).
fn region_open(engine: &engine::Engine) -> bool {
    engine.registry().state() == memloop::registry::RegionState::Open
}

/// Before the real connect: the co-resident listener, if any.
pub fn before_connect(fd: c_int, dst: Option<SocketAddr>) -> Option<Connecting> {
    if !is_candidate(fd) {
        return None;
    }
    let dst = dst?;
    crate::testpoint::panic_if_asked(crate::testpoint::Point::Connect);
    let engine = engine::get()?;
    if io_uring_used() {
        tracing::debug!(fd, %dst, "connect stays on TCP: io_uring in use");
        engine
            .registry()
            .count_fallback(FallbackReason::Unsupported);
        return None;
    }
    match agree::find_listener(&engine, dst) {
        // The server refuses it too, and counts it (once per connection).
        Ok(_) if !region_open(&engine) => {
            tracing::debug!(fd, %dst, "connect stays on TCP: the region is paused");
            None
        }
        Ok(ep) => {
            let announced = match engine.registry().endpoint_connecting(ep.id) {
                Ok(w) => Some(w),
                Err(e) => {
                    // Unannounced, the server waits only its short time for our offer.
                    tracing::debug!(fd, %dst, %e, "connect not announced on the endpoint");
                    None
                }
            };
            if let Some(w) = &announced {
                w.fetch_add(1, SeqCst);
            }
            Some(Connecting {
                engine,
                ep: Some(ep),
                dst,
                announced,
                looking: None,
            })
        }
        Err(reason) => {
            tracing::debug!(fd, %dst, %reason, "connect stays on TCP");
            engine.registry().count_fallback(reason);
            (reason == FallbackReason::NoListener && crate::late::may_arm_unlisted(&engine)).then(
                || Connecting {
                    looking: Some(crate::late::LookToken::take(&engine)),
                    engine,
                    ep: None,
                    dst,
                    announced: None,
                },
            )
        }
    }
}

/// After a real connect that succeeded or is in progress: offer the channel.
pub fn after_connect(fd: c_int, mut c: Connecting) {
    let fresh = fresh_epolls(fd);
    let (engine, dst) = (c.engine.clone(), c.dst);
    let Some(ep) = &c.ep else {
        let looked = c
            .looking
            .take()
            .and_then(|t| crate::late::unlisted(&engine, fd, dst, t));
        if let Some(p) = looked {
            table::insert(fd, Entry::Plain(p));
        }
        return;
    };
    match agree::client_offer(&engine, ep, fd, dst) {
        Ok(conn) => {
            tracing::debug!(fd, %dst, "offered a ring");
            table::insert(fd, Entry::Conn(conn.clone()));
            adopt_epolls(fd, &conn, fresh);
        }
        Err(reason) => {
            tracing::debug!(fd, %dst, %reason, "no ring offered");
            let p = agree::record_plain(&engine, fd, reason, None, None);
            table::insert(fd, Entry::Plain(p));
        }
    }
}

fn fresh_epolls(fd: c_int) -> Vec<(c_int, u32, u64)> {
    match table::get(fd).as_deref() {
        Some(Entry::Fresh(f)) => f.epolls.lock().clone(),
        _ => Vec::new(),
    }
}

/// Moves epoll registrations made before the connection became ours into our epoll sets.
pub fn adopt_epolls(fd: c_int, conn: &Arc<Conn>, regs: Vec<(c_int, u32, u64)>) {
    for (epfd, events, data) in regs {
        tracing::debug!(fd, epfd, "epoll registration taken over");
        if let Some(s) = epoll_set(epfd) {
            s.adopt(epfd, fd, Target::Conn(conn.clone()), events, data);
        }
    }
}

/// A new epoll set: known from birth, so that every wait on it filters our registrations.
pub fn after_epoll_create(epfd: c_int) {
    if epfd >= 0 && !engine::disabled() {
        table::insert(epfd, Entry::Epoll(EpollSet::new(epfd)));
    }
}

/// Our record of epoll set `epfd`. Sets are recorded at birth; one we never saw (made before
/// we were loaded) is recorded now. `None`: `epfd` is one of our other fds, not an epoll set.
fn epoll_set(epfd: c_int) -> Option<Arc<EpollSet>> {
    match table::get(epfd).as_deref() {
        Some(Entry::Epoll(s)) => return Some(s.clone()),
        Some(_) => return None,
        None => {}
    }
    if table::kind(epfd) != table::K_NONE {
        return None;
    }
    let s = EpollSet::new(epfd);
    table::insert(epfd, Entry::Epoll(s.clone()));
    Some(s)
}

pub fn after_listen(fd: c_int) {
    if !is_candidate(fd) {
        return;
    }
    let l = match engine::get() {
        Some(engine) => Listener::register(&engine, fd),
        // No region yet: published when the process joins one (at a later accept).
        None if !engine::disabled() => Listener::dormant(memloop::identity::net_scope(), fd),
        None => None,
    };
    if let Some(l) = l {
        table::insert(fd, Entry::Listener(l));
    }
}

/// Before a (possibly blocking) accept on a listener of ours: join the region now, not after
/// a connection arrived (a forked worker's first accept would otherwise keep its client
/// waiting for the join), and publish the listener if it was made while dormant.
pub fn before_accept(lfd: c_int) {
    if table::kind(lfd) != table::K_OBJ {
        return;
    }
    if let Some(Entry::Listener(l)) = table::get(lfd).as_deref() {
        // Only joins ahead of time; `after_accept` asks again (and says if there is none).
        if let Some(engine) = engine::get() {
            l.publish(&engine);
        }
    }
}

/// After a real accept on `lfd` produced `fd`.
pub fn after_accept(lfd: c_int, fd: c_int) {
    if fd < 0 || table::kind(lfd) != table::K_OBJ {
        return;
    }
    let Some(e) = table::get(lfd) else { return };
    let Entry::Listener(l) = &*e else {
        return;
    };
    let Some(engine) = engine::get() else { return };
    l.publish(&engine);
    let Some(ep) = l.endpoint(&engine) else {
        table::mark_tcp(fd);
        return;
    };
    let accepted = if io_uring_used() {
        agree::server_refuse(&engine, ep, fd, FallbackReason::Unsupported)
    } else if !region_open(&engine) {
        agree::server_refuse(&engine, ep, fd, FallbackReason::Paused)
    } else {
        agree::server_accept(&engine, ep, fd)
    };
    match accepted {
        Accepted::Ring(conn) => {
            tracing::debug!(fd, "accepted on a ring");
            table::insert(fd, Entry::Conn(conn));
        }
        // A client that is no member, or runs without the library: never a ring, so nothing
        // to record or follow (the fd stays the kernel's: every later call passes straight
        // through), as a client's connect to no listener. Counted only.
        Accepted::Plain(
            reason @ (FallbackReason::NotMember | FallbackReason::PeerNotPreloaded),
            None,
        ) => {
            engine.registry().count_fallback(reason);
        }
        Accepted::Plain(reason, marker) => {
            let p = agree::record_plain(&engine, fd, reason, Some(ep), marker);
            table::insert(fd, Entry::Plain(p));
        }
    }
}

/// Before the real close of `fd` (also for the implicit close of dup2's target).
pub fn before_close(fd: c_int) {
    crate::conn::linger::release_done();
    let Some(mut e) = table::get(fd) else {
        if table::kind(fd) == table::K_OWN {
            crate::conn::linger::program_closes(fd);
            crate::engine::own_fd_closing(fd);
        }
        table::remove(fd);
        return;
    };
    // (Waits for a conversion under way: then the converted connection is closed.)
    if crate::late::closing(&e) {
        match table::get(fd) {
            Some(now) => e = now,
            None => {
                table::remove(fd);
                return;
            }
        }
    }
    match &*e {
        Entry::Conn(c) => {
            let last = c.close_fd(fd);
            let target = Target::Conn(c.clone());
            for s in table::epoll_sets() {
                s.fd_closed(fd, &target, last);
            }
            if last {
                if c.path() == Path::Pending {
                    c.abandon();
                } else {
                    c.release_with(fd);
                }
            }
        }
        Entry::Epoll(set) => epoll_closed(fd, set),
        Entry::Udp(u) => {
            let last = !table::shared_with_another_fd(fd, &e);
            if last {
                u.before_close(fd);
            }
            let target = Target::Udp(u.clone());
            for s in table::epoll_sets() {
                s.fd_closed(fd, &target, last);
            }
        }
        // A listener stays published while a dup of it is open (the kernel keeps listening).
        Entry::Listener(l) if !table::shared_with_another_fd(fd, &e) => l.unregister(),
        _ => {}
    }
    table::remove(fd);
}

/// An epoll fd closes: with its last fd the set leaves every set it was nested in.
fn epoll_closed(fd: c_int, set: &Arc<EpollSet>) {
    let others: Vec<c_int> = table::epoll_fds_of(set)
        .into_iter()
        .filter(|&f| f != fd)
        .collect();
    if let Some(&f) = others.first() {
        set.set_fd(f);
    }
    let target = Target::Set(set.clone());
    for s in table::epoll_sets() {
        if !Arc::ptr_eq(&s, set) {
            s.fd_closed(fd, &target, others.is_empty());
        }
    }
}

/// After a successful dup of `old` into `new` (the kernel already closed `new`'s old file).
pub fn after_dup(old: c_int, new: c_int) {
    crate::late::taint(old, "dup");
    if table::kind(old) != table::K_NONE {
        table::duplicate(old, new);
    }
}

/// epoll_ctl on an fd of ours. `None`: not ours, the caller passes it through.
pub fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: Option<(u32, u64)>,
) -> Option<Result<(), c_int>> {
    if table::kind(fd) == table::K_UDP && op == libc::EPOLL_CTL_ADD {
        // Its kernel registration could not report the rings once it is published.
        crate::udp::kernel_only(
            fd,
            "in an epoll set before it was bound",
            FallbackReason::Unsupported,
        );
        return None;
    }
    if table::kind(fd) != table::K_OBJ {
        return None;
    }
    let mut e = table::get(fd)?;
    loop {
        match crate::late::epoll_ctl(fd, &e, epfd, op, ev) {
            crate::late::Ctl::Pass => break,
            crate::late::Ctl::Done(r) => return Some(r),
            crate::late::Ctl::Reroute => e = table::get(fd)?,
        }
    }
    let target = match &*e {
        // Ever on its ring: ours for good (its socket may hold doorbells).
        Entry::Conn(c) if matches!(c.path(), Path::Pending | Path::Ring) || c.was_ring() => {
            Target::Conn(c.clone())
        }
        Entry::Conn(_) => {
            // Settled on TCP since it was registered: hand the registration back first.
            if let Some(s) = epoll_of(epfd) {
                s.release_fd(epfd, fd);
            }
            return None;
        }
        Entry::Epoll(s) => Target::Set(s.clone()),
        Entry::Udp(u) => Target::Udp(u.clone()),
        _ => return None,
    };
    match epoll_set(epfd) {
        Some(s) => Some(s.ctl(epfd, op, fd, target, ev)),
        None => Some(Err(libc::EINVAL)),
    }
}

/// A late ring's conversion replaced `old` on `fd` by `new`: the items of every set follow.
pub fn retarget_epolls(fd: c_int, old: &Arc<Conn>, new: &Arc<Conn>) {
    for s in table::epoll_sets() {
        s.retarget(fd, old, new);
    }
}

/// Our own shutdown changed a ring connection's readiness: wake the sets watching it.
pub fn poke(c: &Arc<Conn>) {
    for s in table::epoll_sets() {
        s.poke(c);
    }
}

/// Remembers epoll registrations of a candidate socket (made before it connects).
pub fn note_fresh_epoll(epfd: c_int, op: c_int, fd: c_int, ev: Option<(u32, u64)>) {
    if !is_candidate(fd) {
        return;
    }
    let fresh = match table::get(fd).as_deref() {
        Some(Entry::Fresh(f)) => f.clone(),
        _ => {
            let f = Arc::new(Fresh::default());
            table::insert(fd, Entry::Fresh(f.clone()));
            f
        }
    };
    let mut regs = fresh.epolls.lock();
    regs.retain(|(e, _, _)| *e != epfd);
    if op != libc::EPOLL_CTL_DEL {
        if let Some((events, data)) = ev {
            regs.push((epfd, events, data));
        }
    }
}

/// Whether `fd` is an epoll set with ring interests.
pub fn epoll_of(epfd: c_int) -> Option<Arc<EpollSet>> {
    match &*table::get(epfd)? {
        Entry::Epoll(s) => Some(s.clone()),
        _ => None,
    }
}

/// O_NONBLOCK changed through fcntl or ioctl.
pub fn set_nonblock(fd: c_int, on: bool) {
    if let Some(c) = table::conn(fd) {
        c.nonblock.store(on, std::sync::atomic::Ordering::Relaxed);
    } else if let Some(u) = table::udp(fd) {
        u.nonblock.store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

// ---- exec ---------------------------------------------------------------------------------

/// Before `exec`: ring connections the new image inherits move to TCP unless it loads this
/// library too (then it adopts them); epoll sets the new image inherits (no close-on-exec) get the program's own
/// registrations back in the kernel. `Err(EBUSY)` (nothing done): a connection cannot leave
/// its ring yet (see [`demote_inheritable`]); the exec must not happen.
pub fn before_exec(keeps_library: bool) -> Result<(), c_int> {
    if keeps_library {
        // A connection coming back to its ring (`Joining`) has the peer's last TCP bytes in
        // its socket, where the new image would take them for doorbells (it adopts the
        // connection as a ring one): it goes to TCP first (carrying them), and the new image
        // adopts it there.
        demote_where(SwitchReason::Exec, |c| c.path() == Path::Joining)?;
    } else {
        demote_inheritable(SwitchReason::Exec, "exec into an image without the library")?;
    }
    crate::plain::finish_resends();
    crate::late::taint_all("exec");
    // (Leaving withdraws what no receiver took yet and sends it by the kernel.)
    crate::udp::leave_all("exec");
    if !keeps_library {
        crate::udp::drop_stale_wakes_before_exec();
    }
    // The old image's holds on switched connections pass to the new image if it runs the
    // library (it adopts them); else they end, and the connection stays on TCP for good.
    for c in table::conns() {
        if c.path() == Path::Tcp && c.inheritable() {
            if keeps_library {
                crate::conn::hand_to_next_image(&c);
            } else {
                c.release_switched();
            }
        }
    }
    for (fd, s) in inherited_sets() {
        s.prepare_exec(fd);
    }
    Ok(())
}

/// Ring connections a new program image (or a spawned process) would inherit leave their
/// rings first: that image may be static, setuid or started without the library, and
/// nothing may strand bytes in a ring it cannot read. They stay off their rings for good
/// (pinned, `why`): that program may write on the socket at any moment, where a promotion's
/// stop would make its bytes read as doorbells.
///
/// `Err(EBUSY)`, with nothing pinned: a connection coming back to its ring holds the peer's
/// last TCP bytes unread in its socket, with no room in the ring to carry them
/// (`Conn::demote`); the program must read them first. Handed on now, the other program
/// would read the peer's doorbells after them and never the ring's bytes: the caller fails
/// the exec or spawn instead, and the connection stays here, intact.
pub fn demote_inheritable(reason: SwitchReason, why: &str) -> Result<(), c_int> {
    let ours = |c: &Conn| !matches!(c.path(), Path::Tcp) || c.switched();
    let moved = demote_where(reason, ours)?;
    for c in moved {
        if c.path() == Path::Tcp && c.switched() {
            c.pin_for_good(why);
        }
    }
    Ok(())
}

/// Demotes every inheritable connection `pick` selects; the ones it looked at, or
/// `Err(EBUSY)` if one of them cannot leave its ring yet.
fn demote_where(
    reason: SwitchReason,
    pick: impl Fn(&Conn) -> bool,
) -> Result<Vec<Arc<Conn>>, c_int> {
    let mut moved = Vec::new();
    for c in table::conns() {
        if pick(&c) && c.inheritable() {
            match c.demote(reason) {
                Err(libc::EBUSY) => {
                    tracing::warn!(ch = ?c.ch, %reason, "connection not handed on: the peer's \
                        last TCP bytes are unread (the program must read them first)");
                    return Err(libc::EBUSY);
                }
                Err(e) => {
                    tracing::debug!(ch = ?c.ch, errno = e, %reason, "connection kept its ring")
                }
                Ok(()) => {}
            }
            moved.push(c);
        }
    }
    Ok(moved)
}

/// Before `posix_spawn`: what the child inherits cannot stay on a ring (`Err(EBUSY)`: see
/// [`demote_inheritable`]; the spawn must not happen).
pub fn before_spawn() -> Result<(), c_int> {
    crate::late::taint_inheritable("spawn");
    // The child may run anything and adopts nothing (no exec hook ran).
    demote_inheritable(SwitchReason::Spawn, "posix_spawn")?;
    crate::plain::finish_resends();
    crate::udp::leave_inheritable("posix_spawn");
    Ok(())
}

/// `MSG_OOB` on a ring connection: the ring has no urgent data, so the connection moves to
/// TCP first and the kernel sends the byte.
pub fn before_urgent(fd: c_int) {
    crate::late::taint(fd, "urgent data");
    if let Some(c) = table::conn(fd) {
        if let Err(e) = c.demote(SwitchReason::Oob) {
            tracing::debug!(fd, errno = e, "urgent data: connection kept its ring");
        }
    }
}

/// Ring connections among the fds of an `SCM_RIGHTS` message leave their rings before the
/// message goes: the receiver gets a plain TCP socket, whatever it runs.
///
/// `Err(EBUSY)`: one of them cannot leave its ring yet — it is coming back to it with the
/// peer's last TCP bytes unread in its socket and no room in the ring to carry them
/// (`Conn::demote`). Passed on, the receiver would read the peer's doorbells after those
/// bytes and never the ring's: the message must fail instead (nothing sent, no hold taken;
/// the connection stays with this process, intact, and goes once the program has read them).
pub fn before_passing(fds: &[c_int]) -> Result<(), c_int> {
    let mut passed = Vec::new();
    for &fd in fds {
        crate::udp::kernel_only(fd, "passed with SCM_RIGHTS", FallbackReason::ForkOrExec);
        crate::late::taint(fd, "passed with SCM_RIGHTS");
        if let Some(c) = table::conn(fd) {
            match c.demote(SwitchReason::FdPassed) {
                Ok(()) => passed.push(c),
                Err(libc::EBUSY) => {
                    tracing::warn!(fd, ch = ?c.ch, "SCM_RIGHTS refused (EBUSY): the peer's last \
                        TCP bytes are unread (the program must read them first)");
                    return Err(libc::EBUSY);
                }
                Err(e) => tracing::debug!(fd, errno = e, "passed connection kept its ring"),
            }
        }
    }
    for c in passed {
        crate::conn::hand_off(&c);
    }
    Ok(())
}

/// `pidfd_getfd` gave this process `fd` (a dup of another process's fd, which that process
/// is not told of): `Ok(fd)` for the program, or an errno, the fd closed. A ring connection
/// leaves its ring first and becomes ours on TCP (`conn::grab`); anything else passes.
pub fn after_getfd(fd: c_int) -> Result<c_int, c_int> {
    match crate::hooks::contain("pidfd_getfd", || crate::conn::after_getfd(fd)) {
        Some(Ok(())) => Ok(fd),
        Some(Err(e)) => {
            table::remove(fd);
            crate::real::close_own(fd);
            Err(e)
        }
        None => {
            // Our logic broke half-way: the fd may be a ring connection's socket, which the
            // program must not use raw.
            table::remove(fd);
            crate::real::close_own(fd);
            Err(libc::EIO)
        }
    }
}

/// The `exec` failed: back to our registrations.
pub fn after_failed_exec() {
    crate::conn::take_back_exec_holds();
    for (fd, s) in inherited_sets() {
        s.restore_after_exec(fd);
    }
}

fn inherited_sets() -> Vec<(c_int, Arc<EpollSet>)> {
    table::epoll_fds()
        .into_iter()
        .filter(|(fd, s)| s.has_targets() && crate::real::fd_flags(*fd) & libc::FD_CLOEXEC == 0)
        .collect()
}

// ---- fork ---------------------------------------------------------------------------------

/// Before fork: every ring connection gets one more holder (the child) *now*, so a parent
/// that closes its copy right after fork cannot shut the rings under the child.
/// Set while `fork_prepare` runs if the child must run the engine's child handler at once
/// (the parent holds something of ours beside plain connections and listeners).
static CHILD_NEEDS_ENGINE: AtomicBool = AtomicBool::new(false);

/// Called by the fork preparations that find state of theirs a child must look after.
pub fn child_needs_engine() {
    CHILD_NEEDS_ENGINE.store(true, Relaxed);
}

/// Plain connections a deferred child may use without the engine (the shim's list).
const CHILD_PLAIN_MAX: usize = 64;

pub fn fork_prepare() {
    CHILD_NEEDS_ENGINE.store(false, Relaxed);
    // Before the fork, so a datagram sent from now on goes by the kernel, where the child
    // can read it too (one already in a ring is handed back to its sender, which sends it
    // by the kernel as well).
    crate::udp::leave_all("shared with a forked child");
    engine::lock_for_fork();
    crate::plain::lock_for_fork();
    crate::conn::handoff::lock_for_fork();
    crate::conn::linger::lock_for_fork();
    crate::late::lock_for_fork();
    table::lock_for_fork(|c| {
        c.prepare_fork();
        c.hold_bell_for_fork();
        c.hold_fds_for_fork();
    });
    crate::epoll::hold_for_fork(table::epoll_sets());
    table::hold_epoll_list_for_fork();
    offer_child_plan();
}

/// Tells the shim (if it loaded us) whether the child may put the engine's child handler off
/// until it needs the engine, and what it may use meanwhile: a fork-per-connection server's
/// child then runs none of our code for its connection (each page of ours it touched was a
/// fault: +27 % per connection). Everything is held now, so the answer stands at the fork.
fn offer_child_plan() {
    let plan = match CHILD_NEEDS_ENGINE.load(Relaxed) {
        true => None,
        false => table::plain_only(CHILD_PLAIN_MAX),
    };
    let plan = plan.as_ref().map(|(p, l)| (&p[..], &l[..]));
    crate::real::offer_child_plan(plan, &memloop_shm::member_lock::held_fds());
}

/// The connections whose doorbell locks `fork_prepare` holds (the table's change lock is
/// still held, so the set is the one prepared).
fn release_bells() {
    table::conns().iter().for_each(|c| {
        c.release_bell_after_fork();
        c.release_fds_after_fork();
    });
}

pub fn fork_parent() {
    release_bells();
    crate::epoll::release_after_fork();
    table::release_after_fork();
    engine::release_after_fork();
    crate::plain::release_after_fork();
    crate::conn::handoff::release_after_fork();
    crate::conn::linger::release_after_fork();
    // The child holds every socket too: no late ring for any of them, in either process,
    // except a server's that the child was counted as a holder of.
    crate::late::after_fork_in_parent();
}

/// The fork child handler the shim put off: the child's copies of our lock fds are closed,
/// and `closed` are plain connections it closed meanwhile.
pub fn deferred_fork_child(closed: &[c_int]) {
    memloop_shm::member_lock::forget_closed_in_child();
    fork_child();
    closed.iter().for_each(|&fd| table::forget_closed(fd));
    tracing::debug!(
        closed = closed.len(),
        "fork child: the engine's child handler ran when first needed"
    );
}

pub fn fork_child() {
    crate::real::forget_pid();
    release_bells();
    crate::epoll::release_after_fork();
    table::release_after_fork();
    engine::release_after_fork();
    crate::plain::release_after_fork();
    crate::conn::handoff::release_after_fork();
    crate::conn::linger::release_after_fork();
    crate::conn::linger::forget_in_child();
    crate::late::after_fork_in_child();
    crate::conn::handoff::forget_in_child();
    crate::udp::forget_in_child();
    table::conns().iter().for_each(|c| {
        c.free_locks_in_child(); // first: forgetting the grab takes one of them
        c.forget_grab_in_child();
    });
    crate::plain::forget_resends_in_child();
    engine::reset_in_child();
    if !table::conns().is_empty() || crate::late::any_armed() {
        engine::child_needs_heartbeat();
    }
}
