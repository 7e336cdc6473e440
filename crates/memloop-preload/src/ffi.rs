//! The exported C functions that shadow the C library's. Each does the cheapest possible check
//! (`table::kind`) and passes calls on fds that are not ours straight to the real function.
//!
//! Variadic `fcntl`/`ioctl` are declared with one `unsigned long` argument: on the x86-64 and
//! AArch64 C ABIs a variadic integer or pointer argument travels exactly like a fixed one.
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]

use crate::dispatch::{self, Route};
use crate::real::{self, set_errno};
use crate::{pollsel, table};
use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use std::io::{IoSlice, IoSliceMut};
use std::time::Duration;

// ---- helpers ----------------------------------------------------------------------------------

fn ret_len(r: Result<usize, c_int>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

fn ret_int(r: Result<usize, c_int>) -> c_int {
    match r {
        Ok(n) => n as c_int,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// Runs the ring path; a panic becomes EIO instead of unwinding into C.
fn guarded(f: impl FnOnce() -> Result<usize, c_int>) -> Result<usize, c_int> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(Err(libc::EIO))
}

/// # Safety
/// `buf` must be valid for `len` bytes (or `len == 0`).
unsafe fn slice_mut<'a>(buf: *mut c_void, len: size_t) -> &'a mut [u8] {
    if len == 0 || buf.is_null() {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(buf.cast(), len)
    }
}

/// # Safety
/// `buf` must be valid for `len` bytes (or `len == 0`).
unsafe fn slice<'a>(buf: *const c_void, len: size_t) -> &'a [u8] {
    if len == 0 || buf.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(buf.cast(), len)
    }
}

/// # Safety
/// `iov` must point to `n` valid iovecs describing valid buffers.
unsafe fn iovecs_mut<'a>(iov: *const libc::iovec, n: c_int) -> Vec<IoSliceMut<'a>> {
    if iov.is_null() || n <= 0 {
        return Vec::new();
    }
    std::slice::from_raw_parts(iov, n as usize)
        .iter()
        .map(|v| IoSliceMut::new(slice_mut(v.iov_base, v.iov_len)))
        .collect()
}

/// # Safety
/// `iov` must point to `n` valid iovecs describing valid buffers.
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> Vec<IoSlice<'a>> {
    if iov.is_null() || n <= 0 {
        return Vec::new();
    }
    std::slice::from_raw_parts(iov, n as usize)
        .iter()
        .map(|v| IoSlice::new(slice(v.iov_base, v.iov_len)))
        .collect()
}

fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// # Safety
/// `ts` must be null or valid.
unsafe fn ts_timeout(ts: *const libc::timespec) -> Option<Duration> {
    if ts.is_null() {
        return None;
    }
    let t = &*ts;
    Some(Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    ))
}

// ---- socket lifecycle -------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    let fd = real::socket()(domain, ty, proto);
    dispatch::on_socket(fd, domain, ty, proto);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if table::kind(fd) == table::K_NONE {
        return real::connect()(fd, addr, len);
    }
    let found = dispatch::before_connect(fd, real::decode_sockaddr(addr, len));
    let r = real::connect()(fd, addr, len);
    let err = real::errno();
    if let Some(c) = found {
        if r == 0 || err == libc::EINPROGRESS {
            dispatch::after_connect(fd, c);
        } else {
            drop(c);
        }
        set_errno(err);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let r = real::listen()(fd, backlog);
    if r == 0 && table::kind(fd) != table::K_NONE {
        let err = real::errno();
        dispatch::after_listen(fd);
        set_errno(err);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    dispatch::before_accept(fd);
    let nfd = real::accept()(fd, addr, len);
    if nfd >= 0 && table::kind(fd) == table::K_OBJ {
        dispatch::after_accept(fd, nfd);
    }
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    dispatch::before_accept(fd);
    let nfd = real::accept4()(fd, addr, len, flags);
    if nfd >= 0 && table::kind(fd) == table::K_OBJ {
        dispatch::after_accept(fd, nfd);
    }
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if table::kind(fd) != table::K_NONE {
        dispatch::before_close(fd);
    }
    real::close()(fd)
}

/// `close_range` and `closefrom` close many fds at once: ours among them get the bookkeeping
/// of `close` first (a stale entry would later act on a reused fd number).
fn before_close_many(first: c_int, last: c_int) {
    for fd in table::tracked_in(first, last) {
        dispatch::before_close(fd);
    }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    let (lo, hi) = (
        first.min(c_int::MAX as u32) as c_int,
        last.min(c_int::MAX as u32) as c_int,
    );
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 && lo <= hi {
        before_close_many(lo, hi);
    }
    real::close_range()(first, last, flags)
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(first: c_int) {
    before_close_many(first.max(0), c_int::MAX);
    real::closefrom()(first)
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    match dispatch::route(fd) {
        Route::Ring(c) => {
            let r = ret_int(guarded(|| c.shutdown(how).map(|_| 0)));
            dispatch::poke(&c);
            r
        }
        _ => real::shutdown()(fd, how),
    }
}

// ---- receive ------------------------------------------------------------------------------

fn ring_recv(c: &crate::conn::Conn, bufs: &mut [IoSliceMut<'_>], flags: c_int) -> ssize_t {
    ret_len(guarded(|| c.recv(bufs, flags)))
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::read()(fd, buf, count),
        Route::Ring(c) => ring_recv(&c, &mut [IoSliceMut::new(slice_mut(buf, count))], 0),
        Route::Counted(p) => {
            let r = real::read()(fd, buf, count);
            p.count_received(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    count: size_t,
    _buflen: size_t,
) -> ssize_t {
    read(fd, buf, count)
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::recv()(fd, buf, len, flags),
        Route::Ring(c) => ring_recv(&c, &mut [IoSliceMut::new(slice_mut(buf, len))], flags),
        Route::Counted(p) => {
            let r = real::recv()(fd, buf, len, flags);
            if flags & libc::MSG_PEEK == 0 {
                p.count_received(r);
            }
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    _buflen: size_t,
    flags: c_int,
) -> ssize_t {
    recv(fd, buf, len, flags)
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::recvfrom()(fd, buf, len, flags, addr, alen),
        Route::Ring(c) => {
            if !alen.is_null() {
                *alen = 0; // as TCP: no source address for a connected stream
            }
            ring_recv(&c, &mut [IoSliceMut::new(slice_mut(buf, len))], flags)
        }
        Route::Counted(p) => {
            let r = real::recvfrom()(fd, buf, len, flags, addr, alen);
            if flags & libc::MSG_PEEK == 0 {
                p.count_received(r);
            }
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    _buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    recvfrom(fd, buf, len, flags, addr, alen)
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::readv()(fd, iov, n),
        Route::Ring(c) => ring_recv(&c, &mut iovecs_mut(iov, n), 0),
        Route::Counted(p) => {
            let r = real::readv()(fd, iov, n);
            p.count_received(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::recvmsg()(fd, msg, flags),
        Route::Ring(c) => {
            if msg.is_null() {
                set_errno(libc::EFAULT);
                return -1;
            }
            let m = &mut *msg;
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            ring_recv(&c, &mut iovecs_mut(m.msg_iov, m.msg_iovlen as c_int), flags)
        }
        Route::Counted(p) => {
            let r = real::recvmsg()(fd, msg, flags);
            if flags & libc::MSG_PEEK == 0 {
                p.count_received(r);
            }
            r
        }
    }
}

// ---- send -------------------------------------------------------------------------------------

fn ring_send(c: &crate::conn::Conn, bufs: &[IoSlice<'_>], flags: c_int) -> ssize_t {
    ret_len(guarded(|| c.send(bufs, flags)))
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::write()(fd, buf, count),
        Route::Ring(c) => ring_send(&c, &[IoSlice::new(slice(buf, count))], 0),
        Route::Counted(p) => {
            let r = real::write()(fd, buf, count);
            p.count_sent(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::send()(fd, buf, len, flags),
        Route::Ring(c) => ring_send(&c, &[IoSlice::new(slice(buf, len))], flags),
        Route::Counted(p) => {
            let r = real::send()(fd, buf, len, flags);
            p.count_sent(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::sendto()(fd, buf, len, flags, addr, alen),
        Route::Ring(c) => ring_send(&c, &[IoSlice::new(slice(buf, len))], flags),
        Route::Counted(p) => {
            let r = real::sendto()(fd, buf, len, flags, addr, alen);
            p.count_sent(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::writev()(fd, iov, n),
        Route::Ring(c) => ring_send(&c, &iovecs(iov, n), 0),
        Route::Counted(p) => {
            let r = real::writev()(fd, iov, n);
            p.count_sent(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    match dispatch::route(fd) {
        Route::Real => real::sendmsg()(fd, msg, flags),
        Route::Ring(c) => {
            if msg.is_null() {
                set_errno(libc::EFAULT);
                return -1;
            }
            let m = &*msg;
            ring_send(&c, &iovecs(m.msg_iov, m.msg_iovlen as c_int), flags)
        }
        Route::Counted(p) => {
            let r = real::sendmsg()(fd, msg, flags);
            p.count_sent(r);
            r
        }
    }
}

/// sendfile onto a ring: read the file at an explicit offset and send; the file position (or
/// `*offset`) advances by what was actually sent.
unsafe fn ring_sendfile(
    c: &crate::conn::Conn,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    let mut pos = if offset.is_null() {
        libc::lseek64(in_fd, 0, libc::SEEK_CUR)
    } else {
        *offset
    };
    if pos < 0 {
        return -1;
    }
    let mut buf = vec![0u8; count.min(256 * 1024)];
    let mut total = 0usize;
    let mut result = Ok(0);
    while total < count {
        let want = (count - total).min(buf.len());
        let n = libc::pread64(in_fd, buf.as_mut_ptr().cast(), want, pos);
        if n <= 0 {
            if n < 0 && total == 0 {
                result = Err(real::errno());
            }
            break;
        }
        match guarded(|| c.send(&[IoSlice::new(&buf[..n as usize])], 0)) {
            Ok(s) => {
                total += s;
                pos += s as i64;
                if s < n as usize {
                    break;
                }
            }
            Err(e) => {
                if total == 0 {
                    result = Err(e);
                }
                break;
            }
        }
    }
    if offset.is_null() {
        libc::lseek64(in_fd, pos, libc::SEEK_SET);
    } else {
        *offset = pos;
    }
    ret_len(result.map(|_: usize| total))
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    match dispatch::route(out_fd) {
        Route::Ring(c) => ring_sendfile(&c, in_fd, offset.cast(), count),
        Route::Real => real::sendfile()(out_fd, in_fd, offset, count),
        Route::Counted(p) => {
            let r = real::sendfile()(out_fd, in_fd, offset, count);
            p.count_sent(r);
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    match dispatch::route(out_fd) {
        Route::Ring(c) => ring_sendfile(&c, in_fd, offset, count),
        Route::Real => real::sendfile64()(out_fd, in_fd, offset, count),
        Route::Counted(p) => {
            let r = real::sendfile64()(out_fd, in_fd, offset, count);
            p.count_sent(r);
            r
        }
    }
}

// ---- readiness --------------------------------------------------------------------------------

/// Whether `fd` is a ring connection (or undecided) or an epoll set (whose ring members poll
/// and select must see).
fn watched(fd: c_int) -> bool {
    table::kind(fd) == table::K_OBJ
        && match table::get(fd).as_deref() {
            Some(table::Entry::Conn(c)) => c.path() != crate::conn::TCP,
            Some(table::Entry::Epoll(_)) => true,
            _ => false,
        }
}

unsafe fn any_ring(fds: *const libc::pollfd, n: libc::nfds_t) -> bool {
    if fds.is_null() {
        return false;
    }
    std::slice::from_raw_parts(fds, n as usize)
        .iter()
        .any(|p| watched(p.fd))
}

unsafe fn emulated_poll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> c_int {
    let set = std::slice::from_raw_parts_mut(fds, n as usize);
    ret_int(guarded(|| pollsel::poll(set, timeout, mask)))
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    if !any_ring(fds, n) {
        return real::poll()(fds, n, timeout);
    }
    emulated_poll(fds, n, ms_timeout(timeout), std::ptr::null())
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    _len: size_t,
) -> c_int {
    poll(fds, n, timeout)
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if !any_ring(fds, n) {
        return real::ppoll()(fds, n, ts, mask);
    }
    emulated_poll(fds, n, ts_timeout(ts), mask)
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
    _len: size_t,
) -> c_int {
    ppoll(fds, n, ts, mask)
}

/// The fd sets as a pollfd list, if any fd in them is a ring connection.
unsafe fn select_to_poll(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
) -> Option<Vec<libc::pollfd>> {
    let mut list = Vec::new();
    let mut ours = false;
    for fd in 0..nfds.clamp(0, libc::FD_SETSIZE as c_int) {
        let mut events = 0;
        if !r.is_null() && libc::FD_ISSET(fd, r) {
            events |= libc::POLLIN;
        }
        if !w.is_null() && libc::FD_ISSET(fd, w) {
            events |= libc::POLLOUT;
        }
        if !e.is_null() && libc::FD_ISSET(fd, e) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            ours |= watched(fd);
            list.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    ours.then_some(list)
}

unsafe fn poll_to_select(
    list: &[libc::pollfd],
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
) -> c_int {
    for s in [r, w, e] {
        if !s.is_null() {
            libc::FD_ZERO(s);
        }
    }
    let mut count = 0;
    for p in list {
        let rd = libc::POLLIN | libc::POLLHUP | libc::POLLERR;
        let wr = libc::POLLOUT | libc::POLLERR;
        for (set, mask, asked) in [
            (r, rd, libc::POLLIN),
            (w, wr, libc::POLLOUT),
            (e, libc::POLLPRI, libc::POLLPRI),
        ] {
            if !set.is_null() && p.events & asked != 0 && p.revents & mask != 0 {
                libc::FD_SET(p.fd, set);
                count += 1;
            }
        }
    }
    count
}

unsafe fn emulated_select(
    list: &mut [libc::pollfd],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
    sets: (*mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set),
) -> c_int {
    match guarded(|| pollsel::poll(list, timeout, mask)) {
        Ok(_) => poll_to_select(list, sets.0, sets.1, sets.2),
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let Some(mut list) = select_to_poll(nfds, r, w, e) else {
        return real::select()(nfds, r, w, e, tv);
    };
    let timeout = (!tv.is_null()).then(|| {
        let t = &*tv;
        Duration::new(
            t.tv_sec.max(0) as u64,
            (t.tv_usec.clamp(0, 999_999) as u32) * 1000,
        )
    });
    let start = std::time::Instant::now();
    let n = emulated_select(&mut list, timeout, std::ptr::null(), (r, w, e));
    if let (Some(t), false) = (timeout, tv.is_null()) {
        // Linux reports the time left.
        let left = t.saturating_sub(start.elapsed());
        (*tv).tv_sec = left.as_secs() as libc::time_t;
        (*tv).tv_usec = left.subsec_micros() as libc::suseconds_t;
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some(mut list) = select_to_poll(nfds, r, w, e) else {
        return real::pselect()(nfds, r, w, e, ts, mask);
    };
    emulated_select(&mut list, ts_timeout(ts), mask, (r, w, e))
}

// ---- epoll ------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    if table::kind(fd) == table::K_NONE {
        return real::epoll_ctl()(epfd, op, fd, ev);
    }
    let want = (!ev.is_null()).then(|| ((*ev).events, (*ev).u64));
    if let Some(r) = dispatch::epoll_ctl(epfd, op, fd, want) {
        return ret_int(r.map(|_| 0));
    }
    let r = real::epoll_ctl()(epfd, op, fd, ev);
    if r == 0 {
        dispatch::note_fresh_epoll(epfd, op, fd, want);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    let fd = real::epoll_create()(size);
    dispatch::after_epoll_create(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    let fd = real::epoll_create1()(flags);
    dispatch::after_epoll_create(fd);
    fd
}

unsafe fn emulated_epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
    precise: bool,
) -> Option<c_int> {
    if table::kind(epfd) != table::K_OBJ || events.is_null() || max <= 0 {
        return None;
    }
    let set = dispatch::epoll_of(epfd)?;
    let out = std::slice::from_raw_parts_mut(events, max as usize);
    Some(ret_int(guarded(|| {
        set.wait(epfd, out, timeout, mask, precise)
    })))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    emulated_epoll_wait(
        epfd,
        events,
        max,
        ms_timeout(timeout),
        std::ptr::null(),
        false,
    )
    .unwrap_or_else(|| real::epoll_wait()(epfd, events, max, timeout))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    emulated_epoll_wait(epfd, events, max, ms_timeout(timeout), mask, false)
        .unwrap_or_else(|| real::epoll_pwait()(epfd, events, max, timeout, mask))
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    emulated_epoll_wait(epfd, events, max, ts_timeout(ts), mask, true)
        .unwrap_or_else(|| real::epoll_pwait2()(epfd, events, max, ts, mask))
}

// ---- fd control -------------------------------------------------------------------------------

unsafe fn fcntl_common(
    real_fn: unsafe extern "C" fn(c_int, c_int, libc::c_ulong) -> c_int,
    fd: c_int,
    cmd: c_int,
    arg: libc::c_ulong,
) -> c_int {
    let r = real_fn(fd, cmd, arg);
    if r >= 0 && table::kind(fd) != table::K_NONE {
        match cmd {
            libc::F_SETFL => dispatch::set_nonblock(fd, arg as c_int & libc::O_NONBLOCK != 0),
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => dispatch::after_dup(fd, r),
            _ => {}
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    fcntl_common(real::fcntl(), fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    fcntl_common(real::fcntl64(), fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: libc::c_ulong) -> c_int {
    // Only the queue sizes depend on the ring (and so on the connection's decision); anything
    // else (FIONBIO right after connect, say) must not wait for the server to accept.
    let queue = req == libc::FIONREAD || req == libc::TIOCOUTQ;
    if queue && arg != 0 && table::kind(fd) == table::K_OBJ {
        if let Route::Ring(c) = dispatch::route(fd) {
            // FIONREAD = SIOCINQ; TIOCOUTQ = SIOCOUTQ: bytes we sent that the peer has not read.
            let v = match req {
                libc::FIONREAD => c.readable_bytes(),
                _ => c.unread_by_peer(),
            };
            *(arg as *mut c_int) = v.min(c_int::MAX as usize) as c_int;
            return 0;
        }
    }
    let r = real::ioctl()(fd, req, arg);
    if r == 0 && req == libc::FIONBIO && arg != 0 && table::kind(fd) == table::K_OBJ {
        dispatch::set_nonblock(fd, *(arg as *const c_int) != 0);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let nodelay = level == libc::IPPROTO_TCP && opt == libc::TCP_NODELAY;
    if nodelay && table::kind(fd) == table::K_OBJ && !val.is_null() && len as usize >= 4 {
        if let Some(c) = table::conn(fd).filter(|c| c.path() != crate::conn::TCP) {
            // Remembered for getsockopt (and restored if the connection ends up on TCP); the
            // kernel socket keeps it on for the doorbells.
            c.set_app_nodelay((*(val as *const c_int) != 0) as c_int);
            return 0;
        }
    }
    let r = real::setsockopt()(fd, level, opt, val, len);
    let timeo = opt == libc::SO_RCVTIMEO || opt == libc::SO_SNDTIMEO;
    if r == 0 && level == libc::SOL_SOCKET && timeo && table::kind(fd) == table::K_OBJ {
        if let Some(c) = table::conn(fd) {
            c.refresh_timeout(fd, opt);
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let nodelay = level == libc::IPPROTO_TCP && opt == libc::TCP_NODELAY;
    if nodelay && table::kind(fd) == table::K_OBJ && !val.is_null() && !len.is_null() && *len >= 4 {
        if let Some(c) = table::conn(fd).filter(|c| c.path() != crate::conn::TCP) {
            *(val as *mut c_int) = c.app_nodelay();
            *len = 4;
            return 0;
        }
    }
    real::getsockopt()(fd, level, opt, val, len)
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let r = real::dup()(fd);
    if r >= 0 && table::kind(fd) != table::K_NONE {
        dispatch::after_dup(fd, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old != new && table::kind(new) != table::K_NONE && real::status_flags(old) >= 0 {
        dispatch::before_close(new);
    }
    let r = real::dup2()(old, new);
    if r >= 0 && old != new && table::kind(old) != table::K_NONE {
        dispatch::after_dup(old, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if old != new && table::kind(new) != table::K_NONE && real::status_flags(old) >= 0 {
        dispatch::before_close(new);
    }
    let r = real::dup3()(old, new, flags);
    if r >= 0 && table::kind(old) != table::K_NONE {
        dispatch::after_dup(old, r);
    }
    r
}

/// `vfork` becomes `fork`: a vforked child shares our memory and skips the fork handlers, so
/// ring connections it inherits (and keeps across exec) would not be counted as held by it.
/// A full fork is a valid implementation of vfork.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    libc::fork()
}

/// splice with a ring connection on one side: the pipe or file side is read or written
/// for real, the connection side through the ring; never more than fits on the other side,
/// so no byte is taken that cannot be delivered.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
    match (dispatch::route(fd_in), dispatch::route(fd_out)) {
        (_, Route::Ring(c)) => ret_len(guarded(|| {
            let room = c.wait_room(len.min(1 << 20), nonblock)?;
            let mut buf = vec![0u8; room];
            let n = if off_in.is_null() {
                real::read()(fd_in, buf.as_mut_ptr().cast(), room)
            } else {
                let n = libc::pread64(fd_in, buf.as_mut_ptr().cast(), room, *off_in);
                if n > 0 {
                    *off_in += n as i64;
                }
                n
            };
            if n < 0 {
                return Err(real::errno());
            }
            c.send(&[IoSlice::new(&buf[..n as usize])], libc::MSG_NOSIGNAL)
        })),
        (Route::Ring(c), _) => ret_len(guarded(|| {
            let room = real::pipe_room(fd_out).unwrap_or(65536).min(len).max(1);
            let mut buf = vec![0u8; room];
            let f = if nonblock { libc::MSG_DONTWAIT } else { 0 };
            let n = c.recv(&mut [IoSliceMut::new(&mut buf)], f)?;
            let w = if off_out.is_null() {
                real::write()(fd_out, buf.as_ptr().cast(), n)
            } else {
                let w = libc::pwrite64(fd_out, buf.as_ptr().cast(), n, *off_out);
                if w > 0 {
                    *off_out += w as i64;
                }
                w
            };
            if w < 0 {
                return Err(real::errno());
            }
            Ok(w as usize)
        })),
        _ => real::splice()(fd_in, off_in, fd_out, off_out, len, flags),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
) -> c_int {
    let Route::Ring(_) = dispatch::route(fd) else {
        return real::sendmmsg()(fd, msgs, n, flags);
    };
    let mut done = 0;
    for i in 0..n as usize {
        let m = &mut *msgs.add(i);
        let r = sendmsg(fd, &m.msg_hdr, flags);
        if r < 0 {
            return if done > 0 { done } else { -1 };
        }
        m.msg_len = r as libc::c_uint;
        done += 1;
    }
    done
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    let Route::Ring(_) = dispatch::route(fd) else {
        return real::recvmmsg()(fd, msgs, n, flags, timeout);
    };
    let mut done = 0;
    let mut f = flags & !libc::MSG_WAITFORONE;
    for i in 0..n as usize {
        let m = &mut *msgs.add(i);
        let r = recvmsg(fd, &mut m.msg_hdr, f);
        if r <= 0 {
            return if done > 0 {
                done
            } else if r == 0 {
                0
            } else {
                -1
            };
        }
        m.msg_len = r as libc::c_uint;
        done += 1;
        if flags & libc::MSG_WAITFORONE != 0 {
            f |= libc::MSG_DONTWAIT;
        }
    }
    done
}

// ---- exec -------------------------------------------------------------------------------------
// (`execl*` build their vector and call the C library's internal execve, out of our reach.)

type Argv = *const *const libc::c_char;

fn exec_with(f: impl FnOnce() -> c_int) -> c_int {
    dispatch::before_exec();
    let r = f();
    let e = real::errno();
    dispatch::after_failed_exec();
    real::set_errno(e);
    r
}

#[no_mangle]
pub unsafe extern "C" fn execve(path: *const libc::c_char, argv: Argv, envp: Argv) -> c_int {
    exec_with(|| real::execve()(path, argv, envp))
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const libc::c_char, argv: Argv) -> c_int {
    exec_with(|| real::execv()(path, argv))
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const libc::c_char, argv: Argv) -> c_int {
    exec_with(|| real::execvp()(file, argv))
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const libc::c_char, argv: Argv, envp: Argv) -> c_int {
    exec_with(|| real::execvpe()(file, argv, envp))
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int {
    exec_with(|| real::fexecve()(fd, argv, envp))
}

// ---- raw system calls ---------------------------------------------------------------------------

/// The C library's `syscall`: everything passes through, but `io_uring_setup` is noted (a
/// process with io_uring may wait on or read sockets where memloop cannot see it). `syscall`
/// is variadic; on these targets variadic integer arguments travel exactly like fixed ones,
/// so the six possible arguments are taken and handed on as they came.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: libc::c_long,
    a: libc::c_long,
    b: libc::c_long,
    c: libc::c_long,
    d: libc::c_long,
    e: libc::c_long,
    f: libc::c_long,
) -> libc::c_long {
    if n == libc::SYS_io_uring_setup {
        dispatch::note_io_uring();
    }
    real::syscall()(n, a, b, c, d, e, f)
}

// ---- start-up ---------------------------------------------------------------------------------

extern "C" fn at_fork_prepare() {
    dispatch::fork_prepare();
}
extern "C" fn at_fork_parent() {
    dispatch::fork_parent();
}
extern "C" fn at_fork_child() {
    dispatch::fork_child();
}

extern "C" fn on_load() {
    crate::init_logging();
    crate::engine::capture_settings();
    // SAFETY: registering three plain functions; they only touch our own state.
    unsafe {
        libc::pthread_atfork(
            Some(at_fork_prepare),
            Some(at_fork_parent),
            Some(at_fork_child),
        )
    };
    crate::inherit::adopt_inherited();
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;
